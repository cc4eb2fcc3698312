"""The one rank protocol: a phase that every rank of a manager runs.

A save, a restore, a deletion and the tiers' listings are sequences of phases. In a phase each
rank runs its part (:func:`everyone`) or rank 0 alone does (:func:`primary`); the outcomes are
exchanged through the manager's :class:`~.exchange.Exchange`; if any rank failed, every rank
raises the same typed error, whose message and ``failures`` name the failures by rank (the
rank that failed raises its own error, with ``failures`` filled in). Every rank reaches the same
exchanges in the same order whatever fails, so a failure on one rank becomes an error on every
rank instead of a hang (a rank that dies makes the others' exchange time out). The training
thread's decisions (:func:`agree`: is a save due, did any rank see a preemption, are the ranks
at the same step) travel as one small row on the exchange's control group.

One rule for a rank's own failure before an exchange (:func:`attempt`): with several ranks it
is kept and exchanged (a ``KeyboardInterrupt`` too, re-raised after the exchange: the other
ranks must learn of it); with one process it is raised at once, as raised (or, where the
caller must undo something first, kept for the phase, a ``KeyboardInterrupt`` or
``SystemExit`` still raised at once).

With one process a phase is a plain call: the part runs and its error propagates as raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

from .. import errors as _errors
from ..errors import CheckpointError, CorruptCheckpointError, PartlyWrittenError, RankFailure
from ..io.dcp_call import unwrap_dcp
from .exchange import Exchange

T = TypeVar("T")


@dataclass
class _Outcome:
    value: Any
    failure: Optional[RankFailure]


def attempt(exchange: Exchange, fn: Callable[[], T], *, keep_alone: bool = False
            ) -> Tuple[Optional[BaseException], Optional[T]]:
    """This rank's part before a phase, its failure kept for the phase (the module docstring).

    Args:
        exchange: the manager's exchange.
        fn: the part.
        keep_alone: with one process too, keep the failure (the caller undoes something
            before the phase raises it); a ``KeyboardInterrupt`` or ``SystemExit`` is still
            raised at once.

    Returns:
        ``(None, fn's result)``, or ``(its error, None)``.

    Raises:
        BaseException: with one process, ``fn``'s error, at once, as raised (no other rank to
            tell); with ``keep_alone`` only a ``KeyboardInterrupt`` or ``SystemExit``.
    """
    try:
        return None, fn()
    except BaseException as exc:  # noqa: BLE001 - kept for the phase, which raises it (module docstring)
        if exchange.world_size == 1 and (not keep_alone or isinstance(exc, (KeyboardInterrupt, SystemExit))):
            raise
        return exc, None


def everyone(exchange: Exchange, what: str, step: Optional[int], fn: Optional[Callable[[], T]] = None, *,
             error: Optional[BaseException] = None) -> List[Optional[T]]:
    """Run ``fn`` on every rank and gather the results.

    Args:
        exchange: the manager's exchange.
        what: the phase's name, for the error message ("writing", "restore checks").
        step: the step the phase concerns (named by the error raised).
        fn: this rank's part; None: nothing to run (the rank only reports ``error``).
        error: a failure this rank already had before the phase: reported instead of running ``fn``.

    Returns:
        Every rank's result of ``fn``, by rank (None where a rank ran nothing).

    Raises:
        CheckpointError: (or the failing error's own class) on every rank when any rank's part
            failed or reported ``error``.
    """
    if exchange.world_size == 1:
        if error is not None:
            _, own = unwrap_dcp(error)  # as the exchange raised it: DCP's wrapper off, the step named
            raise own.with_context(step=step) if isinstance(own, CheckpointError) else own
        return [fn() if fn is not None else None]
    local, value = (error, None) if error is not None or fn is None else attempt(exchange, fn, keep_alone=True)
    outcome = _Outcome(value, None if local is None else failure_of(exchange.rank, local))
    outcomes: List[_Outcome] = exchange.all_gather(outcome, what, step)
    raise_if_failed([o.failure for o in outcomes], step, what, local)
    return [o.value for o in outcomes]


def own(exchange: Exchange, what: str, step: Optional[int], fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; each rank keeps its own result (only failures are exchanged).

    For user code whose result stays on its rank (a ``Stateful`` target's ``state_dict()``):
    a failure on one rank is an error on every rank, at once.

    Args:
        exchange: the manager's exchange.
        what: the phase's name, for the error message.
        step: the step the phase concerns (named by the error raised).
        fn: this rank's part.

    Returns:
        This rank's result of ``fn``.

    Raises:
        CheckpointError: (or the failing error's own class) on every rank when any rank's part
            failed; one process: ``fn``'s error as raised.
    """
    if exchange.world_size == 1:
        return fn()
    local, value = attempt(exchange, fn, keep_alone=True)
    everyone(exchange, what, step, error=local)
    return value  # type: ignore[return-value]  # (set: everyone raised otherwise)


def primary(exchange: Exchange, what: str, step: Optional[int], fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and hand its result to every rank.

    Args:
        exchange: the manager's exchange.
        what: the phase's name, for the error message ("commit").
        step: the step the phase concerns (named by the error raised).
        fn: rank 0's part.

    Returns:
        Rank 0's result, on every rank.

    Raises:
        CheckpointError: (or the failing error's own class) on every rank when rank 0's part failed.
    """
    if exchange.world_size == 1:
        return fn()
    local: Optional[BaseException] = None
    out: Optional[_Outcome] = None
    if exchange.is_primary:
        local, value = attempt(exchange, fn, keep_alone=True)
        out = _Outcome(value, None if local is None else failure_of(exchange.rank, local))
    out = exchange.broadcast(out, what, step)
    assert out is not None
    raise_if_failed([out.failure], step, what, local)
    return out.value


def agree(exchange: Exchange, what: str, flags: Sequence[bool], *, error: Optional[BaseException] = None,
          step: Optional[int] = None, signal: bool = False,
          refused: Callable[[List[int]], CheckpointError]) -> Tuple[List[bool], bool]:
    """The training thread's agreement: rank 0's ``flags`` on every rank, in one small exchange on
    the control group (no objects pickled).

    Every rank says whether it has a failure it must raise (``error``), which step it is at
    (``step``: a rank at another step than rank 0's fails the agreement) and ``signal`` (whether
    any rank had it set is the answer's second part): a rank that raised alone would leave the
    others waiting at their next exchange.

    Args:
        exchange: the manager's exchange.
        what: the operation agreed on ("save_async", "restore"): ranks at different operations
            raise :class:`~async_ckpt.errors.CoordinationError` naming both.
        flags: rank 0's decision (this rank's, on rank 0).
        error: this rank's failure to raise, or None.
        step: the step this rank is at (None: not compared).
        signal: this rank's signal (a preemption it saw).
        refused: the error the other ranks raise, given the ranks that failed.

    Returns:
        Rank 0's flags, and whether any rank's ``signal`` was set.

    Raises:
        BaseException: ``error``, on this rank, when any rank failed the agreement.
        CheckpointError: ``refused(ranks)`` on the others.
    """
    agreed, failed, signalled = exchange.agree_signal(list(flags), ok=error is None, step=step, signal=signal,
                                                      what=what)
    if error is not None:
        raise error
    if failed:
        raise refused(failed)
    return agreed, signalled


def failure_of(rank: int, exc: BaseException) -> RankFailure:
    """``exc`` raised on ``rank``, as it is exchanged between ranks.

    Args:
        rank: this rank.
        exc: its error (DCP's ``CheckpointException`` is unwrapped and names the rank that failed).

    Returns:
        The :class:`~async_ckpt.errors.RankFailure` to exchange.
    """
    where, err = unwrap_dcp(exc)
    if where is None and isinstance(err, PartlyWrittenError) and err.__cause__ is not None:
        where, _ = unwrap_dcp(err.__cause__)  # DCP's failure, wrapped after this rank wrote: whose it was
    return RankFailure(rank if where is None else where, type(err).__name__, str(err))


def raise_if_failed(failures: Sequence[Optional[RankFailure]], step: Optional[int], what: str,
                    local: Optional[BaseException] = None) -> None:
    """Raise the phase's error on this rank if any rank failed.

    Args:
        failures: every rank's failure (None where a rank succeeded), by rank.
        step: the step of the phase.
        what: the phase's name.
        local: this rank's own error, if it had one: raised as the error of the phase (its
            class, message and traceback kept, ``step`` and ``failures`` named:
            :meth:`~async_ckpt.errors.CheckpointError.with_context`); an error that is not a
            :class:`~async_ckpt.errors.CheckpointError` is wrapped in one.

    Raises:
        CheckpointError: of the first failure's class where it is one of async_ckpt's, naming
            every failure by rank; a :class:`~async_ckpt.errors.CorruptCheckpointError` only if
            every rank's failure is one (so that the ranks fall back past a step together).
            KeyboardInterrupt and SystemExit are re-raised as they are.
    """
    bad = list(dict.fromkeys(f for f in failures if f is not None))  # DCP gives every rank the same one
    if not bad:
        return
    if local is not None and isinstance(local, (KeyboardInterrupt, SystemExit)):
        raise local
    summary = "; ".join(f"rank {f.rank}: {f.kind}: {f.message}" for f in bad)
    message = f"step {step}: {what} failed: {summary}" if step is not None else f"{what} failed: {summary}"
    # Damage (a restore falls back past it) only if every rank's failure is damage, so that the
    # ranks fall back together or not at all: else the first failure that is not damage decides.
    damage = [_is_damage(f.kind) for f in bad]
    first = bad[0] if all(damage) else bad[damage.index(False)]
    if local is not None:
        _, own = unwrap_dcp(local)
        if isinstance(own, CorruptCheckpointError) and not all(damage):
            raise _rebuild(first.kind, message, step, bad) from own
        if isinstance(own, CheckpointError):
            raise own.with_context(step=step, failures=bad)
        raise CheckpointError(message, step=step, failures=bad) from own
    raise _rebuild(first.kind, message, step, bad)


def _is_damage(kind: str) -> bool:
    cls = getattr(_errors, kind, None)
    return isinstance(cls, type) and issubclass(cls, CorruptCheckpointError)


def _rebuild(kind: str, message: str, step: Optional[int], failures: Sequence[RankFailure]) -> CheckpointError:
    cls = getattr(_errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    try:
        return cls(message, step=step, failures=failures)
    except TypeError:
        return CheckpointError(message, step=step, failures=failures)
