"""A thin handle on one fsspec filesystem and a root path, with the few operations we need.

Local paths take a POSIX fast path (plain files, ``fsync``, atomic ``rename``); every other
fsspec URL (``gs://``, ``s3://``, ``memory://``, ...) goes through fsspec.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import StorageError
from .retry import RetryPolicy

DEFAULT_BLOCK_SIZE = 64 * 2**20  # upload chunk for object stores; gcsfs's 5 MiB is far too small
# Object stores: a data file up to this size is serialised in memory and uploaded in one call
# (``pipe_file``: one request on GCS below 50 MiB, one PUT on S3 below 100 MiB, and a whole-file
# retry is possible); a bigger one streams through ``open()`` in DEFAULT_BLOCK_SIZE chunks.
PIPE_MAX_BYTES = 256 * 2**20
# Object stores: the writer aims for data files of about this size, so one checkpoint becomes
# many objects uploaded concurrently (each a single request) rather than a few long streams;
# 8-16 MiB is the request size both GCS and S3 recommend for parallel transfers.
OBJECT_FILE_BYTES = 16 * 2**20
# Reads: files bigger than this are fetched as concurrent ranged reads of this size.
READ_RANGE_BYTES = 32 * 2**20

MISSING = "file is missing"  # what :meth:`Storage.file_problem` says of a file that is not there

# fsspec protocols of object stores: no directories, no atomic rename.
_OBJECT_STORE_PROTOCOLS = {"gs", "gcs", "s3", "s3a", "az", "abfs", "abfss", "adl", "oss", "oci", "cos", "tos",
                           "r2", "b2"}


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
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        #: gs://, s3://, ...: no directories (``makedirs`` never creates a bucket), data files
        #: uploaded whole with ``pipe_file`` when they fit in ``pipe_max_bytes``.
        self.is_object_store = any(p in _OBJECT_STORE_PROTOCOLS for p in protocols)
        self.pipe_max_bytes = PIPE_MAX_BYTES
        self.max_file_bytes: Optional[int] = OBJECT_FILE_BYTES if self.is_object_store else None
        self.root = os.path.abspath(root) if self.is_local else root.rstrip("/")
        self.block_size = block_size
        self.retry = retry if retry is not None else RetryPolicy()

    @property
    def length_checked_writes(self) -> bool:
        """Whether the service checks every upload's length (gs://, s3://): a written file
        need not be stat'ed to catch a short write."""
        return self.is_object_store

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
        if self.is_object_store:
            return  # no directories; and gcsfs/s3fs makedirs would silently create a missing bucket
        self.retry.call(lambda: self.fs.makedirs(path, exist_ok=True), f"mkdir {path}")

    def check_writable(self) -> None:
        """Object stores: write and delete a small probe object under the root, so that a
        missing bucket or wrong credentials fail now with a clear :class:`StorageError`."""
        if not self.is_object_store:
            return
        probe = self.join(f".async_ckpt-probe-{os.getpid()}-{id(self):x}")
        try:
            self.write_bytes(probe, b"async_ckpt write probe\n")
            self.retry.call(lambda: self.fs.rm_file(probe), f"delete {probe}")
        except FileNotFoundError as exc:
            raise StorageError(f"checkpoint path {self.url!r} cannot be written: the bucket does not exist "
                               f"(or is not visible with these credentials): {exc}") from exc
        except (OSError, StorageError) as exc:
            cause = exc.__cause__ if isinstance(exc, StorageError) and exc.__cause__ is not None else exc
            raise StorageError(f"checkpoint path {self.url!r} cannot be written ({type(cause).__name__}: {cause}); "
                               "check the credentials, endpoint and bucket in storage_options") from exc

    @contextmanager
    def open_write(self, path: str, size_hint: Optional[int] = None) -> Iterator[Any]:
        """A binary file opened for writing; durable (flushed, fsynced or uploaded) on exit.

        On object stores a file whose ``size_hint`` is at most ``pipe_max_bytes`` is buffered in
        memory and uploaded in one ``pipe_file`` call on exit; otherwise it streams in
        ``block_size`` chunks (resumable/multipart upload), completed on exit. Either way
        nothing is visible under ``path`` unless the block exits normally.
        """
        if self.is_object_store and size_hint is not None and size_hint <= self.pipe_max_bytes:
            buf = _BufferFile(size_hint)
            yield buf
            self.fs.pipe_file(path, buf.getvalue())
        elif self.is_local:
            f = open(path, "wb")
            try:
                w = _WritebackFile(f)
                yield w
                f.flush()
                w.start_writeback()
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

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Write a small file that is either wholly there or not at all, even if the process
        dies mid-write: one PUT on object stores; elsewhere a temporary name, then a rename."""
        if self.is_object_store:
            self.write_bytes(path, data)
            return
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.write_bytes(tmp, data)
        if self.is_local:
            os.replace(tmp, path)
        else:
            self.retry.call(lambda: self.fs.mv(tmp, path), f"rename {tmp}")

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
        """Remove a file or tree; a missing path is not an error.

        Local paths: never through a symbolic link. A link at ``path`` itself is removed, not
        what it points to (trees are removed with ``shutil.rmtree``, which does the same for
        links inside them); a link between the root and ``path`` raises :class:`StorageError`.
        """
        if self.is_local:
            self._check_no_link_above(path)

        def _do() -> None:
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass

        self.retry.call(_do, f"delete {path}")

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (local paths; object stores have none)."""
        return self.is_local and os.path.islink(path)

    def _check_no_link_above(self, path: str) -> None:
        """Raise :class:`StorageError` if a directory between the root and ``path`` is a link."""
        rel = os.path.relpath(os.path.abspath(path), self.root)
        if rel == os.curdir or rel == os.pardir or rel.startswith(os.pardir + os.sep):
            return  # not below the root (the root itself may well be a link)
        cur = self.root
        for part in rel.split(os.sep)[:-1]:
            cur = os.path.join(cur, part)
            if os.path.islink(cur):
                raise StorageError(f"refusing to delete {path}: {cur} is a symbolic link, and async_ckpt never "
                                   "deletes through one")

    def file_problem(self, path: str, inside: str) -> Optional[str]:
        """Why ``path`` cannot be read as a checkpoint file of the directory ``inside``, or None.

        Local paths: it must exist, be a regular file (a directory in its place is damage),
        and, if it is a symbolic link, resolve to a file inside ``inside``. Object stores have
        neither links nor directories at a file's name: always None (a missing object shows
        when it is read).
        """
        if not self.is_local:
            return None
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return MISSING
        except NotADirectoryError:
            return f"{MISSING} (a parent is not a directory)"
        if stat.S_ISLNK(st.st_mode):
            real, base = os.path.realpath(path), os.path.realpath(inside)
            if os.path.commonpath([real, base]) != base or real == base:
                return f"is a symbolic link to {real!r}, outside the step directory"
            try:
                st = os.stat(path)
            except OSError:
                return "is a dangling symbolic link"
        if stat.S_ISDIR(st.st_mode):
            return "is a directory, not a file"
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        return None

    # ---- reads -------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        return self.retry.call(lambda: self.fs.cat_file(path), f"read {path}")

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        """Read ``path[start:start+len(out)]`` into ``out``; return the bytes read (short at EOF)."""

        def _do() -> int:
            if self.is_local:
                with open(path, "rb") as f:
                    f.seek(start)
                    return f.readinto(out)  # type: ignore[arg-type]
            data = self.fs.cat_file(path, start=start, end=start + len(out))
            n = min(len(data), len(out))
            out[:n] = memoryview(data)[:n]
            return len(data)

        return self.retry.call(_do, f"read {path}[{start}:{start + len(out)}]")

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


WRITEBACK_BYTES = 8 * 2**20  # local files: disk writes start after every this many bytes


def _load_sync_file_range() -> Optional[Callable[[int, int, int], None]]:
    """Linux ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``: start writing a
    range of dirty pages to disk and return without waiting. ``None`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # CDLL releases the GIL in the call
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE


_sync_file_range = _load_sync_file_range()


class _WritebackFile:
    """A local file being written, whose pages start going to disk while the rest is produced.

    Without it, nothing reaches the disk before the final ``fsync``, which then waits for the
    whole file: producing the bytes (for many small tensors, mostly Python) and writing them
    run one after the other. Kicking off the writeback of every full ``WRITEBACK_BYTES`` as it
    is written overlaps the two; the ``fsync`` still decides durability. A hint only: where
    ``sync_file_range`` is missing or fails, the file is simply written as before.
    """

    def __init__(self, f: Any, every: Optional[int] = None) -> None:
        self._f = f
        self._every = every if every is not None else WRITEBACK_BYTES
        self._written = 0
        self._started = 0  # bytes before this offset have had their writeback started

    def write(self, b: Any) -> int:
        n = self._f.write(b)
        self._written += n
        if self._written - self._started >= self._every:
            self._f.flush()
            self.start_writeback()
        return n

    def start_writeback(self) -> None:
        """Start (not wait for) the disk writes of everything written and flushed so far."""
        if _sync_file_range is not None and self._written > self._started:
            _sync_file_range(self._f.fileno(), self._started, self._written - self._started)
        self._started = self._written

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()


class _BufferFile:
    """A write-only in-memory file backed by one ``bytearray`` (no copy when it is uploaded)."""

    def __init__(self, size_hint: int) -> None:
        self._buf = bytearray(max(0, size_hint) + 65536)  # torch.save adds headers beyond the raw bytes
        self._n = 0
        self.closed = False

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        end = self._n + mv.nbytes
        if end > len(self._buf):
            self._buf.extend(bytes(max(end - len(self._buf), len(self._buf) // 4)))
        self._buf[self._n:end] = mv
        self._n = end
        return mv.nbytes

    def tell(self) -> int:
        return self._n

    def flush(self) -> None:
        pass

    def getvalue(self) -> bytearray:
        del self._buf[self._n:]  # truncate in place
        return self._buf


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
