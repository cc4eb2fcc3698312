"""``CheckpointManager``, the façade (:mod:`.core`), its listing over tiers (:mod:`.listing`) and
its process-level hooks (:mod:`.hooks`)."""

from .core import CheckpointManager

__all__ = ["CheckpointManager"]
