"""One save, after staging: write -> manifest -> commit -> retention, for 1 process and N.

Every rank runs the same phases on its writer thread::

    0. the host copies are complete (lazy saves: and unchanged)
    1. rank 0 opens the step (temp dir / unmarked dir)     -> broadcast of where and which step
    2. every rank is ready to write (or says why not)       -> all_gather of errors
    3. every rank writes its files                          (io.step_io.write_step)
    4. all_gather of (error, file records, sizes)
    5. rank 0 writes manifest + marker, applies retention   -> broadcast of the outcome

Every rank reaches the same exchanges in the same order whatever fails, so one rank's failure
becomes an error on every rank instead of a hang, and nothing is committed unless every rank
wrote its files. With one process the exchanges are no-ops and errors propagate as raised.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from ..errors import CheckpointError
from ..format.manifest import CopyIdentity, FileRecord, Manifest, reduce_metrics
from ..io import step_io
from ..io.writer_process import ProcessExecutor, WriterProcess, executing
from ..policies import RetentionPolicy
from ..ranks import phase
from ..ranks.replicas import DroppedSamples, diverged, fingerprints
from ..staging import HostSnapshot
from ..stats import SaveStats
from ..storage import StepTarget
from .store import PendingCommit, RootStore


@dataclass
class SaveJob:
    """What the training thread hands the writer for one save."""

    step: int
    snap: Optional[HostSnapshot]  # None: this rank's staging failed (``local_error``)
    metrics: Dict[str, float]
    stats: Optional[SaveStats]
    t0: float
    local_error: Optional[BaseException] = None
    #: entries added to the manifest's ``extra`` (the job's retention)
    manifest_extra: Dict[str, Any] = field(default_factory=dict)
    #: which save wrote the copy and whose it is (a local tier records the job's rank and size)
    identity: CopyIdentity = field(default_factory=CopyIdentity)
    #: the commit time to stamp (if after every known commit) instead of the time of the commit:
    #: a save written to two tiers gets the time it was taken in both, so that merging the tiers
    #: orders steps as they were saved even when one tier's writer lags behind the other's
    commit_at: Optional[float] = None
    #: declared-frozen tensors (incremental saves): each one's version, and the keys not copied
    frozen: Tuple[Dict[str, Tuple[int, int]], Set[str]] = field(default_factory=lambda: ({}, set()))
    #: several ranks: how the ranks' ``metrics`` become the step's (see ``reduce_metrics``)
    metrics_reduce: str = "rank0"
    #: several ranks: samples of the tensors another rank stages, taken at the call (compared
    #: with the stager's fingerprints to find values that differ between ranks)
    samples: Optional[DroppedSamples] = None


#: ``SaveStats.extra`` key: the declared-frozen tensors this save found changed (and wrote in full)
FROZEN_CHANGED = "frozen_changed"
#: ``SaveStats.extra`` key: the data files of this rank the writer process wrote (``writer="process"``)
WRITER_PROCESS_FILES = "writer_process_files"
#: ``SaveStats.extra`` keys of incremental saves: seconds spent verifying the files taken from the
#: last step (and looking at the files written, for the next save's check), and the bytes read
#: back to do it (0 where the storage vouched for every file)
VERIFY_S = "verify_s"
VERIFY_READ_BYTES = "verify_read_bytes"


log = logging.getLogger("async_ckpt")


class StagingAlreadyReported(Exception):
    """This rank's staging failed and was raised to its caller; the job ends quietly."""


@dataclass
class _RankResult:
    files: Dict[str, FileRecord]  # with each file's record list, where the writer kept one
    nbytes: int
    num_tensors: int
    int_keys: List[str]
    #: several ranks: fingerprints of the values every rank stages whole (see replicas.diverged)
    prints: Dict[str, int] = field(default_factory=dict)
    #: this rank's ``metrics=`` (reduced by rank 0 as the manager's ``metrics_reduce`` says)
    metrics: Dict[str, float] = field(default_factory=dict)


def run_save(store: RootStore, job: SaveJob, *, policy: RetentionPolicy, threads: int, planner: Any,
             writer_process: Optional[WriterProcess] = None) -> Optional[SaveStats]:
    """Writer thread of every rank: the phases in the module docstring. Returns the save's
    statistics once committed (None on a rank whose staging failed). With ``writer_process``,
    the files of a local root whose items live in the snapshot's shared buffers are written
    there (see :mod:`async_ckpt.io.writer_process`)."""
    exchange = store.exchange
    step, snap = job.step, job.snap
    target: Optional[StepTarget] = None
    opened: Optional[PendingCommit] = None
    released = False

    def release(failed: bool = False) -> None:  # this job's hold on the snapshot, given back once
        nonlocal released
        if snap is not None and not released:
            released = True
            # after a failed write, a write of it that timed out may still read the buffers when
            # its request returns: they are given up, never handed to the next save
            snap.release(reuse=not failed)

    def open_step() -> Tuple[str, str, int]:
        nonlocal opened, target
        opened = store.begin_write(step)
        target = opened.target
        assert target is not None
        return target.path, target.final, step

    def commit(results: List[_RankResult]) -> float:
        assert opened is not None
        merged: Dict[str, FileRecord] = {}
        for r in results:
            for name, rec in r.files.items():
                if name in merged:
                    raise CheckpointError(f"step {step}: file {name} was written by two ranks", step=step)
                merged[name] = rec
        int_keys = sorted({k for r in results for k in r.int_keys})
        differ = diverged([r.prints for r in results]) if len(results) > 1 else {}
        new = {k: v for k, v in differ.items() if k not in store.diverged_keys}
        if new:  # warned once per key; every manifest names them
            store.diverged_keys |= set(new)
            log.warning("step %d: %d value(s) differ between the ranks that hold them under one key (%s%s); the "
                        "checkpoint holds one rank's value of each, the others are lost: give per-rank state "
                        "per-rank keys (e.g. f'rank{rank}.name'), or make it equal on every rank (DDP: "
                        "broadcast_buffers=True)", step, len(new),
                        ", ".join(f"{k} (ranks {v})" for k, v in list(new.items())[:5]),
                        f" and {len(new) - 5} more" if len(new) > 5 else "")
        # rank 0's commit: its own metrics, or every rank's reduced (sent only when asked for)
        metrics = (job.metrics if len(results) == 1 or job.metrics_reduce == "rank0"
                   else reduce_metrics([r.metrics for r in results], job.metrics_reduce))
        manifest = Manifest(step=step, commit_time=store.catalog.next_commit_time(job.commit_at), files=merged,
                            metrics=metrics, nbytes=sum(r.nbytes for r in results),
                            num_tensors=sum(r.num_tensors for r in results), world_size=exchange.world_size,
                            extra={**job.manifest_extra, **({"int_keys": int_keys} if int_keys else {}),
                                   **({"diverged_keys": sorted(differ)} if differ else {})},
                            identity=job.identity)
        opened.commit(manifest, policy)  # retention decided (markers gone) before save()/join() return
        return manifest.commit_time

    executor: Optional[ProcessExecutor] = None
    store.forget_step(step)  # a re-save: the files under the step's name are going
    try:
        # 0. every host copy done (lazy saves: and unchanged, else TornSnapshotError)
        local = job.local_error
        if snap is not None:
            def copied() -> None:
                assert snap is not None
                snap.drop_sources()  # here, not in the stall: releasing device-buffer views costs
                snap.wait_copied()

            local = phase.attempt(exchange, copied)[0] or local
        tw = time.perf_counter()

        # 1. rank 0 opens the step; everyone learns where (or why not).
        path, final, opened_step = phase.primary(exchange, "opening the step directory", step, open_step)
        if not exchange.is_primary:
            target = StepTarget(step, path, final)
            if opened_step != step and local is None:  # jobs pair in order: never write into another step
                local = CheckpointError(f"rank {exchange.rank}'s save job is for step {step}, rank 0's for step "
                                        f"{opened_step}: the ranks' saves are out of step; neither is committed",
                                        step=step)
        assert target is not None

        # 2. every rank is ready to write (or says why not; a rank whose job is for another
        # step than rank 0's says so here, and nothing is committed).
        staged_here = snap is not None
        ready = None if exchange.is_primary else (lambda: store.storage.makedirs(target.path))
        try:
            phase.everyone(exchange, "staging", step, ready, error=local)
        except BaseException:
            if job.local_error is not None and not staged_here:
                raise StagingAlreadyReported() from None  # raised to this rank's training thread already
            raise
        assert snap is not None

        # 3. every rank writes its files.
        files: Dict[str, FileRecord] = {}
        write_error: Optional[BaseException] = None
        # read before the buffers go back to the pool (right after the write)
        prints = fingerprints(snap.state_dict) if exchange.world_size > 1 else {}
        if job.samples is not None:
            prints.update(job.samples.prints())
        reuse = store.reuse
        if reuse is not None:
            store.recall_last_step()  # a new manager: what the newest committed step holds
            reuse.prepare(*job.frozen, step=step)
        written: Optional[Dict[str, FileRecord]] = None
        if writer_process is not None and store.storage.is_local:
            blocks = [b for lease in snap.leases for b in lease.shared_blocks()]
            if blocks and writer_process.usable():  # else (it cannot start): the thread writer
                executor = ProcessExecutor(writer_process, blocks)

        def write() -> Dict[str, FileRecord]:  # one process, or every rank through dcp.save over the group
            assert snap is not None and target is not None
            return exchange.dcp("writing", lambda: step_io.write_step(
                store.storage, target.path, snap.state_dict, threads=threads, planner=planner, memo=store.memo,
                reuse=reuse, group=exchange.group, several_ranks=exchange.world_size > 1))

        try:
            with executing(executor):  # reported to every rank in the next phase
                write_error, written = phase.attempt(exchange, write)
        finally:
            # buffers go back to the pool as soon as the data is written; after a failed write a
            # write of it that timed out may still read them: they are given up
            release(failed=written is None)
        files = written or {}
        tc = time.perf_counter()

        # 4. did every rank write? gather the file records for the manifest.
        mine = _RankResult(dict(files), snap.nbytes, snap.num_tensors, list(snap.int_keys), prints,
                           dict(job.metrics) if job.metrics_reduce != "rank0" else {})
        results = phase.everyone(exchange, "writing", step, lambda: mine, error=write_error)

        # 5. rank 0 commits and applies retention; everyone learns the outcome.
        commit_time = phase.primary(exchange, "commit", step, lambda: commit(results))  # type: ignore[arg-type]
        td = time.perf_counter()
        changed: List[str] = []
        checks: Optional[Tuple[float, int]] = None
        if reuse is not None:  # incremental: the next save may take this step's files
            reuse.committed(target.path, step, target.final)
            changed = reuse.take_changed()
            checks = reuse.take_checks()
    except StagingAlreadyReported:
        return None
    except BaseException:
        release()
        raise
    finally:
        if opened is not None:
            opened.abort()  # nothing once committed
    stats = job.stats
    if stats is None:
        return None
    stats.write_s, stats.commit_s, stats.durable_s = tc - tw, td - tc, td - job.t0
    stats.files = len(files)
    if executor is not None:
        stats.extra[WRITER_PROCESS_FILES] = executor.files_written
    stats.referred_bytes = sum(r.size for r in files.values() if r.ref is not None)
    stats.written_bytes = sum(r.size for r in files.values()) - stats.referred_bytes
    stats.commit_time = commit_time
    if changed:
        stats.extra[FROZEN_CHANGED] = changed
    if checks is not None:  # incremental: what verifying the taken files cost
        stats.extra[VERIFY_S], stats.extra[VERIFY_READ_BYTES] = checks
    return stats
