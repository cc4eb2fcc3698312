"""Where the bytes :func:`~.read_exec.execute` reads go: the sinks of the one verified read.

* buffers (:func:`~.read_exec.read_files`): :class:`IntoBuffers` (buffers the caller holds: the
  atomic restore's host buffers), :data:`FRESH` (a fresh buffer per file), :data:`NULL` (kept
  nowhere: ``verify``, a check of a step's files, the check of a file an incremental save takes);
* :class:`StagedFiles`: files already read and verified into host buffers, served to a reader
  as its storage (``restore(..., atomic=True)``);
* :class:`TargetSink`: straight into the target tensors of a direct restore (CPU tensors
  themselves; XLA and CUDA tensors through host stand-ins, :class:`DeviceTargets`), the small
  records of a buffered piece scattered by one ``_foreach_copy_``;
* :class:`CopyTo`: into files of another storage, written as they are read (``promote``, a
  skipped upload caught up, a peer's copy brought home);
* :func:`stored_bytes` / :func:`aligned_copy`: a ``torch.save``-serialised tensor record into its
  target, straight from the read buffer (DCP's reader too).

Device targets (XLA, CUDA) of a direct restore are read into host stand-ins and put on their
devices once every file is verified (:class:`DeviceTargets`):

:func:`~.read_targets.load_direct` reads the data of each device target into a fresh host tensor of
the same dtype and shape (its *stand-in*; pinned for CUDA), like a CPU target and verified the
same way, so the device targets themselves are untouched until every file passed its size and
checksum checks. Only then does :meth:`DeviceTargets.commit` put the stand-ins on the devices.

CUDA: every target's ``copy_(stand_in, non_blocking=True)`` is issued on a side stream of its
device (which first waits for the work already queued on the current stream), then awaited
once; the current stream waits for the side stream, so later work sees the data.

XLA:

* where the PJRT device's memory is host memory (PJRT CPU), a DLPack import of each stand-in
  makes it the device buffer itself: nothing is copied;
* elsewhere, one batched host-to-device transfer for all of them per device
  (``_xla_tensors_from_aten``: every transfer issued, then awaited together);
* each target then takes its device tensor by ``copy_`` under ``no_grad``: the target stays
  the same Python object (parameters stay parameters), a whole tensor just holds the new
  buffer with no computation pending, and a view updates its base as ``copy_`` does.

A stand-in is never written again once it is on the device. A target listed twice (tied
parameters) has one stand-in and one transfer: the plan (:mod:`.read_plan`) reads the first
key's data into it and every later key's into a private host tensor, copied into the stand-in
in key order once every file is verified (the last key wins, as for CPU targets). Distinct
target objects that alias one device buffer get stand-ins of their own, committed in key order.
SPMD mode (tensors that may be sharded over devices) is not handled here: :func:`~.read_plan.device_supported` says so and the restore goes
through DCP.
"""

from __future__ import annotations

import bisect
import io
import threading
import types
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import compat
from ..addresses import byte_view
from ..errors import CorruptCheckpointError
from ..format.manifest import FileRecord, shown
from ..format.torch_record import plain_data_start
from .read_exec import BufferSink, OpenFiles, Piece, StepFiles, execute, whole_pieces
from .read_plan import RangeRead, RecordRead, record_pieces

# ---- buffers -------------------------------------------------------------------------------------


class IntoBuffers:
    """Into buffers the caller holds, by file name (each exactly the file's size)."""

    def __init__(self, views: Dict[str, torch.Tensor]) -> None:
        self.views = views

    def buffer(self, name: str, size: int) -> Optional[torch.Tensor]:
        return self.views[name]


class _Fresh:
    def buffer(self, name: str, size: int) -> Optional[torch.Tensor]:
        # one byte more: a file's last read catches a longer file in the same request;
        # never zero-filled: every byte is read into
        return torch.empty(size + 1, dtype=torch.uint8)


class _Null:
    def buffer(self, name: str, size: int) -> Optional[torch.Tensor]:
        return None


#: A fresh buffer per file (returned by :func:`~.read_exec.read_files`).
FRESH: BufferSink = _Fresh()
#: Nothing kept: the files are only checked.
NULL: BufferSink = _Null()


#: Copies out of a staged buffer at least this large go through ``torch`` (which releases the GIL).
_TORCH_COPY_BYTES = 2**20


class _StagedRanges:
    """A ranged reader over a staged buffer."""

    def __init__(self, buf: torch.Tensor) -> None:
        self._buf = buf
        self._mv = byte_view(buf)
        self.known_size: Optional[int] = buf.numel()

    def read_into(self, start: int, out: memoryview) -> int:
        n = max(0, min(len(out), self._buf.numel() - start))
        if n >= _TORCH_COPY_BYTES:
            torch.frombuffer(out, dtype=torch.uint8, count=n).copy_(self._buf[start:start + n])
        elif n:
            out[:n] = self._mv[start:start + n]
        return n

    def close(self) -> None:
        pass  # nothing held: the buffer is the caller's


class StagedFiles:
    """The files of ``views`` (``path/name`` -> verified bytes) served from memory, as the
    readers read a step (:class:`~.read_exec.StepFiles`); any other file from ``storage``."""

    is_local = True  # reads are memory copies: no request cost

    def __init__(self, storage: StepFiles, path: str, views: Dict[str, torch.Tensor]) -> None:
        self._storage = storage
        self._staged = {f"{path}/{name}": buf for name, buf in views.items()}

    def file_problem(self, where: str, inside: str) -> Optional[str]:
        return None if where in self._staged else self._storage.file_problem(where, inside)

    def open_ranges(self, where: str) -> Any:
        buf = self._staged.get(where)
        return self._storage.open_ranges(where) if buf is None else _StagedRanges(buf)

    def size(self, where: str) -> int:
        buf = self._staged.get(where)
        return self._storage.size(where) if buf is None else buf.numel()


# ---- a tensor record into its target -----------------------------------------------------------

def stored_bytes(item: memoryview, req: Any, target: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The copy that puts a ``torch.save``-serialised tensor's raw data into its target.

    The data sits in the file wherever the records before it ended, so its address need not
    be a multiple of the dtype's size, and kernels for wide dtypes (complex128) may fault on
    a misaligned source. ``src`` is therefore the data viewed as ``target``'s dtype only where
    it is aligned; otherwise it stays bytes (see :func:`aligned_copy`).

    Args:
        item: the record's bytes, straight from the read buffer.
        req: the read item (its ``storage_offsets`` and ``lengths``).
        target: the tensor the item goes into.

    Returns:
        ``(dst, src)``: copying ``src`` into ``dst`` fills ``target``; ``None`` unless the item
        is the plain case (one little-endian, uncompressed storage of exactly ``target``'s size
        and shape, read whole, see :func:`~async_ckpt.format.torch_record.plain_data_start`),
        where ``torch.load`` is used.
    """
    nbytes = target.numel() * target.element_size()
    if nbytes == 0 or any(req.storage_offsets) or list(req.lengths) != list(target.size()):
        return None
    start = plain_data_start(item, target.dtype, tuple(target.shape))
    if start is None:
        return None
    with warnings.catch_warnings():  # a read-only buffer (bytes) is fine: it is only copied from
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(item, dtype=torch.uint8, count=nbytes, offset=start)
    return aligned_copy(raw, target)


def aligned_copy(raw: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(dst, src)`` that copy the bytes ``raw`` (flat uint8, ``target``'s size) into ``target``
    without ever reading ``raw`` as a wider type at an address that type is not aligned to.

    Aligned: ``raw`` viewed as ``target``'s dtype and shape. Misaligned, into a contiguous CPU
    or CUDA target without a conjugate or negative bit: ``target``'s bytes (a uint8 view) take
    ``raw`` as bytes (still one copy). Otherwise ``raw`` is first copied into a fresh (aligned)
    buffer, which is then viewed as ``target``'s dtype.
    """
    itemsize = target.element_size()
    if raw.data_ptr() % itemsize == 0:
        return target, raw.view(target.dtype).view(target.shape)
    if target.device.type in ("cpu", "cuda") and target.layout == torch.strided and target.is_contiguous() \
            and not target.is_conj() and not target.is_neg() and not target.is_quantized:
        # as_strided, not view(-1): a one-element target may have any stride (w[:, 0] of a (1, N) matrix)
        return target.as_strided((target.numel(),), (1,)).view(torch.uint8), raw
    return target, raw.clone().view(target.dtype).view(target.shape)


def _whole(t: torch.Tensor) -> Any:
    return types.SimpleNamespace(storage_offsets=[0] * t.dim(), lengths=list(t.shape))


def load_tensor(rec: RecordRead, item: memoryview) -> torch.Tensor:
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


def check_slow(rec: RecordRead, item: memoryview) -> None:
    """Before any write (staged restores): a record that only ``torch.load`` reads is read now
    and checked (kept in ``rec.loaded``); a small one of another layout goes the slow path."""
    t = rec.target
    assert t is not None
    if rec.kind == "small" and plain_data_start(item, t.dtype, tuple(t.shape)) is not None:
        return
    rec.kind = "slow"
    if stored_bytes(item, _whole(t), t) is None:
        rec.loaded = load_tensor(rec, item)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; under ``torch.inference_mode`` for an inference tensor, the only
    place it may be written."""
    if dst.is_inference():
        with torch.inference_mode():
            dst.copy_(src)
    else:
        dst.copy_(src)


def copy_slow(rec: RecordRead, item: memoryview) -> None:
    """A record into a target that is not plain contiguous memory, or of another layout."""
    t = rec.target
    assert t is not None
    raw = None if rec.loaded is not None else stored_bytes(item, _whole(t), t)
    dst, src = raw if raw is not None else (t, rec.loaded if rec.loaded is not None else load_tensor(rec, item))
    copy_into(dst, src)


# ---- into the target tensors -------------------------------------------------------------------

class TargetSink:
    """The bytes of a direct restore's pieces into its targets (a :class:`~.read_exec.Consumer`).

    A piece straight into a target needs nothing more (:meth:`writing` notes that the caller's
    memory is being written). A buffered piece (:class:`~.read_plan.RangeRead`) hands its bytes to
    :meth:`arrived`: the large records whose head or tail it holds take them
    (:class:`~.read_plan.Arrived`: where their data lies, confirmed), the windows probed earlier
    are compared with them (a file changed while it was read is damage), and the small tensor
    records in it go into their targets, by one ``_foreach_copy_`` of runs of evenly spaced
    same-sized pieces; the others (another layout, a target that is not plain memory) by the
    slow path.

    Args:
        where: the file path of a file name (for messages).
        windows: per file, ``(offset, bytes)`` probed before the reads (sorted).
    """

    def __init__(self, where: Any, windows: Dict[str, List[Tuple[int, bytes]]]) -> None:
        self._where = where
        self.windows = windows
        #: whether the caller's memory was written
        self.touched = False
        #: direct records whose arrived bytes put the data where the manifest said
        self.confirmed: List[RecordRead] = []

    def writing(self, piece: Piece) -> None:
        self.touched = True

    def finished(self, name: str, error: Optional[BaseException]) -> None:
        pass  # a direct restore is not read sequentially

    def arrived(self, piece: Piece, buf: torch.Tensor, mv: memoryview) -> None:
        assert isinstance(piece, RangeRead)
        for rec in piece.arrivals:
            a = rec.arrived
            assert a is not None and rec.target is not None
            if a.take(piece.start, mv) and a.agrees(rec.target.dtype, tuple(rec.target.shape)):
                self.confirmed.append(rec)  # (list.append: atomic)
        for w0, data in self.windows.get(piece.name, ()):
            lo, hi = max(w0, piece.start), min(w0 + len(data), piece.end)
            if lo < hi and mv[lo - piece.start:hi - piece.start] != data[lo - w0:hi - w0]:
                where = self._where(piece.name)
                raise CorruptCheckpointError(f"{where}: changed while it was being read", path=where)
        dsts: List[torch.Tensor] = []
        own = False  # a dst is the caller's memory
        # the small tensors' data in buf, as runs of evenly spaced same-sized pieces
        # [first offset, spacing, bytes, count]: one view per run, cut into rows in C
        runs: List[List[int]] = []
        for rec in piece.recs:
            at = rec.start - piece.start
            if rec.kind == "small":
                assert rec.target is not None and rec.flat is not None
                item = mv[at:at + rec.length]
                s = plain_data_start(item, rec.target.dtype, tuple(rec.target.shape))
                if s is None:
                    self.touched = self.touched or rec.own
                    copy_slow(rec, item)
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
                self.touched = self.touched or rec.own
                copy_slow(rec, mv[at:at + rec.length])
        if dsts:
            srcs: List[torch.Tensor] = []
            for first, spacing, nb, count in runs:
                if count == 1:
                    srcs.append(buf.narrow(0, first, nb))
                else:
                    srcs.extend(buf.as_strided((count, nb), (spacing, 1), first).unbind(0))
            self.touched = self.touched or own
            with torch.no_grad():
                compat.foreach_copy_(dsts, srcs)


# ---- into another storage ----------------------------------------------------------------------

class CopyTo:
    """Files of a step written to another storage as they are read, in order (a
    :class:`~.read_exec.Consumer` of a sequential :func:`~.read_exec.execute`): a file is
    completed only once it was read whole and verified; a failure discards it (object stores
    complete no upload; elsewhere the caller removes the step being written).

    Args:
        storage: where the files go.
        path: the directory they go into (it exists).
        files: their manifest records (sizes, for the uploads).
    """

    def __init__(self, storage: Any, path: str, files: Dict[str, FileRecord]) -> None:
        self.storage, self.path, self.files = storage, path, files
        self._open: Dict[str, Tuple[Any, Any]] = {}  # name -> (context manager, file)
        self._lock = threading.Lock()

    def writing(self, piece: Piece) -> None:
        pass  # pieces are read into the reading thread's buffer, never into the caller's memory

    def arrived(self, piece: Piece, buf: torch.Tensor, data: memoryview) -> None:
        with self._lock:
            got = self._open.get(piece.name)
        if got is None:
            cm = self.storage.open_write(f"{self.path}/{piece.name}", size_hint=self.files[piece.name].size)
            got = (cm, cm.__enter__())
            with self._lock:
                self._open[piece.name] = got
        got[1].write(data)

    def finished(self, name: str, error: Optional[BaseException]) -> None:
        with self._lock:
            got = self._open.pop(name, None)
        if got is None:  # an empty file: no piece brought bytes
            if error is not None:
                return
            cm = self.storage.open_write(f"{self.path}/{name}", size_hint=0)
            got = (cm, cm.__enter__())
        cm = got[0]
        if error is None:
            cm.__exit__(None, None, None)
        else:
            cm.__exit__(type(error), error, error.__traceback__)  # discarded, as a failed write is

    def close(self, error: BaseException) -> None:
        """Discard every file still open (a read failed before their end)."""
        with self._lock:
            left, self._open = self._open, {}
        for cm, _ in left.values():
            try:
                cm.__exit__(type(error), error, error.__traceback__)
            except Exception:  # noqa: BLE001 - the read's own failure is the one raised
                pass


def copy_files(src: StepFiles, src_dir: str, files: Dict[str, FileRecord], dst: Any, dst_dir: str, *,
               verify: bool = True, threads: int = 4, block_bytes: int = 8 * 2**20) -> None:
    """Copy the files ``files`` of the step ``src_dir`` to ``dst_dir`` of ``dst`` through the one
    verified read: each file read in order, ``block_bytes`` at a time (never a whole file in
    memory), written as it is read (:class:`CopyTo`), and checked against its manifest record
    (size, and CRC-32C with ``verify``) before its copy is completed; ``threads`` files at once.

    Args:
        src: the storage holding the step. src_dir: the step's directory there.
        files: the files, with their manifest records.
        dst: the storage to copy to. dst_dir: the directory there (it exists).
        verify: check CRC-32Cs (sizes are always checked).
        threads: files copied at once.
        block_bytes: bytes read and written at a time.

    Raises:
        CorruptCheckpointError: a file is missing, is not a plain file inside ``src_dir``, or
            its size or checksum is not the manifest's: its copy is not completed (object
            stores: nothing is left; elsewhere a partial file may be, in the step the caller
            aborts).
        StorageError: reading or writing failed.
    """
    sink = CopyTo(dst, dst_dir, files)
    try:
        with OpenFiles(src, src_dir, files) as opened:
            pieces = [p for name, rec in files.items() for p in whole_pieces(name, rec.size, None, block_bytes)]
            execute(opened, pieces, verify=verify, threads=threads, consumer=sink, sequential=True,
                    scratch_bytes=min(block_bytes, max((r.size for r in files.values()), default=0)) + 1)
    except BaseException as exc:
        sink.close(exc)
        raise


def read_ranges(storage: StepFiles, path: str, files: Dict[str, FileRecord], wanted: Dict[str, List[Tuple[int, int]]],
                *, verify: bool = True, threads: int = 8) -> Dict[Tuple[str, int], bytes]:
    """Byte ranges of a step's files, through the one verified read: of a file whose manifest
    lists its records, the records the ranges lie in, each checked against its CRC-32C; of any
    other file, each range alone (its length checked: its checksum is the whole file's, which
    ``verify`` reads).

    Args:
        storage: the root's storage.
        path: the step directory.
        files: the manifest's records of the files.
        wanted: per file, the ``(offset, length)`` ranges to read.
        verify: compare checksums.
        threads: how many reads run at once.

    Returns:
        ``(file, offset)`` -> the bytes of that range.

    Raises:
        CorruptCheckpointError: a file missing, unsafe, too short, or a record's checksum.
    """
    listed = {n: r for n, r in wanted.items() if files[n].records is not None}
    pieces, covered, runs = record_pieces(files, listed, 32 * 2**20)
    alone: Dict[Tuple[str, int], bytearray] = {}
    for name, spans in wanted.items():
        if name in listed:
            continue
        covered[name] = []
        for offset, length in spans:
            buf = alone[(name, offset)] = bytearray(length)
            pieces.append(Piece(name, offset, offset + length, memoryview(buf)))
    with OpenFiles(storage, path, {n: files[n] for n in wanted}) as opened:
        execute(opened, pieces, verify=verify, threads=threads, records=covered)
    out = {k: bytes(v) for k, v in alone.items()}
    for name, spans in listed.items():
        starts, bufs = runs[name]
        for offset, length in spans:
            k = max(0, bisect.bisect_right(starts, offset) - 1)
            out[(name, offset)] = bytes(bufs[k][offset - starts[k]:offset - starts[k] + length])
    return out


# ---- device targets ----------------------------------------------------------------------------

#: Whether stand-ins become device buffers by DLPack import (True) or are transferred (False);
#: None: decided from the PJRT device type (DLPack on ``CPU``).
HOST_BACKED: Optional[bool] = None


def _host_backed() -> bool:
    if HOST_BACKED is not None:
        return HOST_BACKED
    try:
        import torch_xla.runtime as xr

        return xr.device_type() == "CPU"
    except Exception:  # no usable torch_xla runtime: not a CPU-backed XLA device
        return False


class DeviceTargets:
    """The device targets of one restore and their host stand-ins."""

    def __init__(self) -> None:
        self._pairs: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(target) -> (target, stand-in)

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def has(self, target: torch.Tensor) -> bool:
        """Whether ``target`` (this very object) already has a stand-in."""
        return id(target) in self._pairs

    def stand_in(self, target: torch.Tensor) -> torch.Tensor:
        """The contiguous host tensor that receives ``target``'s data (one per target object)."""
        got = self._pairs.get(id(target))
        if got is None:
            got = (target, _host_tensor(target))  # never zero-filled
            self._pairs[id(target)] = got
        return got[1]

    def commit(self) -> None:
        """Every stand-in onto its target's device, then into the target, in the order the
        targets were first given stand-ins (key order; see the module docstring); the stand-ins
        are released."""
        pairs = [p for p in self._pairs.values() if p[0].device.type == "xla"]
        cuda = [p for p in self._pairs.values() if p[0].device.type == "cuda"]
        self._pairs.clear()
        if cuda:
            _commit_cuda(cuda)
        srcs: List[Optional[torch.Tensor]] = [None] * len(pairs)
        if _host_backed():
            from torch.utils.dlpack import to_dlpack

            from_dlpack = compat.xla_from_dlpack_fn()
            for i, (target, host) in enumerate(pairs):
                try:
                    x = from_dlpack(to_dlpack(host))
                except Exception:  # no DLPack view of this buffer: the copy below transfers it
                    continue  # transferred below
                if x.device == target.device:
                    srcs[i] = x
        by_device: Dict[str, List[int]] = {}
        for i, (target, _) in enumerate(pairs):
            if srcs[i] is None:
                by_device.setdefault(str(target.device), []).append(i)
        for device, idx in by_device.items():
            moved = compat.xla_tensors_from_aten([pairs[i][1] for i in idx], device)
            for i, x in zip(idx, moved):
                srcs[i] = x
        with torch.no_grad():
            for (target, _), src in zip(pairs, srcs):
                assert src is not None
                target.copy_(src)


def _host_tensor(target: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor like ``target`` (pinned for a CUDA target, where pinning works)."""
    if target.device.type == "cuda":
        try:
            return torch.empty(tuple(target.shape), dtype=target.dtype, pin_memory=True)
        except RuntimeError:  # pinning refused (limits): a pageable buffer copies too, slower
            pass
    return torch.empty(tuple(target.shape), dtype=target.dtype)


def _commit_cuda(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every CUDA stand-in into its target: copies issued on one side stream per device, then
    awaited (the stand-ins must outlive them)."""
    by_device: Dict[torch.device, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    for target, host in pairs:
        by_device.setdefault(target.device, []).append((target, host))
    streams = []
    with torch.no_grad():
        for device, group in by_device.items():
            with torch.cuda.device(device):
                current = torch.cuda.current_stream(device)
                side = torch.cuda.Stream(device)
                side.wait_stream(current)  # the targets may still be in use by queued work
                with torch.cuda.stream(side):
                    for target, host in group:
                        target.copy_(host, non_blocking=host.is_pinned())
                streams.append((current, side))
    for current, side in streams:
        side.synchronize()
        current.wait_stream(side)
