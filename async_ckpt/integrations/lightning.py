"""PyTorch Lightning: :class:`AsyncCkptIO`, a ``CheckpointIO`` plugin that saves in the background.

``Trainer(plugins=[AsyncCkptIO()])``. Each ``save_checkpoint`` copies the tensors of
Lightning's checkpoint dict into reused host buffers (see
:class:`~async_ckpt.integrations.object_snapshot.Snapshotter`); a writer thread then writes the file
at ``path`` in ``torch.save`` format to a hidden temporary name next to it (local or any fsspec
filesystem), fsyncs it (local) and renames it into place (``fs.mv`` remotely: a server-side copy
on object stores, which publishes the object at once). ``path`` is therefore always the
previous complete file or the new complete file, and plain ``torch.load`` /
``LightningModule.load_from_checkpoint`` read it without the plugin -- except for a name that
did not exist: ``save_checkpoint`` takes it at the call with a small placeholder file
(:data:`PLACEHOLDER`: ``torch.load(weights_only=False)`` of it raises an error naming
``wait()``, see :func:`still_being_written`), so that
``ModelCheckpoint`` (which gives a name a version suffix only when the name exists) never
gives one name to two saves while the first is being written. A failed write removes that
placeholder; a process killed before the write committed leaves it, and ``load_checkpoint``
refuses it. ``load_checkpoint`` first waits for a pending write of that path, then
checks the file (zip structure and the CRC-32 of every record) before loading it.

Saves made by a ``Checkpoint`` callback (``ModelCheckpoint`` and its subclasses) return once
the host copy is taken. Any other ``save_checkpoint`` -- ``trainer.save_checkpoint("x.ckpt")``
from user code -- returns once that file is committed (``sync_explicit=True``, the default), so
a ``torch.load`` right after it works.

The class subclasses the ``CheckpointIO`` of ``lightning`` and, where it is installed, of
``pytorch_lightning`` (``lightning_fabric``) too, so either package's ``Trainer`` accepts it.
"""

from __future__ import annotations

import collections
import io
import logging
import os
import sys
import threading
import time
import warnings
from types import FrameType
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError, CorruptCheckpointError
from ..stats import SaveStats
from .atomic_files import remove_stale_tmps, tmp_name, verify_torch_file, write_file
from .background_writer import BackgroundWriter
from .object_snapshot import HostCopy, Snapshotter
from .save_figures import SaveFigures

log = logging.getLogger("async_ckpt.integrations.lightning")

_bases: List[type] = []  # lightning.fabric's CheckpointIO and/or lightning_fabric's (distinct classes)
try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LCheckpointIO

    _bases.append(_LCheckpointIO)
except ImportError:  # pragma: no cover - only pytorch_lightning installed
    pass
try:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _PLCheckpointIO

    if _PLCheckpointIO not in _bases:
        _bases.append(_PLCheckpointIO)
except ImportError:
    pass
if not _bases:  # pragma: no cover
    raise ImportError("async_ckpt.integrations.lightning needs `lightning` or `pytorch_lightning` "
                      "(from a checkout of async_ckpt: pip install -e '.[lightning]')")


def _checkpoint_callbacks() -> Tuple[type, ...]:
    """Lightning's ``Checkpoint`` callback base classes (of either package)."""
    import importlib

    out: List[type] = []
    for mod in ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks"):
        try:
            out.append(importlib.import_module(mod).Checkpoint)
        except (ImportError, AttributeError):
            pass
    return tuple(out)


def _called_by_checkpoint_callback(depth: int = 40) -> bool:
    """Whether a ``Checkpoint`` callback's method is on the calling stack."""
    classes = _checkpoint_callbacks()
    frame: Optional[FrameType] = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if classes and isinstance(frame.f_locals.get("self"), classes):
            return True
        frame = frame.f_back
    return False


def _caller_of(modules: Tuple[str, ...], name: str, depth: int = 40) -> Any:
    """The nearest ``self`` on the calling stack (above our caller's caller) that is an instance of
    the class ``name`` of one of ``modules`` (Lightning's two packages), or None."""
    import importlib

    classes: List[type] = []
    for mod in modules:
        try:
            classes.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            pass
    frame: Optional[FrameType] = sys._getframe(3)
    for _ in range(depth):
        if frame is None or not classes:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, tuple(classes)):
            return obj
        frame = frame.f_back
    return None


def _outer_async_plugin() -> Any:
    """Lightning's own ``AsyncCheckpointIO`` (of either package) calling from its thread, or None."""
    return _caller_of(("lightning.pytorch.plugins.io", "pytorch_lightning.plugins.io"), "AsyncCheckpointIO")


def still_being_written() -> None:
    """What unpickling the placeholder of a checkpoint still being written calls.

    ``save_checkpoint`` takes a new name at the call with a small placeholder file (see the
    module docstring); ``torch.load(path, weights_only=False)`` of it, before the write commits,
    raises this error instead of an ``EOFError`` (with ``weights_only=True``, torch refuses the
    placeholder naming this function as an unsupported global).

    Raises:
        CheckpointError: always, naming ``wait()``.
    """
    raise CheckpointError(
        "this checkpoint file is AsyncCkptIO's placeholder: its write is still in flight in the "
        "background (or the process ended before it committed). Call wait() on the plugin "
        "(trainer.strategy.checkpoint_io.wait()) before reading it other than through the "
        "plugin's load_checkpoint, which waits by itself")


class _Placeholder:
    def __reduce__(self) -> Tuple[Any, ...]:
        return still_being_written, ()


def _placeholder_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save(_Placeholder(), buf)
    return buf.getvalue()


#: what a name taken for a write in flight holds until the write commits
PLACEHOLDER = _placeholder_bytes()


def _running(trainer: Any) -> bool:
    """Whether ``trainer`` is running a stage (``trainer.state.status`` is ``"running"``)."""
    status = getattr(getattr(trainer, "state", None), "status", None)
    return getattr(status, "value", status) == "running"


def _calling_trainer() -> Any:
    """The Lightning ``Trainer`` on the calling stack (its ``save_checkpoint``), or None."""
    return _caller_of(("lightning.pytorch", "pytorch_lightning"), "Trainer")


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


class UnsupportedOptionError(CheckpointError, TypeError):
    """An argument of the wrong kind (``storage_options`` that is not a dict of fsspec options)."""


class AsyncCkptIO(*_bases):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` whose saves return once the tensors are copied to host memory.

    Args:
        max_pending: saves queued or being written at most; the next ``save_checkpoint`` waits
            for the oldest one (bounds the host memory held by snapshots).
        memory_budget_bytes: bound on the host staging pool (``None``: the pool keeps what
            recent saves used, see :class:`~async_ckpt.staging.HostBufferPool`).
        fsync: fsync each file and its directory before the save counts as done.
        sync_explicit: a ``save_checkpoint`` not made by a ``Checkpoint`` callback (user code
            calling ``trainer.save_checkpoint``) returns once its file is committed.
        storage_options: fsspec filesystem options for remote paths (``gs://``, ``s3://``,
            ...), used by every save, load and removal; a ``save_checkpoint(...,
            storage_options=...)`` overrides them for that save.
        log_stats: log each save's figures to the ``Trainer``'s loggers (``trainer.loggers``:
            TensorBoard, CSV, W&B...) at its ``global_step``: ``checkpoint/blocking_s``,
            ``checkpoint/stage_s``, ``checkpoint/nbytes``, and the newest committed earlier
            save's ``checkpoint/durable_s`` and ``checkpoint/write_s`` (see
            :mod:`async_ckpt.integrations.save_figures`).

    ``stats`` holds a :class:`~async_ckpt.SaveStats` per save (``step`` is the checkpoint's
    ``global_step``; ``blocking_s``, ``queue_wait_s``, ``stage_s``, ``write_s``, ``commit_s``,
    ``durable_s``, ``commit_time``, ``nbytes``, ``num_tensors``; ``extra["path"]``, and
    ``extra["synchronous"]``: whether the call waited for the commit), the write's fields
    filled in by the writer as the save completes.

    Errors of a background write are raised as :class:`~async_ckpt.CheckpointError` by the
    next ``save_checkpoint``, ``load_checkpoint``, ``remove_checkpoint`` or by ``teardown``
    (which Lightning calls at the end of ``fit``/``validate``/...; it waits for every pending
    write first).

    ``remove_checkpoint`` (top-k rotation, replaced ``last`` files) waits for a pending write
    of that path before deleting it, and never deletes the most recently saved path.

    The plugin pickles (``strategy="ddp_spawn"`` sends it to the spawned processes;
    ``torch.save(trainer)`` saves it): the copy has the same settings, ``stats`` and newest
    path, and a new host buffer pool and writer of its own (the original's pending writes
    stay the original's).
    """

    def __init__(self, max_pending: int = 2, memory_budget_bytes: Optional[int] = None, fsync: bool = True,
                 sync_explicit: bool = True, storage_options: Optional[Dict[str, Any]] = None,
                 log_stats: bool = True) -> None:
        super().__init__()
        self.snapshotter = Snapshotter(memory_budget_bytes)
        self.writer = BackgroundWriter("async-ckpt-lightning", max_pending=max_pending)
        self.fsync = fsync
        self.sync_explicit = sync_explicit
        self.storage_options = self._check_options(storage_options, "AsyncCkptIO(storage_options=...)") or {}
        self.newest: Optional[str] = None  # the path saved last (never removed)
        self.saves = 0
        self.stats: Deque[SaveStats] = collections.deque(maxlen=1000)
        self.log_stats = log_stats
        self._figures = SaveFigures()
        self._filesystems: Dict[Tuple[str, str], Any] = {}
        self._fs_lock = threading.Lock()
        self._warned_nested = False

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_filesystems"] = {}  # made again on first use (a filesystem may hold a lock)
        del state["_fs_lock"]
        return state  # the snapshotter and the writer pickle as new ones

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._warned_nested = False
        self.__dict__.update(state)
        self._fs_lock = threading.Lock()

    @staticmethod
    def _check_options(options: Any, where: str) -> Optional[Dict[str, Any]]:
        if options is not None and not isinstance(options, dict):
            raise UnsupportedOptionError(
                f"{where}: storage_options must be a dict of fsspec filesystem options (for example "
                f"{{'token': ...}} for gs://, {{'key': ..., 'secret': ...}} for s3://), got "
                f"{type(options).__name__}")
        return options

    def filesystem(self, path: Any, storage_options: Optional[Dict[str, Any]] = None) -> Any:
        """The fsspec filesystem this plugin uses for ``path``.

        One instance per protocol and options, reused by every save, load and removal.

        Args:
            path: a local path or a URL (``gs://b/x.ckpt``).
            storage_options: fsspec options (default: the plugin's ``storage_options``).

        Returns:
            The fsspec filesystem.
        """
        options = self.storage_options if storage_options is None else storage_options
        path = os.fspath(path)
        protocol = path.split("://", 1)[0] if "://" in path else "file"
        key = (protocol, repr(sorted(options.items())))
        with self._fs_lock:
            fs = self._filesystems.get(key)
            if fs is None:
                import fsspec

                fs = self._filesystems[key] = fsspec.core.url_to_fs(path, **options)[0]
        return fs

    # ---- CheckpointIO -------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Optional[Any] = None) -> None:
        """Copy the tensors of ``checkpoint`` to host memory and write the file in the background.

        The file at ``path`` is written, fsynced and renamed into place by the writer thread;
        a ``path`` that does not exist is created as a placeholder before the call returns (see the
        module docstring).

        Args:
            checkpoint: Lightning's checkpoint dict.
            path: where the file goes (local path or fsspec URL).
            storage_options: fsspec filesystem options for this save (a dict; default: the
                plugin's ``storage_options``).

        Raises:
            UnsupportedOptionError: ``storage_options`` is not a dict.
            CheckpointError: a previous background write failed; for a save not made by a
                ``Checkpoint`` callback (with ``sync_explicit``), this write failed.
        """
        t0 = time.perf_counter()
        path = os.fspath(path)
        options = self._check_options(storage_options, f"{type(self).__name__}.save_checkpoint({path!r})")
        explicit = self.sync_explicit and not _called_by_checkpoint_callback()
        if _outer_async_plugin() is not None:
            explicit = True  # on the outer plugin's thread: its errors reach it through this call
            if not self._warned_nested:
                self._warned_nested = True
                warnings.warn(
                    "AsyncCkptIO is wrapped in Lightning's AsyncCheckpointIO, which makes its saves synchronous: "
                    "the outer plugin clones every tensor on the training thread and calls save_checkpoint "
                    "from its own thread, where AsyncCkptIO waits for each write to commit. AsyncCkptIO is "
                    "asynchronous by itself: pass it directly (Trainer(plugins=[AsyncCkptIO()])).",
                    UserWarning, stacklevel=2)
        self.writer.check()
        copy = self.snapshotter.take(checkpoint, what=f"checkpoint {path}")
        t1 = time.perf_counter()
        step = checkpoint.get("global_step", self.saves) if isinstance(checkpoint, dict) else self.saves
        stats = SaveStats(step=int(step) if isinstance(step, int) else self.saves, nbytes=copy.nbytes,
                          num_tensors=copy.num_tensors, files=1, stage_s=t1 - t0,
                          extra={"path": path, "synchronous": explicit})
        reserved = self._reserve(path, options)

        def dropped() -> None:
            copy.release()
            if reserved:
                self._unreserve(path, options)

        self.writer.submit(path, lambda: self._write(path, copy, options, stats, t0, reserved), on_drop=dropped)
        stats.queue_wait_s = time.perf_counter() - t1
        stats.blocking_s = time.perf_counter() - t0
        self.stats.append(stats)
        self.newest = path
        self.saves += 1
        if explicit:
            self.writer.wait(path)  # durable on return; raises this write's error
            stats.blocking_s = time.perf_counter() - t0
        trainer = _calling_trainer() if self.log_stats else None
        # only while the trainer runs (fit, validate, ...): a save outside a run logs nothing, so
        # a logger makes no directory of its own (a default TensorBoard logger: ./lightning_logs)
        if trainer is not None and trainer.loggers and _running(trainer):
            def sink(figures: Dict[str, float]) -> None:
                for logger in trainer.loggers:
                    logger.log_metrics(figures, step=trainer.global_step)

            self._figures.report(stats, self.stats, sink)

    def _reserve(self, path: str, options: Optional[Dict[str, Any]]) -> bool:
        """Take the name ``path`` with :data:`PLACEHOLDER` if nothing is there; whether it did."""
        try:
            if _is_local(path):
                local = _local(path)
                os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
                fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                try:
                    os.write(fd, PLACEHOLDER)
                finally:
                    os.close(fd)
                return True
            fs = self.filesystem(path, options)
            if fs.exists(path):
                return False
            parent = os.path.dirname(path)
            if parent and not parent.endswith("://"):
                fs.makedirs(parent, exist_ok=True)
            fs.pipe_file(path, PLACEHOLDER)
            return True
        except FileExistsError:
            return False
        except Exception as exc:  # noqa: BLE001 - the write fails too, and its error is raised
            log.debug("could not take the name %s before writing it: %s", path, exc)
            return False

    def _unreserve(self, path: str, options: Optional[Dict[str, Any]]) -> None:
        """Remove the placeholder :meth:`_reserve` made (a write of ``path`` failed)."""
        try:
            if _is_local(path):
                local = _local(path)
                if os.path.getsize(local) in (0, len(PLACEHOLDER)):
                    with open(local, "rb") as f:
                        if f.read() in (b"", PLACEHOLDER):
                            os.remove(local)
            else:
                fs = self.filesystem(path, options)
                if fs.exists(path) and fs.size(path) in (0, len(PLACEHOLDER)) and fs.cat_file(path) in (
                        b"", PLACEHOLDER):
                    fs.rm(path)
        except Exception as exc:  # noqa: BLE001 - the write's error is the one that matters
            log.warning("could not remove the placeholder %s left by its failed write: %s", path, exc)

    def _write(self, path: str, copy: HostCopy, options: Optional[Dict[str, Any]], stats: SaveStats,
               t0: float, reserved: bool) -> None:
        w0 = time.perf_counter()
        try:
            if _is_local(path):
                local = _local(path)
                remove_stale_tmps(local)
                write_file(local, copy.save, fsync=self.fsync)
                w1 = time.perf_counter()
            else:
                w1 = self._write_remote(path, copy, options)
        except BaseException:
            if reserved:
                self._unreserve(path, options)
            raise
        finally:
            copy.release()
        done = time.perf_counter()
        stats.write_s, stats.commit_s = w1 - w0, done - w1
        stats.durable_s, stats.commit_time = done - t0, time.time()
        log.debug("saved checkpoint %s", path)

    def _write_remote(self, path: str, copy: HostCopy, options: Optional[Dict[str, Any]]) -> float:
        """Write to a hidden temporary object next to ``path``, then move it into place: a
        failure mid-upload (whose partial object fsspec still publishes when the file is
        closed) never replaces the previous file. Returns when the data write ended."""
        fs = self.filesystem(path, options)
        tmp = tmp_name(path)
        parent = os.path.dirname(path)
        if parent and not parent.endswith("://"):
            fs.makedirs(parent, exist_ok=True)
        try:
            with fs.open(tmp, "wb") as f:
                copy.save(f)
            written = time.perf_counter()
            fs.mv(tmp, path)
        except BaseException:
            try:
                if fs.exists(tmp):
                    fs.rm(tmp)
            except Exception as exc:  # the error that matters is the write's
                log.warning("could not remove the temporary %s: %s", tmp, exc)
            raise
        return written

    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict:
        """Wait for a pending write of ``path``, check the file, and load it with ``torch.load``.

        Args:
            path: the file (local path or fsspec URL).
            map_location: passed to ``torch.load`` (default: tensors stay where they were saved
                from, as Lightning's ``TorchCheckpointIO`` loads them).
            weights_only: passed to ``torch.load``.

        Returns:
            The checkpoint dict.

        Raises:
            FileNotFoundError: there is no file at ``path`` (as Lightning's ``TorchCheckpointIO``).
            CorruptCheckpointError: the file is empty or a placeholder whose write never committed,
                its zip structure is incomplete or a
                record fails its CRC-32 check.
            CheckpointError: a background write failed.
        """
        path = os.fspath(path)
        self.writer.wait(path)
        self.writer.check()
        fs = self.filesystem(path)
        if not fs.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        with fs.open(path, "rb") as f:
            if fs.size(path) == len(PLACEHOLDER) and f.read() == PLACEHOLDER:
                raise CorruptCheckpointError(
                    f"{path}: the file is the placeholder AsyncCkptIO takes a name with; its write never "
                    f"committed (the process ended before it)")
            f.seek(0)
            verify_torch_file(f, path)
            return torch.load(f, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the file at ``path`` once no write of it is pending.

        The most recently saved path is kept (a warning says so).

        Args:
            path: the file (local path or fsspec URL).

        Raises:
            CheckpointError: a background write failed.
        """
        path = os.fspath(path)
        self.writer.check()
        if self.newest is not None and os.path.abspath(path) == os.path.abspath(self.newest):
            log.warning("not removing %s: it is the most recently saved checkpoint", path)
            return
        self.writer.wait(path)
        fs = self.filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
            log.debug("removed checkpoint %s", path)

    def teardown(self) -> None:
        """Wait for every pending write and end the writer thread.

        Raises:
            CheckpointError: a background write failed (the first error among them).
        """
        self.writer.wait_all(shutdown=True)

    # ---- extras -------------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for every pending write (without ending the writer thread).

        Raises:
            CheckpointError: a background write failed.
        """
        self.writer.wait_all()

    @property
    def pending(self) -> list:
        """Paths whose writes are queued or running."""
        return self.writer.pending()
