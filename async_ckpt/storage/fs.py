"""A thin handle on one fsspec filesystem and a root path, with the few operations we need.

Local paths take a POSIX fast path (plain files, ``fsync``, atomic ``rename``); every other
fsspec URL (``gs://``, ``s3://``, ``memory://``, ...) goes through fsspec.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import StorageError
from .retry import RetryPolicy

DEFAULT_BLOCK_SIZE = 64 * 2**20  # upload chunk for object stores; gcsfs's 5 MiB is far too small


class Storage:
    """One checkpoint root on one fsspec filesystem."""

    def __init__(
        self,
        url: str,
        storage_options: Optional[Dict[str, Any]] = None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        retry: Optional[RetryPolicy] = None,
    ) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(url).__name__}")
        url = os.fspath(url)
        if not url:
            raise ValueError("path must not be empty")
        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open checkpoint path {url!r}: {exc}") from exc
        self.url = url
        self.fs = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.is_local else root.rstrip("/")
        self.block_size = block_size
        self.retry = retry if retry is not None else RetryPolicy()

    # ---- paths -------------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def url_of(self, path: str) -> str:
        """A URL that fsspec (and so DCP) can open for ``path``."""
        if self.is_local:
            return path
        return self.fs.unstrip_protocol(path)

    # ---- writes ------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        self.retry.call(lambda: self.fs.makedirs(path, exist_ok=True), f"mkdir {path}")

    @contextmanager
    def open_write(self, path: str) -> Iterator[Any]:
        """A binary file opened for writing; durable (flushed, fsynced or uploaded) on exit."""
        if self.is_local:
            f = open(path, "wb")
            try:
                yield f
                f.flush()
                os.fsync(f.fileno())
            finally:
                f.close()
        else:
            f = self.fs.open(path, "wb", block_size=self.block_size)
            ok = False
            try:
                yield f
                ok = True
            finally:
                if ok:
                    f.close()  # uploads the last block / completes the multipart upload
                else:
                    _discard(f)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a small file in one call (retried as a whole on transient errors)."""

        def _do() -> None:
            if self.is_local:
                with self.open_write(path) as f:
                    f.write(data)
            else:
                self.fs.pipe_file(path, data)

        self.retry.call(_do, f"write {path}")

    def fsync_dir(self, path: str) -> None:
        if self.is_local:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        """Atomic rename (POSIX only)."""
        assert self.is_local, "rename is only used on POSIX paths"
        os.rename(src, dst)

    def rm(self, path: str, recursive: bool = True) -> None:
        """Remove a file or tree; a missing path is not an error."""

        def _do() -> None:
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass

        self.retry.call(_do, f"delete {path}")

    # ---- reads -------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        return self.retry.call(lambda: self.fs.cat_file(path), f"read {path}")

    def size(self, path: str) -> int:
        """Size in bytes of the file at ``path`` as the storage reports it."""
        if self.is_local:
            return os.path.getsize(path)
        try:
            self.fs.invalidate_cache(path)  # never answer from a listing cached before the write
        except Exception:
            pass
        return int(self.retry.call(lambda: self.fs.size(path), f"stat {path}"))

    def exists(self, path: str) -> bool:
        return bool(self.retry.call(lambda: self.fs.exists(path), f"stat {path}"))

    def listdir(self, path: str) -> List[Dict[str, Any]]:
        """Entries directly under ``path`` (``name`` is the base name); [] when it does not exist."""

        def _do() -> List[Dict[str, Any]]:
            try:
                entries = self.fs.ls(path, detail=True, refresh=True) if not self.is_local else self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return []
            out = []
            for e in entries:
                name = e["name"].rstrip("/").rsplit("/", 1)[-1]
                out.append({**e, "name": name})
            return out

        return self.retry.call(_do, f"list {path}")

    def invalidate_cache(self) -> None:
        try:
            self.fs.invalidate_cache()
        except Exception:
            pass


def _discard(f: Any) -> None:
    """Abandon a partially written remote file without committing it."""
    for name in ("discard", "abort"):
        fn = getattr(f, name, None)
        if callable(fn):
            try:
                fn()
            except Exception:
                pass
            break
    try:
        f.closed = True  # fsspec buffered files: prevent close() from uploading later
    except Exception:
        pass


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC
