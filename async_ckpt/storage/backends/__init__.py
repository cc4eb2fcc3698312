"""Storage backends: the parts of :class:`~async_ckpt.storage.storage.Storage` that depend on the
kind of storage, one class per kind, picked by :func:`backend_for`.

* :class:`PosixBackend` (:mod:`.posix`): local paths;
* :class:`ObjectStoreBackend` (:mod:`.object_store`): gs://, s3:// and other object stores;
* :class:`FsspecBackend` (:mod:`.fsspec`): any other fsspec URL (``memory://``, test filesystems).
"""

from __future__ import annotations

from typing import Any

from fsspec.implementations.local import LocalFileSystem

from .base import MISSING, Backend, FileState
from .fsspec import FsspecBackend
from .object_store import OBJECT_STORE_PROTOCOLS, ObjectStoreBackend
from .posix import PosixBackend


def backend_for(fs: Any) -> Backend:
    """The backend for fsspec filesystem ``fs``: POSIX for the local filesystem, the object
    store one when a protocol of ``fs`` is an object store's, else generic fsspec."""
    if isinstance(fs, LocalFileSystem):
        return PosixBackend(fs)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if any(p in OBJECT_STORE_PROTOCOLS for p in protocols):
        return ObjectStoreBackend(fs)
    return FsspecBackend(fs)


__all__ = ["MISSING", "Backend", "FileState", "FsspecBackend", "ObjectStoreBackend", "PosixBackend", "backend_for"]
