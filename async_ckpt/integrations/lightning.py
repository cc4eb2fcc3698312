"""PyTorch Lightning: :class:`AsyncCkptIO`, a ``CheckpointIO`` plugin that saves in the background.

``Trainer(plugins=[AsyncCkptIO()])``. Each ``save_checkpoint`` copies the tensors of
Lightning's checkpoint dict into reused host buffers (see
:class:`~async_ckpt.integrations._snapshot.Snapshotter`) and returns; a writer thread then
writes the file at ``path`` in ``torch.save`` format to a hidden temporary name, fsyncs it and
renames it into place. ``path`` is therefore always absent, the previous complete file, or the
new complete file, and plain ``torch.load`` / ``LightningModule.load_from_checkpoint`` read it
without the plugin. ``load_checkpoint`` first waits for a pending write of that path, then
checks the file (zip structure and the CRC-32 of every record) before loading it.

The class subclasses the ``CheckpointIO`` of ``lightning`` and, where it is installed, of
``pytorch_lightning`` (``lightning_fabric``) too, so either package's ``Trainer`` accepts it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Optional

import torch

from ..errors import CheckpointError
from ._snapshot import BackgroundWriter, HostCopy, Snapshotter, remove_stale_tmps, verify_torch_file, write_file

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
                      "(pip install 'async_ckpt[lightning]')")


def _filesystem(path: str) -> Any:
    try:
        from lightning.fabric.utilities.cloud_io import get_filesystem
    except ImportError:  # pragma: no cover
        from lightning_fabric.utilities.cloud_io import get_filesystem
    return get_filesystem(path)


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


class UnsupportedOptionError(CheckpointError, TypeError):
    """An argument that :class:`AsyncCkptIO` does not support (``storage_options``)."""


class AsyncCkptIO(*_bases):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` whose saves return once the tensors are copied to host memory.

    Args:
        max_pending: saves queued or being written at most; the next ``save_checkpoint`` waits
            for the oldest one (bounds the host memory held by snapshots).
        memory_budget_bytes: bound on the host staging pool (``None``: the pool keeps what
            recent saves used, see :class:`~async_ckpt.staging.HostBufferPool`).
        fsync: fsync each file and its directory before the save counts as done.

    Errors of a background write are raised as :class:`~async_ckpt.CheckpointError` by the
    next ``save_checkpoint``, ``load_checkpoint``, ``remove_checkpoint`` or by ``teardown``
    (which Lightning calls at the end of ``fit``/``validate``/...; it waits for every pending
    write first).

    ``remove_checkpoint`` (top-k rotation, replaced ``last`` files) waits for a pending write
    of that path before deleting it, and never deletes the most recently saved path.
    """

    def __init__(self, max_pending: int = 2, memory_budget_bytes: Optional[int] = None, fsync: bool = True) -> None:
        super().__init__()
        self.snapshotter = Snapshotter(memory_budget_bytes)
        self.writer = BackgroundWriter("async-ckpt-lightning", max_pending=max_pending)
        self.fsync = fsync
        self.newest: Optional[str] = None  # the path saved last (never removed)
        self.saves = 0

    # ---- CheckpointIO -------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Optional[Any] = None) -> None:
        """Copy the tensors of ``checkpoint`` to host memory and return; the file at ``path`` is
        written, fsynced and renamed into place in the background."""
        if storage_options is not None:
            raise UnsupportedOptionError(
                f"{type(self).__name__}.save_checkpoint({str(path)!r}): storage_options is not supported "
                f"(got {type(storage_options).__name__})")
        path = os.fspath(path)
        self.writer.check()
        copy = self.snapshotter.take(checkpoint, what=f"checkpoint {path}")
        self.writer.submit(path, lambda: self._write(path, copy), on_drop=copy.release)
        self.newest = path
        self.saves += 1

    def _write(self, path: str, copy: HostCopy) -> None:
        try:
            obj = copy.materialize()
            if _is_local(path):
                local = _local(path)
                remove_stale_tmps(local)
                write_file(local, lambda f: torch.save(obj, f), fsync=self.fsync)
            else:  # object stores publish an object only when its upload completes
                fs = _filesystem(path)
                fs.makedirs(os.path.dirname(path), exist_ok=True)
                with fs.open(path, "wb") as f:
                    torch.save(obj, f)
            obj = None  # the materialised copy goes before the buffers are released
        finally:
            copy.release()
        log.debug("saved checkpoint %s", path)

    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict:
        """Wait for a pending write of ``path``, check the file, and load it with ``torch.load``.

        Raises ``FileNotFoundError`` for a missing file (as Lightning's ``TorchCheckpointIO``)
        and :class:`~async_ckpt.CorruptCheckpointError` for a damaged one."""
        path = os.fspath(path)
        self.writer.wait(path)
        self.writer.check()
        fs = _filesystem(path)
        if not fs.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        with fs.open(path, "rb") as f:
            verify_torch_file(f, path)
            return torch.load(f, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the file at ``path`` once no write of it is pending; the most recently saved
        path is kept (a warning says so)."""
        path = os.fspath(path)
        self.writer.check()
        if self.newest is not None and os.path.abspath(path) == os.path.abspath(self.newest):
            log.warning("not removing %s: it is the most recently saved checkpoint", path)
            return
        self.writer.wait(path)
        fs = _filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
            log.debug("removed checkpoint %s", path)

    def teardown(self) -> None:
        """Wait for every pending write; raise the first error among them."""
        self.writer.wait_all(shutdown=True)

    # ---- extras -------------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for every pending write (without ending the writer thread); raise errors."""
        self.writer.wait_all()

    @property
    def pending(self) -> list:
        """Paths whose writes are queued or running."""
        return self.writer.pending()
