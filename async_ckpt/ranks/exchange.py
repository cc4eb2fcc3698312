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
    """How the ranks of one manager exchange. Rank 0 (``is_primary``) commits and deletes.

    Every exchange names the operation it belongs to (``what``, and ``step`` where one is
    given): ranks that reach exchanges of different operations raise a
    :class:`~async_ckpt.errors.CoordinationError` naming both, on every rank."""

    rank: int
    world_size: int
    #: the process group DCP's collectives (and the writer thread's exchanges) run over
    group: Any

    @property
    def is_primary(self) -> bool: ...

    def agree(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None, what: str = "agree"
              ) -> Tuple[List[bool], List[int]]:
        """Rank 0's ``flags`` on every rank, and the ranks whose ``ok`` was false or whose
        ``step`` is not rank 0's (when both give one) (training thread; one collective)."""

    def agree_signal(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None,
                     signal: bool = False, what: str = "agree") -> Tuple[List[bool], List[int], bool]:
        """:meth:`agree`, and whether ``signal`` is true on any rank, in the same collective."""

    def any_rank(self, flag: bool, what: str = "any_rank") -> bool:
        """Whether ``flag`` is true on any rank (training thread; one collective)."""

    def gather_ints(self, value: int, what: str = "gather_ints") -> List[int]:
        """Every rank's int64 ``value``, by rank (training thread; one small collective)."""

    def gather_objects(self, obj: Any, what: str = "gather_objects") -> List[Any]:
        """Every rank's ``obj``, by rank (training thread; one collective)."""

    def broadcast(self, obj: Any, what: str = "broadcast", step: Optional[int] = None) -> Any:
        """Rank 0's ``obj`` on every rank (writer thread, or the caller after ``join``)."""

    def all_gather(self, obj: Any, what: str = "all_gather", step: Optional[int] = None) -> List[Any]:
        """Every rank's ``obj``, by rank."""

    def dcp(self, what: str, fn: Callable[[], Any], step: Optional[int] = None) -> Any:
        """Run ``fn``, a ``dcp.save``/``dcp.load`` over :attr:`group`, as one of this exchange's
        exchanges (several ranks: an error DCP did not report on every rank breaks it)."""

    def collective(self, fn: Callable[[], None], what: str, step: Optional[int] = None, group: Any = None) -> None:
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

    def agree(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None, what: str = "agree"
              ) -> Tuple[List[bool], List[int]]:
        return [bool(f) for f in flags], ([] if ok else [0])

    def agree_signal(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None,
                     signal: bool = False, what: str = "agree") -> Tuple[List[bool], List[int], bool]:
        return [bool(f) for f in flags], ([] if ok else [0]), bool(signal)

    def any_rank(self, flag: bool, what: str = "any_rank") -> bool:
        return bool(flag)

    def gather_ints(self, value: int, what: str = "gather_ints") -> List[int]:
        return [int(value)]

    def gather_objects(self, obj: Any, what: str = "gather_objects") -> List[Any]:
        return [obj]

    def broadcast(self, obj: Any, what: str = "broadcast", step: Optional[int] = None) -> Any:
        return obj

    def all_gather(self, obj: Any, what: str = "all_gather", step: Optional[int] = None) -> List[Any]:
        return [obj]

    def dcp(self, what: str, fn: Callable[[], Any], step: Optional[int] = None) -> Any:
        return fn()

    def collective(self, fn: Callable[[], None], what: str, step: Optional[int] = None, group: Any = None) -> None:
        fn()


class GroupExchange:
    """N processes: gloo groups of our own over the ranks of the user's process group.

    Every exchange carries a label (:func:`label_row`: which operation, which step) in a
    fixed-size row that is exchanged first (in the same collective where the exchange is a row
    of ints): ranks at different operations (one restoring while another saves) raise the same
    :class:`~async_ckpt.errors.CoordinationError` naming every rank's operation, instead of
    pairing payloads of different sizes (which gloo answers by aborting the process). The
    exchange stays usable: every rank saw the same labels and stopped at the same exchange.
    """

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

    def collective(self, fn: Any, what: str, step: Optional[int] = None, group: Any = None) -> None:
        """Run ``fn`` (one collective over ``group``, default :attr:`group`) as an exchange of
        this exchange, after the ranks compared its label (``what``, ``step``): at once a
        :class:`~async_ckpt.errors.CoordinationError` when an earlier exchange failed or another
        rank is at another exchange; when ``fn`` fails, the exchange is broken from then on.

        Args:
            fn: the collective.
            what: its name, for the label and the error message.
            step: the step it belongs to (None: none).
            group: the group ``fn`` runs over (:attr:`group` or :attr:`control`).

        Raises:
            CoordinationError: this exchange, or an earlier one, failed, or the ranks are at
                different exchanges.
        """
        self._labelled(group if group is not None else self.group, what, step, [])
        self._run(fn, what)

    def _run(self, fn: Any, what: str) -> None:
        self._check(what)
        try:
            fn()
        except Exception as exc:  # gloo: a peer died, or the timeout passed (or this rank could not take part)
            raise self._break(what, exc) from exc

    def _labelled(self, group: Any, what: str, step: Optional[int], values: Sequence[int], *,
                  keyed: bool = True) -> List[List[int]]:
        """Every rank's ``values`` (a fixed number of int64 for a given ``what``), after the ranks'
        labels, exchanged in the same collective, were found equal (``keyed``: ``step`` is part
        of the label; else the caller compares it).

        Raises:
            CoordinationError: a rank's label is not this rank's (every rank raises it, naming
                each rank's operation); or the collective failed (the exchange is broken).
        """
        import torch.distributed as dist

        mine = label_row(what, step, keyed=keyed)
        t = torch.tensor(mine + [int(v) for v in values], dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._run(lambda: dist.all_gather(out, t, group=group), what)
        rows = [o.tolist() for o in out]
        labels = [row[:LABEL_WORDS] for row in rows]
        if any(lab != labels[0] for lab in labels):
            where = "; ".join(f"rank {r}: {label_text(lab)}" for r, lab in enumerate(labels))
            raise CoordinationError(
                f"the ranks are out of step, at different checkpoint operations ({where}): every rank must call the "
                f"manager's save/save_async, restore, delete, join and close in the same order with the same "
                f"step. Every rank raised this at the same exchange, so the manager can still be used once the "
                f"ranks call it in step")
        return [row[LABEL_WORDS:] for row in rows]

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

    def dcp(self, what: str, fn: Callable[[], Any], step: Optional[int] = None) -> Any:
        """Run ``fn``, a ``dcp.save``/``dcp.load`` over :attr:`group`, once the ranks' labels
        (``what``, ``step``) matched: DCP reports a failure of its steps on every rank (a
        ``CheckpointException``); any other error left this rank's collectives out of step with
        the others' (or a collective failed): broken."""
        self._labelled(self.group, what, step, [])
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

    def agree(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None, what: str = "agree"
              ) -> Tuple[List[bool], List[int]]:
        agreed, failed, _ = self.agree_signal(flags, ok, step, what=what)
        return agreed, failed

    def agree_signal(self, flags: Sequence[bool], ok: bool = True, step: Optional[int] = None,
                     signal: bool = False, what: str = "agree") -> Tuple[List[bool], List[int], bool]:
        import torch.distributed as dist

        if len(flags) > _FLAG_SLOTS:
            raise ValueError(f"at most {_FLAG_SLOTS} flags travel in an agreement, got {len(flags)}")
        # A step travels in the int64 row as itself when it fits below _LARGE_STEP; a larger one
        # (steps are any non-negative int, as in one process) as _LARGE_STEP, and then every
        # rank (each sees that marker in the rows) sends its exact step in one more exchange.
        # The step is compared here (a rank at another step is named), not in the label.
        mark = -1 if step is None else int(step) if 0 <= step < _LARGE_STEP else _LARGE_STEP
        padded = [int(bool(f)) for f in flags] + [0] * (_FLAG_SLOTS - len(flags))
        rows = self._labelled(self.control, what, step, padded + [int(bool(signal)), int(bool(ok)), mark], keyed=False)
        steps: List[Optional[int]] = [None if row[-1] < 0 else row[-1] for row in rows]
        if _LARGE_STEP in steps:
            exact: List[Any] = [None] * self.world_size
            mine = None if step is None else str(int(step))  # decimal digits: no size limit
            self.collective(lambda: dist.all_gather_object(exact, mine, group=self.control),
                            f"{what} (large step)", group=self.control)
            steps = [None if e is None else int(e) for e in exact]
        first = steps[0]
        failed = [r for r, (row, s) in enumerate(zip(rows, steps))
                  if not row[-2] or (first is not None and s is not None and s != first)]
        return [bool(v) for v in rows[0][:len(flags)]], failed, any(row[-3] for row in rows)

    def any_rank(self, flag: bool, what: str = "any_rank") -> bool:
        return any(row[0] for row in self._labelled(self.control, what, None, [int(bool(flag))]))

    def gather_ints(self, value: int, what: str = "gather_ints") -> List[int]:
        return [row[0] for row in self._labelled(self.control, what, None, [int(value)])]

    def gather_objects(self, obj: Any, what: str = "gather_objects") -> List[Any]:
        import torch.distributed as dist

        out: List[Any] = [None] * self.world_size
        self.collective(lambda: dist.all_gather_object(out, obj, group=self.control), what, group=self.control)
        return out

    def broadcast(self, obj: Any, what: str = "broadcast", step: Optional[int] = None) -> Any:
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        self.collective(lambda: dist.broadcast_object_list(box, group=self.group, group_src=0), what, step)
        return box[0]

    def all_gather(self, obj: Any, what: str = "all_gather", step: Optional[int] = None) -> List[Any]:
        import torch.distributed as dist

        out: List[Any] = [None] * self.world_size
        self.collective(lambda: dist.all_gather_object(out, obj, group=self.group), what, step)
        return out


#: int64 words of an exchange's label: an 8-byte digest of the whole text, then its first bytes
LABEL_WORDS = 16

#: flags an agreement carries (its row has one size whatever the caller agrees on)
_FLAG_SLOTS = 8


def label_row(what: str, step: Optional[int], keyed: bool = True) -> List[int]:
    """The label of an exchange, as :data:`LABEL_WORDS` int64: a digest of ``what`` and ``step``
    (equal labels: the same operation at the same step), then the text's first bytes (to name it).

    Args:
        what: the operation.
        step: its step, or None.
        keyed: whether ``step`` is part of the label (else the caller compares steps itself).

    Returns:
        The words.
    """
    import hashlib

    text = what if step is None or not keyed else f"{what} (step {step})"
    raw = text.encode("utf-8")
    digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)
    head = raw[:8 * (LABEL_WORDS - 1)].ljust(8 * (LABEL_WORDS - 1), b"\0")
    return [digest] + [int.from_bytes(head[i:i + 8], "little", signed=True) for i in range(0, len(head), 8)]


def label_text(row: Sequence[int]) -> str:
    """The readable part of a :func:`label_row` (its first bytes)."""
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in row[1:LABEL_WORDS])
    return raw.rstrip(b"\0").decode("utf-8", "replace")


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

    Raises:
        CoordinationError: the ranks did not all call it within ``timeout_s``.
        InvalidArgumentError: this rank is not in ``process_group``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return LocalExchange()
    ranks = None if process_group is None else sorted(dist.get_process_group_ranks(process_group))
    size = dist.get_world_size() if ranks is None else len(ranks)
    if size <= 1:
        return LocalExchange()
    try:
        group, control = checkpoint_group(process_group, timeout_s), checkpoint_group(process_group, timeout_s)
    except Exception as exc:  # torch's DistStoreError (a rank came late), gloo's RuntimeError (it left)
        raise CoordinationError(
            f"creating the checkpoint manager's process groups failed: the ranks did not all create their "
            f"CheckpointManager within collective_timeout_s={timeout_s:g} s of each other ({type(exc).__name__}: "
            f"{exc}). Create the CheckpointManager at the same point on every rank (it is collective), or pass a "
            f"larger collective_timeout_s") from exc
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
