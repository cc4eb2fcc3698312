"""Restricted unpicklers: what a checkpoint's pickles may build when async_ckpt reads them.

* ``.metadata`` (DCP's format, a pickle) is read by :func:`load_metadata`, which allows only
  DCP's metadata record classes, torch's dtypes/sizes/layouts and plain containers;
* non-tensor items are loaded by :func:`load_value` (through :class:`SafeLoadPlanner` and
  every other reader) with ``weights_only=True`` unless ``allow_pickle`` is set; random number
  generator states (NumPy arrays and scalars, NumPy's ``Generator``/``RandomState`` and their
  bit generators, Python's ``random.Random``), outside torch's safe set, are built by a second
  restricted unpickler that allows exactly those classes (:data:`RNG_GLOBALS`) besides it;
* a tensor item's ``data.pkl`` is read as a description only
  (:class:`~async_ckpt.format.torch_record.TensorDescUnpickler`, with the record format).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pickle
import re
import types
from typing import IO, AbstractSet, Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from ..compat import weights_only_globals
from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..gc_pause import gc_paused
from .dcp_layout import METADATA_NAME, flatten_target, set_element
from .manifest import shown

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


#: Callables that unpickle or load what they are given: what async_ckpt names for a value nested
#: in a list or tuple whose class is outside the safe set (see ``PickledObject.__reduce__``).
#: Allowlisting one of them would let any pickle run, so the error never suggests it.
_LOADERS = frozenset({"pickle.loads", "_pickle.loads", "functools.partial", "torch.load",
                      "torch.serialization.load"})


def unsafe_value_error(fqn: str, exc: BaseException, name: Optional[str] = None) -> UnsafeCheckpointError:
    """A short, plain error for a non-tensor value at ``fqn`` that ``weights_only`` refused.

    Args:
        fqn: the value's dotted key.
        exc: torch's ``UnpicklingError``.
        name: the refused class or function (default: the one ``exc`` names).

    Returns:
        The error to raise (``exc`` is to be chained as its cause).
    """
    name = name or refused_global(exc)
    trust = "pass restore(..., allow_pickle=True) if you trust this checkpoint"
    if name in _LOADERS:
        return UnsafeCheckpointError(
            f"{shown(fqn)}: the checkpoint holds, inside a list or tuple, a value of a class outside torch's "
            f"weights_only safe set, saved as a pickle that restoring would have to load (that could run code); "
            f"{trust}")
    what = f"a {shown(name)} object" if name else "an object outside torch's safe set"
    fix = f" or allowlist it with torch.serialization.add_safe_globals([{name}])" if name else ""
    return UnsafeCheckpointError(
        f"{shown(fqn)}: the checkpoint holds {what}, which restoring would have to unpickle (that could run "
        f"code); {trust}{fix}")


#: What a checkpoint's random number generator states are built from, besides torch's safe set:
#: NumPy arrays, scalars and dtypes (NumPy 1 and 2 module names), NumPy's generators, their bit
#: generators and seed sequences (through numpy's own pickling helpers, which only construct
#: these classes), and Python's ``random.Random``. Each only builds a value from plain data.
RNG_GLOBALS = frozenset({
    "random.Random",
    "numpy.ndarray", "numpy.dtype",
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
    "numpy.random._pickle.__generator_ctor", "numpy.random._pickle.__bit_generator_ctor",
    "numpy.random._pickle.__randomstate_ctor",
    "numpy.random._generator.Generator", "numpy.random.mtrand.RandomState",
    "numpy.random._mt19937.MT19937", "numpy.random._pcg64.PCG64", "numpy.random._pcg64.PCG64DXSM",
    "numpy.random._philox.Philox", "numpy.random._sfc64.SFC64",
    "numpy.random.bit_generator.SeedSequence", "numpy.random.bit_generator.__pyx_unpickle_SeedSequence",
})


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(f"GLOBAL {name} is not allowed")
        self.name = name


def _rng_global(module: str, name: str) -> Any:
    if module.startswith("numpy.core"):  # NumPy 1's name of numpy._core (NumPy 2 warns on it)
        try:
            return getattr(importlib.import_module("numpy._core" + module[len("numpy.core"):]), name)
        except ImportError:
            pass
    return getattr(importlib.import_module(module), name)


class _RngUnpickler(pickle.Unpickler):
    """Builds torch's ``weights_only`` safe set and :data:`RNG_GLOBALS`, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in RNG_GLOBALS:
            return _rng_global(module, name)
        obj = weights_only_globals().get(full)
        if obj is None:
            raise _Refused(full)
        return obj


_RNG_PICKLE = types.SimpleNamespace(__name__="async_ckpt_rng_pickle", Unpickler=_RngUnpickler,
                                    load=lambda f, **kw: _RngUnpickler(f, **kw).load())


def load_value(f: IO[bytes], fqn: str, allow_pickle: bool = False, **kwargs: Any) -> Any:
    """Load a non-tensor item (a ``torch.save`` archive), building only safe classes.

    ``torch.load(weights_only=True)`` first; a value it refuses for a class of
    :data:`RNG_GLOBALS` (an RNG state) is built again by a restricted unpickler that allows
    those classes and torch's safe set, and nothing else.

    Args:
        f: the archive, a seekable binary file at its start.
        fqn: the value's dotted key (for the error).
        allow_pickle: unpickle any class (only for a trusted checkpoint).
        **kwargs: passed to ``torch.load`` (``map_location``).

    Returns:
        The value.

    Raises:
        UnsafeCheckpointError: the value holds a class outside both sets (and not
            ``allow_pickle``).
    """
    if allow_pickle:
        return torch.load(f, weights_only=False, **kwargs)
    start = f.tell()
    try:
        return torch.load(f, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        if refused_global(exc) not in RNG_GLOBALS:
            raise unsafe_value_error(fqn, exc) from exc
        first = exc
    f.seek(start)
    try:
        return torch.load(f, weights_only=False, pickle_module=_RNG_PICKLE, **kwargs)
    except _Refused as exc:
        raise unsafe_value_error(fqn, first, exc.name) from exc


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor items with ``weights_only`` unless allowed."""

    def __init__(self, allow_pickle: bool = False, skip: Optional[AbstractSet[str]] = None) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        #: flattened keys this rank does not read (another rank reads them and sends them)
        self.skip = frozenset(skip or ())

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        """DCP's, with the target flattened in the checkpoint's key layout
        (:func:`~.dcp_layout.flatten_target`)."""
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
        return load_value(value, read_item.dest_index.fqn, self.allow_pickle)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.set_bytes(read_item, self.decode_bytes(read_item, value))

    def set_bytes(self, read_item: Any, obj: Any) -> None:
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
