"""``CheckpointManager``, the façade (:mod:`.core`), its save decisions (:mod:`.decisions`), its
listing over tiers (:mod:`.listing`), its explicit actions on committed steps (:mod:`.actions`:
delete, promote) and its process-level hooks (:mod:`.hooks`)."""

from .core import CheckpointManager

__all__ = ["CheckpointManager"]
