"""Where the bytes :func:`~.read_exec.execute` reads go: the sinks of the one verified read.

* buffers (:func:`~.read_exec.read_files`): :class:`IntoBuffers` (buffers the caller holds: the
  atomic restore's host buffers), :data:`FRESH` (a fresh buffer per file), :data:`NULL` (kept
  nowhere: ``verify``, a check of a step's files, the check of a file an incremental save takes);
* :class:`StagedFiles`: files already read and verified into host buffers, served to a reader
  as its storage (``restore(..., atomic=True)``);
* :class:`TargetSink`: straight into the target tensors of a direct restore (CPU tensors
  themselves; XLA and CUDA tensors through host stand-ins,
  :class:`~.device_targets.DeviceTargets`), the small records of a buffered piece scattered by
  one ``_foreach_copy_``; a record of another layout, or into a target that is not plain memory,
  by ``torch.load`` (:func:`copy_slow`). Where a record's data lies and how it goes into its
  target: :mod:`async_ckpt.format.torch_record`.

Elsewhere: files copied to another storage (:mod:`.copies`), byte ranges (:mod:`.ranges`).
"""

from __future__ import annotations

import io
import types
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import compat
from ..addresses import byte_view
from ..errors import CorruptCheckpointError
from ..format.manifest import shown
from ..format.torch_record import plain_data_start, stored_bytes
from .read_exec import BufferSink, Piece, StepFiles
from .read_plan import RangeRead, RecordRead

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
