"""What a manager lists: committed steps over its tiers, commit order, metrics, the best step."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..errors import InvalidArgumentError, StepNotFoundError, warn_user
from ..policies import RetentionPolicy, best_checkpoint, check_step, find_keep_best
from ..storage import CheckpointLayout, Manifest
from ..tiers import FALLBACK_ERRORS, Tier, commit_records, foreign_root, held_steps


class TierListing:
    """The listing methods of :class:`~async_ckpt.CheckpointManager` (a mixin over its tiers)."""

    _tiers: List[Tier]
    _local: Optional[Tier]
    layout: CheckpointLayout
    retention: RetentionPolicy

    def _check_process(self) -> None:  # pragma: no cover - the manager's
        raise NotImplementedError

    def best_step(self, metric: Optional[str] = None, mode: Optional[str] = None) -> Optional[int]:
        """The committed step with the best value of ``metric`` (ties: the earliest commit).

        ``metric``/``mode`` default to those of the retention's :class:`KeepBest` (a ``KeepBest``
        inside ``AnyOf`` counts); ``mode`` is ``"min"`` otherwise. None when no committed step
        has the metric.
        """
        best = find_keep_best(self.retention)
        if metric is None:
            if best is None:
                raise InvalidArgumentError("best_step() needs metric= (the retention policy has no KeepBest)")
            metric = best.metric
        if mode is None:
            mode = best.mode if best is not None and best.metric == metric else "min"
        found = best_checkpoint(commit_records(self._tiers), metric, mode)
        return None if found is None else found.step

    def all_steps(self) -> List[int]:
        """Committed steps, ascending (as torch_xla's manager lists them), over every tier. The
        order that counts is commit order: see :meth:`steps_in_commit_order` and :meth:`latest_step`."""
        self._check_process()
        if self._local is None:
            return self.layout.committed_steps()
        return sorted(self.step_tiers())

    def step_tiers(self) -> Dict[int, Tuple[str, ...]]:
        """Committed step -> the tiers holding it (``"local"``, ``"persistent"``), newest
        commit first. Without ``local_dir`` every step is ``("persistent",)``."""
        self._check_process()
        return {h.step: h.tiers for h in held_steps(self._tiers)}

    def steps_in_commit_order(self) -> List[int]:
        """Committed steps, oldest commit first (the order retention sees them in)."""
        self._check_process()
        return [c.step for c in commit_records(self._tiers)]

    def latest_step(self) -> Optional[int]:
        """The most recently committed step (over every tier), or None when there is none.

        In a run whose steps only go up this is also the highest step. After a deliberate roll
        back (restore 10, train on, save 11 and 12) it is 12, not an abandoned higher step.
        """
        self._check_process()
        records = commit_records(self._tiers)
        if records:
            return records[-1].step
        steps = self.all_steps()  # only steps whose manifests do not read
        return steps[-1] if steps else None

    def metrics(self, step: int) -> Dict[str, float]:
        """The metrics stored with a committed step (of its newest save, over the tiers). A tier
        that cannot be read (a bucket that is down) is skipped with a warning while another
        tier holds the step; when none does, its error is raised (it may hold the step).
        Another job's local copy (saved for another checkpoint path: see
        :func:`~async_ckpt.tiers.foreign_root`) is not read: when only such copies hold the
        step, :class:`StepNotFoundError` is raised."""
        step = check_step(step)
        copies: List[Manifest] = []
        failed: List[BaseException] = []
        foreign: List[str] = []
        for t in self._tiers:
            try:
                if step in t.store.layout.committed_steps():
                    manifest = t.store.layout.read_manifest(step)
                    root = foreign_root(t, manifest.extra)
                    if root is None:
                        copies.append(manifest)
                    else:
                        foreign.append(f"the copy in {t.url} was saved for the checkpoint path {root}")
            except FALLBACK_ERRORS as exc:
                if len(self._tiers) == 1:
                    raise
                warn_user(f"async_ckpt: the {t.name} tier ({t.url}) cannot be read, using the other tier: "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning)
                failed.append(exc)
        if not copies:
            if failed:
                raise failed[0]
            if foreign:
                raise StepNotFoundError(f"no committed checkpoint of this job for step {step} under "
                                        f"{' or '.join(t.url for t in self._tiers)} ({'; '.join(foreign)}: "
                                        f"another job's)", step=step)
            return dict(self.layout.read_manifest(step).metrics)  # raises the not-found error
        return dict(max(copies, key=lambda m: m.commit_time).metrics)
