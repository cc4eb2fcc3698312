"""``RootStore``: the steps under one root, as one manager sees and changes them.

It wires the step catalog, the root's writer lease, retention and the background deleter,
for one process and for N (on N ranks only rank 0 holds the lease, commits and deletes; the
other ranks' stores only list and read).
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Set

from ..errors import LeaseHeldError, StepAlreadyExistsError, StepNotFoundError
from ..format import step_names
from ..format.dcp_layout import WriteMemo
from ..format.manifest import MARKER_NAME, Manifest
from ..io import Reuse
from ..io.dcp_adapters import read_metadata
from ..policies import CheckpointInfo, RetentionPolicy
from ..ranks.exchange import Exchange
from ..storage import StepTarget, Storage
from ..storage.lease import writer_lease
from ..storage.step_dirs import StepDirectories
from .catalog import StepCatalog

log = logging.getLogger("async_ckpt")


class RootStore:
    """Committed, in-flight and condemned steps of one root; the lease; deletions."""

    def __init__(self, storage: Storage, layout: StepDirectories, exchange: Exchange,
                 clock: Callable[[], float], *, keep_incomplete: bool = False, lease_timeout: float = 0.0,
                 reuse: Optional[Reuse] = None) -> None:
        self.storage = storage
        self.layout = layout
        self.exchange = exchange
        self.catalog = StepCatalog(layout, clock)
        #: the last save's file layout at this root, reused by the next save of the same shape
        self.memo = WriteMemo()
        #: incremental saves: what the last step this store committed holds (None: every save whole)
        self.reuse = reuse
        self.keep_incomplete = keep_incomplete
        self.lease_timeout = lease_timeout
        # Taken at the first save (or delete): until then this store only reads.
        self.lease = writer_lease(storage) if exchange.is_primary else None
        self.deleter = ThreadPoolExecutor(1, thread_name_prefix="async-ckpt-delete")
        self._warned_lower = False
        self._busy = 0  # background deletions queued or running
        self._busy_cond = threading.Condition()
        self._top: Optional[int] = None  # highest step committed or saved, once listed
        self._foreign: Optional[Set[int]] = None  # steps other programs' directories hold, once listed
        self._recalled = False  # recall_last_step() ran
        self._recall_step: Optional[int] = None  # the step a restore read from this root
        #: several ranks: keys whose values differed between ranks (warned about once)
        self.diverged_keys: Set[str] = set()
        #: how log lines name this root among a manager's roots (" from the local tier"); empty
        #: for a manager with one root
        self.label = ""

    # ---- the writer lease --------------------------------------------------------------------
    def become_writer(self) -> None:
        """Take the root's writer lease before the first write; then settle what a dead writer
        left: finish interrupted commits, clean up incomplete steps (in the background)."""
        if self.lease is None:
            return
        if self.lease.held:
            try:
                self.lease.check()
                return
            except LeaseHeldError as exc:  # lost (taken over, or lapsed): give up our claim, then take it again
                log.warning("%s; taking the writer lease again", exc)
                self.lease.release()
                self._forget_root()  # another writer may have held the root meanwhile
        self.lease.acquire(self.lease_timeout)
        self.catalog.enable_cache()
        self.catalog.forget()
        self.recover()
        if not self.keep_incomplete:
            self.in_background(self.cleanup_incomplete)

    def _forget_root(self) -> None:
        """Forget what this store remembered of the root's steps while it held the lease: a
        writer that held the root in between may have deleted or re-saved any step under the
        same name, so an incremental save takes nothing from a step this store committed or
        restored (the next save is whole), and the highest step is listed again."""
        reuse = self.reuse
        if reuse is not None:
            reuse.forget()
        self._recall_step, self._recalled = None, True
        self._top = None
        self._foreign = None

    def check_lease(self, step: Optional[int] = None) -> None:
        """Right before a commit or a delete: raise :class:`LeaseHeldError` (of ``step``)
        unless this store can prove it still holds the lease (object stores: not taken over,
        and renewed within the TTL)."""
        if self.lease is not None:
            try:
                self.lease.check()
            except LeaseHeldError as exc:
                raise exc.with_context(step=step) from exc.__cause__

    def warn_if_lower(self, step: int, restored: Optional[int]) -> None:
        """One warning when a save goes below the highest committed step without a restore.
        Lists the root once (at the first save); later saves compare with what it saw and what
        was saved since, so the check does no I/O in the stall."""
        if self._top is None:
            steps = self.layout.committed_steps()
            self._top = steps[-1] if steps else -1
        top, self._top = self._top, max(self._top, step)
        if self._warned_lower or (restored is not None and restored <= step) or step >= top:
            return
        self._warned_lower = True
        log.warning(
            "saving step %d under %s, which already holds committed steps up to %d "
            "(an earlier run?). Commit order decides: step %d becomes the latest step, and "
            "retention by commit order will delete the older run's steps as this run goes on. "
            "Restore a step first to continue from it, or save to another directory.",
            step, self.storage.url, top, step)

    def refuse_existing(self, step: int, overwrite: bool = True) -> None:
        """Before a save of ``step`` here (the holder of the lease): refuse one that would take
        the place of another program's directory, or (``overwrite=False``) of a step that exists.
        The root is listed for foreign directories once (at the first save); a step found there
        is checked again directly, so a directory removed since does not refuse its step (one
        written since is refused by the commit itself).

        Args:
            step: the step about to be saved.
            overwrite: whether a save may replace a committed (or queued) step of ours.

        Raises:
            ForeignStepError: another program's directory holds the step's name.
            StepAlreadyExistsError: ``overwrite=False`` and the step is committed or being saved.
        """
        if self._foreign is None:
            self._foreign = set(self.layout.foreign_steps())
        if step in self._foreign:
            self.layout.refuse_foreign(step)
            self._foreign.discard(step)
        if not overwrite and (step in self.catalog.infos() or step in self.catalog.in_flight()):
            raise StepAlreadyExistsError(
                f"step {step} already exists under {self.storage.url} and this manager was created with "
                f"overwrite=False: save another step, delete({step}) it first, or create the manager with "
                f"overwrite=True (a re-save replaces a step atomically)", step=step,
                path=self.layout.step_dir(step))

    # ---- retention and deletion --------------------------------------------------------------
    def in_background(self, fn: Callable[[], None]) -> None:
        """Run deletions off the writer thread, so they never delay the next save."""
        def run() -> None:
            try:
                fn()
            finally:
                with self._busy_cond:
                    self._busy -= 1
                    self._busy_cond.notify_all()

        with self._busy_cond:
            self._busy += 1
        try:
            self.deleter.submit(run)
        except RuntimeError:  # executor already shut down (close() or interpreter exit)
            run()

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no deletion is queued or running in the
        background; whether none is."""
        with self._busy_cond:
            return self._busy_cond.wait_for(lambda: self._busy == 0, timeout=timeout)

    def apply_retention(self, policy: RetentionPolicy) -> List[int]:
        """Right after a commit (rank 0): the steps ``policy`` drops stop being committed now
        (their markers go); their files are deleted in the background. Returns them."""
        try:
            drops = self.catalog.drops(policy)
        except Exception as exc:  # a failing policy must never break training
            log.warning("retention failed: %s", exc)
            return []
        dropped = []
        for s in drops:
            try:
                self.check_lease()
            except LeaseHeldError as exc:
                log.error("retention deletes nothing: %s", exc)
                break
            try:
                paths = self.condemn(s)
            except Exception as exc:
                log.warning("could not delete step %d: %s", s, exc)
                continue
            if paths:
                dropped.append(s)
                log.info("deleted step %d%s (retention)", s, self.label)
                self.in_background(functools.partial(self._remove, s, paths))
        return dropped

    def condemn(self, step: int) -> List[str]:
        """``catalog.condemn(step)``; an incremental save no longer takes files from ``step``."""
        self.forget_step(step)
        return self.catalog.condemn(step)

    def forget_step(self, step: int) -> None:
        """Incremental saves: take nothing more from ``step``'s files (it is being deleted or
        saved again, so the files under its name are going, or will be others)."""
        reuse = self.reuse
        if reuse is not None:
            reuse.forget_step(step)

    def note_restored(self, step: Optional[int]) -> None:
        """A restore read ``step`` from this root (``None``: from another root): incremental saves
        compare with that step from now on (read back at the next save, :meth:`recall_last_step`),
        never with a step they would otherwise have remembered (a restore that fell back skipped
        damaged newer steps, whose files must not be shared again)."""
        reuse = self.reuse
        if reuse is not None:
            reuse.forget()
            self._recall_step, self._recalled = step, False

    def recall_last_step(self) -> None:
        """Incremental saves, before the first save after a restore: remember what the restored
        step holds (from its manifest's record hashes and its ``.metadata``), so that a resumed
        run takes its unchanged files too. Only the step a restore read and verified is recalled
        (a step never read might be damaged, and sharing it would carry the damage forward);
        one that cannot be read is skipped (that save is whole)."""
        reuse = self.reuse
        if reuse is None or self._recalled:
            return
        self._recalled = True
        try:
            step = self._recall_step
            if step is None:
                return
            opened = self.layout.read_committed(step)
            where, man = opened.where, opened.manifest
            md = read_metadata(self.storage, where, man.files, whole=man.whole)
            n = reuse.recall(step, where, man.files, md, prefix=f"__{self.exchange.rank}_")
            if n:
                log.info("incremental saves compare with step %d (%d tensors)", step, n)
        except Exception as exc:  # noqa: BLE001 - the first save is then whole
            log.info("incremental saves: the newest step cannot be compared with (%s); the next save is whole", exc)

    def _remove(self, step: int, paths: List[str]) -> None:
        try:
            self.check_lease(step)  # a successor may be re-saving this step into the same directory
            self.catalog.remove(step, paths)
        except Exception as exc:  # the step is already unmarked: cleanup finishes it later
            log.warning("could not remove the files of step %d: %s", step, exc)

    def begin_write(self, step: int) -> "PendingCommit":
        """Begin writing ``step`` (the holder of the lease): see :class:`PendingCommit`.

        Args:
            step: the step.

        Returns:
            The write, to commit or abort.
        """
        return PendingCommit(self, step)

    def delete(self, step: int) -> None:
        """Delete a committed step now (the caller holds the lease)."""
        if step not in self.layout.committed_steps():
            raise StepNotFoundError(f"no committed checkpoint for step {step} under {self.storage.url}", step=step)
        self.check_lease(step)
        paths = self.condemn(step)
        self.check_lease(step)
        self.catalog.remove(step, paths)
        log.info("deleted step %d%s (delete())", step, self.label)

    def recover(self) -> None:
        """Finish commits a crash interrupted (see ``StepDirectories.recover``)."""
        try:
            self.check_lease()
            for step in self.layout.recover():
                log.warning("completed the commit of step %d, which a crash had interrupted", step)
        except Exception as exc:
            log.warning("recovery of interrupted commits failed: %s", exc)

    def cleanup_incomplete(self) -> None:
        """Remove what never committed (a dead writer's debris). Holder of the lease only."""
        try:
            busy = self.catalog.busy_paths()
            for path in self.layout.incomplete(exclude=busy):
                step = self.layout.step_of(path)
                if step is None or not self.catalog.claim_delete(step):
                    continue  # a save of this step started meanwhile: its directory is not ours
                try:
                    if not step_names.is_kind(path, step_names.TRASH) and self.storage.exists(f"{path}/{MARKER_NAME}"):
                        continue  # committed since it was listed
                    log.info("removing incomplete checkpoint %s", path)
                    self.check_lease(step)
                    self.layout.remove(self.layout.condemn_dir(path))
                finally:
                    self.catalog.release_delete(step)
        except Exception as exc:
            log.warning("cleanup of incomplete checkpoints failed: %s", exc)

    def close(self) -> None:
        """Finish deletions, release the lease."""
        try:
            self.deleter.shutdown(wait=True)
        finally:
            if self.lease is not None:
                self.lease.release()


class PendingCommit:
    """One step being written to a root by the holder of its lease: opened (claimed in the
    catalog, its directory begun), then committed (manifest, catalog record, retention) or
    aborted. A save and a promotion commit through it alike.

    Args:
        store: the root.
        step: the step.

    Raises:
        StorageError: the step's directory could not be begun (the claim is given back).
    """

    def __init__(self, store: "RootStore", step: int) -> None:
        self.store = store
        self.step = step
        self.committed = False
        self._claimed = False
        self.target: Optional[StepTarget] = None
        store.catalog.begin_write(step)  # claimed before anything is written; waits out a deletion
        self._claimed = True
        store.forget_step(step)  # a re-save replaces the files under the step's name
        try:
            self.target = store.layout.begin(step, store.layout.new_token())
            store.catalog.set_path(step, self.target.path)
        except BaseException:
            self.abort()
            raise

    def commit(self, manifest: Manifest, policy: RetentionPolicy) -> List[int]:
        """Commit the step with ``manifest``, record it, then apply ``policy`` (decided, its
        markers gone, before this returns).

        Args:
            manifest: the step's manifest (its commit time included).
            policy: the root's retention.

        Returns:
            The steps retention dropped.

        Raises:
            LeaseHeldError: the lease could not be proven right before the commit.
            StorageError: the commit failed.
        """
        assert self.target is not None
        store, step = self.store, self.step
        store.check_lease(step)  # proven right before the commit (object stores: renewed in time)
        store.layout.commit(self.target, manifest)
        self.committed = True
        store.catalog.record_commit(CheckpointInfo(step, manifest.commit_time, dict(manifest.metrics),
                                                   manifest.nbytes, manifest.all_extra()))
        store.catalog.end_write(step)
        self._claimed = False
        return store.apply_retention(policy)

    def abort(self) -> None:
        """Give the claim back and remove what was written, unless committed (idempotent)."""
        if self._claimed:
            self._claimed = False
            self.store.catalog.end_write(self.step)
        if self.target is not None and not self.committed:
            target, self.target = self.target, None
            self.store.layout.abort(target)
