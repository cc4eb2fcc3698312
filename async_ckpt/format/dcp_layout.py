"""DCP's layout of a state dict, as a step stores it: keys, paths, values, the write memo.

:data:`METADATA_NAME` is the name of a step's DCP metadata file. :func:`flatten` is DCP's
``flatten_state_dict`` with less work per entry (and :func:`flatten_target` the flattening of a
restore target in a checkpoint's key layout); :func:`set_element` sets a value at one of its
paths (the one place that turns a path's string back into the dict key it names);
:func:`is_stateful` is DCP's ``Stateful`` test. A layout's signature (:func:`signature`) says
whether the next state dict has the same keys, dtypes and shapes; a :class:`WriteMemo` holds the
last :class:`FileLayout` (file assignment and pickled ``.metadata``) for the planner-free save to
reuse.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import operator
import threading
from collections.abc import Mapping, MutableMapping
from typing import AbstractSet, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from .. import compat
from .manifest import FileRecord
from .torch_record import PickledObject

flatten_state_dict = compat.dcp_flatten_state_dict()
traverse_state_dict = compat.dcp_traverse().traverse_state_dict
_dcp_version = compat.dcp_version()

#: the name of a step's DCP metadata file (DCP's own, ``FileSystemWriter``'s too)
METADATA_NAME = ".metadata"


def is_stateful(value: Any) -> bool:
    """DCP's ``Stateful`` (``isinstance(value, Stateful)``): a value with ``state_dict()`` and
    ``load_state_dict()``, a mapping too. ``dcp.save`` saves a top-level one through its
    ``state_dict()``, ``dcp.load`` restores it through its ``load_state_dict()``.

    Args:
        value: a top-level value of a state dict.

    Returns:
        Whether it is saved and restored through those methods.
    """
    return not isinstance(value, torch.Tensor) and callable(getattr(value, "state_dict", None)) \
        and callable(getattr(value, "load_state_dict", None))


def metadata_index(fqn: str, offset: torch.Size, index: int) -> MetadataIndex:
    """``MetadataIndex(fqn, offset, index)`` without its ``__init__``, which rebuilds ``offset``
    as a new ``torch.Size`` per item. Same fields, so equal, hashed and pickled alike; ``offset``
    is shared, so pickled once."""
    idx = object.__new__(MetadataIndex)
    object.__setattr__(idx, "fqn", fqn)
    object.__setattr__(idx, "offset", offset)
    object.__setattr__(idx, "index", index)
    return idx


def _real_key(mapping: Any, key: Any) -> Any:
    """``key`` as ``mapping`` holds it: a path's string for an int key (``"0"`` for ``0``)
    where only the int is there; else ``key`` itself."""
    if type(key) is str and key not in mapping:
        try:
            k = int(key)
        except ValueError:
            return key
        if str(k) == key and k in mapping:
            return k
    return key


class Appended(tuple):
    """A path :func:`set_element` created at the end of a list (the list was shorter): undone by
    :func:`remove_created` cutting the list back there."""


def set_element(root: Any, path: Sequence[Any], value: Any, *, int_keys: AbstractSet[str] = frozenset(),
                created: Optional[List[tuple]] = None) -> None:
    """DCP's ``set_element``: ``value`` put at ``path`` (one of :func:`flatten`'s mappings)
    in ``root``, creating the dicts (a string next) and lists (an int next) that are missing.

    The one place that turns a path's string back into the dict key it names. DCP's paths
    hold every dict key as ``str(key)``, so a string names the int key it spells exactly
    (``"7"`` names ``7``, ``"-1"`` names ``-1``; ``"007"`` is only ever the string ``"007"``):
    where a dict has that int key but not the string (an optimizer's ``state``, keyed by
    parameter index), the value goes under the int key, not under a new string key beside it.
    A dotted prefix of the path listed in ``int_keys`` (the manifest's ``int_keys``: keys that
    were ints when saved) is an int key even where the dict does not hold it yet.

    Args:
        root: the (nested) state dict.
        path: the path of the value (dict keys as strings, list indices as ints).
        value: the value.
        int_keys: dotted paths whose last key was an int when saved.
        created: where to record the paths this call created, outermost first (a list slot it
            filled that held None, or :class:`Appended` where it lengthened a list), for
            :func:`remove_created`.
    """
    cur = root
    prefix = ""
    typed: List[Any] = []
    last = len(path) - 1
    for i, key in enumerate(path):
        if int_keys:
            prefix = f"{prefix}.{key}" if i else str(key)
        if isinstance(cur, MutableMapping):
            key = int(key) if int_keys and prefix in int_keys and type(key) is str else _real_key(cur, key)
            missing = key not in cur
            if i == last:
                cur[key] = value
            elif missing:
                cur[key] = {} if type(path[i + 1]) is str else []
            if missing and created is not None:
                created.append((*typed, key))
        else:  # a list: an int index
            if len(cur) <= key:
                if created is not None:
                    created.append(Appended((*typed, len(cur))))
                cur.extend([None] * (key + 1 - len(cur)))
            if cur[key] is None:
                if created is not None:
                    created.append((*typed, key))
                if i != last:
                    cur[key] = {} if type(path[i + 1]) is str else []
            if i == last:
                cur[key] = value
        if i != last:
            typed.append(key)
            cur = cur[key]


def remove_created(root: Any, created: List[tuple]) -> None:
    """Undo the paths :func:`set_element` recorded in ``created``: innermost first, so the
    containers it created go too; a list it lengthened is cut back to its old length, a slot
    of it that held None holds None again.

    Args:
        root: the state dict they were created in.
        created: the recorded paths.
    """
    appended = [p for p in created if isinstance(p, Appended)]
    for path in sorted(set(created) - set(appended), key=len, reverse=True) + sorted(appended, key=len, reverse=True):
        cur: Any = root
        try:
            for p in path[:-1]:
                cur = cur[p]
            if isinstance(cur, dict):
                cur.pop(path[-1], None)
            elif isinstance(cur, list) and isinstance(path, Appended):
                del cur[path[-1]:]
            elif isinstance(cur, list) and path[-1] < len(cur):
                cur[path[-1]] = None
        except (KeyError, IndexError, TypeError):
            pass  # already gone with an outer container, or the caller replaced it meanwhile


def flatten(state_dict: Dict[str, Any], reuse: Optional[Dict[str, Tuple[Any, ...]]] = None
             ) -> Tuple[Dict[str, Any], Dict[str, Tuple[Any, ...]]]:
    """``flatten_state_dict(state_dict)``: the same keys in the same order, values, mappings and
    errors, with less work per entry: nested mappings and their leaves are walked here; lists
    (whose flattening depends on what they hold) are handed to DCP's own traversal.

    ``reuse``: an earlier result's mappings; a path equal to the one there is taken from it, so
    the new tuples die at once instead of living as long as the result."""
    if _dcp_version._derived_version == "2_3":  # DCP's pre-2.4 layout: its own code only
        return flatten_state_dict(state_dict)
    flat: Dict[str, Any] = {}
    mappings: Dict[str, Tuple[Any, ...]] = {}
    tensor = torch.Tensor

    def put(fqn: str, path: Tuple[Any, ...], value: Any) -> None:
        if fqn in flat:
            raise ValueError(f"duplicated flatten key {fqn}")
        flat[fqn] = value
        mappings[fqn] = path

    def walk(path: Tuple[Any, ...], prefix: str, mapping: Any) -> None:
        for k, v in mapping.items():
            ks = str(k)
            if type(v) is tensor:  # the common case first: a terminal leaf
                fqn = prefix + ks
                if fqn in flat:
                    raise ValueError(f"duplicated flatten key {fqn}")
                flat[fqn] = v
                full = path + (ks,)
                if reuse is not None:
                    old = reuse.get(fqn)
                    if old == full:
                        full = old
                mappings[fqn] = full
            elif isinstance(v, Mapping):
                walk(path + (ks,), prefix + ks + ".", v)
            elif isinstance(v, list):
                base = path + (ks,)

                def visit(sub: Tuple[Any, ...], value: Any, base: Tuple[Any, ...] = base) -> None:
                    full = base + sub[1:]
                    put(".".join(map(str, full)), full, value)

                traverse_state_dict({"": v}, visit)
            else:  # anything else is a leaf, a tuple included
                put(prefix + ks, path + (ks,), v)

    walk((), "", state_dict)
    return flat, mappings


def _container_at(root: Any, path: Tuple[Any, ...]) -> Any:
    """The dict or list at ``path`` (a flattened key's path) in ``root``, or None."""
    cur = root
    for key in path:
        if isinstance(cur, Mapping):
            key = _real_key(cur, key)
            if key not in cur:
                return None
            cur = cur[key]
        elif isinstance(cur, list) and type(key) is int and key < len(cur):
            cur = cur[key]
        else:
            return None
    return cur if isinstance(cur, (Mapping, list)) else None


def flatten_target(state_dict: Dict[str, Any], metadata: Any,
                   flat: Optional[Tuple[Dict[str, Any], Dict[str, Tuple[Any, ...]]]] = None
                   ) -> Tuple[Dict[str, Any], Dict[str, Tuple[Any, ...]]]:
    """:func:`flatten` of a restore target, in the key layout of the checkpoint ``metadata``
    describes: the one flattening of every restore path (the checks, the direct reads, DCP's
    planners), on CPU, plain XLA and SPMD alike.

    DCP's layout (torch >= 2.4, what a save without torch_xla's planner writes) makes every
    value inside a dict its own item. torch_xla's ``SPMDSavePlanner`` (its manager, and
    async_ckpt under SPMD) and DCP before 2.4 make a dict or list holding no tensor one item:
    an optimizer's ``param_groups``, or a whole SGD state dict without momentum buffers. A key
    of the checkpoint that names such a container of the target, holding no tensor there
    either, is therefore taken as one value in place of the entries below it; everything
    else is as :func:`flatten` gives it. (DCP's own loader tells the two layouts apart by the
    same evidence, the checkpoint's keys, but switches the whole target at once and only
    when every key fits.)

    Args:
        state_dict: the restore target.
        metadata: the checkpoint's DCP ``Metadata``.
        flat: ``state_dict`` flattened already (``(flat, mappings)``, as DCP's planner did).

    Returns:
        ``(flat, mappings)`` as :func:`flatten` returns them.
    """
    items, mappings = flat if flat is not None else flatten(state_dict)
    md = metadata.state_dict_metadata
    paths = metadata.planner_data or {}
    whole: Dict[str, Tuple[Any, ...]] = {}
    for key in md:
        if key not in items and paths.get(key):
            path = tuple(paths[key])
            if _container_at(state_dict, path) is not None:
                whole[key] = path
    if not whole:
        return items, mappings

    def owner(fqn: str) -> Optional[str]:
        i = fqn.find(".")
        while i > 0:
            if fqn[:i] in whole:
                return fqn[:i]
            i = fqn.find(".", i + 1)
        return None

    for fqn, value in items.items():
        if isinstance(value, torch.Tensor):
            w = owner(fqn)
            if w is not None:
                whole.pop(w, None)  # the target holds tensors there: not one item (a mismatch)
    if not whole:
        return items, mappings
    out: Dict[str, Any] = {}
    out_mappings: Dict[str, Tuple[Any, ...]] = {}
    for fqn, value in items.items():
        w = owner(fqn)
        if w is None or w not in whole:
            out[fqn], out_mappings[fqn] = value, mappings[fqn]
        elif w not in out:
            out[w], out_mappings[w] = _container_at(state_dict, whole[w]), whole[w]
    for w, path in whole.items():  # an empty container: no entry of the target stood for it
        if w not in out:
            out[w], out_mappings[w] = _container_at(state_dict, path), path
    return out, out_mappings


@dataclasses.dataclass
class FileLayout:
    """What one state dict layout writes: reused while the next saves have the same layout."""

    key: Tuple[Any, ...]  # (threads, max_file_bytes): what else decides the bucketing
    fqns: List[str]
    sig: List[Any]  # per item: dtype, shape, requires_grad, pinned for tensors; None for objects
    mappings: Dict[str, Any]
    buckets: List[List[int]]  # item positions, per file
    hints: List[int]
    lengths: List[List[int]]  # per file, each item's length as written
    metadata: bytes  # the pickled .metadata for exactly these lengths
    files_meta: FileRecord


class WriteMemo:
    """The layout of the last single-process save made through it (the planner-free save).

    One per writer owner (a ``CheckpointManager`` keeps one): the next save of an equal
    layout through the same memo reuses its file assignment and pickled ``.metadata``. Saves
    through different memos share nothing, so two managers saving different state dicts
    each keep their own layout. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layout: Optional[FileLayout] = None

    @property
    def layout(self) -> Optional[FileLayout]:
        """The remembered layout, or ``None`` before the first planner-free save."""
        with self._lock:
            return self._layout

    def remember(self, layout: FileLayout) -> None:
        with self._lock:
            self._layout = layout


_NEEDS_PLANNER = object()  # a signature entry: DCP's planner must handle this object


def _signature_entries(objs: List[Any]) -> Iterator[Any]:
    """What decides a layout besides the keys: per tensor its dtype, shape, ``requires_grad``
    and pinning (four entries), ``None`` per other object; :data:`_NEEDS_PLANNER` (and the end)
    at the first DTensor, ShardedTensor or tensor subclass."""
    tensor_type = torch.Tensor
    for obj in objs:
        if type(obj) is tensor_type:
            yield obj.dtype
            yield obj.shape
            yield obj.requires_grad
            yield obj.is_cpu and obj.is_pinned()
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            yield _NEEDS_PLANNER
            return
        else:
            yield None


def signature(objs: List[Any]) -> Optional[List[Any]]:
    """The signature of ``objs`` (see :func:`_signature_entries`); ``None`` if DCP's planner must run."""
    sig = list(_signature_entries(objs))
    return None if sig and sig[-1] is _NEEDS_PLANNER else sig


def has_signature(objs: List[Any], sig: List[Any]) -> bool:
    """``signature(objs) == sig``, entry by entry, without keeping a new ``torch.Size`` per
    tensor alive."""
    pairs = itertools.zip_longest(_signature_entries(objs), sig, fillvalue=object())  # unequal to all
    return all(itertools.starmap(operator.eq, pairs))


def local_data(obj: Any) -> Any:
    """An item's data as ``DefaultSavePlanner.resolve_data`` gives it: tensors as they are,
    anything else ``torch.save``-d into a ``BytesIO`` (a :class:`PickledObject`: the archive of
    the bytes it holds)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if type(obj) is PickledObject:
        return obj.archive()
    return saved_bytes(obj)


def saved_bytes(obj: Any) -> io.BytesIO:
    """``obj`` ``torch.save``-d into a ``BytesIO``, as DCP saves a non-tensor item, but each
    tensor in it with a storage of its own (:func:`own_storages`)."""
    buf = io.BytesIO()
    torch.save(own_storages(obj), buf)
    return buf


def own_storages(obj: Any, seen: Optional[Dict[int, torch.Tensor]] = None) -> Any:
    """``obj`` (a tuple or list that DCP stores as one item, ``torch.save``-d whole) with each
    tensor that is a view into a larger storage (a staged tensor in a shared host buffer)
    replaced by a copy of its own. ``torch.save`` writes a tensor's whole storage: the item
    would hold its neighbours' bytes too, and the restored tensor would be a view at an offset
    into that storage (which ``Generator.set_state`` of a restored RNG state crashes on). The
    same tensor twice stays one tensor; ``obj`` itself when nothing is copied."""
    if type(obj) is torch.Tensor:
        if obj.device.type == "meta" or obj.untyped_storage().nbytes() == obj.numel() * obj.element_size():
            return obj
        seen = {} if seen is None else seen
        own = seen.get(id(obj))
        if own is None:
            own = seen[id(obj)] = obj.clone()
        return own
    if type(obj) in (tuple, list):
        seen = {} if seen is None else seen
        items = [own_storages(v, seen) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    if type(obj) is dict:
        seen = {} if seen is None else seen
        new = {k: own_storages(v, seen) for k, v in obj.items()}
        return obj if all(new[k] is v for k, v in obj.items()) else new
    return obj
