"""Restore by reading file ranges straight into the target tensors, verified as they arrive.

:func:`load_direct` is the single-process restore of a checkpoint that async_ckpt (or DCP)
wrote, into CPU, XLA or CUDA tensors that already exist. For each data file it reads every byte once, as a
tiling of the file into ranges, in parallel over ``threads``:

* the data of a large tensor record goes straight into the target tensor's memory
  (``preadv`` on local files, ranged reads elsewhere), in pieces of at most
  ``DIRECT_CHUNK_BYTES``;
* everything else (record headers and trailers, small tensors, non-tensor items) is read into a
  per-thread buffer of about ``BUFFER_CHUNK_BYTES``, cut at record boundaries; the small
  tensors in it are copied into their targets by one ``_foreach_copy_`` per buffer;
* each range's CRC-32C is computed on the thread that read it, right after the read, and the
  file's CRC is put together from them (:func:`~.crc.crc32c_combine`) and compared with the
  manifest's before :func:`load_direct` returns.

Where a large record's data begins is taken from the manifest where the writer recorded it
(``FileRecord.data_at``); the record's zip directory and headers, which arrive with the reads
of the file's other bytes, are parsed on the reading threads to confirm it, and a record that
disagrees fails the restore (a :class:`~async_ckpt.errors.CorruptCheckpointError`, raised after
the checksums). Elsewhere (older manifests, plain DCP checkpoints) it is found before the reads,
from small probes of the record's start and end. Non-tensor items are read and decoded first
too, so an unsafe pickle is refused before any tensor is written; the probed bytes are
compared with the verified ones when those arrive.

A failure after the first write leaves the targets partly written: the error raised is a
:class:`~async_ckpt.errors.CheckpointError` whose message says so (``partly_written`` is set
on it). Targets that are not plain contiguous CPU tensors (strided views, conjugate bits) and
records of another layout take a slower path through the buffer (``copy_``), and anything
this module does not handle (sharded checkpoints, DTensors, devices other than the CPU, XLA
and CUDA, custom planners) makes :func:`load_direct` return ``False`` before touching anything,
for DCP to load.

XLA and CUDA targets are read into host stand-ins the same way and put on their devices once
every file is verified (:mod:`.device_targets`), so a failure before that leaves them untouched.
"""

from __future__ import annotations

import bisect
import io
import pickle
import threading
import types
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ... import compat
from ...addresses import host_bytes
from ...errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ...gc_pause import gc_paused
from ..fs import Storage
from ..manifest import FileRecord, crc32c, shown
from .crc import crc32c_concat
from .device_targets import DeviceTargets, is_device
from .device_targets import supported as device_supported
from .reader import close_all, open_step_file
from .record_layout import HEADS, Arrived, Probe, data_start

#: A tensor record at least this large (local files) has its data read straight into the
#: target; smaller ones are read with their neighbours and scattered.
DIRECT_MIN_BYTES = 256 * 2**10
#: The same threshold for remote storage, where every range is a request.
REMOTE_DIRECT_MIN_BYTES = 8 * 2**20
#: Largest single read straight into a target (a big tensor is read as several, in parallel).
DIRECT_CHUNK_BYTES = 16 * 2**20
#: Reads into the per-thread buffer are about this size (longer only for one longer record).
BUFFER_CHUNK_BYTES = 8 * 2**20

PARTLY_WRITTEN = ("the target state dict was partly written with this step's data and must not be "
                  "used as is; restore(..., atomic=True) leaves it untouched on failure")

set_element = compat.dcp_traverse().set_element


class _Unsupported(Exception):
    """The checkpoint or target is not one :func:`load_direct` handles (nothing touched yet)."""


@dataclass
class _Rec:
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


@dataclass
class _Task:
    path: str
    name: str
    start: int
    end: int  # exclusive
    extra: int = 0  # 1 on a file's last range where the size is not known: catches a longer file
    dest: Optional[memoryview] = None  # straight into a target, else the thread's buffer
    own: bool = True  # dest is the caller's memory
    recs: List[_Rec] = field(default_factory=list)  # records inside [start, end) (buffered)
    arrivals: List[_Rec] = field(default_factory=list)  # direct records whose head or tail it reads


def _plain_target(t: torch.Tensor) -> bool:
    return t.is_cpu and t.layout == torch.strided and not t.is_quantized


def _contiguous_bytes(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t``'s memory as a flat uint8 tensor, for a contiguous tensor without conjugate or
    negative bits; else None. A view of ``t`` where writing through one is allowed, else (an
    inference tensor) a tensor over its address that does not own the memory."""
    if not t.is_contiguous() or t.is_conj() or t.is_neg() or t.numel() == 0:
        return None
    if t.is_inference():
        return host_bytes(t.data_ptr(), t.numel() * t.element_size())
    return t.view(-1).view(torch.uint8)


def _flat_targets(state_dict: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """DCP's flattening of ``state_dict`` (the writer's quicker equivalent)."""
    from .writer import _flatten

    return _flatten(state_dict)


class _Buffers(threading.local):
    buf: Optional[torch.Tensor] = None

    def get(self, n: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < n:
            self.buf = torch.empty(max(n, BUFFER_CHUNK_BYTES), dtype=torch.uint8)  # never zero-filled
        return self.buf


def _plan(storage: Storage, path: str, state_dict: Dict[str, Any], files: Dict[str, FileRecord],
          metadata: Metadata, direct_min: int, devices: DeviceTargets) -> Tuple[Dict[str, List[_Rec]], Dict[str, Any], Dict[str, Any]]:
    """Records per file for the targets in ``state_dict`` (device targets get host stand-ins in
    ``devices``); raises :class:`_Unsupported`."""
    flat, mappings = _flat_targets(state_dict)
    md = metadata.state_dict_metadata
    data = metadata.storage_data
    if not isinstance(data, dict):
        raise _Unsupported("no storage data")
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

    per_file: Dict[str, List[_Rec]] = {}
    for fqn, value in flat.items():
        m = md.get(fqn)
        if m is None:
            continue  # not in the checkpoint (strict=False): left as it is
        if isinstance(m, BytesStorageMetadata):
            info = lookup(fqn, None)
            if info is None or isinstance(value, torch.Tensor):
                raise _Unsupported(fqn)
            rec = _Rec(fqn, info.offset, info.length, "bytes")
        elif isinstance(m, TensorStorageMetadata):
            if type(value) not in (torch.Tensor, torch.nn.Parameter):
                raise _Unsupported(fqn)
            on_device = is_device(value)
            if not (device_supported(value) if on_device else _plain_target(value)):
                raise _Unsupported(fqn)
            if len(m.chunks) != 1 or any(m.chunks[0].offsets) or tuple(m.chunks[0].sizes) != tuple(m.size) \
                    or tuple(value.shape) != tuple(m.size) or value.dtype != m.properties.dtype:
                raise _Unsupported(fqn)
            offsets = m.chunks[0].offsets
            info = lookup(fqn, offsets if type(offsets) is torch.Size else torch.Size(offsets))
            if info is None:
                raise _Unsupported(fqn)
            nbytes = value.numel() * value.element_size()
            if nbytes == 0:
                continue  # nothing to read into; the bytes still count for the checksum
            if on_device:
                t = devices.stand_in(value)
            else:
                t = value.detach() if type(value) is not torch.Tensor or value.requires_grad else value
            fb = _contiguous_bytes(t)
            kind = "slow" if fb is None else ("direct" if nbytes >= direct_min else "small")
            rec = _Rec(fqn, info.offset, info.length, kind, t, fb, own=not on_device)
        else:
            raise _Unsupported(fqn)
        per_file.setdefault(info.relative_path, []).append(rec)
    for name, recs in per_file.items():
        if name not in files:
            raise _Unsupported(name)  # check_metadata refuses this first; never read unlisted files
        recs.sort(key=lambda r: r.start)
        end = 0
        for r in recs:
            if r.start < end:
                raise _Unsupported(f"{name}: overlapping items")  # not a layout we write
            end = r.start + r.length
        if end > files[name].size:
            raise _Unsupported(name)
        data_at = files[name].data_at
        for r in recs if data_at else ():
            head = data_at.get(r.start) if r.kind == "direct" else None  # type: ignore[union-attr]
            if head is not None and head + r.flat.numel() <= r.length:  # type: ignore[union-attr]
                r.data_start = r.start + head
    return per_file, flat, mappings


def _tasks(path: str, name: str, size: int, recs: List[_Rec], size_known: bool) -> List[_Task]:
    """The file ``name`` as a tiling of ranges: direct ones and buffered ones."""
    where = f"{path}/{name}"
    direct = [r for r in recs if r.kind == "direct"]
    out: List[_Task] = []
    pos = 0
    others = iter([r for r in recs if r.kind != "direct"])
    pending = next(others, None)

    def buffered(lo: int, hi: int) -> None:
        nonlocal pending
        cur = _Task(where, name, lo, lo)
        while True:
            # records wholly inside [lo, hi) go with the range they start in
            nxt = pending if pending is not None and pending.start < hi else None
            stop = nxt.start if nxt is not None else hi
            while stop - cur.end > 0:  # plain bytes up to the next record (or the end)
                room = cur.start + BUFFER_CHUNK_BYTES - cur.end
                if room <= 0:
                    out.append(cur)
                    cur = _Task(where, name, cur.end, cur.end)
                    continue
                cur.end = min(stop, cur.end + room)
            if nxt is None:
                break
            if cur.end > cur.start and cur.end + nxt.length - cur.start > BUFFER_CHUNK_BYTES:
                out.append(cur)
                cur = _Task(where, name, cur.end, cur.end)
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
        # flat is set on every direct record; numpy's stubs declare the buffer protocol only for Python >= 3.12
        mv = memoryview(r.flat.numpy())  # type: ignore[union-attr, arg-type, unused-ignore]
        for lo in range(a, b, DIRECT_CHUNK_BYTES):
            hi = min(b, lo + DIRECT_CHUNK_BYTES)
            out.append(_Task(where, name, lo, hi, dest=mv[lo - a:hi - a], own=r.own))
        pos = b
    if size > pos:
        buffered(pos, size)
    if not size_known and out:
        out[-1].extra = 1
    return out


def _decode(fqn: str, blob: bytes, allow_pickle: bool) -> Any:
    try:
        return torch.load(io.BytesIO(blob), weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{shown(fqn)}: refusing to unpickle an object outside torch's safe set ({shown(exc)}); pass "
            "allow_pickle=True to restore if you trust this checkpoint") from exc


def _copy_slow(rec: _Rec, item: memoryview) -> None:
    """A record into a target that is not plain contiguous memory, or of another layout."""
    from .reader import _stored_bytes  # the aligned copy out of a read buffer

    t = rec.target
    assert t is not None
    req = types.SimpleNamespace(storage_offsets=[0] * t.dim(), lengths=list(t.shape))
    raw = _stored_bytes(item, req, t)
    if raw is not None:
        dst, src = raw
        dst.copy_(src)
        return
    tensor = torch.load(io.BytesIO(bytes(item)), map_location="cpu", weights_only=True)
    if not isinstance(tensor, torch.Tensor) or tensor.shape != t.shape:
        raise CorruptCheckpointError(f"{shown(rec.fqn)}: stored value is not a tensor of shape {tuple(t.shape)}")
    t.copy_(tensor)


def load_direct(storage: Storage, path: str, state_dict: Dict[str, Any], *, files: Optional[Dict[str, FileRecord]],
                metadata: Metadata, verify: bool = True, threads: int = 8, allow_pickle: bool = False) -> bool:
    """Load the checked ``metadata``'s checkpoint under ``path`` into ``state_dict`` in place by
    direct reads (see the module docstring); ``False`` (nothing read or touched) when it does
    not apply. ``files`` are the manifest's records (required: sizes and checksums)."""
    if files is None:
        return False
    direct_min = DIRECT_MIN_BYTES if storage.is_local else REMOTE_DIRECT_MIN_BYTES
    with gc_paused():  # one Python record per item: no collections walking them meanwhile
        return _load_direct(storage, path, state_dict, files, metadata, verify, threads, allow_pickle, direct_min)


def _load_direct(storage: Storage, path: str, state_dict: Dict[str, Any], files: Dict[str, FileRecord],
                 metadata: Metadata, verify: bool, threads: int, allow_pickle: bool, direct_min: int) -> bool:
    devices = DeviceTargets()
    try:
        per_file, flat, mappings = _plan(storage, path, state_dict, files, metadata, direct_min, devices)
    except _Unsupported:
        return False
    threads = max(1, threads)
    readers: Dict[str, Any] = {}
    touched = [False]
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="async-ckpt-read") as pool:
            return _load(storage, path, per_file, flat, mappings, files, verify, allow_pickle, pool, readers,
                         touched, state_dict, threads, devices)
    except BaseException as exc:
        if touched[0] and isinstance(exc, CheckpointError) and not getattr(exc, "partly_written", False):
            exc.args = (f"{exc.args[0] if exc.args else exc}; {PARTLY_WRITTEN}",) + tuple(exc.args[1:])
            exc.partly_written = True  # type: ignore[attr-defined]
        elif touched[0] and not isinstance(exc, (KeyboardInterrupt, SystemExit)) and not isinstance(exc, CheckpointError):
            raise CheckpointError(f"restore from {path} failed ({type(exc).__name__}: {exc}); {PARTLY_WRITTEN}") from exc
        raise
    finally:
        close_all(readers)


def _open(storage: Storage, path: str, name: str, files: Dict[str, FileRecord], readers: Dict[str, Any]) -> Any:
    """Open ``path/name`` after the reader's checks (:func:`~.reader.open_step_file`); kept in
    ``readers`` (closed by the caller)."""
    readers[name] = r = open_step_file(storage, path, name, files[name].size)
    return r


def _load(storage: Storage, path: str, per_file: Dict[str, List[_Rec]], flat: Dict[str, Any],
          mappings: Dict[str, Any], files: Dict[str, FileRecord], verify: bool, allow_pickle: bool,
          pool: ThreadPoolExecutor, readers: Dict[str, Any], touched: List[bool], state_dict: Dict[str, Any],
          threads: int, devices: DeviceTargets) -> bool:
    for name in per_file:
        _open(storage, path, name, files, readers)

    # 1. Probes: where the large records' data lies; the non-tensor items' bytes, decoded.
    def probe(name: str, rec: _Rec) -> Optional[Probe]:
        r = readers[name]
        if rec.kind == "bytes":
            buf = bytearray(rec.length)
            got = r.read_into(rec.start, memoryview(buf))
            if got != rec.length:
                raise CorruptCheckpointError(f"{path}/{name}: is shorter than the manifest says", path=f"{path}/{name}")
            p = object.__new__(Probe)
            p.reader, p.rec, p.windows = r, rec, [(rec.start, bytes(buf))]
            return p
        p = Probe(r, rec)
        t = rec.target
        assert t is not None
        start = data_start(p.get, rec.length, t.dtype, tuple(t.shape))
        if start is None:
            rec.kind = "slow"  # another layout: through the buffer
        else:
            rec.data_start = rec.start + start
        return p

    for name, recs in per_file.items():
        for rec in recs:
            if rec.kind == "direct" and rec.data_start >= 0:
                rec.arrived = Arrived(readers[name], rec.start, rec.length, rec.data_start, rec.flat.numel())  # type: ignore[union-attr]
    jobs = [(name, rec) for name, recs in per_file.items() for rec in recs
            if rec.kind == "bytes" or (rec.kind == "direct" and rec.arrived is None)]
    probe_calls = [lambda n=n, r=r: probe(n, r) for n, r in jobs]  # (named: mypy types it here, not in _run's call)
    probes = _run(pool, probe_calls)
    decoded: Dict[str, Any] = {}
    windows: Dict[str, List[Tuple[int, bytes]]] = {}
    undecodable: Optional[BaseException] = None
    for (name, rec), p in zip(jobs, probes):
        assert p is not None
        windows.setdefault(name, []).extend(p.windows)
        if rec.kind == "bytes" and undecodable is None:
            try:
                decoded[rec.fqn] = _decode(rec.fqn, p.windows[0][1], allow_pickle)
            except BaseException as exc:  # noqa: BLE001 - reported below, after the checksums
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                undecodable = exc
    if undecodable is not None:
        # Nothing written yet: check the files without writing (damage reads as damage), then
        # refuse the item.
        from .reader import FsspecStorageReader

        FsspecStorageReader(storage, path, files=files, verify=verify)._read_files(list(per_file), pool)
        raise undecodable

    # 2. Every byte of every file, once: into the targets, or into a buffer and scattered.
    tasks: List[_Task] = []
    for name, recs in per_file.items():
        tasks += _tasks(path, name, files[name].size, recs, readers[name].known_size is not None)
    for ws in windows.values():
        ws.sort()
    _assign_arrivals(per_file, tasks)
    buffers = _Buffers()
    confirmed: List[_Rec] = []  # direct records whose arrived bytes put the data where the manifest said

    def run(task: _Task) -> Tuple[int, int]:
        r = readers[task.name]
        n = task.end - task.start
        if task.dest is not None:
            touched[0] = touched[0] or task.own
            got = r.read_into(task.start, task.dest)
            return got, (crc32c(task.dest[:got]) if verify else 0)
        buf = buffers.get(n + task.extra)
        mv = memoryview(buf.numpy())[: n + task.extra]  # type: ignore[arg-type, unused-ignore]  # numpy declares the buffer protocol for Python >= 3.12 only
        got = r.read_into(task.start, mv)
        crc = crc32c(mv[:min(got, n)]) if verify else 0
        if got < n:
            return got, crc
        for rec in task.arrivals:
            a = rec.arrived
            assert a is not None and rec.target is not None
            if a.take(task.start, mv[:n]) and a.agrees(rec.target.dtype, tuple(rec.target.shape)):
                confirmed.append(rec)  # (list.append: atomic)
        for w0, data in windows.get(task.name, ()):
            lo, hi = max(w0, task.start), min(w0 + len(data), task.end)
            if lo < hi and mv[lo - task.start:hi - task.start] != data[lo - w0:hi - w0]:
                raise CorruptCheckpointError(f"{task.path}: changed while it was being read", path=task.path)
        dsts: List[torch.Tensor] = []
        own = False  # a dst is the caller's memory
        # the small tensors' data in buf, as runs of evenly spaced same-sized pieces
        # [first offset, spacing, bytes, count]: one view per run, cut into rows in C
        runs: List[List[int]] = []
        for rec in task.recs:
            at = rec.start - task.start
            if rec.kind == "small":
                t = rec.target
                assert t is not None and rec.flat is not None
                head = HEADS.get(t.dtype, tuple(t.shape))
                if head is not None and head[1] == rec.length and bytes(mv[at:at + len(head[0])]) == head[0]:
                    start = at + len(head[0])
                else:
                    item = mv[at:at + rec.length]
                    get = lambda a, b, item=item: bytes(item[a:b])  # (named: mypy types it here, not in the call)
                    s = data_start(get, rec.length, t.dtype, tuple(t.shape))
                    if s is None:
                        touched[0] = touched[0] or rec.own
                        _copy_slow(rec, item)
                        continue
                    start = at + s
                nb = rec.flat.numel()
                dsts.append(rec.flat)
                own = own or rec.own
                last = runs[-1] if runs else None
                if last is not None and last[2] == nb and (
                        (last[3] == 1 and start - last[0] >= nb) or (last[3] > 1 and start == last[0] + last[1] * last[3])):
                    if last[3] == 1:
                        last[1] = start - last[0]
                    last[3] += 1
                else:
                    runs.append([start, 0, nb, 1])
            elif rec.kind == "slow":
                touched[0] = touched[0] or rec.own
                _copy_slow(rec, mv[at:at + rec.length])
        if dsts:
            srcs: List[torch.Tensor] = []
            for first, spacing, nb, count in runs:
                if count == 1:
                    srcs.append(buf.narrow(0, first, nb))
                else:
                    srcs.extend(buf.as_strided((count, nb), (spacing, 1), first).unbind(0))
            touched[0] = touched[0] or own
            with torch.no_grad():
                compat.foreach_copy_(dsts, srcs)
        return got, crc

    # Each job reads a run of consecutive ranges of one file in file order (one sequential
    # stream, so the kernel's readahead works for it): one run per file, or a file cut into
    # several runs when there are fewer files than threads.
    per: Dict[str, List[int]] = {}
    for i, t in enumerate(tasks):
        per.setdefault(t.name, []).append(i)
    split = max(1, -(-threads // max(1, len(per))))
    groups: List[List[int]] = []
    for idx in per.values():
        n = -(-len(idx) // split)
        groups += [idx[k:k + n] for k in range(0, len(idx), n)]
    results: List[Any] = [None] * len(tasks)

    def run_group(group: List[int]) -> None:
        for i in group:
            results[i] = run(tasks[i])

    group_calls = [lambda g=g: run_group(g) for g in groups]  # (named: mypy types it here, not in _run's call)
    _run(pool, group_calls)

    # 3. Sizes and checksums per file, before anything else is set.
    parts: Dict[str, List[Tuple[_Task, int, int]]] = {}
    for task, (got, crc) in zip(tasks, results):
        parts.setdefault(task.name, []).append((task, got, crc))
    for name, ps in parts.items():
        where = f"{path}/{name}"
        size = files[name].size
        ps.sort(key=lambda p: p[0].start)
        total = 0
        for task, got, _ in ps:
            n = task.end - task.start
            if got < n:
                raise CorruptCheckpointError(f"{where}: size is {task.start + got} bytes, manifest says {size}",
                                             path=where)
            total += min(got, n)
            if got > n:
                raise CorruptCheckpointError(f"{where}: size is more than {size} bytes, manifest says {size}",
                                             path=where)
        if verify:
            crc = crc32c_concat((c, p.end - p.start) for p, _, c in ps)
            if crc != files[name].crc32c:
                raise CorruptCheckpointError(
                    f"{where}: checksum mismatch (crc32c {crc:#010x}, manifest says {files[name].crc32c:#010x})",
                    path=where)
    wrong = [rec for recs in per_file.values() for rec in recs if rec.arrived is not None]
    if len(wrong) != len(confirmed):
        ok = set(map(id, confirmed))
        rec = next(rec for rec in wrong if id(rec) not in ok)
        raise CorruptCheckpointError(f"{path}: {shown(rec.fqn)}: its record does not hold its data at the offset the "
                                     "manifest gives", path=path)
    if devices:
        touched[0] = True
        devices.commit()
    for fqn, value in decoded.items():
        set_element(state_dict, mappings[fqn], value)
    return True


def _assign_arrivals(per_file: Dict[str, List[_Rec]], tasks: List[_Task]) -> None:
    """Give each buffered task the direct records (with bytes to gather, see :class:`Arrived`)
    whose head or tail it reads."""
    by_file: Dict[str, List[_Rec]] = {n: [r for r in recs if r.arrived is not None] for n, recs in per_file.items()}
    ends = {n: [r.start + r.length for r in recs] for n, recs in by_file.items()}
    for task in tasks:
        recs = by_file.get(task.name)
        if task.dest is not None or not recs:
            continue
        k = bisect.bisect_right(ends[task.name], task.start)  # the first record ending after the task's start
        while k < len(recs) and recs[k].start < task.end:
            task.arrivals.append(recs[k])
            k += 1


def _run(pool: ThreadPoolExecutor, fns: Sequence[Callable[[], Any]]) -> List[Any]:
    """Run ``fns`` on ``pool``; their results in order. On the first failure the tasks not yet
    started are cancelled and it is raised once the running ones finish."""
    futs = [pool.submit(f) for f in fns]
    done, _ = wait(futs, return_when=FIRST_EXCEPTION)
    for f in futs:
        if f.done() and not f.cancelled() and f.exception() is not None:
            for g in futs:
                g.cancel()
            wait(futs)
            raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futs]
