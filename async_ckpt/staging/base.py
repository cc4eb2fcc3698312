"""The staging loop shared by the eager and the lazy stager.

:meth:`BaseStager.stage` plans the state dict (unless given a plan), splits its tensors by
device type, hands the XLA ones and the CPU/CUDA ones to the subclass, and builds the
:class:`~.snapshot.HostSnapshot` from the host tensors they filled in. Buffers taken for a
stage that fails go back to the pool; a failure caused by a tensor that cannot be staged is
reported as :class:`~async_ckpt.errors.InvalidStateDictError` naming it.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Set, Tuple

import torch

from ..errors import InvalidStateDictError
from ..gc_pause import gc_paused
from .buffer_layout import SMALL_TENSOR_BYTES, snapshot_nbytes
from .plan import DROPPED, PlanMemo, StagingPlan, make_plan
from .pool import HostBufferPool, Lease
from .snapshot import HostSnapshot
from .xla import XlaStaging


class StagingJob:
    """What one stage fills in: a host tensor per plan tensor, the leases holding them, and
    what the snapshot reports about its sources."""

    __slots__ = ("host", "leases", "sources", "xla_shards", "xla_spmd", "deferred")

    def __init__(self, plan: StagingPlan) -> None:
        self.host: List[Optional[torch.Tensor]] = [None] * len(plan.tensors)
        self.leases: List[Lease] = []
        #: zero-copy views of XLA device buffers the copies read (see ``HostSnapshot.sources``)
        self.sources: Optional[List[torch.Tensor]] = None
        self.xla_shards = False
        self.xla_spmd = False
        #: transfers left to another thread (SPMD: from references to immutable device data)
        self.deferred: List[Callable[[], None]] = []


class BaseStager:
    """One host buffer pool and plan memo; subclasses copy the tensors (see the module docstring).

    Args:
        pool: the host buffer pool (default: a new unbounded one).
        plans: the plan memo (default: a new one).
        xla: the XLA staging state (default: made on first use).
    """

    def __init__(self, pool: Optional[HostBufferPool] = None, plans: Optional[PlanMemo] = None,
                 xla: Optional[XlaStaging] = None) -> None:
        self.pool = pool if pool is not None else HostBufferPool()
        self.plans = plans if plans is not None else PlanMemo()
        self._xla = xla

    @property
    def xla(self) -> XlaStaging:
        """This stager's XLA state (made on first use: it imports torch_xla)."""
        if self._xla is None:
            self._xla = XlaStaging(SMALL_TENSOR_BYTES)
        return self._xla

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
        return make_plan(state_dict, self.plans)

    def stage(self, state_dict: Any, plan: Optional[StagingPlan] = None,
              keep: Optional[Set[int]] = None, drop: Optional[Set[int]] = None) -> HostSnapshot:
        """Host copies of ``state_dict`` (the garbage collector paused meanwhile).

        Args:
            state_dict: the state dict to copy.
            plan: its plan (default: planned here with this stager's memo).
            keep: plan indices of tensors not to copy: the snapshot holds the tensor itself
                (declared-frozen tensors, see :mod:`.frozen`).
            drop: plan indices of tensors another rank stages: left out of the snapshot (never
                inside a list or tuple).

        Returns:
            The snapshot, holding pooled buffers until released.

        Raises:
            InvalidStateDictError: the state dict cannot be planned, or a tensor cannot be
                staged (quantized, nested, meta, a dtype without a copy kernel; named in the
                message: only once staging failed are the tensors checked one by one).
            StagingBudgetError: the snapshot needs more host memory than the pool's budget.
        """
        with gc_paused():  # a full collection inside the stall would cost more than the copies
            plan = plan if plan is not None else self.plan(state_dict)
            try:
                return self._stage(plan, keep, drop)
            except Exception as exc:
                if not isinstance(exc, InvalidStateDictError):
                    try:
                        plan.check_tensors()
                    except InvalidStateDictError as bad:  # a tensor of the state dict is the cause
                        raise bad from exc
                raise

    def synchronize_staging(self) -> None:
        """Wait until every snapshot staged so far has its host copies (nothing to wait for here)."""

    def _stage(self, plan: StagingPlan, keep: Optional[Set[int]] = None,
               drop: Optional[Set[int]] = None) -> HostSnapshot:
        job = self._new_job(plan)
        by_type = plan.by_device_type()
        if keep or drop:
            for i in keep or ():
                job.host[i] = plan.tensors[i]
            for i in drop or ():
                job.host[i] = DROPPED
            skip = (keep or set()) | (drop or set())
            by_type = {kind: rest for kind, items in by_type.items()
                       if (rest := [it for it in items if it[0] not in skip])}
        try:
            if "xla" in by_type:
                self._stage_xla(by_type.pop("xla"), job)
            cuda = "cuda" in by_type
            local = [it for kind in ("cpu", "cuda") for it in by_type.pop(kind, [])]
            if by_type:
                kinds = ", ".join(sorted(by_type))
                raise NotImplementedError(f"staging tensors on device type(s) {kinds} is not supported")
            if local:
                self._stage_local(local, job, cuda)
        except BaseException:
            for lease in job.leases:
                lease.release()
            raise
        host = job.host
        snap = HostSnapshot(
            state_dict=plan.build(host, dropping=bool(drop)),  # type: ignore[arg-type]
            nbytes=snapshot_nbytes([t for t in host if t is not DROPPED] if drop else host, plan),
            num_tensors=len(plan.tensors),
            int_keys=plan.int_keys,
            leases=job.leases,
            sources=job.sources,
            xla_shards=job.xla_shards,
            xla_spmd=job.xla_spmd,
        )
        self._finish(snap, job)
        return snap

    # ---- what a subclass provides ----------------------------------------------------------

    def _new_job(self, plan: StagingPlan) -> StagingJob:
        return StagingJob(plan)

    def _stage_xla(self, items: List[Tuple[int, torch.Tensor]], job: StagingJob) -> None:
        raise NotImplementedError

    def _stage_local(self, items: List[Tuple[int, torch.Tensor]], job: StagingJob, cuda: bool) -> None:
        """``cuda=False``: none of ``items`` is on CUDA."""
        raise NotImplementedError

    def _finish(self, snap: HostSnapshot, job: StagingJob) -> None:
        """Called with the snapshot once every tensor has its host tensor."""
