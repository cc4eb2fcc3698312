"""Save-decision and retention policies: small objects with one method each, composable.

A *save policy* answers ``should_save(step, context) -> bool``; ``context`` is a
:class:`SaveContext` the manager fills in (the time of the previous save, whether a save is
still being written, whether the job is being preempted), and a policy that needs only the step
ignores it. A user's policy with ``should_save(step)`` only, or a plain callable
``fn(step) -> bool``, is accepted wherever a save policy is: :func:`as_save_policy` adapts it
once, when the manager is built.

A *retention policy* answers ``keep(checkpoints) -> set of steps`` given every committed
checkpoint (oldest commit first, as :class:`CheckpointInfo` read from the manifests); the manager
deletes the rest, except that the newest committed step and any step still being written are
never deleted, whatever a policy says. A plain callable
``fn(checkpoints) -> iterable of steps`` is accepted wherever a retention policy is.

Retention policies see only what the manifests hold (step, commit time, metrics, size), so a
new manager on the same directory makes the same decisions as the one before a restart.
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Optional,
    Protocol,
    Sequence,
    Set,
    Tuple,
    Union,
    runtime_checkable,
)

from .errors import InvalidArgumentError, InvalidStepError

__all__ = [
    "AnyOf",
    "AtSteps",
    "CheckpointInfo",
    "Continuous",
    "EveryNSteps",
    "EveryTSeconds",
    "KeepAll",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepLatest",
    "KeepTimeInterval",
    "OnPreemption",
    "RetentionPolicy",
    "SaveContext",
    "SavePolicy",
    "as_retention_policy",
    "apply_retention",
    "as_save_policy",
    "best_checkpoint",
    "decide_save",
    "retention_from_spec",
    "retention_spec",
]


@dataclass(frozen=True)
class CheckpointInfo:
    """What retention policies see of a committed checkpoint (read from its manifest).

    Attributes:
        step: the step.
        commit_time: wall-clock time (``time.time()``) of its commit.
        metrics: the ``metrics=`` given to the save that wrote it.
        nbytes: its size in bytes.
        extra: the manifest's ``extra`` entries (what the saving manager recorded, e.g. the
            id of the save that wrote a step to both tiers); not compared.
    """

    step: int
    commit_time: float
    metrics: Dict[str, float] = field(default_factory=dict)
    nbytes: int = 0
    extra: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class SaveContext:
    """What the manager knows when it asks a save policy for a decision.

    The times are read from the manager's interval clock (``time.monotonic()`` unless its
    ``interval_clock`` says otherwise): only their differences mean anything, and those never
    go negative when the wall clock steps back (NTP, a VM restored from a snapshot).

    Attributes:
        now: the time of the decision (interval clock).
        start_time: when the manager was created (interval clock).
        last_save_time: when this manager last took a save (forced ones included; interval
            clock), or None.
        last_save_step: the step of that save, or None.
        save_in_flight: a save has been taken and is not yet committed.
        preempted: a preemption was detected and its checkpoint is not taken yet.
    """

    now: float
    start_time: float
    last_save_time: Optional[float] = None
    last_save_step: Optional[int] = None
    save_in_flight: bool = False
    preempted: bool = False


@runtime_checkable
class SavePolicy(Protocol):
    """A save policy: decides whether a checkpoint is due at a step (see the module docstring)."""

    def should_save(self, step: int, context: Optional["SaveContext"] = None) -> bool:
        """Whether a checkpoint is due at ``step``.

        Args:
            step: the training step.
            context: what the manager knows (None outside a manager).

        Returns:
            True when a save is due.
        """


@runtime_checkable
class RetentionPolicy(Protocol):
    """A retention policy: decides which committed checkpoints to keep (see the module docstring)."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        """The steps to keep.

        Args:
            checkpoints: every committed checkpoint, oldest commit first.

        Returns:
            The steps to keep; the manager deletes the others (never the newest committed
            step nor one still being written).
        """


SavePolicyLike = Union[SavePolicy, Callable[[int], bool]]
RetentionPolicyLike = Union[RetentionPolicy, Callable[[Sequence[CheckpointInfo]], Iterable[int]]]


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_seconds(name: str, value: Any, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number of seconds, got {type(value).__name__}")
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v < 0 or (v == 0 and not allow_zero):
        raise InvalidArgumentError(f"{name} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return v


def _commit_order(checkpoints: Sequence[CheckpointInfo]) -> List[CheckpointInfo]:
    return sorted(checkpoints, key=lambda c: (c.commit_time, c.step))


# ---- save policies ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EveryNSteps:
    """Save when ``step % n == 0`` (torch_xla's ``save_interval``).

    Attributes:
        n: the interval in steps (an int >= 1).

    Raises:
        InvalidArgumentError: ``n`` is not an int >= 1.
    """

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidArgumentError(f"save interval must be an int >= 1, got {self.n!r}")

    def should_save(self, step: int, context: Optional[SaveContext] = None) -> bool:
        """Whether ``step`` is a multiple of ``n``.

        Args:
            step: the training step.
            context: not used.

        Returns:
            ``step % n == 0``.
        """
        return step % self.n == 0


class AtSteps:
    """Save at exactly the given steps.

    Args:
        steps: the steps (non-negative ints).

    Raises:
        InvalidArgumentError: ``steps`` is not an iterable of non-negative ints.
    """

    def __init__(self, steps: Iterable[int]) -> None:
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
            raise InvalidArgumentError(f"AtSteps needs an iterable of steps, got {type(steps).__name__}")
        self.steps: FrozenSet[int] = frozenset(_check_int("AtSteps step", s, 0) for s in steps)

    def should_save(self, step: int, context: Optional[SaveContext] = None) -> bool:
        """Whether ``step`` is one of the steps.

        Args:
            step: the training step.
            context: not used.

        Returns:
            ``step in steps``.
        """
        return step in self.steps

    def __repr__(self) -> str:
        return f"AtSteps({sorted(self.steps)})"


class EveryTSeconds:
    """Save at most once per ``seconds`` of elapsed time.

    A save is due when ``seconds`` have passed since the previous save this manager took
    (forced and preemption saves included) or, before the first one, since the manager was
    created: the first save of a run comes ``seconds`` into it, not at its first step. Combine
    with :class:`AtSteps` (``AnyOf([AtSteps([0]), EveryTSeconds(600)])``) to also save at once.
    Time is measured on a monotonic clock (the manager's ``interval_clock``), so a wall clock
    that steps back never delays a save.

    Args:
        seconds: the interval (a finite number > 0).
        clock: the clock this policy measures with when it is used outside a manager (no
            context; it counts from its construction): default ``time.monotonic``. Within a
            manager the context's times are used.

    Raises:
        InvalidArgumentError: ``seconds`` is not a finite number > 0, or ``clock`` is not
            callable.
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = _check_seconds("EveryTSeconds seconds", seconds)
        if not callable(clock):
            raise InvalidArgumentError(f"EveryTSeconds clock must be callable (like time.monotonic), got {clock!r}")
        self.clock = clock
        self._own_last = clock()

    def should_save(self, step: int, context: Optional[SaveContext] = None) -> bool:
        """Whether ``seconds`` have passed since the previous save (or the start).

        Args:
            step: the training step (not used).
            context: the manager's times; None outside a manager, where this policy's own
                ``clock`` measures from its previous yes (or its construction).

        Returns:
            True when the interval has passed.
        """
        if context is None:
            now = self.clock()
            if now - self._own_last >= self.seconds:
                self._own_last = now
                return True
            return False
        ref = context.last_save_time if context.last_save_time is not None else context.start_time
        return context.now - ref >= self.seconds

    def __repr__(self) -> str:
        return f"EveryTSeconds({self.seconds:g})"


class Continuous:
    """Save whenever no save is in flight (and at least ``min_interval_s`` after the last one).

    Checkpoints as often as the storage allows without ever making training wait for a slot.
    Used outside a manager (no context) it always says yes.

    Args:
        min_interval_s: the least seconds between two saves (a finite number >= 0).

    Raises:
        InvalidArgumentError: ``min_interval_s`` is not a finite number >= 0.
    """

    def __init__(self, min_interval_s: float = 0.0) -> None:
        self.min_interval_s = _check_seconds("Continuous min_interval_s", min_interval_s, allow_zero=True)

    def should_save(self, step: int, context: Optional[SaveContext] = None) -> bool:
        """Whether no save is in flight and ``min_interval_s`` passed since the last one.

        Args:
            step: the training step (not used).
            context: what the manager knows (None: always True).

        Returns:
            True when a save may start now.
        """
        if context is None:
            return True
        if context.save_in_flight:
            return False
        if self.min_interval_s and context.last_save_time is not None:
            return context.now - context.last_save_time >= self.min_interval_s
        return True

    def __repr__(self) -> str:
        return f"Continuous(min_interval_s={self.min_interval_s:g})"


class OnPreemption:
    """Save when a preemption was detected (needs ``chkpt_on_preemption=True`` on the manager).

    A manager with preemption enabled already saves on preemption whatever its policy; this
    policy is for saving *only* then: ``save_policy=OnPreemption()``.
    """

    def should_save(self, step: int, context: Optional[SaveContext] = None) -> bool:
        """Whether the manager detected a preemption whose checkpoint is not taken yet.

        Args:
            step: the training step (not used).
            context: what the manager knows (None: always False).

        Returns:
            ``context.preempted``.
        """
        return bool(context is not None and context.preempted)

    def __repr__(self) -> str:
        return "OnPreemption()"


def decide_save(policy: SavePolicy, step: int, context: Optional[SaveContext] = None) -> bool:
    """A save policy's decision, as a bool.

    Args:
        policy: a save policy as returned by :func:`as_save_policy`.
        step: the training step.
        context: what the manager knows (None outside a manager).

    Returns:
        Whether a save is due.
    """
    return bool(policy.should_save(step, context))


class _CallableSave:
    """A plain ``fn(step) -> bool`` used as a save policy."""

    def __init__(self, fn: Callable[[int], bool]) -> None:
        self.fn = fn

    def should_save(self, step: int, context: Optional[SaveContext] = None) -> bool:
        return bool(self.fn(step))

    def __repr__(self) -> str:
        return f"save_policy({getattr(self.fn, '__name__', repr(self.fn))})"


class _StepOnly:
    """A user's policy whose ``should_save`` takes the step only."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def should_save(self, step: int, context: Optional[SaveContext] = None) -> bool:
        return bool(self.policy.should_save(step))

    def __repr__(self) -> str:
        return repr(self.policy)


def _takes_context(method: Callable[..., Any]) -> bool:
    """Whether ``method`` accepts a second positional argument (the context)."""
    import inspect

    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: assume step only
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def as_save_policy(policy: Any) -> SavePolicy:
    """A save policy whose ``should_save(step, context)`` can always be called.

    Args:
        policy: an object with ``should_save(step, context)`` or ``should_save(step)``, or a
            plain callable ``fn(step) -> bool``.

    Returns:
        ``policy`` itself when its ``should_save`` takes the context, else an adapter that
        calls it with the step only (decided once, here).

    Raises:
        InvalidArgumentError: ``policy`` has no ``should_save`` method and is not callable.
    """
    should = getattr(policy, "should_save", None)
    if callable(should):
        return policy if _takes_context(should) else _StepOnly(policy)
    if callable(policy):
        return _CallableSave(policy)
    raise InvalidArgumentError(f"a save policy needs a should_save(step) method or must be callable, got {type(policy).__name__}")


# ---- retention policies -------------------------------------------------------------------------
@dataclass(frozen=True)
class KeepAll:
    """Never delete anything."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        """Every step.

        Args:
            checkpoints: every committed checkpoint.

        Returns:
            Their steps.
        """
        return {c.step for c in checkpoints}


@dataclass(frozen=True)
class KeepLatest:
    """Keep the ``n`` most recently committed checkpoints (torch_xla's ``max_to_keep``).

    Attributes:
        n: how many to keep (an int >= 1).

    Raises:
        InvalidArgumentError: ``n`` is not an int >= 1.
    """

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidArgumentError(f"KeepLatest needs n >= 1, got {self.n!r}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        """The steps of the ``n`` newest commits (ties of commit time: the higher step is newer).

        Args:
            checkpoints: every committed checkpoint.

        Returns:
            The steps to keep.
        """
        ordered = _commit_order(checkpoints)
        return {c.step for c in ordered[-self.n:]}


@dataclass(frozen=True)
class KeepEveryNSteps:
    """Keep every checkpoint whose step is a multiple of ``n``, forever (Orbax's ``keep_period``).

    Attributes:
        n: the period in steps (an int >= 1).

    Raises:
        InvalidArgumentError: ``n`` is not an int >= 1.
    """

    n: int

    def __post_init__(self) -> None:
        _check_int("KeepEveryNSteps n", self.n)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        """The steps that are multiples of ``n``.

        Args:
            checkpoints: every committed checkpoint.

        Returns:
            The steps to keep.
        """
        return {c.step for c in checkpoints if c.step % self.n == 0}


@dataclass(frozen=True)
class KeepTimeInterval:
    """Keep one checkpoint per ``seconds`` of commit time (Orbax's ``keep_time_interval``).

    Walking the checkpoints oldest commit first, the first one is kept, then each one committed
    at least ``seconds`` after the last kept one. Deleting a checkpoint this policy does not keep
    never changes which ones it keeps, so its decisions are stable as checkpoints come and go.

    Attributes:
        seconds: the interval of commit time (a finite number > 0).

    Raises:
        InvalidArgumentError: ``seconds`` is not a finite number > 0.
    """

    seconds: float

    def __post_init__(self) -> None:
        _check_seconds("KeepTimeInterval seconds", self.seconds)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        """One step per ``seconds`` of commit time (see the class docstring).

        Args:
            checkpoints: every committed checkpoint.

        Returns:
            The steps to keep.
        """
        kept: Set[int] = set()
        last: Optional[float] = None
        for c in _commit_order(checkpoints):
            if last is None or c.commit_time - last >= self.seconds:
                kept.add(c.step)
                last = c.commit_time
        return kept


_MODES = ("min", "max")
_MISSING = ("keep", "drop")


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` checkpoints with the best value of ``metric`` (Lightning's ``save_top_k``).

    Attributes:
        n: how many to keep (an int >= 1).
        metric: a key of the ``metrics=`` given to ``save``/``save_async``.
        mode: ``"min"`` (a loss) or ``"max"`` (an accuracy).
        missing: checkpoints saved without this metric are all kept (``"keep"``, the default)
            or are left to the other policies (``"drop"``).

    Ties go to the checkpoint committed first, so a new checkpoint that is only as good as a
    kept one never displaces it.

    Raises:
        InvalidArgumentError: ``n`` is not an int >= 1, ``metric`` is not a non-empty string,
            or ``mode`` / ``missing`` is not one of its values.
    """

    n: int
    metric: str
    mode: str = "min"
    missing: str = "keep"

    def __post_init__(self) -> None:
        _check_int("KeepBest n", self.n)
        if not isinstance(self.metric, str) or not self.metric:
            raise InvalidArgumentError(f"KeepBest metric must be a non-empty string, got {self.metric!r}")
        if self.mode not in _MODES:
            raise InvalidArgumentError(f"KeepBest mode must be one of {_MODES}, got {self.mode!r}")
        if self.missing not in _MISSING:
            raise InvalidArgumentError(f"KeepBest missing must be one of {_MISSING}, got {self.missing!r}")

    def ranked(self, checkpoints: Sequence[CheckpointInfo]) -> List[CheckpointInfo]:
        """Checkpoints that have the metric, best first (ties: the earliest commit first).

        Args:
            checkpoints: committed checkpoints.

        Returns:
            Those whose ``metrics`` hold ``metric``, ranked.
        """
        return _rank(checkpoints, self.metric, self.mode)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        """The ``n`` best steps, and (``missing="keep"``) every step without the metric.

        Args:
            checkpoints: every committed checkpoint.

        Returns:
            The steps to keep.
        """
        kept = {c.step for c in self.ranked(checkpoints)[: self.n]}
        if self.missing == "keep":
            kept |= {c.step for c in checkpoints if self.metric not in c.metrics}
        return kept


def _rank(checkpoints: Sequence[CheckpointInfo], metric: str, mode: str) -> List[CheckpointInfo]:
    sign = 1.0 if mode == "min" else -1.0
    have = [c for c in checkpoints if metric in c.metrics]
    return sorted(have, key=lambda c: (sign * c.metrics[metric], c.commit_time, c.step))


def best_checkpoint(checkpoints: Sequence[CheckpointInfo], metric: str, mode: str = "min") -> Optional[CheckpointInfo]:
    """The checkpoint with the best ``metric`` (ties: the earliest commit).

    Args:
        checkpoints: committed checkpoints.
        metric: a key of their ``metrics``.
        mode: ``"min"`` or ``"max"``.

    Returns:
        The best one, or None when none has the metric.

    Raises:
        InvalidArgumentError: ``mode`` is neither ``"min"`` nor ``"max"``.
    """
    if mode not in _MODES:
        raise InvalidArgumentError(f"mode must be one of {_MODES}, got {mode!r}")
    ranked = _rank(checkpoints, metric, mode)
    return ranked[0] if ranked else None


class _CallableRetention:
    """A plain ``fn(checkpoints) -> iterable of steps`` used as a retention policy."""

    def __init__(self, fn: Callable[[Sequence[CheckpointInfo]], Iterable[int]]) -> None:
        self.fn = fn

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        return _steps_from(self.fn(checkpoints), self.fn)

    def __repr__(self) -> str:
        return f"retention({getattr(self.fn, '__name__', repr(self.fn))})"


def _steps_from(result: Any, who: Any) -> Set[int]:
    if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
        raise InvalidArgumentError(f"retention policy {who!r} must return an iterable of steps, got {type(result).__name__}")
    out = set()
    for s in result:
        if isinstance(s, bool) or not isinstance(s, int):
            raise InvalidArgumentError(f"retention policy {who!r} returned a non-integer step {s!r}")
        out.add(s)
    return out


def as_retention_policy(policy: Any) -> RetentionPolicy:
    """A retention policy whose ``keep(checkpoints)`` can be called.

    Args:
        policy: an object with ``keep(checkpoints)``, or a plain callable
            ``fn(checkpoints) -> iterable of steps``.

    Returns:
        ``policy`` itself when it has ``keep``, else an adapter that calls it.

    Raises:
        InvalidArgumentError: ``policy`` has no ``keep`` method and is not callable.
    """
    if callable(getattr(policy, "keep", None)):
        return policy
    if callable(policy):
        return _CallableRetention(policy)
    raise InvalidArgumentError(f"a retention policy needs a keep(checkpoints) method or must be callable, got {type(policy).__name__}")


def apply_retention(policy: RetentionPolicy, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
    """Run a retention policy and check what it returns.

    Args:
        policy: a retention policy as returned by :func:`as_retention_policy`.
        checkpoints: every committed checkpoint, oldest commit first.

    Returns:
        The steps to keep.

    Raises:
        InvalidArgumentError: the policy returned something other than an iterable of ints.
    """
    return _steps_from(policy.keep(checkpoints), policy)


def keeping(policy: RetentionPolicy, step: int) -> RetentionPolicy:
    """``policy``, keeping ``step`` too (a step an explicit request or a restore just put there).

    Args:
        policy: a retention policy as returned by :func:`as_retention_policy`.
        step: the step kept whatever ``policy`` says.

    Returns:
        The policy that keeps what ``policy`` keeps and ``step``.
    """
    return as_retention_policy(lambda cps: apply_retention(policy, cps) | {step})


# ---- composition --------------------------------------------------------------------------------
class AnyOf:
    """Union of policies.

    As a save policy: save when any member wants to. As a retention policy: keep every step any
    member keeps (``AnyOf([KeepBest(3, "loss"), KeepLatest(2)])`` keeps the best 3 and the
    latest 2). Members may be policy objects or plain callables.

    Args:
        policies: the members (at least one).

    Raises:
        InvalidArgumentError: ``policies`` is not a non-empty sequence of policies or callables.
    """

    def __init__(self, policies: Sequence[Any]) -> None:
        if isinstance(policies, (str, bytes)) or not isinstance(policies, Iterable):
            raise InvalidArgumentError(f"AnyOf needs a list of policies, got {type(policies).__name__}")
        self.policies: Tuple[Any, ...] = tuple(policies)
        if not self.policies:
            raise InvalidArgumentError("AnyOf needs at least one policy")
        for p in self.policies:
            if not (callable(p) or callable(getattr(p, "should_save", None)) or callable(getattr(p, "keep", None))):
                raise InvalidArgumentError(f"AnyOf member {p!r} is neither a save policy, a retention policy nor callable")
        self._savers: Optional[Tuple[SavePolicy, ...]] = None

    def should_save(self, step: int, context: Optional[SaveContext] = None) -> bool:
        """Whether any member wants to save (members after the first yes are not asked).

        Args:
            step: the training step.
            context: what the manager knows (None outside a manager).

        Returns:
            True when a member's ``should_save`` is.

        Raises:
            InvalidArgumentError: a member is a retention policy.
        """
        if self._savers is None:
            for p in self.policies:
                if callable(getattr(p, "keep", None)) and not callable(getattr(p, "should_save", None)):
                    raise InvalidArgumentError(f"AnyOf used as a save policy holds a retention policy {p!r}")
            self._savers = tuple(as_save_policy(p) for p in self.policies)
        return any(decide_save(p, step, context) for p in self._savers)  # stops at the first yes

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        """Every step any member keeps.

        Args:
            checkpoints: every committed checkpoint.

        Returns:
            The union of the members' steps.

        Raises:
            InvalidArgumentError: a member is a save policy, or returned something other than
                an iterable of ints.
        """
        kept: Set[int] = set()
        for p in self.policies:
            if callable(getattr(p, "should_save", None)) and not callable(getattr(p, "keep", None)):
                raise InvalidArgumentError(f"AnyOf used as a retention policy holds a save policy {p!r}")
            kept |= apply_retention(as_retention_policy(p), checkpoints)
        return kept

    def __repr__(self) -> str:
        return f"AnyOf({list(self.policies)!r})"


# ---- the job's retention, as manifests record it ------------------------------------------------
#: ``retention_spec``'s value for a policy it cannot describe (a user's class or function)
CUSTOM = "custom"
#: the manifest ``extra`` entry holding :func:`retention_spec` of the job's retention
RETENTION_KEY = "retention"


def retention_spec(policy: Any) -> Optional[Dict[str, Any]]:
    """A JSON description of a retention policy, for the manifests of the persistent root.

    The manager records it in each manifest (``extra["retention"]``) so that tools
    (``async-ckpt prune``) know what the job's own retention keeps.

    Args:
        policy: a retention policy.

    Returns:
        None for :class:`KeepAll` (and an ``AnyOf`` holding it: nothing is ever deleted); a
        dict ``{"policy": name, ...fields}`` for :class:`KeepLatest`, :class:`KeepEveryNSteps`,
        :class:`KeepTimeInterval`, :class:`KeepBest` and ``AnyOf`` of them; ``{"policy":
        "custom", "repr": ...}`` for any other policy.
    """
    if isinstance(policy, KeepAll):
        return None
    if isinstance(policy, (KeepLatest, KeepEveryNSteps, KeepTimeInterval, KeepBest)):
        return {"policy": type(policy).__name__, **{f: getattr(policy, f) for f in policy.__dataclass_fields__}}
    if isinstance(policy, AnyOf):
        members = [retention_spec(p) for p in policy.policies]
        if any(m is None for m in members):
            return None
        return {"policy": "AnyOf", "policies": members}
    return {"policy": CUSTOM, "repr": repr(policy)[:200]}


def retention_from_spec(spec: Any) -> Optional[RetentionPolicy]:
    """The policy :func:`retention_spec` described.

    Args:
        spec: what :func:`retention_spec` returned (read back from a manifest).

    Returns:
        The policy; None when ``spec`` (or a member of it) is a custom policy, or not a
        description this version knows (a tool cannot tell what such a policy keeps).
    """
    kinds = {c.__name__: c for c in (KeepLatest, KeepEveryNSteps, KeepTimeInterval, KeepBest)}
    if not isinstance(spec, dict):
        return None
    name = spec.get("policy")
    try:
        if name == "AnyOf":
            members = [retention_from_spec(m) for m in spec.get("policies") or []]
            return None if not members or any(m is None for m in members) else AnyOf(members)
        cls = kinds.get(name) if isinstance(name, str) else None
        if cls is None:
            return None
        return cls(**{k: v for k, v in spec.items() if k != "policy"})
    except (TypeError, InvalidArgumentError):
        return None


# ---- steps and lookups --------------------------------------------------------------------------
def check_step(step: Any) -> int:
    """``step`` as an int.

    Args:
        step: an int or an object with ``__index__`` (not a bool).

    Returns:
        The step.

    Raises:
        InvalidStepError: ``step`` is not a non-negative integer.
    """
    if isinstance(step, bool):
        raise InvalidStepError(f"step must be a non-negative integer, got {step!r}")
    try:
        s = operator.index(step)
    except TypeError:
        raise InvalidStepError(f"step must be a non-negative integer, got {step!r} ({type(step).__name__})") from None
    if s < 0:
        raise InvalidStepError(f"step must be a non-negative integer, got {s}")
    return s


def find_keep_best(policy: Any) -> Optional[KeepBest]:
    """The :class:`KeepBest` in a retention policy (searched inside ``AnyOf``).

    Args:
        policy: a retention policy.

    Returns:
        ``policy`` itself when it is a ``KeepBest``, the one ``KeepBest`` member of an
        ``AnyOf``, else None.
    """
    if isinstance(policy, KeepBest):
        return policy
    found = [p for p in getattr(policy, "policies", ()) if isinstance(p, KeepBest)]
    return found[0] if len(found) == 1 else None
