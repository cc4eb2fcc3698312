"""The lazy copy engine: chunks of host copies, their completion handles, the copier thread.

A lazy stage (:class:`~.lazy.LazyStager`) lays the copies out in chunks (:func:`build_chunks`)
and issues them (:func:`start`): CUDA ones at once, ``non_blocking`` on a side stream with one
event per chunk; CPU ones (and host views of XLA buffers) on a background thread
(:class:`Copier`), one batched copy per chunk. :class:`PendingCopies` is the snapshot's handle
on them; :data:`outstanding` lists every handle of the process whose chunks are not all sealed,
for the hooks of :mod:`.guard`.

What keeps a lazy snapshot exact
    * the hooks of :mod:`.guard` wait (:meth:`PendingCopies.wait`) for the chunks that hold the
      tensors an optimizer step or a module's forward is about to write;
    * a safety net for everything else: each source tensor's ``_version`` is recorded at the
      call and compared again when its chunk is *sealed*: on the thread that called
      ``save_async``, between two of its ops, after the copy completed (the next hook call,
      ``wait_for_staging``, ``save_async``, ``join`` or ``close``). An in-place op bumps
      ``_version`` only when it *ends*, so a check on the copier thread could miss a write still
      in progress; between two ops of the training thread none is. If the version changed, the
      save fails with :class:`TornSnapshotError` instead of writing a torn checkpoint (also
      when the write came after the copy but before the seal: the safe side). The writer
      waits for the seal before writing;
    * freed or swapped storage: each source's storage (data pointer, size, and that the user's
      tensor still points at it) is recorded at the call and checked right before a CPU copy
      reads it (and again after), and for CUDA copies at the seal. A storage freed or resized
      (``untyped_storage().resize_(0)``, as FSDP does with unsharded parameters) or replaced
      (``set_()``) is not read, and the save fails with :class:`TornSnapshotError`.

What is process-wide, and why
    The hooks of :mod:`.guard` are process-wide, so they see every outstanding
    :class:`PendingCopies` of every stager (:data:`outstanding`). That is what keeps two
    managers apart: each handle only waits for and seals its own chunks, and a tensor saved by
    two managers is waited for on behalf of both. The copier thread is one per process too: it
    holds no state of its own beyond the queue of handles, runs them in order, and a barrier
    (:meth:`Copier.hold`, used by :class:`async_ckpt.testing.hold_copies`) stops it. What a
    stager learns (the order in which the guard needed its storages, :class:`NeedOrder`) is per
    stager.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch

from ..compat import foreach_copy_
from ..errors import CheckpointError, TornSnapshotError

StorageKey = Tuple[bool, int]  # (is_cuda, storage data_ptr)


def storage_key(t: torch.Tensor) -> Optional[StorageKey]:
    """The key the guard matches tensors by: (is CUDA, storage data_ptr); None if it has none."""
    try:
        return (t.is_cuda, t.untyped_storage().data_ptr())
    except Exception:  # XLA, meta, sparse, ...
        return None


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except Exception:  # inference tensors have no version counter
        return -1


class Chunk:
    """One batched copy and the user tensors it reads."""

    __slots__ = ("dsts", "srcs", "members", "versions", "keys", "nbytes", "xla", "done", "fenced",
                 "sealed", "event", "device", "lock", "error", "torn", "claimed", "storages", "freed", "fn")

    def __init__(self, xla: bool = False) -> None:
        self.dsts: List[torch.Tensor] = []
        self.srcs: List[torch.Tensor] = []
        self.members: List[Tuple[str, torch.Tensor]] = []  # (name, user tensor) for the version check
        self.versions: List[int] = []
        self.keys: Set[StorageKey] = set()
        self.nbytes = 0
        self.xla = xla
        self.done = threading.Event()  # the bytes are in the host buffers
        self.fenced = False  # CUDA: the training stream waits for the copy (later work is ordered after it)
        self.claimed = False  # CPU: a thread (copier or training) has taken this copy
        self.sealed = False  # the version check has run
        self.event: Any = None  # CUDA event recorded after the copy
        self.device: Any = None
        self.lock = threading.Lock()
        self.error: Optional[BaseException] = None
        self.torn: List[str] = []
        #: (name, tensor, storage data_ptr, storage nbytes) of every source and user tensor,
        #: recorded at the call and compared before (and after) the copy reads them
        self.storages: List[Tuple[str, torch.Tensor, int, int]] = []
        self.freed: List[str] = []  # tensors whose storage was freed, resized or replaced
        #: a deferred transfer (SPMD: from references to immutable device data) run instead
        #: of a copy; it reads no user tensor, so nothing is checked
        self.fn: Optional[Callable[[], None]] = None

    def claim(self) -> bool:
        """Take this CPU copy for the calling thread (False if another thread has it)."""
        with self.lock:
            if self.claimed:
                return False
            self.claimed = True
            return True

    def storage_changed(self) -> List[str]:
        """Names of the tensors whose storage is no longer the one recorded at the call: freed
        or resized (``untyped_storage().resize_()``, as FSDP does with unsharded parameters:
        data pointer or size differ) or replaced (``set_()``: the tensor points elsewhere)."""
        bad: List[str] = []
        for name, t, ptr, nbytes in self.storages:
            try:
                s = t.untyped_storage()
                same = s.data_ptr() == ptr and s.nbytes() == nbytes
            except Exception:  # noqa: BLE001 - no storage to read from any more
                same = False
            if not same and name not in bad:
                bad.append(name)
        return bad

    def run(self) -> None:
        """Do the copy (the caller claimed it, or it is a CUDA chunk) and mark it done.

        CPU: the sources' storages are checked right before the copy and again after it. A
        storage freed, resized or replaced since the call is not read (reading it would touch
        freed memory); one that changed during the copy may have been read while freed. Either
        way the chunk records the tensors in ``freed`` and the snapshot fails with
        :class:`TornSnapshotError`. (A free that races with the copy itself is not prevented:
        call ``CheckpointManager.wait_for_staging()`` before freeing saved storages.)"""
        try:
            if self.event is not None:
                self.event.synchronize()
            elif self.fn is not None:
                self.fn()
            elif self.dsts:
                bad = self.storage_changed()
                if not bad:
                    with torch.no_grad():
                        foreach_copy_(self.dsts, self.srcs)
                    bad = self.storage_changed()
                self.freed.extend(bad)
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc
        self.dsts, self.srcs = [], []  # copied: drop the references to the user's tensors
        self.fn = None
        if self.event is None:
            self.storages = []
        self.done.set()

    def seal(self) -> None:
        """Compare the recorded versions with the current ones (once).

        Sound only on the thread that mutates the tensors, between two of its ops, after the
        copy completed (or was fenced): then every write that thread made since the call has
        bumped ``_version`` already, so an unchanged version proves the copy is exact. A write
        made after the copy completed but before the seal is reported too (safe side).
        """
        with self.lock:
            if self.sealed:
                return
            self.sealed = True
            if self.storages:
                # CUDA: the copy ran on a side stream, unordered with the training stream that
                # may have freed the storage since the call (its memory may have been reused).
                self.freed.extend(n for n in self.storage_changed() if n not in self.freed)
                self.storages = []
            for (name, t), v in zip(self.members, self.versions):
                if v >= 0 and _version(t) != v:
                    self.torn.append(name)
            self.members = []  # checked: the user's tensors are not needed for it any more


class PendingCopies:
    """The completion handle of a lazy snapshot.

    Training thread: ``wait(keys)`` fences the chunks that hold any of ``keys`` (and seals
    them); ``wait_all()`` waits for every copy and seals everything. Writer thread:
    ``result()`` waits until every chunk is sealed and raises :class:`TornSnapshotError` (or
    the copy's own error) if the snapshot is not exact.
    """

    def __init__(self, chunks: List[Chunk], order: Optional["NeedOrder"] = None) -> None:
        self.chunks = chunks
        self.order = order  # where the guard notes the storages it waited for (the stager's)
        self.owner = threading.get_ident()  # the thread that called save_async
        self.by_key: Dict[StorageKey, List[Chunk]] = {}
        for c in chunks:
            for k in c.keys:
                self.by_key.setdefault(k, []).append(c)
        self.has_xla = any(c.xla for c in chunks)
        #: no chunk has anything to check (device buffers only): any thread may seal them
        self.checkless = all(c.xla for c in chunks)
        self.finished = threading.Event()  # every copy has run
        self.sealed = threading.Event()  # every chunk has been version-checked
        self._pos = 0  # chunks before it are sealed
        self._seal_lock = threading.Lock()
        self.waited_s = 0.0  # time the training thread spent waiting in the guard
        self.step: Optional[int] = None
        if not chunks:
            self.finished.set()
            self.sealed.set()

    @property
    def done(self) -> bool:
        return self.sealed.is_set()

    def seal_ready(self) -> None:
        """Seal the chunks whose copies have completed (owner thread, between ops; cheap)."""
        if self.sealed.is_set() or threading.get_ident() != self.owner:
            return
        self._advance()

    def _advance(self) -> None:
        with self._seal_lock:
            chunks, n = self.chunks, len(self.chunks)
            while self._pos < n:
                c = chunks[self._pos]
                if not c.sealed:
                    if not (c.done.is_set() or c.fenced):
                        return
                    c.seal()
                self._pos += 1
        self.sealed.set()
        outstanding.remove(self)

    def _fence(self, chunks: Iterable[Chunk]) -> None:
        t0 = time.perf_counter()
        for c in chunks:
            if c.sealed:
                continue
            if not c.done.is_set():
                if c.event is not None and c.error is None:
                    # CUDA: order the training stream after the copy; no host stall.
                    torch.cuda.current_stream(c.device).wait_event(c.event)
                    c.fenced = True
                elif c.event is None and c.claim():
                    c.run()  # not started yet: copy it here, beside the copier (work stealing)
                else:
                    c.done.wait()
            c.seal()  # before the mutation the caller is about to make
        self.waited_s += time.perf_counter() - t0

    def wait(self, keys: Iterable[StorageKey]) -> None:
        """Make it safe to mutate the tensors whose storage keys are ``keys``."""
        if self.sealed.is_set():
            return
        found: List[Chunk] = []
        for k in keys:
            cs = self.by_key.get(k)
            if cs:
                found.extend(cs)
        if found:
            self._fence(found)
        self.seal_ready()

    def wait_xla(self) -> None:
        if self.has_xla and not self.sealed.is_set():
            self._fence([c for c in self.chunks if c.xla])

    def wait_all(self) -> None:
        """Training thread: wait until every copy has finished, and seal them all."""
        if self.sealed.is_set():
            return
        t0 = time.perf_counter()
        self.finished.wait()
        self._advance()
        self.waited_s += time.perf_counter() - t0

    def result(self) -> None:
        """Wait until every copy is done and sealed (by the training thread: the next hook,
        ``save_async``, ``wait_for_staging``, ``join`` or ``close``); raise if a copy failed or a
        source changed before it was copied."""
        if threading.get_ident() == self.owner:
            self.wait_all()
        elif self.checkless:
            self.finished.wait()
            self._advance()
        self.sealed.wait()
        for c in self.chunks:
            if c.error is not None:
                raise CheckpointError(f"{'deferred XLA transfer' if c.xla else 'lazy host copy'} failed: "
                                      f"{type(c.error).__name__}: {c.error}",
                                      step=self.step) from c.error
        freed = [n for c in self.chunks for n in c.freed]
        if freed:
            raise TornSnapshotError(
                f"lazy save of step {self.step}: the storage of tensor(s) {_names(freed)} was freed, "
                f"resized or replaced (untyped_storage().resize_(), set_()) after "
                f"save_async(..., lazy=True) returned and before their host copy ran; the copy was "
                f"not made and the checkpoint was not written. Call manager.wait_for_staging() "
                f"before freeing or swapping saved tensors' storage, or save with lazy=False",
                step=self.step)
        torn = [n for c in self.chunks for n in c.torn]
        if torn:
            raise TornSnapshotError(
                f"lazy save of step {self.step}: tensor(s) {_names(torn)} were modified in place after "
                f"save_async(..., lazy=True) returned and before their host copy was confirmed, by "
                f"something the guard does not see (not optimizer.step() nor a module's forward); "
                f"the checkpoint was not written. Call manager.wait_for_staging() before mutating "
                f"tensors by hand, or save with lazy=False", step=self.step)


def _names(names: List[str]) -> str:
    return ", ".join(names[:10]) + (f" (and {len(names) - 10} more)" if len(names) > 10 else "")


# ---- the background copier -----------------------------------------------------------------
class Copier:
    """One daemon thread that runs CPU chunk copies and completes CUDA chunks, FIFO."""

    def __init__(self) -> None:
        self._queue: "queue.Queue[Union[PendingCopies, threading.Event]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="async-ckpt-lazy-copy", daemon=True)
        self._thread.start()

    def submit(self, pc: PendingCopies) -> None:
        """Queue the CPU copies of ``pc`` (and the completion of its CUDA ones).

        Args:
            pc: The handle of one lazy snapshot.
        """
        self._queue.put(pc)

    def hold(self, barrier: threading.Event) -> None:
        """Queue a barrier: what is queued after it waits until ``barrier`` is set.

        Args:
            barrier: Set it to let the copier go on.
        """
        self._queue.put(barrier)

    def _run(self) -> None:
        while True:
            pc = self._queue.get()
            if isinstance(pc, threading.Event):  # hold(): a barrier
                pc.wait()
                continue
            try:
                for c in pc.chunks:
                    if c.event is not None or c.claim():  # else the training thread took it
                        c.run()
                for c in pc.chunks:
                    c.done.wait()  # stolen copies finish on the training thread
            finally:
                pc.finished.set()


_copier: Optional[Copier] = None
_copier_lock = threading.Lock()


def copier() -> Copier:
    """The process's copier thread (started on first use).

    Returns:
        The one :class:`Copier` of this process.
    """
    global _copier
    with _copier_lock:
        if _copier is None:
            _copier = Copier()
        return _copier


# ---- the outstanding snapshots ------------------------------------------------------------
class Outstanding:
    """The handles of this process whose chunks are not all sealed, oldest first.

    ``handles`` is a tuple replaced on every change (copy-on-write): the hooks read it without
    a lock."""

    def __init__(self) -> None:
        self.handles: Tuple[PendingCopies, ...] = ()
        self._lock = threading.Lock()

    def add(self, pc: PendingCopies) -> None:
        """Track ``pc`` until it is sealed.

        Args:
            pc: A handle whose copies are not finished.
        """
        with self._lock:
            self.handles = self.handles + (pc,)

    def remove(self, pc: PendingCopies) -> None:
        """Stop tracking ``pc`` (sealed).

        Args:
            pc: A handle (one not tracked is ignored).
        """
        with self._lock:
            self.handles = tuple(p for p in self.handles if p is not pc)


#: every outstanding lazy snapshot of the process
outstanding = Outstanding()


class NeedOrder:
    """The order in which the guard needed each storage of one stager's snapshots (learned:
    the next lazy stage of that stager issues the big copies in this order)."""

    __slots__ = ("rank", "_counter")

    #: bounded: storages come and go
    LIMIT = 1_000_000

    def __init__(self) -> None:
        self.rank: Dict[StorageKey, int] = {}
        self._counter = 0

    def note(self, keys: Iterable[StorageKey], known: Dict[StorageKey, Any]) -> None:
        """The guard is about to wait for ``keys`` (one wait: they share a rank); only those
        in ``known`` (the storages of this stager's snapshot) are noted."""
        self._counter += 1
        rank, counter = self.rank, self._counter
        if len(rank) > self.LIMIT:
            rank.clear()
        for k in keys:
            if k in known:
                rank.setdefault(k, counter)

    def order(self, units: Sequence[Any]) -> List[Any]:
        """Big units in the order the guard needed them last time; unknown ones keep their order."""
        rank = self.rank
        if not rank:
            return list(units)
        inf = math.inf

        def of(u: Any) -> float:
            k = storage_key(u.members[0][1])
            return rank.get(k, inf) if k is not None else inf

        return sorted(units, key=of)  # stable


# ---- issuing ---------------------------------------------------------------------------------
def build_chunks(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor, List[Tuple[str, torch.Tensor]], bool]],
                 chunk_bytes: int) -> List[Chunk]:
    """Group ``(dst, src, members, xla)`` copies, in order, into chunks of about ``chunk_bytes``
    (never mixing CPU and CUDA sources, or XLA views and plain tensors)."""
    chunks: List[Chunk] = []
    cur: Optional[Chunk] = None
    for dst, src, members, xla in pairs:
        kind = (src.is_cuda, src.device, xla)
        if cur is None or cur.nbytes >= chunk_bytes or (cur.srcs and (cur.srcs[0].is_cuda, cur.srcs[0].device, cur.xla) != kind):
            cur = Chunk(xla=xla)
            chunks.append(cur)
        cur.dsts.append(dst)
        cur.srcs.append(src)
        cur.nbytes += dst.numel() * dst.element_size()
        if xla:  # our own views of immutable device buffers: nothing to guard
            continue
        src_seen = False
        for name, t in members:
            cur.members.append((name, t))
            cur.versions.append(_version(t))
            s = _storage_of(t)
            if s is not None:
                ptr = s.data_ptr()
                cur.keys.add((t.is_cuda, ptr))
                cur.storages.append((name, t, ptr, s.nbytes()))
                src_seen = src_seen or t is src
        if not src_seen and members:  # a span of a shared storage: check the span view too
            s = _storage_of(src)
            if s is not None:
                cur.storages.append((members[0][0], src, s.data_ptr(), s.nbytes()))
    return chunks


def deferred_chunks(fns: Sequence[Callable[[], None]]) -> List[Chunk]:
    """One chunk per deferred transfer (run by the copier like a CPU copy, or stolen by the
    training thread when a guard waits for it)."""
    chunks: List[Chunk] = []
    for fn in fns:
        c = Chunk(xla=True)
        c.fn = fn
        chunks.append(c)
    return chunks


def _storage_of(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except Exception:  # meta, sparse, ...
        return None


def start(chunks: List[Chunk], cuda_stream: Callable[[torch.device], Any],
          order: Optional[NeedOrder] = None) -> PendingCopies:
    """Issue the copies of ``chunks``: CUDA ones now on side streams (``cuda_stream(device)``,
    one event each), CPU ones on the background copier.

    Args:
        chunks: The chunks of one snapshot (:func:`build_chunks`).
        cuda_stream: The side stream to copy on, per CUDA device.
        order: Where the guard notes what it waits for (the stager's), or None.

    Returns:
        The snapshot's handle, in :data:`outstanding` until it is sealed (install the hooks of
        :mod:`.guard` to have it waited for before optimizer steps and forwards).
    """
    cuda = any(c.srcs and c.srcs[0].is_cuda for c in chunks)
    if cuda:
        waited: Set[Any] = set()
        for c in chunks:
            if not (c.srcs and c.srcs[0].is_cuda):
                continue
            dev = c.srcs[0].device
            stream = cuda_stream(dev)
            if dev not in waited:
                # The side stream must see every kernel already queued on the training stream.
                stream.wait_stream(torch.cuda.current_stream(dev))
                waited.add(dev)
            with torch.cuda.stream(stream), torch.no_grad():
                foreach_copy_(c.dsts, c.srcs, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            c.event, c.device = ev, dev
    pc = PendingCopies(chunks, order)
    if not pc.finished.is_set():
        outstanding.add(pc)
    copier().submit(pc)
    return pc
