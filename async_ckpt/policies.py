"""Save-decision and retention policies: small objects with one method each.

A *save policy* answers ``should_save(step) -> bool``. A *retention policy* answers
``keep(checkpoints) -> set of steps`` given every committed checkpoint (oldest commit first);
the manager deletes the rest, except that the newest committed step and any step still being
written are never deleted, whatever a policy says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Protocol, Sequence, Set, runtime_checkable


@dataclass(frozen=True)
class CheckpointInfo:
    """What retention policies see of a committed checkpoint (read from its manifest)."""

    step: int
    commit_time: float
    metrics: Dict[str, float] = field(default_factory=dict)
    nbytes: int = 0


@runtime_checkable
class SavePolicy(Protocol):
    def should_save(self, step: int) -> bool:
        """Whether a checkpoint is due at ``step``."""


@runtime_checkable
class RetentionPolicy(Protocol):
    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        """The steps to keep, given every committed checkpoint in commit order."""


@dataclass(frozen=True)
class EveryNSteps:
    """Save when ``step % n == 0`` (torch_xla's ``save_interval``)."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"save interval must be an int >= 1, got {self.n!r}")

    def should_save(self, step: int) -> bool:
        return step % self.n == 0


@dataclass(frozen=True)
class KeepAll:
    """Never delete anything."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        return {c.step for c in checkpoints}


@dataclass(frozen=True)
class KeepLatest:
    """Keep the ``n`` most recently committed checkpoints (torch_xla's ``max_to_keep``)."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"KeepLatest needs n >= 1, got {self.n!r}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        ordered = sorted(checkpoints, key=lambda c: (c.commit_time, c.step))
        return {c.step for c in ordered[-self.n:]}
