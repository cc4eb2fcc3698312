"""XLA SPMD pieces of multi-process checkpoints: which tensors are sharded, their host shards,
and torch_xla's DCP planners for them.

The multi-process save and restore themselves are the single-process ones with a
``GroupCoordinator`` (see ``async_ckpt/lifecycle``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch


# ---- XLA SPMD ------------------------------------------------------------------------------

def _cpu_shards_type() -> Optional[type]:
    import sys

    if "torch_xla" not in sys.modules:  # no XLA tensors without torch_xla: do not import it
        return None
    try:
        from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards
    except Exception:
        return None
    return _CpuShards


def _leaves(tree: Any):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def has_xla_shards(state_dict: Any) -> bool:
    """Whether a host snapshot holds staged XLA SPMD shards (torch_xla's ``_CpuShards``)."""
    cls = _cpu_shards_type()
    return cls is not None and any(isinstance(v, cls) for v in _leaves(state_dict))


def xla_sharded(items: List[Tuple[int, torch.Tensor]]) -> List[Tuple[int, torch.Tensor]]:
    """The ``(index, tensor)`` pairs whose tensor is SPMD-sharded (see :func:`is_xla_sharded`).

    Only SPMD mode (``xr.use_spmd()``) can shard a tensor: outside it, a state dict of many
    tensors skips the per-tensor query altogether.
    """
    try:
        import torch_xla.runtime as xr

        spmd = bool(xr.is_spmd())
    except Exception:
        spmd = False
    return [(i, t) for i, t in items if is_xla_sharded(t)] if spmd else []


def is_xla_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is an XLA tensor split over several devices by ``mark_sharding``."""
    if t.device.type != "xla":
        return False
    try:
        import torch_xla
        import torch_xla.distributed.spmd as xs

        kind = torch_xla._XLAC._get_xla_sharding_type(t)
    except Exception:
        return False
    return kind is not None and kind != xs.ShardingType.REPLICATED


def stage_xla_shards(tensors: List[torch.Tensor]) -> List[Any]:
    """Host copies of the local shards of SPMD-sharded XLA tensors, one replica of each shard.

    Returns torch_xla's ``_CpuShards`` (shards with their global indices), which torch_xla's
    ``SPMDSavePlanner`` writes as DCP chunks.
    """
    from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards, _cpu_shards_from_tensors

    out = []
    for cs in _cpu_shards_from_tensors(list(tensors)):
        # Keep one copy of each distinct shard: the replica 0 of a shard lives on exactly one
        # device in the whole job, so every shard is written once, by the host that holds it.
        uniq = [s for s in cs.shards if s.replica_id == 0]
        out.append(_CpuShards(shards=uniq, global_shape=cs.global_shape))
    return out


def save_planner_for(state_dict: Any) -> Any:
    """The DCP save planner for a host snapshot: torch_xla's for staged SPMD shards, else ``None``."""
    if not has_xla_shards(state_dict):
        return None
    import warnings

    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class _Planner(SPMDSavePlanner):
        def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                super().set_up_planner(state_dict, is_coordinator)

    return _Planner()


def load_planner_for(state_dict: Any, allow_pickle: bool) -> Any:
    """The DCP load planner for a restore target: torch_xla's for SPMD-sharded XLA tensors, else ``None``."""
    if not any(isinstance(v, torch.Tensor) and is_xla_sharded(v) for v in _leaves(state_dict)):
        return None
    import io
    import pickle

    from torch.distributed.checkpoint._traverse import set_element
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    from .errors import UnsafeCheckpointError

    class _Planner(SPMDLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=not allow_pickle)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointError(
                    f"{read_item.dest_index.fqn}: refusing to unpickle an object outside torch's safe set "
                    f"({exc}); pass allow_pickle=True to restore if you trust this checkpoint") from exc
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    return _Planner()
