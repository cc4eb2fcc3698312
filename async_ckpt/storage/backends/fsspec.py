"""Any fsspec filesystem that is neither local nor an object store (``memory://``, test
filesystems, ...): fsspec calls throughout, streamed writes, rename by ``mv``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

from ..retry import caller_memory
from .base import FileState, info_state


class FsspecBackend:
    """Storage through fsspec's generic API (see :class:`~.base.Backend`)."""

    is_local = False
    length_checked_writes = False
    keeps_crc32c = False
    default_max_file_bytes: Optional[int] = None
    #: the client library retries each request itself (async_ckpt then makes one attempt)
    client_retries = False
    atomic_puts = False
    probe_writes = False

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def normalize_root(self, root: str) -> str:
        return root.rstrip("/")

    def url_of(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def endpoint(self) -> Optional[str]:
        return None  # not known: only the bounded first request tells

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    @contextmanager
    def open_write(self, path: str, size_hint: Optional[int], *, block_size: int,
                   pipe_max_bytes: int) -> Iterator[Any]:
        f = self.fs.open(path, "wb", block_size=block_size)
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
        self.fs.pipe_file(path, data)

    def replace(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst)

    def write_file_atomic(self, path: str, write_to: Callable[[str], None]) -> int:
        raise AssertionError("writers that take a path write local files only")

    def remove_file(self, path: str) -> None:
        self.fs.rm_file(path)

    def fsync_dir(self, path: str) -> None:
        pass

    def rename(self, src: str, dst: str) -> None:
        raise AssertionError("rename is only used on POSIX paths")

    def share(self, src: str, dst: str) -> bool:
        self.fs.copy(src, dst)  # gcsfs / s3fs: a server-side copy (rewrite, CopyObject)
        return False

    def before_delete(self, path: str, root: str) -> None:
        pass  # no symbolic links

    def is_link(self, path: str) -> bool:
        return False

    def file_problem(self, path: str, inside: str) -> Optional[str]:
        return None  # a missing file shows when it is read

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        try:
            data = self.fs.cat_file(path, start=start, end=start + len(out))
        except Exception:
            # GCS and S3 refuse a range that starts at or past the end (HTTP 416) where a file
            # read gives 0 bytes: what a reader asks to learn that the file ends there
            if start > 0 and self._ends_by(path, start):
                return 0
            raise
        n = min(len(data), len(out))
        with caller_memory(f"read {path}"):  # never once a timed-out caller gave ``out`` back
            out[:n] = memoryview(data)[:n]
        return len(data)

    def _ends_by(self, path: str, at: int) -> bool:
        """Whether the file ``path`` ends at or before byte ``at`` (False when that cannot be had)."""
        try:
            self.fs.invalidate_cache(path)
            return at >= int(self.fs.size(path))
        except Exception:  # noqa: BLE001 - the caller raises its own error
            return False

    def open_ranges(self, path: str) -> "_FsspecRanges":
        return _FsspecRanges(self, path)

    def size(self, path: str) -> int:
        try:
            self.fs.invalidate_cache(path)  # never answer from a listing cached before the write
        except Exception:  # noqa: BLE001 - a filesystem without a cache
            pass
        return int(self.fs.size(path))

    def file_state(self, path: str) -> FileState:
        try:
            self.fs.invalidate_cache(path)  # never answer from a listing cached before a write
        except Exception:  # noqa: BLE001 - a filesystem without a cache
            pass
        return info_state(self.fs.info(path))

    def ls(self, path: str) -> List[Dict[str, Any]]:
        return self.fs.ls(path, detail=True, refresh=True)

    def marked(self, root: str, marker: str) -> List[str]:
        """One ``glob`` (object stores have no links)."""
        out: List[str] = []
        for p in self.fs.glob(f"{root.rstrip('/')}/*/{marker}"):
            parts = p.rstrip("/").split("/")
            if len(parts) >= 2 and parts[-2] not in out:
                out.append(parts[-2])
        return out


class _FsspecRanges:
    """Ranged reads of one file as ranged requests (``cat_file`` with ``start``/``end``)."""

    known_size: Optional[int] = None

    def __init__(self, backend: FsspecBackend, path: str) -> None:
        self._backend, self._path = backend, path

    def read_into(self, start: int, out: memoryview) -> int:
        return min(len(out), self._backend.read_into(self._path, start, out))

    def close(self) -> None:
        pass


def _discard(f: Any) -> None:
    """Abandon a partially written remote file without committing it."""
    for name in ("discard", "abort"):
        fn = getattr(f, name, None)
        if callable(fn):
            try:
                fn()
            except Exception:  # best effort on a write being abandoned: its error is raised by the caller
                pass
            break
    try:
        f.closed = True  # fsspec buffered files: prevent close() from uploading later
    except Exception:  # a file object without a settable `closed`: nothing to prevent
        pass
