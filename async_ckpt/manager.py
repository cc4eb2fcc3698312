"""``CheckpointManager``: the façade. It wires policies, staging, the writer and storage.

Data flows one way: state dict -> staging (host snapshot; the only blocking part) -> writer
(background) -> storage (DCP files through fsspec) -> commit (manifest, marker) -> retention.
"""

from __future__ import annotations

import atexit
import collections
import logging
import operator
import os
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
    as_retention_policy,
    as_save_policy,
    best_checkpoint,
    decide_save,
)
from .preemption import PreemptionTracker, PreemptionWatcher
from .staging import HostBufferPool, HostSnapshot, Stager
from .staging.gc_pause import gc_paused
from .lifecycle import StepCatalog
from .stats import SaveStats, StatsLog
from .storage import CheckpointLayout, Manifest, RetryPolicy, Storage, StepTarget
from .storage.lease import writer_lease
from .storage.manifest import MARKER_NAME
from .storage.dcp import METADATA_NAME, FsspecStorageReader, WriteMemo, load_state_dict, save_state_dict
from .writer import AsyncWriter
from . import distributed as _dist

log = logging.getLogger("async_ckpt")

_live_managers: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


def _finish_pending_saves_at_exit() -> None:
    for mgr in list(_live_managers):
        if mgr._forked:
            continue  # a forked child's copy: its parent finishes the saves
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


def _mark_forked_in_child() -> None:
    """After ``os.fork()``, in the child: every inherited manager refuses to be used (its writer
    threads were not copied) and forgets the parent's writer lease."""
    for mgr in list(_live_managers):
        mgr._forked = True
        if mgr._lease is not None:
            mgr._lease.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked_in_child)


def _stop_threads(writer: AsyncWriter, deleter: ThreadPoolExecutor, lease: Any) -> None:
    """Finalizer of a manager that was garbage-collected without ``close()``."""
    try:
        writer.close()
    except Exception as exc:
        log.error("async_ckpt: an unclosed CheckpointManager had a failed save: %s", exc)
    deleter.shutdown(wait=False)
    if lease is not None:
        lease.release()


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
        max_to_keep: keep the N most recently committed steps (commit order, as torch_xla);
            0 or None keeps all (ignored if ``retention``).
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
        memory_budget_bytes: bound on pooled host staging memory (None: the pool keeps only
            what recent saves used, within about 1.1x the largest save's need).
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
        lease_timeout: seconds the first save waits for the root's writer lease when another
            live writer holds it (default 0: raise :class:`LeaseHeldError` at once).

    Commit order is the order: :meth:`latest_step` and ``restore(None)`` mean the most recently
    committed step, retention drops the oldest commits, and any step may be saved in any order
    (a re-save replaces a step atomically). One live writer per root: a manager takes the root's
    writer lease at its first save, so managers that only list and restore never interfere with
    a writer, and never delete, rename or clean up anything.
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
        lease_timeout: float = 0.0,
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
        self.storage = Storage(path, storage_options, retry=retry)
        self.layout = CheckpointLayout(self.storage, commit_mode)
        self.process_group = process_group
        self.chkpt_on_preemption = chkpt_on_preemption
        self.verify = verify
        self.write_threads = write_threads
        self.on_saved = on_saved
        if not isinstance(lease_timeout, (int, float)) or isinstance(lease_timeout, bool) or lease_timeout < 0:
            raise ValueError(f"lease_timeout must be a number of seconds >= 0, got {lease_timeout!r}")
        self.lease_timeout = float(lease_timeout)
        self._keep_incomplete = keep_incomplete
        self._stats_log = StatsLog.from_option(self.storage, stats_log)
        self.stager = Stager(HostBufferPool(memory_budget_bytes))
        self._write_memo = WriteMemo()  # this manager's last save layout (see storage.dcp.writer)
        self.stats: Deque[SaveStats] = collections.deque(maxlen=1000)
        self._writer = AsyncWriter(max_pending_async)
        if not isinstance(lazy, bool):
            raise TypeError(f"lazy must be a bool, got {lazy!r}")
        self.lazy = lazy
        self._lazy_pending: List[Any] = []  # PendingCopies of this manager's lazy saves
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-delete")
        self._closed = False
        self._forked = False
        self._pid = os.getpid()
        self._clock: Callable[[], float] = time.time  # wall clock of decisions and manifests' commit_time
        self.catalog = StepCatalog(self.layout, lambda: self._clock())
        # Taken at the first save (or delete): until then this manager only reads.
        self._lease = writer_lease(self.storage) if self._dist is None or self._dist.is_coordinator else None
        self._start_time = self._clock()
        self._last_save_time: Optional[float] = None
        self._last_save_step: Optional[int] = None
        self._restored: Optional[int] = None  # the step this manager last restored
        self._warned_lower = False
        self._check_writable()
        if self._preemption is not None:
            try:
                self._preemption.watcher.install()
            except BaseException:
                self._writer.close()
                self._deleter.shutdown(wait=False)
                raise
        # An unclosed manager that is garbage-collected stops its threads (it has no pending
        # work then: a queued save holds a reference to it).
        self._finalizer = weakref.finalize(self, _stop_threads, self._writer, self._deleter, self._lease)
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

    # ---- the writer lease --------------------------------------------------------------------
    def _become_writer(self) -> None:
        """Take the root's writer lease before the first write (training thread); then settle
        what a dead writer left: finish interrupted commits, clean up incomplete steps."""
        if self._lease is None or self._lease.held:
            return
        self._lease.acquire(self.lease_timeout)
        self.catalog.enable_cache()
        self.catalog.forget()
        self._recover_commits()
        if not self._keep_incomplete:
            self._in_background(self._cleanup_incomplete)

    def _warn_if_lower(self, step: int) -> None:
        """One warning when a save goes below the highest committed step without a restore."""
        if self._warned_lower or (self._restored is not None and self._restored <= step):
            return
        steps = self.layout.committed_steps()
        if steps and step < steps[-1]:
            self._warned_lower = True
            log.warning(
                "async_ckpt: saving step %d under %s, which already holds committed steps up to %d "
                "(an earlier run?). Commit order decides: step %d becomes the latest step, and "
                "retention by commit order will delete the older run's steps as this run goes on. "
                "Restore a step first to continue from it, or save to another directory.",
                step, self.storage.url, steps[-1], step)

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
        found = best_checkpoint(self.catalog.in_commit_order(), metric, mode)
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
        self._become_writer()
        self._warn_if_lower(step)
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
        self._writer.submit(lambda: self._persist(step, snap, metrics, stats, t0), step=step)
        self._taken(step, preempt)
        if wait:
            self._writer.join()
        return True

    def _persist(self, step: int, snap: HostSnapshot, metrics: Dict[str, float], stats: SaveStats,
                 t0: float) -> None:
        """Writer thread: data files, then manifest and marker, then retention's decision."""
        target: Optional[StepTarget] = None
        claimed = False
        try:
            snap.drop_sources()  # here, not in the stall: releasing device-buffer views costs
            snap.wait_copied()  # lazy: every host copy done and unchanged (else TornSnapshotError)
            tw = time.perf_counter()
            self.catalog.begin_write(step)  # claimed before anything is written; waits out a deletion
            claimed = True
            target = self.layout.begin(step)
            self.catalog.set_path(step, target.path)
            files = save_state_dict(self.storage, target.path, snap.state_dict,
                                    threads=self.write_threads, process_group=self.process_group,
                                    planner=_dist.save_planner_for(snap.state_dict), memo=self._write_memo)
            snap.release()  # buffers go back to the pool as soon as the data is written
            tc = time.perf_counter()
            self._check_lease()
            manifest = Manifest(step=step, commit_time=self.catalog.next_commit_time(), files=files,
                                metrics=metrics, nbytes=snap.nbytes, num_tensors=snap.num_tensors, world_size=1,
                                extra={"int_keys": snap.int_keys} if snap.int_keys else {})
            self.layout.commit(target, manifest)
            td = time.perf_counter()
            self.catalog.record_commit(CheckpointInfo(step, manifest.commit_time, dict(metrics), snap.nbytes))
        except BaseException:
            snap.release()
            if target is not None:
                self.layout.abort(target)
            raise
        finally:
            if claimed:
                self.catalog.end_write(step)
        self._apply_retention()  # decided and visible before save()/join() return
        stats.write_s, stats.commit_s, stats.durable_s = tc - tw, td - tc, td - t0
        stats.files = len(files)
        stats.commit_time = manifest.commit_time
        self._after_commit(stats)

    def _after_commit(self, stats: SaveStats) -> None:
        """Statistics and the user's callback: neither can fail a committed save."""
        self.stats.append(stats)
        if self._stats_log is not None and (self._dist is None or self._dist.is_coordinator):
            try:
                self._stats_log.append(stats, None)
            except Exception as exc:
                log.warning("async_ckpt: could not append save statistics: %s", exc)
        log.info("async_ckpt: saved %s", stats.summary())
        if self.on_saved is not None:
            try:
                self.on_saved(stats)
            except Exception:
                log.exception("async_ckpt: the on_saved callback raised for step %d (the step is committed)",
                              stats.step)

    def _check_lease(self) -> None:
        if self._lease is not None:
            self._lease.check()

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
    def _apply_retention(self) -> List[int]:
        """Writer thread, right after a commit: the steps retention drops stop being committed
        now (their markers go); their files are deleted in the background. Returns them."""
        try:
            drops = self.catalog.drops(self.retention)
        except Exception as exc:  # a failing policy must never break training
            log.warning("async_ckpt: retention failed: %s", exc)
            return []
        dropped = []
        for s in drops:
            try:
                paths = self.catalog.condemn(s)
            except Exception as exc:
                log.warning("async_ckpt: could not delete step %d: %s", s, exc)
                continue
            if paths:
                dropped.append(s)
                log.info("async_ckpt: deleted step %d (retention)", s)
                self._in_background(lambda s=s, paths=paths: self._remove(s, paths))
        return dropped

    def _remove(self, step: int, paths: List[str]) -> None:
        try:
            self.catalog.remove(step, paths)
        except Exception as exc:  # the step is already unmarked: cleanup finishes it later
            log.warning("async_ckpt: could not remove the files of step %d: %s", step, exc)

    def _recover_commits(self) -> None:
        """Finish commits a crash interrupted (see ``CheckpointLayout.recover``)."""
        try:
            for step in self.layout.recover():
                log.warning("async_ckpt: completed the commit of step %d, which a crash had interrupted", step)
        except Exception as exc:
            log.warning("async_ckpt: recovery of interrupted commits failed: %s", exc)

    def _cleanup_incomplete(self) -> None:
        """Remove what never committed (a dead writer's debris). Holder of the lease only."""
        try:
            busy = self.catalog.busy_paths()
            for path in self.layout.incomplete(exclude=busy):
                step = self.layout.step_of(path)
                if step is None or not self.catalog.claim_delete(step):
                    continue  # a save of this step started meanwhile: its directory is not ours
                try:
                    trash = path.rstrip("/").rsplit("/", 1)[-1].startswith(".trash-")
                    if not trash and self.storage.exists(f"{path}/{MARKER_NAME}"):
                        continue  # committed since it was listed
                    log.info("async_ckpt: removing incomplete checkpoint %s", path)
                    self.layout.remove(self.layout.condemn_dir(path))
                finally:
                    self.catalog.release_delete(step)
        except Exception as exc:
            log.warning("async_ckpt: cleanup of incomplete checkpoints failed: %s", exc)

    def delete(self, step: int) -> None:
        """Delete a committed step (an explicit user action): it is no longer listed or
        restorable when this returns, and its files are gone.

        Waits for pending saves first and takes the root's writer lease (:class:`LeaseHeldError`
        while another writer holds it). Raises :class:`StepNotFoundError` for a step that is not
        committed. Multi-process: call it on every rank; rank 0 deletes.
        """
        self._check_open()
        step = _check_step(step)
        self.join()
        if self._dist is not None:
            _dist.delete(self, step)
            return
        self._become_writer()
        self._delete_now(step)

    def _delete_now(self, step: int) -> None:
        if step not in self.layout.committed_steps():
            raise StepNotFoundError(f"no committed checkpoint for step {step} under {self.storage.url}", step=step)
        paths = self.catalog.condemn(step)
        self.catalog.remove(step, paths)
        log.info("async_ckpt: deleted step %d (delete())", step)

    # ---- listing -----------------------------------------------------------------------------
    def all_steps(self) -> List[int]:
        """Committed steps, ascending (as torch_xla's manager lists them). The order that counts
        is commit order: see :meth:`steps_in_commit_order` and :meth:`latest_step`."""
        self._check_process()
        return self.layout.committed_steps()

    def steps_in_commit_order(self) -> List[int]:
        """Committed steps, oldest commit first (the order retention sees them in)."""
        self._check_process()
        return [c.step for c in self.catalog.in_commit_order()]

    def latest_step(self) -> Optional[int]:
        """The most recently committed step, or None when there is none.

        In a run whose steps only go up this is also the highest step. After a deliberate roll
        back (restore 10, train on, save 11 and 12) it is 12, not an abandoned higher step.
        """
        self._check_process()
        latest = self.catalog.latest()
        if latest is not None:
            return latest
        steps = self.layout.committed_steps()  # only steps whose manifests do not read
        return steps[-1] if steps else None

    def metrics(self, step: int) -> Dict[str, float]:
        """The metrics stored with a committed step."""
        return dict(self.layout.read_manifest(_check_step(step)).metrics)

    # ---- restoring ---------------------------------------------------------------------------
    def restore(self, step: Optional[int], state_dict: Dict[str, Any], *, verify: Optional[bool] = None,
                allow_pickle: bool = False) -> int:
        """Load a committed step into ``state_dict`` in place and return the step.

        ``step=None`` picks the most recently committed step (see :meth:`latest_step`); if it
        fails verification, the next older commit that verifies is used, with a warning naming
        the skipped step. A named step that is damaged raises :class:`CorruptCheckpointError`.
        Entries the checkpoint has but ``state_dict`` lacks (e.g. a fresh optimizer's empty
        ``state``) are added. On failure ``state_dict`` is left as it was.
        """
        self._check_process()
        if not isinstance(state_dict, Mapping):
            raise InvalidStateDictError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        if not self._closed:
            self.wait_for_staging()
            self._writer.join()  # pending saves land first (and their errors surface)
        verify = self.verify if verify is None else verify
        if self._dist is not None:
            s = _dist.restore(self, None if step is None else _check_step(step), state_dict, verify, allow_pickle)
            return self._note_restored(s)
        steps = self.catalog.steps_newest_first()
        if step is not None:
            step = _check_step(step)
            if step not in steps:
                listed = sorted(steps)
                raise StepNotFoundError(
                    f"no committed checkpoint for step {step} under {self.storage.url} "
                    f"(committed: {listed if len(listed) <= 20 else listed[-20:]})", step=step)
            self._restore_step(step, state_dict, verify, allow_pickle)
            return self._note_restored(step)
        if not steps:
            raise StepNotFoundError(f"no committed checkpoint under {self.storage.url}")
        errors = []
        for s in steps:
            try:
                self._restore_step(s, state_dict, verify, allow_pickle)
            except CorruptCheckpointError as exc:
                warnings.warn(f"async_ckpt: skipping damaged step {s}: {exc}", RuntimeWarning, stacklevel=2)
                errors.append(exc)
                continue
            return self._note_restored(s)
        raise CorruptCheckpointError(
            f"no committed step under {self.storage.url} passed verification; newest error: {errors[0]}",
            step=steps[0]) from errors[0]

    def _note_restored(self, step: int) -> int:
        self._restored = step
        return step

    def _restore_step(self, step: int, state_dict: Dict[str, Any], verify: bool, allow_pickle: bool) -> None:
        path, manifest = self.layout.open_step(step)
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
        """Wait for every pending save to commit (and retention's decision after it); raise the
        first background failure."""
        self._check_process()
        self.wait_for_staging()
        self._writer.join()

    def close(self) -> None:
        """Finish pending saves and deletions, stop the background threads, release the writer
        lease, raise failures."""
        if self._closed:
            return
        self._check_process()
        self._closed = True
        _live_managers.discard(self)
        if self._preemption is not None:
            self._preemption.watcher.uninstall()
        try:
            self.wait_for_staging()  # lazy saves' writers wait for their copies to be sealed
            self._writer.close()
        finally:
            self._deleter.shutdown(wait=True)
            if self._lease is not None:
                self._lease.release()
            self._finalizer.detach()

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

    def _check_process(self) -> None:
        if self._forked:
            raise CheckpointError(
                f"this CheckpointManager ({self.storage.url}) was created in process {self._pid} and is "
                f"used in a forked child (pid {os.getpid()}): its writer threads do not exist here, so "
                f"saves would never be written. Create a new CheckpointManager in the child.")

    def _check_open(self) -> None:
        self._check_process()
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
