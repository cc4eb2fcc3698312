"""Staging: state dict -> host snapshot (the only part of a save that blocks training).

Knows tensors and devices, not paths or process groups. :class:`Stager` holds one manager's
:class:`EagerStager` and :class:`LazyStager` (both :class:`SnapshotStager`) over one
:class:`HostBufferPool`.
"""

from .eager import EagerStager
from .lazy import LazyStager
from .plan import StagingPlan, make_plan
from .pool import HostBufferPool, Lease
from .protocol import SnapshotStager
from .snapshot import HostSnapshot
from .stager import Stager

__all__ = ["EagerStager", "HostBufferPool", "HostSnapshot", "LazyStager", "Lease", "SnapshotStager", "Stager",
           "StagingPlan", "make_plan"]
