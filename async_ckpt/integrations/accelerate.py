"""Hugging Face Accelerate: :func:`attach` makes ``Accelerator.save_state()`` asynchronous.

``saver = attach(accelerator)``, once after ``accelerator.prepare(...)``; then
``accelerator.save_state(...)`` and ``accelerator.load_state(...)`` are used as before.

Accelerate's save hooks (``register_save_state_pre_hook``) run *inside* a synchronous
``save_state`` and cannot change what it writes or when, so :func:`attach` replaces that
instance's ``save_state`` and ``load_state`` instead (as the HF Trainer callback replaces
``_save_checkpoint``). ``save_state`` then:

1. at the call, as accelerate: applies ``total_limit`` (automatic naming: the oldest
   directories go, each after its pending write), makes the checkpoint directory and runs the
   registered save-state pre-hooks with it; collects everything accelerate's ``save_state``
   saves, in its order -- each model's ``get_state_dict(model, unwrap=False)``, the
   optimizers', schedulers' and gradient scaler's state dicts, the seedable samplers and
   stateful-dataloader states, the RNG states with ``accelerator.step`` and the
   ``register_for_checkpointing`` objects' state dicts -- and copies their tensors to pooled
   host buffers in one batched copy;
2. returns the checkpoint directory (as accelerate does), so training goes on after the copy;
3. in a writer thread, writes accelerate's own files (``model.safetensors`` /
   ``pytorch_model.bin``, ``optimizer.bin``, ``scheduler.bin``, ``sampler.bin``,
   ``dl_state_dict.bin``, ``scaler.pt``, ``random_states_0.pkl``, ``custom_checkpoint_N.pkl``;
   ``_i`` suffixes for further objects) with accelerate's own ``save`` into that directory,
   each committed by itself (:class:`~async_ckpt.storage.commit.FileCommit`: a hidden
   temporary name beside it, fsync, rename; then the directory is fsynced). Nothing else in
   the directory is touched: a user's files stay, a symbolic link to the directory is written
   through, and saving a directory again replaces only these files.

Until the write is done the directory holds the files of an earlier save of it, or not all
of them: read them through ``load_state`` (which waits) or after :meth:`AsyncSaveState.wait`.
A write that fails is raised by the next call; one still pending at interpreter exit is
finished, and a failure then is printed and makes the exit status non-zero.

``load_state`` waits for every pending write first and raises a background error. The files
are the ones accelerate writes, so a plain ``Accelerator`` (without :func:`attach`) loads them.

Runs whose ``save_state`` is collective or framework-specific -- several processes, FSDP,
DeepSpeed, Megatron-LM, PyTorch/XLA -- keep accelerate's synchronous ``save_state`` (after the
pending writes), with one warning.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import random
import re
import shutil
import time
from typing import Any, Deque, Dict, List, Optional

import numpy as np
import torch

from ..errors import CheckpointError
from ..stats import SaveStats
from ..storage.commit import FileCommit
from .background_writer import BackgroundWriter
from .object_snapshot import Snapshotter
from .save_figures import SaveFigures

log = logging.getLogger("async_ckpt.integrations.accelerate")


class AcceleratorAlreadyAttachedError(CheckpointError, ValueError):
    """:func:`attach` was called twice for one ``Accelerator``."""


def _suffixed(name: str, i: int) -> str:
    """accelerate's name of the i-th object's file: ``optimizer.bin``, ``optimizer_1.bin``."""
    if i == 0:
        return name
    stem, ext = os.path.splitext(name)
    return f"{stem}_{i}{ext}"


class AsyncSaveState:
    """The asynchronous ``save_state`` of one ``Accelerator`` (made by :func:`attach`).

    Args:
        accelerator: the ``accelerate.Accelerator`` whose ``save_state``/``load_state`` this
            object replaces.
        max_pending: checkpoints queued or being written at most; a ``save_state`` waits for
            the oldest when the bound is reached.
        memory_budget_bytes: bound on the host staging pool (``None``: the pool keeps what
            recent saves used).
        fsync: fsync the checkpoint directory once its files are committed (each file is
            always fsynced before its rename).
        log_stats: log each save's figures through ``accelerator.log`` (its trackers:
            TensorBoard, W&B, ...; nothing without ``init_trackers``) at the save's ``step``:
            ``checkpoint/blocking_s``, ``checkpoint/stage_s``, ``checkpoint/nbytes``, and the
            newest committed earlier save's ``checkpoint/durable_s`` and ``checkpoint/write_s``
            (see :mod:`async_ckpt.integrations.save_figures`).

    ``stats`` holds a :class:`~async_ckpt.SaveStats` per save: ``step`` is the save's
    iteration (accelerate's ``project_configuration.iteration``: 0, 1, ...; the number in an
    automatically named ``checkpoint_N``), ``blocking_s``, ``queue_wait_s``, ``stage_s``,
    ``nbytes``, ``num_tensors``, and once the checkpoint is committed ``write_s``,
    ``commit_s``, ``durable_s``, ``commit_time``, ``files`` and ``written_bytes``;
    ``extra["path"]`` is the checkpoint directory.
    """

    def __init__(self, accelerator: Any, max_pending: int = 2, memory_budget_bytes: Optional[int] = None,
                 fsync: bool = True, log_stats: bool = True) -> None:
        if getattr(accelerator, "_async_ckpt_saver", None) is not None:
            raise AcceleratorAlreadyAttachedError(
                "async_ckpt.integrations.accelerate.attach(): this Accelerator is attached already; "
                "use the object the first attach() returned")
        self.accelerator = accelerator
        self.snapshotter = Snapshotter(memory_budget_bytes)
        self.writer = BackgroundWriter("async-ckpt-accelerate", max_pending=max_pending)
        self.fsync = fsync
        self.stats: Deque[SaveStats] = collections.deque(maxlen=1000)
        self.log_stats = log_stats
        self._figures = SaveFigures()
        self._warned = False
        self._original_save = accelerator.save_state
        self._original_load = accelerator.load_state
        accelerator.save_state = self.save_state
        accelerator.load_state = self.load_state
        accelerator._async_ckpt_saver = self

    # ---- public ---------------------------------------------------------------------------------
    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """``Accelerator.save_state``, returning once the state is copied to host memory.

        Args:
            output_dir: the checkpoint directory (ignored with ``automatic_checkpoint_naming``,
                as in accelerate).
            safe_serialization: models as ``model.safetensors`` (``True``) or
                ``pytorch_model.bin``.
            **save_model_func_kwargs: passed to accelerate's own ``save_state`` where it is used
                (DeepSpeed and the other synchronous cases).

        Returns:
            The checkpoint directory, as accelerate returns it (made at the call; its files are
            all there once the write is done: :meth:`wait`).

        Raises:
            CheckpointError: a previous background write failed, or the state cannot be
                snapshotted (``InvalidStateDictError``).
            ValueError: as accelerate, for an automatically named directory that exists.
            TypeError: ``output_dir`` is None without ``automatic_checkpoint_naming``.
        """
        acc = self.accelerator
        t0 = time.perf_counter()
        self.writer.check()
        why = self._unsupported()
        if why is not None:
            if not self._warned:
                log.warning("%s: saving synchronously with accelerate's own save_state", why)
                self._warned = True
            self.writer.wait_all()
            return self._original_save(output_dir, safe_serialization=safe_serialization,
                                       **save_model_func_kwargs)
        cfg = acc.project_configuration
        if cfg.automatic_checkpoint_naming:
            parent = os.path.join(acc.project_dir, "checkpoints")
            os.makedirs(parent, exist_ok=True)
            self._apply_total_limit(parent, cfg.total_limit)
            output_dir = os.path.join(parent, f"checkpoint_{acc.save_iteration}")
            if os.path.exists(output_dir):
                raise ValueError(
                    f"Checkpoint directory {output_dir} ({acc.save_iteration}) already exists. Please manually "
                    "override `self.save_iteration` with what iteration to start with.")
        elif output_dir is None:
            raise TypeError("save_state() needs output_dir unless automatic_checkpoint_naming is on")
        output_dir = os.fspath(output_dir)
        final = os.path.abspath(os.path.expanduser(output_dir))
        self.writer.wait(final)  # the same directory saved again: its earlier write lands first
        # As accelerate: the directory exists at the call (its hooks and the caller may write
        # there); the files land in it one by one, each atomically, and nothing else there is touched.
        commit = FileCommit(final, fsync=self.fsync)
        commit.begin()

        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

        weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
        for hook in acc._save_model_state_pre_hook.values():
            hook(acc._models, weights, output_dir)  # as accelerate: hooks may write files or drop weights
        model_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
        files: List[Any] = []  # (file name, object, safetensors?)
        for i, sd in enumerate(weights):
            files.append((model_name.replace(".", f"_{i}.") if i else model_name, sd, safe_serialization))
        for i, opt in enumerate(acc._optimizers):
            files.append((_suffixed("optimizer.bin", i), opt.state_dict(), False))
        for i, sch in enumerate(acc._schedulers):
            files.append((_suffixed("scheduler.bin", i), sch.state_dict(), False))
        for i, dl in enumerate(acc._dataloaders):
            if isinstance(dl.dataset, IterableDatasetShard):
                sampler = dl.get_sampler()
                if isinstance(sampler, SeedableRandomSampler):
                    files.append((_suffixed("sampler.bin", i), sampler, False))
            if getattr(dl, "use_stateful_dataloader", False):
                files.append(("dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin", dl.state_dict(), None))
        if acc.scaler is not None:
            files.append(("scaler.pt", acc.scaler.state_dict(), None))
        files.append((f"random_states_{acc.state.process_index}.pkl", self._rng_states(), None))
        for i, obj in enumerate(acc._custom_objects):
            files.append((f"custom_checkpoint_{i}.pkl", obj.state_dict(), False))

        copy = self.snapshotter.take([f[1] for f in files], what=f"accelerate state {final}")
        t1 = time.perf_counter()
        stats = SaveStats(step=cfg.iteration, nbytes=copy.nbytes, num_tensors=copy.num_tensors, stage_s=t1 - t0,
                          extra={"path": final})
        names = [(f[0], f[2]) for f in files]
        save_on_each_node = cfg.save_on_each_node

        def job() -> None:
            from accelerate.utils import save

            w0 = time.perf_counter()
            try:
                objs = copy.materialize()
                for (name, safe), obj in zip(names, objs):
                    if safe is None:  # accelerate writes these with plain torch.save
                        commit.write(name, functools.partial(torch.save, obj))
                    else:
                        commit.write(name, functools.partial(save, obj, save_on_each_node=save_on_each_node,
                                                             safe_serialization=safe))
                del objs, obj
            finally:
                copy.release()
            w1 = time.perf_counter()
            commit.finish()
            done = time.perf_counter()
            stats.files, stats.written_bytes = len(commit.files), sum(commit.files.values())
            stats.write_s, stats.commit_s = w1 - w0, done - w1
            stats.durable_s, stats.commit_time = done - t0, time.time()
            log.debug("committed %s", final)

        self.writer.submit(final, job, on_drop=copy.release)
        stats.queue_wait_s = time.perf_counter() - t1
        stats.blocking_s = time.perf_counter() - t0
        self.stats.append(stats)
        if self.log_stats:
            self._figures.report(stats, self.stats, lambda figures: acc.log(figures, step=stats.step))
        cfg.iteration += 1
        return output_dir

    def load_state(self, input_dir: Optional[str] = None, **kwargs: Any) -> Any:
        """``Accelerator.load_state`` after every pending write is committed.

        Args:
            input_dir: the checkpoint directory (``None``: the newest automatically named one).
            **kwargs: passed to accelerate's ``load_state``.

        Returns:
            What accelerate's ``load_state`` returns.

        Raises:
            CheckpointError: a background write failed.
        """
        self.writer.wait_all()
        return self._original_load(input_dir, **kwargs)

    def wait(self) -> None:
        """Wait for every pending write; raise the first background error as ``CheckpointError``."""
        self.writer.wait_all()

    def close(self) -> None:
        """Wait for every pending write and give the accelerator its own methods back.

        Also ends the writer thread; ``save_state``/``load_state`` are accelerate's again.

        Raises:
            CheckpointError: a background write failed (the first error).
        """
        try:
            self.writer.wait_all(shutdown=True)
        finally:
            acc = self.accelerator
            acc.save_state = self._original_save
            acc.load_state = self._original_load
            acc._async_ckpt_saver = None

    @property
    def pending(self) -> List[str]:
        """Directories whose writes are queued or running."""
        return self.writer.pending()

    # ---- internals ------------------------------------------------------------------------------
    def _unsupported(self) -> Optional[str]:
        from accelerate.utils import DistributedType

        acc = self.accelerator
        kind = acc.distributed_type
        for name in ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"):
            if kind == getattr(DistributedType, name, None):
                return name
        if acc.num_processes > 1:
            return "several processes"
        return None

    def _rng_states(self) -> Dict[str, Any]:
        """What accelerate's ``save_accelerator_state`` saves as ``random_states_N.pkl``."""
        from accelerate.utils import (
            is_cuda_available,
            is_hpu_available,
            is_mlu_available,
            is_musa_available,
            is_xpu_available,
        )

        states: Dict[str, Any] = {
            "step": self.accelerator.step,
            "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
        }
        if is_xpu_available():
            states["torch_xpu_manual_seed"] = torch.xpu.get_rng_state_all()
        if is_mlu_available():
            states["torch_mlu_manual_seed"] = torch.mlu.get_rng_state_all()  # type: ignore[attr-defined]
        elif is_musa_available():
            states["torch_musa_manual_seed"] = torch.musa.get_rng_state_all()  # type: ignore[attr-defined]
        if is_hpu_available():
            states["torch_hpu_manual_seed"] = torch.hpu.get_rng_state_all()  # type: ignore[attr-defined]
        if is_cuda_available():
            states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
        return states

    def _apply_total_limit(self, parent: str, limit: Optional[int]) -> None:
        """accelerate's ``total_limit``, applied as accelerate does before a new automatically
        named save: the oldest directories in ``parent`` go (each after its pending write)."""
        folders = [os.path.join(parent, folder) for folder in os.listdir(parent)]
        if limit is None or len(folders) + 1 <= limit or not self.accelerator.is_main_process:
            return
        folders.sort(key=lambda folder: list(map(int, re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)))[0])
        log.warning("Deleting %d checkpoints to make room for new checkpoint.", len(folders) + 1 - limit)
        for folder in folders[: len(folders) + 1 - limit]:
            self.writer.wait(os.path.abspath(folder))
            shutil.rmtree(folder)

def attach(accelerator: Any, max_pending: int = 2, memory_budget_bytes: Optional[int] = None,
           fsync: bool = True, log_stats: bool = True) -> AsyncSaveState:
    """Make ``accelerator.save_state()`` asynchronous (and ``load_state()`` wait for it).

    Args:
        accelerator: an ``accelerate.Accelerator``, after ``prepare(...)`` or before (the
            objects it holds at each ``save_state`` are saved).
        max_pending: checkpoints queued or being written at most.
        memory_budget_bytes: bound on the host staging pool (``None``: unbounded).
        fsync: fsync the checkpoint directory once its files are committed (each file is
            always fsynced before its rename).
        log_stats: log each save's figures to the accelerator's trackers (see
            :class:`AsyncSaveState`).

    Returns:
        The :class:`AsyncSaveState`: ``wait()`` before reading a checkpoint outside
        ``load_state``, ``close()`` at the end (waits, and raises a background error).

    Raises:
        AcceleratorAlreadyAttachedError: ``accelerator`` is attached already.
    """
    return AsyncSaveState(accelerator, max_pending=max_pending, memory_budget_bytes=memory_budget_bytes,
                          fsync=fsync, log_stats=log_stats)
