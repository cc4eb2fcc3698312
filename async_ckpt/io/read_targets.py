"""Restore by reading file ranges straight into the target tensors, verified as they arrive.

:func:`load_direct` is the single-process restore of a checkpoint that async_ckpt (or DCP)
wrote, into CPU, XLA or CUDA tensors that already exist. For each data file it reads every byte once, as a
tiling of the file into ranges (worked out by :mod:`.direct_plan`), in parallel over ``threads``:

* the data of a large tensor record goes straight into the target tensor's memory
  (``preadv`` on local files, ranged reads elsewhere), in pieces of at most
  ``DIRECT_CHUNK_BYTES``;
* everything else (record headers and trailers, small tensors, non-tensor items) is read into a
  per-thread buffer of about ``BUFFER_CHUNK_BYTES``, cut at record boundaries; the small
  tensors in it are copied into their targets by one ``_foreach_copy_`` per buffer;
* each range's CRC-32C is computed on the thread that read it, right after the read, and each
  file is verified from its ranges by :func:`~.read_exec.check_file` (the one definition of
  verified) before :func:`load_direct` returns.

Where a large record's data begins is taken from the manifest where the writer recorded it
(``FileRecord.data_at``); the record's zip directory and headers, which arrive with the reads
of the file's other bytes, are parsed on the reading threads to confirm it, and a record that
puts its data elsewhere fails the restore (a :class:`~async_ckpt.errors.CorruptCheckpointError`,
raised after the checksums); a record of a layout the parser does not know is put together again
from those verified bytes and read with ``torch.load``. Elsewhere (older manifests, plain DCP checkpoints) it is found before the reads,
from small probes of the record's start and end. Non-tensor items are read and decoded first
too, so an unsafe pickle is refused before any tensor is written; the probed bytes are
compared with the verified ones when those arrive.

Targets whose memory overlaps an earlier key's (tied weights restored from a checkpoint that
holds them untied, overlapping views; an XLA or CUDA target listed under several keys) are
read into private tensors, so that the checksums are of their own bytes, and copied into place
(a device target's host stand-in) once every file is verified, in key order: where they
overlap, the last key's data stays.

A failure after the first write leaves the targets partly written: the error raised is a
:class:`~async_ckpt.errors.PartlyWrittenError` (:func:`partly_written`), whose cause is the failure. Targets that are not plain contiguous CPU tensors (strided views, conjugate bits) and
records of another layout take a slower path through the buffer (``copy_``), and anything
this module does not handle (sharded checkpoints, DTensors, devices other than the CPU, XLA
and CUDA, custom planners) makes :func:`load_direct` return ``False`` before touching anything,
for DCP to load.

XLA and CUDA targets are read into host stand-ins the same way and put on their devices once
every file is verified (:mod:`.device_targets`), so a failure before that leaves them untouched.
"""

from __future__ import annotations

import io
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .. import compat
from ..addresses import byte_view
from ..errors import CheckpointError, CorruptCheckpointError, PartlyWrittenError, partly_written_error
from ..format.crc import crc32c
from ..format.dcp_layout import set_element
from ..format.manifest import FileRecord, shown
from ..format.torch_record import data_start, plain_data_start
from ..format.unpickling import load_value
from ..gc_pause import gc_paused
from .dcp_adapters import stored_bytes
from .read_exec import NULL, StepFiles, check_file, close_all, open_step_file, read_files, run_all, short_error
from .read_plan import (
    BUFFER_CHUNK_BYTES,
    RangeRead,
    RecordRead,
    Unsupported,
    assign_arrivals,
    file_ranges,
    plan_records,
)
from .record_layout import Arrived, Probe
from .sinks import DeviceTargets

#: A tensor record at least this large (local files) has its data read straight into the
#: target; smaller ones are read with their neighbours and scattered.
DIRECT_MIN_BYTES = 256 * 2**10
#: The same threshold for remote storage, where every range is a request.
REMOTE_DIRECT_MIN_BYTES = 8 * 2**20

PARTLY_WRITTEN = ("the target state dict was partly written with this step's data and must not be "
                  "used as is; restore(..., atomic=True) leaves it untouched on failure")


def partly_written(path: str, exc: BaseException) -> PartlyWrittenError:
    """The error of a read of the step under ``path`` that failed (``exc``) after it had
    written into the target.

    Args:
        path: the step directory read.
        exc: the failure.

    Returns:
        A :class:`~async_ckpt.errors.PartlyWrittenError` whose cause is ``exc``.
    """
    what = str(exc) if isinstance(exc, CheckpointError) else f"restore from {path} failed ({type(exc).__name__}: {exc})"
    return partly_written_error(f"{what}; {PARTLY_WRITTEN}", step=exc.step if isinstance(exc, CheckpointError) else None,
                                cause=exc)



class _Buffers(threading.local):
    buf: Optional[torch.Tensor] = None

    def get(self, n: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < n:
            self.buf = torch.empty(max(n, BUFFER_CHUNK_BYTES), dtype=torch.uint8)  # never zero-filled
        return self.buf


def _decode(fqn: str, blob: bytes, allow_pickle: bool) -> Any:
    return load_value(io.BytesIO(blob), fqn, allow_pickle)


def _whole(t: torch.Tensor) -> Any:
    return types.SimpleNamespace(storage_offsets=[0] * t.dim(), lengths=list(t.shape))


def _load_tensor(rec: RecordRead, item: memoryview) -> torch.Tensor:
    """The record ``item`` read by ``torch.load``; :class:`CorruptCheckpointError` unless it
    is a tensor of its target's dtype and shape."""
    t = rec.target
    assert t is not None
    try:
        tensor = torch.load(io.BytesIO(item), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(f"{shown(rec.fqn)}: its record cannot be read as a tensor "
                                     f"({type(exc).__name__}: {shown(exc)})") from exc
    if not isinstance(tensor, torch.Tensor) or tensor.shape != t.shape or tensor.dtype != t.dtype:
        raise CorruptCheckpointError(f"{shown(rec.fqn)}: stored value is not a {t.dtype} tensor of shape {tuple(t.shape)}")
    return tensor


def _check_slow(rec: RecordRead, item: memoryview) -> None:
    """Before any write (staged restores): a record that only ``torch.load`` reads is read now
    and checked (kept in ``rec.loaded``); a small one of another layout goes the slow path."""
    t = rec.target
    assert t is not None
    if rec.kind == "small" and plain_data_start(item, t.dtype, tuple(t.shape)) is not None:
        return
    rec.kind = "slow"
    if stored_bytes(item, _whole(t), t) is None:
        rec.loaded = _load_tensor(rec, item)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; under ``torch.inference_mode`` for an inference tensor, the only
    place it may be written."""
    if dst.is_inference():
        with torch.inference_mode():
            dst.copy_(src)
    else:
        dst.copy_(src)


def _copy_slow(rec: RecordRead, item: memoryview) -> None:
    """A record into a target that is not plain contiguous memory, or of another layout."""
    t = rec.target
    assert t is not None
    raw = None if rec.loaded is not None else stored_bytes(item, _whole(t), t)
    dst, src = raw if raw is not None else (t, rec.loaded if rec.loaded is not None else _load_tensor(rec, item))
    _copy_into(dst, src)


def load_direct(storage: StepFiles, path: str, state_dict: Dict[str, Any], *, files: Optional[Dict[str, FileRecord]],
                metadata: Metadata, verify: bool = True, threads: int = 8, allow_pickle: bool = False,
                staged: bool = False) -> bool:
    """Load the checked ``metadata``'s checkpoint under ``path`` into ``state_dict`` in place by
    direct reads (see the module docstring); ``False`` (nothing read or touched) when it does
    not apply. ``files`` are the manifest's records (required: sizes and checksums).
    ``staged``: ``storage`` serves verified bytes from memory (``restore(..., atomic=True)``):
    every check that can fail (where each record's data lies, the records only ``torch.load``
    reads) is made before the first write into a target."""
    if files is None:
        return False
    direct_min = DIRECT_MIN_BYTES if storage.is_local else REMOTE_DIRECT_MIN_BYTES
    with gc_paused():  # one Python record per item: no collections walking them meanwhile
        return _load_direct(storage, path, state_dict, files, metadata, verify, threads, allow_pickle, direct_min,
                            staged)


def _load_direct(storage: StepFiles, path: str, state_dict: Dict[str, Any], files: Dict[str, FileRecord],
                 metadata: Metadata, verify: bool, threads: int, allow_pickle: bool, direct_min: int,
                 staged: bool) -> bool:
    devices = DeviceTargets()
    try:
        per_file, flat, mappings = plan_records(storage, path, state_dict, files, metadata, direct_min, devices)
    except Unsupported:
        return False
    threads = max(1, threads)
    readers: Dict[str, Any] = {}
    touched = [False]
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="async-ckpt-read") as pool:
            return _load(storage, path, per_file, flat, mappings, files, verify, allow_pickle, pool, readers,
                         touched, state_dict, threads, devices, staged)
    except Exception as exc:
        if touched[0] and not isinstance(exc, PartlyWrittenError):
            raise partly_written(path, exc) from exc
        raise
    finally:
        close_all(readers)


def _misplaced(path: str, rec: RecordRead) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {shown(rec.fqn)}: its record does not hold its data at the offset the "
                                  "manifest gives", path=path)


def _open(storage: StepFiles, path: str, name: str, files: Dict[str, FileRecord], readers: Dict[str, Any]) -> Any:
    """Open ``path/name`` after the reader's checks (:func:`~.read_exec.open_step_file`); kept in
    ``readers`` (closed by the caller)."""
    readers[name] = r = open_step_file(storage, path, name, files[name].size)
    return r


def _load(storage: StepFiles, path: str, per_file: Dict[str, List[RecordRead]], flat: Dict[str, Any],
          mappings: Dict[str, Any], files: Dict[str, FileRecord], verify: bool, allow_pickle: bool,
          pool: ThreadPoolExecutor, readers: Dict[str, Any], touched: List[bool], state_dict: Dict[str, Any],
          threads: int, devices: DeviceTargets, staged: bool) -> bool:
    for name in per_file:
        _open(storage, path, name, files, readers)

    # 1. Probes: where the large records' data lies; the non-tensor items' bytes, decoded.
    def probe(name: str, rec: RecordRead) -> Optional[Probe]:
        r = readers[name]
        if rec.kind == "bytes":
            buf = bytearray(rec.length)
            got = r.read_into(rec.start, memoryview(buf))
            if got != rec.length:
                raise short_error(f"{path}/{name}", rec.start + rec.length)
            p = object.__new__(Probe)
            p.reader, p.rec, p.windows = r, rec, [(rec.start, bytes(buf))]
            return p
        p = Probe(r, rec)
        t = rec.target
        assert t is not None
        start = data_start(p.get, rec.length, t.dtype, tuple(t.shape))
        if start is None:
            rec.kind = "slow"  # another layout: through the buffer
        elif rec.data_start >= 0 and rec.data_start != rec.start + start:  # (staged: the manifest's offset)
            raise _misplaced(path, rec)
        else:
            rec.data_start = rec.start + start
        return p

    for name, recs in per_file.items():
        for rec in recs:
            if rec.kind == "direct" and rec.data_start >= 0 and not staged:  # (staged: probed, in memory)
                rec.arrived = Arrived(readers[name], rec.start, rec.length, rec.data_start, rec.flat.numel())  # type: ignore[union-attr]
    jobs = [(name, rec) for name, recs in per_file.items() for rec in recs
            if rec.kind == "bytes" or (rec.kind == "direct" and rec.arrived is None)]
    probe_calls = [lambda n=n, r=r: probe(n, r) for n, r in jobs]  # (named: mypy types it here, not in run_all's call)
    probes = run_all(pool, probe_calls)
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
        read_files(storage, path, {n: files[n] for n in per_file}, NULL, verify=verify, pool=pool)
        raise undecodable
    if staged:  # the records only torch.load reads, read and checked before the first write
        def check(name: str, rec: RecordRead) -> None:
            buf = bytearray(rec.length)
            _check_slow(rec, memoryview(buf)[:readers[name].read_into(rec.start, memoryview(buf))])

        run_all(pool, [lambda n=n, r=r: check(n, r) for n, recs in per_file.items() for r in recs  # type: ignore[misc]
                    if r.kind in ("small", "slow")])

    # 2. Every byte of every file, once: into the targets, or into a buffer and scattered.
    tasks: List[RangeRead] = []
    for name, recs in per_file.items():
        tasks += file_ranges(path, name, files[name].size, recs, readers[name].known_size is not None)
    for ws in windows.values():
        ws.sort()
    assign_arrivals(per_file, tasks)
    buffers = _Buffers()
    confirmed: List[RecordRead] = []  # direct records whose arrived bytes put the data where the manifest said

    def run(task: RangeRead) -> Tuple[int, int]:
        r = readers[task.name]
        n = task.end - task.start
        if task.dest is not None:
            touched[0] = touched[0] or task.own
            got = r.read_into(task.start, task.dest)
            return got, (crc32c(task.dest[:got]) if verify else 0)
        buf = buffers.get(n + task.extra)
        mv = byte_view(buf)[: n + task.extra]
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
                assert rec.target is not None and rec.flat is not None
                item = mv[at:at + rec.length]
                s = plain_data_start(item, rec.target.dtype, tuple(rec.target.shape))
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

    group_calls = [lambda g=g: run_group(g) for g in groups]  # (named: mypy types it here, not in run_all's call)
    run_all(pool, group_calls)

    # 3. Sizes and checksums per file, before anything else is set.
    parts: Dict[str, List[Tuple[RangeRead, int, int]]] = {}
    for task, (got, crc) in zip(tasks, results):
        parts.setdefault(task.name, []).append((task, got, crc))
    for name, ps in parts.items():
        ps.sort(key=lambda p: p[0].start)
        check_file(f"{path}/{name}", files[name].size, ((t.start, t.end, got, crc) for t, got, crc in ps),
                   files[name].crc32c, verify)
    wrong = [rec for recs in per_file.values() for rec in recs if rec.arrived is not None]
    unparsed = []  # records of a layout data_start does not parse: not a misplaced offset, the slow path
    if len(wrong) != len(confirmed):
        ok = set(map(id, confirmed))
        for rec in wrong:
            a, tgt = rec.arrived, rec.target
            assert a is not None and tgt is not None
            if id(rec) in ok:
                continue
            if data_start(a.get, a.length, tgt.dtype, tuple(tgt.shape)) is not None:
                raise _misplaced(path, rec)
            unparsed.append(rec)
    for rec in unparsed:  # the record again, from its verified bytes (its data went into the target)
        _copy_slow(rec, rec.arrived.record(rec.flat))  # type: ignore[union-attr, arg-type]
    # targets sharing memory with an earlier key's: their own verified data, in key order (the last key wins)
    for rec in sorted((r for recs in per_file.values() for r in recs if r.into is not None), key=lambda r: r.order):
        touched[0] = True
        _copy_into(rec.into, rec.target)  # type: ignore[arg-type]
    if devices:
        touched[0] = True
        devices.commit()
    for fqn, value in decoded.items():
        set_element(state_dict, mappings[fqn], value)
    return True
