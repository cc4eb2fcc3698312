"""``CheckpointManager``, the façade (:mod:`.core`), built from its roots
(:class:`~async_ckpt.jobs.roots.Root`), its save schedule (:mod:`.schedule`: pure), the
two-tier parts (:mod:`.tiered`: merged listing, copy order, foreign copies, promote) and its
process-level hooks (:mod:`.hooks`)."""

from .core import CheckpointManager

__all__ = ["CheckpointManager"]
