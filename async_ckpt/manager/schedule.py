"""The save schedule: is a save of a step due, and at which roots. Pure: no I/O, no clock.

The caller reads its clocks and its roots' state (:class:`RootState`) and passes them in; the
answer depends on nothing else, so the same inputs give the same answer on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..policies import SaveContext, SavePolicy, decide_save


@dataclass(frozen=True)
class RootState:
    """What the schedule needs to know of one root.

    Attributes:
        policy: the root's save policy; None: due whenever the persistent root is.
        last_save_time: when this manager last took a save for it (interval clock), or None.
        last_save_step: the step of that save, or None.
        save_in_flight: a save for it is queued or being written.
    """

    policy: Optional[SavePolicy]
    last_save_time: Optional[float] = None
    last_save_step: Optional[int] = None
    save_in_flight: bool = False


@dataclass(frozen=True)
class Due:
    """Where a save goes.

    Attributes:
        persistent: the persistent root takes the step.
        local: the local tier takes the step.
        preempt: it is the preemption checkpoint.
        wanted: the persistent root's policy, ``force`` or preemption asked for it (True also
            when the root then turned out unreachable and ``persistent`` was dropped).
    """

    persistent: bool
    local: bool
    preempt: bool
    wanted: bool

    @property
    def any(self) -> bool:
        """Whether the save goes anywhere."""
        return self.persistent or self.local


def policy_wants(root: RootState, step: int, *, now: float, start_time: float, preempted: bool = False) -> bool:
    """Whether ``root``'s own policy wants a save of ``step``.

    Args:
        root: the root's policy and save state (its policy must not be None).
        step: the step.
        now: the interval clock's time of the decision.
        start_time: the interval clock's time the manager was created.
        preempted: a preemption was detected and its checkpoint is not taken yet.

    Returns:
        The policy's answer.
    """
    assert root.policy is not None
    ctx = SaveContext(now=now, start_time=start_time, last_save_time=root.last_save_time,
                      last_save_step=root.last_save_step, save_in_flight=root.save_in_flight, preempted=preempted)
    return decide_save(root.policy, step, ctx)


def due_at(step: int, *, force: bool, preempt: bool, now: float, start_time: float, persistent: RootState,
           local: Optional[RootState]) -> Due:
    """Which roots a save of ``step`` is due at.

    The persistent root: when forced, at a preemption, or when its policy wants it. The local
    tier (when there is one): when forced or at a preemption, else when its own policy wants
    it (without one: when the persistent root's decision was to save).

    Args:
        step: the step.
        force: the caller asked for the save whatever the policies say.
        preempt: it is the preemption checkpoint.
        now: the interval clock's time of the decision.
        start_time: the interval clock's time the manager was created.
        persistent: the persistent root's state.
        local: the local tier's state, or None without a local tier.

    Returns:
        The decision (``wanted`` equals ``persistent`` here).
    """
    take = force or preempt or policy_wants(persistent, step, now=now, start_time=start_time, preempted=preempt)
    take_local = False
    if local is not None:
        if force or preempt or local.policy is None:
            take_local = force or preempt or take
        else:
            take_local = policy_wants(local, step, now=now, start_time=start_time)
    return Due(take, take_local, preempt, take)
