"""Restore: choose the step (commit order) -> check -> read into the targets -> fall back.

The same phases for one process and N: each attempt checks the manifest, the DCP metadata and
the target, then loads; after each phase the ranks exchange outcomes through the coordinator,
so a failure on one rank is seen by all and they all skip a damaged step or all raise. With
``step=None`` a damaged step falls back to the next older commit, with a warning naming it.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Set

import torch

from ..compat import dcp_flatten_state_dict
from ..errors import CorruptCheckpointError, StateDictMismatchError, StepNotFoundError
from ..storage.dcp import METADATA_NAME, FsspecStorageReader
from .coordinator import describe, raise_gathered
from .steps import StepStore


def restore(store: StepStore, step: Optional[int], state_dict: Dict[str, Any], *, verify: bool,
            allow_pickle: bool, threads: int, planner: Any) -> int:
    """Every rank: load ``step`` (None: the most recent commit that verifies) into ``state_dict``
    in place and return the step. Rank 0's listing decides which steps exist."""
    coord = store.coordinator
    steps: List[int] = coord.broadcast(store.catalog.steps_newest_first() if coord.is_primary else None)
    if step is not None:
        if step not in steps:
            listed = sorted(steps)
            raise StepNotFoundError(
                f"no committed checkpoint for step {step} under {store.storage.url} "
                f"(committed: {listed if len(listed) <= 20 else listed[-20:]})", step=step)
        _restore_one(store, step, state_dict, verify, allow_pickle, threads, planner)
        return step
    if not steps:
        raise StepNotFoundError(f"no committed checkpoint under {store.storage.url}")
    errors: List[CorruptCheckpointError] = []
    for s in steps:
        try:
            _restore_one(store, s, state_dict, verify, allow_pickle, threads, planner)
        except CorruptCheckpointError as exc:
            warnings.warn(f"async_ckpt: skipping damaged step {s}: {exc}", RuntimeWarning, stacklevel=3)
            errors.append(exc)
            continue
        return s
    raise CorruptCheckpointError(
        f"no committed step under {store.storage.url} passed verification; newest error: {errors[0]}",
        step=steps[0]) from errors[0]


def _restore_one(store: StepStore, step: int, state_dict: Dict[str, Any], verify: bool, allow_pickle: bool,
                 threads: int, planner: Any) -> None:
    coord = store.coordinator
    added: List[tuple] = []
    local: Optional[BaseException] = None
    manifest = metadata = None
    path = store.layout.step_dir(step)
    try:
        path, manifest = store.layout.open_step(step)
        if METADATA_NAME not in manifest.files:
            raise CorruptCheckpointError(f"step {step}: manifest lists no {METADATA_NAME}", step=step, path=path)
        reader = FsspecStorageReader(store.storage, path, files=manifest.files, verify=verify, threads=threads)
        metadata = reader.read_metadata()
        added = prepare_target(state_dict, metadata, step, set(manifest.extra.get("int_keys", ())))
    except BaseException as exc:  # noqa: BLE001 - exchanged below
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        local = exc
    _agree_or_undo(store, step, "restore checks", local, state_dict, added)
    assert manifest is not None
    try:
        coord.load(store.storage, path, state_dict, files=manifest.files, verify=verify, threads=threads,
                   allow_pickle=allow_pickle, metadata=metadata, planner=planner)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        local = exc
    _agree_or_undo(store, step, "restore", local, state_dict, added)


def _agree_or_undo(store: StepStore, step: int, what: str, local: Optional[BaseException],
                   state_dict: Dict[str, Any], added: List[tuple]) -> None:
    """Every rank learns every rank's outcome of ``what``; on any failure, all raise and take
    out the entries this restore added to ``state_dict``."""
    if isinstance(local, CorruptCheckpointError):
        local.step = step
    outcomes = store.coordinator.all_gather(None if local is None else describe(store.coordinator.rank, local))
    try:
        raise_gathered(outcomes, step, what, local)
    except BaseException:
        remove_added(state_dict, added)
        raise


def prepare_target(state_dict: Dict[str, Any], metadata: Any, step: int, int_keys: Set[str]) -> List[tuple]:
    """Check ``state_dict`` against a checkpoint's DCP metadata; add entries it lacks.

    Returns the paths added, so that a failed restore can take them out again.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = dcp_flatten_state_dict()(state_dict)
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


def remove_added(state_dict: Dict[str, Any], added: List[tuple]) -> None:
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
