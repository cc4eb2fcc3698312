"""When a manager saves: its save policies (one per tier), ``force`` and preemption, and
which tiers a save goes to (the persistent root's writer lease, the ranks' agreement)."""

from __future__ import annotations

import logging
from typing import Any, Callable, List, NamedTuple, Optional

from ..errors import CheckpointError, LeaseHeldError, StorageError
from ..lifecycle.coordinator import Coordinator
from ..lifecycle.steps import StepStore
from ..policies import SaveContext, SavePolicy, as_save_policy, check_step, decide_save
from ..preemption import PreemptionTracker
from ..tiers import Tier
from ..writer import AsyncWriter

log = logging.getLogger("async_ckpt")


class Due(NamedTuple):
    """Where a save goes: the persistent root, the local tier; whether it is the preemption
    checkpoint, and whether the save policy (or ``force``, or preemption) asked for it."""

    persistent: bool
    local: bool
    preempt: bool
    taken: bool


class SaveDecisions:
    """The save-decision methods of :class:`~async_ckpt.CheckpointManager` (a mixin)."""

    _preemption: Optional[PreemptionTracker]
    _interval_clock: Callable[[], float]
    _start_time: float
    _last_save_time: Optional[float]
    _last_save_step: Optional[int]
    _writer: AsyncWriter
    _local: Optional[Tier]
    _tiers: List[Tier]
    _coord: Coordinator
    _store: StepStore
    _restored: Optional[int]
    _ensure_writable: Callable[[], None]

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
        yet. ``save_async`` of a step it answers False for does nothing (beyond raising an
        earlier background failure)."""
        step = check_step(step)
        preempt = self._preemption.due(step) if self._preemption is not None else False
        take = preempt or self._policy_wants(step, preempt)
        return take or (self._local is not None and self._local_due(self._local, step, False, take))

    def _save_context(self, preempted: bool) -> SaveContext:
        return SaveContext(now=self._interval_clock(), start_time=self._start_time, last_save_time=self._last_save_time,
                           last_save_step=self._last_save_step, save_in_flight=self._writer.pending > 0,
                           preempted=preempted)

    def _policy_wants(self, step: int, preempted: bool = False) -> bool:
        return decide_save(self.save_policy, step, self._save_context(preempted))

    def _decide(self, step: int, force: bool) -> "tuple[bool, bool]":
        """(take this save, it is the preemption checkpoint). Training thread."""
        preempt = self._preemption.due(step) if self._preemption is not None else False
        return (force or preempt or self._policy_wants(step, preempt)), preempt

    def _due(self, step: int, force: bool, invalid: Optional[Exception] = None) -> Due:
        """Which tiers a save of ``step`` goes to, the same on every rank (rank 0 decides).

        When the persistent root is due, rank 0 takes its writer lease first. Another live
        writer holding it raises :class:`LeaseHeldError`. A root that cannot be reached (a
        ``StorageError`` or ``OSError``: down, a vanished mount) raises :class:`StorageError`
        without a local tier; with one, that error is kept as the failure of this step's upload
        (logged now, raised by ``join()``/``close()`` on every rank), the step goes to the local
        tier instead, and the next step due for the root tries the lease again.

        ``invalid``: this rank's step or metrics did not validate (several ranks): it decides
        nothing, says so in the exchange and raises that error; the other ranks raise a
        ``CheckpointError`` naming it."""
        alone = self._coord.world_size == 1
        take = preempt = take_local = False
        if invalid is None:
            take, preempt = self._decide(step, force)
        if not alone and self._coord.any_rank(preempt) and not preempt and invalid is None:
            # a preemption one rank detected (a signal to one host) is every rank's checkpoint
            # and every rank's last step, whatever rank 0's own signal handler saw (every rank
            # takes part in this exchange, whatever its own chkpt_on_preemption)
            if self._preemption is not None:
                self._preemption.adopt(step)
            take = preempt = True
        if invalid is None:
            take_local = self._local is not None and self._local_due(self._local, step, force or preempt, take)
        held: Optional[LeaseHeldError] = None
        unreachable: Optional[StorageError] = None
        if take and self._coord.is_primary:
            try:
                self._ensure_writable()  # a manager that only lists and restores needs only read access
                self._store.become_writer()
                self._store.warn_if_lower(step, self._restored)
            except LeaseHeldError as exc:
                if alone:
                    raise
                held = exc
            except (StorageError, OSError) as exc:
                unreachable = StorageError(f"step {step}: the checkpoint path {self._store.storage.url} cannot be "
                                           f"reached (taking its writer lease failed): {type(exc).__name__}: {exc}",
                                           step=step)
                unreachable.__cause__ = exc
                if self._local is None and alone:
                    raise unreachable from exc
        reached = unreachable is None
        if not alone:
            # Rank 0 decides for everyone: time-based policies, preemption signals and "nothing
            # in flight" conditions can answer differently per rank.
            # Every rank also says whether its writers hold a failure the next save raises, or
            # its step or metrics are invalid, and which step it saves (a rank at another step
            # fails the exchange): a rank raising alone would leave the others waiting for it.
            ok = invalid is None and not any(tier.writer.failed() for tier in self._tiers)
            (take, take_local, preempt, lease_ok, reached), failed = self._coord.agree(
                [take, take_local, preempt, held is None, reached], ok=ok, step=step if invalid is None else None)
            if failed:
                if invalid is not None:
                    raise invalid
                for tier in self._tiers:
                    tier.writer.raise_if_failed()
                raise CheckpointError(f"step {step}: not saved: rank(s) {failed} could not save it (an earlier "
                                      f"background save failed there, its step or metrics were invalid, or it "
                                      f"was called with another step than rank 0; see their errors)",
                                      step=step if isinstance(step, int) else None)
            if take and not lease_ok:
                raise held or LeaseHeldError(
                    f"rank 0 could not take the writer lease of {self._store.storage.url}; see rank 0's error")
        if not take or reached:
            return Due(take, take_local, preempt, take)
        if unreachable is None:
            unreachable = StorageError(f"step {step}: rank 0 could not reach the checkpoint path "
                                       f"{self._store.storage.url}; see rank 0's error", step=step)
        if self._local is None:
            raise unreachable
        self._writer.add_failure(step, unreachable)  # logged now, raised by join()/close()
        return Due(False, True, preempt, take)

    def _taken(self, step: int, preempt: bool) -> None:
        """Record a save that was just taken (staged and queued). Training thread."""
        self._last_save_time = self._interval_clock()
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
        ctx = SaveContext(now=self._interval_clock(), start_time=self._start_time, last_save_time=tier.last_save_time,
                          last_save_step=tier.last_save_step, save_in_flight=tier.writer.pending > 0, preempted=False)
        return decide_save(tier.policy, step, ctx)

