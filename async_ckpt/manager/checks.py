"""Checks a manager makes of what it saves, besides the save itself: values a restore could
unpickle only with ``allow_pickle=True`` (warned once per key), and declared-frozen tensors that
changed behind their version counters (checked once more at ``close()``)."""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set

from ..errors import FrozenTensorChangedError, InvalidArgumentError, UnsafeCheckpointError, warn_user
from ..format.unpickling import load_value, refused_global
from ..staging.frozen import FrozenTensors, changed_keys


class PickledValues:
    """Warns once per key about saved values that a restore can unpickle only with
    ``allow_pickle=True`` (classes outside torch's ``weights_only`` safe set and the RNG
    states restore builds). Each value is tried once with restore's restricted unpickler
    (:func:`~async_ckpt.format.unpickling.load_value`), which builds only those classes and
    runs no code of the value's classes."""

    def __init__(self) -> None:
        self._seen: Set[str] = set()  # keys of pickled values already checked

    def check(self, plan: Any) -> None:
        """Warn about the values of ``plan`` (a staging plan) not checked before.

        Args:
            plan: the staging plan of a save (its ``pickled`` values).
        """
        bad: List[str] = []
        for path, obj in plan.pickled:
            if path in self._seen:
                continue
            self._seen.add(path)
            try:
                load_value(obj.archive(), path)
            except Exception as exc:  # noqa: BLE001 - UnsafeCheckpointError, or what a class raises when built
                cause = exc.__cause__ if isinstance(exc, UnsafeCheckpointError) else exc
                name = refused_global(cause) if cause is not None else None
                bad.append(f"{path} ({name})" if name else path)
        if bad:
            shown = ", ".join(bad[:10]) + (f" (and {len(bad) - 10} more)" if len(bad) > 10 else "")
            warn_user(f"saved values that restore(..., allow_pickle=True) must unpickle (their classes are "
                      f"outside torch's weights_only safe set): {shown}; save them as plain types (dict, list, "
                      "str, int, float, tensors) or allowlist the classes with "
                      "torch.serialization.add_safe_globals before restoring")


def frozen_changed_at_close(frozen: Optional[FrozenTensors], same_bytes: Sequence[Callable[..., Any]]
                            ) -> Optional[FrozenTensorChangedError]:
    """The declared-frozen tensors, checked once more at ``close()``: the error naming those
    whose bytes are not the last step's (their version counters did not move), or None.

    Args:
        frozen: the manager's declared-frozen tensors, or None.
        same_bytes: each root's check of a key's bytes against its last commit
            (:meth:`~async_ckpt.io.reuse.Reuse.same_bytes`).

    Returns:
        The error to raise, or None.
    """
    if frozen is None or not frozen.last:
        return None
    try:
        changed = changed_keys(frozen.last, list(same_bytes))
    finally:
        frozen.last = {}
    if not changed:
        return None
    return FrozenTensorChangedError(
        f"tensors declared frozen changed after the last save: {', '.join(changed[:5])}"
        f"{f' and {len(changed) - 5} more' if len(changed) > 5 else ''}; the last step holds "
        "their bytes as they were when it was saved", keys=changed)


def check_user_metadata(metadata: Any) -> Optional[Dict[str, Any]]:
    """Validate ``save(..., metadata=)``: a mapping with str keys that JSON holds as it is (no
    pickle: numbers, strings, bools, None, lists and dicts of them; no NaN).

    Args:
        metadata: the mapping, or None.

    Returns:
        A copy as read back from its JSON (None for None).

    Raises:
        InvalidArgumentError: not a mapping with str keys, or not JSON.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise InvalidArgumentError(f"metadata must be a dict with str keys (stored as JSON), got {type(metadata).__name__}")
    try:
        return dict(json.loads(json.dumps(dict(metadata), allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"metadata must hold only JSON values (numbers, strings, bools, None, lists, "
                                   f"dicts with str keys; no NaN): {exc}") from None
