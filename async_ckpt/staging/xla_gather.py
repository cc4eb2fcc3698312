"""Small XLA tensors on PJRT CPU, copied by buffer address: one gather per tensor size.

Why: the zero-copy path of :func:`~.backends.xla_host_views` costs a DLPack export and import
per tensor (~7.5 us), which with 10,000 small tensors is three times the copy itself.

How: on PJRT CPU a device buffer is ordinary host memory in row-major order, and
``_XLAC._unsafe_buffer_pointer`` returns its address (~2 us, no Python tensor made). All buffers
then lie inside one address range ``[lowest, highest end)``. For each distinct size ``n``, one
``index_select`` over the range unfolded into every ``n``-byte window picks the windows that
start at the buffers' addresses and writes them as consecutive rows of a pooled slab. The
range is only a view: nothing outside the buffers is read, nothing is allocated.

When: after :func:`~.backends.xla_wait` (every launched execution has its output buffers).
The pending-work check of :func:`~.backends.xla_sync` is not needed first: reading the address
of a tensor with pending work fails (it has no buffer yet), and :meth:`XlaGather.stage` then
raises :class:`XlaPendingWork` so the caller syncs and tries again. That saves a pass over
every tensor (~0.8 us each) in the usual case, where nothing is pending. And only when, in this
save, a DLPack view of one tensor of each (dtype, shape) is a host tensor that starts at the
address given and is row-major. That proves the addresses are host memory (not a GPU's) and
that the layout is the one assumed. Anything else — no such binding, an address that cannot be
read, a failed check, two tensors on one buffer (tied) — leaves the tensors to the DLPack path.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..addresses import gather
from .pool import HostBufferPool, Lease
from .views import slab_views

_ALIGN = 64
_dtype, _shape = attrgetter("dtype"), attrgetter("shape")


class _Layout:
    """Where each small tensor of one state dict layout goes in the slab (one per layout)."""

    __slots__ = ("dtypes", "shapes", "small", "rest", "groups", "slab_bytes", "order", "offsets", "probes")

    def __init__(self, dtypes: List[torch.dtype], shapes: List[torch.Size], sizes: List[int], small_max: int) -> None:
        self.dtypes = dtypes  # per item: what decides the layout (two lists compare faster than pairs)
        self.shapes = shapes
        self.small = [p for p, n in enumerate(sizes) if 0 < n <= small_max]
        smallset = set(self.small)
        self.rest = [p for p in range(len(sizes)) if p not in smallset]
        by_size: Dict[int, List[int]] = {}
        for p in self.small:
            by_size.setdefault(sizes[p], []).append(p)
        rank = {p: k for k, p in enumerate(self.small)}  # where each small item's address is listed
        # One group per size, each a run of rows in the slab: (size, ranks of its items, start).
        self.groups: List[Tuple[int, torch.Tensor, int]] = []
        self.order: List[int] = []  # item positions in slab order
        self.offsets: List[int] = []  # their byte offsets in the slab
        off = 0
        for n, ps in sorted(by_size.items()):
            self.groups.append((n, torch.tensor([rank[p] for p in ps], dtype=torch.int64), off))
            self.order += ps
            self.offsets += range(off, off + n * len(ps), n)
            off += (n * len(ps) + _ALIGN - 1) // _ALIGN * _ALIGN
        self.slab_bytes = off
        first: Dict[Any, int] = {}
        for p in self.small:
            first.setdefault((dtypes[p], shapes[p]), p)
        # One tensor per (dtype, shape), checked every save: (its position, its rank in small).
        self.probes = [(p, rank[p]) for p in first.values()]


def _buffer_address_of() -> Optional[Any]:
    try:
        import torch_xla

        return torch_xla._XLAC._unsafe_buffer_pointer
    except Exception:
        return None


def _probe_ok(t: torch.Tensor, addr: int) -> bool:
    """Whether DLPack shows ``t``'s buffer as row-major host memory starting at ``addr``."""
    try:
        import torch_xla

        v = torch._C._from_dlpack(torch_xla._XLAC._to_dlpack(t))
    except Exception:
        return False
    return v.is_cpu and v.data_ptr() == addr and v.shape == t.shape and v.dtype == t.dtype and v.is_contiguous()


class XlaPendingWork(Exception):
    """A small tensor's buffer address could not be read before a sync: it may have pending
    work. The caller runs :func:`~.backends.xla_sync` and calls :meth:`XlaGather.stage` again."""


class XlaGather:
    """Stages the small tensors of XLA state dicts by address (see the module docstring).

    Remembers the layout of the last state dict, so a training loop's repeated saves only read
    the addresses, gather and hand out the slab's cached views."""

    def __init__(self, small_max: int) -> None:
        self.small_max = small_max
        self._layout: Optional[_Layout] = None
        self._address_of = _buffer_address_of()
        #: kept by the caller (``Stager.xla_small_first``): the last save found pending work, so
        #: sync before reading until a sync finds none (XLA views, for one, always have some)
        self.sync_first = False

    def stage(self, pool: HostBufferPool, items: List[Tuple[int, torch.Tensor]],
              host: List[Optional[torch.Tensor]], leases: List[Lease], synced: bool = True
              ) -> List[Tuple[int, torch.Tensor]]:
        """Copy the small tensors of ``items`` into a pooled slab and put their host views in
        ``host``; return the items left to the caller (all of them if this path does not apply).
        ``synced=False``: pending work has not been checked for; an address that cannot be read
        raises :class:`XlaPendingWork` (nothing copied, nothing held) instead of giving up."""
        address_of = self._address_of
        if address_of is None or not items:
            return items
        ts = [t for _, t in items]
        dtypes, shapes = list(map(_dtype, ts)), list(map(_shape, ts))
        layout = self._layout
        if layout is None or layout.shapes != shapes or layout.dtypes != dtypes:
            layout = self._layout = _Layout(dtypes, shapes, [t.nbytes for t in ts], self.small_max)
        if not layout.small:
            return items
        small = [ts[p] for p in layout.small]
        try:
            addrs = list(map(address_of, small))
        except Exception:
            if not synced:
                raise XlaPendingWork() from None
            return items
        if len(set(addrs)) != len(addrs):
            return items  # tied tensors: the DLPack path copies a shared buffer once
        if not all(_probe_ok(ts[p], addrs[k]) for p, k in layout.probes):
            return items
        lease = pool.acquire([layout.slab_bytes])
        slab = lease.buffers[0]
        where = torch.tensor(addrs, dtype=torch.int64)  # in layout.small order
        try:
            with torch.no_grad():
                for n, ranks, start in layout.groups:
                    gather(where.index_select(0, ranks), n, slab[start: start + n * ranks.numel()].view(-1, n))
        except Exception:  # e.g. NumPy missing: the DLPack path still works
            lease.release()
            return items
        leases.append(lease)
        views = slab_views(slab, layout, layout.offsets, [ts[p] for p in layout.order])
        for p, v in zip(layout.order, views):
            host[items[p][0]] = v
        return [items[p] for p in layout.rest]
