"""The one thing that differs between one process and N: how ranks exchange.

A save or restore runs the same phases everywhere (:mod:`.phase`); at each phase boundary the
ranks exchange outcomes through an :class:`Exchange`. For one process, :class:`LocalExchange`
answers every exchange with the local value. For N, :class:`GroupExchange` uses two gloo groups
of its own (one for the writer thread, one for the training thread's agreements), created once
per manager, so checkpoint traffic never interleaves with training collectives, and with a
bounded timeout, so a rank that dies makes the others raise instead of waiting for gloo's
30-minute default. After a failed exchange (a timeout, a peer gone, a rank that left one of
DCP's collectives early) the ranks' exchanges over those groups can no longer be paired: the
exchange is then *broken*, and every later exchange raises
:class:`~async_ckpt.errors.CoordinationError` at once, naming the first failure. A DCP call
over the group (:meth:`Exchange.dcp`) counts as one of its exchanges.

Nothing else lives here: what the ranks exchange, and what they do with it, is the phases'.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch

from ..errors import CoordinationError, InvalidArgumentError

#: How long a collective waits for the other ranks before it fails (seconds).
DEFAULT_TIMEOUT_S = 300.0

#: Steps from here on do not travel in :meth:`GroupExchange.agree`'s int64 row (int64's
#: largest value marks them; their digits are exchanged instead).
_LARGE_STEP = 2**63 - 1


class Exchange(Protocol):
    """How the ranks of one manager exchange. Rank 0 (``is_primary``) commits and deletes."""

    rank: int
    world_size: int
    #: the process group DCP's collectives (and the writer thread's exchanges) run over
    group: Any

    @property
    def is_primary(self) -> bool: ...

    def agree(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None
              ) -> Tuple[List[bool], List[int]]:
        """Rank 0's ``flags`` on every rank, and the ranks whose ``ok`` was false or whose
        ``step`` is not rank 0's (when both give one) (training thread; one collective)."""

    def agree_signal(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None,
                     signal: bool = False) -> Tuple[List[bool], List[int], bool]:
        """:meth:`agree`, and whether ``signal`` is true on any rank, in the same collective."""

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (training thread; one collective)."""

    def gather_ints(self, value: int) -> List[int]:
        """Every rank's int64 ``value``, by rank (training thread; one small collective)."""

    def gather_objects(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, by rank (training thread; one collective)."""

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (writer thread, or the caller after ``join``)."""

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, by rank."""

    def dcp(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, a ``dcp.save``/``dcp.load`` over :attr:`group`, as one of this exchange's
        exchanges (several ranks: an error DCP did not report on every rank breaks it)."""

    def collective(self, fn: Callable[[], None], what: str) -> None:
        """Run ``fn``, one collective over :attr:`group`, as one of this exchange's exchanges."""


class LocalExchange:
    """One process: every exchange is the local value."""

    rank = 0
    world_size = 1
    is_primary = True

    def __init__(self, group: Any = None) -> None:
        #: a one-rank process group when other ranks exist (a rank's own local tier), so that
        #: DCP never runs collectives over the default group for it
        self.group = group

    def agree(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None
              ) -> Tuple[List[bool], List[int]]:
        return [bool(f) for f in flags], ([] if ok else [0])

    def agree_signal(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None,
                     signal: bool = False) -> Tuple[List[bool], List[int], bool]:
        return [bool(f) for f in flags], ([] if ok else [0]), bool(signal)

    def any_rank(self, flag: bool) -> bool:
        return bool(flag)

    def gather_ints(self, value: int) -> List[int]:
        return [int(value)]

    def gather_objects(self, obj: Any) -> List[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_gather(self, obj: Any) -> List[Any]:
        return [obj]

    def dcp(self, what: str, fn: Callable[[], Any]) -> Any:
        return fn()

    def collective(self, fn: Callable[[], None], what: str) -> None:
        fn()


class GroupExchange:
    """N processes: gloo groups of our own over the ranks of the user's process group."""

    def __init__(self, group: Any, control: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import torch.distributed as dist

        self.group = group
        #: the training thread's agreements (the writer thread owns ``group`` while saves are
        #: pending; two threads must never share one group)
        self.control = control
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        #: the first failed exchange (None: none yet); once set, every exchange raises at once
        self.broken: Optional[str] = None

    def collective(self, fn: Any, what: str) -> None:
        """Run ``fn`` (one collective over :attr:`group` or :attr:`control`) as an exchange of
        this exchange: at once a :class:`~async_ckpt.errors.CoordinationError` when an
        earlier exchange failed; when ``fn`` fails, the exchange is broken from then on.

        Args:
            fn: the collective.
            what: its name, for the error message.

        Raises:
            CoordinationError: this exchange, or an earlier one, failed.
        """
        self._check(what)
        try:
            fn()
        except Exception as exc:  # gloo: a peer died, or the timeout passed (or this rank could not take part)
            raise self._break(what, exc) from exc

    def _check(self, what: str) -> None:
        if self.broken is not None:
            raise CoordinationError(
                f"checkpoint coordination ({what}) refused: an earlier exchange between the ranks failed (a rank "
                f"died or did not take part within collective_timeout_s={self.timeout_s:g} s: {self.broken}), so "
                f"this manager's exchanges can no longer be paired between the ranks; it "
                f"cannot save or restore any more. Close it and create a new CheckpointManager on every rank "
                f"(committed steps are kept)")

    def _break(self, what: str, exc: BaseException) -> CoordinationError:
        """Mark the exchange broken by ``exc`` (the first failure is kept); the error to raise."""
        first = self.broken is None
        if first:
            self.broken = f"{what}: {type(exc).__name__}: {exc}"
        return CoordinationError(
            f"checkpoint coordination ({what}) failed: another rank died or did not take part within "
            f"collective_timeout_s={self.timeout_s:g} s: {exc}. "
            + ("Every later save or restore of this manager raises at once: close it and create a new "
               "CheckpointManager on every rank" if first else f"(earlier: {self.broken})"))

    def dcp(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, a ``dcp.save``/``dcp.load`` over :attr:`group`: DCP reports a failure of its
        steps on every rank (a ``CheckpointException``); any other error left this rank's
        collectives out of step with the others' (or a collective failed): broken."""
        self._check(what)
        try:
            return fn()
        except BaseException as exc:
            if not _reported_by_dcp(exc):
                self._break(what, exc)
            raise

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    def agree(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None
              ) -> Tuple[List[bool], List[int]]:
        agreed, failed, _ = self.agree_signal(flags, ok, step)
        return agreed, failed

    def agree_signal(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None,
                     signal: bool = False) -> Tuple[List[bool], List[int], bool]:
        import torch.distributed as dist

        # A step travels in the int64 row as itself when it fits below _LARGE_STEP; a larger one
        # (steps are any non-negative int, as in one process) as _LARGE_STEP, and then every
        # rank (each sees that marker in the rows) sends its exact step in one more exchange.
        mark = -1 if step is None else int(step) if 0 <= step < _LARGE_STEP else _LARGE_STEP
        t = torch.tensor([int(bool(f)) for f in flags] + [int(bool(signal)), int(bool(ok)), mark], dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.collective(lambda: dist.all_gather(out, t, group=self.control), "agree")
        rows = [o.tolist() for o in out]
        steps: List[Optional[int]] = [None if row[-1] < 0 else row[-1] for row in rows]
        if _LARGE_STEP in steps:
            exact: List[Any] = [None] * self.world_size
            mine = None if step is None else str(int(step))  # decimal digits: no size limit
            self.collective(lambda: dist.all_gather_object(exact, mine, group=self.control), "agree (large step)")
            steps = [None if e is None else int(e) for e in exact]
        first = steps[0]
        failed = [r for r, (row, s) in enumerate(zip(rows, steps))
                  if not row[-2] or (first is not None and s is not None and s != first)]
        return [bool(v) for v in rows[0][:-3]], failed, any(row[-3] for row in rows)

    def any_rank(self, flag: bool) -> bool:
        import torch.distributed as dist

        t = torch.tensor([int(bool(flag))], dtype=torch.int64)
        self.collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control), "any_rank")
        return bool(t.item())

    def gather_ints(self, value: int) -> List[int]:
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.collective(lambda: dist.all_gather(out, t, group=self.control), "gather_ints")
        return [int(o.item()) for o in out]

    def gather_objects(self, obj: Any) -> List[Any]:
        import torch.distributed as dist

        out: List[Any] = [None] * self.world_size
        self.collective(lambda: dist.all_gather_object(out, obj, group=self.control), "gather_objects")
        return out

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        self.collective(lambda: dist.broadcast_object_list(box, group=self.group, group_src=0), "broadcast")
        return box[0]

    def all_gather(self, obj: Any) -> List[Any]:
        import torch.distributed as dist

        out: List[Any] = [None] * self.world_size
        self.collective(lambda: dist.all_gather_object(out, obj, group=self.group), "all_gather")
        return out

def _reported_by_dcp(exc: BaseException) -> bool:
    """Whether ``exc`` (raised out of a ``dcp.save``/``dcp.load`` call) is, or was caused by, DCP's
    ``CheckpointException``: a failure DCP gathered and raised on every rank, after the same
    collectives everywhere."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen: Optional[BaseException] = exc
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, CheckpointException):
            return True
        seen = seen.__cause__
    return False


def rank_local_exchange(timeout_s: float = DEFAULT_TIMEOUT_S) -> LocalExchange:
    """An exchange for what this rank alone writes and reads (its local tier): with other
    ranks, over a new gloo group of this rank only (made without the other ranks)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return LocalExchange()
    group = dist.new_group(ranks=[dist.get_rank()], backend="gloo", timeout=datetime.timedelta(seconds=timeout_s),
                           use_local_synchronization=True)
    return LocalExchange(group)


def exchange_for(process_group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> "LocalExchange | GroupExchange":
    """The exchange for ``process_group`` (default: all ranks): a :class:`GroupExchange`
    with two new gloo groups when ``torch.distributed`` is initialised with more than one rank,
    else a :class:`LocalExchange`.

    Collective when distributed: must be called on every rank of ``process_group`` (of the
    default group when it is ``None``), in the same order as other ``new_group`` calls.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return LocalExchange()
    ranks = None if process_group is None else sorted(dist.get_process_group_ranks(process_group))
    size = dist.get_world_size() if ranks is None else len(ranks)
    if size <= 1:
        return LocalExchange()
    group, control = checkpoint_group(process_group, timeout_s), checkpoint_group(process_group, timeout_s)
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        raise InvalidArgumentError("CheckpointManager was created on a rank outside its process_group")
    return GroupExchange(group, control, timeout_s)


def checkpoint_group(process_group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A new gloo group over the ranks of ``process_group`` (default: all ranks), whose
    operations fail after ``timeout_s``: each thread of a manager that exchanges with the other
    ranks gets one of its own.

    Collective: must be called on every rank of ``process_group`` (of the default group when it
    is ``None``), in the same order as other ``new_group`` calls.

    Args:
        process_group: the user's process group, or None.
        timeout_s: how long an operation waits for the other ranks.

    Returns:
        The group.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if process_group is None:
        return dist.new_group(backend="gloo", timeout=timeout)
    # a subgroup: only its members take part in creating ours
    ranks = sorted(dist.get_process_group_ranks(process_group))
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)
