"""What a read of a step reads where, worked out before anything is read: the pieces
:func:`~.read_exec.execute` reads.

The direct restore (:mod:`.read_targets`): :func:`plan_records` gives, per data file, the records
of the targets' items (``RecordRead``: where each lies, and whether its data goes straight into
its target, is read with its neighbours and scattered, takes the slow path through the buffer,
or is a non-tensor item), and raises :class:`Unsupported` for anything the direct restore does
not handle (nothing is read by then). :func:`file_ranges` cuts each file into a tiling of pieces
(``RangeRead``): straight into a target, at most ``DIRECT_CHUNK_BYTES`` each, or into a
per-thread buffer, about ``BUFFER_CHUNK_BYTES`` at a time, cut at record boundaries.
:func:`assign_arrivals` gives each buffered piece the large records whose head or tail it
reads. :class:`Probe` and :class:`Arrived` hold those bytes (to find or confirm where a large
record's data lies).

DCP's reader (:mod:`.dcp_adapters`): :func:`record_pieces` gives the runs of records that hold
the byte ranges a load plan needs, as pieces into fresh buffers.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ..addresses import byte_view, host_bytes
from ..format.dcp_layout import flatten_target
from ..format.manifest import FileRecord
from ..format.torch_record import data_start as record_data_start
from .read_exec import OpenFiles, Piece

#: Largest single read straight into a target (a big tensor is read as several, in parallel).
DIRECT_CHUNK_BYTES = 16 * 2**20
#: Reads into the per-thread buffer are about this size (longer only for one longer record).
BUFFER_CHUNK_BYTES = 8 * 2**20


class Unsupported(Exception):
    """The checkpoint or target is not one :func:`plan_records` handles (nothing touched yet)."""


@dataclass
class RecordRead:
    """One item of one file: where it lies and what becomes of it."""

    fqn: str
    start: int  # in the file
    length: int
    kind: str  # "direct" | "small" | "slow" | "bytes"
    target: Optional[torch.Tensor] = None
    flat: Optional[torch.Tensor] = None  # the target's bytes (uint8, 1-D), contiguous targets only
    data_start: int = -1  # "direct": where the tensor's data starts in the file
    own: bool = True  # target is the caller's tensor (False: a device target's host stand-in)
    arrived: Optional[Arrived] = None  # "direct", data_start from the manifest: its head and tail bytes
    loaded: Optional[torch.Tensor] = None  # "slow": the record read by torch.load ahead of the writes (staged)
    #: the caller's tensor where ``target`` is a private one (its memory overlaps an earlier key's
    #: target): copied there once every read is done, in key order (``order``)
    into: Optional[torch.Tensor] = None
    order: int = 0


@dataclass
class RangeRead(Piece):
    """A piece of a direct restore: straight into a target (``dest``), or into the reading
    thread's buffer, then scattered into the targets of the records inside it."""

    recs: List[RecordRead] = field(default_factory=list)  # records inside [start, end) (buffered)
    arrivals: List[RecordRead] = field(default_factory=list)  # direct records whose head or tail it reads


def is_device(t: torch.Tensor) -> bool:
    """A target read through a host stand-in (:class:`~.device_targets.DeviceTargets`): an XLA or CUDA tensor."""
    return t.device.type in ("xla", "cuda")


def device_supported(t: torch.Tensor) -> bool:
    """Whether the device tensor ``t`` can be restored through a stand-in: strided, not
    quantized, and (XLA) this process is not in SPMD mode."""
    if t.layout != torch.strided or t.is_quantized:
        return False
    if t.device.type == "cuda":
        return True
    try:
        import torch_xla.runtime as xr

        return not xr.is_spmd()
    except Exception:  # noqa: BLE001 - no torch_xla (or an older one): not a target this path reads
        return False


def _plain_target(t: torch.Tensor) -> bool:
    return t.is_cpu and t.layout == torch.strided and not t.is_quantized


def _contiguous_bytes(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t``'s memory as a flat uint8 tensor, for a contiguous tensor without conjugate or
    negative bits; else None. A view of ``t`` where writing through one is allowed, else (an
    inference tensor) a tensor over its address that does not own the memory.

    A contiguous tensor may have any stride on a dimension of size 1 (a one-element view
    ``w[:, 0]`` of a ``(1, N)`` matrix: stride ``N``), which ``view(-1)`` keeps; its memory is
    still dense from its first element, so it is taken with stride 1."""
    if not t.is_contiguous() or t.is_conj() or t.is_neg() or t.numel() == 0:
        return None
    if t.is_inference():
        return host_bytes(t.data_ptr(), t.numel() * t.element_size())
    flat = t if t.dim() == 1 else t.view(-1)
    if flat.stride(0) != 1:  # one element under any stride: taken with stride 1
        flat = t.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def _overlapping(flat: Dict[str, Any], md: Dict[str, Any]) -> Set[str]:
    """The keys whose CPU target tensor's memory overlaps that of a key before them (tied
    weights, overlapping views): in each group of targets that overlap, all but the first."""
    spans: List[Tuple[int, int, int, str]] = []
    for i, (fqn, v) in enumerate(flat.items()):
        if isinstance(v, torch.Tensor) and fqn in md and v.is_cpu and v.layout == torch.strided and v.numel():
            if v.is_contiguous():
                extent = v.numel()
            else:
                extent = 1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride()))
            lo = v.data_ptr()
            spans.append((lo, lo + extent * v.element_size(), i, fqn))
    spans.sort()
    out: Set[str] = set()
    group: List[Tuple[int, str]] = []
    end = -1
    for lo, hi, i, fqn in spans + [(2**64, 2**64, -1, "")]:
        if lo >= end:  # a new group starts: the last one, if several, keeps its first key only
            if len(group) > 1:
                out.update(f for _, f in sorted(group)[1:])
            group, end = [], hi
        group.append((i, fqn))
        end = max(end, hi)
    return out


def plan_records(state_dict: Dict[str, Any], files: Dict[str, FileRecord], metadata: Metadata, direct_min: int,
                 devices: Any, cast: bool = False) -> Tuple[Dict[str, List[RecordRead]], Dict[str, Any], Dict[str, Any]]:
    """The records per data file that the targets in ``state_dict`` are read from.

    Args:
        state_dict: the targets.
        files: the manifest's file records.
        metadata: the step's checked DCP metadata.
        direct_min: tensors of at least this many bytes are read straight into their targets.
        devices: XLA/CUDA targets get host stand-ins here (:class:`~.device_targets.DeviceTargets`).
        cast: a target of another dtype than the checkpoint's is read into a private tensor of
            the checkpoint's dtype, copied (cast) into the target once the reads are done, as
            ``dcp.load`` does (which casts one item at a time).

    Returns:
        ``(records per file in file order, the flattened targets, their key mappings)``.

    Raises:
        Unsupported: a checkpoint or target the direct restore does not handle (nothing read).
    """
    flat, mappings = flatten_target(state_dict, metadata)
    md = metadata.state_dict_metadata
    data = metadata.storage_data
    if not isinstance(data, dict):
        raise Unsupported("no storage data")
    # storage_data by key name: one entry per name (a name stored in several entries is
    # looked up by its full MetadataIndex)
    by_fqn: Dict[str, Tuple[Any, Any]] = {}
    shared = set()
    for idx, info in data.items():
        name = idx.fqn
        if name in by_fqn:
            shared.add(name)
        by_fqn[name] = (idx.offset, info)

    def lookup(fqn: str, offset: Any) -> Any:
        if fqn in shared:
            return data.get(MetadataIndex(fqn, offset))
        got = by_fqn.get(fqn)
        if got is None or (got[0] is None) != (offset is None) or (offset is not None and got[0] != offset):
            return None
        return got[1]

    tied = _overlapping(flat, md)
    per_file: Dict[str, List[RecordRead]] = {}
    for order, (fqn, value) in enumerate(flat.items()):
        m = md.get(fqn)
        if m is None:
            continue  # not in the checkpoint (strict=False): left as it is
        if isinstance(m, BytesStorageMetadata):
            info = lookup(fqn, None)
            if info is None or isinstance(value, torch.Tensor):
                raise Unsupported(fqn)
            rec = RecordRead(fqn, info.offset, info.length, "bytes")
        elif isinstance(m, TensorStorageMetadata):
            if type(value) not in (torch.Tensor, torch.nn.Parameter):
                raise Unsupported(fqn)
            on_device = is_device(value)
            if not (device_supported(value) if on_device else _plain_target(value)):
                raise Unsupported(fqn)
            if len(m.chunks) != 1 or any(m.chunks[0].offsets) or tuple(m.chunks[0].sizes) != tuple(m.size) \
                    or tuple(value.shape) != tuple(m.size) or (value.dtype != m.properties.dtype and not cast):
                raise Unsupported(fqn)
            offsets = m.chunks[0].offsets
            info = lookup(fqn, offsets if type(offsets) is torch.Size else torch.Size(offsets))
            if info is None:
                raise Unsupported(fqn)
            nbytes = value.numel() * value.element_size()
            if nbytes == 0:
                continue  # nothing to read into; the bytes still count for the checksum
            again = on_device and devices.has(value)  # a device target of an earlier key: its stand-in is shared
            if on_device:
                t = devices.stand_in(value)
            else:
                t = value.detach() if type(value) is not torch.Tensor or value.requires_grad else value
            into = None
            if fqn in tied or again or value.dtype != m.properties.dtype:
                # read into private memory, so that what lands there (and is checked) is its own;
                # of the checkpoint's dtype: copied into the target (cast) once the reads are done
                into, t = t, torch.empty(tuple(value.shape), dtype=m.properties.dtype)
                nbytes = t.numel() * t.element_size()
            fb = _contiguous_bytes(t)
            kind = "slow" if fb is None else ("direct" if nbytes >= direct_min else "small")
            rec = RecordRead(fqn, info.offset, info.length, kind, t, fb, own=not on_device and into is None, into=into,
                             order=order)
        else:
            raise Unsupported(fqn)
        per_file.setdefault(info.relative_path, []).append(rec)
    for name, recs in per_file.items():
        if name not in files:
            raise Unsupported(name)  # check_metadata refuses this first; never read unlisted files
        recs.sort(key=lambda r: r.start)
        end = 0
        for r in recs:
            if r.start < end:
                raise Unsupported(f"{name}: overlapping items")  # not a layout we write
            end = r.start + r.length
        if end > files[name].size:
            raise Unsupported(name)
        data_at = files[name].data_at
        for r in recs if data_at else ():
            head = data_at.get(r.start) if r.kind == "direct" else None  # type: ignore[union-attr]
            if head is not None and head + r.flat.numel() <= r.length:  # type: ignore[union-attr]
                r.data_start = r.start + head
    return per_file, flat, mappings


def file_ranges(name: str, size: int, recs: List[RecordRead]) -> List[RangeRead]:
    """The file ``name`` as a tiling of pieces: straight into targets, or through a buffer.

    Args:
        name: the file.
        size: its manifest size.
        recs: its records (:func:`plan_records`), in file order.

    Returns:
        The pieces, in file order.
    """
    direct = [r for r in recs if r.kind == "direct"]
    out: List[RangeRead] = []
    pos = 0
    others = iter([r for r in recs if r.kind != "direct"])
    pending = next(others, None)

    def buffered(lo: int, hi: int) -> None:
        nonlocal pending
        cur = RangeRead(name, lo, lo)
        while True:
            # records wholly inside [lo, hi) go with the range they start in
            nxt = pending if pending is not None and pending.start < hi else None
            stop = nxt.start if nxt is not None else hi
            while stop - cur.end > 0:  # plain bytes up to the next record (or the end)
                room = cur.start + BUFFER_CHUNK_BYTES - cur.end
                if room <= 0:
                    out.append(cur)
                    cur = RangeRead(name, cur.end, cur.end)
                    continue
                cur.end = min(stop, cur.end + room)
            if nxt is None:
                break
            if cur.end > cur.start and cur.end + nxt.length - cur.start > BUFFER_CHUNK_BYTES:
                out.append(cur)
                cur = RangeRead(name, cur.end, cur.end)
            cur.recs.append(nxt)
            cur.end = nxt.start + nxt.length
            pending = next(others, None)
        if cur.end > cur.start:
            out.append(cur)

    for r in direct:
        a = r.data_start
        b = a + r.flat.numel()  # type: ignore[union-attr]
        if a > pos:
            buffered(pos, a)
        mv = byte_view(r.flat)  # type: ignore[arg-type]  # flat is set on every direct record
        for lo in range(a, b, DIRECT_CHUNK_BYTES):
            hi = min(b, lo + DIRECT_CHUNK_BYTES)
            out.append(RangeRead(name, lo, hi, dest=mv[lo - a:hi - a], own=r.own))
        pos = b
    if size > pos:
        buffered(pos, size)
    return out


def assign_arrivals(per_file: Dict[str, List[RecordRead]], tasks: List[RangeRead]) -> None:
    """Give each buffered range the direct records whose head or tail it reads.

    Args:
        per_file: the records per file; those with bytes to gather (:class:`Arrived`) count.
        tasks: the ranges of every file; each buffered one gets its ``arrivals``.
    """
    by_file: Dict[str, List[RecordRead]] = {n: [r for r in recs if r.arrived is not None] for n, recs in per_file.items()}
    ends = {n: [r.start + r.length for r in recs] for n, recs in by_file.items()}
    for task in tasks:
        recs = by_file.get(task.name)
        if task.dest is not None or not recs:
            continue
        k = bisect.bisect_right(ends[task.name], task.start)  # the first record ending after the task's start
        while k < len(recs) and recs[k].start < task.end:
            task.arrivals.append(recs[k])
            k += 1


# ---- the bytes of a large record's ends ----------------------------------------------------------

#: Bytes read at each end of a large record to find where its data lies.
PROBE_BYTES = 4096


class Probe:
    """The bytes of a large record near its ends, peeked once (:meth:`~.read_exec.OpenFiles.peek`:
    compared with the verified bytes when those arrive); other bytes peeked on demand."""

    def __init__(self, opened: OpenFiles, name: str, rec: RecordRead) -> None:
        self.opened, self.name, self.rec = opened, name, rec
        self.windows: List[Tuple[int, bytes]] = []  # (offset in the file, bytes)
        n = min(PROBE_BYTES, rec.length)
        self._fetch(rec.start, n)
        if rec.length > n:
            lo = max(rec.start + n, rec.start + rec.length - PROBE_BYTES)
            self._fetch(lo, rec.start + rec.length - lo)

    def _fetch(self, start: int, n: int) -> bytes:
        data = self.opened.peek(self.name, start, n)
        self.windows.append((start, data))
        return data

    def get(self, lo: int, hi: int) -> bytes:  # record-relative
        a, b = self.rec.start + lo, self.rec.start + hi
        for w0, data in self.windows:
            if w0 <= a and b <= w0 + len(data):
                return data[a - w0:b - w0]
        return self._fetch(a, b - a)


class Arrived:
    """The bytes of a large record around its data (its head, from its start to the data, and
    its tail, from the end of the data to its end), gathered as the reads bring them in, to
    confirm where its data lies when that was taken from the manifest instead of probed."""

    def __init__(self, opened: OpenFiles, name: str, start: int, length: int, data_start: int, nbytes: int) -> None:
        self.opened, self.name, self.start, self.length = opened, name, start, length
        self.data_lo, self.data_hi = data_start, data_start + nbytes  # in the file
        self.head = bytearray(data_start - start)
        self.tail = bytearray(start + length - self.data_hi)
        self._missing = len(self.head) + len(self.tail)
        self._lock = threading.Lock()

    def take(self, lo: int, data: memoryview) -> bool:
        """Keep what of the file's bytes ``data`` (from offset ``lo``) lies in the head or tail;
        whether that completed them (true once, on the call that did)."""
        hi, n = lo + len(data), 0
        for buf, base, end in ((self.head, self.start, self.data_lo), (self.tail, self.data_hi, self.start + self.length)):
            a, b = max(lo, base), min(hi, end)
            if a < b:
                buf[a - base:b - base] = data[a - lo:b - lo]
                n += b - a
        if not n:
            return False
        with self._lock:
            self._missing -= n
            return self._missing == 0

    def get(self, lo: int, hi: int) -> bytes:  # record-relative
        a, b = self.start + lo, self.start + hi
        if self.start <= a and b <= self.data_lo:
            return bytes(self.head[a - self.start:b - self.start])
        if self.data_hi <= a and b <= self.start + self.length:
            return bytes(self.tail[a - self.data_hi:b - self.data_hi])
        return self.opened.peek(self.name, a, b - a)  # not where zipfile looks in a torch.save record

    def record(self, data: torch.Tensor) -> memoryview:
        """The whole record: the head and tail gathered, ``data`` (its bytes, flat uint8) between."""
        out = bytearray(self.length)
        h, n = len(self.head), self.data_hi - self.data_lo
        out[:h] = self.head
        out[h:h + n] = byte_view(data)
        out[h + n:] = self.tail
        return memoryview(out)

    def agrees(self, dtype: torch.dtype, shape: Tuple[int, ...]) -> bool:
        """Whether the record, parsed from the bytes gathered, has its data where it was said to."""
        return record_data_start(self.get, self.length, dtype, shape) == self.data_lo - self.start


# ---- DCP's reader: runs of records -------------------------------------------------------------

def record_pieces(files: Dict[str, FileRecord], wanted: Dict[str, List[Tuple[int, int]]], piece_bytes: int
                  ) -> Tuple[List[Piece], Dict[str, List[int]], Dict[str, Tuple[List[int], List[memoryview]]]]:
    """The records that the byte ranges ``wanted`` lie in, as runs of adjacent records, each
    read into a fresh buffer (a run is one request; a big one is cut into pieces of about
    ``piece_bytes``, read at once).

    Args:
        files: the manifest's records of the files (each listing its records).
        wanted: per file, the ``(offset, length)`` ranges a load needs.
        piece_bytes: the most bytes of one piece.

    Returns:
        ``(pieces, records, runs)``: the pieces to read; per file, the indices of the records
        they cover (each checked against its CRC-32C); per file, where each run starts in the
        file and its buffer.
    """
    pieces: List[Piece] = []
    covered: Dict[str, List[int]] = {}
    out: Dict[str, Tuple[List[int], List[memoryview]]] = {}
    for name, spans in wanted.items():
        records = files[name].records
        assert records is not None
        starts = [0, *itertools.accumulate(n for n, _ in records)]  # starts[-1]: the file's size
        needed: Set[int] = set()
        for offset, length in spans:
            first = max(0, bisect.bisect_right(starts, offset) - 1)
            last = max(first + 1, bisect.bisect_left(starts, offset + length))
            needed.update(range(first, min(last, len(records))))
        runs: List[List[int]] = []  # [first record, last record + 1]
        for k in sorted(needed):
            if runs and runs[-1][1] == k:
                runs[-1][1] = k + 1
            else:
                runs.append([k, k + 1])
        covered[name] = sorted(needed)
        # not zero-filled: every byte is overwritten by the reads (or the file is too short)
        bufs = [byte_view(torch.empty(starts[b] - starts[a], dtype=torch.uint8)) for a, b in runs]
        out[name] = ([starts[a] for a, _ in runs], bufs)
        for buf, (a, _) in zip(bufs, runs):
            for lo in range(0, len(buf), piece_bytes):
                hi = min(len(buf), lo + piece_bytes)
                pieces.append(Piece(name, starts[a] + lo, starts[a] + hi, buf[lo:hi]))
    return pieces, covered, out
