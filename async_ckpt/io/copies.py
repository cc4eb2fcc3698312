"""A step's files copied to another storage through the one verified read (:func:`copy_files`:
``promote``, a skipped upload caught up, a peer's copy brought home from its own disk): each file
read in order, written as it is read (:class:`CopyTo`), completed only once verified."""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

import torch

from ..format.manifest import FileRecord
from .read_exec import OpenFiles, Piece, StepFiles, execute, whole_pieces


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
