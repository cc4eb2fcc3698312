"""A data file written as a stream of records: CRC-32C per record and per file as the bytes
pass, small writes gathered into large ones, and one file written, checked and recorded.

No torch here: the writer process (:mod:`.writer_child`) runs this code without importing it,
and the training process's writer thread (:mod:`.write`) runs it with tensors' records
appended from their templates.
"""

from __future__ import annotations

import errno
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..format.crc import crc32c, crc32c_combine, raw_crc32c
from ..format.manifest import FileRecord
from ..storage.storage import Storage

COALESCE_BYTES = 4 * 2**20  # small records are gathered into writes of about this size
COMBINE_BYTES = 2**20  # a write at least this big is checksummed once for its record and its file
DATA_AT_MIN_BYTES = 64 * 2**10  # tensor records with this much data have their data's place kept
_COALESCE_BYTES, _COMBINE_BYTES = COALESCE_BYTES, COMBINE_BYTES


class RecordStream:
    """Write-through stream that counts bytes and computes CRC32C as data passes, gathering
    small writes into large ones (fewer syscalls/requests).

    With ``records``, each record's length and CRC32C are kept too (:attr:`records`): the
    writer calls :meth:`end_record` after each item (or :meth:`_end_tail_records` for records
    appended whole).
    A record's bytes are checksummed as they come in; where the file's CRC would take a second
    pass over a big write (at least ``_COMBINE_BYTES``), the write is checksummed once and
    that CRC combined into both (:func:`~async_ckpt.format.crc.crc32c_combine`).
    """

    def __init__(self, f: Any, records: bool = False) -> None:
        self._f = f
        self.size = 0  # bytes passed on to ``f``
        self.crc = 0
        self.error: Optional[BaseException] = None  # torch.save hides it behind a RuntimeError
        self._pending = bytearray()
        self.records: Optional[List[Tuple[int, int]]] = [] if records else None  # (length, crc32c)
        self._rec_crc = 0  # of the record being written
        self._rec_start = 0

    def _write_through(self, b: Any, crc: Optional[int] = None) -> int:
        """Pass ``b`` on to the file; ``crc``: its CRC32C, already computed."""
        mv = memoryview(b).cast("B")
        self.crc = crc32c(mv, self.crc) if crc is None else crc32c_combine(self.crc, crc, mv.nbytes)
        try:
            self._f.write(mv)
        except BaseException as exc:
            self.error = exc
            raise
        self.size += mv.nbytes
        return mv.nbytes

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        if n >= 65536:
            self.flush_pending()
            if self.records is None:
                return self._write_through(b)
            if n < _COMBINE_BYTES:
                self._rec_crc = crc32c(b, self._rec_crc)
                return self._write_through(b)
            crc = crc32c(b)
            self._rec_crc = crc32c_combine(self._rec_crc, crc, n)
            return self._write_through(b, crc)
        if self.records is not None:
            self._rec_crc = crc32c(b, self._rec_crc)
        self._pending += b  # no cast: a memoryview cast costs more than the copy of a small record
        if len(self._pending) >= _COALESCE_BYTES:
            self.flush_pending()
        return n

    def end_record(self) -> None:
        """The bytes written since the last record end one (with ``records``)."""
        records = self.records
        if records is not None:
            end = self.size + len(self._pending)
            records.append((end - self._rec_start, self._rec_crc))
            self._rec_crc, self._rec_start = 0, end

    def _end_tail_records(self, n: int, count: int) -> None:
        """End the last ``count`` records of ``n`` bytes each, whole records just appended to
        the pending buffer (with ``records``)."""
        records = self.records
        if records is not None:
            end = len(self._pending)
            with memoryview(self._pending) as mv:  # released: the buffer grows later
                records += [(n, raw_crc32c(mv[k:k + n])) for k in range(end - n * count, end, n)]
            self._rec_start += n * count

    def tell(self) -> int:
        return self.size + len(self._pending)

    def flush_pending(self) -> None:
        if self._pending:
            data, self._pending = self._pending, bytearray()
            self._write_through(data)

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def keep_data_at(data_at: Dict[int, int], record_at: int, data_offset: int, nbytes: int) -> None:
    """Note where a tensor's data starts in its record, for the manifest (``FileRecord.data_at``):
    the one rule both writers (the thread and the writer process) follow.

    Args:
        data_at: the file's offsets so far (record offset -> data offset in the record).
        record_at: where the record starts in the file.
        data_offset: where the data starts in the record (``-1``: not known, nothing noted).
        nbytes: the tensor's data bytes (noted from :data:`DATA_AT_MIN_BYTES` up).
    """
    if data_offset >= 0 and nbytes >= DATA_AT_MIN_BYTES:
        data_at[record_at] = data_offset


#: writes the records of one file into the stream; keeps each item's length in ``lengths`` and,
#: for a record of a large tensor, ``data_at[record offset] = its data's offset in it``
Producer = Callable[[RecordStream, List[int], Dict[int, int]], None]


def write_record_file(storage: Storage, path: str, name: str, size_hint: Optional[int], records: bool,
               produce: Producer, stream_type: Any = RecordStream) -> Tuple[str, FileRecord, List[int]]:
    """Write one data file (one attempt: the caller retries) and return its name, its record
    and the lengths of its items.

    Args:
        storage: the root's storage.
        path: the step's directory.
        name: the file's name.
        size_hint: about its size (lets small files upload in one request).
        records: keep each item's length and CRC-32C in the record.
        produce: writes the file's items (see :data:`Producer`).
        stream_type: the stream class (a subclass with appenders of its own).

    Returns:
        ``(name, record, item lengths)``.

    Raises:
        OSError: a short write (``EIO``: transient, the file is redone) or what the storage raised.
    """
    lengths: List[int] = []
    data_at: Dict[int, int] = {}
    with storage.open_write(f"{path}/{name}", size_hint=size_hint) as f:
        stream = stream_type(f, records)
        produce(stream, lengths, data_at)
        stream.flush_pending()
    # A silently short write (a full or flaky disk, a FUSE mount) fails the attempt with EIO,
    # which is transient, so the file is redone. Storage whose uploads the service
    # length-checks (gs://, s3://) needs no check.
    stored = stream.size if storage.length_checked_writes else storage.size(f"{path}/{name}")
    if stored != stream.size:
        raise OSError(errno.EIO, f"short write: {stream.size} bytes written, storage holds {stored}", f"{path}/{name}")
    kept = stream.records
    if kept is not None and [n for n, _ in kept] != lengths:
        kept = None  # never list records that are not the items: the file is then checked whole
    return name, FileRecord(stream.size, stream.crc, None if kept is None else tuple(kept), data_at or None), lengths
