"""The one check of a step's DCP metadata against itself and its manifest, before any use.

:func:`check_step_metadata` is what restore (through DCP's reader (:mod:`async_ckpt.io.dcp_adapters`)),
``export``, ``show`` and ``verify`` run on a step's ``.metadata`` once it is unpickled: a step
whose metadata passes can be planned, allocated and read without meeting a value that makes
no sense (a negative shape, a chunk outside its tensor, an item past the end of its file, a
file far larger than its items). Anything else is a :class:`CorruptCheckpointError`, so that
``restore(None)`` falls back to an older step, ``verify`` reports it and the command line
prints one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .. import compat
from ..errors import CorruptCheckpointError
from .manifest import FileRecord, check_file_name, shown

if TYPE_CHECKING:  # the class compat returns, named for the type checker
    from torch.distributed.checkpoint.filesystem import _StorageInfo
else:
    _StorageInfo, _ = compat.dcp_storage_info()

_FIX = "the step is damaged or was not written by async_ckpt; restore another step"


def _count(x: Any) -> bool:
    """A non-negative int (not a bool)."""
    return type(x) is int and x >= 0


def _dims(x: Any) -> bool:
    """A shape, offsets or sizes: a tuple or list of non-negative ints."""
    if type(x) is torch.Size:  # holds ints only
        return not x or min(x) >= 0
    return isinstance(x, (tuple, list)) and all(_count(d) for d in x)


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def check_step_metadata(md: Any, files: Optional[Dict[str, FileRecord]], *, where: str,
                        whole: bool = True) -> Dict[str, int]:
    """Check a step's unpickled DCP metadata, and (with ``files``, the manifest's records) that
    it agrees with the manifest, before anything is planned, allocated or read from it.

    Checked: ``md`` is DCP ``Metadata`` with a dict of entries; every tensor entry has a dtype,
    a shape of non-negative sizes and chunks that lie inside it, do not overlap and cover
    every element, each chunk with a stored record at least as long as its data; every other
    entry has its stored bytes; every key path (``planner_data``) is a non-empty sequence of
    names and list indices; every stored item names a plain file name and a byte range of
    non-negative ints. With ``files``: every file an item lies in is listed, its items do not
    overlap, and the last of them ends exactly at the file's listed size (a file holds its
    items and nothing else).

    Args:
        md: what ``.metadata`` unpickled to (:func:`~.unpickling.load_metadata`).
        files: the manifest's file records, or ``None`` for a checkpoint without a manifest
            (plain DCP): then only ``md`` itself is checked.
        where: the ``.metadata`` file, for messages.
        whole: whether the copy holds every element of every tensor (the default). ``False``
            for one rank's share of a several-rank save (a local tier's copy,
            :attr:`~.manifest.Manifest.whole`): its chunks must still lie inside their tensors
            and not overlap, but need not cover them.

    Returns:
        Per data file that items lie in, where its last item ends.

    Raises:
        CorruptCheckpointError: naming the first problem found.
    """

    def bad(what: str, path: str = where) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {what}; {_FIX}", path=path)

    try:
        return _check(md, files, where, bad, whole)
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:  # a record missing a field, ...
        raise bad(f"malformed DCP metadata ({type(exc).__name__}: {shown(exc)})") from exc


def _check(md: Any, files: Optional[Dict[str, FileRecord]], where: str, bad: Any, whole: bool) -> Dict[str, int]:
    """:func:`check_step_metadata`, raising ``bad(problem)``."""
    if not isinstance(md, Metadata):
        raise bad(f"not DCP metadata (got {type(md).__name__})")
    entries, data, paths = md.state_dict_metadata, md.storage_data, md.planner_data
    if not isinstance(entries, dict):
        raise bad(f"its entries (state_dict_metadata) are {type(entries).__name__}, not a dict")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise bad(f"its storage data is {type(data).__name__}, not a dict")
    if paths is not None and not isinstance(paths, dict):
        raise bad(f"its key paths (planner_data) are {type(paths).__name__}, not a dict")
    # Per file: where its items end so far, while they come in file order without overlapping
    # (as every writer stores them); a file whose items do not is checked again below, sorted.
    ends: Dict[str, int] = {}
    first: Dict[str, str] = {}  # file -> the key of its first item
    unordered: Set[str] = set()
    cur_rel: Any = None
    cur_end = 0
    last: Dict[str, Tuple[Any, Any]] = {}  # key -> (chunk offsets or None, where it is stored) of its last item
    several: Set[str] = set()  # keys stored as several items (chunks)
    for idx, info in data.items():
        if type(idx) is not MetadataIndex:
            raise bad(f"a storage data key is {type(idx).__name__}, not a DCP MetadataIndex")
        fqn: Any = idx.fqn
        if type(fqn) is not str and not isinstance(fqn, str):
            raise bad(f"a storage data key is {type(idx).__name__}, not a DCP MetadataIndex")
        if type(info) is _StorageInfo:  # DCP's record: its fields exist (their values are checked below)
            rel: Any = info.relative_path
            offset: Any = info.offset
            length: Any = info.length
        else:
            rel = getattr(info, "relative_path", None)
            offset = getattr(info, "offset", None)
            length = getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise bad(f"{shown(fqn)}: invalid byte range {shown(offset)}+{shown(length)}")
        if rel != cur_rel or cur_rel is None:
            if cur_rel is not None:
                ends[cur_rel] = cur_end
            so_far = ends.get(rel)
            if so_far is None:
                check_file_name(rel, where=where)
                first[rel] = fqn
                so_far = 0
            cur_rel, cur_end = rel, so_far
        if offset < cur_end:
            unordered.add(rel)
        cur_end = offset + length if offset + length > cur_end else cur_end
        at: Any = idx.offset  # a tensor chunk's offsets (a crafted pickle may hold a list: not hashable)
        if at is not None and type(at) is not torch.Size:
            if not _dims(at):
                raise bad(f"{shown(fqn)}: invalid chunk offsets {shown(at)} in its storage data key")
            at = torch.Size(at)
        if fqn in last:
            several.add(fqn)
        last[fqn] = (at, info)
    every: List[Dict[Tuple[str, Any], Any]] = []

    def stored() -> Dict[Tuple[str, Any], Any]:
        """(key, chunk offsets or None) -> where it is stored, for every item: made on first use."""
        if not every:
            every.append({(idx.fqn, None if idx.offset is None else torch.Size(idx.offset)): info
                          for idx, info in data.items()})
        return every[0]

    for fqn, m in entries.items():
        if type(fqn) is not str and not isinstance(fqn, str):
            raise bad(f"an entry's key is {type(fqn).__name__}, not a string")
        if type(m) is TensorStorageMetadata and fqn not in several and _whole_chunk(m, last.get(fqn)):
            pass  # the common case, checked in one step
        elif isinstance(m, TensorStorageMetadata):
            _check_tensor(fqn, m, stored(), bad, whole)
        elif isinstance(m, BytesStorageMetadata):
            got = last.get(fqn)
            if (got is None or got[0] is not None) and (fqn not in several or (fqn, None) not in stored()):
                raise bad(f"{shown(fqn)}: no stored bytes for this entry")
        else:
            raise bad(f"{shown(fqn)}: entry is {type(m).__name__}, not tensor or bytes metadata")
        path = None if paths is None else paths.get(fqn)
        if path is None or (type(path) is tuple and len(path) == 1 and type(path[0]) is str):
            continue  # no key path, or the common one: a top-level name
        if not isinstance(path, (tuple, list)) or not path \
                or not all(isinstance(p, str) or _count(p) for p in path):
            raise bad(f"{shown(fqn)}: its key path {shown(path)} is not a non-empty sequence of names and list "
                      "indices")
    if cur_rel is not None:
        ends[cur_rel] = cur_end
    for rel in sorted(unordered, key=list(ends).index):
        items = sorted((info.offset, info.offset + info.length, idx.fqn) for idx, info in data.items()
                       if info.relative_path == rel)
        for (_, end, key), (start, _, nxt) in zip(items, items[1:]):
            if start < end:
                raise bad(f"{shown(key)} and {shown(nxt)} overlap in {shown(rel)} (bytes {start}-{end})")
        ends[rel] = items[-1][1]
        first[rel] = items[0][2]
    if files is None:
        return ends
    step_dir = where.rsplit("/", 1)[0] if "/" in where else ""
    for rel, end in ends.items():
        rec = files.get(rel)
        if rec is None:
            raise bad(f"{shown(first[rel])} is stored in {shown(rel)}, which the manifest lacks; refusing "
                      "to read it unchecked")
        at = f"{step_dir}/{rel}" if step_dir else rel
        if end > rec.size:
            raise bad(f"manifest says {rec.size} bytes, but an item .metadata places in it ends at byte {end}", at)
        if end < rec.size and not rec.may_hold_unused:  # a taken file (or a copy of one) may hold records it does not use
            raise bad(f"manifest says {rec.size} bytes, but its items end at byte {end}", at)
    return ends


def _whole_chunk(m: TensorStorageMetadata, stored: Optional[Tuple[Any, Any]]) -> bool:
    """Whether the tensor entry ``m``, whose key is stored as the one item ``stored`` (chunk
    offsets, where), is the common case, which passes :func:`_check_tensor`: DCP's own records, a
    torch dtype, one chunk that is the whole tensor, and a stored record at least as long as its
    data. ``False`` sends it through the full check."""
    chunks = m.chunks
    if type(chunks) is not list or len(chunks) != 1:
        return False
    c = chunks[0]
    props = m.properties
    if type(c) is not ChunkStorageMetadata or type(props) is not TensorProperties:
        return False
    size, first, dtype = m.size, c.offsets, props.dtype
    if type(size) is not torch.Size or type(first) is not torch.Size or type(dtype) is not torch.dtype \
            or c.sizes != size or len(first) != len(size) or any(first) or (size and min(size) < 0):
        return False
    if stored is None or stored[0] != first:
        return False
    info = stored[1]
    n = dtype.itemsize
    for d in size:
        n *= d
    return info.length >= n


def _check_tensor(fqn: str, m: TensorStorageMetadata, stored: Dict[Tuple[str, Any], Any], bad: Any,
                  whole: bool) -> None:
    """A tensor entry: see :func:`check_step_metadata`."""
    dtype = getattr(m.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise bad(f"{shown(fqn)}: its dtype is {shown(dtype)}, not a torch dtype")
    size = m.size
    if not _dims(size):
        raise bad(f"{shown(fqn)}: invalid shape {shown(size)} (sizes must be non-negative integers)")
    chunks = m.chunks
    if not isinstance(chunks, (list, tuple)):
        raise bad(f"{shown(fqn)}: its chunks are {type(chunks).__name__}, not a list")
    covered = 0
    boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
    for c in chunks:
        offsets: Any = getattr(c, "offsets", None)
        sizes: Any = getattr(c, "sizes", None)
        if not _dims(offsets) or not _dims(sizes) or len(offsets) != len(size) or len(sizes) != len(size):
            raise bad(f"{shown(fqn)}: a chunk at {shown(offsets)} of {shown(sizes)} does not fit a tensor of "
                      f"shape {tuple(size)}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise bad(f"{shown(fqn)}: a chunk at {tuple(offsets)} of {tuple(sizes)} lies outside its shape "
                      f"{tuple(size)}")
        info = stored.get((fqn, torch.Size(offsets)))
        if info is None:
            raise bad(f"{shown(fqn)}: its chunk at {tuple(offsets)} has no stored data")
        n = _prod(sizes)
        if info.length < n * dtype.itemsize:
            raise bad(f"{shown(fqn)}: its chunk at {tuple(offsets)} holds {n * dtype.itemsize} bytes of data, "
                      f"but its record is {info.length} bytes")
        covered += n
        if n:
            boxes.append((tuple(offsets), tuple(sizes)))
    if len(boxes) > 1 and size:  # (a scalar's chunks are counted below)
        _check_disjoint(fqn, boxes, bad)
    if covered != _prod(size) and (whole or covered > _prod(size)):
        raise bad(f"{shown(fqn)}: its chunks hold {covered} of its {_prod(size)} elements")


def _check_disjoint(fqn: str, boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]], bad: Any) -> None:
    """No two (non-empty) chunks of ``fqn`` share an element: a sweep along the first dimension,
    comparing each chunk only with those it could reach there."""
    boxes.sort()
    active: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
    for o, s in boxes:
        active = [(o2, s2) for o2, s2 in active if o2[0] + s2[0] > o[0]]
        for o2, s2 in active:
            if all(a2 < a + n and a < a2 + n2 for a, n, a2, n2 in zip(o, s, o2, s2)):
                raise bad(f"{shown(fqn)}: its chunks at {o2} and {o} overlap")
        active.append((o, s))
