"""Restricted unpicklers: what a checkpoint's pickles may build when async_ckpt reads them.

* ``.metadata`` (DCP's format, a pickle) is read by :func:`load_metadata`, which allows only
  DCP's metadata record classes, torch's dtypes/sizes/layouts and plain containers;
* non-tensor items are loaded by :class:`SafeLoadPlanner` with ``weights_only=True`` unless
  ``allow_pickle`` is set;
* a tensor item's ``data.pkl`` is read as a description only
  (:class:`~async_ckpt.storage.torch_record.TensorDescUnpickler`, with the record format).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import re
from typing import AbstractSet, Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from ...errors import CorruptCheckpointError, UnsafeCheckpointError
from ...gc_pause import gc_paused
from ..manifest import shown
from .dcp_call import METADATA_NAME
from .file_assignment import flatten_target, set_element

_SAFE_BUILTINS = {"set", "frozenset", "dict", "list", "tuple", "slice", "bytearray", "complex", "int", "float"}


def _plain_data_class(obj: Any) -> bool:
    """A dataclass, enum or named tuple: calling it only builds a record (DCP's metadata types),
    unlike the other classes of those modules (writers, readers, executors)."""
    return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
                                      or (issubclass(obj, tuple) and hasattr(obj, "_fields")))


class _MetadataUnpickler(pickle.Unpickler):
    """Allows only DCP's metadata classes, torch's dtypes/sizes and plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or module == "torch.distributed.checkpoint":
            obj = pickle.Unpickler.find_class(self, module, name)
            if _plain_data_class(obj):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.memory_format, torch.layout)) or obj is torch.Size:
                return obj
        elif module == "torch.serialization" and name == "_get_layout":  # maps "torch.strided" -> layout
            return pickle.Unpickler.find_class(self, module, name)
        elif module == "builtins" and name in _SAFE_BUILTINS:
            return pickle.Unpickler.find_class(self, module, name)
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return pickle.Unpickler.find_class(self, module, name)  # DCP's own writer stores the checkpoint_id path
        elif module == "collections" and name == "OrderedDict":
            return pickle.Unpickler.find_class(self, module, name)
        elif module == "torch.distributed._shard.sharded_tensor.metadata" or module == "torch.distributed.tensor._dtensor_spec":
            obj = pickle.Unpickler.find_class(self, module, name)
            if _plain_data_class(obj):
                return obj
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {shown(f'{module}.{name}')}, which is not an allowed DCP metadata "
            "class; refusing to load it (it could run code)"
        )


def load_metadata(data: bytes, *, where: str = METADATA_NAME) -> Metadata:
    """Unpickle DCP ``.metadata`` bytes safely. The cyclic garbage collector is paused while
    the records are built (tens of thousands of objects for a large state dict, each allocation
    otherwise counting towards a collection that walks all of them)."""
    try:
        with gc_paused():
            md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: DCP metadata is unreadable ({type(exc).__name__}: {shown(exc)})",
                                     path=where) from exc
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{where}: not DCP metadata (got {type(md).__name__})", path=where)
    return md


def refused_global(exc: BaseException) -> Optional[str]:
    """The class or function that ``torch.load(weights_only=True)`` refused, named in its
    (long, ANSI-coloured) error text; None if it names none."""
    m = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return m.group(1) if m else None


def unsafe_value_error(fqn: str, exc: BaseException) -> UnsafeCheckpointError:
    """A short, plain error for a non-tensor value at ``fqn`` that ``weights_only`` refused.

    Args:
        fqn: the value's dotted key.
        exc: torch's ``UnpicklingError``.

    Returns:
        The error to raise (``exc`` is to be chained as its cause).
    """
    name = refused_global(exc)
    what = f"a {shown(name)} object" if name else "an object outside torch's safe set"
    fix = f" or allowlist it with torch.serialization.add_safe_globals([{name}])" if name else ""
    return UnsafeCheckpointError(
        f"{shown(fqn)}: the checkpoint holds {what}, which restoring would have to unpickle (that could run "
        f"code); pass restore(..., allow_pickle=True) if you trust this checkpoint{fix}")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor items with ``weights_only`` unless allowed."""

    def __init__(self, allow_pickle: bool = False, skip: Optional[AbstractSet[str]] = None) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        #: flattened keys this rank does not read (another rank reads them and sends them)
        self.skip = frozenset(skip or ())

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        """DCP's, with the target flattened in the checkpoint's key layout
        (:func:`~.file_assignment.flatten_target`)."""
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if self.flatten_state_dict and metadata is not None:
            self.state_dict, self.mappings = flatten_target(self.original_state_dict, metadata,
                                                            (self.state_dict, self.mappings))

    def create_local_plan(self) -> Any:
        """DCP's plan, less the items of :attr:`skip`."""
        plan = super().create_local_plan()
        if self.skip:
            plan = dataclasses.replace(plan, items=[it for it in plan.items if it.dest_index.fqn not in self.skip])
        return plan

    def decode_bytes(self, read_item: Any, value: io.BytesIO) -> Any:
        """Deserialise one non-tensor item without touching the state dict."""
        try:
            return torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as exc:
            raise unsafe_value_error(read_item.dest_index.fqn, exc) from exc

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.set_bytes(read_item, self.decode_bytes(read_item, value))

    def set_bytes(self, read_item: Any, obj: Any) -> None:
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
