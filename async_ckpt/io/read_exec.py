"""The one verified read of a step's files: the only module that opens a step's data files.

Every path that reads a step's bytes goes through here: the direct restore into the target
tensors, the atomic restore's staging into host buffers, DCP's ``StorageReader``, ``verify``,
``show --values``, the copies between roots (``promote``, a skipped upload caught up, a peer's
copy), the incremental save's check of the files it takes, and its read-back of a record.

* :class:`OpenFiles`: a step's files opened after the reader's checks (a safe name, a plain
  file inside the step directory, the manifest's size where the storage knows it without
  another request); :meth:`OpenFiles.peek` is the one unverified read (a record's ends, probed
  before the reads that verify them; the bytes are compared when those arrive).
* :func:`execute`: the executor. It reads :class:`Piece` s (a range of a file, into the
  caller's memory or into a per-thread buffer handed to a :class:`Consumer`), a run of
  consecutive pieces of one file per job (one sequential stream: the kernel's readahead works
  for it), the jobs spread over ``threads``; each piece's CRC-32C is computed on the thread that
  read it, right after the read. A file is verified whole (its pieces tile it: the size, not a
  byte more, and the CRC-32C put together from the pieces' CRC-32Cs, :func:`check_file`) or,
  where the manifest lists its records, record by record (each record a read touches against
  its CRC-32C).
* :func:`read_files`: whole files into buffers a :class:`BufferSink` gives (the sinks are in
  :mod:`.sinks`).
* :class:`FileStream`: one file read in order, chunk by chunk, verified when its last chunk is
  read (a peer's copy sent over the network, chunk by chunk).

Every failure is a :class:`~async_ckpt.errors.CorruptCheckpointError` worded by
:func:`size_error`, :func:`checksum_error`, :func:`short_error` or :func:`missing_error`, the
same from every path.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from ..addresses import byte_view
from ..errors import CorruptCheckpointError, StorageError
from ..format.crc import crc32c, crc32c_combine, crc32c_concat
from ..format.manifest import FileRecord, check_file_name

#: Ranges of whole-file reads are about this large (a bigger file is read as several, in parallel).
CHUNK_BYTES = 16 * 2**20

#: What :meth:`StepFiles.file_problem` says of a file that is not there.
MISSING = "file is missing"


class StepFiles(Protocol):
    """What reading a step's files needs of a storage: ``Storage`` has it, and so does
    :class:`~.sinks.StagedFiles` (files already read and verified, in memory)."""

    @property
    def is_local(self) -> bool:
        """Whether a read is cheap (no per-request cost)."""

    def file_problem(self, where: str, inside: str) -> Optional[str]:
        """Why ``where`` is not a plain file inside ``inside``; ``None`` when it is."""

    def open_ranges(self, where: str) -> Any:
        """``where`` opened for ranged reads (``read_into``, ``known_size``, ``close``)."""

    def size(self, where: str) -> int:
        """The size of ``where`` (a checkpoint without a manifest: nothing else tells it)."""


# ---- the one wording ---------------------------------------------------------------------------

def size_problem(got: int, size: int, *, longer: bool = False) -> str:
    """A file of another size than the manifest's, as a problem of that file.

    Args:
        got: the bytes found (with ``longer``: the manifest's size, which the file goes past).
        size: the manifest's size.
        longer: the file goes on past ``size``.

    Returns:
        ``"size is N bytes, manifest says M"``.
    """
    said = f"more than {got}" if longer else str(got)
    return f"size is {said} bytes, manifest says {size}"


def size_error(where: str, got: int, size: int, *, longer: bool = False) -> CorruptCheckpointError:
    """A file of another size than the manifest's (:func:`size_problem`).

    Args:
        where: the file.
        got: the bytes found (with ``longer``: the manifest's size, which the file goes past).
        size: the manifest's size.
        longer: the file goes on past ``size``.

    Returns:
        The error (to raise).
    """
    return CorruptCheckpointError(f"{where}: {size_problem(got, size, longer=longer)}", path=where)


def checksum_error(where: str, crc: int, want: int, span: Optional[Tuple[int, int]] = None) -> CorruptCheckpointError:
    """A file (or, with ``span``, the record at those bytes of it) whose CRC-32C is not the manifest's.

    Args:
        where: the file.
        crc: the CRC-32C of what was read.
        want: the manifest's.
        span: ``(start, end)`` of the record within the file, for a record's checksum.

    Returns:
        The error (to raise).
    """
    at = "" if span is None else f" in the record at bytes {span[0]}-{span[1]}"
    return CorruptCheckpointError(f"{where}: checksum mismatch{at} (crc32c {crc:#010x}, manifest says {want:#010x})",
                                  path=where)


def short_error(where: str, end: int) -> CorruptCheckpointError:
    """A file that ends before byte ``end``, which the manifest places in it.

    Args:
        where: the file.
        end: the first byte past the range that could not be read whole.

    Returns:
        The error (to raise).
    """
    return CorruptCheckpointError(f"{where}: file ends before byte {end}, which the manifest places in it",
                                  path=where)


def missing_error(where: str, problem: str = MISSING) -> CorruptCheckpointError:
    """A step's file that is not there, or not a plain file inside the step directory.

    Args:
        where: the file.
        problem: what is wrong with it (:meth:`StepFiles.file_problem`'s answer).

    Returns:
        The error (to raise).
    """
    return CorruptCheckpointError(f"{where}: {problem}", path=where)


def check_file(where: str, size: int, parts: Iterable[Tuple[int, int, int, int]], want: int, verify: bool) -> None:
    """The one definition of a verified file, from the ranges read of it.

    Args:
        where: the file.
        size: the manifest's size.
        parts: ``(start, end, got, crc)`` per range, covering ``[0, size)`` in order: ``got`` the
            bytes the read returned (more than ``end - start`` when the file goes on past
            ``size``), ``crc`` the CRC-32C of the bytes of ``[start, start + got)`` inside the range.
        want: the manifest's CRC-32C.
        verify: compare the checksum (else sizes only).

    Raises:
        CorruptCheckpointError: a short or long file, or (``verify``) a checksum mismatch.
    """
    ps = list(parts)
    for start, end, got, _ in ps:
        if got < end - start:
            raise size_error(where, start + got, size)
        if got > end - start:
            raise size_error(where, size, size, longer=True)
    if verify:
        crc = crc32c_concat((c, end - start) for start, end, _, c in ps)
        if crc != want:
            raise checksum_error(where, crc, want)


def check_sizes(storage: Any, path: str, files: Mapping[str, FileRecord]) -> Dict[str, str]:
    """A cheap look at a step's files that reads no data: each must be a regular file inside the
    step directory with the manifest's size (one listing gives every size on object stores).

    Args:
        storage: the root's storage.
        path: the step directory.
        files: the manifest's records.

    Returns:
        Per file that fails, what is wrong with it (empty: the step passed).
    """
    listed: Optional[Dict[str, Dict[str, Any]]] = None
    if not storage.is_local:  # one listing gives every size
        listed = {e["name"]: e for e in storage.listdir(path)}
    problems: Dict[str, str] = {}
    for name, rec in sorted(files.items()):
        where = f"{path}/{name}"
        if listed is not None:
            e = listed.get(name)
            if e is None:
                problems[name] = MISSING
                continue
            if e.get("type") == "directory":
                problems[name] = "is a directory, not a file"
                continue
            size = int(e["size"]) if e.get("size") is not None else storage.size(where)
        else:
            problem = storage.file_problem(where, path)
            if problem is not None:
                problems[name] = problem
                continue
            size = storage.size(where)
        if size != rec.size:
            problems[name] = size_problem(size, rec.size)
    return problems


# ---- opening a step's file ---------------------------------------------------------------------

@contextlib.contextmanager
def unreadable_is_damage(where: str) -> Iterator[None]:
    """A step's file that is missing or is a directory: :class:`CorruptCheckpointError` (the
    step is damaged); other storage errors pass through."""
    try:
        yield
    except FileNotFoundError:
        raise missing_error(where) from None
    except StorageError as exc:
        if isinstance(exc.__cause__, (IsADirectoryError, NotADirectoryError)):
            raise missing_error(where, f"is not a readable file ({exc.__cause__})") from exc
        raise


class _CheckedRanges:
    """A step file's ranged reader whose reads say a missing file is damage, as opening does."""

    def __init__(self, reader: Any, where: str) -> None:
        self._reader, self._where = reader, where
        self.known_size: Optional[int] = reader.known_size

    def read_into(self, start: int, out: memoryview) -> int:
        with unreadable_is_damage(self._where):
            return int(self._reader.read_into(start, out))

    def close(self) -> None:
        self._reader.close()


def open_step_file(storage: StepFiles, path: str, name: str, size: int) -> _CheckedRanges:
    """``path/name`` opened for ranged reads after the reader's checks: a safe name, a plain
    file inside the step directory (no link out of it), of ``size`` where the storage knows the
    size without another request.

    Args:
        storage: the root's storage.
        path: the step directory.
        name: the file's name in it (as the manifest lists it).
        size: the manifest's size of it.

    Returns:
        A ranged reader (``read_into``, ``known_size``, ``close``); its reads raise
        :class:`CorruptCheckpointError` for a file found missing only then (object stores open
        nothing before the first read).

    Raises:
        CorruptCheckpointError: an unsafe name, not a plain file inside ``path``, missing, a
            directory, or of another size than ``size``.
    """
    where = f"{path}/{name}"
    check_file_name(name, where=where)
    problem = storage.file_problem(where, path)
    if problem is not None:
        raise missing_error(where, problem)
    with unreadable_is_damage(where):
        reader = storage.open_ranges(where)
    if reader.known_size is not None and reader.known_size != size:
        reader.close()
        raise size_error(where, reader.known_size, size)
    return _CheckedRanges(reader, where)


class OpenFiles:
    """Files of one step opened for the executor (:func:`open_step_file` for each).

    Args:
        storage: the root's storage.
        path: the step directory.
        files: the files to open, with their manifest records.

    Raises:
        CorruptCheckpointError: see :func:`open_step_file` (nothing is left open).
    """

    def __init__(self, storage: StepFiles, path: str, files: Mapping[str, FileRecord]) -> None:
        self.storage, self.path = storage, path
        self.files: Dict[str, FileRecord] = dict(files)
        self._readers: Dict[str, _CheckedRanges] = {}
        try:
            for name, rec in self.files.items():
                self._readers[name] = open_step_file(storage, path, name, rec.size)
        except BaseException:
            self.close()
            raise

    def where(self, name: str) -> str:
        """The path of the file ``name``."""
        return f"{self.path}/{name}"

    def size_known(self, name: str) -> bool:
        """Whether the storage told the file's size when it was opened (local files)."""
        return self._readers[name].known_size is not None

    def read_into(self, name: str, start: int, out: memoryview) -> int:
        """Read ``name[start:start+len(out)]`` into ``out``; the bytes read (fewer at the end of
        the file). For the executor: the bytes are verified by the caller."""
        return self._readers[name].read_into(start, out)

    def peek(self, name: str, start: int, n: int) -> bytes:
        """Up to ``n`` bytes of ``name`` from ``start``, not verified: the caller compares them
        with the verified bytes of the same range when those arrive (:func:`execute`), or
        reads the whole file verified before it trusts them.

        Args:
            name: the file.
            start: the first byte.
            n: how many bytes.

        Returns:
            The bytes read (fewer at the end of the file).
        """
        buf = bytearray(n)
        got = self._readers[name].read_into(start, memoryview(buf))
        return bytes(buf[:got])

    def close(self) -> None:
        """Close every file (a failure to close is not the read's: it was read, or failed, already)."""
        readers, self._readers = self._readers, {}
        for r in readers.values():
            try:
                r.close()
            except Exception:  # noqa: BLE001 - closing a read handle: the bytes were read (or the read failed) already
                pass

    def __enter__(self) -> "OpenFiles":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_all(pool: ThreadPoolExecutor, fns: Sequence[Callable[[], Any]]) -> List[Any]:
    """Run ``fns`` on ``pool``; their results in order. On the first failure the tasks not yet
    started are cancelled and it is raised once the running ones finish."""
    futs = [pool.submit(f) for f in fns]
    wait(futs, return_when=FIRST_EXCEPTION)
    for f in futs:
        if f.done() and not f.cancelled() and f.exception() is not None:
            for g in futs:
                g.cancel()
            wait(futs)
            raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futs]


# ---- the executor ------------------------------------------------------------------------------

@dataclass
class Piece:
    """One ranged read of a step's file.

    Attributes:
        name: the file.
        start: the first byte.
        end: the byte past the last (exclusive).
        dest: where the bytes go (at least ``end - start`` bytes; one more lets a file's last
            piece catch a longer file in the same request); None: a per-thread buffer, handed
            to the :class:`Consumer` once read.
        own: ``dest`` is the caller's memory (a failure after its read left the caller partly
            written).
    """

    name: str
    start: int
    end: int
    dest: Optional[memoryview] = None
    own: bool = True


class Consumer(Protocol):
    """What becomes of the bytes :func:`execute` reads (a sink of :mod:`.sinks`, or
    :class:`~.copies.CopyTo`)."""

    def writing(self, piece: Piece) -> None:
        """The read of ``piece`` into its ``dest`` (the caller's memory) starts."""

    def arrived(self, piece: Piece, buf: torch.Tensor, data: memoryview) -> None:
        """``piece`` (without a ``dest``) was read whole: ``data`` is its bytes, at the start of
        ``buf`` (the reading thread's buffer; valid until this returns)."""

    def finished(self, name: str, error: Optional[BaseException]) -> None:
        """Sequential reads: the file ``name`` was read whole and verified (``error`` None), or
        not (``error``, raised right after)."""


class _Scratch(threading.local):
    buf: Optional[torch.Tensor] = None

    def get(self, n: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < n:
            self.buf = torch.empty(n, dtype=torch.uint8)  # never zero-filled: every byte used is read into
        return self.buf


class _File:
    """What :func:`execute` checks of one file: its pieces' outcomes, then the file."""

    def __init__(self, opened: OpenFiles, name: str, records: Optional[Sequence[int]]) -> None:
        rec = opened.files[name]
        self.name, self.where, self.rec = name, opened.where(name), rec
        self.parts: List[Tuple[int, int, int, int]] = []  # whole: (start, end, got, crc) per piece
        self.records: Optional[List[int]] = None  # by record: which ones
        self.starts: List[int] = []
        self.record_parts: Dict[int, List[Tuple[int, int, int]]] = {}  # record -> (start, crc, length)
        if records is not None:  # by record (none listed: ranges checked for their length only)
            self.records = sorted(set(records))
            if rec.records is not None:
                self.starts = [0, *itertools.accumulate(n for n, _ in rec.records)]

    def read(self, piece: Piece, got: int, data: memoryview, verify: bool) -> Tuple[int, int, int, int]:
        """The outcome of ``piece`` (``data``: its bytes read, at most its length)."""
        n = piece.end - piece.start
        if self.records is None:
            return piece.start, piece.end, got, (crc32c(data) if verify else 0)
        if got < n:
            raise short_error(self.where, piece.end)
        if verify and self.records:  # the CRC-32C of each record's part in the piece
            starts = self.starts
            k = max(0, bisect.bisect_right(starts, piece.start) - 1)
            while k < len(starts) - 1 and starts[k] < piece.end:
                lo, hi = max(piece.start, starts[k]), min(piece.end, starts[k + 1])
                if lo < hi:
                    self.record_parts.setdefault(k, []).append((lo, crc32c(data[lo - piece.start:hi - piece.start]),
                                                                hi - lo))
                k += 1
        return piece.start, piece.end, got, 0

    def check(self, verify: bool) -> None:
        """Raise :class:`CorruptCheckpointError` unless the file (or each record read) is verified."""
        if self.records is None:
            self.parts.sort()
            check_file(self.where, self.rec.size, self.parts, self.rec.crc32c, verify)
            return
        if not verify or not self.records:
            return
        assert self.rec.records is not None
        for k in self.records:
            lo, hi = self.starts[k], self.starts[k + 1]
            crc, at = 0, lo
            for start, c, length in sorted(self.record_parts.get(k, ())):
                crc, at = crc32c_combine(crc, c, length), start + length
            want = self.rec.records[k][1]
            if at != hi or crc != want:
                raise checksum_error(self.where, crc, want, (lo, hi))


def execute(opened: OpenFiles, pieces: Sequence[Piece], *, verify: bool = True, threads: int = 8,
            pool: Optional[ThreadPoolExecutor] = None, records: Optional[Mapping[str, Sequence[int]]] = None,
            consumer: Optional[Consumer] = None, progress: Optional[Callable[[int], None]] = None,
            sequential: bool = False, scratch_bytes: int = 0) -> None:
    """Read ``pieces`` of the files of ``opened``, in parallel, and verify each file.

    A file is verified whole: its pieces tile it from byte 0 to its manifest size, and its
    CRC-32C is put together from theirs (:func:`check_file`); where the storage did not tell
    its size, its last piece reads one byte more, so that a longer file is caught as well as a
    shorter one. With ``records`` naming the records of a file whose pieces cover exactly
    those records (its manifest lists its records), each of them is checked against its own
    CRC-32C instead, and a piece that ends early is :func:`short_error` (an empty list: ranges
    read for themselves, checked for their length only).

    Args:
        opened: the step's files, opened.
        pieces: what to read.
        verify: compare checksums (sizes are always compared).
        threads: how many reads run at once (without ``pool``).
        pool: run on this pool instead of a new one.
        records: per file read record by record, the indices of the records its pieces cover.
        consumer: what becomes of pieces read into a buffer (and of the caller's memory).
        progress: called with the byte count of each piece once it is read (from the reading
            threads, one call at a time).
        sequential: each file's pieces are read in order on one thread, and the file is
            checked (``consumer.finished``) right after its last piece (a copy written as it
            is read).
        scratch_bytes: the least size of a thread's buffer (it grows for a longer piece).

    Raises:
        CorruptCheckpointError: a file of another size or (``verify``) another checksum, or what
            the consumer raises; nothing is reported until every read finished (sequential:
            the file's own failure, once its job ended).
    """
    files: Dict[str, _File] = {}
    per: Dict[str, List[Piece]] = {}
    for p in pieces:
        per.setdefault(p.name, []).append(p)
    for name in per:
        per[name].sort(key=lambda p: p.start)
        files[name] = _File(opened, name, (records or {}).get(name))
    scratch = _Scratch()
    lock = threading.Lock()

    def read(f: _File, piece: Piece, last: bool) -> Tuple[int, int, int, int]:
        n = piece.end - piece.start
        extra = int(last and f.records is None and not opened.size_known(f.name))  # catches a longer file
        dest = piece.dest
        if dest is not None:
            if consumer is not None and piece.own:
                consumer.writing(piece)
            view = dest[:n + extra] if len(dest) >= n + extra else dest[:n]
            got = opened.read_into(f.name, piece.start, view) if n + extra else 0
            data = dest[:min(got, n)]
            buf: Optional[torch.Tensor] = None
        else:
            buf = scratch.get(max(n + extra, scratch_bytes))
            view = byte_view(buf)[:n + extra]
            got = opened.read_into(f.name, piece.start, view) if n + extra else 0
            data = view[:min(got, n)]
        out = f.read(piece, got, data, verify)
        if progress is not None and got:
            with lock:
                progress(min(got, n))
        if extra and got == n and len(view) == n:
            got += opened.read_into(f.name, piece.end, memoryview(bytearray(1)))  # the file goes on past its size
            out = (out[0], out[1], got, out[3])
        if buf is not None and consumer is not None and got >= n:
            consumer.arrived(piece, buf, data)
        return out

    def run(name: str, group: List[Piece]) -> None:
        f = files[name]
        last = per[name][-1]
        outs = [read(f, p, p is last) for p in group]
        with lock:
            f.parts.extend(outs)
        if sequential:
            try:
                f.check(verify)
            except BaseException as exc:
                if consumer is not None:
                    consumer.finished(name, exc)
                raise
            if consumer is not None:
                consumer.finished(name, None)

    # a run of consecutive pieces of one file per job (one sequential stream per job)
    jobs: List[Callable[[], None]] = []
    split = 1 if sequential else max(1, -(-max(1, threads) // max(1, len(per))))
    for name, ps in per.items():
        n = -(-len(ps) // split)
        for k in range(0, len(ps), n):
            jobs.append(functools.partial(run, name, ps[k:k + n]))
    if pool is not None:
        run_all(pool, jobs)
    elif len(jobs) == 1:
        jobs[0]()
    elif jobs:
        with ThreadPoolExecutor(max(1, min(threads, len(jobs))), thread_name_prefix="async-ckpt-read") as own:
            run_all(own, jobs)
    if not sequential:
        for f in files.values():
            f.check(verify)


# ---- whole files into buffers ------------------------------------------------------------------

class BufferSink(Protocol):
    """Where :func:`read_files` puts a file's bytes (:mod:`.sinks`: into buffers the caller
    holds, into fresh ones, into nothing)."""

    def buffer(self, name: str, size: int) -> Optional[torch.Tensor]:
        """A flat uint8 CPU tensor of ``size`` bytes (or one more) for the file ``name``, or
        ``None``: read through a per-thread buffer and keep nothing."""


def whole_pieces(name: str, size: int, buf: Optional[torch.Tensor], chunk: int) -> List[Piece]:
    """The pieces that read the file ``name`` whole, ``chunk`` bytes at a time, into ``buf``
    (or into a per-thread buffer); an empty file is one empty piece (it is checked too)."""
    mv = byte_view(buf) if buf is not None and buf.numel() else (memoryview(bytearray(1)) if buf is not None else None)
    return [Piece(name, lo, min(size, lo + chunk), None if mv is None else mv[lo:])
            for lo in range(0, max(size, 1), chunk)] if size else [Piece(name, 0, 0, mv)]


def read_files(storage: StepFiles, path: str, files: Mapping[str, FileRecord], sink: BufferSink, *,
               verify: bool = True, threads: int = 8, chunk: int = CHUNK_BYTES,
               pool: Optional[ThreadPoolExecutor] = None,
               progress: Optional[Callable[[int], None]] = None) -> Dict[str, torch.Tensor]:
    """Read the whole files ``files`` of the step ``path``, each verified (:func:`execute`).

    Args:
        storage: the root's storage.
        path: the step directory.
        files: the files to read, by name, with their manifest records (size, CRC-32C).
        sink: where the bytes go (:mod:`.sinks`: ``IntoBuffers``, ``FRESH``, ``NULL``).
        verify: compare checksums (sizes are always compared).
        threads: how many reads run at once (without ``pool``).
        chunk: the size of one ranged read.
        pool: run on this pool instead of a new one.
        progress: called with the byte count of each range once it is read.

    Returns:
        The buffers the sink gave, by file name, each exactly the file's size (none for a sink
        that keeps nothing).

    Raises:
        CorruptCheckpointError: a file that is missing, unsafe, of another size or (``verify``)
            another checksum; nothing is reported until every read finished.
    """
    bufs: Dict[str, torch.Tensor] = {}
    pieces: List[Piece] = []
    with OpenFiles(storage, path, files) as opened:
        for name, rec in files.items():
            buf = sink.buffer(name, rec.size)
            if buf is not None:
                bufs[name] = buf[:rec.size]
            pieces += whole_pieces(name, rec.size, buf, chunk)
        execute(opened, pieces, verify=verify, threads=threads, pool=pool, progress=progress,
                scratch_bytes=min(chunk, max((r.size for r in files.values()), default=0)))
    return bufs


# ---- one file in order -------------------------------------------------------------------------

class FileStream:
    """One file of a step read in order, chunk by chunk, verified once its last chunk is read
    (the same checks and wording as :func:`execute`).

    Args:
        storage: the root's storage.
        path: the step directory.
        name: the file.
        rec: its manifest record.
        verify: compare the checksum (sizes are always compared).

    Raises:
        CorruptCheckpointError: see :func:`open_step_file`.
    """

    def __init__(self, storage: StepFiles, path: str, name: str, rec: FileRecord, *, verify: bool = True) -> None:
        self.name, self.rec, self.verify = name, rec, verify
        self._opened = OpenFiles(storage, path, {name: rec})
        self._file = _File(self._opened, name, None)

    def read(self, lo: int, out: memoryview) -> int:
        """Read ``[lo, lo + len(out))`` (the next chunk, in order) into ``out``; after the last
        chunk (its end is the file's size) the file is checked.

        Args:
            lo: where the chunk starts (the end of the one before).
            out: where its bytes go.

        Returns:
            The bytes read.

        Raises:
            CorruptCheckpointError: the file is shorter or longer than its manifest says, or
                (``verify``) its checksum is not the manifest's (at its last chunk).
        """
        hi = lo + len(out)
        got = self._opened.read_into(self.name, lo, out)
        crc = crc32c(out[:got]) if self.verify else 0
        if hi == self.rec.size and got == len(out) and not self._opened.size_known(self.name):
            got += self._opened.read_into(self.name, hi, memoryview(bytearray(1)))  # the file goes on past its size
        self._file.parts.append((lo, hi, got, crc))
        if hi == self.rec.size:
            self._opened.close()
            self._file.check(self.verify)
        return min(got, len(out))

    def close(self) -> None:
        """Close the file (done already after its last chunk)."""
        self._opened.close()
