"""A wrapping fsspec filesystem that injects storage faults, registered as ``faulty://``.

``faulty:///abs/path`` wraps the local filesystem (real files on disk, so tests can also
inspect and damage them); ``storage_options={"target_protocol": "memory"}`` wraps fsspec's
memory filesystem instead. It is not a ``LocalFileSystem``, so async_ckpt treats it like an
object store (``marker`` commit mode, fsspec code paths, no rename).

Faults are rules added with :meth:`FaultyFileSystem.inject`::

    fs = manager.storage.fs
    fs.inject("write", "*.distcp", "reset", times=1)    # one ConnectionResetError mid-file
    fs.inject("write", "*.distcp", "enospc")             # every write: OSError(ENOSPC)
    fs.inject("write", "*.distcp", "truncate")           # silently keeps half the bytes

``op`` is one of ``write`` (streamed ``open(..., "wb")`` files and ``pipe_file``), ``read``,
``rm``, ``ls``, ``mkdir``; ``pattern`` is an ``fnmatch`` pattern on the file's base name;
``kind`` is ``reset`` (ConnectionResetError), ``timeout`` (TimeoutError), ``eio``
(OSError EIO), ``http503`` (an error with ``.status = 503``, transient), ``enospc``,
``eacces``, ``http403`` (permanent), ``truncate`` (writes only: the data is cut short and
success is reported), ``hang`` (the operation waits until the test sets ``fault.release``,
then goes through: a request stuck in the network; ``fault.reached`` is set once it waits) or
``die`` (the process exits at once with status ``DIE_STATUS``: a rank killed mid-request).
``times=None`` means always. Every injected fault is appended to ``fs.hits`` as
``(op, path, kind)``::

    stuck = fs.inject("write", "*.distcp", "hang", times=1)
    assert stuck.reached.wait(30)                       # a save is in flight, held here
    stuck.release.set()                                 # ... and goes on
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import fsspec
from fsspec.spec import AbstractFileSystem

KINDS = ("reset", "timeout", "eio", "http503", "enospc", "eacces", "http403", "truncate", "hang", "die")
DIE_STATUS = 17  # the exit status of a process a "die" fault ended
HANG_LIMIT_S = 60.0  # a hang the test never releases ends (as a TimeoutError) instead of hanging the suite
OPS = ("write", "read", "rm", "ls", "mkdir")


@dataclass
class Fault:
    op: str
    pattern: str
    kind: str
    times: Optional[int] = None  # None: every time
    after_bytes: int = 0  # writes: fail once this many bytes of the file went through
    reached: threading.Event = field(default_factory=threading.Event)  # hang: an operation waits
    release: threading.Event = field(default_factory=threading.Event)  # hang: let it go on

    def hold(self, path: str) -> None:
        """A ``hang``: wait until the test releases it; a ``die``: end the process."""
        if self.kind == "die":
            os._exit(DIE_STATUS)
        self.reached.set()
        if not self.release.wait(HANG_LIMIT_S):
            raise TimeoutError(errno.ETIMEDOUT, "injected hang was never released", path)


class HTTPError(Exception):
    """What an object-store client raises for an HTTP error status (``.status``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status


def _error(kind: str, path: str) -> BaseException:
    if kind == "http503":
        return HTTPError(503, f"injected: Service Unavailable ({path})")
    if kind == "http403":
        return HTTPError(403, f"injected: Forbidden ({path})")
    if kind == "reset":
        return ConnectionResetError(errno.ECONNRESET, "injected: connection reset by peer", path)
    if kind == "timeout":
        return TimeoutError(errno.ETIMEDOUT, "injected: timed out", path)
    if kind == "eio":
        return OSError(errno.EIO, "injected: I/O error", path)
    if kind == "enospc":
        return OSError(errno.ENOSPC, "injected: No space left on device", path)
    if kind == "eacces":
        return PermissionError(errno.EACCES, "injected: Permission denied", path)
    raise ValueError(kind)


class FaultyFileSystem(AbstractFileSystem):
    """Delegates to a target fsspec filesystem, injecting the faults configured on it."""

    protocol = "faulty"
    root_marker = "/"
    cachable = False  # every Storage gets its own instance, so faults never leak between tests

    def __init__(self, target_protocol: str = "file", target_options: Optional[dict] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = fsspec.filesystem(target_protocol, **(target_options or {}))
        self.faults: List[Fault] = []
        self.hits: List[Tuple[str, str, str]] = []
        self._lock = threading.Lock()

    # ---- fault control -----------------------------------------------------------------------
    def inject(self, op: str, pattern: str, kind: str, times: Optional[int] = None, after_bytes: int = 0) -> Fault:
        if op not in OPS or kind not in KINDS or (kind == "truncate" and op != "write"):
            raise ValueError(f"bad fault {op!r}/{kind!r}")
        fault = Fault(op, pattern, kind, times, after_bytes)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def _take(self, op: str, path: str, *, kinds: Tuple[str, ...] = KINDS, nbytes: Optional[int] = None) -> Optional[Fault]:
        """The first matching fault that is still armed (and consume one use of it)."""
        # A file written under a temporary name and renamed into place (the commit marker) is
        # matched by its final name: a fault on "COMMITTED" hits the write of its temporary.
        # (".COMMITTED.tmp-<pid>-<hex>": the temporary is hidden, its final name is not).
        name = re.sub(r"^\.?(.*)\.tmp-\d+-[0-9a-f]+$", r"\1", path.rstrip("/").rsplit("/", 1)[-1])
        with self._lock:
            for f in self.faults:
                if f.op != op or f.kind not in kinds or not fnmatch.fnmatch(name, f.pattern):
                    continue
                if f.times is not None and f.times <= 0:
                    continue
                if nbytes is not None and nbytes < f.after_bytes:
                    continue
                if f.times is not None:
                    f.times -= 1
                self.hits.append((op, path, f.kind))
                return f
        return None

    def _maybe_fail(self, op: str, path: str) -> None:
        f = self._take(op, path, kinds=tuple(k for k in KINDS if k != "truncate"))
        if f is not None and f.kind in ("hang", "die"):
            f.hold(path)
        elif f is not None:
            raise _error(f.kind, path)

    # ---- paths -------------------------------------------------------------------------------
    def _t(self, path: str) -> str:
        return self.target._strip_protocol(self._strip_protocol(path))

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        """``<protocol>://abs/path`` -> ``/abs/path`` (this class's ``protocol``: subclasses that
        wrap local files under a name of their own inherit it)."""
        path = str(path)
        prefix = f"{cls.protocol}://"
        if path.startswith(prefix):
            path = path[len(prefix):]
        return path.rstrip("/") or "/"

    # ---- delegated operations ------------------------------------------------------------
    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        if "w" in mode or "a" in mode:
            return _FaultyWriter(self, path, self.target.open(self._t(path), mode))
        self._maybe_fail("read", path)
        return self.target.open(self._t(path), mode)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self._maybe_fail("write", path)
        f = self._take("write", path, kinds=("truncate",))
        if f is not None:
            value = bytes(value)[: len(value) // 2]
        self.target.pipe_file(self._t(path), value, **kwargs)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        self._maybe_fail("read", path)
        return self.target.cat_file(self._t(path), start=start, end=end, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict:
        return self.target.info(self._t(path), **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._maybe_fail("ls", path)
        kwargs.pop("refresh", None)
        return self.target.ls(self._t(path), detail=detail, **kwargs)

    def glob(self, path: str, **kwargs: Any) -> Any:
        self._maybe_fail("ls", path)
        return self.target.glob(self._t(path), **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._maybe_fail("mkdir", path)
        self.target.makedirs(self._t(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._maybe_fail("mkdir", path)
        self.target.mkdir(self._t(path), create_parents=create_parents, **kwargs)

    def rm(self, path: Any, recursive: bool = False, maxdepth: Any = None) -> None:
        paths = path if isinstance(path, list) else [path]
        for p in paths:
            if recursive and self.target.isdir(self._t(p)):
                for sub in self.target.find(self._t(p)):
                    self._maybe_fail("rm", sub)
            self._maybe_fail("rm", p)
            self.target.rm(self._t(p), recursive=recursive)

    def rm_file(self, path: str) -> None:
        self.rm(path)

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: Any = None, **kwargs: Any) -> None:
        """Rename through the wrapped filesystem (atomic on a local target), fault-injectable."""
        self._maybe_fail("mv", path1)
        self.target.mv(self._t(path1), self._t(path2), recursive=recursive, maxdepth=maxdepth, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.target.exists(self._t(path))

    def invalidate_cache(self, path: Optional[str] = None) -> None:
        self.target.invalidate_cache(None if path is None else self._t(path))


class _FaultyWriter:
    """A file opened for writing through :class:`FaultyFileSystem`."""

    def __init__(self, fs: FaultyFileSystem, path: str, f: Any) -> None:
        self.fs, self.path, self.f = fs, path, f
        self.written = 0
        self.truncating = False
        self.closed = False
        self.broken: Optional[Fault] = None  # once a write failed, the stream stays broken

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self.broken is not None:
            raise _error(self.broken.kind, self.path)
        fault = self.fs._take("write", self.path, kinds=tuple(k for k in KINDS if k != "truncate"),
                              nbytes=self.written + n)
        if fault is not None and fault.kind in ("hang", "die"):
            fault.hold(self.path)
        elif fault is not None:
            self.broken = fault
            raise _error(fault.kind, self.path)
        if not self.truncating and self.written + n > 0:
            self.truncating = self.fs._take("write", self.path, kinds=("truncate",), nbytes=self.written + n) is not None
        if self.truncating:
            keep = max(0, min(n, n // 2))
            if keep:
                self.f.write(memoryview(data).cast("B")[:keep])
        else:
            self.f.write(data)
        self.written += n
        return n  # a truncating write still claims full success: the point is to be caught later

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.f.close()

    def discard(self) -> None:
        self.closed = True
        try:
            self.f.close()
        except Exception:
            pass

    def __enter__(self) -> "_FaultyWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
