"""Replicated state across ranks: which rank stages and writes, and which rank reads, each item
that several ranks hold.

With DDP, HSDP replicas or any state every rank holds, each rank used to stage a full copy (and
DCP's de-duplication then wrote one of them), and every rank read all of it at restore. Here the
ranks agree which rank takes each replicated item, balanced by bytes:

* **save** (:class:`SaveShares`, training thread): an item is a plain tensor of at least
  :data:`MIN_SHARED_BYTES` (not inside a list or tuple, which DCP may store whole) or one DTensor
  shard, named by its key, dtype, shape and offsets in the global tensor; items that several
  ranks hold alike are *replicated*, and each goes to the holder with the least load so far
  (its own unshared bytes counted first), largest first. Each rank stages only what it takes
  (the others are left out of its snapshot), so its stall and its write are its share, and DCP
  writes every item once. The assignment is cached; one small exchange per save (each rank's
  structure fingerprint) decides whether it still holds, one more only when it does not.
* **divergence** (:func:`fingerprints`, :class:`DroppedSamples`, :func:`diverged`): values that
  several ranks save under one key but that differ between them (a per-rank buffer, BatchNorm
  statistics with ``broadcast_buffers=False``) are found from fingerprints that ride in the
  exchange of the write's outcome: small values hashed whole, large plain tensors by a sample
  (:func:`sample`) taken from the host copy on the writer thread, or, where another rank stages
  the tensor, at the call from the live tensor.
* **restore** (:func:`read_assignment`): a tensor every rank's target holds as a plain tensor,
  stored as one whole chunk, is read by one rank (balanced the same way) and sent to the others
  (:meth:`~async_ckpt.ranks.exchange.GroupExchange.broadcast`).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Set, Tuple

import torch

from .. import compat
from ..addresses import byte_view
from ..format.crc import crc32c
from ..format.dcp_layout import flatten

#: replicated tensors smaller than this are staged by every rank (DCP de-duplicates their writes)
MIN_SHARED_BYTES = 64 * 2**10

Item = Tuple[str, Tuple[int, ...], int]  # (key, offsets in the global tensor, bytes)


def assign(held: Sequence[Sequence[Item]]) -> Dict[Tuple[str, Tuple[int, ...]], int]:
    """Which rank takes each item several ranks hold (``held[r]``: rank ``r``'s items).

    Balanced by bytes: each rank starts with the bytes only it holds; replicated items, largest
    first (then by key), go to the least-loaded holder (then the lowest rank). Deterministic:
    every rank computes the same answer from the same lists.

    Args:
        held: per rank, its items.

    Returns:
        ``(key, offsets)`` -> rank, for the replicated items only.
    """
    holders: Dict[Tuple[str, Tuple[int, ...], int], List[int]] = {}
    for r, items in enumerate(held):
        for key, offsets, n in items:
            holders.setdefault((key, tuple(offsets), n), []).append(r)
    load = [0] * len(held)
    shared = []
    for (key, offsets, n), ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += n
        else:
            shared.append((key, offsets, n, ranks))
    out: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    for key, offsets, n, ranks in sorted(shared, key=lambda x: (-x[2], x[0], x[1])):
        r = min(ranks, key=lambda q: (load[q], q))
        load[r] += n
        out[(key, offsets)] = r
    return out


def _fingerprint(items: Sequence[Hashable]) -> int:
    """A 62-bit fingerprint of ``items`` (the same on every rank for equal lists)."""
    h = hashlib.blake2b(repr(list(items)).encode(), digest_size=8)
    return struct.unpack("<q", h.digest())[0] & (2**62 - 1)


_OFFSETS: Dict[Any, Tuple[int, ...]] = {}  # (global shape, mesh, placements) -> this rank's shard offsets


def _offsets(spec: Any) -> Tuple[int, ...]:
    """:func:`~async_ckpt.compat.dtensor_global_offset`, remembered per (shape, mesh, placements):
    torch computes it in Python, once per DTensor per save otherwise (an FSDP2 model's hundreds)."""
    try:
        key: Any = (tuple(spec.shape), spec.mesh, tuple(spec.placements))
        hash(key)
    except TypeError:
        return tuple(int(o) for o in compat.dtensor_global_offset(spec))
    got = _OFFSETS.get(key)
    if got is None:
        if len(_OFFSETS) > 65536:
            _OFFSETS.clear()
        got = _OFFSETS[key] = tuple(int(o) for o in compat.dtensor_global_offset(spec))
    return got


def plan_items(plan: Any) -> List[Tuple[int, Item]]:
    """``(plan index, item)`` of the tensors of a staging plan that may be replicated: at least
    :data:`MIN_SHARED_BYTES`, not inside a list or tuple; a DTensor's shard named by its offsets.
    An item's key is the tensor's key with its dtype and shape: tensors of equal bytes under one
    key but of another dtype or shape on another rank are not one replicated tensor."""
    specs = plan.dtensor_specs()
    nested = plan.in_sequence()
    out = []
    for i, (key, t) in enumerate(zip(plan.keys, plan.tensors)):
        n = t.numel() * t.element_size()
        if n < MIN_SHARED_BYTES or key in nested:
            continue
        spec = specs.get(i)
        if spec is not None:
            try:
                offsets = _offsets(spec)
            except Exception:  # noqa: BLE001 - a torch whose private helper moved: staged by its holder, as before
                continue
        elif type(t) is torch.Tensor:
            offsets = (0,) * t.dim()
        else:
            continue
        out.append((i, (f"{key}\0{t.dtype}\0{tuple(t.shape)}", tuple(int(o) for o in offsets), int(n))))
    return out


class SaveShares:
    """One manager's agreement of who stages each replicated item (see the module docstring).

    The assignment is kept with every rank's fingerprint of its items; a save whose fingerprints
    all match reuses it. When an assignment finds nothing that several ranks hold (a fully
    sharded model), the exchanges stop for good: a collective in the stall costs the ranks' skew,
    and staging everything is what that state needs anyway.
    """

    def __init__(self) -> None:
        self._fingerprints: Optional[List[int]] = None
        self._assignment: Dict[Tuple[str, Tuple[int, ...]], int] = {}
        #: exchanges made by the last :meth:`drops` (1 while the assignment holds, 2 when remade)
        self.last_exchanges = 0
        #: the first assignment found nothing several ranks hold: no exchange any more
        self.dormant = False

    def drops(self, exchange: Any, plan: Optional[Any]) -> Set[int]:
        """The plan indices this rank does not stage (other ranks take them). Collective.

        Args:
            exchange: the ranks (a :class:`~async_ckpt.ranks.exchange.Exchange`).
            plan: this rank's staging plan; ``None`` when planning failed here (every rank then
                stages everything, and this rank raises its error).

        Returns:
            Plan indices to leave out of this rank's snapshot.
        """
        if self.dormant:
            self.last_exchanges = 0
            return set()
        items = plan_items(plan) if plan is not None else []
        mine = _fingerprint([it for _, it in items]) if plan is not None else -1
        prints = exchange.gather_ints(mine)
        self.last_exchanges = 1
        if any(p < 0 for p in prints):  # a rank could not plan: nothing is left out anywhere
            return set()
        if prints != self._fingerprints:
            held = exchange.gather_objects([it for _, it in items])
            self.last_exchanges = 2
            self._assignment = assign(held)
            self._fingerprints = prints
            # nothing replicated (FSDP2, tensor parallel): no more exchanges for this manager; every
            # rank decides so from the same lists, and staging everything is always correct
            self.dormant = not self._assignment
        rank = exchange.rank
        return {i for i, (key, offsets, _) in items
                if self._assignment.get((key, offsets), rank) != rank}


def read_assignment(held: Sequence[Sequence[Item]]) -> Dict[Tuple[str, Tuple[int, ...]], int]:
    """Which rank reads each tensor that every rank's restore target holds (the others receive it).

    Args:
        held: per rank, the plain tensors of its target that the checkpoint stores whole.

    Returns:
        ``(key, offsets)`` -> the reading rank, for the tensors every rank holds.
    """
    everyone = len(held)
    count: Dict[Tuple[str, Tuple[int, ...], int], int] = {}
    for items in held:
        for key, offsets, n in items:
            k = (key, tuple(offsets), n)
            count[k] = count.get(k, 0) + 1
    common = [[it for it in items if count[(it[0], tuple(it[1]), it[2])] == everyone] for items in held]
    return assign(common)


def restore_items(state_dict: Any, metadata: Any) -> Dict[Item, torch.Tensor]:
    """This rank's candidates for a read by one rank: the plain tensors of its restore target,
    of at least :data:`MIN_SHARED_BYTES`, that the checkpoint stores as one whole chunk of the
    same shape and dtype (item key: the flattened key and the dtype)."""
    flat, _ = flatten(state_dict)
    entries = metadata.state_dict_metadata
    out: Dict[Item, torch.Tensor] = {}
    for fqn, t in flat.items():
        if type(t) is not torch.Tensor or t.numel() * t.element_size() < MIN_SHARED_BYTES:
            continue
        entry = entries.get(fqn)
        chunks = getattr(entry, "chunks", None)
        if not chunks or len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(t.shape) \
                or any(chunks[0].offsets) or entry.properties.dtype != t.dtype:
            continue
        out[(f"{fqn}\0{t.dtype}", (0,) * t.dim(), t.numel() * t.element_size())] = t
    return out


#: each item starts at a multiple of this in a send buffer (a view as any dtype needs alignment)
_ALIGN = 64


def send_replicas(group: Any, rank: int, world_size: int, readers: Dict[Tuple[str, Tuple[int, ...]], int],
                  mine: Dict[Item, torch.Tensor], collective: Callable[[Callable[[], None], str], None]
                  ) -> Optional[str]:
    """After a read by one rank per item: each reading rank sends what it read, in one buffer
    per rank (gloo ``broadcast`` over ``group``, then its CRC32C), and every other rank that
    holds an item copies it into its tensor once the buffer's CRC matched. Collective: every
    rank takes part in every broadcast whatever fails locally.

    Args:
        group: the process group (the manager's own gloo group).
        rank: this rank in ``group``.
        world_size: the ranks in ``group``.
        readers: :func:`read_assignment`'s result.
        mine: this rank's :func:`restore_items`.
        collective: runs one broadcast as an exchange of the coordinator
            (:meth:`~async_ckpt.ranks.exchange.GroupExchange.collective`).

    Returns:
        ``None``, or what went wrong here (a buffer this rank could not pack, one whose CRC did
        not match or that its sender could not pack, one it could not copy out).

    Raises:
        CoordinationError: a broadcast failed (another rank died or did not take part in time).
    """
    import torch.distributed as dist

    by_key = {(k, o): (n, t) for (k, o, n), t in mine.items()}
    problems: List[str] = []
    for r in range(world_size):
        items = sorted((k, o) for (k, o), q in readers.items() if q == r)
        if not items:
            continue
        sizes = [by_key[it][0] for it in items]  # every rank holds every item read by one rank
        starts, end = [], 0
        for n in sizes:
            starts.append(end)
            end += -(-n // _ALIGN) * _ALIGN
        buf = torch.empty(end, dtype=torch.uint8)
        sent = 0
        if r == rank:
            try:
                for it, at, n in zip(items, starts, sizes):
                    src = by_key[it][1].detach().contiguous().view(-1).view(torch.uint8)
                    buf[at:at + n].copy_(src)
                sent = crc32c(byte_view(buf))
            except Exception as exc:  # noqa: BLE001 - still sent (marked), reported by every rank
                problems.append(f"rank {rank} could not send what it read: {type(exc).__name__}: {exc}")
                sent = -1
        crc = torch.tensor([sent], dtype=torch.int64)
        for t in (buf, crc):
            collective(functools.partial(dist.broadcast, t, group=group, group_src=r), "sending restored tensors")
        if r == rank:
            continue
        expected = int(crc.item())
        if expected < 0:
            problems.append(f"rank {rank}: rank {r} could not send the {len(items)} tensors it read")
            continue
        got = crc32c(byte_view(buf))
        if got != expected:
            problems.append(f"rank {rank}: the {len(items)} tensors sent by rank {r} arrived damaged (crc32c "
                            f"{got:#010x}, sent {expected:#010x}); nothing was copied from them")
            continue
        try:
            for it, at, n in zip(items, starts, sizes):
                t = by_key[it][1]
                with torch.no_grad():
                    t.copy_(buf[at:at + n].view(t.dtype).view(t.shape))
        except Exception as exc:  # noqa: BLE001 - reported by every rank
            problems.append(f"rank {rank} could not copy what rank {r} sent: {type(exc).__name__}: {exc}")
    return "; ".join(problems) or None


#: a large tensor's fingerprint covers this many runs of elements, evenly spaced over it (the
#: first and the last element included; 0: large tensors are not compared, which
#: benchmarks/bench_multirank.py sets for its reference) ...
SAMPLE_RUNS = 32
#: ... of this many elements each (1024 elements in all: a few KiB, whatever the tensor's size)
SAMPLE_RUN = 32

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _sample_bytes(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The bytes of ``t`` that :func:`sample` copies, as a ``uint8`` view of ``t`` (no copy): the
    whole tensor when it is small, else :data:`SAMPLE_RUNS` runs of :data:`SAMPLE_RUN` elements
    evenly spaced over it (first and last element included). ``None`` when ``t`` is not
    contiguous or has no byte view (then :func:`sample` gathers its elements)."""
    if not t.is_contiguous():
        return None
    n, size = t.numel(), t.element_size()
    runs, run = max(2, SAMPLE_RUNS), SAMPLE_RUN
    try:
        raw = t.detach().view(torch.uint8) if t.dim() else t.detach().view(1).view(torch.uint8)
    except Exception:  # noqa: BLE001 - a dtype without a byte view (quantized, say)
        return None
    if n <= runs * run:
        return raw.as_strided((n * size,), (1,))
    step = (n - run) // (runs - 1)
    return raw.as_strided((runs, run * size), (step * size, 1))


def sample(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` that its fingerprint covers, in a new tensor on ``t``'s device:
    :data:`SAMPLE_RUNS` runs of :data:`SAMPLE_RUN` elements evenly spaced in its element order
    (all of it when it is smaller). The same for equal tensors whatever their strides; bits are
    copied as they are.

    Args:
        t: a plain tensor.

    Returns:
        The sample (contiguous: its bytes are the sampled elements' bytes in element order).
    """
    taken = _sample_bytes(t)
    if taken is not None:
        return taken.clone().view(-1)
    kind = _INT_OF_SIZE.get(t.element_size())
    v = t.detach()
    if kind is not None and v.dtype != kind and not v.is_complex():
        v = v.view(kind)
    n = v.numel()
    runs, run = max(2, SAMPLE_RUNS), SAMPLE_RUN
    if n <= runs * run:
        out = v.reshape(-1).clone()
    else:
        step = (n - run) // (runs - 1)
        index = (torch.arange(runs, device=v.device)[:, None] * step
                 + torch.arange(run, device=v.device)[None, :]).view(-1)
        out = torch.take(v, index)
    return out


def _header(dtype: torch.dtype, shape: Sequence[int]) -> bytes:
    return f"{dtype}{tuple(shape)}".encode()


def _print_of(header: bytes, taken: torch.Tensor) -> int:
    """XXH3-64 of a tensor's :func:`_header` (dtype and shape) and of the bytes of ``taken`` (a
    host tensor: all of a small tensor, or its :func:`sample`)."""
    import xxhash

    h = xxhash.xxh3_64(header)  # never hash(): salted per process
    if taken.numel():
        h.update(byte_view(taken.contiguous()))
    return h.intdigest()


def fingerprints(state_dict: Any) -> Dict[str, int]:
    """Cheap fingerprints of a snapshot's values: per flattened key, XXH3-64 of the bytes of a
    tensor under :data:`MIN_SHARED_BYTES` (contiguous, on the host), of the :func:`sample` of a
    larger plain host tensor, of an int, float, string or bytes (pickled values are left out: a
    set's pickle differs from process to process). Gathered with the write's outcome (no
    exchange of its own) to find "replicated" values that differ between ranks (:func:`diverged`).
    DTensor shards are left out (ranks hold different shards under one key)."""
    import xxhash

    flat, _ = flatten(state_dict)
    out: Dict[str, int] = {}
    for fqn, v in flat.items():
        if type(v) is torch.Tensor:
            if not v.is_cpu:
                continue
            if v.numel() * v.element_size() >= MIN_SHARED_BYTES:
                if not SAMPLE_RUNS:
                    continue
                try:
                    out[fqn] = _print_of(_header(v.dtype, v.shape), sample(v))
                except Exception:  # noqa: BLE001 - a dtype without a copy kernel: not compared, never a failed save
                    continue
            elif v.is_contiguous():
                out[fqn] = _print_of(_header(v.dtype, v.shape), v)
        elif type(v) in (int, float, str, bytes, bool) or v is None:  # not pickles: a set's differs per process
            out[fqn] = xxhash.xxh3_64_intdigest(repr(v).encode())
    return out


class DroppedSamples:
    """Samples (:func:`sample`) of the plain tensors this rank leaves to other ranks (their
    holders stage them): taken at the call, on the training thread, from the live tensors, so
    that the writer thread can fingerprint them as of the call, as its peers fingerprint their
    host copies. The samples of the contiguous tensors of one device and dtype are gathered by
    one batched copy (a strided view of each tensor, stacked into the rows of one buffer; a CUDA
    device's buffers then go to the host in one copy each on its stream, without waiting): the
    call costs one view per tensor. Others are sampled one by one. XLA tensors are
    not sampled (their values are not compared).

    Args:
        plan: this rank's staging plan.
        drop: the plan indices this rank does not stage (:meth:`SaveShares.drops`).
    """

    def __init__(self, plan: Any, drop: Set[int]) -> None:
        drop = drop if SAMPLE_RUNS else set()
        specs = plan.dtensor_specs() if drop else {}
        #: per buffer: the keys, dtypes and shapes of the tensors whose samples are its rows
        self._taken: List[Tuple[List[str], List[Tuple[torch.dtype, torch.Size]], torch.Tensor]] = []
        self._device: List[torch.Tensor] = []  # device buffers, alive until their copies are done
        self._events: List[Any] = []
        self._prints: Optional[Dict[str, int]] = None
        runs, run = max(2, SAMPLE_RUNS), SAMPLE_RUN
        tensors, keys = plan.tensors, plan.keys
        # (device index (-1: CPU), dtype) -> keys, (dtype, shape) and sample views of its tensors
        batched: Dict[Tuple[int, torch.dtype], Tuple[List[str], List[Tuple[torch.dtype, torch.Size]],
                                                     List[torch.Tensor]]] = {}
        alone: List[Tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for i in sorted(drop):
                t = tensors[i]
                if i in specs or type(t) is not torch.Tensor or not (t.is_cpu or t.is_cuda):
                    continue  # a DTensor shard (ranks hold different ones), XLA: not compared
                n = t.numel()
                if n <= runs * run or not t.is_contiguous():
                    alone.append((keys[i], t))
                    continue
                group = batched.get((t.get_device(), t.dtype))
                if group is None:
                    group = batched[(t.get_device(), t.dtype)] = ([], [], [])
                group[0].append(keys[i])
                group[1].append((t.dtype, t.shape))
                group[2].append(t.detach().as_strided((runs, run), ((n - run) // (runs - 1), 1)))
            events: Dict[int, None] = {}
            for (dev, dtype), (names, kinds, srcs) in batched.items():
                buf = torch.empty((len(srcs), runs, run), dtype=dtype, device=srcs[0].device)
                try:
                    torch.stack(srcs, out=buf)
                except Exception:  # noqa: BLE001 - a dtype without a stack kernel: one by one
                    alone += [(key, src) for key, src in zip(names, srcs)]
                    continue
                self._add(names, kinds, buf, dev, events)
            for key, t in alone:
                try:
                    s = sample(t).view(1, -1)
                except Exception:  # noqa: BLE001 - a dtype without a copy kernel: not compared, never a failed save
                    continue
                self._add([key], [(t.dtype, t.shape)], s, t.get_device(), events)
        for dev in events:  # the copies are queued on each device's current stream: one event each
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            self._events.append(ev)

    def _add(self, names: List[str], kinds: List[Tuple[torch.dtype, torch.Size]], buf: torch.Tensor, dev: int,
             events: Dict[int, None]) -> None:
        """Keep ``buf`` (row ``k``: the sample of ``names[k]``), sent to the host if on CUDA."""
        if dev >= 0:
            self._device.append(buf)
            buf = buf.to("cpu", non_blocking=True)
            events[dev] = None
        self._taken.append((names, kinds, buf))

    def prints(self) -> Dict[str, int]:
        """The samples' fingerprints, by key (writer thread; waits for the CUDA copies).

        Returns:
            Key -> fingerprint, as :func:`fingerprints` gives it for a host copy of the tensor.
        """
        if self._prints is None:
            for ev in self._events:
                ev.synchronize()
            self._prints = {key: _print_of(_header(*kind), buf[k])
                            for names, kinds, buf in self._taken for k, (key, kind) in enumerate(zip(names, kinds))}
            self._device.clear()
            self._taken.clear()
        return dict(self._prints)


def diverged(per_rank: Sequence[Dict[str, int]]) -> Dict[str, List[int]]:
    """The keys several ranks saved with different values (:func:`fingerprints` and
    :meth:`DroppedSamples.prints` by rank), each with the ranks that hold it: the checkpoint
    holds one of those ranks' values (the rank that staged a large replicated tensor; for others,
    the one DCP's de-duplication kept)."""
    seen: Dict[str, Dict[int, List[int]]] = {}
    for r, prints in enumerate(per_rank):
        for key, h in prints.items():
            seen.setdefault(key, {}).setdefault(h, []).append(r)
    return {key: sorted(r for ranks in by.values() for r in ranks) for key, by in seen.items() if len(by) > 1}
