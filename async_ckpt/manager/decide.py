"""The save decision across ranks: is a save of a step due, and at which roots.

The pure schedule (:mod:`.schedule`) answers from the roots' policies, clocks and preemption;
:class:`SaveDecision` adds what needs I/O or the other ranks: rank 0 takes the persistent root's
writer lease before a save due there (a root it cannot reach sends the step to the local tier,
when there is one), and with several ranks every rank takes rank 0's decision in one small
exchange (:func:`~async_ckpt.ranks.phase.agree`), together with whether any rank saw a
preemption, whether any rank has a failure to raise, and whether every rank is at the same step.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from ..errors import CheckpointError, LeaseHeldError, StepAlreadyExistsError, StorageError
from ..jobs.preemption import PreemptionTracker
from ..jobs.roots import Root, Roots
from ..ranks import phase
from ..ranks.exchange import Exchange
from .probe import RootProbe
from .schedule import Due, RootState, due_at


def state_of(root: Root) -> RootState:
    """What the save schedule needs of ``root``."""
    return RootState(root.policy, root.last_save_time, root.last_save_step, root.writer.pending > 0)


class SaveDecision:
    """Where a save of a step goes, the same on every rank.

    Args:
        roots: the manager's roots.
        exchange: the manager's exchange.
        probe: the persistent root's probe (the first save there checks it can be written).
        preemption: the preemption tracker, or None (``chkpt_on_preemption`` off).
        interval_clock: the clock time-based policies measure intervals with.

    Attributes:
        restored: the step the manager last restored, or None (set by the manager's restore: a
            save below the highest committed step is warned about unless a restore explains it).
    """

    def __init__(self, roots: Roots, exchange: Exchange, probe: RootProbe, preemption: Optional[PreemptionTracker],
                 interval_clock: Callable[[], float]) -> None:
        self.roots, self.exchange, self.probe = roots, exchange, probe
        self.preemption = preemption
        self.interval_clock = interval_clock
        self.start_time = interval_clock()
        self.restored: Optional[int] = None
        #: whether a save may replace an existing step (the manager's ``overwrite``)
        self.overwrite = True

    def schedule(self, step: int, force: bool, preempt: bool) -> Due:
        """The save schedule's answer for ``step`` now (no I/O)."""
        local = self.roots.local
        return due_at(step, force=force, preempt=preempt, now=self.interval_clock(), start_time=self.start_time,
                      persistent=state_of(self.roots.persistent), local=None if local is None else state_of(local))

    def due(self, step: int) -> bool:
        """Whether a save is due at ``step`` now (a preemption not taken yet counts)."""
        preempt = self.preemption.due(step) if self.preemption is not None else False
        return self.schedule(step, False, preempt).any

    def where(self, step: int, force: bool, invalid: Optional[Exception] = None) -> Due:
        """Which roots a save of ``step`` goes to, the same on every rank (rank 0 decides).

        When the persistent root is due, rank 0 takes its writer lease first
        (:meth:`claim_persistent`). With several ranks the ranks then agree (:meth:`_agree`). A
        root that cannot be reached raises :class:`StorageError` without a local tier; with
        one, that error is kept as the failure of this step's upload (logged now, raised by
        ``join()``/``close()`` on every rank), the step goes to the local tier instead, and the
        next step due for the root tries the lease again.

        Args:
            step: the step.
            force: save whatever the policies say.
            invalid: this rank's step or metrics did not validate: raised at once in one process;
                with several ranks this rank decides nothing, says so in the exchange and raises
                that error, the other ranks a ``CheckpointError`` naming it.

        Returns:
            Where the save goes.

        Raises:
            InvalidArgumentError: ``invalid`` (raised as it is; several ranks: after the agreement).
            CheckpointError: an earlier background save failed (each root's failure is raised once;
                several ranks: on every rank together, by the agreement), or another rank could
                not save the step.
            LeaseHeldError: another live writer holds the persistent root's lease.
            StorageError: the root cannot be reached (without a local tier).
            StepAlreadyExistsError: the step may not be written there (another program's directory,
                :class:`~async_ckpt.errors.ForeignStepError`; an existing step, ``overwrite=False``).
        """
        alone = self.exchange.world_size == 1
        if alone:  # with several ranks the agreement raises these, on every rank together
            if invalid is not None:
                raise invalid
            self.raise_failed_saves()
        storage = self.roots.persistent.store.storage
        preempt = False
        if invalid is None and self.preemption is not None:
            preempt = self.preemption.due(step)
        held: Optional[LeaseHeldError] = None
        unreachable: Optional[StorageError] = None
        while True:
            due = self.schedule(step, force, preempt) if invalid is None else Due(False, False, False, False)
            held = unreachable = None
            if due.persistent and self.exchange.is_primary:
                try:
                    self.claim_persistent(step)
                except StepAlreadyExistsError as exc:  # the caller's to fix: never a fallback to the local tier
                    if alone:
                        raise
                    invalid, due = exc, Due(False, False, False, False)
                except LeaseHeldError as exc:
                    if alone:
                        raise
                    held = exc
                except (StorageError, OSError) as exc:
                    unreachable = StorageError(f"step {step}: the checkpoint path {storage.url} cannot be "
                                               f"reached (taking its writer lease failed): {type(exc).__name__}: "
                                               f"{exc}", step=step)
                    unreachable.__cause__ = exc
                    if self.roots.local is None and alone:
                        raise unreachable from exc
            reached = unreachable is None
            if alone:
                break
            # one exchange per call: rank 0's decision, and whether any rank saw a preemption
            agreed, lease_ok, reached, signalled = self._agree(step, due, held is None, reached, invalid,
                                                               preempt and invalid is None)
            if signalled and not agreed.preempt:
                # a preemption one rank detected (a signal to one host) is every rank's checkpoint
                # and every rank's last step, whatever rank 0's own signal handler saw: decided
                # again with it (a second exchange, at a preemption only)
                if not preempt and self.preemption is not None:
                    self.preemption.adopt(step)
                preempt = True
                continue
            due = agreed
            if due.persistent and not lease_ok:
                raise held or LeaseHeldError(
                    f"rank 0 could not take the writer lease of {storage.url}; see rank 0's error")
            break
        if not due.persistent or reached:
            return due
        if unreachable is None:
            unreachable = StorageError(f"step {step}: rank 0 could not reach the checkpoint path "
                                       f"{storage.url}; see rank 0's error", step=step)
        if self.roots.local is None:
            raise unreachable
        self.roots.persistent.writer.add_failure(step, unreachable)  # logged now, raised by join()/close()
        return Due(False, True, due.preempt, True)

    def claim_persistent(self, step: int) -> None:
        """Rank 0, before a save due at the persistent root: the root is writable, its writer
        lease is held, the step may be written there (not another program's directory; with
        ``overwrite=False``, not an existing step) and a save below the highest committed step
        is warned about once."""
        self.probe.ensure_writable()  # a manager that only lists and restores needs only read access
        store = self.roots.persistent.store
        store.become_writer()
        store.refuse_existing(step, self.overwrite)
        store.warn_if_lower(step, self.restored)

    def _agree(self, step: int, due: Due, lease_ok: bool, reached: bool, invalid: Optional[Exception],
               preempt: bool = False) -> Tuple[Due, bool, bool, bool]:
        """Several ranks: rank 0's decision, lease and reachability, taken by every rank.

        Time-based policies, preemption signals and "nothing in flight" conditions can answer
        differently per rank. Every rank also says whether its writers hold a failure the next
        save raises, or its step or metrics are invalid, and which step it saves (a rank at
        another step fails the exchange): a rank raising alone would leave the others waiting.
        Returns the decision, lease and reachability, and whether any rank's ``preempt`` was set."""
        error: Optional[BaseException] = invalid
        if error is None and any(r.writer.failed() for r in self.roots):
            error = phase.attempt(self.exchange, self.raise_failed_saves)[0]  # the failure a save raises here

        def refused(failed: List[int]) -> CheckpointError:
            return CheckpointError(f"step {step}: not saved: rank(s) {failed} could not save it (an earlier "
                                   f"background save failed there, its step or metrics were invalid, or it "
                                   f"was called with another step than rank 0; see their errors)",
                                   step=step if isinstance(step, int) else None)

        (take, take_local, rank0_preempt, lease_ok, reached), signalled = phase.agree(
            self.exchange, "save_async", [due.persistent, due.local, due.preempt, lease_ok, reached], error=error,
            step=step if invalid is None else None, signal=preempt, refused=refused)
        return Due(take, take_local, rank0_preempt, take), lease_ok, reached, signalled

    def raise_failed_saves(self) -> None:
        """Raise the first root's background failure a save raises (each raised once)."""
        for root in self.roots:
            root.writer.raise_if_failed()
