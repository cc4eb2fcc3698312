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

A file is taken only once verified (:meth:`Reuse.share`): a step is never committed as intact on
bytes nobody checked since they were written. A file this process wrote (and checksummed while
writing) or checked earlier passes when the storage says it is unchanged since (POSIX: inode,
size, mtime, and the ctime unless only the link count moved with it; see
:class:`~async_ckpt.storage.backends.FileState`); on storage that keeps each object's CRC-32C
(GCS) the taken copy's own CRC-32C is compared with the manifest's; anything else is read back
and checked. A file found damaged makes that save whole (and is logged).

The hash is xxHash's XXH3-128 (``xxhash``): 128 bits, so an identity by chance is out of reach,
and about 30 GB/s here (blake3 ran at 7 GB/s, 13 with threads; CRC32C at 15), so the pass costs
a few percent of a write even when everything changed. It is not cryptographic: it detects
change, not an adversary who crafts colliding tensors.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
import xxhash

from ..addresses import byte_view
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.manifest import FileRecord
from ..staging.frozen import host_copy
from ..storage.backends import FileState
from .read_exec import OpenFiles, Piece, execute, read_files
from .sinks import NULL
from .writer_process import current_executor

log = logging.getLogger("async_ckpt")

#: tensors smaller than this are always written (a reference would save less than it costs)
MIN_SHARED_BYTES = 64 * 2**10
#: a file of the last step is shared when the tensors taken from it fill at least this part of
#: it; otherwise they are written again (sharing it would keep its other, stale bytes alive)
SHARE_MIN_FRACTION = 0.5

Key = Tuple[str, Tuple[int, ...]]  # (flattened key, chunk offsets): one item of one rank
Version = Tuple[int, int]  # a declared-frozen tensor's (version counter, data pointer)


def item_key(fqn: str, offsets: Optional[Iterable[int]]) -> Key:
    """The identity of a saved item across saves: its flattened key and its chunk's offsets."""
    return fqn, tuple(offsets) if offsets is not None else ()


def hashable(t: Any) -> bool:
    """Whether :func:`content_hash` hashes ``t``: a plain contiguous CPU tensor of at least
    :data:`MIN_SHARED_BYTES`."""
    return type(t) is torch.Tensor and t.is_cpu and t.is_contiguous() \
        and t.numel() * t.element_size() >= MIN_SHARED_BYTES


def content_hash(t: Any) -> Optional[int]:
    """XXH3-128 of a host tensor's bytes, or ``None`` where it is not hashed (see :func:`hashable`).
    The writer process hashes the same bytes the same way (``writer_child``)."""
    if not hashable(t):
        return None
    return xxhash.xxh3_128_intdigest(byte_view(t))


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
    #: each file's state when its bytes were last known good (written and checksummed by this
    #: process, read back and checked, or checked by the CRC-32C the storage keeps): by name
    verified: Dict[str, FileState] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Known:
    """What a declared-frozen item's bytes were when last committed: at ``version``, these."""

    version: Version
    hash: int
    dtype: torch.dtype
    shape: Tuple[int, ...]


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
    lies in the new step (``(file name, offset, length)``), the shared files' records, and
    their states as verified (for the next save's check)."""

    placed: Dict[int, Tuple[str, int, int]]
    files: Dict[str, FileRecord]
    states: Dict[str, FileState] = dataclasses.field(default_factory=dict)


class Reuse:
    """One root's memory, for one rank, of what its last committed step holds (see the module
    docstring), and the plan of what the next save can take from it. Thread-safe.

    Args:
        full_every: every ``full_every``-th save writes everything (nothing shared), so that no
            shared file grows older than that many saves; ``None``: no such bound. Counted from
            the files' records (``FileRecord.carried``), so a restarted job keeps the count.
        version_of: a declared-frozen tensor's version now (``staging.frozen.version_of``): a
            tensor left uncopied whose bytes at the call no step can give is copied from the
            live tensor only while this still equals its version at the call.
    """

    def __init__(self, full_every: Optional[int] = None,
                 version_of: Optional[Callable[[torch.Tensor], Optional[Version]]] = None) -> None:
        self.full_every = full_every
        self._version_of = version_of
        self._lock = threading.Lock()
        self._held: Optional[HeldBytes] = None
        #: the step declared-frozen tensors left uncopied are read back from when their file is
        #: not taken: the held step, or the one a re-save or deletion set aside (nothing more is
        #: taken from that one, but a save staged before may still read its records)
        self._source: Optional[HeldBytes] = None
        self._pending: Dict[str, Tuple[List[WrittenItem], Dict[str, FileRecord], Dict[str, FileState]]] = {}
        # the next save's declared-frozen tensors (see prepare()) and what saves found changed
        self._seen: Dict[str, Version] = {}
        self._kept: Set[str] = set()
        self._step: Optional[int] = None
        self._changed: List[str] = []
        #: declared-frozen items: their bytes when last committed (kept across restores, which
        #: forget the held step, so that a change behind the version counter is still found)
        self._known: Dict[Key, Known] = {}
        self._checks = [0.0, 0]  # seconds spent verifying files to take, bytes read back for it

    def prepare(self, seen: Dict[str, Version], kept: Set[str], step: Optional[int] = None) -> None:
        """Tell the next save (:meth:`share`) its declared-frozen tensors: ``seen``, the version
        of each (key -> ``(version counter, data pointer)``), and ``kept``, the keys staged
        without a host copy (the snapshot holds the live tensor); ``step``: its step (for
        messages)."""
        with self._lock:
            self._seen, self._kept, self._step = dict(seen), set(kept), step

    def holds(self, fqn: str, t: torch.Tensor, version: Version) -> bool:
        """Whether the next save can take ``fqn``'s bytes from the last step without a host copy:
        it holds them as of ``version`` (training thread; see :mod:`~async_ckpt.staging.frozen`)."""
        if self.due_full():
            return False
        held = self.held
        old = held.items.get(item_key(fqn, (0,) * t.dim())) if held is not None else None
        return old is not None and old.version == version and old.dtype == t.dtype and old.shape == tuple(t.shape)

    def same_bytes(self, fqn: str, host: torch.Tensor, version: Optional[Version] = None) -> Optional[bool]:
        """Whether ``host``'s bytes are those last committed under ``fqn`` (None: no record of
        ``fqn`` committed at ``version``, or ``host`` is not hashed). A restore in between does
        not lose the record."""
        with self._lock:
            known = self._known.get(item_key(fqn, (0,) * host.dim()))
        h = content_hash(host)
        if known is None or h is None or (version is not None and known.version != version):
            return None
        return known.hash == h and known.dtype == host.dtype and known.shape == tuple(host.shape)

    def take_changed(self) -> List[str]:
        """The declared-frozen keys whose bytes the saves since the last call found changed."""
        with self._lock:
            out, self._changed = self._changed, []
            return out

    def take_checks(self) -> Tuple[float, int]:
        """Seconds the saves since the last call spent verifying the files they took, and the
        bytes they read back to do it (0 where the storage vouched for every file)."""
        with self._lock:
            (secs, nbytes), self._checks = self._checks, [0.0, 0]
            return secs, int(nbytes)

    @property
    def held(self) -> Optional[HeldBytes]:
        """What the last step committed through this memory holds (``None``: nothing yet)."""
        with self._lock:
            return self._held

    def due_full(self) -> bool:
        """Whether the next save writes everything (``full_every``): nothing to take from, or a
        file of the last step was taken ``full_every - 1`` times in a row already."""
        with self._lock:
            held = self._held
        if held is None:
            return True
        if self.full_every is None:
            return False
        return max((self._carried(r) for r in held.files.values()), default=0) + 1 >= self.full_every

    def _carried(self, rec: FileRecord) -> int:
        """How many saves in a row took ``rec``'s file (a taken file of a manifest that did not
        record it counts as due for a whole save)."""
        if rec.carried is not None:
            return rec.carried
        return 0 if rec.ref is None else (self.full_every or 1)

    def share(self, storage: Any, path: str, prefix: str, keys: List[Key], objs: List[Any]
              ) -> Tuple[List[Optional[int]], Shared]:
        """Hash ``objs`` (the items of one save, ``keys[i]`` the key of ``objs[i]``) and share
        into ``path`` the files of the last step that the unchanged ones lie in.

        A file is shared under ``<prefix>ref<k>.distcp`` when its unchanged items fill at least
        :data:`SHARE_MIN_FRACTION` of it, once verified (the module docstring); a share that
        fails (the step was deleted meanwhile, the storage refused) leaves those items to be
        written; a file found damaged leaves every item to be written (a whole save, logged).
        A declared-frozen item left uncopied (:meth:`prepare`) whose file is not taken is put
        in ``objs`` as its bytes at the call: read back from the step that holds them (checked
        against their hash), else copied from the live tensor if its version still stands.

        Args:
            storage: the root's storage.
            path: the directory of the step being written.
            prefix: this rank's file-name prefix (``__<rank>_``).
            keys: the items' keys (:func:`item_key`).
            objs: the items (host tensors, or anything else, which is always written).

        Returns:
            Each item's hash (``None``: not hashed) and what was shared.

        Raises:
            CheckpointError: a declared-frozen tensor changed after the call and its bytes at
                the call can be had from nowhere (the step that held them is damaged or gone):
                the save is not committed.
        """
        with self._lock:
            seen, kept, step = self._seen, self._kept, self._step
            held, source, known = self._held, self._source, dict(self._known)
        full = self.due_full()
        hashes: List[Optional[int]] = [None] * len(objs)
        executor = current_executor()  # the writer process hashes what it can read, off this GIL
        pre = executor.hashes(objs, hashable) if executor is not None else hashes[:]
        by_file: Dict[str, List[Tuple[int, HeldItem]]] = {}
        frozen: Dict[int, Optional[HeldItem]] = {}  # items left uncopied -> the record of their bytes
        changed: List[str] = []
        for i, o in enumerate(objs):
            key, fqn = keys[i], keys[i][0]
            if fqn in kept:  # the live tensor, its version at the call that of the source's record
                old = source.items.get(key) if source is not None else None
                if old is not None and old.version == seen.get(fqn) and _fits(old, o):
                    hashes[i], frozen[i] = old.hash, old
                    if held is source and not full:
                        by_file.setdefault(old.name, []).append((i, old))
                else:
                    frozen[i] = None
                continue
            h = hashes[i] = pre[i] if pre[i] is not None else content_hash(o)
            if h is None:
                continue
            k = known.get(key)
            if k is not None and fqn in seen and k.version == seen[fqn] and k.hash != h and _fits(k, o):
                changed.append(fqn)  # declared frozen, its version stood: changed behind our back
            old = held.items.get(key) if held is not None else None
            if old is not None and not full and old.hash == h and _fits(old, o):
                by_file.setdefault(old.name, []).append((i, old))
        with self._lock:
            self._changed += changed
        shared = Shared({}, {})
        if held is not None and by_file:
            shared = self._take(storage, held, path, prefix, by_file, step)
        for i, old in frozen.items():  # left uncopied, not taken: their bytes at the call
            if i not in shared.placed:
                objs[i], hashes[i] = self._at_call(storage, source, old, keys[i], objs[i], seen, known, step)
        return hashes, shared

    def _take(self, storage: Any, held: HeldBytes, path: str, prefix: str,
              by_file: Dict[str, List[Tuple[int, HeldItem]]], step: Optional[int]) -> Shared:
        """Verify, then share, the files of ``held`` that ``by_file``'s items fill at least
        :data:`SHARE_MIN_FRACTION` of; nothing at all if one is damaged."""
        files = {name: taken for name, taken in sorted(by_file.items())
                 if sum(item.length for _, item in taken) >= SHARE_MIN_FRACTION * held.files[name].size}
        damaged, unseen = self._verify(storage, held, list(files))
        shared = Shared({}, {})
        made: List[str] = []
        k = 0
        for name, taken in files.items():
            if damaged is not None:
                break
            if name in unseen:
                continue
            rec = held.files[name]
            new = f"{prefix}ref{k}.distcp"
            k += 1  # a failed share's name is never reused
            try:
                linked = storage.share(f"{held.directory}/{name}", f"{path}/{new}")
                made.append(new)
                st = storage.file_state(f"{path}/{new}")
            except Exception:  # noqa: BLE001 - the items are written instead
                _remove(storage, f"{path}/{new}")
                continue
            problem = _differs(st, rec, "the copy")
            if problem is not None:  # the storage's own CRC-32C of the copy (GCS), or its size
                damaged = (name, problem)
                break
            if linked:  # one file: the link moved its ctime and link count, not its bytes
                held.verified[name] = st
            shared.files[new] = dataclasses.replace(rec, ref=rec.ref or f"{held.step}/{name}",
                                                    carried=self._carried(rec) + 1)
            shared.states[new] = st
            for i, item in taken:
                shared.placed[i] = (new, item.offset, item.length)
        if damaged is None:
            return shared
        for new in made:  # nothing outside the manifest is left
            _remove(storage, f"{path}/{new}")
        name, problem = damaged
        log.warning("incremental save%s: %s/%s, a file of step %d it would take, is damaged (%s): "
                    "step%s is written whole, taking nothing from step %d; the steps that hold that file "
                    "cannot be restored (restore falls back past them)",
                    "" if step is None else f" of step {step}", held.directory, name, held.step, problem,
                    "" if step is None else f" {step}", held.step)
        with self._lock:
            if self._held is held:
                self._held = None  # take nothing more from it (its intact records may still be read back)
        return Shared({}, {})

    def _verify(self, storage: Any, held: HeldBytes, names: List[str]) -> Tuple[Optional[Tuple[str, str]], Set[str]]:
        """Check ``held``'s files ``names`` before they are taken (the module docstring): the
        first damaged one and why (or None), and those that cannot be looked at (e.g. deleted
        meanwhile: not taken). Files the storage vouches for by what it says of them are not
        read; the others are read back together. Storage that keeps each object's CRC-32C
        needs no look at a file it vouched for before: the copy's own is compared after the
        share."""
        t0 = time.perf_counter()
        unseen: Set[str] = set()
        reads: Dict[str, FileRecord] = {}
        states: Dict[str, FileState] = {}
        try:
            for name in names:
                rec, before = held.files[name], held.verified.get(name)
                if before is not None and before.crc32c is not None:
                    continue
                try:
                    st = storage.file_state(f"{held.directory}/{name}")
                except Exception:  # noqa: BLE001 - not taken (written instead)
                    unseen.add(name)
                    continue
                problem = _differs(st, rec, "it")
                if problem is not None:
                    return (name, problem), unseen
                if st.crc32c is None and not (before is not None and st.same_file(before)):
                    reads[name], states[name] = rec, st  # never seen by this process, or changed since
            if not reads:
                return None, unseen
            try:
                read_files(storage, held.directory, reads, NULL)
            except CorruptCheckpointError as exc:
                where = exc.path or ""
                name = where.rsplit("/", 1)[-1] if where.rsplit("/", 1)[-1] in reads else next(iter(reads))
                text = str(exc)
                return (name, text[len(where) + 2:] if where and text.startswith(f"{where}: ") else text), unseen
            except Exception:  # noqa: BLE001 - could not be read (e.g. deleted meanwhile): not taken
                return None, unseen | set(reads)
            held.verified.update(states)  # any later change shows against these states
            return None, unseen
        finally:
            with self._lock:
                self._checks[0] += time.perf_counter() - t0
                self._checks[1] += sum(r.size for r in reads.values())

    def _at_call(self, storage: Any, source: Optional[HeldBytes], old: Optional[HeldItem], key: Key, live: Any,
                 seen: Dict[str, Version], known: Dict[Key, Known], step: Optional[int]) -> Tuple[Any, Optional[int]]:
        """The bytes at the call of a declared-frozen item left uncopied whose file is not
        taken, and their hash: its record ``old`` in ``source`` read back (and checked against
        the hash recorded), else the live tensor while its version is the one at the call."""
        why = "no committed step holds it at its version"
        if old is not None and source is not None:
            try:
                t = _read_record(storage, source.directory, old, source.files[old.name])
                if content_hash(t) == old.hash and _fits(old, t):
                    return t, old.hash
                why = f"its record in {source.directory}/{old.name} is not the bytes recorded"
            except Exception as exc:  # noqa: BLE001 - then the live tensor, if it still stands
                why = f"its record in {source.directory}/{old.name} cannot be read ({exc})"
        fqn = key[0]
        now = self._version_of(live) if self._version_of is not None and isinstance(live, torch.Tensor) else None
        if now is None or now != seen.get(fqn):
            raise CheckpointError(
                f"the declared-frozen tensor {fqn} was left uncopied at the call and changed since (its version "
                f"counter moved); its bytes at the call cannot be had: {why}. The save is not committed", step=step)
        t = host_copy(live)
        h = content_hash(t)
        k = known.get(key)
        if h is not None and k is not None and k.version == now and k.hash != h:
            with self._lock:
                self._changed.append(fqn)
        return t, h

    def wrote(self, storage: Any, path: str, items: List[WrittenItem], files: Dict[str, FileRecord],
              shared: Optional[Shared] = None) -> None:
        """What a save into ``path`` placed, kept until its step commits (:meth:`committed`):
        ``files`` its data files' records (``shared``: what it took). The state of each file it
        wrote is taken now (checksummed as they were written, they count as verified in that
        state: a ``stat`` on local paths, one request per file on object stores), except where
        the storage keeps each object's CRC-32C (GCS), which is checked when the file is taken."""
        states: Dict[str, FileState] = dict(shared.states) if shared is not None else {}
        t0 = time.perf_counter()
        fresh = []
        for it in items:  # in the manifest, for a later manager's first save (see recall)
            rec = files.get(it.name)
            if rec is not None and rec.ref is None:
                if rec.hashes is None:
                    rec.hashes = {}
                rec.hashes[it.offset] = it.hash
                if it.name not in states and it.name not in fresh:
                    fresh.append(it.name)
        if fresh and not storage.keeps_crc32c:
            def look(name: str) -> None:
                try:
                    states[name] = storage.file_state(f"{path}/{name}")
                except Exception:  # noqa: BLE001 - then read back if it is ever taken
                    pass

            if storage.is_local or len(fresh) == 1:
                for name in fresh:
                    look(name)
            else:  # one request each: at once
                with ThreadPoolExecutor(min(8, len(fresh)), thread_name_prefix="async-ckpt-stat") as pool:
                    list(pool.map(look, fresh))
        with self._lock:
            self._checks[0] += time.perf_counter() - t0
            self._pending[path] = (items, files, states)

    def recall(self, step: int, directory: str, files: Dict[str, FileRecord], metadata: Any, prefix: str) -> int:
        """Remember a committed step read back from storage (a new manager's first save then
        compares with it): the tensor records of this rank's files (``prefix``) whose hash its
        manifest recorded. Returns how many; nothing is remembered when a step is already known.
        A record whose hash is that of a declared-frozen item's bytes at a known version gets
        that version (so it need not be copied again, and a change behind its counter shows).

        Args:
            step: the step.
            directory: its committed directory.
            files: its manifest's file records.
            metadata: its DCP ``Metadata`` (checked).
            prefix: this rank's data file names' prefix (``__<rank>_``).
        """
        with self._lock:
            known = dict(self._known)
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
            key, h = item_key(idx.fqn, at), rec.hashes[info.offset]
            dtype, shape = entry.properties.dtype, tuple(chunk.sizes)
            k = known.get(key)
            version = k.version if k is not None and (k.hash, k.dtype, k.shape) == (h, dtype, shape) else None
            items[key] = HeldItem(name, info.offset, info.length, h, dtype, shape, version)
        with self._lock:
            if self._held is not None or not items:
                return 0
            names = {it.name for it in items.values()}
            self._held = self._source = HeldBytes(step, directory, items, {n: r for n, r in files.items() if n in names})
            return len(items)

    def committed(self, path: str, step: int, directory: str) -> None:
        """The save into ``path`` committed as ``step`` in ``directory``: the next save may take
        its records. A save into another path that never committed is forgotten."""
        with self._lock:
            pending = self._pending.pop(path, None)
            self._pending.clear()
            if pending is None:
                return
            items, files, states = pending
            seen = self._seen
            held_items = {it.key: HeldItem(it.name, it.offset, it.length, it.hash, it.dtype, it.shape,
                                           seen.get(it.key[0])) for it in items}
            for it in items:
                v = seen.get(it.key[0])
                if v is not None:
                    self._known[it.key] = Known(v, it.hash, it.dtype, it.shape)
                else:  # committed without a version (none could be had): an older record is stale,
                    self._known.pop(it.key, None)  # and its version may be a freed tensor's, reused
            names = {it.name for it in items}
            self._held = self._source = HeldBytes(step, directory, held_items,
                                                  {n: r for n, r in files.items() if n in names},
                                                  {n: s for n, s in states.items() if n in names})

    def forget_step(self, step: int) -> None:
        """Take nothing from ``step`` (being deleted or saved again) until the next commit; a
        save already staged may still read a declared-frozen tensor's record from it."""
        with self._lock:
            if self._held is not None and self._held.step == step:
                self._held = None

    def forget(self) -> None:
        """Take nothing from earlier steps until the next commit (e.g. the steps were deleted).
        What the declared-frozen tensors' bytes were is kept (:meth:`same_bytes`)."""
        with self._lock:
            self._held = self._source = None
            self._pending.clear()


def _fits(old: Any, t: Any) -> bool:
    """Whether ``t`` has ``old``'s dtype and shape."""
    return getattr(t, "dtype", None) == old.dtype and tuple(getattr(t, "shape", ())) == old.shape


def _differs(st: FileState, rec: FileRecord, what: str) -> Optional[str]:
    """Why a file in state ``st`` is not the one ``rec`` records, by its size and the CRC-32C the
    storage keeps of it (None: nothing tells)."""
    if st.size != rec.size:
        return f"{what} has {st.size} bytes, the manifest says {rec.size}"
    if st.crc32c is not None and st.crc32c != rec.crc32c:
        return f"the storage's CRC-32C of {what} is {st.crc32c:#010x}, the manifest says {rec.crc32c:#010x}"
    return None


def _remove(storage: Any, path: str) -> None:
    try:
        storage.rm(path, recursive=False)
    except Exception:  # noqa: BLE001 - the step's clean-up removes it if this fails
        pass


def _read_record(storage: Any, directory: str, item: HeldItem, rec: FileRecord) -> torch.Tensor:
    """The tensor of the record ``item`` of the file ``directory/item.name`` (a ``torch.save``
    record, as DCP writes one; ``rec`` its file's manifest record), read back through the one
    verified read (checked against its CRC-32C where the manifest lists the file's records)."""
    buf = bytearray(item.length)
    records: List[int] = []
    if rec.records is not None:
        at = 0
        for k, (n, _) in enumerate(rec.records):
            if at == item.offset and n == item.length:
                records = [k]
                break
            at += n
    with OpenFiles(storage, directory, {item.name: rec}) as opened:
        execute(opened, [Piece(item.name, item.offset, item.offset + item.length, memoryview(buf))],
                records={item.name: records})
    t = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
    if not isinstance(t, torch.Tensor):
        where = f"{directory}/{item.name}"
        raise CorruptCheckpointError(f"{where}: the record at offset {item.offset} is not a tensor", path=where)
    return host_copy(t)


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
