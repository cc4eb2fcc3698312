"""The stager protocol: what a manager needs from an eager or a lazy stager.

Modelled on DCP's ``AsyncStager``: :meth:`SnapshotStager.stage` turns a state dict into a
:class:`~.snapshot.HostSnapshot`, and :meth:`SnapshotStager.synchronize_staging` waits until
every snapshot this stager returned has all its host copies. The eager stager
(:class:`~.eager.EagerStager`) copies everything before ``stage`` returns; the lazy stager
(:class:`~.lazy.LazyStager`) returns once the copies are issued.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from .plan import StagingPlan
from .snapshot import HostSnapshot


@runtime_checkable
class SnapshotStager(Protocol):
    """What a manager needs from a stager (see the module docstring)."""

    def plan(self, state_dict: Any) -> StagingPlan:
        """Validate and flatten ``state_dict`` (:func:`~.plan.make_plan`).

        Args:
            state_dict: the state dict.

        Returns:
            Its plan.
        """
        ...

    def stage(self, state_dict: Any, plan: Optional[StagingPlan] = None) -> HostSnapshot:
        """Host copies of ``state_dict``.

        Args:
            state_dict: the state dict to copy.
            plan: its plan (default: planned here).

        Returns:
            The snapshot.
        """
        ...

    def synchronize_staging(self) -> None:
        """Wait until every snapshot staged so far has all its host copies (training thread)."""
        ...
