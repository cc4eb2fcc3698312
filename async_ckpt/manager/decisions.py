"""When a manager saves: its save policies (one per tier), ``force`` and preemption."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..errors import CheckpointError
from ..policies import SaveContext, SavePolicy, as_save_policy, check_step, decide_save
from ..preemption import PreemptionTracker
from ..tiers import Tier
from ..writer import AsyncWriter


class SaveDecisions:
    """The save-decision methods of :class:`~async_ckpt.CheckpointManager` (a mixin)."""

    _preemption: Optional[PreemptionTracker]
    _clock: Callable[[], float]
    _start_time: float
    _last_save_time: Optional[float]
    _last_save_step: Optional[int]
    _writer: AsyncWriter
    _local: Optional[Tier]

    @property
    def save_policy(self) -> SavePolicy:
        """The save policy (assignable: a policy object or a callable ``fn(step) -> bool``)."""
        return self._save_policy

    @save_policy.setter
    def save_policy(self, policy: Any) -> None:
        self._save_policy = as_save_policy(policy)

    def should_save(self, step: int) -> bool:
        """Whether a checkpoint is due at ``step``: the save policy (or, with ``local_dir``, the
        local policy) wants one, or a preemption was detected and its checkpoint is not taken
        yet. ``save_async`` of a step it answers False for does nothing."""
        step = check_step(step)
        preempt = self._preemption.due(step) if self._preemption is not None else False
        take = preempt or self._policy_wants(step, preempt)
        return take or (self._local is not None and self._local_due(self._local, step, False, take))

    def _save_context(self, preempted: bool) -> SaveContext:
        return SaveContext(now=self._clock(), start_time=self._start_time, last_save_time=self._last_save_time,
                           last_save_step=self._last_save_step, save_in_flight=self._writer.pending > 0,
                           preempted=preempted)

    def _policy_wants(self, step: int, preempted: bool = False) -> bool:
        return decide_save(self.save_policy, step, self._save_context(preempted))

    def _decide(self, step: int, force: bool) -> "tuple[bool, bool]":
        """(take this save, it is the preemption checkpoint). Training thread."""
        preempt = self._preemption.due(step) if self._preemption is not None else False
        return (force or preempt or self._policy_wants(step, preempt)), preempt

    def _taken(self, step: int, preempt: bool) -> None:
        """Record a save that was just taken (staged and queued). Training thread."""
        self._last_save_time = self._clock()
        self._last_save_step = step
        if preempt and self._preemption is not None:
            self._preemption.mark_saved(step)

    def reached_preemption(self, step: int) -> bool:
        """True once a preemption was detected and its checkpoint was taken (or is due) at or
        before ``step``: the loop should then :meth:`join` (the checkpoint becomes durable) and exit.

        Call it every step after ``save``/``save_async`` (torch_xla's loop shape). If the signal
        arrives after this step's save decision, it answers False once more, so the next step's
        save takes the checkpoint before the loop is told to stop. Always False unless the manager
        was created with ``chkpt_on_preemption=True``.
        """
        step = check_step(step)
        return self._preemption is not None and self._preemption.reached(step)

    def trigger_preemption(self) -> None:
        """Act as if a preemption signal arrived (for schedulers that announce it another way)."""
        if self._preemption is None:
            raise CheckpointError("trigger_preemption() needs chkpt_on_preemption=True")
        self._preemption.watcher.trigger()

    def _local_due(self, tier: Tier, step: int, forced: bool, take: bool) -> bool:
        """Whether the local tier saves ``step``: forced or preemption saves, else its policy
        (the save policy's decision when it has none)."""
        if forced or tier.policy is None:
            return forced or take
        ctx = SaveContext(now=self._clock(), start_time=self._start_time, last_save_time=tier.last_save_time,
                          last_save_step=tier.last_save_step, save_in_flight=tier.writer.pending > 0, preempted=False)
        return decide_save(tier.policy, step, ctx)

