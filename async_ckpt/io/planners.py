"""DCP planners for XLA SPMD: torch_xla's, for snapshots staged in SPMD mode and for restore
targets holding sharded XLA tensors. Everything else uses async_ckpt's planner-free paths (one
process) or DCP's default planners (several)."""

from __future__ import annotations

import io
import warnings
from typing import Any, Iterator

import torch

from ..compat import xla_loaded
from ..format.dcp_layout import flatten_target, set_element
from ..format.unpickling import load_value
from ..staging import HostSnapshot
from ..staging.xla import is_xla_sharded


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
    """torch_xla's ``SPMDSavePlanner`` for a snapshot staged in SPMD mode, else ``None``.

    Such a step is written as torch_xla's manager writes it: its planner, and its key layout
    (a dict or list that holds no tensor, e.g. an optimizer's ``param_groups``, is one item),
    which torch_xla's ``SPMDLoadPlanner`` reads (it reads no other); DCP's default planner and
    async_ckpt's restore read it too (see :func:`~async_ckpt.format.dcp_layout.flatten_target`).
    """
    if not snap.xla_spmd:
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
    """torch_xla's ``SPMDLoadPlanner`` (with async_ckpt's safe unpickling of non-tensor values,
    reading the checkpoint's key layout) for a target holding SPMD-sharded XLA tensors, else
    ``None``."""
    if not xla_loaded() or not any(isinstance(v, torch.Tensor) and is_xla_sharded(v) for v in _leaves(state_dict)):
        return None
    from torch_xla.distributed.spmd import wrap_if_sharded
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    class _Planner(SPMDLoadPlanner):
        def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
            # torch_xla flattens the target in its own key layout only (a dict or list without
            # tensors is one item); the target is read in the checkpoint's, whichever it is.
            super().set_up_planner(state_dict, metadata, is_coordinator)
            flat, self.mappings = flatten_target(state_dict, metadata)
            self.sharded_state_dict = {k: wrap_if_sharded(v) for k, v in flat.items()
                                       if isinstance(v, torch.Tensor) and is_xla_sharded(v)}
            self.unsharded_state_dict = {k: v for k, v in flat.items() if k not in self.sharded_state_dict}

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = load_value(value, read_item.dest_index.fqn, allow_pickle)
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    return _Planner()
