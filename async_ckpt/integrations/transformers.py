"""Hugging Face ``Trainer``: :class:`AsyncCkptCallback` makes its checkpoint saves asynchronous.

``Trainer(..., callbacks=[AsyncCkptCallback()])``. The callback finds the ``Trainer`` it was
given to (from the calling frame of its first event) and replaces that instance's
``_save_checkpoint`` -- the method the training loop calls at every save step, after the
evaluation and the best-metric bookkeeping of that step -- with one that:

1. does, at the call, everything that reads live training state: the model, optimizer,
   scheduler and gradient-scaler state dicts and the RNG states (as ``_save_rng_state``
   collects them) are snapshotted to pooled host buffers in one batched copy; the
   ``TrainerState`` (stateful callbacks updated as HF does) is rendered to its JSON text and
   the ``TrainingArguments`` to their ``torch.save`` bytes;
2. returns, so training resumes after the host copy;
3. in a writer thread, writes HF's own layout into a hidden ``.checkpoint-N.async-ckpt-tmp``
   directory in HF's order -- ``model.safetensors`` (and ``config.json``,
   ``generation_config.json``) through the model's own ``save_pretrained``, the tokenizer /
   processor, ``training_args.bin``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``,
   ``rng_state.pth``, and ``trainer_state.json`` last -- fsyncs every file, renames the
   directory to ``checkpoint-N`` and fsyncs the output directory; then applies HF's own
   ``rotate_checkpoints`` (``save_total_limit``, keeping the newest and the best checkpoint).

A directory in flight is hidden (its name starts with ``.``), so neither HF's rotation nor
``get_last_checkpoint`` (``resume_from_checkpoint=True``) ever sees one. All pending writes are
waited for before the trainer's end-of-training steps (``load_best_model_at_end``, the
``save_total_limit=1`` clean-up) and at ``on_train_end``, which raises a background error.

Several processes (DDP, or any ``torch.distributed`` run that HF saves from its ``should_save``
process): the save step does, on every rank, what needs the group -- ``store_flos`` (a
collective), a barrier once the writer has created the hidden directory, each rank's
``rng_state_{process_index}.pth`` written into it (a few KB, synchronously, fsynced), a second
barrier -- and only the writer snapshots the model, optimizer and scheduler and writes them in
the background, renaming the directory once everything is in it. The waits at the end of
training are followed by a barrier, so no rank goes on before the writer has committed.

PEFT models are written through ``PeftModel.save_pretrained`` (``adapter_model.safetensors`` and
``adapter_config.json``), as HF does.

Configurations whose saves are collective inside the save itself or framework-specific fall back
to HF's own synchronous ``_save_checkpoint`` (after the pending writes), with one warning:
DeepSpeed and FSDP (their ``save_*`` gathers or writes shards on every rank through the
framework's own collectives, in accelerate's FSDP layout; HF's Trainer runs FSDP only on
accelerators -- on CPU it rejects ``fsdp`` or, with ``use_cpu=True``, trains as DDP, which is
then saved asynchronously), tensor-parallel loading, SageMaker MP,
PyTorch/XLA, several processes without ``torch.distributed``, and ``push_to_hub``.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import logging
import os
import random
import shutil
import sys
import threading
import time
from types import FrameType
from typing import Any, Deque, Dict, Optional, cast

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from ..errors import CheckpointError
from ..stats import SaveStats
from .atomic_files import TMP_SUFFIX, fsync_dir, fsync_tree
from .background_writer import BackgroundWriter
from .object_snapshot import HostCopy, Snapshotter
from .save_figures import SaveFigures

log = logging.getLogger("async_ckpt.integrations.transformers")

PREFIX = "checkpoint"
TRAINING_ARGS_NAME = "training_args.bin"
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
RNG_NAME = "rng_state.pth"


class AsyncCkptCallback(TrainerCallback):
    """A ``TrainerCallback`` that turns the Trainer's checkpoint saves into background writes.

    Args:
        max_pending: checkpoints queued or being written at most; a save step waits for the
            oldest when the bound is reached.
        memory_budget_bytes: bound on the host staging pool (``None``: the pool keeps what
            recent saves used).
        fsync: fsync every file and directory before a checkpoint counts as committed.
        log_stats: log each save's figures through the ``Trainer``'s ``log()`` (so its
            TensorBoard, W&B... callbacks and ``state.log_history`` get them):
            ``checkpoint/blocking_s``, ``checkpoint/stage_s``, ``checkpoint/nbytes``, and the
            newest committed earlier save's ``checkpoint/durable_s`` and ``checkpoint/write_s``
            (see :mod:`async_ckpt.integrations.save_figures`).

    ``stats`` holds a :class:`~async_ckpt.SaveStats` per save (``step`` is the
    ``global_step``; ``blocking_s``, ``queue_wait_s``, ``stage_s``, ``nbytes``,
    ``num_tensors``, and once the checkpoint is committed ``write_s``, ``commit_s``,
    ``durable_s``, ``commit_time``, ``files`` and ``written_bytes``; ``extra["path"]``). With
    several processes a rank that writes nothing records its part of the stall (``nbytes`` 0,
    ``extra["writer"]`` False).

    The callback pickles: the copy has the same settings and ``stats``, a new host buffer pool
    and writer of its own, and binds to the trainer it finds at its first event.
    """

    def __init__(self, max_pending: int = 2, memory_budget_bytes: Optional[int] = None, fsync: bool = True,
                 log_stats: bool = True) -> None:
        self.snapshotter = Snapshotter(memory_budget_bytes)
        self.writer = BackgroundWriter("async-ckpt-hf", max_pending=max_pending)
        self.fsync = fsync
        self.trainer: Optional[Trainer] = None
        self.stats: Deque[SaveStats] = collections.deque(maxlen=1000)
        self.log_stats = log_stats
        self._figures = SaveFigures()
        self._warned = False
        self._lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        state["trainer"] = None  # the copy binds again (the trainer's patched method is this one's)
        return state  # the snapshotter and the writer pickle as new ones

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ---- finding and patching the trainer -------------------------------------------------------
    def _bind(self) -> None:
        if self.trainer is not None:
            return
        frame: Optional[FrameType] = sys._getframe(2)
        for _ in range(12):
            if frame is None:
                break
            obj = frame.f_locals.get("self")
            if isinstance(obj, Trainer):
                self.attach(obj)
                return
            frame = frame.f_back
        raise CheckpointError("AsyncCkptCallback: could not find the Trainer it was added to; "
                              "call callback.attach(trainer)")

    def attach(self, trainer: Trainer) -> None:
        """Bind to ``trainer``: its ``_save_checkpoint`` becomes the asynchronous save.

        Done automatically at the first event; a no-op for the trainer bound already.

        Args:
            trainer: the HF ``Trainer`` this callback was added to.
        """
        if self.trainer is trainer:
            return
        self.trainer = trainer
        original = trainer._save_checkpoint

        def _save_checkpoint(model: Any, trial: Any) -> None:
            self._save(trainer, original, model, trial)

        trainer._save_checkpoint = _save_checkpoint  # type: ignore[method-assign]

    def on_init_end(self, args, state, control, **kwargs):
        """Bind to the ``Trainer`` that is calling (found from the calling frames).

        Args:
            args: the ``TrainingArguments``.
            state: the ``TrainerState``.
            control: the ``TrainerControl``.
            **kwargs: the other objects HF passes to callbacks.

        Raises:
            CheckpointError: the calling ``Trainer`` cannot be found (call :meth:`attach`).
        """
        self._bind()

    def on_train_begin(self, args, state, control, **kwargs):
        """Bind to the calling ``Trainer`` if not bound yet; raise an earlier background error.

        Args:
            args: the ``TrainingArguments``.
            state: the ``TrainerState``.
            control: the ``TrainerControl``.
            **kwargs: the other objects HF passes to callbacks.

        Raises:
            CheckpointError: a background write failed, or the ``Trainer`` cannot be found.
        """
        self._bind()
        self.writer.check()

    def on_log(self, args, state, control, logs=None, **kwargs):
        """At the final log of training, wait for every pending write.

        The final log holds ``train_runtime``; with several processes a barrier follows.

        Args:
            args: the ``TrainingArguments``.
            state: the ``TrainerState``.
            control: the ``TrainerControl``.
            logs: the logged values.
            **kwargs: the other objects HF passes to callbacks.

        Raises:
            CheckpointError: a background write failed.
        """
        # The final log (train_runtime, train_loss) comes right before load_best_model_at_end
        # and the save_total_limit=1 clean-up: every checkpoint must be committed by then.
        if logs and "train_runtime" in logs:
            self._end_barrier(self.trainer)

    def on_train_end(self, args, state, control, **kwargs):
        """Wait for every pending write and end the writer thread.

        With several processes a barrier follows.

        Args:
            args: the ``TrainingArguments``.
            state: the ``TrainerState``.
            control: the ``TrainerControl``.
            **kwargs: the other objects HF passes to callbacks.

        Raises:
            CheckpointError: a background write failed.
        """
        self._end_barrier(self.trainer, shutdown=True)

    def wait(self) -> None:
        """Wait for every pending write.

        Raises:
            CheckpointError: a background write failed (the first error).
        """
        self.writer.wait_all()

    # ---- the save ---------------------------------------------------------------------------
    def _unsupported(self, trainer: Trainer) -> Optional[str]:
        from transformers.utils import is_torch_xla_available

        args = trainer.args
        if getattr(trainer, "is_deepspeed_enabled", False):
            return "DeepSpeed"
        if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
            return "FSDP"
        if is_torch_xla_available():
            return "PyTorch/XLA"
        if getattr(trainer, "is_distributed_loading_by_transformers", False):
            return "tensor-parallel loading"
        if args.world_size > 1 and not self._distributed(trainer):
            return "several processes without torch.distributed"
        if args.push_to_hub:
            return "push_to_hub"
        try:
            from transformers.utils import is_sagemaker_mp_enabled

            if is_sagemaker_mp_enabled():
                return "SageMaker MP"
        except ImportError:  # pragma: no cover
            pass
        return None

    @staticmethod
    def _distributed(trainer: Trainer) -> bool:
        """Whether the run has several processes in an initialised ``torch.distributed`` group."""
        from transformers.training_args import ParallelMode

        return (trainer.args.world_size > 1 and trainer.args.parallel_mode == ParallelMode.DISTRIBUTED
                and torch.distributed.is_available() and torch.distributed.is_initialized())

    def _end_barrier(self, trainer: Optional[Trainer], shutdown: bool = False) -> None:
        """Wait for the pending writes, then (several processes) for every rank to get here, so
        that none reads a checkpoint the writer has not committed; raise a write error after."""
        error: Optional[BaseException] = None
        try:
            self.writer.wait_all(shutdown=shutdown)
        except BaseException as exc:  # the other ranks still need this rank at the barrier
            error = exc
        if trainer is not None and self._distributed(trainer):
            torch.distributed.barrier()
        if error is not None:
            raise error

    def _save(self, trainer: Trainer, original: Any, model: Any, trial: Any) -> None:
        t0 = time.perf_counter()
        self.writer.check()
        why = self._unsupported(trainer)
        if why is not None:
            if not self._warned:
                log.warning("AsyncCkptCallback: %s: saving synchronously with the Trainer's own save", why)
                self._warned = True
            self.writer.wait_all()
            original(model, trial)
            return
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import SaveStrategy

        args, state = trainer.args, trainer.state
        folder = f"{PREFIX}-{state.global_step}"
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()  # a collective under DDP: every rank, as HF does
        run_dir = trainer._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, folder)
        tmp = os.path.join(run_dir, f".{folder}{TMP_SUFFIX}")
        multi = self._distributed(trainer)
        writes = args.should_save

        if multi:
            # The same step saved again: its hidden directory is reused, so its write goes first.
            self.writer.wait(output_dir)
            if writes:
                if os.path.lexists(tmp):
                    shutil.rmtree(tmp)  # left by an interrupted write
                os.makedirs(tmp)
            torch.distributed.barrier()  # the directory exists for every rank

        if args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST] and state.best_global_step:
            best = f"{PREFIX}-{state.best_global_step}"
            best_dir = os.path.join(run_dir, best)
            # HF checks that the directory exists after writing this step's model: the current
            # one, a committed one, or one still being written all count (a rank that does not
            # write sees the writer's hidden directory: checked before the final name, which a
            # rename in between makes exist).
            if (best_dir == output_dir or self.writer.pending(best_dir)
                    or os.path.exists(os.path.join(run_dir, f".{best}{TMP_SUFFIX}")) or os.path.exists(best_dir)):
                state.best_model_checkpoint = best_dir

        if multi and not args.save_only_model:
            # Each rank's RNG state, as HF names it; small, so written here (fsynced).
            rng_path = os.path.join(tmp, f"rng_state_{args.process_index}.pth")
            with open(rng_path, "wb") as f:
                torch.save(self._rng_states(trainer), f)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        if multi:
            torch.distributed.barrier()  # every rank's file is in the directory
            if not writes:
                took = time.perf_counter() - t0
                self._record(trainer, SaveStats(step=state.global_step, blocking_s=took, stage_s=took,
                                                extra={"path": output_dir, "writer": False}))
                return

        unwrapped = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
        # transformers types these Optional; a Trainer that is saving has all three.
        payload: Dict[str, Any] = {"model": cast(torch.nn.Module, trainer.model).state_dict()}
        if not args.save_only_model:
            payload["optimizer"] = cast(torch.optim.Optimizer, trainer.optimizer).state_dict()
            payload["scheduler"] = cast(torch.optim.lr_scheduler.LRScheduler, trainer.lr_scheduler).state_dict()
            scaler = getattr(trainer.accelerator, "scaler", None)
            if scaler is not None:
                payload["scaler"] = scaler.state_dict()
            if not multi:
                payload["rng"] = self._rng_states(trainer)

        for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            # transformers annotates a list; TrainerState.__post_init__ makes it a dict by name.
            stateful = cast(Dict[str, Any], state.stateful_callbacks)
            if isinstance(stateful[name], list):
                stateful[name].append(cb.state())
            else:
                stateful[name] = cb.state()
        state_json = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"
        args_bytes = io.BytesIO()
        torch.save(args, args_bytes)

        copy = self.snapshotter.take(payload, what=f"checkpoint {output_dir}")
        t1 = time.perf_counter()
        stats = SaveStats(step=state.global_step, nbytes=copy.nbytes, num_tensors=copy.num_tensors, stage_s=t1 - t0,
                          extra={"path": output_dir})
        job = _Job(self, trainer, unwrapped, run_dir, output_dir, copy, state_json, args_bytes.getvalue(),
                   best=state.best_model_checkpoint, limit=args.save_total_limit, prepared=multi, stats=stats, t0=t0)
        self.writer.submit(output_dir, job.run, on_drop=copy.release)
        stats.queue_wait_s = time.perf_counter() - t1
        stats.blocking_s = time.perf_counter() - t0
        self._record(trainer, stats)

    def _record(self, trainer: Trainer, stats: SaveStats) -> None:
        """Keep a save's statistics; log its figures through the Trainer's ``log()``."""
        self.stats.append(stats)
        if self.log_stats:
            self._figures.report(stats, self.stats, trainer.log)

    @staticmethod
    def _rng_states(trainer: Trainer) -> Dict[str, Any]:
        """What ``Trainer._save_rng_state`` saves."""
        states: Dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state(),
        }
        from transformers.training_args import ParallelMode

        every = trainer.args.parallel_mode == ParallelMode.DISTRIBUTED  # HF saves all devices' states then
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.random.get_rng_state_all() if every else torch.cuda.random.get_rng_state()
        for name in ("npu", "hpu", "mlu", "musa"):
            mod = getattr(torch, name, None)
            if mod is not None and getattr(mod, "is_available", lambda: False)():
                src = mod.random if hasattr(mod, "random") else mod
                states[name] = src.get_rng_state_all() if every else src.get_rng_state()
        return states


class _Job:
    """One checkpoint's background write (see the module docstring for the order)."""

    def __init__(self, cb: AsyncCkptCallback, trainer: Trainer, model: Any, run_dir: str, output_dir: str,
                 copy: HostCopy, state_json: str, args_bytes: bytes, best: Optional[str], limit: Optional[int],
                 prepared: bool = False, stats: Optional[SaveStats] = None, t0: float = 0.0) -> None:
        self.cb, self.trainer, self.model = cb, trainer, model
        self.stats, self.t0 = stats, t0
        self.prepared = prepared  # the hidden directory exists already (the other ranks' files are in it)
        self.run_dir, self.output_dir = run_dir, output_dir
        self.copy, self.state_json, self.args_bytes = copy, state_json, args_bytes
        self.best, self.limit = best, limit

    def run(self) -> None:
        from transformers import PreTrainedModel
        from transformers.trainer_utils import rotate_checkpoints

        supported: tuple = (PreTrainedModel,)
        try:
            from peft import PeftModel

            supported = (PreTrainedModel, PeftModel)
        except ImportError:
            pass

        name = os.path.basename(self.output_dir)
        tmp = os.path.join(self.run_dir, f".{name}{TMP_SUFFIX}")
        w0 = time.perf_counter()
        try:
            if not self.prepared:
                if os.path.lexists(tmp):
                    shutil.rmtree(tmp)  # left by an interrupted write
                os.makedirs(tmp)
            obj = self.copy.materialize()
            if isinstance(self.model, supported):
                self.model.save_pretrained(tmp, state_dict=obj["model"])
            else:
                import safetensors.torch

                safetensors.torch.save_file(obj["model"], os.path.join(tmp, "model.safetensors"),
                                            metadata={"format": "pt"})
            tr = self.trainer
            if tr.processing_class is not None:
                tr.processing_class.save_pretrained(tmp)
            elif (tokenizer := getattr(tr.data_collator, "tokenizer", None)) is not None:
                tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, TRAINING_ARGS_NAME), "wb") as f:
                f.write(self.args_bytes)
            for key, fname in (("optimizer", OPTIMIZER_NAME), ("scheduler", SCHEDULER_NAME),
                               ("scaler", SCALER_NAME), ("rng", RNG_NAME)):
                if key in obj:
                    torch.save(obj[key], os.path.join(tmp, fname))
            del obj
        finally:
            self.copy.release()
        with open(os.path.join(tmp, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(self.state_json)
        w1 = time.perf_counter()
        if self.cb.fsync:
            fsync_tree(tmp)
        old = None
        if os.path.lexists(self.output_dir):  # the same step saved again: replace it
            old = os.path.join(self.run_dir, f".{name}.old{TMP_SUFFIX}")
            if os.path.lexists(old):
                shutil.rmtree(old)
            os.rename(self.output_dir, old)
        os.rename(tmp, self.output_dir)
        if self.cb.fsync:
            fsync_dir(self.run_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        done = time.perf_counter()
        if self.stats is not None:
            st = self.stats
            files = [e for e in os.scandir(self.output_dir) if e.is_file(follow_symlinks=False)]
            st.files, st.written_bytes = len(files), sum(e.stat(follow_symlinks=False).st_size for e in files)
            st.write_s, st.commit_s = w1 - w0, done - w1
            st.durable_s, st.commit_time = done - self.t0, time.time()
        rotate_checkpoints(output_dir=self.run_dir, save_total_limit=self.limit,
                           best_model_checkpoint=self.best, use_mtime=True)
        log.debug("committed %s", self.output_dir)
