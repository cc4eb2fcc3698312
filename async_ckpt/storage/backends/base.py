"""The :class:`Backend` protocol: what differs between the kinds of storage under a
:class:`~async_ckpt.storage.storage.Storage`, and what the backends share."""

from __future__ import annotations

import os
import uuid
from contextlib import AbstractContextManager
from typing import Any, Dict, List, Optional, Protocol

from ..retry import RetryPolicy

MISSING = "file is missing"  # what ``file_problem`` says of a file that is not there


def temp_name(path: str) -> str:
    """A name next to ``path`` for writing it before it is renamed into place."""
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


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

    Methods documented as one attempt raise the storage's own errors; :class:`Storage` retries
    them. Those given a ``retry`` policy apply it to the calls that may be retried.
    """

    fs: Any
    #: Local POSIX paths: plain files, ``fsync``, atomic ``rename``, symbolic links.
    is_local: bool
    #: Uploads are length-checked by the service, so a written file need not be stat'ed.
    length_checked_writes: bool
    #: Data files of about this size, for many concurrent single-request uploads (or None).
    default_max_file_bytes: Optional[int]
    #: The client library retries each request itself (gcsfs, s3fs): async_ckpt's
    #: :class:`RetryPolicy` then makes one attempt, so that there is one retry layer.
    client_retries: bool

    def normalize_root(self, root: str) -> str:
        """The checkpoint root as this backend's paths spell it."""

    def url_of(self, path: str) -> str:
        """A URL that fsspec (and so DCP) can open for ``path``."""

    def makedirs(self, path: str, retry: RetryPolicy) -> None:
        """Make ``path`` and its parents a directory, where the storage has directories."""

    def check_writable(self, url: str, probe: str, retry: RetryPolicy) -> None:
        """Fail now with a clear :class:`StorageError` if the root cannot be written."""

    def open_write(self, path: str, size_hint: Optional[int], *, block_size: int,
                   pipe_max_bytes: int) -> AbstractContextManager[Any]:
        """A binary file opened for writing, durable on a normal exit; nothing is visible under
        ``path`` if the block raises (one attempt)."""

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a small file (one attempt)."""

    def write_bytes_atomic(self, path: str, data: bytes, retry: RetryPolicy) -> None:
        """Write a small file that is either wholly there or not at all."""

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

    def size(self, path: str, retry: RetryPolicy) -> int:
        """The size of ``path`` as the storage reports it now (no cached listing)."""

    def ls(self, path: str) -> List[Dict[str, Any]]:
        """fsspec's detailed listing of ``path``, fresh (one attempt)."""
