"""XLA device -> host: everything the stagers do with XLA tensors.

In the order a stage uses them:

* :func:`xla_wait` (always first) and :func:`xla_sync` (only when a tensor has pending work):
  every tensor staged has its PJRT buffer.
* SPMD mode (``xr.use_spmd()``, :func:`stage_spmd`): every XLA tensor at once, by two batched
  transfers: a tensor split over devices by ``mark_sharding`` as host copies of this process's
  local shards (:func:`stage_xla_shards`), the others by torch_xla's batched transfer.
* Otherwise small tensors on PJRT CPU by buffer address (:class:`XlaGather`): one gather per size,
* and the others through zero-copy DLPack views of their PJRT host buffers (:func:`xla_host_views`),
  copied into pooled buffers like CPU tensors; a tensor without a PJRT buffer of its own, and
  every tensor where PJRT exposes no host view (TPU, GPU), by torch_xla's batched transfer
  (:func:`stage_batched`).

:class:`XlaStaging` (one per stager) runs the first three and keeps what it learns from one
save to the next. Every private torch_xla name goes through :mod:`async_ckpt.compat`.

Which tensors have a buffer DLPack can export
    ``_to_dlpack`` ends the whole process (an ``ABSL_CHECK``, not an exception) for a tensor
    that has neither a data handle nor a device-data IR node, and for one whose PJRT buffer
    does not exist yet. Tensors in that state are ordinary: under SPMD (and with
    ``XLA_TENSOR_UPDATE_SYNC=0``) a copy from the CPU -- ``.to('xla')``, ``copy_``,
    ``load_state_dict`` of a CPU state dict -- keeps the data on the host until the next sync;
    a tensor with pending work has an IR node; and under SPMD every device tensor's data is
    torch_xla's sharded data, which has no single PJRT buffer. DLPack is therefore never the
    way a bad case is found. Under SPMD it is not used at all (the mode decides). Elsewhere a
    tensor is exported only after its buffer address was read (:func:`with_buffers`):
    ``_unsafe_buffer_pointer`` succeeds exactly when the tensor's data is a PJRT buffer that
    exists, which is what ``_to_dlpack`` needs, and otherwise raises a Python error naming the
    state; the tensor then goes to torch_xla's batched transfer, which handles every state
    (host data, pending work, sharded data).

Small tensors by address
    On PJRT CPU a device buffer is ordinary host memory in row-major order, and
    ``_unsafe_buffer_pointer`` returns its address without making a Python tensor, whereas a
    DLPack view costs an export and an import per tensor. All buffers lie inside one address
    range ``[lowest, highest end)``. For each distinct size ``n``, one ``index_select`` over
    the range unfolded into every ``n``-byte window (:func:`~async_ckpt.addresses.gather`)
    picks the windows that start at the buffers' addresses and writes them as consecutive rows
    of a pooled slab. The range is only a view: nothing outside the buffers is read, nothing is
    allocated.

    This runs after :func:`xla_wait` (every launched execution has its output buffers). The
    pending-work check of :func:`xla_sync` is not needed first: reading the address of a
    tensor with pending work fails (it has no buffer yet), and :meth:`XlaGather.stage` then
    raises :class:`XlaPendingWork` so the caller syncs and tries again; in the usual case,
    where nothing is pending, that saves a pass over every tensor. And only when, in this
    save, a DLPack view of one tensor of each (dtype, shape) is a host tensor that starts at
    the address given and is row-major: that proves the addresses are host memory (not a
    GPU's) and that the layout is the one assumed. Anything else (no such binding, an address
    that cannot be read, a failed check, two tensors on one buffer) leaves the tensors to the
    DLPack path.
"""

from __future__ import annotations

import logging
from operator import attrgetter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import compat
from ..addresses import gather
from .buffer_layout import unique
from .pool import HostBufferPool, Lease
from .views import slab_views

_Items = List[Tuple[int, torch.Tensor]]

log = logging.getLogger("async_ckpt")

# ---- waiting for buffers -------------------------------------------------------------------


def xla_wait() -> None:
    """Wait until every XLA execution already launched has finished (its outputs have their
    PJRT buffers); see :func:`xla_sync` for why it is needed."""
    compat.xla_wait_device_ops()


def xla_sync(tensors: Optional[Sequence[torch.Tensor]] = None) -> bool:
    """Materialise pending XLA computations and wait until every device buffer exists.

    With ``tensors``, ``torch_xla.sync()`` runs only if one of them has a pending computation:
    it walks every live XLA tensor even when there is nothing to run, while the check is
    cheap per tensor.

    The wait is unconditional. ``torch_xla.sync()`` only launches an execution: until it
    finishes, its outputs are handles without a PJRT buffer, and ``_to_dlpack`` on one aborts
    the whole process (``Check failed: pjrt_buffer != nullptr``). A training loop's own
    ``torch_xla.sync()`` right before ``save_async`` leaves exactly that behind.

    Returns whether it ran ``torch_xla.sync()``.
    """
    import torch_xla

    check = compat.xla_need_materialization_fn()
    synced = tensors is None or check is None or any(check(list(tensors)))
    if synced:
        sync = getattr(torch_xla, "sync", None)
        if sync is not None:
            sync()
        else:  # older torch_xla
            import torch_xla.core.xla_model as xm

            xm.mark_step()
    xla_wait()
    return synced


# ---- transfers -----------------------------------------------------------------------------


def with_buffers(items: _Items) -> Tuple[_Items, _Items]:
    """Split ``(index, tensor)`` pairs into those whose tensor's data is a PJRT buffer that
    exists (what ``_to_dlpack`` needs: see the module docstring) and the others.

    The test is reading the buffer's address, one binding call per tensor, which raises a
    Python error (never ends the process) for host data, pending work, sharded data or a
    buffer not there yet. Call it after :func:`xla_wait`. Without the binding, no tensor
    qualifies.
    """
    address_of = _buffer_address_of()
    if address_of is None:
        return [], list(items)
    ok: _Items = []
    other: _Items = []
    for it in items:
        try:
            address_of(it[1])
        except Exception:  # the tensor has no PJRT buffer of its own: the batched transfer takes it
            other.append(it)
        else:
            ok.append(it)
    return ok, other


def xla_host_views(tensors: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
    """Zero-copy host views of XLA device buffers, or ``None`` where PJRT does not expose them
    or a tensor has no PJRT buffer of its own (checked first: see :func:`with_buffers`).

    On PJRT CPU the device buffer lives in host memory and DLPack hands it out without a copy;
    XLA buffers are immutable (an in-place op makes a new buffer), so the view keeps showing
    the values at the time it was taken. The raw bindings are used: the Python wrappers'
    checks cost as much as the conversions.
    """
    if with_buffers(list(enumerate(tensors)))[1]:
        return None
    try:
        to_dlpack, from_dlpack = compat.xla_to_dlpack_fn(), compat.from_dlpack
        views = [from_dlpack(to_dlpack(t)) for t in tensors]
    except Exception:  # no DLPack view: the caller copies through the runtime instead
        return None
    if not all(v.is_cpu for v in views):
        return None
    return views


def stage_batched(items: _Items, host: List[Optional[torch.Tensor]]) -> None:
    """torch_xla's batched transfer (every transfer issued, then awaited together) into fresh
    host tensors, for XLA tensors without host views. A tensor listed twice (tied parameters)
    is transferred once and both entries get the same host tensor."""
    srcs, index = unique(items)
    staged = compat.xla_get_cpu_tensors(srcs)
    for i, t in items:
        host[i] = staged[index[id(t)]]


# ---- SPMD ----------------------------------------------------------------------------------


def _spmd() -> bool:
    try:
        import torch_xla.runtime as xr

        return bool(xr.is_spmd())
    except Exception:  # torch_xla absent or not initialised: not SPMD
        return False


def _sharding_query() -> Optional[Tuple[Callable[[torch.Tensor], Any], Any]]:
    """The sharding type of a tensor, and the type meaning "not split", or None without them."""
    try:
        import torch_xla.distributed.spmd as xs

        return compat.xla_sharding_type_fn(), xs.ShardingType.REPLICATED
    except Exception:  # torch_xla without SPMD sharding types
        return None


def _split(t: torch.Tensor, kind_of: Callable[[torch.Tensor], Any], replicated: Any) -> bool:
    if t.device.type != "xla":
        return False
    try:
        kind = kind_of(t)
    except Exception:  # a tensor without a sharding: not split
        return False
    return kind is not None and kind != replicated


def is_xla_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is an XLA tensor split over several devices by ``mark_sharding``."""
    if t.device.type != "xla":
        return False
    query = _sharding_query()
    return query is not None and _split(t, *query)


def xla_sharded(items: _Items) -> _Items:
    """The ``(index, tensor)`` pairs whose tensor is SPMD-sharded (see :func:`is_xla_sharded`).

    Only SPMD mode (``xr.use_spmd()``) can shard a tensor: outside it, a state dict of many
    tensors skips the per-tensor query altogether.
    """
    if not _spmd():
        return []
    query = _sharding_query()
    if query is None:
        return []
    kind_of, replicated = query
    return [(i, t) for i, t in items if _split(t, kind_of, replicated)]


def stage_spmd(items: _Items, host: List[Optional[torch.Tensor]],
               deferred: Optional[List[Callable[[], None]]] = None) -> bool:
    """Stage every XLA tensor of ``items`` into ``host`` in SPMD mode; return whether any was
    split over devices (then ``host`` holds torch_xla's ``_CpuShards`` for it).

    Pending work runs first (one sync, only if a tensor has some), so that what is read is
    data, and a sharding propagated to a computed tensor is known. Then two batched transfers,
    each issuing every transfer before awaiting them together: the local shards of every
    split tensor (:func:`stage_xla_shards`: this process's addressable shards only), and
    every other tensor (torch_xla's batched transfer; a tensor whose data is still on the host
    is handed back as it is, without a transfer). No per-tensor transfer or sync, and no
    DLPack: under SPMD no device tensor has a PJRT buffer of its own.

    With ``deferred`` (a list), the tensors :func:`defer_spmd` can take are not transferred
    here: their host entries are placeholders, and the transfers that fill them are appended
    to ``deferred``, to run on another thread.
    """
    xla_sync([t for _, t in items])
    split = xla_sharded(items)  # deferred or not, the snapshot then holds shards
    if deferred is not None:
        items = defer_spmd(items, host, deferred)
    left = {i for i, _ in items}
    sharded = [(i, t) for i, t in split if i in left]
    if sharded:
        srcs, index = unique(sharded)
        shards = stage_xla_shards(srcs)
        for i, t in sharded:
            host[i] = shards[index[id(t)]]
    rest = [(i, t) for i, t in items if host[i] is None]
    if rest:
        stage_batched(rest, host)
    return bool(split)


def stage_xla_shards(tensors: List[torch.Tensor]) -> List[Any]:
    """Host copies of the local shards of SPMD-sharded XLA tensors, one replica of each shard.

    Returns torch_xla's ``_CpuShards`` (shards with their global indices), which torch_xla's
    ``SPMDSavePlanner`` writes as DCP chunks.
    """
    cpu_shards, cpu_shards_from_tensors = compat.xla_cpu_shards()
    out = []
    for cs in cpu_shards_from_tensors(list(tensors)):
        # Keep one copy of each distinct shard: the replica 0 of a shard lives on exactly one
        # device in the whole job, so every shard is written once, by the host that holds it.
        uniq = [s for s in cs.shards if s.replica_id == 0]
        out.append(cpu_shards(shards=uniq, global_shape=cs.global_shape))
    return out


# ---- SPMD: transfers off the training thread ------------------------------------------------

#: the bytes of local shards one deferred transfer reads (``_get_local_shards`` holds the GIL
#: while it runs: the training thread waits at most about this long for it)
DEFER_CHUNK_BYTES = 8 * 2**20

_told: set = set()


def _tell_once(key: str, msg: str, *args: Any) -> None:
    if key not in _told:
        _told.add(key)
        log.info(msg, *args)


def _has_device_data(t: torch.Tensor) -> bool:
    """Whether ``t``'s value is a device buffer (not host data awaiting a sync), read without
    side effects: asking for a data handle would upload host data."""
    try:
        return "XLAData: None" not in compat.xla_tensor_debug_info(t)
    except Exception:  # no debug info: treat as not device data (transferred at the call)
        return False


def data_references(tensors: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """New XLA tensors over the same device data as ``tensors`` (no copy), or None for each
    one that cannot be referenced safely (see :func:`defer_spmd`).

    The reference is made by ``_get_tensors_xla_device_data_node``: it gives the user's
    tensor its device-data IR node first (so a later use of it never re-creates one), then
    makes the reference, whose sharding annotation (every device data has one under SPMD)
    makes a device-data node of its own, which tags the shared data with the reference's
    tensor id. torch_xla donates a buffer at a step barrier only if its tag is the id of a
    tensor being updated, so the user's in-place updates and optimizer steps no longer donate
    it. A reference without a sharding annotation would not have retagged the data: None.
    """
    refs_of = compat.xla_device_data_refs_fn()
    spec = compat.xla_sharding_spec_fn()
    out: List[Optional[torch.Tensor]] = []
    for t in tensors:
        ref: Optional[torch.Tensor] = None
        if _has_device_data(t):
            try:
                found = refs_of([t], [])[1]
                if len(found) == 1 and spec(found[0]):
                    ref = found[0]
            except Exception:  # noqa: BLE001 - not referenced: transferred at the call
                ref = None
        out.append(ref)
    return out


def defer_spmd(items: _Items, host: List[Optional[torch.Tensor]], deferred: List[Callable[[], None]]) -> _Items:
    """Take references to the device data of ``items`` (after :func:`xla_sync`: no pending
    work) and put the transfers that read them into ``deferred``; return the items that must
    be transferred now.

    XLA device buffers are immutable: an in-place update, an optimizer step or a sync gives a
    tensor a new buffer, and a reference keeps the old one alive, so what a deferred transfer
    reads is the state at the call. The one thing that could take the buffer meanwhile is
    donation (input/output aliasing), which the reference rules out for step-barrier donation
    (``XLA_ENABLE_PARAM_ALIASING``; see :func:`data_references`). A buffer a user marked for
    donation (``_set_buffer_donation``) is donated whatever its tag: such a tensor, one still
    holding host data, and one that cannot be referenced are transferred at the call (told
    once, at INFO).

    Host entries: a split tensor gets a ``_CpuShards`` whose shard list the transfer fills
    (one replica of each local shard, as :func:`stage_xla_shards`), any other an empty host
    tensor of its shape that the transfer points at the transferred data. Nothing may read
    them before the transfers ran.
    """
    if not items:
        return items
    srcs, index = unique(items)
    refs = data_references(srcs)
    donation = compat.xla_buffer_donation_fn()
    query = _sharding_query()
    if query is None:
        return items
    kind_of, replicated = query
    now: set = set()
    split: List[Tuple[torch.Tensor, Any]] = []
    whole: List[Tuple[torch.Tensor, torch.Tensor]] = []
    entry: Dict[int, Any] = {}
    cpu_shards = compat.xla_cpu_shards()[0]
    for k, (t, ref) in enumerate(zip(srcs, refs)):
        if ref is None:  # host data (handed back without a transfer) or data that cannot be referenced
            if _has_device_data(t):
                _tell_once("ref", "async_ckpt: an XLA tensor whose device data cannot be referenced (no "
                           "sharding annotation) is transferred while save_async waits")
            now.add(k)
            continue
        try:
            donated = bool(donation(ref))
        except Exception:  # noqa: BLE001 - unknown: take the safe side
            donated = True
        if donated:
            _tell_once("donation", "async_ckpt: XLA tensors marked for buffer donation (_set_buffer_donation) "
                       "are transferred while save_async waits: a donated buffer cannot be read later")
            now.add(k)
            continue
        if _split(ref, kind_of, replicated):
            cs = cpu_shards(shards=[], global_shape=t.shape)
            split.append((ref, cs))
            entry[k] = cs
        else:
            ph = torch.empty(t.shape, dtype=t.dtype)
            whole.append((ref, ph))
            entry[k] = ph
    if split:
        chunk: List[Tuple[torch.Tensor, Any]] = []
        size = 0
        for ref, cs in split:
            chunk.append((ref, cs))
            size += ref.nbytes
            if size >= DEFER_CHUNK_BYTES:
                deferred.append(_shards_transfer(chunk))
                chunk, size = [], 0
        if chunk:
            deferred.append(_shards_transfer(chunk))
    if whole:
        deferred.append(_whole_transfer(whole))
    rest: _Items = []
    for i, t in items:
        k = index[id(t)]
        if k in now:
            rest.append((i, t))
        else:
            host[i] = entry[k]
    return rest


def _shards_transfer(pairs: List[Tuple[torch.Tensor, Any]]) -> Callable[[], None]:
    def run() -> None:
        got = stage_xla_shards([ref for ref, _ in pairs])
        for (_, cs), g in zip(pairs, got):
            cs.shards[:] = g.shards
        pairs.clear()  # drop the references: their buffers can go

    return run


def _whole_transfer(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    def run() -> None:
        got = compat.xla_get_cpu_tensors([ref for ref, _ in pairs])
        with torch.no_grad():
            for (_, ph), g in zip(pairs, got):
                if g.dtype != ph.dtype or g.shape != ph.shape:
                    raise RuntimeError(f"torch_xla transferred a {g.dtype} {tuple(g.shape)} tensor for a "
                                       f"{ph.dtype} {tuple(ph.shape)} one")
                ph.set_(g.untyped_storage(), g.storage_offset(), g.size(), g.stride())  # no copy
        pairs.clear()

    return run


# ---- small tensors by buffer address -------------------------------------------------------

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


def _buffer_address_of() -> Optional[Callable[[torch.Tensor], int]]:
    try:
        return compat.xla_buffer_pointer_fn()
    except Exception:  # torch_xla without the buffer-pointer API
        return None


def _probe_ok(t: torch.Tensor, addr: int) -> bool:
    """Whether DLPack shows ``t``'s buffer as row-major host memory starting at ``addr``."""
    try:
        v = compat.from_dlpack(compat.xla_to_dlpack_fn()(t))
    except Exception:  # no DLPack view: the probe fails, the slower path is used
        return False
    return v.is_cpu and v.data_ptr() == addr and v.shape == t.shape and v.dtype == t.dtype and v.is_contiguous()


class XlaPendingWork(Exception):
    """A small tensor's buffer address could not be read before a sync: it may have pending
    work. The caller runs :func:`xla_sync` and calls :meth:`XlaGather.stage` again."""


class XlaGather:
    """Stages the small tensors of XLA state dicts by address (see the module docstring).

    Remembers the layout of the last state dict, so a training loop's repeated saves only read
    the addresses, gather and hand out the slab's cached views."""

    def __init__(self, small_max: int) -> None:
        self.small_max = small_max
        self._layout: Optional[_Layout] = None
        self._address_of = _buffer_address_of()
        #: the last save found pending work, so sync before reading until a sync finds none
        #: (XLA views, for one, always have some); kept by :meth:`XlaStaging.small_first`
        self.sync_first = False

    def stage(self, pool: HostBufferPool, items: _Items, host: List[Optional[torch.Tensor]], leases: List[Lease],
              synced: bool = True) -> _Items:
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


# ---- one stager's XLA state ----------------------------------------------------------------


class XlaStaging:
    """The XLA part of one stager: what it stages at once, and what it remembers (the
    gather's last layout, whether to sync before reading addresses)."""

    def __init__(self, small_max: int) -> None:
        self.gather = XlaGather(small_max)

    def small_first(self, pool: HostBufferPool, items: _Items, host: List[Optional[torch.Tensor]],
                    leases: List[Lease]) -> _Items:
        """Small tensors by buffer address, before any pending-work check; the rest, returned,
        are synced if they need it. When a small one has pending work, everything is synced
        and the gather runs again; later saves then sync first, until a sync finds nothing
        pending."""
        gather_ = self.gather
        if not gather_.sync_first:
            try:
                rest = gather_.stage(pool, items, host, leases, synced=False)
            except XlaPendingWork:
                pass
            else:
                if rest:
                    xla_sync([t for _, t in rest])
                return rest
        gather_.sync_first = xla_sync([t for _, t in items])
        return gather_.stage(pool, items, host, leases)

    def stage_direct(self, pool: HostBufferPool, items: _Items, host: List[Optional[torch.Tensor]],
                     leases: List[Lease], deferred: Optional[List[Callable[[], None]]] = None,
                     ) -> Tuple[_Items, bool, bool]:
        """Wait for launched executions, then stage into ``host`` what is copied at once: in
        SPMD mode everything (:func:`stage_spmd`), otherwise small tensors by address.

        ``deferred``: see :func:`stage_spmd` (SPMD mode only).

        Returns:
            ``(rest, shards, spmd)``: the tensors left (none in SPMD mode; pending work done),
            whether SPMD shards were staged, and whether SPMD mode staged them.
        """
        xla_wait()
        if _spmd():
            return [], stage_spmd(items, host, deferred), True
        return self.small_first(pool, items, host, leases), False, False
