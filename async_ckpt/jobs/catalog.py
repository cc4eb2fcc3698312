"""``StepCatalog``: the bookkeeping of one manager's steps, under one lock.

Commit order is the order: the newest commit is the latest step, retention sees steps oldest
commit first, and a step is never dropped while it is being written or because another step
was saved or restored. Commit times are read from the manifests; the catalog hands out commit
times that never go backwards (also across restarts: a new commit is stamped after every
commit it can see), so commit order survives a clock step.

The writer (the holder of the root's lease) keeps the committed steps' records cached; managers
that only read list the storage every time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Dict, Iterator, List, Optional, Set

from ..errors import StepNotFoundError
from ..policies import CheckpointInfo, RetentionPolicy, apply_retention
from ..storage.step_dirs import StepDirectories

log = logging.getLogger("async_ckpt")


def commit_order(infos: Dict[int, CheckpointInfo]) -> List[CheckpointInfo]:
    """Records oldest commit first (ties: the lower step first)."""
    return sorted(infos.values(), key=lambda c: (c.commit_time, c.step))


class StepCatalog:
    """Committed steps (by commit order), steps in flight, steps being deleted."""

    def __init__(self, layout: StepDirectories, clock: Callable[[], float]) -> None:
        self.layout = layout
        self.clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._inflight: Dict[int, str] = {}  # step -> directory being written ("" before it exists)
        self._deleting: Set[int] = set()
        self._held: Dict[int, int] = {}  # step -> readers that retention must not pull it from under
        self._infos: Optional[Dict[int, CheckpointInfo]] = None  # cache (writer only)
        self._gen = 0  # bumped by every commit and deletion, so a stale listing is never cached
        self._cache = False

    # ---- reading -----------------------------------------------------------------------------
    def enable_cache(self) -> None:
        """Keep records cached from now on: only valid for the holder of the writer lease."""
        self._cache = True

    def _record(self, step: int) -> Optional[CheckpointInfo]:
        try:
            m = self.layout.read_manifest(step)
        except StepNotFoundError:  # deleted since it was listed (a live writer's retention): not damage
            log.debug("step %d is no longer committed", step)
            return None
        except Exception as exc:  # damaged: not a record retention can rely on
            log.warning("ignoring step %d: %s", step, exc)
            return None
        return CheckpointInfo(step, m.commit_time, dict(m.metrics), m.nbytes, m.all_extra())

    def infos(self) -> Dict[int, CheckpointInfo]:
        """step -> record of every committed step whose manifest reads.

        The steps are listed from storage every time (a listing is cheap; a marker removed by
        hand is seen at once); with the cache on, only manifests not read before are read.
        """
        steps = self.layout.committed_steps()
        with self._lock:
            known = dict(self._infos) if self._cache and self._infos is not None else {}
            gen = self._gen
        out: Dict[int, CheckpointInfo] = {}
        for step in steps:
            info = known.get(step) or self._record(step)
            if info is not None:
                out[step] = info
        if self._cache:
            with self._lock:
                if self._gen == gen:  # nothing committed or deleted meanwhile
                    self._infos = dict(out)
        return out

    def in_commit_order(self) -> List[CheckpointInfo]:
        return commit_order(self.infos())

    def latest(self) -> Optional[int]:
        """The most recently committed step whose manifest reads (None when there is none)."""
        ordered = self.in_commit_order()
        return ordered[-1].step if ordered else None

    def steps_newest_first(self) -> List[int]:
        """Committed steps, newest commit first, after the steps whose manifest does not read
        (highest first): their commit time is unknown, so a restore tries them first and
        reports why it skips them."""
        order = [c.step for c in reversed(self.in_commit_order())]
        seen = set(order)
        return [s for s in reversed(self.layout.committed_steps()) if s not in seen] + order

    # ---- writing -----------------------------------------------------------------------------
    def begin_write(self, step: int) -> None:
        """Claim ``step`` for a save (waits out a deletion of it)."""
        with self._changed:
            self._changed.wait_for(lambda: step not in self._deleting)
            self._inflight[step] = ""

    def set_path(self, step: int, path: str) -> None:
        with self._lock:
            self._inflight[step] = path

    def end_write(self, step: int) -> None:
        with self._changed:
            self._inflight.pop(step, None)
            self._changed.notify_all()  # a removal of the step's old files may be waiting

    def busy_paths(self) -> Set[str]:
        with self._lock:
            return {p for p in self._inflight.values() if p}

    def in_flight(self) -> Set[int]:
        """Steps being written, and steps :meth:`hold` holds: retention drops none of them."""
        with self._lock:
            return set(self._inflight) | set(self._held)

    @contextlib.contextmanager
    def hold(self, step: int) -> Iterator[None]:
        """Keep retention from dropping ``step`` while this process reads it (a promotion
        copying it to another root); a pass that would have dropped it drops it after."""
        with self._lock:
            self._held[step] = self._held.get(step, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._held[step] -= 1
                if not self._held[step]:
                    del self._held[step]

    def next_commit_time(self, at: Optional[float] = None) -> float:
        """Now (or ``at``), or just after the newest commit this catalog knows (commit times
        never go back)."""
        now = self.clock() if at is None else at
        known = [c.commit_time for c in self.infos().values()]
        newest = max(known) if known else float("-inf")
        return now if now > newest else newest + 1e-6

    def record_commit(self, info: CheckpointInfo) -> None:
        """Called once ``info.step`` is committed, while it is still marked in flight."""
        with self._lock:
            self._gen += 1
            if self._infos is not None:
                self._infos[info.step] = info

    # ---- retention and deletion --------------------------------------------------------------
    def drops(self, policy: RetentionPolicy) -> List[int]:
        """The committed steps ``policy`` drops now, oldest commit first. Never the newest
        commit, never a step in flight."""
        ordered = self.in_commit_order()
        if not ordered:
            return []
        keep = apply_retention(policy, ordered)
        keep.add(ordered[-1].step)
        keep |= self.in_flight()
        return [c.step for c in ordered if c.step not in keep]

    def claim_delete(self, step: int) -> bool:
        """Reserve ``step`` for deletion unless a save of it is in flight."""
        with self._lock:
            if step in self._inflight or step in self._deleting:
                return False
            self._deleting.add(step)
            return True

    def release_delete(self, step: int) -> None:
        with self._changed:
            self._deleting.discard(step)
            self._changed.notify_all()

    def condemn(self, step: int) -> List[str]:
        """Make ``step`` no longer committed, at once (markers removed); return the directories
        whose files are still to delete. [] when it is in flight or already being deleted."""
        if not self.claim_delete(step):
            return []
        try:
            paths = self.layout.condemn(step)
            with self._lock:
                self._gen += 1
                if self._infos is not None:
                    self._infos.pop(step, None)
            return paths
        finally:
            self.release_delete(step)

    def remove(self, step: int, paths: List[str]) -> None:
        """Delete the files of condemned directories of ``step`` (deleter thread). Waits out a
        save of the step; a directory committed again meanwhile is left alone."""
        with self._changed:
            self._changed.wait_for(lambda: step not in self._deleting and step not in self._inflight)
            self._deleting.add(step)
        try:
            for p in paths:
                self.layout.remove(p)
        finally:
            self.release_delete(step)

    def forget(self) -> None:
        """Drop the cache (the storage may have changed under us)."""
        with self._lock:
            self._gen += 1
            self._infos = None
