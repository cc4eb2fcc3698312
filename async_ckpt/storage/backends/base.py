"""The :class:`Backend` protocol: what differs between the kinds of storage under a
:class:`~async_ckpt.storage.storage.Storage`, and what the backends share."""

from __future__ import annotations

import base64
import binascii
import os
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

MISSING = "file is missing"  # what ``file_problem`` says of a file that is not there


@dataclass(frozen=True)
class FileState:
    """What the storage says of a file without reading it.

    Enough to tell that its bytes were not rewritten since an earlier look (:meth:`same_file`),
    or, where the storage keeps one, their CRC-32C.

    Attributes:
        size: its size in bytes.
        crc32c: the CRC-32C the storage keeps of the object's bytes (GCS; S3 where the object
            carries one), or None.
        identity: what any rewrite of the bytes through the storage changes (POSIX: device,
            inode, mtime; object stores: generation, ETag, last-modified time; ``memory://``:
            its creation time), or None where the storage tells nothing of the kind.
        changed: POSIX: ``st_ctime_ns``, which a write moves even when it puts the mtime back
            (and a hard link or an unlink moves too), else None.
        links: POSIX: ``st_nlink``, else None.
    """

    size: int
    crc32c: Optional[int] = None
    identity: Optional[Tuple[Any, ...]] = None
    changed: Optional[int] = None
    links: Optional[int] = None

    def same_file(self, before: "FileState") -> bool:
        """Whether the storage says the bytes are still those it said they were in ``before``.

        Same size and identity (a write moves the mtime or generation), and, on POSIX, the same
        ctime unless the link count moved with it (a hard link made or removed changes the
        ctime, not the bytes; a write whose mtime was put back shows only in the ctime).

        Args:
            before: the file's state at an earlier look.

        Returns:
            False when anything says the file may have been rewritten (or nothing can tell).
        """
        if self.identity is None or self.identity != before.identity or self.size != before.size:
            return False
        return self.changed == before.changed or self.links != before.links


#: fsspec ``info()`` fields that change whenever an object's bytes are rewritten
_IDENTITY_FIELDS = ("generation", "etag", "ETag", "VersionId", "LastModified", "updated", "mtime", "created", "ino")


def info_state(info: Dict[str, Any]) -> FileState:
    """The :class:`FileState` of a file from fsspec's ``info()`` of it: gcsfs's ``crc32c`` (and
    s3fs's ``ChecksumCRC32C``, where the object has one: base64 of the big-endian CRC), and the
    fields of :data:`_IDENTITY_FIELDS` it has."""
    crc: Optional[int] = None
    for key in ("crc32c", "ChecksumCRC32C"):
        raw = info.get(key)
        if isinstance(raw, str):
            try:
                b = base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError):
                continue
            if len(b) == 4:
                crc = int.from_bytes(b, "big")
                break
    ident = tuple((k, str(info[k])) for k in _IDENTITY_FIELDS if info.get(k) is not None)
    return FileState(int(info["size"]), crc, ident or None)


#: what every temporary name of a file (:func:`temp_name`) has after the file's own name
TEMP_INFIX = ".tmp-"


def temp_name(path: str) -> str:
    """A hidden name next to ``path`` for writing it before it is renamed into place:
    ``.<name>.tmp-<pid>-<random>``."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{TEMP_INFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")


class RangeReader(Protocol):
    """An open file for ranged reads, safe to use from several threads at once."""

    #: The file's size when it is known without another request (local files), else None.
    known_size: Optional[int]

    def read_into(self, start: int, out: memoryview) -> int:
        """Read ``file[start:start+len(out)]`` into ``out``; the bytes read, short only at
        the end of the file (one attempt)."""

    def close(self) -> None:
        """Release the handle."""


class Backend(Protocol):
    """One kind of storage, on one fsspec filesystem ``fs``.

    Every method makes one attempt and raises the storage's own errors: :class:`~async_ckpt.storage.storage.Storage` alone
    retries them and bounds their time (:class:`~async_ckpt.storage.retry.RetryPolicy`).
    """

    fs: Any
    #: Local POSIX paths: plain files, ``fsync``, atomic ``rename``, symbolic links.
    is_local: bool
    #: Uploads are length-checked by the service, so a written file need not be stat'ed.
    length_checked_writes: bool
    #: The storage keeps each object's CRC-32C, which ``file_state`` gives (GCS).
    keeps_crc32c: bool
    #: Data files of about this size, for many concurrent single-request uploads (or None).
    default_max_file_bytes: Optional[int]
    #: The client library retries each request itself (gcsfs, s3fs): async_ckpt's
    #: :class:`RetryPolicy` then makes one attempt, so that there is one retry layer.
    client_retries: bool
    #: One write of a small file is atomic (an object store's PUT): no temporary name needed.
    atomic_puts: bool
    #: A missing bucket or wrong credentials only show at the first write: the root is probed.
    probe_writes: bool

    def normalize_root(self, root: str) -> str:
        """The checkpoint root as this backend's paths spell it."""

    def url_of(self, path: str) -> str:
        """A URL that fsspec (and so DCP) can open for ``path``."""

    def endpoint(self) -> Optional[str]:
        """The URL of the service the client connects to, where known (object stores), else None."""

    def makedirs(self, path: str) -> None:
        """Make ``path`` and its parents a directory, where the storage has directories."""

    def open_write(self, path: str, size_hint: Optional[int], *, block_size: int,
                   pipe_max_bytes: int) -> AbstractContextManager[Any]:
        """A binary file opened for writing, durable on a normal exit; nothing is visible under
        ``path`` if the block raises (one attempt)."""

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a small file (one attempt)."""

    def replace(self, src: str, dst: str) -> None:
        """Put the file ``src`` in the place of ``dst`` (a small file written under a temporary
        name, where :attr:`atomic_puts` is false)."""

    def write_file_atomic(self, path: str, write_to: Callable[[str], None]) -> int:
        """Local paths: ``write_to`` writes a fresh temporary beside ``path``, which is then
        fsynced and renamed over ``path`` (never over a link or a directory); its size."""

    def remove_file(self, path: str) -> None:
        """Remove the file ``path``."""

    def fsync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` durable, where that means anything."""

    def rename(self, src: str, dst: str) -> None:
        """Atomic rename (POSIX only)."""

    def share(self, src: str, dst: str) -> bool:
        """Make ``dst`` a file holding exactly ``src``'s bytes without sending them from this
        process: a hard link on POSIX paths, a server-side copy on object stores (one
        attempt). Returns whether the bytes are shared (a hard link) rather than copied."""

    def before_delete(self, path: str, root: str) -> None:
        """Raise :class:`StorageError` if deleting ``path`` would go through a symbolic link."""

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link."""

    def file_problem(self, path: str, inside: str) -> Optional[str]:
        """Why ``path`` cannot be read as a checkpoint file of directory ``inside``, or None."""

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        """Read ``path[start:start+len(out)]`` into ``out``; the bytes read (one attempt)."""

    def open_ranges(self, path: str) -> "RangeReader":
        """A handle for many ranged reads of ``path`` (one attempt to open it)."""

    def size(self, path: str) -> int:
        """The size of ``path`` as the storage reports it now (no cached listing)."""

    def file_state(self, path: str) -> FileState:
        """What the storage says of the file ``path`` now, without reading it (one attempt, no
        cached listing)."""

    def ls(self, path: str) -> List[Dict[str, Any]]:
        """fsspec's detailed listing of ``path``, fresh (one attempt)."""

    def marked(self, root: str, marker: str) -> List[str]:
        """The names of the directories directly under ``root`` that hold a file ``marker``
        (never a symbolic link); [] when ``root`` does not exist."""
