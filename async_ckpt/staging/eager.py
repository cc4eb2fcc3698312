"""The eager stager: every host copy is made before :meth:`EagerStager.stage` returns.

The tensors are laid out in pooled buffers (:mod:`.buffer_layout`; storages shared by several
tensors copied once) and copied with one batched transfer per device type: CPU
(:mod:`.cpu`), CUDA (:mod:`.cuda`), XLA (:mod:`.xla`). When ``stage`` returns, the snapshot
owns host copies of every tensor and the training loop may mutate its tensors freely.

One exception, invisible to the training loop: under SPMD the XLA transfers read references
to the (immutable) device data taken at the call, on the copier thread
(:func:`~.xla.defer_spmd`); ``snapshot.pending`` tracks them and ``wait_copied()`` waits.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import guard
from .base import BaseStager, StagingJob
from .buffer_layout import BufferLayoutMemo
from .cpu import copy_cpu
from .cuda import CudaTransfer
from .lazy_copies import deferred_chunks, start
from .plan import PlanMemo
from .pool import HostBufferPool
from .snapshot import HostSnapshot
from .xla import XlaStaging, stage_batched, with_buffers, xla_host_views

_Items = List[Tuple[int, torch.Tensor]]


class EagerStager(BaseStager):
    """Makes fully copied :class:`~.snapshot.HostSnapshot` objects from one :class:`HostBufferPool`.

    Args:
        pool: the host buffer pool (default: a new unbounded one).
        plans: the plan memo (default: a new one).
        xla: the XLA staging state (default: made on first use).
    """

    def __init__(self, pool: Optional[HostBufferPool] = None, plans: Optional[PlanMemo] = None,
                 xla: Optional[XlaStaging] = None) -> None:
        super().__init__(pool, plans, xla)
        self.cuda = CudaTransfer()
        self._layouts = BufferLayoutMemo()

    def _stage_local(self, items: _Items, job: StagingJob, cuda: bool) -> None:
        self.copy_now(items, job, cuda)

    def _stage_xla(self, items: _Items, job: StagingJob) -> None:
        rest, shards, spmd = self.xla.stage_direct(self.pool, items, job.host, job.leases, job.deferred)
        job.xla_shards = job.xla_shards or shards
        job.xla_spmd = job.xla_spmd or spmd
        if rest:
            self.copy_xla_now(rest, job)

    def _finish(self, snap: HostSnapshot, job: StagingJob) -> None:
        if job.deferred:  # SPMD: the transfers run on the copier thread; the writer waits for them
            snap.pending = start(deferred_chunks(job.deferred), self.cuda.stream)
            guard.install()

    def copy_now(self, items: _Items, job: StagingJob, cuda: bool = True, source: str = "local") -> None:
        """Copy CPU/CUDA tensors into pooled buffers before returning.

        Args:
            items: ``(plan index, tensor)`` pairs.
            job: the stage; ``job.host`` gets a host view per index, ``job.leases`` the buffers.
            cuda: False when none of ``items`` is on CUDA.
            source: names the buffer layout remembered for the next stage of the same kind.
        """
        dsts, srcs = self._layouts.pairs(self.pool, items, job.host, job.leases, cuda, source)
        if not cuda:
            with torch.no_grad():
                copy_cpu(dsts, srcs)
            return
        cpu_d: List[torch.Tensor]
        cpu_s: List[torch.Tensor]
        cuda_d: List[torch.Tensor]
        cuda_s: List[torch.Tensor]
        cpu_d, cpu_s, cuda_d, cuda_s = [], [], [], []
        for dst, src in zip(dsts, srcs):
            (cuda_d if src.is_cuda else cpu_d).append(dst)
            (cuda_s if src.is_cuda else cpu_s).append(src)
        with torch.no_grad():
            if cuda_d:
                self.cuda.copy(cuda_d, cuda_s)
            copy_cpu(cpu_d, cpu_s)

    def copy_xla_now(self, items: _Items, job: StagingJob) -> None:
        """Copy XLA tensors before returning.

        After :meth:`XlaStaging.stage_direct` (no pending work left). Through zero-copy host views into pooled buffers (the views are kept as
        ``job.sources``); tensors without a PJRT buffer of their own (:func:`with_buffers`),
        or all where PJRT has no host views, by torch_xla's batched transfer.

        Args:
            items: ``(plan index, tensor)`` pairs.
            job: the stage; ``job.host`` gets a host tensor per index.
        """
        items, other = with_buffers(items)
        if other:
            stage_batched(other, job.host)
        if not items:
            return
        views = xla_host_views([t for _, t in items])
        if views is None:
            stage_batched(items, job.host)
            return
        # A tensor listed twice (tied parameters) gives two views of one buffer, which the
        # storage grouping of the layout copies once and hands out as one tensor.
        self.copy_now([(i, v) for (i, _), v in zip(items, views)], job, cuda=False, source="xla")
        job.sources = views
