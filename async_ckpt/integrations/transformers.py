"""Hugging Face ``Trainer``: :class:`AsyncCkptCallback` makes its checkpoint saves asynchronous.

``Trainer(..., callbacks=[AsyncCkptCallback()])``. The callback finds the ``Trainer`` it was
given to (from the calling frame of its first event) and replaces that instance's
``_save_checkpoint`` -- the method the training loop calls at every save step, after the
evaluation and the best-metric bookkeeping of that step -- with one that:

1. does, at the call, everything that reads live training state: the model, optimizer,
   scheduler and gradient-scaler state dicts and the RNG states (as ``_save_rng_state``
   collects them) are snapshotted to pooled host buffers in one batched copy; the
   ``TrainerState`` (stateful callbacks updated as HF does) is rendered to its JSON text and
   the ``TrainingArguments`` to their ``torch.save`` bytes; as HF, ``checkpoint-N`` exists
   when the call returns (an ``on_save`` callback writes into it);
2. returns, so training resumes after the host copy;
3. in a writer thread, writes HF's own files into ``checkpoint-N`` in HF's order --
   ``model.safetensors`` (and ``config.json``, ``generation_config.json``) through the model's
   own ``save_pretrained``, the tokenizer / processor, ``training_args.bin``,
   ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state.pth``, and
   ``trainer_state.json`` last -- each committed by itself
   (:class:`~async_ckpt.storage.commit.FileCommit`: a hidden temporary name beside it, fsync,
   rename; then the directory is fsynced); then applies HF's ``save_total_limit`` rotation
   (keeping the newest and the best checkpoint) to the committed checkpoints.

Nothing else in ``checkpoint-N`` is touched: what an ``on_save`` callback wrote there stays,
and saving a step again replaces only these files. A checkpoint whose write is pending is
never counted nor removed by the rotation. All pending writes are waited for before the
trainer's end-of-training steps (``load_best_model_at_end``, the ``save_total_limit=1``
clean-up) and at ``on_train_end``, which raises a background error; one still pending at
interpreter exit is finished, and a failure then is printed and makes the exit status
non-zero.

A ``Trainer`` subclass that overrides a method of the save (``_save_checkpoint``,
``save_model``, ``_save``, ``_save_optimizer_and_scheduler``, ``_save_scaler``,
``_save_rng_state``) keeps HF's synchronous save, which calls its override, with one warning
naming it. The figures of each save (``log_stats``) go to the reporting callbacks only
(``report_to``: TensorBoard, W&B, ...), never into ``state.log_history``.

Several processes (DDP, or any ``torch.distributed`` run that HF saves from its ``should_save``
process): the save step does, on every rank, what needs the group -- ``store_flos`` (a
collective), a barrier once the writer has made ``checkpoint-N``, each rank's
``rng_state_{process_index}.pth`` written into it (a few KB, synchronously, fsynced), a second
barrier -- and only the writer snapshots the model, optimizer and scheduler and writes them in
the background. The waits at the end of training are followed by a barrier, so no rank goes
on before the writer has committed.

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
import functools
import io
import json
import logging
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Deque, Dict, Optional, cast

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from ..errors import CheckpointError
from ..stats import SaveStats
from ..storage.commit import FileCommit
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
        fsync: fsync the checkpoint directory once its files are committed (each file is
            always fsynced before its rename).
        log_stats: send each save's figures to the Trainer's reporting callbacks (``report_to``:
            TensorBoard, W&B, ...; not into ``state.log_history``, so the checkpointed state
            is the one a run without this callback has): ``checkpoint/blocking_s``,
            ``checkpoint/stage_s``, ``checkpoint/nbytes``, and the newest committed earlier
            save's ``checkpoint/durable_s`` and ``checkpoint/write_s`` (see
            :mod:`async_ckpt.integrations.save_figures`).

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
        #: checkpoint directories a save step has made and not yet queued (under ``_lock``)
        self._saving: set = set()

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_saving"] = set()
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

        Its ``_load_from_checkpoint`` (a resume) then first waits for the pending writes. A
        subclass that overrides a method of the save keeps HF's own save (one warning).

        Done automatically at the first event; a no-op for the trainer bound already.

        Args:
            trainer: the HF ``Trainer`` this callback was added to.
        """
        if self.trainer is trainer:
            return
        self.trainer = trainer
        overrides = _save_overrides(type(trainer))
        if overrides:
            # The subclass's own save must run: HF's synchronous save (which calls it) is kept.
            log.warning("AsyncCkptCallback: %s overrides the Trainer's %s; its checkpoints are saved "
                        "synchronously by its own code (async_ckpt cannot stage what the override writes)",
                        type(trainer).__qualname__, ", ".join(overrides))
            return
        original = trainer._save_checkpoint

        def _save_checkpoint(model: Any, trial: Any) -> None:
            self._save(trainer, original, model, trial)

        trainer._save_checkpoint = _save_checkpoint  # type: ignore[method-assign]
        if getattr(type(trainer), "_load_from_checkpoint", None) is getattr(Trainer, "_load_from_checkpoint", None):
            load = trainer._load_from_checkpoint

            def _load_from_checkpoint(*args: Any, **kwargs: Any) -> Any:
                self.writer.wait_all()  # a resume reads what we may still be writing
                return load(*args, **kwargs)

            trainer._load_from_checkpoint = _load_from_checkpoint  # type: ignore[method-assign]

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
        multi = self._distributed(trainer)
        writes = args.should_save

        # The same step saved again: its earlier write lands first. As HF, the directory
        # exists at the call (an ``on_save`` callback writes into it); the files land in it
        # one by one, each atomically, and nothing else there is touched.
        self.writer.wait(os.path.abspath(output_dir))
        commit = FileCommit(output_dir, fsync=self.fsync)
        # Not yet queued, so not pending: the rotation after an earlier write must neither count
        # this directory (made now) as a checkpoint nor remove it.
        with self._lock:
            self._saving.add(commit.directory)
        try:
            if writes or multi:
                commit.begin()
            if multi:
                torch.distributed.barrier()  # the directory exists for every rank

            if args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST] and state.best_global_step:
                best_dir = os.path.join(run_dir, f"{PREFIX}-{state.best_global_step}")
                if os.path.exists(best_dir):  # as HF (the directory is made at the call)
                    state.best_model_checkpoint = best_dir

            if multi and not args.save_only_model:
                # Each rank's RNG state, as HF names it; small, so written here.
                rng = self._rng_states(trainer)
                commit.write(f"rng_state_{args.process_index}.pth", lambda tmp: torch.save(rng, tmp))
                commit.finish()
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
            job = _Job(self, trainer, unwrapped, run_dir, commit, copy, state_json, args_bytes.getvalue(),
                       best=state.best_model_checkpoint, limit=args.save_total_limit, stats=stats, t0=t0)
            self.writer.submit(commit.directory, job.run, on_drop=copy.release)
            if os.path.exists(os.path.join(output_dir, JIT_SENTINEL)):
                # HF's just-in-time checkpoint (a preemption: SIGTERM) marks the directory
                # incomplete and removes the mark once _save_checkpoint returns: return once
                # the files are written, or the mark would go first.
                self.writer.wait(commit.directory)
            stats.queue_wait_s = time.perf_counter() - t1
            stats.blocking_s = time.perf_counter() - t0
            self._record(trainer, stats)
        finally:
            with self._lock:
                self._saving.discard(commit.directory)

    def _record(self, trainer: Trainer, stats: SaveStats) -> None:
        """Keep a save's statistics; send its figures to the Trainer's reporting callbacks."""
        self.stats.append(stats)
        if self.log_stats:
            self._figures.report(stats, self.stats, lambda figures: _to_trackers(trainer, figures))

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


#: the Trainer methods a checkpoint save runs; a subclass overriding one keeps HF's own save
SAVE_METHODS = ("_save_checkpoint", "save_model", "_save", "_save_optimizer_and_scheduler", "_save_scaler",
                "_save_rng_state")


#: The file HF's just-in-time checkpoint (``execute_jit_checkpoint``) puts in the directory while it saves.
JIT_SENTINEL = "checkpoint-is-incomplete.txt"

def _save_overrides(cls: type) -> list:
    """The names of :data:`SAVE_METHODS` that ``cls`` (a ``Trainer`` subclass) overrides."""
    return [name for name in SAVE_METHODS
            if getattr(cls, name, None) is not getattr(Trainer, name, None)]


def _to_trackers(trainer: Trainer, figures: Dict[str, float]) -> None:
    """Send ``figures`` to the Trainer's reporting callbacks (``report_to``: TensorBoard, W&B,
    ...) as an ``on_log`` event, and to nothing else: neither ``state.log_history`` (the state
    a checkpoint holds, so a resumed run's equals an uninterrupted one's) nor the user's own
    callbacks see them."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK

    trackers = tuple(INTEGRATION_TO_CALLBACK.values())
    handler = trainer.callback_handler
    for cb in handler.callbacks:
        if isinstance(cb, trackers):
            cast(Any, cb).on_log(trainer.args, trainer.state, trainer.control, logs=dict(figures), model=handler.model,
                      processing_class=handler.processing_class, optimizer=handler.optimizer,
                      lr_scheduler=handler.lr_scheduler, train_dataloader=handler.train_dataloader,
                      eval_dataloader=handler.eval_dataloader)


class _Job:
    """One checkpoint's background write (see the module docstring for the order)."""

    def __init__(self, cb: AsyncCkptCallback, trainer: Trainer, model: Any, run_dir: str, commit: FileCommit,
                 copy: HostCopy, state_json: str, args_bytes: bytes, best: Optional[str], limit: Optional[int],
                 stats: Optional[SaveStats] = None, t0: float = 0.0) -> None:
        self.cb, self.trainer, self.model = cb, trainer, model
        self.stats, self.t0 = stats, t0
        self.run_dir, self.commit = run_dir, commit
        self.copy, self.state_json, self.args_bytes = copy, state_json, args_bytes
        self.best, self.limit = best, limit

    def run(self) -> None:
        from transformers import PreTrainedModel

        supported: tuple = (PreTrainedModel,)
        try:
            from peft import PeftModel

            supported = (PreTrainedModel, PeftModel)
        except ImportError:
            pass

        commit = self.commit
        w0 = time.perf_counter()
        try:
            obj = self.copy.materialize()
            tr = self.trainer
            tokenizer = tr.processing_class
            if tokenizer is None:
                tokenizer = getattr(tr.data_collator, "tokenizer", None)
            if isinstance(self.model, supported) or tokenizer is not None:
                def write_dir(d: str) -> None:  # as HF's Trainer._save
                    if isinstance(self.model, supported):
                        self.model.save_pretrained(d, state_dict=obj["model"])
                    if tokenizer is not None:
                        tokenizer.save_pretrained(d)

                commit.write_tree(write_dir)
            if not isinstance(self.model, supported):
                import safetensors.torch

                commit.write("model.safetensors", lambda tmp: safetensors.torch.save_file(
                    obj["model"], tmp, metadata={"format": "pt"}))
            commit.write(TRAINING_ARGS_NAME, lambda tmp: _write_bytes(tmp, self.args_bytes))
            for key, fname in (("optimizer", OPTIMIZER_NAME), ("scheduler", SCHEDULER_NAME),
                               ("scaler", SCALER_NAME), ("rng", RNG_NAME)):
                if key in obj:
                    commit.write(fname, functools.partial(torch.save, obj[key]))
            obj = None  # the materialised copy goes before the buffers are released
        finally:
            self.copy.release()
        commit.write(TRAINER_STATE_NAME, lambda tmp: _write_bytes(tmp, self.state_json.encode("utf-8")))
        w1 = time.perf_counter()
        commit.finish()
        done = time.perf_counter()
        if self.stats is not None:
            st = self.stats
            st.files, st.written_bytes = len(commit.files), sum(commit.files.values())
            st.write_s, st.commit_s = w1 - w0, done - w1
            st.durable_s, st.commit_time = done - self.t0, time.time()
        self._rotate()
        log.debug("committed %s", commit.directory)

    def _rotate(self) -> None:
        """HF's ``rotate_checkpoints`` (``save_total_limit``, keeping the newest and the best
        checkpoint) over the committed checkpoints: one whose write is still pending, or whose
        save step has made its directory and not yet queued it, is neither counted nor removed
        (HF, saving synchronously, never sees one)."""
        from transformers.trainer_utils import sort_checkpoints

        if self.limit is None or self.limit <= 0:
            return
        # Under the callback's lock: a save step's directory is registered before it is made and
        # until it is queued, so it is in ``_saving`` or pending, or not made yet, when listed here.
        with self.cb._lock:
            skip = (set(self.cb.writer.pending()) | self.cb._saving) - {self.commit.directory}
            checkpoints = [c for c in sort_checkpoints(self.run_dir, PREFIX, use_mtime=True)
                           if os.path.abspath(c) not in skip]
            if len(checkpoints) <= self.limit:
                return
            protected = {checkpoints[-1]}
            if self.best is not None:
                protected.add(str(Path(self.best)))
            keep = max(self.limit, len(protected))
            remaining = len(checkpoints)
            for checkpoint in checkpoints:
                if remaining <= keep:
                    break
                if checkpoint not in protected:
                    shutil.rmtree(checkpoint, ignore_errors=True)
                    remaining -= 1


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
