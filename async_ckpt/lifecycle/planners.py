"""DCP planners for XLA SPMD: torch_xla's, for snapshots holding staged shards and for restore
targets holding sharded XLA tensors. Everything else uses async_ckpt's planner-free paths (one
process) or DCP's default planners (several)."""

from __future__ import annotations

import io
import warnings
from typing import Any, Iterator

import torch

from ..compat import xla_loaded
from ..staging import HostSnapshot
from ..staging.xla import is_xla_sharded
from ..storage.dcp.file_assignment import set_element
from ..storage.dcp.unpickling import load_value


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def save_planner_for(snap: HostSnapshot) -> Any:
    """torch_xla's ``SPMDSavePlanner`` when staging produced SPMD shards, else ``None``."""
    if not snap.xla_shards:
        return None
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class _Planner(SPMDSavePlanner):
        # DCP calls set_up_planner(state_dict, storage_meta, is_coordinator) (torch's SavePlanner);
        # torch_xla's SPMDSavePlanner still declares the older (state_dict, is_coordinator).
        def set_up_planner(self, state_dict: Any, storage_meta: Any = None,  # type: ignore[override]
                           is_coordinator: bool = False) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                super().set_up_planner(state_dict, is_coordinator)

    return _Planner()


def load_planner_for(state_dict: Any, allow_pickle: bool) -> Any:
    """torch_xla's ``SPMDLoadPlanner`` (with async_ckpt's safe unpickling of non-tensor values)
    for a target holding SPMD-sharded XLA tensors, else ``None``."""
    if not xla_loaded() or not any(isinstance(v, torch.Tensor) and is_xla_sharded(v) for v in _leaves(state_dict)):
        return None
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    class _Planner(SPMDLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = load_value(value, read_item.dest_index.fqn, allow_pickle)
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    return _Planner()
