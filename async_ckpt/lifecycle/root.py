"""``Root``: one checkpoint root of a manager, the persistent root and the local tier alike.

A root is where steps go (its :class:`~.steps.StepStore`: catalog, writer lease, deletions),
the background writer that writes them, the retention that drops them, the save policy that
says when a step is due there, and when this manager last took a save for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..policies import RetentionPolicy, SavePolicy
from ..save_queue import AsyncWriter
from .steps import StepStore

#: the name of the local tier's root (``local_dir``)
LOCAL = "local"
#: the name of the persistent root (the manager's ``path``)
PERSISTENT = "persistent"
#: the name of a root of copies a rank holds for another rank (``local_replicas=``: peer copies)
HELD = "held"


@dataclass
class Root:
    """One checkpoint root: its steps, its writer, its retention, its save schedule state.

    Attributes:
        name: :data:`PERSISTENT`, :data:`LOCAL` or :data:`HELD`.
        store: the steps under the root (catalog, lease, deletions).
        writer: the background writer of the root's saves (a held root's: the replication thread).
        retention: which committed steps stay (applied after each commit there).
        policy: when a save is due at this root; None: whenever one is due at the persistent
            root (a local tier without a ``local_policy``).
        last_save_time: when this manager last took a save for the root (interval clock).
        last_save_step: the step of that save.
        home: a local tier's persistent root (``root_identity`` of it): a local copy saved
            for another root is another job's. None for the persistent root.
    """

    name: str
    store: StepStore
    writer: AsyncWriter
    retention: RetentionPolicy
    policy: Optional[SavePolicy] = None
    last_save_time: Optional[float] = None
    last_save_step: Optional[int] = None
    home: Optional[str] = None

    @property
    def url(self) -> str:
        """The root's URL (as given, with its protocol)."""
        return self.store.storage.url

    def record_save(self, step: int, now: float) -> None:
        """Remember that a save of ``step`` was taken for this root at ``now`` (interval clock).

        Args:
            step: the step saved.
            now: the interval clock's time of the save.
        """
        self.last_save_time, self.last_save_step = now, step
