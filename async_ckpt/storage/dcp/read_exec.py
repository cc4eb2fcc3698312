"""The one verified read of a step's files: parallel ranged reads, CRC-32C per range as it arrives.

Every path that reads a step's data files (the direct restore, the atomic restore's staging,
DCP's ``StorageReader``, ``verify``, copies between roots) opens them through
:func:`open_step_file` and decides "verified" through :func:`check_file`: a file is verified
when the ranges read cover exactly its manifest size (not a byte more) and, with ``verify``,
the CRC-32C put together from the ranges' CRC-32Cs (:func:`~.crc.crc32c_concat`) is the
manifest's. Every failure is a :class:`~async_ckpt.errors.CorruptCheckpointError` worded by
:func:`size_error`, :func:`checksum_error` or :func:`short_error`, the same from every path.

:func:`read_files` runs whole files: each file is cut into ranges of about ``chunk`` bytes, a
run of consecutive ranges per job (one sequential stream, so the kernel's readahead works for
it), the jobs spread over ``threads``; each range's CRC-32C is computed on the thread that read
it, right after the read. Where the bytes go is the sink's choice:

* :class:`IntoBuffers`: into buffers the caller holds (the atomic restore's host buffers);
* :data:`FRESH`: into a fresh buffer per file, returned;
* :data:`NULL`: into a per-thread scratch buffer, kept nowhere (``verify``, and a check of a
  step's files before an error is reported).

:func:`read_file_bytes` gives one verified file's bytes (copies between roots, exports).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from ...addresses import byte_view
from ...errors import CorruptCheckpointError, StorageError
from ..crc import crc32c_concat
from ..manifest import FileRecord, check_file_name, crc32c

#: Ranges of whole-file reads are about this large (a bigger file is read as several, in parallel).
CHUNK_BYTES = 16 * 2**20


class StepFiles(Protocol):
    """What reading a step's files needs of a storage: ``Storage`` has it, and so
    does :class:`~.atomic_restore.StagedStorage` (files already read and verified, in memory)."""

    @property
    def is_local(self) -> bool:
        """Whether a read is cheap (no per-request cost)."""

    def file_problem(self, where: str, inside: str) -> Optional[str]:
        """Why ``where`` is not a plain file inside ``inside``; ``None`` when it is."""

    def open_ranges(self, where: str) -> Any:
        """``where`` opened for ranged reads (``read_into``, ``known_size``, ``close``)."""

    def read_bytes(self, where: str) -> bytes:
        """The whole of ``where``."""


# ---- the one wording ---------------------------------------------------------------------------

def size_error(where: str, got: int, size: int, *, longer: bool = False) -> CorruptCheckpointError:
    """A file of another size than the manifest's.

    Args:
        where: the file.
        got: the bytes found (with ``longer``: the manifest's size, which the file goes past).
        size: the manifest's size.
        longer: the file goes on past ``size``.

    Returns:
        The error (to raise).
    """
    said = f"more than {got}" if longer else str(got)
    return CorruptCheckpointError(f"{where}: size is {said} bytes, manifest says {size}", path=where)


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


# ---- opening a step's file ---------------------------------------------------------------------

@contextlib.contextmanager
def unreadable_is_damage(where: str) -> Iterator[None]:
    """A step's file that is missing or is a directory: :class:`CorruptCheckpointError` (the
    step is damaged); other storage errors pass through."""
    try:
        yield
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: file is missing", path=where) from None
    except StorageError as exc:
        if isinstance(exc.__cause__, (IsADirectoryError, NotADirectoryError)):
            raise CorruptCheckpointError(f"{where}: is not a readable file ({exc.__cause__})", path=where) from exc
        raise


def open_checked_ranges(storage: StepFiles, where: str, size: int) -> Any:
    """``where`` (a step's data file, already checked to be a plain file inside the step) opened
    for ranged reads.

    Args:
        storage: the root's storage.
        where: the file.
        size: the manifest's size of it.

    Returns:
        A ranged reader (``read_into``, ``known_size``, ``close``).

    Raises:
        CorruptCheckpointError: missing, a directory, or not of ``size`` where the storage knows
            the size without another request. Its reads raise it too for a file found missing
            only then (object stores open nothing before the first read).
    """
    with unreadable_is_damage(where):
        reader = storage.open_ranges(where)
    if reader.known_size is not None and reader.known_size != size:
        reader.close()
        raise size_error(where, reader.known_size, size)
    return _StepFileRanges(reader, where)


class _StepFileRanges:
    """A step file's ranged reader whose reads say a missing file is damage, as opening does."""

    def __init__(self, reader: Any, where: str) -> None:
        self._reader, self._where = reader, where
        self.known_size: Optional[int] = reader.known_size

    def read_into(self, start: int, out: memoryview) -> int:
        with unreadable_is_damage(self._where):
            return int(self._reader.read_into(start, out))

    def close(self) -> None:
        self._reader.close()


def open_step_file(storage: StepFiles, path: str, name: str, size: int) -> Any:
    """``path/name`` opened for ranged reads after the reader's checks: a safe name, a plain
    file inside the step directory (no link out of it), then :func:`open_checked_ranges`.

    Args:
        storage: the root's storage.
        path: the step directory.
        name: the file's name in it (as the manifest lists it).
        size: the manifest's size of it.

    Returns:
        A ranged reader.

    Raises:
        CorruptCheckpointError: an unsafe name, not a plain file inside ``path``, or see
            :func:`open_checked_ranges`.
    """
    where = f"{path}/{name}"
    check_file_name(name, where=where)
    problem = storage.file_problem(where, path)
    if problem is not None:
        raise CorruptCheckpointError(f"{where}: {problem}", path=where)
    return open_checked_ranges(storage, where, size)


def close_all(readers: Dict[str, Any]) -> None:
    """Close every ranged reader of ``readers`` (a failure to close is not the restore's)."""
    for r in readers.values():
        try:
            r.close()
        except Exception:  # noqa: BLE001
            pass


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


# ---- sinks -------------------------------------------------------------------------------------

class Sink(Protocol):
    """Where :func:`read_files` puts a file's bytes."""

    def buffer(self, name: str, size: int) -> Optional[torch.Tensor]:
        """A flat uint8 CPU tensor of ``size`` bytes for the file ``name``, or ``None``: read
        through a per-thread scratch buffer and keep nothing."""


class IntoBuffers:
    """Into buffers the caller holds, by file name (each exactly the file's size)."""

    def __init__(self, views: Dict[str, torch.Tensor]) -> None:
        self.views = views

    def buffer(self, name: str, size: int) -> Optional[torch.Tensor]:
        return self.views[name]


class _Fresh:
    def buffer(self, name: str, size: int) -> Optional[torch.Tensor]:
        return torch.empty(size, dtype=torch.uint8)  # never zero-filled: every byte is read into


class _Null:
    def buffer(self, name: str, size: int) -> Optional[torch.Tensor]:
        return None


#: A fresh buffer per file (returned by :func:`read_files`).
FRESH: Sink = _Fresh()
#: Nothing kept: the files are only checked.
NULL: Sink = _Null()


class _Scratch(threading.local):
    buf: Optional[torch.Tensor] = None

    def get(self, n: int) -> memoryview:
        if self.buf is None or self.buf.numel() < n:
            self.buf = torch.empty(n, dtype=torch.uint8)
        return byte_view(self.buf)[:n]


# ---- the executor ------------------------------------------------------------------------------

def read_files(storage: StepFiles, path: str, files: Dict[str, FileRecord], sink: Sink, *, verify: bool = True,
               threads: int = 8, chunk: int = CHUNK_BYTES, pool: Optional[ThreadPoolExecutor] = None,
               progress: Optional[Callable[[int], None]] = None) -> Dict[str, torch.Tensor]:
    """Read the whole files ``files`` of the step ``path``, each verified (:func:`check_file`).

    Args:
        storage: the root's storage.
        path: the step directory.
        files: the files to read, by name, with their manifest records (size, CRC-32C).
        sink: where the bytes go (:class:`IntoBuffers`, :data:`FRESH`, :data:`NULL`).
        verify: compare checksums (sizes are always compared).
        threads: how many reads run at once (without ``pool``).
        chunk: the size of one ranged read.
        pool: run on this pool instead of a new one.
        progress: called with the byte count of each range once it is read (from the reading
            threads, one call at a time).

    Returns:
        The buffers the sink gave, by file name (none for :data:`NULL`).

    Raises:
        CorruptCheckpointError: a file that is missing, unsafe, of another size or (``verify``)
            another checksum; nothing is reported until every read finished.
    """
    readers: Dict[str, Any] = {}
    bufs: Dict[str, Optional[torch.Tensor]] = {}
    scratch = _Scratch()
    lock = threading.Lock()
    # (name, start, end, extra): extra = 1 on the last range of a file whose size the storage
    # does not know, so that a longer file is caught as well as a shorter one
    tasks: List[Tuple[str, int, int, int]] = []
    per: Dict[str, List[int]] = {}
    try:
        for name, rec in files.items():
            readers[name] = open_step_file(storage, path, name, rec.size)
            bufs[name] = sink.buffer(name, rec.size)
        for name, rec in files.items():
            size = rec.size
            per[name] = []  # an empty file is checked too
            ranges = [(lo, min(size, lo + chunk)) for lo in range(0, size, chunk)] or [(0, 0)]
            for k, (lo, hi) in enumerate(ranges):
                extra = int(k == len(ranges) - 1 and readers[name].known_size is None)
                if hi > lo or extra:
                    per[name].append(len(tasks))
                    tasks.append((name, lo, hi, extra))

        def run(task: Tuple[str, int, int, int]) -> Tuple[int, int]:
            name, lo, hi, extra = task
            r = readers[name]
            buf = bufs[name]
            mv = byte_view(buf)[lo:hi] if buf is not None else scratch.get(hi - lo)
            got = r.read_into(lo, mv) if hi > lo else 0
            crc = crc32c(mv[:got]) if verify else 0
            if progress is not None and got:
                with lock:
                    progress(got)
            if extra and got == hi - lo:
                got += r.read_into(hi, memoryview(bytearray(1)))  # 1: the file goes on past its size
            return got, crc

        # a run of consecutive ranges of one file per job (one sequential stream per job)
        split = max(1, -(-max(1, threads) // max(1, len(per))))
        groups: List[List[int]] = []
        for idx in per.values():
            if idx:
                n = -(-len(idx) // split)
                groups += [idx[k:k + n] for k in range(0, len(idx), n)]
        results: List[Tuple[int, int]] = [(0, 0)] * len(tasks)

        def run_group(group: List[int]) -> None:
            for i in group:
                results[i] = run(tasks[i])

        calls = [lambda g=g: run_group(g) for g in groups]  # (named: mypy types it here, not in run_all's call)
        if pool is not None:
            run_all(pool, calls)
        elif groups:
            with ThreadPoolExecutor(max(1, min(threads, len(groups))), thread_name_prefix="async-ckpt-read") as own:
                run_all(own, calls)
    finally:
        close_all(readers)
    for name, idx in per.items():
        check_file(f"{path}/{name}", files[name].size,
                   ((tasks[i][1], tasks[i][2], results[i][0], results[i][1]) for i in idx),
                   files[name].crc32c, verify)
    return {n: b for n, b in bufs.items() if b is not None}


def read_file_bytes(storage: StepFiles, path: str, name: str, rec: FileRecord, *, verify: bool = True,
                    threads: int = 8) -> memoryview:
    """One file of a step, read whole and verified (:func:`read_files` into a fresh buffer).

    Args:
        storage: the root's storage.
        path: the step directory.
        name: the file's name in it.
        rec: its manifest record.
        verify: compare its checksum.
        threads: how many ranged reads run at once.

    Returns:
        Its bytes.

    Raises:
        CorruptCheckpointError: see :func:`read_files`.
    """
    buf = read_files(storage, path, {name: rec}, FRESH, verify=verify, threads=threads)[name]
    return byte_view(buf) if buf.numel() else memoryview(b"")
