"""``CheckpointManager``: the façade. It wires policies, staging, the writer and storage.

Data flows one way: state dict -> staging (host snapshot; the only blocking part) -> writer
(background) -> storage (DCP files through fsspec) -> commit (manifest, marker) -> retention.
"""

from __future__ import annotations

import atexit
import collections
import logging
import operator
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Set

import torch

from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidStateDictError,
    InvalidStepError,
    StateDictMismatchError,
    StepNotFoundError,
)
from .policies import (
    CheckpointInfo,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepLatest,
    RetentionPolicy,
    SaveContext,
    SavePolicy,
    apply_retention,
    as_retention_policy,
    as_save_policy,
    best_checkpoint,
    decide_save,
)
from .preemption import PreemptionTracker, PreemptionWatcher
from .staging import HostBufferPool, HostSnapshot, Stager
from .staging.gc_pause import gc_paused
from .stats import SaveStats, StatsLog
from .storage import CheckpointLayout, Manifest, RetryPolicy, Storage, StepTarget
from .storage.dcp_io import METADATA_NAME, FsspecStorageReader, load_metadata, load_state_dict, save_state_dict
from .writer import AsyncWriter
from . import distributed as _dist

log = logging.getLogger("async_ckpt")

_live_managers: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


def _finish_pending_saves_at_exit() -> None:
    for mgr in list(_live_managers):
        try:
            mgr.close()
        except Exception as exc:  # the interpreter is exiting: report, do not raise
            log.error("async_ckpt: a pending save failed at exit: %s", exc)


# Runs before concurrent.futures refuses new work at interpreter exit (threading's exit hooks
# run in reverse order of registration), so pending saves can still finish their writes.
try:
    threading._register_atexit(_finish_pending_saves_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover
    atexit.register(_finish_pending_saves_at_exit)


def _check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise InvalidStepError(f"step must be a non-negative integer, got {step!r}")
    try:
        s = operator.index(step)
    except TypeError:
        raise InvalidStepError(f"step must be a non-negative integer, got {step!r} ({type(step).__name__})") from None
    if s < 0:
        raise InvalidStepError(f"step must be a non-negative integer, got {s}")
    return s


class CheckpointManager:
    """Asynchronous checkpointing of a state dict to a local path or any fsspec URL.

    A drop-in for ``torch_xla.experimental.distributed_checkpoint.CheckpointManager`` (same
    positional arguments and methods) that also surfaces background failures, commits
    atomically, verifies on restore and reuses host buffers between saves.

    Args:
        path: checkpoint root: a local path or an fsspec URL (``file://``, ``memory://``,
            ``gs://``, ``s3://``, ...). Each step is a DCP checkpoint in ``<path>/<step>/``.
        save_interval: save when ``step % save_interval == 0`` (ignored if ``save_policy``).
        max_to_keep: keep the N most recently committed steps; 0 or None keeps all
            (ignored if ``retention``).
        max_pending_async: saves that may be in flight at once; the next one waits for a slot.
        num_of_threads: torch_xla's name for ``write_threads`` (kept so that positional
            arguments match torch_xla's ``CheckpointManager``).
        process_group: process group for multi-process saves (default: the default group).
        chkpt_on_preemption: detect preemption (off by default: no signal handler is installed
            unless asked). After a preemption signal, the next ``save``/``save_async`` takes a
            checkpoint whatever the save policy says and :meth:`reached_preemption` turns True.
            Must be set from the main thread (it installs a signal handler). See docs/policies.md.
        preemption_signals: signals that mean "preempted" (default ``(signal.SIGTERM,)``; add
            ``signal.SIGUSR1`` for SLURM's ``--signal``). Handlers that were installed before are
            still called.
        preemption_sync: ``"auto"`` (torch_xla's preemption sync point on TPU, signals
            elsewhere), ``"signal"``, or ``"xla"`` (the sync point, also on PJRT CPU).
        storage_options: passed to fsspec (credentials, endpoint, project, ...).
        save_policy: an object with ``should_save(step) -> bool``; overrides ``save_interval``.
        retention: an object with ``keep(checkpoints) -> set[int]``; overrides ``max_to_keep``.
        memory_budget_bytes: bound on pooled host staging memory (None: unbounded).
        write_threads: files written concurrently per rank.
        commit_mode: ``"auto"`` (rename on POSIX, marker on object stores), ``"rename"``, ``"marker"``.
        verify: check checksums on restore (sizes are always checked).
        keep_incomplete: keep steps that never committed instead of cleaning them up.
        retry: backoff for transient storage errors (default: ``RetryPolicy()``, 5 attempts).
        on_saved: called with the :class:`SaveStats` of each committed save (writer thread).
        stats_log: append each save's :class:`SaveStats` as a JSON line to a file under the root:
            ``True`` for ``<path>/save_stats.jsonl``, or a path relative to ``path`` (see
            :class:`async_ckpt.stats.StatsLog`; on object stores the file is rewritten per save).
        lazy: default of ``save_async(..., lazy=)``: return once the host copies are issued;
            a guard waits for them right before an optimizer step or module forward would
            change the tensors (see :meth:`save_async` and docs/design.md).
    """

    def __init__(
        self,
        path: str,
        save_interval: int = 1,
        max_to_keep: Optional[int] = 0,
        max_pending_async: int = 1,
        num_of_threads: Optional[int] = None,
        process_group: Any = None,
        chkpt_on_preemption: bool = False,
        *,
        storage_options: Optional[Dict[str, Any]] = None,
        save_policy: Optional[SavePolicy] = None,
        retention: Optional[RetentionPolicy] = None,
        memory_budget_bytes: Optional[int] = None,
        write_threads: int = 8,
        commit_mode: str = "auto",
        verify: bool = True,
        keep_incomplete: bool = False,
        retry: Optional[RetryPolicy] = None,
        on_saved: Optional[Callable[[SaveStats], None]] = None,
        stats_log: Any = None,
        preemption_signals: Optional[Sequence[int]] = None,
        preemption_sync: str = "auto",
        lazy: bool = False,
    ) -> None:
        if num_of_threads is not None:  # torch_xla's name for the writer's thread count
            if not isinstance(num_of_threads, int) or isinstance(num_of_threads, bool) or num_of_threads < 1:
                raise ValueError(f"num_of_threads must be an int >= 1, got {num_of_threads!r}")
            write_threads = num_of_threads
        if not isinstance(write_threads, int) or isinstance(write_threads, bool) or write_threads < 1:
            raise ValueError(f"write_threads must be an int >= 1, got {write_threads!r}")
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 0):
            raise ValueError(f"max_to_keep must be an int >= 0 or None, got {max_to_keep!r}")
        self.save_policy: SavePolicy = as_save_policy(save_policy) if save_policy is not None else EveryNSteps(save_interval)
        self.retention: RetentionPolicy = (
            as_retention_policy(retention) if retention is not None
            else (KeepLatest(max_to_keep) if max_to_keep else KeepAll())
        )
        self._preemption: Optional[PreemptionTracker] = None
        if chkpt_on_preemption:  # validated now, installed once everything else is set up
            import signal as _signal

            self._preemption = PreemptionTracker(PreemptionWatcher(
                (_signal.SIGTERM,) if preemption_signals is None else tuple(preemption_signals), preemption_sync))
            if preemption_signals is not None and self._preemption.watcher.sync == "xla":
                raise ValueError("preemption_signals cannot be combined with torch_xla's preemption sync point "
                                 "(it handles SIGTERM itself); pass preemption_sync='signal' to use signals")
        elif preemption_signals is not None:
            raise ValueError("preemption_signals needs chkpt_on_preemption=True")
        # Collective: every rank creates the checkpoint group, first, before anything that
        # could fail on one rank only (None in a single process).
        self._dist = _dist.checkpoint_group(process_group)
        self._condemned: Set[int] = set()  # dropped by retention, deletion pending on rank 0
        self.storage = Storage(path, storage_options, retry=retry)
        self.layout = CheckpointLayout(self.storage, commit_mode)
        self.process_group = process_group
        self.chkpt_on_preemption = chkpt_on_preemption
        self.verify = verify
        self.write_threads = write_threads
        self.on_saved = on_saved
        self._stats_log = StatsLog.from_option(self.storage, stats_log)
        self.stager = Stager(HostBufferPool(memory_budget_bytes))
        self.stats: Deque[SaveStats] = collections.deque(maxlen=1000)
        self._writer = AsyncWriter(max_pending_async)
        if not isinstance(lazy, bool):
            raise TypeError(f"lazy must be a bool, got {lazy!r}")
        self.lazy = lazy
        self._lazy_pending: List[Any] = []  # PendingCopies of this manager's lazy saves
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-delete")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._inflight: Dict[int, str] = {}  # step -> directory being written
        self._deleting: Set[int] = set()  # steps whose files a deletion is removing right now
        self._infos: Optional[Dict[int, CheckpointInfo]] = None
        self._commit_gen = 0  # bumped by every commit, so a stale listing is never cached
        self._closed = False
        self._clock: Callable[[], float] = time.time  # wall clock of decisions and manifests' commit_time
        self._start_time = self._clock()
        self._last_save_time: Optional[float] = None
        self._last_save_step: Optional[int] = None
        self._top_step: Optional[int] = None  # highest committed step (cached; see _highest_committed)
        self._top_known = False
        self._rollback_to: Optional[int] = None  # restored step below the highest: saves above it roll back
        self._check_writable()
        if self._dist is None or self._dist.is_coordinator:
            self._recover_commits()
        if not keep_incomplete and self._dist is None:
            self._in_background(self._cleanup_incomplete)
        elif not keep_incomplete and self._dist.is_coordinator:
            # Multi-process: only rank 0 cleans up, on its writer thread, before its first save
            # opens a step (so a step another rank is writing is never mistaken for debris).
            self._writer.wait_for_slot()
            self._writer.submit(self._cleanup_incomplete)
        if self._preemption is not None:
            try:
                self._preemption.watcher.install()
            except BaseException:
                self._writer.close()
                self._deleter.shutdown(wait=False)
                raise
        _live_managers.add(self)

    # ---- policy ------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether a checkpoint is due at ``step``: the save policy wants one, or a preemption
        was detected and its checkpoint is not taken yet."""
        step = _check_step(step)
        preempt = self._preemption.due(step) if self._preemption is not None else False
        return preempt or self._policy_wants(step, preempt)

    def _save_context(self, preempted: bool) -> SaveContext:
        return SaveContext(now=self._clock(), start_time=self._start_time, last_save_time=self._last_save_time,
                           last_save_step=self._last_save_step, save_in_flight=self._writer.pending > 0,
                           preempted=preempted)

    def _policy_wants(self, step: int, preempted: bool = False) -> bool:
        return decide_save(self.save_policy, step, self._save_context(preempted))

    def _decide(self, step: int, force: bool) -> "tuple[bool, bool]":
        """(take this save, it is the preemption checkpoint). Training thread."""
        preempt = self._preemption.due(step) if self._preemption is not None else False
        return (force or preempt or self._policy_wants(step, preempt)), preempt

    def _taken(self, step: int, preempt: bool) -> None:
        """Record a save that was just taken (staged and queued). Training thread."""
        self._last_save_time = self._clock()
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
        step = _check_step(step)
        return self._preemption is not None and self._preemption.reached(step)

    def trigger_preemption(self) -> None:
        """Act as if a preemption signal arrived (for schedulers that announce it another way)."""
        if self._preemption is None:
            raise CheckpointError("trigger_preemption() needs chkpt_on_preemption=True")
        self._preemption.watcher.trigger()

    # ---- rollback ----------------------------------------------------------------------------
    def _highest_committed(self) -> Optional[int]:
        with self._lock:
            if self._top_known:
                return self._top_step
        steps = self.layout.committed_steps()
        with self._lock:
            if not self._top_known:
                self._top_step, self._top_known = (steps[-1] if steps else None), True
            return self._top_step

    def _note_committed(self, step: int) -> None:
        with self._lock:
            if self._top_known:
                self._top_step = step if self._top_step is None else max(self._top_step, step)

    def _note_restored(self, step: int) -> int:
        top = self._highest_committed()
        self._rollback_to = step if top is not None and step < top else None
        return step

    def _check_rollback(self, step: int) -> bool:
        """Whether saving ``step`` rolls back (steps above it get deleted first); raise if that
        was not asked for by restoring an older step. Training thread."""
        top = self._highest_committed()
        if top is None or step >= top:
            self._rollback_to = None  # back at (or past) the top: nothing to roll back
            return False
        if self._rollback_to is None:
            raise InvalidStepError(
                f"step {step} is lower than the highest committed step {top} under {self.storage.url}; "
                f"to roll back, restore(<older step>) first (saving then deletes the steps above the "
                f"saved one), or save to another directory", step=step)
        if step < self._rollback_to:
            raise InvalidStepError(
                f"step {step} is lower than the restored step {self._rollback_to} (rolling back from "
                f"{top}); save steps >= {self._rollback_to}", step=step)
        return True

    def _drop_superseded(self, step: int) -> None:
        """Rollback, writer thread, before ``step`` is written: delete the committed steps above
        it (markers first, so none of them can be picked as the latest any more)."""
        above = [s for s in self.layout.committed_steps() if s > step]
        for s in above:
            self.storage.rm(self.layout.marker_path(s), recursive=False)
        with self._lock:
            self._infos = None  # re-read from the manifests at the next retention pass
            self._top_known = False  # listed again at the next save
            if self._rollback_to is not None and self._rollback_to <= step:
                self._rollback_to = None
        for s in above:
            self.storage.rm(self.layout.step_dir(s))
            log.warning("async_ckpt: deleted step %d: rolled back to step %d", s, step)

    def best_step(self, metric: Optional[str] = None, mode: Optional[str] = None) -> Optional[int]:
        """The committed step with the best value of ``metric`` (ties: the earliest commit).

        ``metric``/``mode`` default to those of the retention's :class:`KeepBest` (a ``KeepBest``
        inside ``AnyOf`` counts); ``mode`` is ``"min"`` otherwise. None when no committed step
        has the metric.
        """
        best = _find_keep_best(self.retention)
        if metric is None:
            if best is None:
                raise ValueError("best_step() needs metric= (the retention policy has no KeepBest)")
            metric = best.metric
        if mode is None:
            mode = best.mode if best is not None and best.metric == metric else "min"
        found = best_checkpoint(list(self._checkpoint_infos().values()), metric, mode)
        return None if found is None else found.step

    # ---- saving ------------------------------------------------------------------------------
    def save_async(self, step: int, state_dict: Mapping[str, Any], force: bool = False,
                   metrics: Optional[Dict[str, float]] = None, *, lazy: Optional[bool] = None) -> bool:
        """Snapshot ``state_dict`` to host memory and write it in the background.

        Returns once host copies of every tensor exist (the training loop may then mutate its
        tensors freely); returns ``False`` without doing anything when no save is due and
        ``force`` is not set. Raises the error of an earlier failed background save.

        With ``lazy=True`` (default: the manager's ``lazy``) it returns once the copies are
        *issued* (tensors up to 64 KiB are already copied: cheaper than guarding them): the
        others run in the background, and a guard waits for the outstanding copies of
        exactly the tensors about to change, right before ``optimizer.step()`` (params and
        optimizer state) or a module's forward (its buffers). Other in-place writes must come
        after :meth:`wait_for_staging`; one that bumps ``_version`` before its copy finished
        makes that save fail with ``TornSnapshotError`` (never a torn checkpoint). Single
        process only; multi-process saves stage eagerly.
        """
        return self._save(step, state_dict, force, metrics, wait=False, lazy=self.lazy if lazy is None else lazy)

    def wait_for_staging(self) -> None:
        """Wait until the host copies of every lazy save of this manager are done (cheap when
        none is outstanding). Call it before mutating saved tensors outside ``optimizer.step()``."""
        pending, self._lazy_pending = self._lazy_pending, []
        for pc in pending:
            pc.wait_all()
        from .staging.lazy import settle_hooks

        settle_hooks()

    def save(self, step: int, state_dict: Mapping[str, Any], force: bool = False,
             metrics: Optional[Dict[str, float]] = None) -> bool:
        """Like :meth:`save_async`, but returns only once the step is committed."""
        return self._save(step, state_dict, force, metrics, wait=True)

    def _save(self, step: Any, state_dict: Mapping[str, Any], force: bool, metrics: Any, wait: bool,
              lazy: bool = False) -> bool:
        self._check_open()
        step = _check_step(step)
        from .storage.manifest import check_metrics

        metrics = check_metrics(metrics)
        if self._dist is not None:
            return _dist.save(self, step, state_dict, force, metrics, wait)
        self._writer.raise_if_failed()
        take, preempt = self._decide(step, force)
        if not take:
            return False
        supersede = self._check_rollback(step)
        t0 = time.perf_counter()
        with gc_paused():
            plan = self.stager.plan(state_dict)  # validates before anything is taken or written
        if self._lazy_pending:
            self.wait_for_staging()  # earlier lazy copies finish and are sealed (their writers wait for it)
        self._writer.wait_for_slot()
        t1 = time.perf_counter()
        try:
            snap = self.stager.stage(state_dict, plan, lazy=True) if lazy and not wait else \
                self.stager.stage(state_dict, plan)
            if snap.pending is not None:
                snap.pending.step = step
                self._lazy_pending.append(snap.pending)
        except BaseException:
            self._writer.release_slot()
            raise
        t2 = time.perf_counter()
        stats = SaveStats(step=step, nbytes=snap.nbytes, num_tensors=snap.num_tensors,
                          queue_wait_s=t1 - t0, stage_s=t2 - t1, blocking_s=t2 - t0)
        self._writer.submit(lambda: self._persist(step, snap, metrics, stats, t0, supersede), step=step)
        self._taken(step, preempt)
        if wait:
            self._writer.join()
        return True

    def _persist(self, step: int, snap: HostSnapshot, metrics: Dict[str, float], stats: SaveStats, t0: float,
                 supersede: bool = False) -> None:
        """Writer thread: data files, then manifest and marker, then retention."""
        target: Optional[StepTarget] = None
        try:
            snap.drop_sources()  # here, not in the stall: releasing device-buffer views costs
            snap.wait_copied()  # lazy: every host copy done and unchanged (else TornSnapshotError)
            tw = time.perf_counter()
            if supersede:
                self._drop_superseded(step)
            with self._changed:  # claimed before anything is written; waits out a deletion of it
                self._changed.wait_for(lambda: step not in self._deleting)
                self._inflight[step] = ""
            target = self.layout.begin(step)
            with self._lock:
                self._inflight[step] = target.path
            files = save_state_dict(self.storage, target.path, snap.state_dict,
                                    threads=self.write_threads, process_group=self.process_group,
                                    planner=_dist.save_planner_for(snap.state_dict))
            snap.release()  # buffers go back to the pool as soon as the data is written
            tc = time.perf_counter()
            manifest = Manifest(step=step, commit_time=self._clock(), files=files, metrics=metrics,
                                nbytes=snap.nbytes, num_tensors=snap.num_tensors, world_size=1,
                                extra={"int_keys": snap.int_keys} if snap.int_keys else {})
            self.layout.commit(target, manifest)
            td = time.perf_counter()
            self._note_committed(step)
            with self._lock:  # recorded while still in flight: retention never sees a gap
                self._commit_gen += 1
                if self._infos is not None:
                    self._infos[step] = CheckpointInfo(step, manifest.commit_time, dict(metrics), snap.nbytes)
        except BaseException:
            snap.release()
            if target is not None:
                self.layout.abort(target)
            raise
        finally:
            with self._lock:
                self._inflight.pop(step, None)
        stats.write_s, stats.commit_s, stats.durable_s = tc - tw, td - tc, td - t0
        stats.files = len(files)
        stats.commit_time = manifest.commit_time
        self.stats.append(stats)
        if self._stats_log is not None:
            self._stats_log.append(stats, self.process_group)
        log.info("async_ckpt: saved %s", stats.summary())
        if self.on_saved is not None:
            self.on_saved(stats)
        self._in_background(self._apply_retention)

    def _in_background(self, fn: Callable[[], None]) -> None:
        """Run deletions off the writer thread, so they never delay the next save."""
        try:
            self._deleter.submit(fn)
        except RuntimeError:  # executor already shut down (close() or interpreter exit)
            fn()

    @property
    def last_stats(self) -> Optional[SaveStats]:
        """Statistics of the most recently committed save."""
        return self.stats[-1] if self.stats else None

    # ---- retention ---------------------------------------------------------------------------
    def _checkpoint_infos(self) -> Dict[int, CheckpointInfo]:
        while True:
            with self._lock:
                if self._infos is not None:
                    return dict(self._infos)
                gen = self._commit_gen
            infos = self._read_infos()
            with self._lock:
                if self._commit_gen == gen:  # no commit raced the listing
                    self._infos = dict(infos)
                    return infos

    def _read_infos(self) -> Dict[int, CheckpointInfo]:
        infos: Dict[int, CheckpointInfo] = {}
        for step in self.layout.committed_steps():
            try:
                m = self.layout.read_manifest(step)
            except CheckpointError as exc:
                log.warning("async_ckpt: ignoring step %d for retention: %s", step, exc)
                continue
            infos[step] = CheckpointInfo(step, m.commit_time, dict(m.metrics), m.nbytes)
        return infos

    def _claim_for_delete(self, step: int, info: Optional[CheckpointInfo] = None) -> bool:
        """Reserve ``step`` for deletion unless a save of it is in flight (or, with ``info``,
        unless it was re-committed since ``info`` was read). Release with :meth:`_release_delete`."""
        with self._lock:
            if step in self._inflight or step in self._deleting:
                return False
            if info is not None and (self._infos is None or self._infos.get(step) is not info):
                return False
            self._deleting.add(step)
            return True

    def _release_delete(self, step: int) -> None:
        with self._changed:
            self._deleting.discard(step)
            self._changed.notify_all()

    def _apply_retention(self) -> None:
        try:
            infos = self._checkpoint_infos()
            if not infos:
                return
            ordered = sorted(infos.values(), key=lambda c: (c.commit_time, c.step))
            keep = apply_retention(self.retention, ordered)
            keep.add(ordered[-1].step)  # the newest commit is never deleted
            keep.add(max(infos))  # nor the highest step
            with self._lock:
                keep |= set(self._inflight)
            for info in ordered:
                if info.step in keep or not self._claim_for_delete(info.step, info):
                    continue
                try:
                    self.layout.delete(info.step)
                    with self._lock:
                        if self._infos is not None:
                            self._infos.pop(info.step, None)
                finally:
                    self._release_delete(info.step)
                log.info("async_ckpt: deleted step %d (retention)", info.step)
        except Exception as exc:  # deletion is best effort and must never break training
            log.warning("async_ckpt: retention failed: %s", exc)

    def _recover_commits(self) -> None:
        """Finish rename commits a crash interrupted (see ``CheckpointLayout.recover``)."""
        try:
            for step in self.layout.recover():
                log.warning("async_ckpt: completed the commit of step %d, which a crash had interrupted", step)
        except Exception as exc:
            log.warning("async_ckpt: recovery of interrupted commits failed: %s", exc)

    def _cleanup_incomplete(self) -> None:
        try:
            with self._lock:
                busy = set(self._inflight.values())
            for path in self.layout.incomplete(exclude=busy):
                step = self.layout.step_of(path)
                if step is None or not self._claim_for_delete(step):
                    continue  # a save of this step started meanwhile: its directory is not ours
                try:
                    if self.storage.exists(self.layout.marker_path(step)) and path == self.layout.step_dir(step):
                        continue  # committed since it was listed
                    log.info("async_ckpt: removing incomplete checkpoint %s", path)
                    self.storage.rm(path)
                finally:
                    self._release_delete(step)
        except Exception as exc:
            log.warning("async_ckpt: cleanup of incomplete checkpoints failed: %s", exc)

    # ---- listing -----------------------------------------------------------------------------
    def all_steps(self) -> List[int]:
        """Committed steps, ascending."""
        steps = self.layout.committed_steps()
        if self._condemned:  # multi-process: dropped by retention on every rank, not yet deleted
            with self._lock:
                steps = [s for s in steps if s not in self._condemned]
        return steps

    def latest_step(self) -> Optional[int]:
        """The highest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> Dict[str, float]:
        """The metrics stored with a committed step."""
        return dict(self.layout.read_manifest(_check_step(step)).metrics)

    # ---- restoring ---------------------------------------------------------------------------
    def restore(self, step: Optional[int], state_dict: Dict[str, Any], *, verify: Optional[bool] = None,
                allow_pickle: bool = False) -> int:
        """Load a committed step into ``state_dict`` in place and return the step.

        ``step=None`` picks the newest committed step; if it fails verification, the next older
        one that verifies is used, with a warning naming the skipped step. A named step that is
        damaged raises :class:`CorruptCheckpointError`. Entries the checkpoint has but
        ``state_dict`` lacks (e.g. a fresh optimizer's empty ``state``) are added. On failure
        ``state_dict`` is left as it was.
        """
        if not isinstance(state_dict, Mapping):
            raise InvalidStateDictError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        if not self._closed:
            self.wait_for_staging()
            self._writer.join()  # pending saves land first (and their errors surface)
        verify = self.verify if verify is None else verify
        if self._dist is not None:
            return _dist.restore(self, None if step is None else _check_step(step), state_dict, verify, allow_pickle)
        steps = self.all_steps()
        if step is not None:
            step = _check_step(step)
            if step not in steps:
                raise StepNotFoundError(
                    f"no committed checkpoint for step {step} under {self.storage.url} "
                    f"(committed: {steps if len(steps) <= 20 else steps[-20:]})", step=step)
            self._restore_step(step, state_dict, verify, allow_pickle)
            return self._note_restored(step)
        if not steps:
            raise StepNotFoundError(f"no committed checkpoint under {self.storage.url}")
        errors = []
        for s in reversed(steps):
            try:
                self._restore_step(s, state_dict, verify, allow_pickle)
            except CorruptCheckpointError as exc:
                warnings.warn(f"async_ckpt: skipping damaged step {s}: {exc}", RuntimeWarning, stacklevel=2)
                errors.append(exc)
                continue
            return self._note_restored(s)
        raise CorruptCheckpointError(
            f"no committed step under {self.storage.url} passed verification; newest error: {errors[0]}",
            step=steps[-1]) from errors[0]

    def _restore_step(self, step: int, state_dict: Dict[str, Any], verify: bool, allow_pickle: bool) -> None:
        manifest = self.layout.read_manifest(step)
        path = self.layout.step_dir(step)
        if METADATA_NAME not in manifest.files:
            raise CorruptCheckpointError(f"step {step}: manifest lists no {METADATA_NAME}", step=step, path=path)
        reader = FsspecStorageReader(self.storage, path, files=manifest.files, verify=verify,
                                     threads=self.write_threads)
        try:
            metadata = reader.read_metadata()
        except CorruptCheckpointError as exc:
            exc.step = step
            raise
        added = _prepare_target(state_dict, metadata, step, set(manifest.extra.get("int_keys", ())))
        try:
            load_state_dict(self.storage, path, state_dict, files=manifest.files, verify=verify,
                            threads=self.write_threads, allow_pickle=allow_pickle, metadata=metadata,
                            process_group=self.process_group,
                            planner=_dist.load_planner_for(state_dict, allow_pickle))
        except BaseException as exc:
            _remove_added(state_dict, added)
            if isinstance(exc, CorruptCheckpointError):
                exc.step = step
            raise

    # ---- lifecycle ---------------------------------------------------------------------------
    def join(self) -> None:
        """Wait for every pending save to commit; raise the first background failure."""
        self.wait_for_staging()
        self._writer.join()

    def close(self) -> None:
        """Finish pending saves and deletions, stop the background threads, raise failures."""
        if self._closed:
            return
        self._closed = True
        _live_managers.discard(self)
        if self._preemption is not None:
            self._preemption.watcher.uninstall()
        try:
            self.wait_for_staging()  # lazy saves' writers wait for their copies to be sealed
            self._writer.close()
        finally:
            self._deleter.shutdown(wait=True)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception as close_exc:  # do not mask the original exception
                log.error("async_ckpt: pending save failed while handling another error: %s", close_exc)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")

    def _check_writable(self) -> None:
        from .errors import StorageError

        try:
            self.storage.makedirs(self.storage.root)
        except (OSError, StorageError) as exc:
            raise StorageError(f"checkpoint path {self.storage.url!r} cannot be written: {exc}") from exc
        self.storage.check_writable()  # object stores: probe object (missing bucket, bad credentials)
        if self.storage.is_local:
            import os

            if not os.access(self.storage.root, os.W_OK):
                raise StorageError(f"checkpoint path {self.storage.url!r} is not writable")


def _find_keep_best(policy: Any) -> Optional[KeepBest]:
    """The :class:`KeepBest` in a retention policy (searched inside ``AnyOf``), if exactly one."""
    if isinstance(policy, KeepBest):
        return policy
    found = [p for p in getattr(policy, "policies", ()) if isinstance(p, KeepBest)]
    return found[0] if len(found) == 1 else None


def _prepare_target(state_dict: Dict[str, Any], metadata: Any, step: int, int_keys: Set[str]) -> List[tuple]:
    """Check ``state_dict`` against a checkpoint's DCP metadata; add entries it lacks.

    Returns the paths added, so that a failed restore can take them out again.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict(state_dict)
    md = metadata.state_dict_metadata
    missing = [k for k in flat if k not in md]
    problems = []
    for k, v in flat.items():
        if k not in md:
            continue
        m = md[k]
        if isinstance(m, TensorStorageMetadata):
            if not isinstance(v, torch.Tensor):
                problems.append(f"{k}: checkpoint has a tensor, state_dict has {type(v).__name__}")
            elif tuple(v.shape) != tuple(m.size):
                problems.append(f"{k}: shape {tuple(v.shape)} in state_dict vs {tuple(m.size)} in checkpoint")
            elif v.dtype != m.properties.dtype:
                problems.append(f"{k}: dtype {v.dtype} in state_dict vs {m.properties.dtype} in checkpoint")
        elif isinstance(v, torch.Tensor):
            problems.append(f"{k}: state_dict has a tensor, checkpoint has a non-tensor value")
    if missing or problems:
        lines = [f"missing from checkpoint: {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}"] if missing else []
        lines += problems[:20]
        raise StateDictMismatchError(f"state_dict does not match checkpoint step {step}: " + "; ".join(lines), step=step)
    mappings = metadata.planner_data or {}
    added = []
    for k, m in md.items():
        if k in flat or k not in mappings:
            continue
        value = torch.empty(tuple(m.size), dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
        added.extend(_insert(state_dict, mappings[k], _typed_path(mappings[k], int_keys), value))
    return added


def _insert(root: Dict[str, Any], raw: Sequence[Any], typed: Sequence[Any], value: Any) -> List[tuple]:
    """Set ``root[typed[0]][typed[1]]... = value``, creating missing containers: a list where
    DCP's path has a list index next (an int in ``raw``), a dict otherwise (also for dict keys
    that were ints, which ``typed`` restores). Returns the paths it created, outermost first."""
    created: List[tuple] = []
    cur: Any = root
    for i, key in enumerate(typed):
        last = i == len(typed) - 1
        fresh = value if last else ([] if isinstance(raw[i + 1], int) else {})
        if isinstance(cur, list):
            while len(cur) <= key:
                cur.append(None)
            if last or cur[key] is None:
                if cur[key] is None:
                    created.append(tuple(typed[: i + 1]))
                cur[key] = fresh
        elif last or key not in cur:
            if key not in cur:
                created.append(tuple(typed[: i + 1]))
            cur[key] = fresh
        cur = cur[key]
    return created


def _typed_path(path: Sequence[Any], int_keys: Set[str]) -> tuple:
    """DCP's path with the dict keys that were ints at save time turned back into ints."""
    out = []
    prefix = ""
    for p in path:
        prefix = f"{prefix}.{p}" if prefix else str(p)
        out.append(int(p) if isinstance(p, str) and prefix in int_keys else p)
    return tuple(out)


def _remove_added(state_dict: Dict[str, Any], added: List[tuple]) -> None:
    """Undo :func:`_insert`: innermost first, so the containers it created go too."""
    for path in sorted(set(added), key=len, reverse=True):
        cur: Any = state_dict
        try:
            for p in path[:-1]:
                cur = cur[p]
            if isinstance(cur, dict):
                cur.pop(path[-1], None)
        except (KeyError, IndexError, TypeError):
            pass
