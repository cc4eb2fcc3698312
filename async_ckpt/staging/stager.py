"""``Stager``: one manager's eager and lazy stager over one host buffer pool.

``stager.eager`` (:class:`~.eager.EagerStager`) and ``stager.lazy`` (:class:`~.lazy.LazyStager`)
implement :class:`~.protocol.SnapshotStager`; they share the pool, the plan memo, the CUDA side
streams and the XLA state. ``stager.stage(state_dict, plan, lazy=...)`` picks one of them.
"""

from __future__ import annotations

from typing import Any, Optional, Set

from .eager import EagerStager
from .lazy import LazyStager
from .plan import StagingPlan
from .pool import HostBufferPool
from .snapshot import HostSnapshot
from .xla import XlaGather


class Stager:
    """Makes :class:`HostSnapshot` objects from state dicts using one :class:`HostBufferPool`.

    Args:
        pool: the host buffer pool of both stagers (default: a new unbounded one).
    """

    def __init__(self, pool: Optional[HostBufferPool] = None) -> None:
        self.eager = EagerStager(pool)
        self.lazy = LazyStager(self.eager)
        self.pool = self.eager.pool

    def plan(self, state_dict: Any) -> StagingPlan:
        """:func:`~.plan.make_plan` with this stager's memo.

        The same plan, found faster when the structure is the one saved last time.

        Args:
            state_dict: the state dict.

        Returns:
            Its plan.

        Raises:
            InvalidStateDictError: as :func:`~.plan.make_plan`.
        """
        return self.eager.plan(state_dict)

    def stage(self, state_dict: Any, plan: Optional[StagingPlan] = None, *, lazy: bool = False,
              keep: Optional[Set[int]] = None, drop: Optional[Set[int]] = None) -> HostSnapshot:
        """Host copies of ``state_dict``.

        Args:
            state_dict: the state dict to copy.
            plan: its plan (default: planned here).
            lazy: return once the copies of device tensors are issued (CPU tensors are copied
                now, see :mod:`.lazy`): ``snapshot.pending`` tracks them and the guard of
                :mod:`.guard` protects the sources until they are done.
            keep: plan indices of tensors not to copy (the snapshot holds them as they are).
            drop: plan indices of tensors another rank stages (left out of the snapshot).

        Returns:
            The snapshot, holding pooled buffers until released.

        Raises:
            InvalidStateDictError: the state dict cannot be planned, or a tensor cannot be staged.
            StagingBudgetError: the snapshot needs more host memory than the pool's budget.
        """
        return (self.lazy if lazy else self.eager).stage(state_dict, plan, keep, drop)

    def synchronize_staging(self) -> None:
        """Wait until every snapshot of this stager has all its host copies."""
        self.lazy.synchronize_staging()

    @property
    def xla_gather(self) -> XlaGather:
        """Stages small XLA tensors by buffer address (eager and lazy stages alike)."""
        return self.eager.xla.gather
