"""torchtitan: :class:`CheckpointManager`, a torchtitan checkpointer backend on async_ckpt.

torchtitan (0.3.0, torch >= 2.11) builds its checkpointer from ``Trainer.Config.checkpoint``,
a ``BaseCheckpointManager.Config``; its default is the DCP backend's config. Select this one
by giving its ``Config`` instead::

    from async_ckpt.integrations.torchtitan import CheckpointManager
    config = Trainer.Config(..., checkpoint=CheckpointManager.Config(enable=True, interval=100,
                                                                    async_mode="async_with_pinned_mem"))

The trainer then calls ``config.checkpoint.build(dataloader=..., model_parts=..., ...)`` and
this class's ``save``, ``load``, ``maybe_wait_for_staging``, ``maybe_wait_for_saving`` and
``close``, as it calls the DCP backend's. Each save is an :class:`async_ckpt.CheckpointManager`
save of the same flattened state dict torchtitan's backend hands to ``dcp.save`` (the model's
keys at the top level, then ``optimizer``, ``lr_scheduler``, ``dataloader`` and the trainer's
``train_state`` as ``Stateful`` values), so a step is a DCP checkpoint that ``dcp.load`` reads
too, committed atomically with checksums.

The ``Config`` fields mean what they mean for torchtitan's backend:

- ``interval``, ``enable_first_step_checkpoint``, ``load_only`` and the last step decide when a
  save is taken (the manager's own save policy is not used: every save is forced);
- ``keep_latest_k``: the manager's ``max_to_keep`` (the newest commits are kept; directories
  another program wrote are never deleted);
- ``async_mode``: ``"disabled"``: :meth:`save` returns once the step is committed;
  ``"async"``: the host copies are taken at the call, a writer thread writes the files and
  ``save_future`` completes at the commit; ``"async_with_pinned_mem"``: the copies are issued at
  the call (lazy staging) and finished by ``maybe_wait_for_staging`` (torchtitan calls it right
  before ``optimizer.step()``), and a writer process writes the files;
- ``load_step``, ``exclude_from_loading``; step 0 (the seed checkpoint) restores the model only;
- ``last_save_model_only`` and ``export_dtype``: the last step holds the model only, cast;
  ``last_save_in_hf`` is written by torchtitan's own HF writer (``dcp_save(..., to_hf=True)``);
- ``initial_load_path`` (``initial_load_model_only``, ``initial_load_in_hf``,
  ``initial_load_in_hf_quantized``): a checkpoint another program wrote, read by torchtitan's own
  ``dcp_load`` when the folder holds no step.

Steps another program wrote in the folder (plain ``dcp.save``: no ``COMMITTED`` marker) are
found and restored read-only (:meth:`async_ckpt.CheckpointManager.foreign_steps`); a save of
such a step raises :class:`~async_ckpt.errors.ForeignStepError` instead of replacing it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional

import torch
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.components.checkpointer.dcp import CheckpointManager as DCPCheckpointManager
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from ..errors import InvalidArgumentError
from ..manager import CheckpointManager as AsyncCheckpointManager
from ..stats import SaveStats

log = logging.getLogger("async_ckpt.integrations.torchtitan")

__all__ = ["AsyncMode", "CheckpointManager", "STEP_PREFIX"]

#: torchtitan's step directory names: ``<folder>/step-<N>``
STEP_PREFIX = "step-"


class CheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpointer contract, saved and restored by :class:`async_ckpt.CheckpointManager`.

    Built by torchtitan's trainer through ``Config.build(...)`` with the keywords below; the
    public methods (``save``, ``load``, ``maybe_wait_for_staging``, ``maybe_wait_for_saving``,
    ``close``) are torchtitan's ``BaseCheckpointManager``'s.

    Args:
        config: this backend's :class:`CheckpointManager.Config`.
        dataloader: torchtitan's dataloader (a ``Stateful``), or None.
        model_parts: the model, or its pipeline stages (flattened into one state dict).
        optimizers: torchtitan's ``OptimizersContainer`` (a ``Stateful``).
        lr_schedulers: torchtitan's ``LRSchedulersContainer`` (a ``Stateful``).
        states: further state saved under its keys (the trainer passes
            ``{"train_state": trainer}``); updated in place with the four above.
        sd_adapter: the model's HF state-dict adapter (``last_save_in_hf``,
            ``initial_load_in_hf``), or None.
        base_folder: the trainer's dump folder; ``config.folder`` is relative to it.

    Raises:
        InvalidArgumentError: ``last_save_in_hf`` without an ``sd_adapter``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(DCPCheckpointManager.Config):
        """torchtitan's DCP backend's options (``BaseCheckpointManager.Config`` and its
        ``async_mode``, validated as torchtitan validates them), built into this backend.

        ``async_mode``: ``"disabled"``: save before returning; ``"async"``: copies at the call,
        a writer thread writes; ``"async_with_pinned_mem"``: copies issued at the call, a writer
        process writes (see the module's docstring).
        """

        #: declared again, as torchtitan's own test of a backend's config expects of it
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"

    enable: bool
    save_future: Optional[Future]

    def __init__(self, config: "CheckpointManager.Config", *, dataloader: Any, model_parts: List[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: Dict[str, Any], sd_adapter: Any,
                 base_folder: str = "") -> None:
        self.enable = False  # until everything below exists: close() is then a no-op
        if not config.enable:
            return
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.initial_load_in_hf = config.initial_load_in_hf
        self.initial_load_in_hf_quantized = config.initial_load_in_hf_quantized
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.last_save_in_hf = config.last_save_in_hf
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.keep_latest_k = config.keep_latest_k
        self.sd_adapter = sd_adapter
        if self.last_save_in_hf and self.sd_adapter is None:
            raise InvalidArgumentError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided: the "
                                       "model needs a state-dict adapter to be saved in HF format")
        self.async_mode = AsyncMode(config.async_mode)
        self.save_future = None
        #: ``async_with_pinned_mem``: set by a save whose host copies were issued, completed by
        #: ``maybe_wait_for_staging`` once they are done
        self.staging_future: Optional[Future] = None
        self._lock = threading.Lock()
        self._pending: Dict[int, Future] = {}  # step -> the future its commit completes
        self.manager = AsyncCheckpointManager(
            self.folder,
            step_prefix=STEP_PREFIX,
            max_to_keep=self.keep_latest_k,
            writer="process" if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM else "thread",
            lazy=self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM,
            read_only=self.load_only,
            on_saved=self._committed,
        )
        self.enable = True
        log.info("Checkpointing active (async_ckpt). Checkpoints will be loaded from and saved to %s", self.folder)

    def __del__(self) -> None:
        self.close()

    # ----------------------------------------------------------------------------------- save

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _flattened_model_states_sd(self, states: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """torchtitan's flattening: the model's keys at the top level, the other states by name
        (a ``None`` dataloader too, as torchtitan's backend saves it: each reads the other's steps)."""
        states = self.states if states is None else states
        sd = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            sd.update(states[MODEL].state_dict())
        return sd

    def _committed(self, stats: SaveStats) -> None:
        """The manager's ``on_saved`` (its writer thread): complete the step's future."""
        with self._lock:
            fut = self._pending.pop(stats.step, None)
        if fut is not None and not fut.done():
            fut.set_result(stats)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        begin = time.monotonic()
        if last_step:
            self._save_last_step(curr_step)
        elif self.async_mode == AsyncMode.DISABLED:
            self.manager.save(curr_step, self._flattened_model_states_sd(), force=True)
        else:
            fut: Future = Future()
            with self._lock:
                self._pending[curr_step] = fut
            try:
                self.manager.save_async(curr_step, self._flattened_model_states_sd(), force=True)
            except BaseException:
                with self._lock:
                    self._pending.pop(curr_step, None)
                raise
            self.save_future = fut
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:  # copies issued, finished by the wait
                self.staging_future = Future()
        log.info("%s step %d in %.2f seconds", "Saved" if self.async_mode == AsyncMode.DISABLED or last_step
                 else "Staged", curr_step, time.monotonic() - begin)
        return True

    def _save_last_step(self, curr_step: int) -> None:
        """The last step: the model only, cast to ``export_dtype`` (``last_save_model_only``),
        in HF format by torchtitan's own writer (``last_save_in_hf``), or everything."""
        if not self.last_save_model_only:
            self.manager.save(curr_step, self._flattened_model_states_sd(), force=True)
            return
        states = {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                  and v.dtype != self.export_dtype else v
                  for k, v in self.states[MODEL].state_dict().items()}
        if self.last_save_in_hf:  # a directory torchtitan writes, beside our steps; never ours to delete
            self.manager.join()
            DCPCheckpointManager.dcp_save(self, states, checkpoint_id=self._hf_export_dir(curr_step),
                                          async_mode=AsyncMode.DISABLED, to_hf=True)
            return
        self.manager.save(curr_step, states, force=True)

    def _hf_export_dir(self, step: int) -> str:
        return filesystem.join(self.folder, f"{STEP_PREFIX}{step}")

    def _maybe_wait_for_staging(self) -> None:
        self.manager.wait_for_staging()
        if self.staging_future is not None:
            self.staging_future.set_result(None)
            self.staging_future = None

    def _wait_for_saving(self) -> None:
        fut = self.save_future
        try:
            self.manager.join()
        except BaseException as exc:
            if fut is not None and not fut.done():
                fut.set_exception(exc)
            raise
        finally:
            self.save_future = None
        if fut is not None and not fut.done():  # committed, but on_saved did not run (a re-save)
            fut.set_result(None)

    def _close(self) -> None:
        try:
            self.maybe_wait_for_saving()
        finally:
            self.manager.close()

    # ----------------------------------------------------------------------------------- load

    def _available_steps(self) -> Dict[int, bool]:
        """Every step the folder holds: step -> whether async_ckpt wrote it (False: another
        program's plain DCP directory, read-only)."""
        steps = {s: False for s in self.manager.foreign_steps()}
        steps.update({s: True for s in self.manager.all_steps()})
        return steps

    def _find_load_step(self) -> int:
        """The highest step the folder holds, or -1 (as torchtitan's ``_find_load_step``)."""
        steps = self._available_steps()
        return max(steps) if steps else -1

    def _states_to_load(self, model_only: bool) -> Dict[str, Any]:
        if model_only:
            return dict(self.states[MODEL].state_dict())
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise InvalidArgumentError(f"checkpoint.exclude_from_loading names {key!r}, which is not a state "
                                           f"of the trainer (its states: {sorted(self.states)})")
        return self._flattened_model_states_sd({k: v for k, v in self.states.items()
                                                if k not in self.exclude_from_loading})

    def _load(self, step: int = -1) -> bool:
        if step != -1:
            if step not in self._available_steps():
                raise FileNotFoundError(f"--checkpoint.load_step={step} not found in {self.folder} (its steps: "
                                        f"{sorted(self._available_steps())})")
            load_step = step
        else:
            load_step = self._find_load_step()
        begin = time.monotonic()
        if load_step == -1:
            return self._initial_load()
        states = self._states_to_load(model_only=load_step == 0)
        # what dcp.load does: exactly the keys asked for (the rest of the step is not read nor
        # warned about), a tensor of another dtype (an export_dtype step) cast into the target
        self.manager.restore(load_step, states, keys=list(states), cast=True)
        self.states[MODEL].load_state_dict(states)
        log.info("Loaded step %d from %s in %.2f seconds", load_step, self.folder, time.monotonic() - begin)
        return True

    def _initial_load(self) -> bool:
        """No step in the folder: ``initial_load_path`` (or the adapter's HF assets), a checkpoint
        another program wrote, read by torchtitan's own ``dcp_load``."""
        from_hf = self.initial_load_in_hf
        if self.initial_load_path:
            checkpoint_id = self.initial_load_path
            if not filesystem.isdir(checkpoint_id):
                raise ValueError(f"Checkpoint.initial_load_path is invalid: {checkpoint_id}")
        elif from_hf:
            if not (self.sd_adapter and self.sd_adapter.hf_assets_path):
                raise InvalidArgumentError("initial_load_in_hf without initial_load_path needs an sd_adapter with "
                                           "hf_assets_path")
            checkpoint_id = self.sd_adapter.hf_assets_path
        else:
            log.info("No checkpoint was provided, this is a fresh start.")
            return False
        states = self._states_to_load(model_only=self.initial_load_model_only)
        DCPCheckpointManager.dcp_load(self, states, checkpoint_id=checkpoint_id, from_hf=from_hf,
                                      from_quantized=self.initial_load_in_hf_quantized)
        log.info("Loaded the initial checkpoint %s", checkpoint_id)
        return True

