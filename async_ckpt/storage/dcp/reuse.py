"""Incremental saves: which tensors an earlier step of the same root already holds, byte for byte.

A save with reuse on hashes each large tensor of its host snapshot (:func:`content_hash`) and
compares it with the record of the same key in the last step this rank committed to the root
(:class:`HeldBytes`). A data file of that step whose records the new step can use (enough of its
bytes: :data:`SHARE_MIN_FRACTION`) is *shared* into the new step's directory
(:meth:`~async_ckpt.storage.storage.Storage.share`: a hard link on POSIX paths, a server-side copy
on object stores) under a name of its own, and the new step's DCP ``.metadata`` places those
tensors there, at the offsets they have in that file. Everything else is written as usual.

So every step directory stays a complete DCP checkpoint made of plain files: ``restore(step)``,
plain ``dcp.load``, ``verify``, ``export`` and ``promote`` read it as any other, with no
reference to resolve; a shared file is always the file that holds the bytes (a hard link *is*
the file: no chains); and deleting a step (retention, ``delete()``, a crashed save's clean-up)
removes its names only, so the bytes live exactly as long as some step of the root names them.

The hash is xxHash's XXH3-128 (``xxhash``): 128 bits, so an identity by chance is out of reach,
and about 30 GB/s here (blake3 ran at 7 GB/s, 13 with threads; CRC32C at 15), so the pass costs
a few percent of a write even when everything changed. It is not cryptographic: it detects
change, not an adversary who crafts colliding tensors.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch
import xxhash

from ...addresses import byte_view
from ..manifest import FileRecord

#: tensors smaller than this are always written (a reference would save less than it costs)
MIN_SHARED_BYTES = 64 * 2**10
#: a file of the last step is shared when the tensors taken from it fill at least this part of
#: it; otherwise they are written again (sharing it would keep its other, stale bytes alive)
SHARE_MIN_FRACTION = 0.5

Key = Tuple[str, Tuple[int, ...]]  # (flattened key, chunk offsets): one item of one rank


def item_key(fqn: str, offsets: Optional[Iterable[int]]) -> Key:
    """The identity of a saved item across saves: its flattened key and its chunk's offsets."""
    return fqn, tuple(offsets) if offsets is not None else ()


def content_hash(t: Any) -> Optional[int]:
    """XXH3-128 of a host tensor's bytes, or ``None`` where it is not hashed (not a plain
    contiguous CPU tensor, or smaller than :data:`MIN_SHARED_BYTES`)."""
    if type(t) is not torch.Tensor or not t.is_cpu or not t.is_contiguous():
        return None
    n = t.numel() * t.element_size()
    if n < MIN_SHARED_BYTES:
        return None
    return xxhash.xxh3_128_intdigest(byte_view(t))


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor with ``t``'s bytes (``t`` itself when it is one already)."""
    t = t.detach()
    if t.is_cpu and t.is_contiguous():
        return t
    return t.contiguous() if t.is_cpu else t.cpu().contiguous()


@dataclasses.dataclass(frozen=True)
class HeldItem:
    """Where a committed step holds one tensor record, and what it holds."""

    name: str  # the data file in that step's directory
    offset: int  # of the record in the file
    length: int  # of the record
    hash: int  # XXH3-128 of the tensor's bytes
    dtype: torch.dtype
    shape: Tuple[int, ...]
    #: a declared-frozen tensor's (version counter, data pointer) when these bytes were taken
    version: Optional[Tuple[int, int]] = None


@dataclasses.dataclass
class HeldBytes:
    """The tensor records of one committed step of this rank: the step that a new save of the
    root may take records from."""

    step: int
    directory: str  # the committed step's directory
    items: Dict[Key, HeldItem]
    files: Dict[str, FileRecord]  # the records of the files the items lie in, by name


@dataclasses.dataclass
class WrittenItem:
    """One tensor record a save placed (written or taken from :class:`HeldBytes`)."""

    key: Key
    name: str
    offset: int
    length: int
    hash: int
    dtype: torch.dtype
    shape: Tuple[int, ...]
    version: Optional[Tuple[int, int]] = None


@dataclasses.dataclass
class Shared:
    """What a save takes from the last step: per position in its item list, where the item now
    lies in the new step (``(file name, offset, length)``), and the shared files' records."""

    placed: Dict[int, Tuple[str, int, int]]
    files: Dict[str, FileRecord]


class Reuse:
    """One root's memory, for one rank, of what its last committed step holds (see the module
    docstring), and the plan of what the next save can take from it. Thread-safe.

    Args:
        full_every: every ``full_every``-th save writes everything (nothing shared), so that no
            shared file grows older than that many saves; ``None``: no such bound.
    """

    def __init__(self, full_every: Optional[int] = None) -> None:
        self.full_every = full_every
        self._lock = threading.Lock()
        self._held: Optional[HeldBytes] = None
        self._pending: Dict[str, Tuple[List[WrittenItem], Dict[str, FileRecord], bool]] = {}
        self._since_full = 0
        # the next save's declared-frozen tensors (see prepare()) and what saves found changed
        self._seen: Dict[str, Tuple[int, int]] = {}
        self._kept: Set[str] = set()
        self._changed: List[str] = []

    def prepare(self, seen: Dict[str, Tuple[int, int]], kept: Set[str]) -> None:
        """Tell the next save (:meth:`share`) its declared-frozen tensors: ``seen``, the version
        of each (key -> ``(version counter, data pointer)``), and ``kept``, the keys staged
        without a host copy (the snapshot holds the live tensor)."""
        with self._lock:
            self._seen, self._kept = dict(seen), set(kept)

    def holds(self, fqn: str, t: torch.Tensor, version: Tuple[int, int]) -> bool:
        """Whether the next save can take ``fqn``'s bytes from the last step without a host copy:
        it holds them as of ``version`` (training thread; see :mod:`~async_ckpt.staging.frozen`)."""
        if self.due_full():
            return False
        held = self.held
        old = held.items.get(item_key(fqn, (0,) * t.dim())) if held is not None else None
        return old is not None and old.version == version and old.dtype == t.dtype and old.shape == tuple(t.shape)

    def same_bytes(self, fqn: str, host: torch.Tensor, version: Optional[Tuple[int, int]] = None) -> Optional[bool]:
        """Whether the last step holds exactly ``host``'s bytes under ``fqn`` (None: it holds no
        record of ``fqn`` taken at ``version``, or ``host`` is not hashed)."""
        held = self.held
        old = held.items.get(item_key(fqn, (0,) * host.dim())) if held is not None else None
        h = content_hash(host)
        if old is None or h is None or (version is not None and old.version != version):
            return None
        return old.hash == h and old.dtype == host.dtype and old.shape == tuple(host.shape)

    def take_changed(self) -> List[str]:
        """The declared-frozen keys whose bytes the saves since the last call found changed."""
        with self._lock:
            out, self._changed = self._changed, []
            return out

    @property
    def held(self) -> Optional[HeldBytes]:
        """What the last step committed through this memory holds (``None``: nothing yet)."""
        with self._lock:
            return self._held

    def due_full(self) -> bool:
        """Whether the next save writes everything (``full_every``)."""
        with self._lock:
            return self._held is None or (self.full_every is not None and self._since_full + 1 >= self.full_every)

    def share(self, storage: Any, path: str, prefix: str, keys: List[Key], objs: List[Any]
              ) -> Tuple[List[Optional[int]], Shared]:
        """Hash ``objs`` (the items of one save, ``keys[i]`` the key of ``objs[i]``) and share
        into ``path`` the files of the last step that the unchanged ones lie in.

        A file is shared under ``<prefix>ref<k>.distcp`` when its unchanged items fill at least
        :data:`SHARE_MIN_FRACTION` of it; a share that fails (the step was deleted meanwhile,
        the storage refused) leaves those items to be written.

        Args:
            storage: the root's storage.
            path: the directory of the step being written.
            prefix: this rank's file-name prefix (``__<rank>_``).
            keys: the items' keys (:func:`item_key`).
            objs: the items (host tensors, or anything else, which is always written).

        Returns:
            Each item's hash (``None``: not hashed) and what was shared.
        """
        with self._lock:
            seen, kept = self._seen, self._kept
        full = self.due_full()
        held = self.held
        hashes: List[Optional[int]] = [None] * len(objs)
        by_file: Dict[str, List[Tuple[int, HeldItem]]] = {}
        changed = []
        for i, o in enumerate(objs):
            fqn = keys[i][0]
            old = held.items.get(keys[i]) if held is not None else None
            if fqn in kept:  # a declared-frozen tensor left uncopied: the live tensor, version unchanged
                if not full and old is not None and old.version == seen.get(fqn) and old.dtype == o.dtype \
                        and old.shape == tuple(o.shape):
                    hashes[i] = old.hash
                    by_file.setdefault(old.name, []).append((i, old))
                    continue
                objs[i] = o = host_copy(o)  # no record to take it from: written, from a copy made now
            h = hashes[i] = content_hash(o)
            if h is None or old is None or old.dtype != o.dtype or old.shape != tuple(o.shape):
                continue
            if old.hash != h:
                if fqn in seen and old.version == seen[fqn]:  # declared frozen, its version stood: behind our back
                    changed.append(fqn)
            elif not full:
                by_file.setdefault(old.name, []).append((i, old))
        shared = Shared({}, {})
        with self._lock:
            self._changed += changed
        if held is None or not by_file:
            return hashes, shared
        k = 0
        for name, taken in sorted(by_file.items()):
            rec = held.files[name]
            if sum(item.length for _, item in taken) < SHARE_MIN_FRACTION * rec.size:
                continue
            new = f"{prefix}ref{k}.distcp"
            k += 1  # a failed share's name is never reused
            try:
                storage.share(f"{held.directory}/{name}", f"{path}/{new}")
                ok = storage.size(f"{path}/{new}") == rec.size  # else not the file the step committed
            except Exception:  # noqa: BLE001 - the items are written instead
                ok = False
            if not ok:
                try:
                    storage.rm(f"{path}/{new}", recursive=False)  # nothing outside the manifest is left
                except Exception:  # noqa: BLE001 - the step's clean-up removes it if it fails
                    pass
                continue
            shared.files[new] = dataclasses.replace(rec, ref=rec.ref or f"{held.step}/{name}")
            for i, item in taken:
                shared.placed[i] = (new, item.offset, item.length)
        return hashes, shared

    def wrote(self, path: str, items: List[WrittenItem], files: Dict[str, FileRecord], full: bool) -> None:
        """What a save into ``path`` placed, kept until its step commits (:meth:`committed`)."""
        for it in items:  # in the manifest, for a later manager's first save (see recall)
            rec = files.get(it.name)
            if rec is not None and rec.ref is None:
                if rec.hashes is None:
                    rec.hashes = {}
                rec.hashes[it.offset] = it.hash
        with self._lock:
            self._pending[path] = (items, files, full)

    def recall(self, step: int, directory: str, files: Dict[str, FileRecord], metadata: Any, prefix: str) -> int:
        """Remember a committed step read back from storage (a new manager's first save then
        compares with it): the tensor records of this rank's files (``prefix``) whose hash its
        manifest recorded. Returns how many; nothing is remembered when a step is already known.

        Args:
            step: the step.
            directory: its committed directory.
            files: its manifest's file records.
            metadata: its DCP ``Metadata`` (checked).
            prefix: this rank's data file names' prefix (``__<rank>_``).
        """
        items: Dict[Key, HeldItem] = {}
        for idx, info in metadata.storage_data.items():
            name = info.relative_path
            rec = files.get(name)
            if not name.startswith(prefix) or rec is None or not rec.hashes or info.offset not in rec.hashes:
                continue
            entry = metadata.state_dict_metadata.get(idx.fqn)
            chunks = getattr(entry, "chunks", None)
            if not chunks:
                continue
            at = tuple(idx.offset) if idx.offset is not None else ()
            chunk = next((c for c in chunks if tuple(c.offsets) == at), None)
            if chunk is None:
                continue
            items[item_key(idx.fqn, at)] = HeldItem(name, info.offset, info.length, rec.hashes[info.offset],
                                                    entry.properties.dtype, tuple(chunk.sizes))
        with self._lock:
            if self._held is not None or not items:
                return 0
            names = {it.name for it in items.values()}
            self._held = HeldBytes(step, directory, items, {n: r for n, r in files.items() if n in names})
            return len(items)

    def committed(self, path: str, step: int, directory: str) -> None:
        """The save into ``path`` committed as ``step`` in ``directory``: the next save may take
        its records. A save into another path that never committed is forgotten."""
        with self._lock:
            pending = self._pending.pop(path, None)
            self._pending.clear()
            if pending is None:
                return
            items, files, full = pending
            seen = self._seen
            held_items = {it.key: HeldItem(it.name, it.offset, it.length, it.hash, it.dtype, it.shape,
                                           seen.get(it.key[0])) for it in items}
            names = {it.name for it in items}
            self._held = HeldBytes(step, directory, held_items, {n: r for n, r in files.items() if n in names})
            self._since_full = 0 if full else self._since_full + 1

    def forget_step(self, step: int) -> None:
        """Take nothing from ``step`` (being deleted or saved again) until the next commit."""
        with self._lock:
            if self._held is not None and self._held.step == step:
                self._held = None

    def forget(self) -> None:
        """Take nothing from earlier steps until the next commit (e.g. the steps were deleted)."""
        with self._lock:
            self._held = None
            self._pending.clear()


def placed_items(keys: List[Key], objs: List[Any], hashes: List[Optional[int]],
                 where: Dict[int, Tuple[str, int, int]]) -> List[WrittenItem]:
    """The tensor records of one save, for :meth:`Reuse.wrote`: every hashed item and where
    it lies (``where``: position -> ``(file name, offset, length)``)."""
    out = []
    for i, h in enumerate(hashes):
        if h is None or i not in where:
            continue
        name, offset, length = where[i]
        out.append(WrittenItem(keys[i], name, offset, length, h, objs[i].dtype, tuple(objs[i].shape)))
    return out
