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
from .policies import CheckpointInfo, EveryNSteps, KeepAll, KeepLatest, RetentionPolicy, SavePolicy
from .staging import HostBufferPool, HostSnapshot, Stager, make_plan
from .stats import SaveStats, StatsLog
from .storage import CheckpointLayout, Manifest, Storage, StepTarget
from .storage.dcp_io import METADATA_NAME, FsspecStorageReader, load_metadata, load_state_dict, save_state_dict
from .writer import AsyncWriter

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
        process_group: process group for multi-process saves (default: the default group).
        storage_options: passed to fsspec (credentials, endpoint, project, ...).
        save_policy: an object with ``should_save(step) -> bool``; overrides ``save_interval``.
        retention: an object with ``keep(checkpoints) -> set[int]``; overrides ``max_to_keep``.
        memory_budget_bytes: bound on pooled host staging memory (None: unbounded).
        write_threads: files written concurrently per rank.
        commit_mode: ``"auto"`` (rename on POSIX, marker on object stores), ``"rename"``, ``"marker"``.
        verify: check checksums on restore (sizes are always checked).
        keep_incomplete: keep steps that never committed instead of cleaning them up.
        on_saved: called with the :class:`SaveStats` of each committed save (writer thread).
        stats_log: append each save's :class:`SaveStats` as a JSON line to a file under the root:
            ``True`` for ``<path>/save_stats.jsonl``, or a path relative to ``path`` (see
            :class:`async_ckpt.stats.StatsLog`; on object stores the file is rewritten per save).
    """

    def __init__(
        self,
        path: str,
        save_interval: int = 1,
        max_to_keep: Optional[int] = 0,
        max_pending_async: int = 1,
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
        on_saved: Optional[Callable[[SaveStats], None]] = None,
        stats_log: Any = None,
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 0):
            raise ValueError(f"max_to_keep must be an int >= 0 or None, got {max_to_keep!r}")
        self.save_policy: SavePolicy = save_policy if save_policy is not None else EveryNSteps(save_interval)
        self.retention: RetentionPolicy = (
            retention if retention is not None else (KeepLatest(max_to_keep) if max_to_keep else KeepAll())
        )
        self.storage = Storage(path, storage_options)
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
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-delete")
        self._lock = threading.Lock()
        self._inflight: Dict[int, str] = {}  # step -> directory being written
        self._infos: Optional[Dict[int, CheckpointInfo]] = None
        self._closed = False
        self._check_writable()
        if not keep_incomplete:
            self._in_background(self._cleanup_incomplete)
        _live_managers.add(self)

    # ---- policy ------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether the save policy wants a checkpoint at ``step``."""
        return bool(self.save_policy.should_save(_check_step(step)))

    # ---- saving ------------------------------------------------------------------------------
    def save_async(self, step: int, state_dict: Mapping[str, Any], force: bool = False,
                   metrics: Optional[Dict[str, float]] = None) -> bool:
        """Snapshot ``state_dict`` to host memory and write it in the background.

        Returns once host copies of every tensor exist (the training loop may then mutate its
        tensors freely); returns ``False`` without doing anything when no save is due and
        ``force`` is not set. Raises the error of an earlier failed background save.
        """
        return self._save(step, state_dict, force, metrics, wait=False)

    def save(self, step: int, state_dict: Mapping[str, Any], force: bool = False,
             metrics: Optional[Dict[str, float]] = None) -> bool:
        """Like :meth:`save_async`, but returns only once the step is committed."""
        return self._save(step, state_dict, force, metrics, wait=True)

    def _save(self, step: Any, state_dict: Mapping[str, Any], force: bool, metrics: Any, wait: bool) -> bool:
        self._check_open()
        step = _check_step(step)
        from .storage.manifest import check_metrics

        metrics = check_metrics(metrics)
        self._writer.raise_if_failed()
        if not force and not self.save_policy.should_save(step):
            return False
        t0 = time.perf_counter()
        plan = make_plan(state_dict)  # validates before anything is taken or written
        self._writer.wait_for_slot()
        t1 = time.perf_counter()
        try:
            snap = self.stager.stage(state_dict, plan)
        except BaseException:
            self._writer.release_slot()
            raise
        t2 = time.perf_counter()
        stats = SaveStats(step=step, nbytes=snap.nbytes, num_tensors=snap.num_tensors,
                          queue_wait_s=t1 - t0, stage_s=t2 - t1, blocking_s=t2 - t0)
        self._writer.submit(lambda: self._persist(step, snap, metrics, stats, t0), step=step)
        if wait:
            self._writer.join()
        return True

    def _persist(self, step: int, snap: HostSnapshot, metrics: Dict[str, float], stats: SaveStats, t0: float) -> None:
        """Writer thread: data files, then manifest and marker, then retention."""
        target: Optional[StepTarget] = None
        try:
            tw = time.perf_counter()
            target = self.layout.begin(step)
            with self._lock:
                self._inflight[step] = target.path
            files = save_state_dict(self.storage, target.path, snap.state_dict,
                                    threads=self.write_threads, process_group=self.process_group)
            snap.release()  # buffers go back to the pool as soon as the data is written
            tc = time.perf_counter()
            manifest = Manifest(step=step, commit_time=time.time(), files=files, metrics=metrics,
                                nbytes=snap.nbytes, num_tensors=snap.num_tensors, world_size=1,
                                extra={"int_keys": snap.int_keys} if snap.int_keys else {})
            self.layout.commit(target, manifest)
            td = time.perf_counter()
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
        with self._lock:
            if self._infos is not None:
                self._infos[step] = CheckpointInfo(step, manifest.commit_time, dict(metrics), snap.nbytes)
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
        with self._lock:
            if self._infos is not None:
                return dict(self._infos)
        infos: Dict[int, CheckpointInfo] = {}
        for step in self.layout.committed_steps():
            try:
                m = self.layout.read_manifest(step)
            except CheckpointError as exc:
                log.warning("async_ckpt: ignoring step %d for retention: %s", step, exc)
                continue
            infos[step] = CheckpointInfo(step, m.commit_time, dict(m.metrics), m.nbytes)
        with self._lock:
            self._infos = dict(infos)
        return infos

    def _apply_retention(self) -> None:
        try:
            infos = self._checkpoint_infos()
            if not infos:
                return
            ordered = sorted(infos.values(), key=lambda c: (c.commit_time, c.step))
            keep = set(self.retention.keep(ordered))
            keep.add(ordered[-1].step)  # the newest commit is never deleted
            keep.add(max(infos))  # nor the highest step
            with self._lock:
                keep |= set(self._inflight)
            for info in ordered:
                if info.step not in keep:
                    self.layout.delete(info.step)
                    with self._lock:
                        if self._infos is not None:
                            self._infos.pop(info.step, None)
                    log.info("async_ckpt: deleted step %d (retention)", info.step)
        except Exception as exc:  # deletion is best effort and must never break training
            log.warning("async_ckpt: retention failed: %s", exc)

    def _cleanup_incomplete(self) -> None:
        try:
            with self._lock:
                busy = set(self._inflight.values())
            for path in self.layout.incomplete(exclude=busy):
                with self._lock:
                    if path in self._inflight.values():
                        continue
                log.info("async_ckpt: removing incomplete checkpoint %s", path)
                self.storage.rm(path)
        except Exception as exc:
            log.warning("async_ckpt: cleanup of incomplete checkpoints failed: %s", exc)

    # ---- listing -----------------------------------------------------------------------------
    def all_steps(self) -> List[int]:
        """Committed steps, ascending."""
        return self.layout.committed_steps()

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
            self._writer.join()  # pending saves land first (and their errors surface)
        verify = self.verify if verify is None else verify
        steps = self.all_steps()
        if step is not None:
            step = _check_step(step)
            if step not in steps:
                raise StepNotFoundError(
                    f"no committed checkpoint for step {step} under {self.storage.url} "
                    f"(committed: {steps if len(steps) <= 20 else steps[-20:]})", step=step)
            self._restore_step(step, state_dict, verify, allow_pickle)
            return step
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
            return s
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
                            process_group=self.process_group)
        except BaseException as exc:
            _remove_added(state_dict, added)
            if isinstance(exc, CorruptCheckpointError):
                exc.step = step
            raise

    # ---- lifecycle ---------------------------------------------------------------------------
    def join(self) -> None:
        """Wait for every pending save to commit; raise the first background failure."""
        self._writer.join()

    def close(self) -> None:
        """Finish pending saves and deletions, stop the background threads, raise failures."""
        if self._closed:
            return
        self._closed = True
        _live_managers.discard(self)
        try:
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
        if self.storage.is_local:
            import os

            if not os.access(self.storage.root, os.W_OK):
                raise StorageError(f"checkpoint path {self.storage.url!r} is not writable")


def _prepare_target(state_dict: Dict[str, Any], metadata: Any, step: int, int_keys: Set[str]) -> List[tuple]:
    """Check ``state_dict`` against a checkpoint's DCP metadata; add entries it lacks.

    Returns the paths added, so that a failed restore can take them out again.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element
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
        path = _typed_path(mappings[k], int_keys)
        if isinstance(m, TensorStorageMetadata):
            set_element(state_dict, path, torch.empty(tuple(m.size), dtype=m.properties.dtype))
        else:
            set_element(state_dict, path, None)
        added.append(path)
    return added


def _typed_path(path: Sequence[Any], int_keys: Set[str]) -> tuple:
    """DCP's path with the dict keys that were ints at save time turned back into ints."""
    out = []
    prefix = ""
    for p in path:
        prefix = f"{prefix}.{p}" if prefix else str(p)
        out.append(int(p) if isinstance(p, str) and prefix in int_keys else p)
    return tuple(out)


def _remove_added(state_dict: Dict[str, Any], added: List[tuple]) -> None:
    for path in reversed(added):
        cur: Any = state_dict
        try:
            for p in path[:-1]:
                cur = cur[p]
            if isinstance(cur, dict):
                cur.pop(path[-1], None)
        except (KeyError, IndexError, TypeError):
            pass
