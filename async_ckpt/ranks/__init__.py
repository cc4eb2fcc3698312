"""Ranks: how they exchange (:mod:`.exchange`), the one rank protocol (:mod:`.phase`), replicated
state (:mod:`.replicas`: who stages, writes and reads what several ranks hold), who holds whose
local copies (:mod:`.topology`) and step copies sent between ranks (:mod:`.peer_transfer`)."""
