"""A save's journey on the training thread once the ranks agreed where it goes: the submission.

:meth:`Submitter.submit` takes the decision (:class:`~.schedule.Due`, from :mod:`.decide`) and
the state dict, and in order:

1. a replication ticket when the save is due at the local tier (peer copies: every rank queues
   the same tickets in the same order);
2. the plan (validated; pickled values warned about), before anything is taken;
3. a writer slot per due root; with a local tier a busy upload is skipped (one process: the
   step goes to the local tier only, listed in ``skipped_uploads``);
4. several ranks: which replicated tensors this rank leaves to the others (one exchange); the
   declared-frozen tensors every due root holds as they are (not copied);
5. staging: one :class:`~async_ckpt.staging.HostSnapshot`, shared by every due root;
6. one :class:`~async_ckpt.jobs.save_job.SaveJob` per due root (its statistics, manifest extra,
   copy identity), queued on the root's writer, the local tier's around its ticket; their
   futures become the save's one future (``last_save_future``);
7. ``save()``: waits for every due root's copy.

One process and N take this one path. Where they differ, it is because the other ranks must
see the same thing: an earlier background failure is raised at the slot with one process, and by
the agreement on every rank together with several (so a slot is taken without raising); a busy
upload is skipped with one process only (with several the ranks would disagree on where the step
is); and a rank that fails after the agreement (its plan, staging, a slot, its local lock) still
queues its part of the persistent root's save as a failed job, so the other ranks' jobs of that
step fail with it instead of waiting for it or pairing with its next step.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from ..errors import CheckpointError
from ..format.manifest import USER_METADATA_KEY, CopyIdentity
from ..gc_pause import gc_paused
from ..jobs.peers import PeerCopies
from ..jobs.preemption import PreemptionTracker
from ..jobs.promote import UploadCatchUp
from ..jobs.replication import Ticket
from ..jobs.roots import LOCAL, Root, Roots
from ..jobs.save_job import SaveJob
from ..jobs.write_queue import all_done
from ..policies import RETENTION_KEY, retention_spec
from ..ranks import phase
from ..ranks.exchange import Exchange
from ..ranks.replicas import DroppedSamples, SaveShares
from ..staging import HostSnapshot, Stager
from ..staging.frozen import FrozenTensors
from ..stats import FALLBACK, UPLOAD_SKIPPED, SaveStats
from .checks import PickledValues
from .schedule import Due

log = logging.getLogger("async_ckpt")

#: runs one save job at one root on its writer thread (the manager's, so that a queued save
#: keeps its manager alive)
Run = Callable[[SaveJob, Root], None]


@dataclass
class _Save:
    """One save on its way through :meth:`Submitter.submit`."""

    step: int
    where: Due
    #: the peer-copy ticket of a save due at the local tier, or None
    ticket: Optional[Ticket]
    #: several ranks, a save due at the persistent root: the root whose job tells the other
    #: ranks that this rank failed after the agreement
    shared: Optional[Root]
    #: seconds of exchanges with the other ranks (the agreement, then the replicated shares)
    exchange_s: float
    #: the roots the save goes to, nearest first
    due: List[Root] = field(default_factory=list)
    #: the roots whose writer slot this save holds
    held: List[Root] = field(default_factory=list)
    #: the persistent root was due, its upload slot busy: the step went to the local tier only
    skipped_upload: bool = False


@dataclass
class _Staged:
    """What staging made of a save: the snapshot, and what it left out."""

    snap: HostSnapshot
    #: keys of the declared-frozen tensors not copied (each root holds them as they are)
    frozen_keys: Set[str]
    #: declared-frozen tensors: each one's version
    frozen_seen: Dict[str, Tuple[int, int]]
    #: bytes in the snapshot that were not copied (declared-frozen tensors)
    kept_bytes: int
    #: several ranks: samples of what this rank leaves to the others, as of the call
    samples: Optional[DroppedSamples]
    queue_wait_s: float
    stage_s: float
    blocking_s: float
    #: ``perf_counter`` when the save call began
    t0: float


class Submitter:
    """Submits each agreed save of a manager to its roots' writers (see the module docstring).

    Args:
        roots: the manager's roots.
        exchange: the manager's exchange.
        stager: the manager's stager (its pool holds the snapshots).
        run_id: names the saves of this manager (``<run_id>.<n>``, with a local tier).
        frozen: the declared-frozen tensors (``frozen=``), or None.
        shares: several ranks: who stages which replicated tensor (``replicated_saves``), or None.
        peers: the peer copies of the local tier, or None.
        catch_up: a local tier: the skipped uploads to make up for, or None.
        preemption: the preemption tracker, or None.
        in_flight: the steps queued or being written (one entry per root's job; shared with the
            writers' side, which removes them).
        wall_clock: the clock of commit times.
        interval_clock: the clock of the save policies' intervals.
        metrics_reduce: how the ranks' metrics become the step's.

    Attributes:
        skipped_uploads: the steps whose upload was skipped (see ``CheckpointManager``).
        saves: saves agreed so far (the same count on every rank).
        last_future: the future of the last save taken, or None.
        pickled: the pickled values already warned about.
    """

    def __init__(self, roots: Roots, exchange: Exchange, stager: Stager, *, run_id: str,
                 frozen: Optional[FrozenTensors], shares: Optional[SaveShares], peers: Optional[PeerCopies],
                 catch_up: Optional[UploadCatchUp], preemption: Optional[PreemptionTracker], in_flight: List[int],
                 wall_clock: Callable[[], float], interval_clock: Callable[[], float], metrics_reduce: str) -> None:
        self.roots, self.exchange, self.stager = roots, exchange, stager
        self.alone = exchange.world_size == 1
        self.run_id = run_id
        self.frozen, self.shares, self.peers = frozen, shares, peers
        self.catch_up, self.preemption = catch_up, preemption
        self.in_flight = in_flight
        self.wall_clock, self.interval_clock = wall_clock, interval_clock
        self.metrics_reduce = metrics_reduce
        self.pickled = PickledValues()
        self.skipped_uploads: List[int] = []
        self.saves = 0
        self.last_future: Optional["Future[int]"] = None

    def submit(self, step: int, state_dict: Mapping[str, Any], where: Due, *, run: Run, force: bool, wait: bool,
               lazy: bool, metrics: Dict[str, float], user_metadata: Optional[Dict[str, Any]],
               exchange_s: float) -> bool:
        """Training thread of every rank, right after the ranks agreed on ``where``.

        Args:
            step: the step.
            state_dict: what to save.
            where: the roots the save is due at (the same on every rank).
            run: runs a job on a root's writer thread.
            force: a forced save (never skips its upload).
            wait: ``save()``: return once every due root's copy committed.
            lazy: stage lazily (return once the copies are issued; not with ``wait``).
            metrics: the save's metrics (validated).
            user_metadata: the save's user metadata (validated), or None.
            exchange_s: seconds the agreement took.

        Returns:
            True when a save was taken; False when no root was due.

        Raises:
            CheckpointError: the state dict cannot be staged, a writer failed earlier (one
                process), another rank could not save the step (``wait``), or a root's save failed
                (``wait``).
        """
        if where.any:  # agreed: every rank counts the same saves, one id per save
            self.saves += 1
        # every rank queues the same replication tickets, in the same order (peer copies)
        ticket = self.peers.expect(step) if self.peers is not None and where.local else None
        persistent, local = self.roots.persistent, self.roots.local
        save = _Save(step, where, ticket, persistent if where.persistent and not self.alone else None, exchange_s)
        # From here on a rank that raises still queues its part of the persistent save, as a
        # failed job: the other ranks' jobs of this step fail with it (never pair with its next).
        try:
            if where.local and local is not None:
                local.store.become_writer()  # this rank's own local directory (taken when opened)
            save.due = [r for r in self.roots if (where.local if r is local else where.persistent)]
            if not save.due:
                if ticket is not None:
                    ticket.release()
                return False
            staged = self._stage(save, state_dict, urgent=wait or force or where.preempt, lazy=lazy and not wait)
        except BaseException as exc:
            self._failed(save, exc, metrics, run)
            if wait and save.shared is not None and isinstance(exc, Exception):
                self.settle("save", exc)  # the others' save() settles too (below): raises exc
            raise
        futures = self._queue(save, staged, metrics, user_metadata, run)
        self.last_future = all_done(futures, step)
        if ticket is not None:
            ticket.release()  # no local job of this save was queued on this rank
        if where.wanted:
            persistent.record_save(step, self.interval_clock())
            if where.preempt and self.preemption is not None:
                self.preemption.mark_saved(step)
        if wait:
            self._wait(save)
        return True

    # ---- the steps of a save -------------------------------------------------------------------
    def _plan(self, state_dict: Mapping[str, Any]) -> Any:
        """The staging plan of ``state_dict`` (validates it); its pickled values warned about."""
        with gc_paused():
            plan = self.stager.plan(state_dict)
        self.pickled.check(plan)
        return plan

    def _stage(self, save: _Save, state_dict: Mapping[str, Any], *, urgent: bool, lazy: bool) -> _Staged:
        """Plan, take the writer slots, share out the replicated tensors, stage."""
        t0 = time.perf_counter()
        planned: Optional[Exception] = None
        plan: Any = None
        try:
            plan = self._plan(state_dict)  # validates before anything is taken or written
        except Exception as exc:  # noqa: BLE001 - several ranks: the exchange below first, then raised
            if self.alone:
                raise
            planned = exc  # every rank takes its slots and queues its part of the save
        plan_s = time.perf_counter() - t0
        # Earlier lazy copies finish and are sealed here, on the training thread: their writers
        # wait for that, so it must come before waiting for a writer slot.
        self.stager.synchronize_staging()
        self._take_slots(save, urgent)
        t1 = time.perf_counter()
        drop: Set[int] = set()
        if self.shares is not None and not save.where.local:  # a local copy holds everything
            tx = time.perf_counter()
            drop = self.shares.drops(self.exchange, None if planned is not None else plan)
            save.exchange_s += time.perf_counter() - tx
        if planned is not None:
            raise planned
        keep: Set[int] = set()
        seen: Dict[str, Tuple[int, int]] = {}
        if self.frozen is not None:  # declared-frozen tensors every due root holds as they are: not copied
            reuses = [r.store.reuse for r in save.due]
            keep, seen = self.frozen.choose(
                plan, lambda key, t, v: all(x is not None and x.holds(key, t, v) for x in reuses))
        keep -= drop
        snap = (self.stager.lazy if lazy else self.stager.eager).stage(state_dict, plan, keep, drop)
        if snap.pending is not None:
            snap.pending.step = save.step
        t2 = time.perf_counter()
        return _Staged(snap, {plan.keys[i] for i in keep}, seen, sum(plan.tensors[i].nbytes for i in keep),
                       # what this rank leaves to the others, as of the call: its values are compared too
                       DroppedSamples(plan, drop) if drop else None,
                       queue_wait_s=t1 - t0 - plan_s, stage_s=plan_s + t2 - t1, blocking_s=t2 - t0, t0=t0)

    def _take_slots(self, save: _Save, urgent: bool) -> None:
        """A writer slot for each due root. One process: an earlier failure is raised here, and
        with a local tier a busy upload is skipped unless the save is ``urgent`` (forced, a
        preemption's, ``save()``): the bucket's save of the step is left out (logged, in stats)
        and the step goes to the local tier. Several ranks: the slot is taken whatever earlier
        failures (the next agreement raises them, on every rank together)."""
        local = self.roots.local
        for tier in list(save.due):
            if not self.alone:
                tier.writer.take_slot()
            elif tier is self.roots.persistent and local is not None and not urgent:
                if not tier.writer.try_slot():
                    save.due.remove(tier)
                    save.skipped_upload = True
                    if not save.where.local:
                        local.store.become_writer()
                        save.due.insert(0, local)
                        local.writer.wait_for_slot()
                        save.held.insert(0, local)
                    continue
            else:
                tier.writer.wait_for_slot()
            save.held.append(tier)

    def _failed(self, save: _Save, exc: BaseException, metrics: Dict[str, float], run: Run) -> None:
        """``exc`` ended the save on this rank: the ticket and the slots are given back; several
        ranks: the persistent root's job is queued as a failed one (it takes the slot and tells
        the other ranks)."""
        if save.ticket is not None:
            save.ticket.release()
        for tier in save.held:
            if tier is not save.shared:
                tier.writer.release_slot()
        shared = save.shared
        if shared is not None:
            if shared not in save.held:
                shared.writer.take_slot()
            failed = SaveJob(save.step, None, metrics, None, time.perf_counter(), local_error=exc)
            shared.writer.submit(functools.partial(run, failed, shared), step=save.step)

    def _queue(self, save: _Save, staged: _Staged, metrics: Dict[str, float],
               user_metadata: Optional[Dict[str, Any]], run: Run) -> List["Future[Any]"]:
        """One job per due root, queued on its writer; their futures."""
        step, snap, local = save.step, staged.snap, self.roots.local
        if save.skipped_upload:
            self.skipped_uploads.append(step)
        snap.share(len(save.due))
        taken_at = self.wall_clock()  # the commit time of this save in every tier (see SaveJob.commit_at)
        futures: List["Future[Any]"] = []
        for tier in save.due:
            job = self._job(save, staged, tier, metrics, user_metadata, taken_at)
            self.in_flight.append(step)
            job_run = functools.partial(run, job, tier)
            try:
                fut = tier.writer.submit(job_run if save.ticket is None or tier is not local
                                         else save.ticket.around(job_run), step=step)
            except BaseException:
                self.in_flight.remove(step)
                if save.ticket is not None:
                    save.ticket.release(failed=tier is local)
                raise
            futures.append(fut)
            if save.skipped_upload and tier is local and self.catch_up is not None:
                first = self.catch_up.skipped(step, self.saves, taken_at, staged.t0, fut)
                (log.warning if first else log.info)(
                    "step %d is not uploaded to %s now: an earlier upload is still running (the step "
                    "is saved to the local tier; the next free upload slot uploads the newest such local copy; "
                    "see CheckpointManager.skipped_uploads)", step, self.roots.persistent.url)
            if tier is not self.roots.persistent:  # the persistent root's save is recorded when wanted
                tier.record_save(step, self.interval_clock())
        return futures

    def _job(self, save: _Save, staged: _Staged, tier: Root, metrics: Dict[str, float],
             user_metadata: Optional[Dict[str, Any]], taken_at: float) -> SaveJob:
        """The save job of one due root: its statistics, manifest extra and copy identity."""
        snap, tiered = staged.snap, self.roots.local is not None
        stats = SaveStats(step=save.step, nbytes=snap.nbytes - staged.kept_bytes, num_tensors=snap.num_tensors,
                          queue_wait_s=staged.queue_wait_s, stage_s=staged.stage_s, blocking_s=staged.blocking_s,
                          exchange_s=save.exchange_s)
        extra: Dict[str, Any] = {} if user_metadata is None else {USER_METADATA_KEY: user_metadata}
        save_id: Optional[str] = None
        if tiered:
            stats.extra["tier"] = tier.name
            if save.skipped_upload:
                stats.extra[UPLOAD_SKIPPED] = True
            if save.where.wanted and not save.where.persistent:  # the checkpoint path could not be reached
                stats.extra[FALLBACK] = True
            save_id = f"{self.run_id}.{self.saves}"
        if tier is self.roots.local:
            identity = CopyIdentity(save_id, LOCAL, self.exchange.rank, self.exchange.world_size, tier.home)
        else:  # what this job's retention keeps, for tools that delete by hand (async-ckpt prune)
            identity = CopyIdentity(save_id)
            spec = retention_spec(tier.retention)
            if spec is not None:
                extra[RETENTION_KEY] = spec
        return SaveJob(save.step, snap, metrics, stats, staged.t0, manifest_extra=extra, identity=identity,
                       metrics_reduce=self.metrics_reduce, commit_at=taken_at if tiered else None,
                       frozen=(staged.frozen_seen, staged.frozen_keys), samples=staged.samples)

    def _wait(self, save: _Save) -> None:
        """``save()``: every due root's copy has landed before one's failure is raised."""
        if save.shared is not None:  # a failure one rank recorded after the agreement: all raise it together
            self.settle("save")
        for tier in save.due:
            tier.writer.wait_idle()
        for tier in save.due:
            tier.writer.join()
        if save.where.wanted and not save.where.persistent:  # the root could not be reached: raised as
            self.roots.persistent.writer.join()               # a failed upload is

    # ---- every pending save --------------------------------------------------------------------
    def settle(self, what: str, invalid: Optional[Exception] = None, key: Optional[int] = None) -> None:
        """Wait for every pending save; raise the failures a save would raise (with a local
        tier, failed writes to ``path`` stay for ``join``/``close``). With several ranks the
        ranks then exchange, before any collective of the caller, whether one holds such a
        failure or an ``invalid`` argument, and ``key`` (which step the caller named): every
        rank raises together (a failing rank its own error, the others a ``CheckpointError``
        naming it) instead of waiting for one that has already raised, and ranks that named
        different steps all raise; ranks in different calls (``what``: "restore" on one, a save
        on another) all raise a ``CoordinationError`` naming them.

        Args:
            what: the caller's operation (``"save"``, ``"restore"``, ``"delete"``, ``"promote"``).
            invalid: several ranks: this rank's argument error, raised on every rank together.
            key: several ranks: what the caller named (every rank must name the same).

        Raises:
            CheckpointError: a pending save failed, or (several ranks) another rank's did or its
                arguments were invalid.
        """
        error: Optional[BaseException] = None if self.alone else invalid  # alone: raised by the caller after
        if error is None:
            try:
                self.stager.synchronize_staging()
                for tier in self.roots:
                    tier.writer.wait_idle()
                for tier in self.roots:
                    tier.writer.raise_if_failed()
            except Exception as exc:
                error = exc
        if not self.alone:
            phase.agree(self.exchange, what, [], error=error, step=key,
                        refused=lambda failed: CheckpointError(f"rank(s) {failed}: an earlier save failed, an argument "
                                                               f"was invalid, or another step was named (see their "
                                                               f"errors)"))
        elif error is not None:
            raise error
