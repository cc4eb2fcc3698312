"""``CheckpointManager``, the façade (:mod:`.core`), built from its roots
(:class:`~async_ckpt.jobs.roots.Root`), its save schedule (:mod:`.schedule`: pure), the
two-tier parts (:mod:`async_ckpt.jobs.roots`: merged listing, copy order; :mod:`async_ckpt.jobs.promote`) and its
process-level hooks (:mod:`.hooks`)."""

from .core import CheckpointManager

__all__ = ["CheckpointManager"]
