"""What the framework integrations share: host snapshots of arbitrary checkpoint objects, a
background writer, and atomic ``torch.save`` files.

A framework's checkpoint is a nested object (dicts, lists, tuples, ``OrderedDict`` state dicts
with their ``_metadata``, hyper-parameter containers, NumPy RNG states, ...) with tensors
anywhere inside. :class:`Snapshotter` takes it apart at the call: one pickle of the object in
which every tensor is replaced by a reference (so the non-tensor parts are copied, with their
exact types, and a later mutation cannot reach the checkpoint), and the tensors themselves
staged to host memory by :class:`~async_ckpt.staging.Stager` through one reused
:class:`~async_ckpt.staging.HostBufferPool` (one batched copy; no fresh host allocation per
save in steady state). :meth:`HostCopy.materialize` rebuilds the object around the host copies
in the background, each tensor on a storage of exactly its own bytes, so ``torch.save`` writes
what it would have written for the original (storage sharing between tensors kept).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch

from ..errors import CheckpointError, CorruptCheckpointError, InvalidArgumentError, InvalidStateDictError
from ..staging import HostBufferPool, Stager

log = logging.getLogger("async_ckpt.integrations")

TMP_SUFFIX = ".async-ckpt-tmp"


class _RefPickler(pickle.Pickler):
    """Pickles an object with every tensor replaced by its index in ``tensors``."""

    def __init__(self, file: Any, tensors: List[torch.Tensor]) -> None:
        super().__init__(file, protocol=2)  # torch.save's protocol: what pickles here, saves there
        self.tensors = tensors
        self._index: Dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            k = self._index.get(id(obj))
            if k is None:
                k = self._index[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return k
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            raise pickle.PicklingError("a bare tensor storage cannot be checkpointed asynchronously")
        return None


class _RefUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, tensors: List[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[pid]


class HostCopy:
    """One checkpoint object at the moment of the call: its pickled skeleton and the host
    copies of its tensors (pooled buffers, given back by :meth:`release`)."""

    def __init__(self, skeleton: bytes, snapshot: Any, groups: List[int], nbytes: int) -> None:
        self._skeleton = skeleton
        self._snapshot = snapshot
        self._groups = groups  # per tensor: the original storage's group id
        self.nbytes = nbytes

    @property
    def num_tensors(self) -> int:
        """How many tensors the snapshot holds."""
        return len(self._groups)

    def materialize(self) -> Any:
        """The checkpoint object, its tensors replaced by compact host tensors. Valid until
        :meth:`release`."""
        if self._snapshot is None:
            raise CheckpointError("the host copy was already released")
        sd = self._snapshot.state_dict
        host = [sd[str(i)] for i in range(len(self._groups))]
        return _RefUnpickler(io.BytesIO(self._skeleton), _compact(host, self._groups)).load()

    def release(self) -> None:
        """Give the host buffers back to the pool (idempotent)."""
        if self._snapshot is not None:
            self._snapshot.release()
            self._snapshot = None


def _bytes_span(storage: torch.UntypedStorage, lo: int, hi: int) -> torch.UntypedStorage:
    """A storage of exactly the bytes ``[lo, hi)`` of ``storage``, sharing its memory (no copy)."""
    span = torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,), (1,))
    return torch.from_numpy(span.numpy()).untyped_storage()


def _extent(t: torch.Tensor) -> Tuple[int, int]:
    es = t.element_size()
    lo = cast(int, t.storage_offset()) * es  # typed int | SymInt (symbolic shapes); host tensors have ints
    return lo, lo + (1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride()))) * es


def _compact(host: List[torch.Tensor], groups: List[int]) -> List[torch.Tensor]:
    """Host tensors on storages of their own bytes: the tensors of one original storage (tied
    weights, views) share one storage spanning what they use; other tensors share nothing, even
    where the pool coalesced them into one buffer."""
    out: List[Optional[torch.Tensor]] = [None] * len(host)
    by_group: Dict[Tuple[int, int], List[int]] = {}
    for i, (h, g) in enumerate(zip(host, groups)):
        if h.numel() == 0:
            out[i] = torch.empty(h.shape, dtype=h.dtype)
        else:
            by_group.setdefault((g, h.untyped_storage().data_ptr()), []).append(i)
    for members in by_group.values():
        if len(members) == 1:
            h = host[members[0]]
            if h.is_contiguous():
                es = h.element_size()
                lo = cast(int, h.storage_offset()) * es  # an int on a host tensor (typed int | SymInt)
                st = _bytes_span(h.untyped_storage(), lo, lo + h.numel() * es)
                out[members[0]] = torch.empty(0, dtype=h.dtype).set_(st, 0, h.size(), h.stride())
                continue
        extents = [_extent(host[i]) for i in members]
        lo, hi = min(e[0] for e in extents), max(e[1] for e in extents)
        if any((e[0] - lo) % host[i].element_size() for i, e in zip(members, extents)):
            for i in members:  # mixed dtypes at odd offsets: each on its own
                out[i] = host[i].clone()
            continue
        st = _bytes_span(host[members[0]].untyped_storage(), lo, hi)
        done: Dict[int, torch.Tensor] = {}
        for i in members:
            h = host[i]
            if id(h) not in done:
                done[id(h)] = torch.empty(0, dtype=h.dtype).set_(
                    st, h.storage_offset() - lo // h.element_size(), h.size(), h.stride())
            out[i] = done[id(h)]
    return out  # type: ignore[return-value]


class Snapshotter:
    """Takes :class:`HostCopy` objects of checkpoint objects through one pooled :class:`Stager`."""

    def __init__(self, memory_budget_bytes: Optional[int] = None) -> None:
        self.stager = Stager(HostBufferPool(memory_budget_bytes))

    @property
    def pool(self) -> HostBufferPool:
        return self.stager.pool

    def take(self, obj: Any, what: str = "checkpoint") -> HostCopy:
        """Host copy of ``obj``. Raises :class:`InvalidStateDictError` (naming ``what``) for an
        object that cannot be pickled or a tensor that cannot be staged."""
        tensors: List[torch.Tensor] = []
        buf = io.BytesIO()
        try:
            _RefPickler(buf, tensors).dump(obj)
        except Exception as exc:
            raise InvalidStateDictError(f"{what}: cannot be saved ({type(exc).__name__}: {exc})") from exc
        groups: List[int] = []
        gid: Dict[Tuple[str, int], int] = {}
        for t in tensors:
            try:
                key: Tuple[str, int] = (t.device.type, t.untyped_storage().data_ptr())
            except Exception:  # no addressable storage (XLA, meta, sparse): a group of its own
                key = ("", id(t))
            groups.append(gid.setdefault(key, len(gid)))
        flat = {str(i): t for i, t in enumerate(tensors)}
        try:
            snap = self.stager.stage(flat, self.stager.plan(flat))
        except InvalidStateDictError as exc:
            raise InvalidStateDictError(f"{what}: tensor #{exc}") from exc
        return HostCopy(buf.getvalue(), snap, groups, snap.nbytes)


# ---- files --------------------------------------------------------------------------------------

def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory ``path`` durable (best effort where the OS
    cannot open directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file under ``root``, then each directory (so a rename of ``root`` that
    follows publishes durable contents)."""
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(d)


def tmp_name(path: str) -> str:
    """A hidden temporary name next to ``path``: ``.<name>.<random>.async-ckpt-tmp``."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")


def remove_stale_tmps(path: str) -> None:
    """Delete temporary files of ``path`` left by an interrupted write."""
    d, base = os.path.split(path)
    try:
        names = os.listdir(d or ".")
    except OSError:
        return
    prefix = f".{base}."
    for n in names:
        if n.startswith(prefix) and n.endswith(TMP_SUFFIX):
            try:
                os.remove(os.path.join(d, n))
            except OSError:
                pass


def write_file(path: str, write: Callable[[Any], None], *, fsync: bool = True) -> None:
    """Write a file through ``write(f)`` to a temporary name, fsync it, then rename it to
    ``path`` (atomic on POSIX: ``path`` is the old file or the complete new one, never torn)."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(d)


def verify_torch_file(f: Any, name: str) -> None:
    """Check a ``torch.save`` file: its zip structure is complete and every record matches the
    CRC-32 stored with it. Raises :class:`CorruptCheckpointError` naming ``name``."""
    import zipfile

    head = f.read(4)
    f.seek(0)
    if head != b"PK\x03\x04":
        if not head:
            raise CorruptCheckpointError(f"{name}: the checkpoint file is empty", path=name)
        return  # a legacy (non-zip) torch.save file: torch.load checks what it can
    try:
        with zipfile.ZipFile(f) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{name}: not a complete torch.save archive ({exc})", path=name) from exc
    finally:
        f.seek(0)
    if bad is not None:
        raise CorruptCheckpointError(f"{name}: record {bad!r} fails its CRC-32 check", path=name)


# ---- the background writer ------------------------------------------------------------------------

class BackgroundWriter:
    """Runs write jobs one at a time, in order, on one thread; tracks them by key (a path).

    A job's error is kept and raised, as :class:`CheckpointError` with the original chained,
    by the next :meth:`check` (which callers make at each entry point), :meth:`wait` or
    :meth:`wait_all`. ``max_pending`` bounds the jobs queued or running: :meth:`submit` waits
    for the oldest when the bound is reached (back-pressure on the host memory they hold).
    """

    def __init__(self, name: str, max_pending: int = 2) -> None:
        if max_pending < 1:
            raise InvalidArgumentError(f"max_pending must be >= 1, got {max_pending}")
        self.name = name
        self.max_pending = max_pending
        self._executor: Optional[ThreadPoolExecutor] = None
        self._jobs: List[Tuple[str, Future]] = []
        self._errors: List[Tuple[str, BaseException]] = []
        self._lock = threading.Lock()

    def submit(self, key: str, fn: Callable[[], None], on_drop: Optional[Callable[[], None]] = None) -> None:
        """Queue ``fn`` under ``key``. ``on_drop`` runs if the job could not be queued."""
        try:
            self.check()
            while True:
                with self._lock:
                    self._reap()
                    if len(self._jobs) < self.max_pending:
                        break
                    oldest = self._jobs[0][1]
                oldest.exception()  # wait; its error is collected by the next check
                self.check()
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
                self._jobs.append((key, self._executor.submit(fn)))
        except BaseException:
            if on_drop is not None:
                on_drop()
            raise

    def _reap(self) -> None:
        keep = []
        for key, fut in self._jobs:
            if fut.done():
                exc = fut.exception()
                if exc is not None:
                    self._errors.append((key, exc))
            else:
                keep.append((key, fut))
        self._jobs = keep

    def pending(self, key: Optional[str] = None) -> List[str]:
        """Keys of the jobs queued or running (of ``key`` only, when given)."""
        with self._lock:
            self._reap()
            return [k for k, _ in self._jobs if key is None or k == key]

    def check(self) -> None:
        """Raise the first error of a finished job (and forget it)."""
        with self._lock:
            self._reap()
            if not self._errors:
                return
            key, exc = self._errors.pop(0)
        raise CheckpointError(f"background checkpoint write of {key} failed: {type(exc).__name__}: {exc}") from exc

    def wait(self, key: str) -> None:
        """Wait for every job of ``key``; raise its error, if any."""
        with self._lock:
            futs = [f for k, f in self._jobs if k == key]
        for f in futs:
            f.exception()
        self.check()

    def wait_all(self, shutdown: bool = False) -> None:
        """Wait for every job; raise the first error. ``shutdown`` also ends the thread (a
        later :meth:`submit` starts a new one)."""
        with self._lock:
            futs = [f for _, f in self._jobs]
            ex = self._executor
            if shutdown:
                self._executor = None
        for f in futs:
            f.exception()
        if shutdown and ex is not None:
            ex.shutdown(wait=True)
        self.check()
