"""What a user does to committed steps explicitly: delete one, promote a local one."""

from __future__ import annotations

import logging
from typing import List, Optional

from ..errors import CheckpointError
from ..lifecycle.coordinator import Coordinator, describe, rebuild
from ..lifecycle.steps import StepStore
from ..policies import RetentionPolicy, check_step
from ..storage import CheckpointLayout
from ..tiers import Tier, foreign_steps, promote

log = logging.getLogger("async_ckpt")


class StepActions:
    """The ``delete``/``promote`` methods of :class:`~async_ckpt.CheckpointManager` (a mixin)."""

    _tiers: List[Tier]
    _local: Optional[Tier]
    _store: StepStore
    _coord: Coordinator
    layout: CheckpointLayout
    retention: RetentionPolicy
    verify: bool
    write_threads: int

    def _check_open(self) -> None:  # pragma: no cover - the manager's
        raise NotImplementedError

    def _settle(self, invalid: Optional[Exception] = None, key: Optional[int] = None) -> None:  # pragma: no cover - the manager's
        raise NotImplementedError

    def delete(self, step: int) -> None:
        """Delete a committed step (an explicit user action): it is no longer listed or
        restorable when this returns, and its files are gone (from every tier that holds it).

        Waits for pending saves first and takes the root's writer lease (:class:`LeaseHeldError`
        while another writer holds it). Raises :class:`StepNotFoundError` for a step that is not
        committed. Multi-process: call it on every rank; rank 0 deletes (each rank its own
        local copy), and a failure on any rank (one rank's earlier failed save, its local copy
        that cannot be deleted) is raised on every rank.
        """
        self._check_open()
        invalid: Optional[Exception] = None
        try:
            step = check_step(step)
        except (TypeError, ValueError, CheckpointError) as exc:
            invalid = exc
        self._settle(invalid, key=None if invalid is not None else step + 1)  # every rank names the same step
        if invalid is not None:
            raise invalid
        outcome = None
        mine: Optional[BaseException] = None
        try:
            local_held = (self._local is not None and step in self._local.store.layout.committed_steps()
                          and not foreign_steps(self._local, step))  # another job's copy is not ours
            if local_held and self._local is not None:
                self._local.store.become_writer()
                self._local.store.delete(step)
            if self._coord.is_primary and (not local_held or step in self.layout.committed_steps()):
                self._store.become_writer()
                self._store.delete(step)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank
            if self._coord.world_size == 1:
                raise
            outcome, mine = describe(self._coord.rank, exc), exc
        if self._coord.world_size > 1:  # every rank's outcome (its local copy; rank 0: the root's)
            bad = [o for o in self._coord.all_gather(outcome) if o is not None]
            if mine is not None:
                raise mine
            if bad:
                raise rebuild(bad[0][0], f"step {step}: delete failed: {bad[0][1]}", step)

    def promote(self, step: int) -> List[int]:
        """Copy the local tier's committed ``step`` to ``path`` and commit it there (checked
        against the local manifest first); returns the steps ``path``'s retention then dropped
        (logged too). That retention pass keeps the promoted step; later saves' passes see it
        as any other step, at its original commit time. Waits for pending saves; takes the
        writer lease of ``path``. One process only (a rank's local copy holds only its own shards)."""
        self._check_open()
        step = check_step(step)
        if self._local is None:
            raise CheckpointError("promote() needs a manager with local_dir=")
        if self._coord.world_size > 1:
            raise CheckpointError("promote() copies one process's local step; with several ranks each local "
                                  "copy holds one rank's shards: save the step with force=True instead")
        self._settle()  # an earlier failed upload (still raised by join) is what promote repairs
        self._store.become_writer()
        _, dropped = promote(self._local, self._tiers[-1], step, verify=self.verify, threads=self.write_threads,
                             retention=self.retention)
        if dropped:
            log.warning("promote(%d): the retention of %s dropped steps %s", step,
                        self._store.storage.url, dropped)
        return dropped
