"""Where each tensor of a stage goes: storage units, pooled buffers and their host views.

Tensors that share a storage (tied weights, views of one another) form one unit, copied once;
small units share one pooled slab; the host tensors are views of the pooled buffers, cached on
them (:mod:`.views`). The eager and the lazy stager lay out a stage with the same code: the
eager one copies the pairs at once, the lazy one issues them to the background.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch

from .plan import UNCOPYABLE_DTYPES, StagingPlan
from .pool import HostBufferPool, Lease
from .views import slab_views, whole_view


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
        # storage_offset() is typed int | SymInt (symbolic shapes); these are concrete tensors.
        lo = cast(int, min(t.storage_offset() * t.element_size() for _, t in members))
        hi = cast(int, max(
            (t.storage_offset() + sum((s - 1) * st for s, st in zip(t.size(), t.stride())) + 1) * t.element_size()
            for _, t in members
        ))
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
    redoing it from this skips the grouping and the per-unit classification of :func:`lay_out`."""

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
        slab_sig = cast(Any, slab)._async_ckpt_views[0]  # set by slab_views
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


class BufferLayoutMemo:
    """:func:`lay_out` for copies made at once, remembering the last simple layout of each
    source (``"local"``: CPU/CUDA tensors, ``"cpu"``: the CPU tensors of a lazy stage that also
    holds CUDA ones, ``"xla"``: host views of XLA buffers). One per eager stager."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: Dict[str, Optional[_Remembered]] = {}

    def pairs(self, pool: HostBufferPool, items: List[Tuple[int, torch.Tensor]], host: List[Optional[torch.Tensor]],
              leases: List[Lease], cuda: bool, source: str) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Pooled buffers for ``items`` (``host`` filled with their views); returns the
        (destinations, sources) still to copy. ``cuda=False``: none of them is on CUDA."""
        ts = [t for _, t in items]
        sig = _simple_sig(ts, cuda)
        memo = self._last.get(source)
        if sig is not None and memo is not None and memo.sig == sig:
            return _redo(memo, pool, items, ts, host, leases)
        copies = lay_out(pool, items, host, leases)
        self._last[source] = _remember(sig, items, copies, leases[-1]) if sig is not None else None
        return [d for d, _ in copies], [u.src for _, u in copies]


def snapshot_nbytes(host: List[Any], plan: StagingPlan) -> int:
    """The bytes a snapshot holds, from its host tensors: cheaper to read than XLA tensors."""
    try:
        return sum(map(_nbytes, host))
    except AttributeError:  # SPMD: a set of local shards stands for the global tensor
        return plan.nbytes


def unique(items: List[Tuple[int, torch.Tensor]]) -> Tuple[List[torch.Tensor], Dict[int, int]]:
    """The distinct tensor objects of ``items`` and, by ``id``, each one's index among them."""
    index: Dict[int, int] = {}
    srcs: List[torch.Tensor] = []
    for _, t in items:
        if id(t) not in index:
            index[id(t)] = len(srcs)
            srcs.append(t)
    return srcs, index
