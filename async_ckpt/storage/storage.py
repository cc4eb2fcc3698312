"""A thin handle on one fsspec filesystem and a root path, with the few operations we need.

What depends on the kind of storage (local POSIX paths, object stores, any other fsspec
URL) is done by the :mod:`.backends` class that :func:`~.backends.backend_for` picks for the
filesystem; :class:`Storage` adds what is common: paths under the root, retries, tunables.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import threading
import urllib.parse
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import fsspec

from ..errors import (
    CheckpointError,
    InvalidArgumentError,
    StorageError,
    StorageTimeoutError,
    StorageUnreachableError,
)
from .backends import MISSING, Backend, FileState, backend_for
from .backends.base import temp_name
from .retry import RetryPolicy, check_abandoned, is_client_error

__all__ = ["CONNECT_TIMEOUT_HINT", "DEFAULT_BLOCK_SIZE", "MISSING", "FileState", "PIPE_MAX_BYTES", "READ_RANGE_BYTES", "Storage"]

DEFAULT_BLOCK_SIZE = 64 * 2**20  # upload chunk for object stores; gcsfs's 5 MiB is far too small
# Object stores: a data file up to this size is serialised in memory and uploaded in one call
# (``pipe_file``: one request on GCS below 50 MiB, one PUT on S3 below 100 MiB, and a whole-file
# retry is possible); a bigger one streams through ``open()`` in DEFAULT_BLOCK_SIZE chunks.
PIPE_MAX_BYTES = 256 * 2**20
# Reads into host buffers: files bigger than twice this are fetched as concurrent ranged reads
# of about this size.
READ_RANGE_BYTES = 32 * 2**20
#: what :meth:`Storage.probe`'s message says to do for a store that is only slow (the
#: ``async-ckpt`` command says its ``--connect-timeout`` instead)
CONNECT_TIMEOUT_HINT = "raise RetryPolicy(connect_timeout=SECONDS)"


class Storage:
    """One checkpoint root on one fsspec filesystem.

    Tunables (attributes): ``max_file_bytes`` (data files of about this size; object stores
    only, else None), ``pipe_max_bytes`` (object stores: larger files stream), ``block_size``
    (streamed uploads' chunk size), ``retry`` (the :class:`RetryPolicy` of every call).

    Args:
        url: the root: a local path, ``os.PathLike`` or any fsspec URL.
        storage_options: fsspec options for the filesystem (per-request timeouts of
            ``retry.request_timeout`` are added for gcsfs and s3fs: :func:`client_timeouts`).
        block_size: the chunk size of streamed uploads.
        retry: the retry policy of every call (default: ``RetryPolicy()``).

    Raises:
        InvalidArgumentError: ``url`` is empty or not a str / ``os.PathLike``, or begins like
            a URL with one slash (``gs:/bucket``: a typo, or a ``pathlib.Path`` of a URL).
        StorageError: fsspec cannot open ``url`` (unknown protocol, its package missing, the
            client refused its options).
    """

    def __init__(
        self,
        url: str,
        storage_options: Optional[Dict[str, Any]] = None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        retry: Optional[RetryPolicy] = None,
    ) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise InvalidArgumentError(f"path must be a str or os.PathLike, got {type(url).__name__}")
        url = os.fspath(url)
        if not url:
            raise InvalidArgumentError("path must not be empty")
        _refuse_one_slash_url(url)
        policy = retry if retry is not None else RetryPolicy()
        try:
            fs, root = fsspec.core.url_to_fs(url, **client_timeouts(url, storage_options, policy.request_timeout))
        except Exception as exc:
            if not isinstance(exc, (ImportError, ValueError, TypeError)) and not is_client_error(exc):
                raise
            raise StorageError(f"cannot open checkpoint path {url!r}: {type(exc).__name__}: {exc}") from exc
        self.url = url
        self._backend: Backend = backend_for(fs)
        self.pipe_max_bytes = PIPE_MAX_BYTES
        self.max_file_bytes: Optional[int] = self._backend.default_max_file_bytes
        self.root = self._backend.normalize_root(root)
        self.block_size = block_size
        self.retry = policy
        self._abandoned = False

    def probe(self) -> bool:
        """Whether the root exists: the first request to the storage, bounded in time.

        On remote storage the request must be answered within ``retry.connect_timeout``
        seconds, and an object store's endpoint, where its client names it, is first resolved
        and connected to (so that a wrong host or port fails at once, with its cause): a wrong
        bucket, endpoint or network fails here in one line instead of after the client's
        retries. Local paths: one ``exists``.

        Returns:
            True when the root exists.

        Raises:
            StorageUnreachableError: the endpoint does not resolve or refuses connections, or
                no answer came within ``retry.connect_timeout`` (the message names the URL, the
                cause, what to check and the setting to raise).
            StorageError: the storage refused the request (wrong credentials, no such bucket).
        """
        if self.is_local:
            return self.exists(self.root)
        seconds = self.retry.connect_timeout
        endpoint = self._backend.endpoint()
        problem = endpoint_problem(endpoint, seconds) if endpoint else None
        if problem is not None:
            raise StorageUnreachableError(self._unreachable(problem))
        policy = dataclasses.replace(self.retry, attempts=1, deadline=min(seconds, self.retry.deadline))
        try:
            return bool(policy.call(lambda: self.fs.exists(self.root), f"stat {self.root}"))
        except StorageTimeoutError as exc:
            raise StorageUnreachableError(self._unreachable(
                f"no answer within {seconds:g} s" + (f" from {endpoint}" if endpoint else ""))) from exc
        except StorageError as exc:
            cause = " ".join(str(exc.__cause__ or exc).split())
            raise StorageError(f"checkpoint path {self.url} cannot be read ({type(exc.__cause__ or exc).__name__}: "
                               f"{cause}); check the credentials, endpoint and bucket in storage_options") from exc

    def _unreachable(self, cause: str) -> str:
        return (f"checkpoint path {self.url} cannot be reached: {cause}; check the endpoint, bucket and "
                f"credentials (storage_options) and the network, or {CONNECT_TIMEOUT_HINT} "
                f"(now {self.retry.connect_timeout:g} s) for a store that is only slow to answer")

    @property
    def retry(self) -> RetryPolicy:
        """The :class:`RetryPolicy` of every call, as this storage applies it.

        Settable: the policy given (see :meth:`RetryPolicy.for_storage`)."""
        return self._retry

    @retry.setter
    def retry(self, policy: RetryPolicy) -> None:
        self._retry = policy.for_storage(remote=not self._backend.is_local,
                                         client_retries=self._backend.client_retries)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (settable: a wrapper, e.g. in tests, takes its place)."""
        return self._backend.fs

    @fs.setter
    def fs(self, fs: Any) -> None:
        self._backend.fs = fs

    @property
    def is_local(self) -> bool:
        """Local POSIX paths: plain files, ``fsync``, atomic ``rename``, symbolic links."""
        return self._backend.is_local

    @property
    def keeps_crc32c(self) -> bool:
        """Whether the storage keeps each object's CRC-32C (gs://: :meth:`file_state` has it)."""
        return self._backend.keeps_crc32c

    @property
    def length_checked_writes(self) -> bool:
        """Whether the service checks every upload's length (gs://, s3://).

        Then a written file need not be stat'ed to catch a short write."""
        return self._backend.length_checked_writes

    # ---- paths -------------------------------------------------------------------------------
    def root_identity(self) -> str:
        """The root as one string per directory: ``<protocol>://<root>/``.

        The filesystem's protocol and the root path (local paths: absolute, symbolic links
        resolved; ``file://`` or not).

        What a local tier's manifests record as the persistent root they were saved for.

        Returns:
            ``<protocol>://<root>/``.
        """
        proto = self.fs.protocol
        proto = proto[0] if isinstance(proto, (tuple, list)) else proto
        root = os.path.realpath(self.root) if self.is_local else self.root
        return f"{proto}://{root.rstrip('/')}/"

    def join(self, *parts: str) -> str:
        """The path of ``parts`` under the root.

        Args:
            *parts: path components (leading and trailing ``/`` stripped; empty ones skipped).

        Returns:
            ``root/part1/part2...``.
        """
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def url_of(self, path: str) -> str:
        """A URL that fsspec (and so DCP) can open for ``path``.

        Args:
            path: a path of this storage (as :meth:`join` makes them).

        Returns:
            The URL (a local path for local storage).
        """
        return self._backend.url_of(path)

    # ---- writes ------------------------------------------------------------------------------
    def abandon(self) -> None:
        """Refuse every later write, rename and new directory through this storage.

        Reads and removals still work: a save being written fails at its next file, and its job then
        removes what it wrote (a second Ctrl-C while a save finishes)."""
        self._abandoned = True

    def _check_abandoned(self, path: str) -> None:
        if self._abandoned:
            raise CheckpointError(f"{path}: not written: the save was abandoned (Ctrl-C)")

    def makedirs(self, path: str) -> None:
        """Make directory ``path`` and its parents.

        Object stores have none: nothing is made there, never a bucket.

        Args:
            path: the directory.

        Raises:
            CheckpointError: the storage was abandoned (:meth:`abandon`).
            StorageError: the storage refused the write (after retries of transient errors;
                :class:`~async_ckpt.errors.StorageTimeoutError` past the retry deadline).
        """
        self._check_abandoned(path)
        self.retry.call(lambda: self._backend.makedirs(path), f"mkdir {path}")

    def check_writable(self) -> None:
        """Object stores: write and delete a small probe object under the root.

        So that a missing bucket or wrong credentials fail now (elsewhere: nothing).

        Raises:
            StorageError: the bucket does not exist or cannot be written.
        """
        if not self._backend.probe_writes:
            return  # a local path or generic fsspec: its first write says what is wrong
        probe = self.join(f".async_ckpt-probe-{os.getpid()}-{id(self):x}")
        try:
            self.write_bytes(probe, b"async_ckpt write probe\n")
            self.retry.call(lambda: self._backend.remove_file(probe), f"delete {probe}")
        except FileNotFoundError as exc:
            raise StorageError(f"checkpoint path {self.url!r} cannot be written: the bucket does not exist "
                               f"(or is not visible with these credentials): {exc}") from exc
        except (OSError, StorageError) as exc:
            cause = exc.__cause__ if isinstance(exc, StorageError) and exc.__cause__ is not None else exc
            raise StorageError(f"checkpoint path {self.url!r} cannot be written ({type(cause).__name__}: {cause}); "
                               "check the credentials, endpoint and bucket in storage_options") from exc

    def open_write(self, path: str, size_hint: Optional[int] = None) -> AbstractContextManager[Any]:
        """A binary file opened for writing; durable (flushed, fsynced or uploaded) on exit.

        On object stores a file whose ``size_hint`` is at most ``pipe_max_bytes`` is buffered in
        memory and uploaded in one ``pipe_file`` call on exit; otherwise it streams in
        ``block_size`` chunks (resumable/multipart upload), completed on exit. Either way
        nothing is visible under ``path`` unless the block exits normally.

        Args:
            path: the file.
            size_hint: its expected size in bytes, if known.

        Returns:
            A context manager giving the binary file object (one attempt: not retried).

        Raises:
            CheckpointError: the storage was abandoned (:meth:`abandon`).
            StorageError: a symbolic link is at ``path`` (local paths: never written through).
            OSError: the storage refused to open or write the file.
        """
        self._check_abandoned(path)
        return self._open_write(path, size_hint)

    @contextmanager
    def _open_write(self, path: str, size_hint: Optional[int]) -> Iterator["_CheckedWrites"]:
        """The backend's file; a write timed out by its caller (see
        :func:`~async_ckpt.storage.retry.check_abandoned`) stops at its next write and is not
        completed: it reads no more of buffers its caller has given back, and lands no file."""
        with self._backend.open_write(path, size_hint, block_size=self.block_size,
                                      pipe_max_bytes=self.pipe_max_bytes) as f:
            yield _CheckedWrites(f, path)
            check_abandoned(f"write {path}")  # raised here: the backend discards the file

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a small file in one call (retried as a whole on transient errors).

        Args:
            path: the file.
            data: its content.

        Raises:
            CheckpointError: the storage was abandoned (:meth:`abandon`).
            StorageError: the storage refused the write (after retries of transient errors;
                :class:`~async_ckpt.errors.StorageTimeoutError` past the retry deadline).
        """
        self._check_abandoned(path)
        self.retry.call(lambda: self._backend.write_bytes(path, data), f"write {path}")

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Write a small file that is either wholly there or not at all.

        Even if the process dies mid-write: one PUT on object stores; elsewhere a temporary name,
        then a rename.

        Args:
            path: the file.
            data: its content.

        Raises:
            CheckpointError: the storage was abandoned (:meth:`abandon`).
            StorageError: the storage refused the write (after retries of transient errors;
                :class:`~async_ckpt.errors.StorageTimeoutError` past the retry deadline).
        """
        self._check_abandoned(path)
        if self._backend.atomic_puts:
            self.write_bytes(path, data)
            return
        tmp = temp_name(path)
        self.write_bytes(tmp, data)
        self.retry.call(lambda: self._backend.replace(tmp, path), f"rename {tmp}")

    def write_file_atomic(self, path: str, write_to: Callable[[str], None]) -> int:
        """Write one file atomically (local paths) by a writer that takes a path.

        ``path`` is the old file or the complete new one, never torn. The writer (``torch.save``, safetensors' ``save_file``, a framework's own save) writes
        a temporary file beside ``path`` that this call first creates empty (a regular file with
        one name, never through a link: :func:`~.backends.posix.open_own_file`); the file is
        then fsynced and renamed over ``path``. A symbolic link or a directory at ``path`` is
        never replaced. The whole write is retried on transient errors; a failed one leaves no
        temporary behind. The directory is not fsynced here (:meth:`fsync_dir`, once for
        several files).

        Args:
            path: the file.
            write_to: writes the whole file at the path it is given.

        Returns:
            The file's size in bytes.

        Raises:
            CheckpointError: the storage was abandoned (:meth:`abandon`).
            StorageError: a symbolic link or a directory is at ``path``, the storage is not
                local, or it refused the write (after retries of transient errors).
        """
        self._check_abandoned(path)
        if not self.is_local:
            raise StorageError(f"cannot write {path} through a writer that takes a path: not a local path")
        return self.retry.call(lambda: self._backend.write_file_atomic(path, write_to), f"write {path}")

    def fsync_dir(self, path: str) -> None:
        """Make directory ``path``'s entries durable (local paths; nothing elsewhere).

        Args:
            path: the directory.
        """
        self._backend.fsync_dir(path)

    def rename(self, src: str, dst: str) -> None:
        """Atomic rename (POSIX only).

        Args:
            src: the existing path.
            dst: its new path.

        Raises:
            CheckpointError: the storage was abandoned (:meth:`abandon`).
            OSError: the rename failed.
        """
        self._check_abandoned(dst)
        self._backend.rename(src, dst)

    def share(self, src: str, dst: str) -> bool:
        """Make ``dst`` hold the bytes of the file ``src`` without sending them from this process.

        A hard link on POSIX paths (the bytes are stored once; a copy where the filesystem has
        no hard links), a server-side copy on object stores.

        Args:
            src: an existing file (a committed step's data file).
            dst: the new file (in a step being written).

        Returns:
            Whether the bytes are now stored once for both (a hard link).

        Raises:
            CheckpointError: the storage was abandoned (:meth:`abandon`).
            FileNotFoundError: ``src`` is gone (e.g. its step was deleted meanwhile).
            StorageError: a symbolic link at either path, or the storage refused (after
                retries of transient errors; :class:`~async_ckpt.errors.StorageTimeoutError`
                past the retry deadline).
        """
        self._check_abandoned(dst)
        return self.retry.call(lambda: self._backend.share(src, dst), f"share {src} as {dst}")

    def rm(self, path: str, recursive: bool = True, *, wait: Optional[float] = None) -> None:
        """Remove a file or tree; a missing path is not an error.

        Local paths: never through a symbolic link. A link at ``path`` itself is removed, not
        what it points to (trees are removed with ``shutil.rmtree``, which does the same for
        links inside them); a link between the root and ``path`` raises :class:`StorageError`.

        Args:
            path: the file or directory.
            recursive: remove a directory with everything in it.
            wait: on remote storage, wait at most this many seconds, with one attempt (a
                clean-up that must not hold up its caller: the deletion goes on in the
                background after that); None: the retry policy's deadline.

        Raises:
            StorageError: a symbolic link lies between the root and ``path``, or the storage
                refused the deletion (:class:`~async_ckpt.errors.StorageTimeoutError` past
                the deadline).
        """
        self._backend.before_delete(path, self.root)
        policy = self.retry
        if wait is not None and policy.bounded:
            policy = dataclasses.replace(policy, attempts=1, deadline=min(policy.deadline, wait))

        def _do() -> None:
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass

        policy.call(_do, f"delete {path}")

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (local paths; object stores have none).

        Args:
            path: the path.

        Returns:
            True for a link (dangling ones too).
        """
        return self._backend.is_link(path)

    def file_problem(self, path: str, inside: str) -> Optional[str]:
        """Why ``path`` cannot be read as a checkpoint file of the directory ``inside``, or None.

        Local paths: it must exist, be a regular file (a directory in its place is damage),
        and, if it is a symbolic link, resolve to a file inside ``inside``. Object stores have
        neither links nor directories at a file's name: always None (a missing object shows
        when it is read).

        Args:
            path: the file.
            inside: the step directory it belongs to.

        Returns:
            A description of the problem, or None.
        """
        return self._backend.file_problem(path, inside)

    # ---- reads -------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        """A whole file's content (retried on transient errors).

        Args:
            path: the file.

        Returns:
            Its bytes.

        Raises:
            FileNotFoundError: there is no file at ``path``.
            StorageError: the storage refused the read (after retries of transient errors;
                :class:`~async_ckpt.errors.StorageTimeoutError` past the retry deadline).
        """
        return self.retry.call(lambda: self.fs.cat_file(path), f"read {path}")

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        """Read ``path[start:start+len(out)]`` into ``out``.

        Args:
            path: the file.
            start: the offset of the first byte.
            out: where the bytes go.

        Returns:
            The bytes read (fewer than ``len(out)`` at the end of the file).

        Raises:
            FileNotFoundError: there is no file at ``path``.
            StorageError: the storage refused the read (after retries of transient errors;
                :class:`~async_ckpt.errors.StorageTimeoutError` past the retry deadline).
        """
        return self.retry.call(lambda: self._backend.read_into(path, start, out),
                               f"read {path}[{start}:{start + len(out)}]")

    def open_ranges(self, path: str) -> "RetriedRanges":
        """``path`` opened for many ranged reads, from any number of threads.

        Each read is retried on transient errors. Close it (or use it as a context manager) when
        done.

        Args:
            path: the file.

        Returns:
            The reader.

        Raises:
            FileNotFoundError: there is no file at ``path``.
            StorageError: the storage refused the read (after retries of transient errors;
                :class:`~async_ckpt.errors.StorageTimeoutError` past the retry deadline).
        """
        return RetriedRanges(self.retry.call(lambda: self._backend.open_ranges(path), f"open {path}"),
                             path, self.retry)

    def size(self, path: str) -> int:
        """Size in bytes of the file at ``path`` as the storage reports it (never from a cache).

        Args:
            path: the file.

        Returns:
            The size.

        Raises:
            FileNotFoundError: there is no file at ``path``.
            StorageError: the storage refused the read (after retries of transient errors;
                :class:`~async_ckpt.errors.StorageTimeoutError` past the retry deadline).
        """
        return int(self.retry.call(lambda: self._backend.size(path), f"stat {path}"))

    def file_state(self, path: str) -> FileState:
        """What the storage says of the file at ``path`` now, without reading it.

        Never from a cache: its size, the CRC-32C the storage keeps of it (GCS), and what tells
        a later look whether its bytes were rewritten since (:meth:`FileState.same_file`).

        Args:
            path: the file.

        Returns:
            Its state.

        Raises:
            FileNotFoundError: there is no file at ``path``.
            StorageError: the storage refused the call (after retries of transient errors;
                :class:`~async_ckpt.errors.StorageTimeoutError` past the retry deadline).
        """
        return self.retry.call(lambda: self._backend.file_state(path), f"stat {path}")

    def exists(self, path: str) -> bool:
        """Whether a file or directory is at ``path``.

        Args:
            path: the path.

        Returns:
            True when it exists.

        Raises:
            StorageError: the storage refused the call (after retries).
        """
        return bool(self.retry.call(lambda: self.fs.exists(path), f"stat {path}"))

    def listdir(self, path: str) -> List[Dict[str, Any]]:
        """Entries directly under ``path``.

        Args:
            path: the directory.

        Returns:
            fsspec's detail dicts (``name`` is the base name, ``type``, ``size``, ...); [] when
            ``path`` does not exist.

        Raises:
            StorageError: the storage refused the listing (after retries).
        """

        def _do() -> List[Dict[str, Any]]:
            try:
                entries = self._backend.ls(path)
            except FileNotFoundError:
                return []
            out = []
            for e in entries:
                name = e["name"].rstrip("/").rsplit("/", 1)[-1]
                out.append({**e, "name": name})
            return out

        return self.retry.call(_do, f"list {path}")

    def marked_dirs(self, marker: str) -> List[str]:
        """The names of the directories directly under the root that hold a file ``marker``.

        Symbolic links are never listed; a local listing is taken again while a rename changed
        the root under it (one listing elsewhere: one ``glob``).

        Args:
            marker: the file's name (a commit marker).

        Returns:
            The directory names ([] when the root does not exist).

        Raises:
            StorageError: the storage refused the listing (after retries).
        """

        def _do() -> List[str]:
            try:
                return self._backend.marked(self.root, marker)
            except FileNotFoundError:
                return []

        return self.retry.call(_do, f"list {self.root}")

    def invalidate_cache(self) -> None:
        """Drop the filesystem's cached listings (errors are ignored)."""
        try:
            self.fs.invalidate_cache()
        except Exception:  # a filesystem without a listing cache: nothing to drop
            pass


_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


def _refuse_one_slash_url(url: str) -> None:
    """A path whose first component is a known protocol followed by one slash (``gs:/bucket``)
    is a mistyped URL, or a URL that went through ``pathlib.Path`` (which folds ``//``): never
    a local directory named ``gs:``."""
    m = _ONE_SLASH.match(url)
    if m is None or m.group(1).lower() not in fsspec.available_protocols():
        return
    likely = f"{m.group(1)}://{url[m.end():]}"
    raise InvalidArgumentError(
        f"checkpoint path {url!r} looks like a URL with one slash after {m.group(1)}: (it would be saved "
        f"to the local directory {m.group(1)}:); did you mean {likely!r}? Pass the URL as a str "
        f"(pathlib.Path folds '//' into '/'), or ./{url} for a local directory")


def endpoint_problem(endpoint: str, timeout: float) -> Optional[str]:
    """Why ``endpoint`` cannot be connected to: its host does not resolve, or a TCP connection
    to it is refused or times out; None when it connects, or when a proxy is configured
    (``HTTP(S)_PROXY``, ``ALL_PROXY``: the client may reach it only through the proxy).

    Args:
        endpoint: an ``http(s)://host[:port]`` URL.
        timeout: seconds for the name lookup and the connection, each.

    Returns:
        The problem in a few words, or None.
    """
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                                       "ALL_PROXY", "all_proxy")):
        return None
    try:
        parts = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None
    box: List[Any] = []

    def lookup() -> None:
        try:
            box.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            box.append(exc)

    worker = threading.Thread(target=lookup, name="async-ckpt-resolve", daemon=True)
    worker.start()
    worker.join(timeout)
    if not box:
        return f"the endpoint {endpoint}'s host {host} did not resolve within {timeout:g} s"
    if isinstance(box[0], OSError):
        return f"the endpoint {endpoint}'s host {host} does not resolve ({box[0].strerror or box[0]})"
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"the endpoint {endpoint} refuses connections ({exc.strerror or type(exc).__name__})"
    return None


#: gcsfs/s3fs storage options that bound one request, per protocol
_GCS, _S3 = ("gs", "gcs"), ("s3", "s3a")


def client_timeouts(url: str, storage_options: Optional[Dict[str, Any]], seconds: float) -> Dict[str, Any]:
    """``storage_options`` with per-request timeouts of ``seconds`` added for the client
    libraries that wait forever by default, unless the options set them already.

    Args:
        url: the checkpoint URL (its protocol picks the client).
        storage_options: the user's fsspec options (not changed).
        seconds: the request timeout (:attr:`RetryPolicy.request_timeout`).

    Returns:
        The options to open the filesystem with: gcsfs (``gs://``) gets ``requests_timeout``,
        s3fs (``s3://``) ``config_kwargs`` ``connect_timeout`` and ``read_timeout``; others
        as given.
    """
    opts = dict(storage_options or {})
    protocol = fsspec.core.split_protocol(url)[0]
    if protocol in _GCS and opts.get("requests_timeout") is None:
        opts["requests_timeout"] = seconds
    elif protocol in _S3:
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", seconds)
        config.setdefault("read_timeout", seconds)
        opts["config_kwargs"] = config
    return opts


class _CheckedWrites:
    """A file being written whose writes stop once a timed-out caller abandoned the call."""

    def __init__(self, f: Any, path: str) -> None:
        self._f, self._what = f, f"write {path}"

    def write(self, b: Any) -> Any:
        check_abandoned(self._what)
        return self._f.write(b)


class RetriedRanges:
    """A backend's :class:`~.backends.base.RangeReader` whose reads are retried.

    Args:
        reader: the backend's reader.
        path: the file, for messages.
        retry: the retry policy of each read.
    """

    def __init__(self, reader: Any, path: str, retry: RetryPolicy) -> None:
        self._reader, self.path, self._retry = reader, path, retry
        self.known_size: Optional[int] = reader.known_size

    def read_into(self, start: int, out: memoryview) -> int:
        """Read ``file[start:start+len(out)]`` into ``out``.

        Args:
            start: the offset of the first byte.
            out: where the bytes go.

        Returns:
            The bytes read (fewer than ``len(out)`` at the end of the file).

        Raises:
            StorageError: the storage refused the read (after retries).
        """
        return self._retry.call(lambda: self._reader.read_into(start, out),
                                f"read {self.path}[{start}:{start + len(out)}]")

    def close(self) -> None:
        """Close the file."""
        self._reader.close()

    def __enter__(self) -> "RetriedRanges":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
