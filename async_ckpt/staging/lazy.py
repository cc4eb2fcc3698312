"""The lazy stager: issue the host copies, return at once, wait only before a mutation.

Parameters and optimizer state do not change during forward and backward, so the copy to host
can run while they do; training only has to wait right before something writes the tensors.
:meth:`LazyStager.stage` returns a :class:`~.snapshot.HostSnapshot` whose copies are still in
flight and whose ``pending`` field is a :class:`~.lazy_copies.PendingCopies`; the hooks of
:mod:`.guard` and the version and storage checks of :mod:`.lazy_copies` keep the sources safe
until the copies are done (see there).

What is copied when
    CPU: every tensor is copied before ``stage`` returns, as the eager stager copies it: on a
    CPU host a copy in the background takes the same cores and memory bandwidth as the
    training loop it would overlap, and the guard's waits come on top, so deferring it saves
    the loop nothing (a lazy save of CPU tensors cost a CPU-bound loop more than an eager
    one). Inside :func:`cpu_lazily` (``async_ckpt.testing.lazy_cpu_copies``: the tests of
    the lazy machinery on CPU-only machines) they are staged lazily instead: small tensors
    (the slab's) copied before ``stage`` returns, the others on the background thread, one
    batched copy per chunk of about :data:`CHUNK_BYTES`, in the order the guard needed them
    last time (:class:`~.lazy_copies.NeedOrder`, one per lazy stager).
    CUDA: ``non_blocking`` copies on a side stream, one event per chunk; waiting for a chunk
    makes the *current stream* wait on its event (no host stall).
    XLA (PJRT CPU): small tensors are copied by buffer address, as the eager stager does; of
    the others, zero-copy views of their (immutable) device buffers are taken now and their
    bytes are copied in the background like CPU tensors. XLA tensors without host views (TPU,
    GPU, a tensor without a PJRT buffer of its own) and every XLA tensor in SPMD mode are
    staged at once, as the eager stager stages them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, List, Optional, Tuple

import torch

from . import guard
from .base import BaseStager, StagingJob
from .buffer_layout import SMALL_TENSOR_BYTES, lay_out, unique
from .cpu import copy_cpu
from .eager import EagerStager
from .lazy_copies import NeedOrder, PendingCopies, build_chunks, deferred_chunks, start
from .plan import StagingPlan
from .snapshot import HostSnapshot
from .xla import XlaStaging, stage_batched, with_buffers, xla_host_views

__all__ = ["CHUNK_BYTES", "LazyStager", "PendingCopies", "cpu_lazily"]

CHUNK_BYTES = 8 * 2**20  # copies are grouped into batches of about this size (one wait unit)

_cpu_lazily = 0  # open cpu_lazily() contexts
_cpu_lock = threading.Lock()


@contextlib.contextmanager
def cpu_lazily() -> Iterator[None]:
    """Within it, lazy stages copy CPU tensors in the background too, as they copy CUDA and XLA
    tensors, instead of before ``stage`` returns (see the module docstring). Process-wide,
    nestable; for tests of the lazy machinery on CPU-only machines."""
    global _cpu_lazily
    with _cpu_lock:
        _cpu_lazily += 1
    try:
        yield
    finally:
        with _cpu_lock:
            _cpu_lazily -= 1

_Items = List[Tuple[int, torch.Tensor]]
_Pair = Tuple[torch.Tensor, torch.Tensor, List[Tuple[str, torch.Tensor]], bool]


class _LazyJob(StagingJob):
    """A stage whose copies are collected as ``(dst, src, members, xla)`` pairs, issued at the end."""

    __slots__ = ("pairs", "names")

    def __init__(self, plan: StagingPlan) -> None:
        super().__init__(plan)
        self.pairs: List[_Pair] = []
        self.names = plan.keys if len(plan.keys) == len(plan.tensors) else [str(i) for i in range(len(plan.tensors))]


class LazyStager(BaseStager):
    """Makes :class:`HostSnapshot` objects whose copies of device tensors are still in flight.

    CPU tensors are copied before :meth:`stage` returns (see the module docstring).

    Shares the pool, the plan memo, the CUDA side streams and the XLA state of ``eager``,
    which also stages what cannot be staged lazily. A snapshot's buffers must not be read
    before ``snapshot.wait_copied()`` returns; releasing it waits for its copies.

    Args:
        eager: the eager stager whose pool, plan memo and device state this one shares.
    """

    def __init__(self, eager: EagerStager) -> None:
        super().__init__(eager.pool, eager.plans)
        self.eager = eager
        self.order = NeedOrder()
        self._outstanding: List[PendingCopies] = []

    @property
    def xla(self) -> XlaStaging:
        """The XLA state of the eager stager (shared)."""
        return self.eager.xla

    @property
    def pending(self) -> List[PendingCopies]:
        """The copy trackers :meth:`synchronize_staging` has not waited for yet.

        Of this stager's snapshots, oldest first."""
        return list(self._outstanding)

    def synchronize_staging(self) -> None:
        """Wait until the copies of every snapshot of this stager are done and sealed.

        Then drop the forward hook if no stager has copies outstanding. Training thread."""
        pending, self._outstanding = self._outstanding, []
        for pc in pending:
            pc.wait_all()
        guard.settle_hooks()

    def _new_job(self, plan: StagingPlan) -> StagingJob:
        return _LazyJob(plan)

    def _stage_local(self, items: _Items, job: StagingJob, cuda: bool) -> None:
        if not _cpu_lazily:  # CPU tensors: copied now, as the eager stager copies them
            host = [it for it in items if not it[1].is_cuda] if cuda else items
            if host:  # a mixed state dict's CPU part: a layout of its own, not the eager one's
                self.eager.copy_now(host, job, cuda=False, source="cpu" if cuda else "local")
            items = [it for it in items if it[1].is_cuda] if cuda else []
            if not items:
                return
        self._lay_out(items, job.host, job, xla=False)  # type: ignore[arg-type]

    def _stage_xla(self, items: _Items, job: StagingJob) -> None:
        rest, shards, spmd = self.xla.stage_direct(self.pool, items, job.host, job.leases, job.deferred)
        job.xla_shards = job.xla_shards or shards
        job.xla_spmd = job.xla_spmd or spmd
        rest, other = with_buffers(rest)
        if other:  # no PJRT buffer of their own (host data, say): copied now, in one batch
            stage_batched(other, job.host)
        if not rest:
            return
        srcs, index = unique(rest)
        views = xla_host_views(srcs)
        if views is None:  # TPU/GPU buffers: no host view to hold, copy them now
            stage_batched(rest, job.host)
            return
        host: List[Optional[torch.Tensor]] = [None] * len(views)
        self._lay_out(list(enumerate(views)), host, job, xla=True)  # type: ignore[arg-type]
        for i, t in rest:
            job.host[i] = host[index[id(t)]]

    def _lay_out(self, items: _Items, host: List[Optional[torch.Tensor]], job: _LazyJob, xla: bool) -> None:
        """The eager stager's buffer layout (:func:`~.buffer_layout.lay_out`), but the copies are
        collected in ``job.pairs`` instead of made, big units in the learned order. Small CPU
        units (the slab's) are copied here. ``xla``: ``items`` are host views of XLA buffers
        (immutable: nothing to guard), indexed by position."""
        now_d: List[torch.Tensor] = []
        now_s: List[torch.Tensor] = []
        pairs, names = job.pairs, job.names
        for dst, unit in lay_out(self.pool, items, host, job.leases, order=self.order.order):
            src = unit.src
            if unit.span_start < 0 and unit.nbytes <= SMALL_TENSOR_BYTES and not src.is_cuda:
                now_d.append(dst)
                now_s.append(src)
            else:
                pairs.append((dst, src, [(names[i] if not xla else str(i), t) for i, t in unit.members], xla))
        if now_d:
            with torch.no_grad():
                copy_cpu(now_d, now_s)

    def _finish(self, snap: HostSnapshot, job: StagingJob) -> None:
        # XLA views and small tensors first, then big tensors in the learned order.
        chunks = deferred_chunks(job.deferred) + build_chunks(job.pairs, CHUNK_BYTES)  # type: ignore[attr-defined]
        pending = start(chunks, self.eager.cuda.stream, self.order)
        guard.install()
        snap.pending = pending
        self._outstanding = [pc for pc in self._outstanding if not pc.done]
        self._outstanding.append(pending)
