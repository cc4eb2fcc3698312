"""The blocking part of a save: turn a state dict into a host snapshot, as fast as possible.

``Stager.stage`` plans the state dict, groups tensors that share storage (tied weights, views)
so each storage is copied once, takes reusable buffers from the pool, and runs one batched
transfer per device type. When it returns, the snapshot owns host copies of every tensor and
the training loop may mutate its tensors freely.
"""

from __future__ import annotations

import time
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .gc_pause import gc_paused
from .backends import CudaTransfer, copy_cpu, xla_batched_to_cpu, xla_host_views, xla_sync, xla_wait
from ..errors import InvalidStateDictError
from .plan import UNCOPYABLE_DTYPES, PlanMemo, StagingPlan, make_plan
from .pool import HostBufferPool, Lease
from .views import slab_views, whole_view
from .xla_gather import XlaGather, XlaPendingWork


@dataclass
class HostSnapshot:
    """Host copies of one state dict. Owns its pooled buffers until :meth:`release`."""

    state_dict: Dict[str, Any]
    nbytes: int
    num_tensors: int
    stage_seconds: float
    int_keys: List[str] = field(default_factory=list)
    leases: List[Lease] = field(default_factory=list)
    #: lazy stage only: the copies still in flight (``async_ckpt.staging.lazy.PendingCopies``)
    pending: Optional[Any] = None
    #: zero-copy views of XLA device buffers the copies were read from: releasing 10,000 of
    #: them takes ~25 ms, so the writer thread drops them (:meth:`drop_sources`), not the stall
    sources: Optional[List[torch.Tensor]] = None

    def drop_sources(self) -> None:
        """Release the device-buffer views the host copies were made from (copies are done)."""
        self.sources = None

    def wait_copied(self) -> None:
        """Lazy snapshots: wait until every host copy is done; raise
        :class:`~async_ckpt.staging.lazy.TornSnapshotError` if a source changed first."""
        if self.pending is not None:
            self.pending.result()

    def release(self) -> None:
        """Give the buffers back to the pool. The snapshot must not be read afterwards."""
        if self.pending is not None:
            self.pending.wait_all()  # never hand out a buffer a lazy copy still writes into
        for lease in self.leases:
            lease.release()
        self.leases = []


@dataclass(slots=True)
class _Unit:
    """One contiguous run of bytes to copy; several tensors may be views into it."""

    src: torch.Tensor  # the source to copy (a tensor, or a uint8 view of a storage span)
    nbytes: int
    members: List[Tuple[int, torch.Tensor]]  # (plan index, source tensor)
    span_start: int = -1  # byte offset in the storage for span units; -1 for simple units


_nbytes = attrgetter("nbytes")

SMALL_TENSOR_BYTES = 64 * 1024  # tensors up to this size share one pooled slab
_ALIGN = 64


def _storage_units(idx_tensors: List[Tuple[int, torch.Tensor]]) -> List[_Unit]:
    """Group CPU/CUDA tensors by storage; a storage shared by several tensors is copied once."""
    # The common case first: every tensor on its own storage (no ties, no views of one
    # another), so no grouping is needed. CPU and CUDA pointers cannot coincide (UVA).
    ptrs = [t.untyped_storage().data_ptr() for _, t in idx_tensors]
    if len(set(ptrs)) == len(ptrs):
        units: List[_Unit] = []
        for item in idx_tensors:
            t = item[1]
            n = t.nbytes
            if n and t.is_contiguous():
                units.append(_Unit(t, n, [item]))
            else:
                units.extend(_grouped_units([item]))
        return units
    return _grouped_units(idx_tensors)


def _grouped_units(idx_tensors: List[Tuple[int, torch.Tensor]]) -> List[_Unit]:
    groups: Dict[Tuple[bool, int], List[Tuple[int, torch.Tensor]]] = {}
    units: List[_Unit] = []
    for i, t in idx_tensors:
        if t.nbytes == 0:
            units.append(_Unit(t, 0, [(i, t)]))
            continue
        if t.is_conj() or t.is_neg():
            # A conjugate or negative view's storage holds the *unresolved* values: its bytes
            # (a span) or a tensor sharing them would be saved without the bit. Copying the
            # view itself into a buffer of its own resolves it (copy_ applies both bits).
            units.append(_Unit(t, t.nbytes, [(i, t)]))
            continue
        key = (t.is_cuda, t.untyped_storage().data_ptr())
        g = groups.get(key)
        if g is None:
            groups[key] = [(i, t)]
        else:
            g.append((i, t))
    for members in groups.values():
        first = members[0][1]
        if len(members) == 1:  # the common case: a tensor alone on its storage
            if first.is_contiguous():
                units.append(_Unit(first, first.nbytes, members))
                continue
            same_view = False
        else:
            same_view = all(
                t.storage_offset() == first.storage_offset() and t.size() == first.size()
                and t.stride() == first.stride() and t.dtype == first.dtype
                for _, t in members
            )
        if same_view and first.is_contiguous():
            units.append(_Unit(first, first.nbytes, members))
            continue
        lo = min(t.storage_offset() * t.element_size() for _, t in members)
        hi = max(
            (t.storage_offset() + sum((s - 1) * st for s, st in zip(t.size(), t.stride())) + 1) * t.element_size()
            for _, t in members
        )
        if any((t.storage_offset() * t.element_size() - lo) % t.element_size() for _, t in members):
            # Mixed dtypes at odd offsets: copy each tensor on its own (still one batch).
            for i, t in members:
                c = t if t.is_contiguous() else None
                if c is None:
                    units.extend(_grouped_units([(i, t.contiguous())]))  # rare: non-aligned strided view
                else:
                    units.append(_Unit(t, t.numel() * t.element_size(), [(i, t)]))
            continue
        span = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
            first.untyped_storage(), lo, (hi - lo,), (1,)
        )
        units.append(_Unit(span, hi - lo, members, span_start=lo))
    return units


def _views_on(buf: torch.Tensor, unit: _Unit, host: List[Optional[torch.Tensor]]) -> torch.Tensor:
    """Fill ``host`` with the member tensors of ``unit`` as views of ``buf``; return the copy target."""
    if unit.span_start < 0:
        i0, t0 = unit.members[0]
        dst = whole_view(buf, t0) if unit.nbytes else torch.empty(t0.shape, dtype=t0.dtype)
        for i, _ in unit.members:
            host[i] = dst
        return dst
    storage = buf.untyped_storage()
    for i, t in unit.members:
        off = (t.storage_offset() * t.element_size() - unit.span_start) // t.element_size()
        host[i] = torch.empty(0, dtype=t.dtype).set_(storage, off, t.size(), t.stride())
    return buf


def lay_out(pool: HostBufferPool, items: List[Tuple[int, torch.Tensor]], host: List[Optional[torch.Tensor]],
            leases: List[Lease], order: Optional[Callable[[List[_Unit]], List[_Unit]]] = None
            ) -> List[Tuple[torch.Tensor, _Unit]]:
    """Pooled host buffers for CPU/CUDA ``items``: fills ``host`` with the host tensors and
    returns the (destination, unit) copies still to make — small units (one shared slab) first,
    then the big ones (in ``order(big)`` when given). Shared by the eager and lazy stagers."""
    units = _storage_units(items)
    pinned = torch.cuda.is_available() and any(u.src.is_cuda for u in units)
    # Small tensors are coalesced into one slab: one pooled buffer instead of thousands.
    big: List[_Unit] = []
    small: List[_Unit] = []
    offsets: List[int] = []
    sig_parts: List[Any] = []  # (dtype, shape) of each small unit: the slab's layout signature
    slab_bytes = 0
    for u in units:  # one pass: this loop runs once per tensor
        n = u.nbytes
        if 0 < n <= SMALL_TENSOR_BYTES and u.span_start < 0:
            small.append(u)
            offsets.append(slab_bytes)
            slab_bytes += (n + _ALIGN - 1) // _ALIGN * _ALIGN
            t0 = u.members[0][1]
            sig_parts.append(t0.dtype)
            sig_parts.append(t0.shape)
        else:
            if u.src.dtype in UNCOPYABLE_DTYPES:  # a lazy save would copy it in the background
                raise TypeError(f"cannot copy a {u.src.dtype} tensor")
            big.append(u)
    lease = pool.acquire([u.nbytes for u in big] + ([slab_bytes] if small else []), pinned=pinned)
    leases.append(lease)
    copies: List[Tuple[torch.Tensor, _Unit]] = []
    if small:
        views = slab_views(lease.buffers[-1], sig_parts, offsets, [u.members[0][1] for u in small])
        for dst, unit in zip(views, small):
            for i, _ in unit.members:
                host[i] = dst
            copies.append((dst, unit))
    bufs = {id(u): b for u, b in zip(big, lease.buffers)}
    for unit in (order(big) if order is not None else big):
        dst = _views_on(bufs[id(unit)], unit, host)
        if unit.nbytes:
            copies.append((dst, unit))
    return copies


class _Remembered:
    """How the last eager stage laid out a state dict in which every tensor was contiguous,
    non-empty and alone on its storage. A training loop saves the same layout every time, and
    redoing it from this skips the grouping and the per-unit classification of :func:`lay_out`
    (about two thirds of the per-tensor cost with 10,000 small tensors)."""

    __slots__ = ("sig", "sizes", "pinned", "order", "n_small", "offsets", "slab_sig")

    def __init__(self, sig, sizes, pinned, order, n_small, offsets, slab_sig) -> None:
        self.sig = sig  # per tensor (dtype, shape[, is_cuda]): what decides the layout
        self.sizes = sizes  # the buffers to acquire: the big units', then the slab
        self.pinned = pinned
        self.order = order  # item positions in copy order: slab members, then big units
        self.n_small = n_small
        self.offsets = offsets  # slab offsets of the small ones
        self.slab_sig = slab_sig  # the key of the slab's own view cache (see lay_out)


def _simple_sig(ts: List[torch.Tensor], cuda: bool) -> Optional[List[Any]]:
    """The layout signature of ``ts``, or ``None`` unless every tensor is contiguous and on a
    storage of its own (the only case :class:`_Remembered` covers)."""
    ptrs = [t.untyped_storage().data_ptr() for t in ts]
    if len(set(ptrs)) != len(ptrs) or not all([t.is_contiguous() for t in ts]):
        return None
    if cuda:
        return [(t.dtype, t.shape, t.is_cuda) for t in ts]
    return [(t.dtype, t.shape) for t in ts]


def _remember(sig: List[Any], items: List[Tuple[int, torch.Tensor]], copies: List[Tuple[torch.Tensor, _Unit]],
              lease: Lease) -> Optional[_Remembered]:
    if len(copies) != len(items) or any(len(u.members) != 1 or u.span_start >= 0 for _, u in copies):
        return None  # an empty tensor (not copied), or a span: lay_out decides every time
    pos = {i: k for k, (i, _) in enumerate(items)}
    order = [pos[u.members[0][0]] for _, u in copies]
    n_small = sum(1 for _, u in copies if u.nbytes <= SMALL_TENSOR_BYTES)
    offsets: List[int] = []
    slab_sig = None
    if n_small:
        slab = lease.buffers[-1]
        base = slab.data_ptr()
        offsets = [d.data_ptr() - base for d, _ in copies[:n_small]]
        slab_sig = slab._async_ckpt_views[0]
    return _Remembered(sig, [b.numel() for b in lease.buffers], lease.pinned, order, n_small, offsets, slab_sig)


def _redo(memo: _Remembered, pool: HostBufferPool, items: List[Tuple[int, torch.Tensor]], ts: List[torch.Tensor],
          host: List[Optional[torch.Tensor]], leases: List[Lease]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """:func:`lay_out` for a layout seen last time: the same buffers and views, no grouping."""
    lease = pool.acquire(memo.sizes, pinned=memo.pinned)
    leases.append(lease)
    order, ns = memo.order, memo.n_small
    dsts: List[torch.Tensor] = []
    if ns:
        dsts += slab_views(lease.buffers[-1], memo.slab_sig, memo.offsets, [ts[p] for p in order[:ns]])
    dsts += [whole_view(buf, ts[p]) for buf, p in zip(lease.buffers, order[ns:])]
    for p, d in zip(order, dsts):
        host[items[p][0]] = d
    return dsts, [ts[p] for p in order]


def snapshot_nbytes(host: List[Any], plan: StagingPlan) -> int:
    """The bytes a snapshot holds, from its host tensors: cheaper to read than XLA tensors."""
    try:
        return sum(map(_nbytes, host))
    except AttributeError:  # SPMD: a set of local shards stands for the global tensor
        return plan.nbytes


def _unique(items: List[Tuple[int, torch.Tensor]]) -> Tuple[List[torch.Tensor], Dict[int, int]]:
    """The distinct tensor objects of ``items`` and, by ``id``, each one's index among them."""
    index: Dict[int, int] = {}
    srcs: List[torch.Tensor] = []
    for _, t in items:
        if id(t) not in index:
            index[id(t)] = len(srcs)
            srcs.append(t)
    return srcs, index


class Stager:
    """Makes :class:`HostSnapshot` objects from state dicts using one :class:`HostBufferPool`."""

    def __init__(self, pool: Optional[HostBufferPool] = None) -> None:
        self.pool = pool if pool is not None else HostBufferPool()
        self._cuda: Optional[CudaTransfer] = None
        self._memo: Dict[str, Optional[_Remembered]] = {}  # the last simple layout, per source
        self._xla_gather: Optional[XlaGather] = None
        self._plan_memo = PlanMemo()

    def plan(self, state_dict: Any) -> StagingPlan:
        """:func:`~.plan.make_plan` with this stager's memo: the same plan, found faster when
        the structure is the one saved last time."""
        return make_plan(state_dict, self._plan_memo)

    def stage(self, state_dict: Any, plan: Optional[StagingPlan] = None, *, lazy: bool = False) -> HostSnapshot:
        """Host copies of ``state_dict``. ``lazy=True`` returns once the copies are issued:
        ``snapshot.pending`` tracks them and the guard in :mod:`.lazy` protects the sources.

        Raises :class:`InvalidStateDictError` naming the tensor when one cannot be staged
        (quantized, nested, meta, a dtype without a copy kernel): such a tensor makes staging
        fail, and only then are the tensors checked one by one."""
        with gc_paused():  # a full collection inside the stall would cost more than the copies
            plan = plan if plan is not None else self.plan(state_dict)
            try:
                if lazy:
                    from .lazy import stage_lazy

                    return stage_lazy(self, state_dict, plan)
                return self._stage(state_dict, plan)
            except Exception as exc:
                if not isinstance(exc, InvalidStateDictError):
                    try:
                        plan.check_tensors()
                    except InvalidStateDictError as bad:  # a tensor of the state dict is the cause
                        raise bad from exc
                raise

    def _stage(self, state_dict: Any, plan: Optional[StagingPlan]) -> HostSnapshot:
        t0 = time.perf_counter()
        plan = plan if plan is not None else self.plan(state_dict)
        host: List[Optional[torch.Tensor]] = [None] * len(plan.tensors)
        by_type = plan.by_device_type()
        leases: List[Lease] = []
        sources = None
        try:
            if "xla" in by_type:
                sources = self._stage_xla(by_type.pop("xla"), host, leases)
            cuda = "cuda" in by_type
            local = [it for kind in ("cpu", "cuda") for it in by_type.pop(kind, [])]
            if by_type:
                kinds = ", ".join(sorted(by_type))
                raise NotImplementedError(f"staging tensors on device type(s) {kinds} is not supported")
            if local:
                self._stage_local(local, host, leases, cuda)
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        snap_sd = plan.build(host)  # type: ignore[arg-type]
        return HostSnapshot(
            state_dict=snap_sd,
            nbytes=snapshot_nbytes(host, plan),
            num_tensors=len(plan.tensors),
            stage_seconds=time.perf_counter() - t0,
            int_keys=plan.int_keys,
            leases=leases,
            sources=sources,
        )

    @property
    def xla_gather(self) -> XlaGather:
        """Stages small XLA tensors by buffer address (eager and lazy stages alike)."""
        if self._xla_gather is None:
            self._xla_gather = XlaGather(SMALL_TENSOR_BYTES)
        return self._xla_gather

    def _stage_local(self, items, host, leases, cuda: bool = True, source: str = "local") -> None:
        """Copy CPU/CUDA ``items`` into pooled buffers. ``cuda=False``: none of them is on CUDA.
        ``source`` names the caller, which keeps a layout of its own in ``self._memo``."""
        ts = [t for _, t in items]
        sig = _simple_sig(ts, cuda)
        memo = self._memo.get(source)
        if sig is not None and memo is not None and memo.sig == sig:
            dsts, srcs = _redo(memo, self.pool, items, ts, host, leases)
        else:
            copies = lay_out(self.pool, items, host, leases)
            self._memo[source] = _remember(sig, items, copies, leases[-1]) if sig is not None else None
            dsts = [d for d, _ in copies]
            srcs = [u.src for _, u in copies]
        if not cuda:
            with torch.no_grad():
                copy_cpu(dsts, srcs)
            return
        cpu_d, cpu_s, cuda_d, cuda_s = [], [], [], []
        for dst, src in zip(dsts, srcs):
            (cuda_d if src.is_cuda else cpu_d).append(dst)
            (cuda_s if src.is_cuda else cpu_s).append(src)
        with torch.no_grad():
            if cuda_d:
                if self._cuda is None:
                    self._cuda = CudaTransfer()
                self._cuda.copy(cuda_d, cuda_s)
            copy_cpu(cpu_d, cpu_s)

    def xla_small_first(self, items, host, leases):
        """Small XLA tensors by buffer address, before any pending-work check (see
        :mod:`.xla_gather`); the rest, returned, are synced if they need it. When a small one
        has pending work, everything is synced and the gather runs again; later saves then sync
        first, until a sync finds nothing pending."""
        gather = self.xla_gather
        if not gather.sync_first:
            try:
                rest = gather.stage(self.pool, items, host, leases, synced=False)
            except XlaPendingWork:
                pass
            else:
                if rest:
                    xla_sync([t for _, t in rest])
                return rest
        gather.sync_first = xla_sync([t for _, t in items])
        return gather.stage(self.pool, items, host, leases)

    def _stage_xla(self, items, host, leases) -> Optional[List[torch.Tensor]]:
        """Stage XLA tensors into ``host``; return the DLPack views used, if any (see ``sources``)."""
        from ..distributed import stage_xla_shards, xla_sharded

        xla_wait()
        sharded = xla_sharded(items)
        if sharded:
            xla_sync([t for _, t in items])
            # SPMD: host copies of this process's shards (one replica each), not the global tensor.
            srcs_sh, ids = _unique(sharded)
            shards = stage_xla_shards(srcs_sh)
            for i, t in sharded:
                host[i] = shards[ids[id(t)]]
            items = [(i, t) for i, t in items if host[i] is None]
            if not items:
                return None
            items = self.xla_gather.stage(self.pool, items, host, leases)
        else:
            # Small tensors by buffer address, one gather per size; the others through DLPack.
            items = self.xla_small_first(items, host, leases)
        if not items:
            return None
        views = xla_host_views([t for _, t in items])
        if views is not None:
            # Zero-copy views of the PJRT host buffers, then one batched copy into pooled
            # buffers. A tensor listed twice (tied parameters) gives two views of one buffer,
            # which the storage grouping of ``lay_out`` copies once and hands out as one tensor.
            self._stage_local([(i, v) for (i, _), v in zip(items, views)], host, leases, cuda=False, source="xla")
            return views
        srcs, uniq = _unique(items)  # tied parameters: the same tensor object, staged once
        staged = xla_batched_to_cpu(srcs)  # fresh host tensors; the seed's parallel path
        for i, t in items:
            host[i] = staged[uniq[id(t)]]
        return None
