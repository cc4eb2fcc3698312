"""The writer threads' side of a manager: one save job at one root, and what follows its commit.

:meth:`Persister.persist` runs on a root's writer thread (:class:`~async_ckpt.jobs.write_queue.WriteQueue`):
the save job (:func:`~async_ckpt.jobs.save_job.run_save`), then the statistics, the stats log
and the user's ``on_saved`` callback (none of which can fail a committed save). A local save
makes room on a full ``local_dir`` first; the persistent root's writer, still in its upload
slot, uploads the newest local copy of the saves that skipped the upload meanwhile
(:class:`~async_ckpt.jobs.promote.UploadCatchUp`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Deque, List, Optional

from ..errors import FrozenTensorChangedError
from ..io.planners import save_planner_for
from ..io.writer_process import WriterProcess
from ..jobs.local_tier import make_room, out_of_space, refuse_foreign_save, space_needed
from ..jobs.promote import UploadCatchUp, save_number
from ..jobs.roots import LOCAL, Root, Roots
from ..jobs.save_job import FROZEN_CHANGED, SaveJob, run_save
from ..policies import CheckpointInfo
from ..ranks.exchange import Exchange
from ..stats import FAILED, SaveStats
from ..storage.stats_log import StatsLog

log = logging.getLogger("async_ckpt")


class Persister:
    """Runs a manager's save jobs on its roots' writer threads.

    Args:
        roots: the manager's roots.
        exchange: the manager's exchange.
        threads: files written at once per rank.
        verify: check CRC-32Cs (a skipped upload's local copy is read verified).
        wall_clock: the clock of commit times.
        stats: where each committed save's statistics go (the manager's ``stats``).
        stats_log: the stats log, or None.
        on_saved: the user's callback, or None.
        catch_up: skipped uploads to make up for (a local tier, one process), or None.
        in_flight: the steps queued or being written (one entry per root's job).
        writer_process: the writer process that writes local files (``writer="process"``), or None.
    """

    def __init__(self, roots: Roots, exchange: Exchange, *, threads: int, verify: bool,
                 wall_clock: Callable[[], float], stats: Deque[SaveStats], stats_log: Optional[StatsLog],
                 on_saved: Optional[Callable[[SaveStats], None]], catch_up: Optional[UploadCatchUp],
                 in_flight: List[int], writer_process: Optional[WriterProcess] = None) -> None:
        self.roots, self.exchange = roots, exchange
        self.threads, self.verify, self.wall_clock = threads, verify, wall_clock
        self.stats, self.stats_log, self.on_saved = stats, stats_log, on_saved
        self.catch_up = catch_up
        self.in_flight = in_flight
        self.writer_process = writer_process

    def persist(self, job: SaveJob, tier: Root) -> None:
        """Writer thread of ``tier``: the save job, then statistics and the user's callback. A
        local save of a step another job's copy holds fails (``ForeignCopyError``); one that
        finds ``local_dir`` full first deletes the copies retention drops once it commits
        (see :func:`~async_ckpt.jobs.local_tier.make_room`), and again after failing for want of
        space. The persistent root's writer then, still in its upload slot, uploads the newest
        local copy of the saves that skipped the upload meanwhile (``UploadCatchUp``)."""
        local, catch_up = self.roots.local, self.catch_up
        if tier is not self.roots.persistent or local is None or catch_up is None:
            self._persist_job(job, tier)
            return
        try:
            self._persist_job(job, tier)
        except Exception as exc:  # kept (and logged) now, before the failures of the uploads that follow
            tier.writer.add_failure(job.step, exc)
        finally:
            catch_up.run(local, tier, verify=self.verify, threads=self.threads, committed=self.after_commit,
                         failed=tier.writer.add_failure)

    def _persist_job(self, job: SaveJob, tier: Root) -> None:
        coming: Optional[CheckpointInfo] = None
        if tier is self.roots.local:
            refuse_foreign_save(tier, job.step, job.snap)
            if job.snap is not None:  # a full local_dir: drop now what retention drops after this save
                at = job.commit_at if job.commit_at is not None else self.wall_clock()
                coming = CheckpointInfo(job.step, at, dict(job.metrics), job.snap.nbytes,
                                        {**job.manifest_extra, **job.identity.to_extra()})
                make_room(tier, coming, space_needed(job.snap.nbytes))
        planner = save_planner_for(job.snap) if job.snap is not None else None
        try:
            stats = run_save(tier.store, job, policy=tier.retention, threads=self.threads, planner=planner,
                             writer_process=self.writer_process)
        except BaseException as exc:
            if coming is not None and out_of_space(exc):  # found full after all: the next save finds room
                make_room(tier, coming, None)
            if isinstance(exc, Exception):
                self._log_failure(job, tier, exc)
            raise
        finally:
            if job.snap is not None and job.step in self.in_flight:
                self.in_flight.remove(job.step)
        if stats is None:
            return
        changed = stats.extra.pop(FROZEN_CHANGED, None)
        if self.catch_up is not None:  # how far the bucket is behind
            saved = save_number(job.identity.save_id)
            if tier is self.roots.persistent:
                self.catch_up.uploaded(saved, job.commit_at)
            stats.extra.update(self.catch_up.lag(saved, job.commit_at))
        self.after_commit(stats)
        if changed:
            raise FrozenTensorChangedError(
                f"tensors declared frozen changed: {', '.join(changed[:5])}"
                f"{f' and {len(changed) - 5} more' if len(changed) > 5 else ''}. Step {stats.step} holds their "
                "new bytes (written in full); stop declaring them frozen (frozen=), or find what changes them",
                keys=changed, step=stats.step)

    def _log_failure(self, job: SaveJob, tier: Root, exc: BaseException) -> None:
        """A save that failed goes to the stats log too (``extra["failed"]``: the error), so that
        the run's record (``async-ckpt stats``, its ``--plot``) shows it. Not when the log could
        not be written either: the failure of a remote persistent root the log lives on."""
        if self.stats_log is None or job.stats is None or not self.exchange.is_primary:
            return
        if tier is self.roots.persistent and not tier.store.storage.is_local:
            return
        stats = dataclasses.replace(job.stats, extra={**job.stats.extra, FAILED: f"{type(exc).__name__}: {exc}"[:300]})
        self.stats_log.append(stats)  # never raises

    def after_commit(self, stats: SaveStats) -> None:
        """Statistics and the user's callback: neither can fail a committed save."""
        self.stats.append(stats)
        # a local tier's saves are logged too unless the log is remote (rewritten per save there)
        logged = stats.extra.get("tier") != LOCAL or self.roots.persistent.store.storage.is_local
        if self.stats_log is not None and self.exchange.is_primary and logged:
            try:
                self.stats_log.append(stats)
            except Exception as exc:  # noqa: BLE001 - statistics never fail a committed save (logged)
                log.warning("could not append save statistics: %s", exc)
        if self.exchange.world_size > 1:
            log.info("rank %d saved %s", self.exchange.rank, stats.summary())
        else:
            log.info("saved %s", stats.summary())
        if self.on_saved is not None:
            try:
                self.on_saved(stats)
            except Exception:  # noqa: BLE001 - the user's callback never fails a committed save (logged)
                log.exception("the on_saved callback raised for step %d (the step is committed)", stats.step)
