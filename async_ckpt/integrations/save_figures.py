"""The figures of an integration's saves, for the framework's own logger (Lightning's
``trainer.logger``, the HF Trainer's ``log()``, accelerate's trackers): where users already look
(TensorBoard, W&B, CSV), next to their losses.

Each save logs one record, at the save: ``checkpoint/blocking_s`` (what the training loop
waited), ``checkpoint/stage_s`` (the host copy), ``checkpoint/nbytes`` (bytes copied), and, once
an earlier save of the same integration has committed, ``checkpoint/durable_s`` and
``checkpoint/write_s`` of the newest such save (committed in the background, so known only at
a later save).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional, Sequence

from ..stats import SaveStats

log = logging.getLogger("async_ckpt.integrations")

#: the prefix of every figure's name (a group of its own in TensorBoard and W&B)
PREFIX = "checkpoint/"


class SaveFigures:
    """What one integration has logged of its saves (the durable time of each save once)."""

    def __init__(self) -> None:
        self._durable: Optional[SaveStats] = None  # the save whose durable time was logged last

    def figures(self, current: SaveStats, history: Sequence[SaveStats]) -> Dict[str, float]:
        """The figures to log at ``current``'s save.

        Args:
            current: the save just taken (its stall is known).
            history: the integration's saves, oldest first (``current`` among them).

        Returns:
            Name -> value: ``checkpoint/blocking_s``, ``checkpoint/stage_s``,
            ``checkpoint/nbytes``, and the newest committed earlier save's
            ``checkpoint/durable_s`` and ``checkpoint/write_s`` when not logged before.
        """
        out = {f"{PREFIX}blocking_s": float(current.blocking_s), f"{PREFIX}stage_s": float(current.stage_s),
               f"{PREFIX}nbytes": float(current.nbytes)}
        done = [s for s in history if s is not current and s.durable_s is not None]
        newest = done[-1] if done else None
        if newest is not None and newest is not self._durable:
            self._durable = newest
            out[f"{PREFIX}durable_s"] = float(newest.durable_s or 0.0)
            out[f"{PREFIX}write_s"] = float(newest.write_s)
        return out

    def report(self, current: SaveStats, history: Sequence[SaveStats],
               sink: Callable[[Dict[str, float]], None]) -> None:
        """Log :meth:`figures` through ``sink`` (the framework's logger).

        A logger that raises is logged at WARNING and never fails the save.

        Args:
            current: the save just taken.
            history: the integration's saves, oldest first.
            sink: calls the framework's logger with the figures.
        """
        try:
            sink(self.figures(current, history))
        except Exception as exc:  # noqa: BLE001 - a logger's failure must not fail a committed snapshot
            log.warning("could not log the checkpoint figures of step %d to the framework's logger: %s",
                        current.step, exc)
