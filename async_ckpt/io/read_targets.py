"""Restore by reading a step straight into the target tensors, verified as the bytes arrive; or
(atomic) into host buffers first.

:func:`read_direct` is the single-process restore of a checkpoint that async_ckpt (or DCP)
wrote, into CPU, XLA or CUDA tensors that already exist (:func:`plan_direct` says whether it
applies, before anything is read). For each data file it reads every byte once, as a tiling of
the file into pieces (:mod:`.read_plan`), through the one verified read
(:func:`~.read_exec.execute`):

* the data of a large tensor record goes straight into the target tensor's memory
  (``preadv`` on local files, ranged reads elsewhere), in pieces of at most
  ``DIRECT_CHUNK_BYTES``;
* everything else (record headers and trailers, small tensors, non-tensor items) is read into a
  per-thread buffer of about ``BUFFER_CHUNK_BYTES``, cut at record boundaries; the small
  tensors in it are copied into their targets by one ``_foreach_copy_`` per buffer
  (:class:`~.sinks.TargetSink`);
* each piece's CRC-32C is computed on the thread that read it, right after the read, and each
  file is verified (size and CRC-32C) before :func:`read_direct` returns.

Where a large record's data begins is taken from the manifest where the writer recorded it
(``FileRecord.data_at``); the record's zip directory and headers, which arrive with the reads
of the file's other bytes, are parsed on the reading threads to confirm it, and a record that
puts its data elsewhere fails the restore (a :class:`~async_ckpt.errors.CorruptCheckpointError`,
raised after the checksums); a record of a layout the parser does not know is put together again
from those verified bytes and read with ``torch.load``. Elsewhere (older manifests, plain DCP
checkpoints) it is found before the reads, from small probes of the record's start and end.
Non-tensor items are read and decoded first too, so an unsafe pickle is refused before any
tensor is written; the probed bytes are compared with the verified ones when those arrive.

Targets whose memory overlaps an earlier key's (tied weights restored from a checkpoint that
holds them untied, overlapping views; an XLA or CUDA target listed under several keys) are
read into private tensors, so that the checksums are of their own bytes, and copied into place
(a device target's host stand-in) once every file is verified, in key order: where they
overlap, the last key's data stays.

A failure after the first write leaves the targets partly written: the error raised is a
:class:`~async_ckpt.errors.PartlyWrittenError` (:func:`partly_written`), whose cause is the
failure. Targets that are not plain contiguous CPU tensors (strided views, conjugate bits) and
records of another layout take a slower path through the buffer (``copy_``); anything this
path does not handle (sharded checkpoints, DTensors, devices other than the CPU, XLA and CUDA)
makes :func:`plan_direct` answer ``None`` before anything is read, for DCP's reader.

XLA and CUDA targets are read into host stand-ins the same way and put on their devices once
every file is verified (:class:`~.device_targets.DeviceTargets`), so a failure before that leaves them
untouched.

:func:`staged` is ``restore(..., atomic=True)``'s first half: every data file the metadata
points at read and verified into host buffers (the manager's pool, within its budget), then
served as the step's files (:class:`~.sinks.StagedFiles`) to the read that writes the target.
"""

from __future__ import annotations

import contextlib
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    PartlyWrittenError,
    StagingBudgetError,
    partly_written_error,
)
from ..format.dcp_layout import set_element
from ..format.manifest import FileRecord, shown
from ..format.torch_record import data_start
from ..format.unpickling import load_value
from ..gc_pause import gc_paused
from .device_targets import DeviceTargets
from .read_exec import OpenFiles, StepFiles, execute, read_files, run_all, short_error, whole_pieces
from .read_plan import (
    BUFFER_CHUNK_BYTES,
    Arrived,
    Probe,
    RangeRead,
    RecordRead,
    Unsupported,
    assign_arrivals,
    file_ranges,
    plan_records,
)
from .sinks import IntoBuffers, StagedFiles, TargetSink, check_slow, copy_into, copy_slow

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


@dataclass
class DirectPlan:
    """What a direct restore reads where (:func:`plan_direct`)."""

    per_file: Dict[str, List[RecordRead]]  # the records of each data file read, in file order
    flat: Dict[str, Any]  # the targets, flattened in the checkpoint's key layout
    mappings: Dict[str, Any]  # their paths
    devices: DeviceTargets  # XLA and CUDA targets' host stand-ins


def plan_direct(state_dict: Dict[str, Any], files: Dict[str, FileRecord], metadata: Metadata, *,
                local: bool, cast: bool = False) -> Optional[DirectPlan]:
    """The direct restore of ``state_dict`` from the step that ``metadata`` (checked) and
    ``files`` (its manifest's records) describe, or ``None`` when it does not apply (nothing
    read, nothing touched: DCP's reader loads it).

    Args:
        state_dict: the targets.
        files: the manifest's records.
        metadata: the step's checked DCP metadata.
        local: reads are cheap (local files, or staged in memory): smaller records are read
            straight into their targets.
        cast: targets of another dtype are cast into, as ``dcp.load`` does (see
            :func:`~.read_plan.plan_records`).

    Returns:
        The plan, or ``None``.
    """
    devices = DeviceTargets()
    try:
        per_file, flat, mappings = plan_records(state_dict, files, metadata,
                                                DIRECT_MIN_BYTES if local else REMOTE_DIRECT_MIN_BYTES, devices, cast)
    except Unsupported:
        return None
    return DirectPlan(per_file, flat, mappings, devices)


def read_direct(storage: StepFiles, path: str, state_dict: Dict[str, Any], plan: DirectPlan, *,
                files: Dict[str, FileRecord], verify: bool = True, threads: int = 8, allow_pickle: bool = False,
                staged: bool = False) -> None:
    """Read the step under ``path`` into ``state_dict`` in place as ``plan`` says (the module
    docstring).

    Args:
        storage: the root's storage (or the staged files, :class:`~.sinks.StagedFiles`).
        path: the step directory.
        state_dict: the targets.
        plan: :func:`plan_direct`'s plan for them.
        files: the manifest's records.
        verify: compare checksums (sizes are always compared).
        threads: how many reads run at once.
        allow_pickle: non-tensor items may be unpickled without restrictions.
        staged: ``storage`` serves verified bytes from memory (``restore(..., atomic=True)``):
            every check that can fail (where each record's data lies, the records only
            ``torch.load`` reads) is made before the first write into a target.

    Raises:
        CorruptCheckpointError: damaged data, found before anything was written.
        PartlyWrittenError: a failure after the first write into a target.
    """
    sink = TargetSink(lambda name: f"{path}/{name}", {})
    with gc_paused():  # one Python record per item: no collections walking them meanwhile
        try:
            with OpenFiles(storage, path, {n: files[n] for n in plan.per_file}) as opened, \
                    ThreadPoolExecutor(max(1, threads), thread_name_prefix="async-ckpt-read") as pool:
                _read(opened, path, state_dict, plan, sink, verify, allow_pickle, pool, max(1, threads), staged)
        except Exception as exc:
            if sink.touched and not isinstance(exc, PartlyWrittenError):
                raise partly_written(path, exc) from exc
            raise


def load_direct(storage: StepFiles, path: str, state_dict: Dict[str, Any], *, files: Optional[Dict[str, FileRecord]],
                metadata: Metadata, verify: bool = True, threads: int = 8, allow_pickle: bool = False,
                staged: bool = False) -> bool:
    """:func:`plan_direct`, then :func:`read_direct`; ``False`` (nothing read or touched) when
    it does not apply (``files`` None: a checkpoint without a manifest)."""
    plan = None if files is None else plan_direct(state_dict, files, metadata, local=storage.is_local)
    if plan is None or files is None:
        return False
    read_direct(storage, path, state_dict, plan, files=files, verify=verify, threads=threads,
                allow_pickle=allow_pickle, staged=staged)
    return True


def _misplaced(path: str, rec: RecordRead) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {shown(rec.fqn)}: its record does not hold its data at the offset the "
                                  "manifest gives", path=path)


def _read(opened: OpenFiles, path: str, state_dict: Dict[str, Any], plan: DirectPlan, sink: TargetSink,
          verify: bool, allow_pickle: bool, pool: ThreadPoolExecutor, threads: int, staged: bool) -> None:
    per_file = plan.per_file

    # 1. Probes: where the large records' data lies; the non-tensor items' bytes, decoded.
    def probe(name: str, rec: RecordRead) -> List[Tuple[int, bytes]]:
        """The bytes peeked of ``rec``, as ``(offset in the file, bytes)`` windows."""
        if rec.kind == "bytes":
            data = opened.peek(name, rec.start, rec.length)
            if len(data) != rec.length:
                raise short_error(opened.where(name), rec.start + rec.length)
            return [(rec.start, data)]
        p = Probe(opened, name, rec)
        t = rec.target
        assert t is not None
        start = data_start(p.get, rec.length, t.dtype, tuple(t.shape))
        if start is None:
            rec.kind = "slow"  # another layout: through the buffer
        elif rec.data_start >= 0 and rec.data_start != rec.start + start:  # (staged: the manifest's offset)
            raise _misplaced(path, rec)
        else:
            rec.data_start = rec.start + start
        return p.windows

    for name, recs in per_file.items():
        for rec in recs:
            if rec.kind == "direct" and rec.data_start >= 0 and not staged:  # (staged: probed, in memory)
                assert rec.flat is not None
                rec.arrived = Arrived(opened, name, rec.start, rec.length, rec.data_start, rec.flat.numel())
    jobs = [(name, rec) for name, recs in per_file.items() for rec in recs
            if rec.kind == "bytes" or (rec.kind == "direct" and rec.arrived is None)]
    probe_calls = [lambda n=n, r=r: probe(n, r) for n, r in jobs]  # (named: mypy types it here, not in run_all's call)
    probes = run_all(pool, probe_calls)
    decoded: Dict[str, Any] = {}
    undecodable: Optional[BaseException] = None
    for (name, rec), windows in zip(jobs, probes):
        sink.windows.setdefault(name, []).extend(windows)
        if rec.kind == "bytes" and undecodable is None:
            try:
                decoded[rec.fqn] = load_value(io.BytesIO(windows[0][1]), rec.fqn, allow_pickle)
            except Exception as exc:  # noqa: BLE001 - reported below, after the checksums
                undecodable = exc
    if undecodable is not None:
        # Nothing written yet: check the files without writing (damage reads as damage), then
        # refuse the item.
        execute(opened, [p for n in per_file for p in whole_pieces(n, opened.files[n].size, None, 16 * 2**20)],
                verify=verify, pool=pool)
        raise undecodable
    if staged:  # the records only torch.load reads, read and checked before the first write
        def check(name: str, rec: RecordRead) -> None:
            check_slow(rec, memoryview(opened.peek(name, rec.start, rec.length)))

        run_all(pool, [lambda n=n, r=r: check(n, r) for n, recs in per_file.items() for r in recs  # type: ignore[misc]
                       if r.kind in ("small", "slow")])

    # 2. Every byte of every file, once: into the targets, or into a buffer and scattered;
    # 3. sizes and checksums per file, before anything else is set.
    pieces: List[RangeRead] = []
    for name, recs in per_file.items():
        pieces += file_ranges(name, opened.files[name].size, recs)
    for ws in sink.windows.values():
        ws.sort()
    assign_arrivals(per_file, pieces)
    execute(opened, pieces, verify=verify, threads=threads, pool=pool, consumer=sink,
            scratch_bytes=BUFFER_CHUNK_BYTES)

    # 4. The records the reads did not confirm; targets that share memory; devices; values.
    wrong = [rec for recs in per_file.values() for rec in recs if rec.arrived is not None]
    unparsed = []  # records of a layout data_start does not parse: not a misplaced offset, the slow path
    if len(wrong) != len(sink.confirmed):
        ok = set(map(id, sink.confirmed))
        for rec in wrong:
            a, tgt = rec.arrived, rec.target
            assert a is not None and tgt is not None
            if id(rec) in ok:
                continue
            if data_start(a.get, a.length, tgt.dtype, tuple(tgt.shape)) is not None:
                raise _misplaced(path, rec)
            unparsed.append(rec)
    for rec in unparsed:  # the record again, from its verified bytes (its data went into the target)
        assert rec.arrived is not None and rec.flat is not None
        copy_slow(rec, rec.arrived.record(rec.flat))
    # targets sharing memory with an earlier key's: their own verified data, in key order (the last key wins)
    for rec in sorted((r for recs in per_file.values() for r in recs if r.into is not None), key=lambda r: r.order):
        assert rec.into is not None and rec.target is not None
        sink.touched = True
        copy_into(rec.into, rec.target)
    if plan.devices:
        sink.touched = True
        plan.devices.commit()
    for fqn, value in decoded.items():
        set_element(state_dict, plan.mappings[fqn], value)


# ---- atomic: every file verified into host buffers first ----------------------------------------

#: ``acquire(sizes)`` -> (one flat uint8 CPU buffer of exactly each size, a function that gives them back).
Acquire = Callable[[Sequence[int]], Tuple[Sequence[torch.Tensor], Callable[[], None]]]


def staged_files(metadata: Metadata, files: Dict[str, FileRecord]) -> Dict[str, int]:
    """The data files ``metadata`` points at, with their manifest sizes (in file-name order)."""
    data = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    names = sorted({info.relative_path for info in data.values()})
    return {n: files[n].size for n in names if n in files}


def _fresh(sizes: Sequence[int]) -> Tuple[Sequence[torch.Tensor], Callable[[], None]]:
    return [torch.empty(n, dtype=torch.uint8) for n in sizes], lambda: None  # never zero-filled


@contextlib.contextmanager
def staged(storage: StepFiles, path: str, *, files: Dict[str, FileRecord], metadata: Metadata, verify: bool = True,
           threads: int = 8, acquire: Optional[Acquire] = None, budget: Optional[int] = None) -> Iterator[StagedFiles]:
    """Every data file ``metadata`` points at read and verified into buffers from ``acquire``
    (fresh ones without it), served as the step's files while the block runs; the buffers go
    back after it, whatever happened.

    Args:
        storage: the root's storage.
        path: the step directory.
        files: the manifest's records.
        metadata: the step's checked DCP metadata.
        verify: compare checksums (sizes are always compared).
        threads: how many reads run at once.
        acquire: where the host buffers come from (the manager's pool).
        budget: the most bytes ``acquire`` may hand out.

    Yields:
        The staged files (:class:`~.sinks.StagedFiles`), verified.

    Raises:
        StagingBudgetError: the files need more than ``budget``, before anything is read.
        CorruptCheckpointError: a damaged file (nothing was written anywhere).
    """
    sizes = staged_files(metadata, files)
    total = sum(sizes.values())
    if budget is not None and total > budget:
        raise StagingBudgetError(
            f"restore(..., atomic=True) of {path} stages its {len(sizes)} data files "
            f"({total / 2**20:.1f} MiB, {total} bytes) in host memory, but memory_budget_bytes is "
            f"{budget / 2**20:.1f} MiB ({budget} bytes); raise memory_budget_bytes, or restore with "
            "atomic=False, which reads straight into the target without that memory; the target "
            "was not touched")
    buffers, release = (acquire or _fresh)(list(sizes.values()))
    try:
        views = dict(zip(sizes, buffers))
        read_files(storage, path, {n: files[n] for n in views}, IntoBuffers(views), verify=verify, threads=threads)
        yield StagedFiles(storage, path, views)
    finally:
        release()

