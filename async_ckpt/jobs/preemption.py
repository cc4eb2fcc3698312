"""Preemption detection: an opt-in signal handler, or torch_xla's preemption sync point.

Nothing here installs a signal handler unless asked (``CheckpointManager(...,
chkpt_on_preemption=True)``). Two ways to detect a preemption:

* ``"signal"``: a Python handler for each of ``signals`` (default ``SIGTERM``; add ``SIGUSR1``
  for SLURM's ``--signal``) that only sets a flag, then calls the handler that was installed
  before it if that one is a Python callable (``SIG_DFL`` and ``SIG_IGN`` are not "called": the
  point of the handler is that the process does not die before its checkpoint is written).
  Python runs signal handlers in the main thread, so it can only be installed from there.
* ``"xla"``: torch_xla's preemption sync manager (TSL's, the one
  ``torch_xla.experimental.distributed_checkpoint.CheckpointManager`` uses). Its SIGTERM handler
  is installed in C, and every host agrees on the step at which
  ``torch_xla._XLAC._sync_point_reached(step)`` turns True, so all hosts save the same step.
  ``"auto"`` picks it when torch_xla runs on TPU.

:class:`PreemptionTracker` turns "a preemption was detected" into the manager's decisions: the
first ``save``/``save_async`` at or after the detection takes a checkpoint whatever the save
policy says, and ``reached_preemption(step)`` is True from the step that checkpoint is (or must
be) taken at.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import threading
from types import FrameType
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from .. import compat
from ..errors import CheckpointError, InvalidArgumentError

log = logging.getLogger("async_ckpt")

SYNC_MODES = ("auto", "signal", "xla")

_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, None]


def resolve_sync_mode(mode: str) -> str:
    """The detection mode to use for ``preemption_sync=mode``.

    Args:
        mode: ``"auto"``, ``"signal"`` or ``"xla"``.

    Returns:
        ``mode`` itself, except ``"auto"``: ``"xla"`` when torch_xla runs on TPU, else
        ``"signal"``.

    Raises:
        InvalidArgumentError: ``mode`` is none of the three.
    """
    if mode not in SYNC_MODES:
        raise InvalidArgumentError(f"preemption_sync must be one of {SYNC_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    if importlib.util.find_spec("torch_xla") is None:
        return "signal"
    dev = os.environ.get("PJRT_DEVICE")
    if dev is None:
        try:
            import torch_xla.runtime as xr

            dev = xr.device_type()
        except Exception:  # torch_xla present but unusable: fall back to signals
            return "signal"
    return "xla" if str(dev).upper() == "TPU" else "signal"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


class PreemptionWatcher:
    """Detects a preemption. ``poll(step)`` returns True from the detection on (it latches).

    Args:
        signals: signals that mean "preempted" (``"signal"`` mode).
        sync: ``"signal"`` or ``"xla"`` (see the module docstring); ``"auto"`` is resolved here.

    Raises:
        InvalidArgumentError: ``sync`` is not a mode, a signal is not a catchable signal
            number, or ``signals`` is empty in ``"signal"`` mode.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,), sync: str = "signal") -> None:
        self.sync = resolve_sync_mode(sync)
        sigs = []
        for s in signals:
            if isinstance(s, bool) or not isinstance(s, int):
                raise InvalidArgumentError(f"preemption_signals must be signal numbers, got {s!r}")
            try:
                sigs.append(signal.Signals(s))
            except ValueError:
                raise InvalidArgumentError(f"preemption_signals: {s!r} is not a signal number") from None
            if s in (signal.SIGKILL, getattr(signal, "SIGSTOP", -1)):
                raise InvalidArgumentError(f"preemption_signals: {_signal_name(s)} cannot be caught")
        if not sigs and self.sync == "signal":
            raise InvalidArgumentError("preemption_signals is empty: nothing would detect a preemption")
        self.signals: Tuple[signal.Signals, ...] = tuple(dict.fromkeys(sigs))
        self._previous: Dict[int, _Handler] = {}
        self._installed = False
        self._active = False
        self._detected = False
        self._signum: Optional[int] = None
        self._sync_step: Optional[int] = None

    # ---- install / uninstall -----------------------------------------------------------------
    def install(self) -> "PreemptionWatcher":
        """Start watching (a no-op when watching already).

        Returns:
            This watcher.

        Raises:
            CheckpointError: ``"signal"`` mode outside the main thread, or ``"xla"`` mode
                without torch_xla.
        """
        if self._installed:
            return self
        if self.sync == "xla":
            self._activate_xla()
        else:
            if threading.current_thread() is not threading.main_thread():
                raise CheckpointError(
                    "chkpt_on_preemption=True installs a signal handler, and Python only allows that "
                    f"from the main thread (this is {threading.current_thread().name!r}); create the "
                    "CheckpointManager in the main thread, or leave chkpt_on_preemption off and call "
                    "trigger_preemption() from your own handler")
            for s in self.signals:
                self._previous[int(s)] = signal.signal(s, self._on_signal)
        self._installed = True
        self._active = True
        return self

    def uninstall(self) -> None:
        """Stop watching; restore the previous handlers where ours is still the one installed."""
        if not self._installed:
            return
        self._active = False
        self._installed = False
        if self.sync == "xla":
            try:
                _, _, deactivate, _ = compat.xla_preemption()
                deactivate()
            except Exception as exc:  # pragma: no cover - best effort at shutdown
                log.debug("deactivating the preemption sync manager failed: %s", exc)
            return
        if threading.current_thread() is not threading.main_thread():
            return  # cannot touch handlers here; ours stays installed but only chains from now on
        for s, prev in self._previous.items():
            try:
                if signal.getsignal(s) == self._on_signal:
                    signal.signal(s, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError) as exc:  # pragma: no cover
                log.debug("restoring the handler of %s failed: %s", _signal_name(s), exc)

    def _activate_xla(self) -> None:
        try:
            import torch_xla.runtime as xr
        except ImportError as exc:
            raise CheckpointError("preemption_sync='xla' needs torch_xla") from exc
        master = xr.get_master_ip() if xr.device_type() == "TPU" else "localhost"
        ensure_coordinator, activate, _, _ = compat.xla_preemption()
        ensure_coordinator(xr.process_index(), xr.process_count(), master)
        activate()

    # ---- detection ---------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        if self._active:
            self._detected = True
            if self._signum is None:
                self._signum = signum
        prev = self._previous.get(signum)
        if callable(prev):
            prev(signum, frame)

    def trigger(self, signum: Optional[int] = None) -> None:
        """Mark a preemption as detected (for a cluster hook that learns of it another way).

        Args:
            signum: the signal that announced it, if any (kept as :attr:`signum` unless one
                was recorded first).
        """
        self._detected = True
        if self._signum is None:
            self._signum = signum

    def poll(self, step: int) -> bool:
        """Whether a preemption has been detected; it latches.

        Args:
            step: the training step (``"xla"``: asked of torch_xla's sync point, on which every
                host agrees).

        Returns:
            True from the detection on.
        """
        if self._detected or not self._installed:
            return self._detected
        if self.sync == "xla":
            *_, sync_point_reached = compat.xla_preemption()
            if sync_point_reached(step):
                self._detected = True
                self._sync_step = step
        return self._detected

    @property
    def detected(self) -> bool:
        """Whether a preemption has been detected (without polling torch_xla)."""
        return self._detected

    @property
    def signum(self) -> Optional[int]:
        """The first signal that marked the preemption, if it came from a Python handler."""
        return self._signum

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` was called and :meth:`uninstall` was not since."""
        return self._installed


class PreemptionTracker:
    """The manager's preemption decisions for one :class:`PreemptionWatcher`.

    * ``due(step)``: a preemption was detected and its checkpoint is not taken yet, so the save
      at ``step`` must happen. Called from ``should_save``/``save``/``save_async``.
    * ``mark_saved(step)``: that checkpoint was taken.
    * ``reached(step)``: True from the preemption step on. If the detection is first seen by
      ``reached`` *after* a save decision was already made for this same step (the signal came
      in between), the preemption step is the next one, so that the loop goes round once more
      and saves before it is told to exit.

    Args:
        watcher: the watcher that detects the preemption.
    """

    def __init__(self, watcher: PreemptionWatcher) -> None:
        self.watcher = watcher
        self._lock = threading.Lock()
        self.preempt_step: Optional[int] = None
        self.saved_step: Optional[int] = None
        self._last_decision: Optional[int] = None

    def due(self, step: int) -> bool:
        """Whether the save at ``step`` must happen because of a preemption (polls the watcher).

        Args:
            step: the step a save decision is made for.

        Returns:
            True when a preemption was detected, its checkpoint is not taken yet and ``step``
            is at or after the preemption step.
        """
        with self._lock:
            self._last_decision = step
            if not self.watcher.poll(step):
                return False
            if self.preempt_step is None:
                self.preempt_step = step
            return self.saved_step is None and step >= self.preempt_step

    def pending(self) -> bool:
        """Detected and not yet saved (no polling)."""
        return self.watcher.detected and self.saved_step is None

    def adopt(self, step: int) -> None:
        """Count a preemption another rank detected as detected here too.

        Args:
            step: the step at which the ranks take its checkpoint (the preemption step, unless
                one is set already); :meth:`reached` then answers as on that rank.
        """
        with self._lock:
            self.watcher.trigger()
            self._last_decision = step
            if self.preempt_step is None:
                self.preempt_step = step

    def mark_saved(self, step: int) -> None:
        """Record that the preemption checkpoint was taken (the first call counts).

        Args:
            step: the step it was taken at.
        """
        with self._lock:
            if self.saved_step is None:
                self.saved_step = step
                log.warning("preemption checkpoint taken at step %d", step)

    def reached(self, step: int) -> bool:
        """Whether the loop reached the preemption step (``reached_preemption``; polls the watcher).

        Args:
            step: the current training step.

        Returns:
            True from the preemption step on: ``step`` itself when no save decision was made
            for it yet, else the step after it (see the class docstring).
        """
        with self._lock:
            if not self.watcher.poll(step):
                return False
            if self.preempt_step is None:
                self.preempt_step = step + 1 if self._last_decision == step else step
            return step >= self.preempt_step
