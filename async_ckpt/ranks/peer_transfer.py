"""Committed step copies sent between ranks, point to point: the wire of peer copies.

One :func:`exchange` moves whole committed copies of steps (one rank's local copy: its manifest
and every file it lists) between pairs of ranks, over a gloo group of the manager's own. Each
rank taking part says what it sends to which ranks (possibly "nothing", which still pairs) and
from which ranks it receives. Both ends of every pair post their operations in the same rounds,
so sends and receives pair up whatever each rank sends:

1. header, every pair (the sequence number both ends must share, whether a copy follows, the
   length of its manifest);
2. manifest, where a copy follows: its JSON;
3. accept, receiver to sender: the receiver checked the manifest (every name a plain file name,
   none of the names async_ckpt writes itself; a size the receiver's ``Accept`` allows) and
   opened where the copy goes, or refuses it (the sender then sends that rank nothing more);
4. data: the files in name order, in chunks of :data:`CHUNK_BYTES`; the sender reads each chunk
   once for every receiver of the copy, through the one verified read
   (:class:`~async_ckpt.io.read_exec.FileStream`: size, CRC-32C); the receiver writes
   each chunk and puts its CRC-32C together as it arrives, then compares it with the manifest's;
5. trailer, sender to receiver: whether its read verified.

A receiver commits the copy (:meth:`Landing.commit`: atomically, as any step) only when every
file arrived with the manifest's size and CRC-32C and the sender's read verified; otherwise it
removes what it wrote (:meth:`Landing.abort`). A damaged source file is sent all the same (the
rounds stay paired) and fails that copy on both ends. In each round every operation is posted
at once (non-blocking) and then waited for, within one bound: two ranks that send to each
other never wait on each other, and a peer that dies or does not take part in time fails the
exchange with :class:`~async_ckpt.errors.CheckpointError` after at most ``timeout_s``, leaving
nothing committed by it (the group's pairs are then out of step: the caller stops using it).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from ..addresses import byte_view
from ..errors import CheckpointError
from ..format.crc import crc32c
from ..format.manifest import Manifest, check_file_name
from ..io.read_exec import FileStream, checksum_error, size_error
from ..storage import Storage

#: the bytes a file is sent in at a time (memory: one such buffer per copy sent and per copy received)
CHUNK_BYTES = 16 * 2**20

#: the header of each pair: [sequence number, 1 when a copy follows, manifest bytes, 0]
_HEADER = 4

#: the longest manifest a peer may announce (bytes): a longer one ends the exchange at once
MAX_MANIFEST_BYTES = 256 * 2**20

#: :attr:`Outcome.sent` of a receiving rank this rank had no copy for (not a failure)
NOTHING_TO_SEND = "nothing to send"


@dataclass
class Outgoing:
    """A committed copy this rank sends.

    Attributes:
        storage: the root holding it.
        path: its step directory.
        manifest: its manifest (checked against its marker when it was opened).
    """

    storage: Storage
    path: str
    manifest: Manifest


class Landing(Protocol):
    """Where a received copy is written, and how it is committed or removed."""

    @property
    def storage(self) -> Storage:
        """The storage the files are written to."""

    @property
    def path(self) -> str:
        """The directory the files are written into (it exists)."""

    def commit(self, manifest: Manifest) -> None:
        """Commit the copy with ``manifest`` (every file is there and verified)."""

    def abort(self) -> None:
        """Remove what was written; nothing is committed (idempotent)."""


#: a receiver's decision on an announced copy: where it goes, or an error saying why it is refused
Accept = Callable[[Manifest], Landing]


@dataclass
class Received:
    """What one exchange did with the copy announced by one sender.

    Attributes:
        src: the sending rank.
        manifest: the copy's manifest (None when nothing was announced, or it did not parse).
        committed: the copy was received whole, verified and committed.
        problem: why not, when a copy was announced and not committed.
        nbytes: the file bytes received.
    """

    src: int
    manifest: Optional[Manifest] = None
    committed: bool = False
    problem: Optional[str] = None
    nbytes: int = 0


@dataclass
class Outcome:
    """What one exchange did on this rank.

    Attributes:
        sent: per receiving rank, None when it took the copy and this rank's read verified, else
            why not (:data:`NOTHING_TO_SEND` when there was no copy to send).
        sent_bytes: the file bytes this rank sent (counted once per receiver).
        received: per sending rank, what happened to its copy.
    """

    sent: Dict[int, Optional[str]] = field(default_factory=dict)
    sent_bytes: int = 0
    received: Dict[int, Received] = field(default_factory=dict)


class _Link:
    """Rounds of point-to-point operations over ``group``, each round bounded by ``timeout_s``."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group
        self.timeout_s = timeout_s

    def round(self, sends: Sequence[Tuple[int, torch.Tensor]], recvs: Sequence[Tuple[int, torch.Tensor]],
              timeout_s: Optional[float] = None) -> None:
        import torch.distributed as dist

        bound = self.timeout_s if timeout_s is None else timeout_s
        try:
            works = [dist.irecv(t, group=self.group, group_src=src) for src, t in recvs]
            works += [dist.isend(t, group=self.group, group_dst=dst) for dst, t in sends]
            deadline = time.monotonic() + bound
            for w in works:
                left = max(0.001, deadline - time.monotonic())
                if w is not None and w.wait(datetime.timedelta(seconds=left)) is False:
                    raise RuntimeError(f"timed out after {bound:g} s")
        except RuntimeError as exc:  # gloo: the peer died (connection closed), or the time passed
            peers = sorted({r for r, _ in sends} | {r for r, _ in recvs})
            raise CheckpointError(f"sending step copies to or from rank(s) {peers} failed: a peer died or did not "
                                  f"take part in time: {exc}") from exc


def _chunks(manifest: Manifest, chunk: int) -> List[Tuple[str, int, int]]:
    """``(file, start, end)`` of every chunk of a copy's non-empty files, file by file in name order."""
    out = []
    for name in sorted(manifest.files):
        size = manifest.files[name].size
        out += [(name, lo, min(size, lo + chunk)) for lo in range(0, size, chunk)]
    return out


class _Source:
    """One copy being sent: each file read in order, chunk by chunk, through the one verified
    read (:class:`~async_ckpt.io.read_exec.FileStream`: checked once its last chunk is read)."""

    def __init__(self, copy: Outgoing, dsts: List[int], chunk: int, verify: bool) -> None:
        self.copy, self.dsts, self.verify = copy, dsts, verify
        self.chunks = _chunks(copy.manifest, chunk)
        self.buf = torch.empty(min(chunk, max((hi - lo for _, lo, hi in self.chunks), default=1)), dtype=torch.uint8)
        self.problem: Optional[str] = None
        self._stream: Optional[FileStream] = None

    def read(self, k: int) -> torch.Tensor:
        """Chunk ``k``'s bytes (zeros once a read failed: the rounds go on, the copy fails)."""
        name, lo, hi = self.chunks[k]
        view = self.buf[:hi - lo]
        if self.problem is not None:
            return view.zero_()
        try:
            if lo == 0:
                self.close()
                self._stream = FileStream(self.copy.storage, self.copy.path, name, self.copy.manifest.files[name],
                                          verify=self.verify)
            assert self._stream is not None
            mv = byte_view(view)
            got = self._stream.read(lo, mv)
            if got < hi - lo:
                mv[got:] = bytes(hi - lo - got)
        except Exception as exc:  # noqa: BLE001 - this copy fails on both ends; the rounds go on
            self.problem = f"{type(exc).__name__}: {exc}"
            self.close()
            view.zero_()
        return view

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


class _Sink:
    """One copy being received: written chunk by chunk, each file's CRC-32C checked at its end."""

    def __init__(self, src: int, manifest: Manifest, landing: Landing, chunk: int, got: Received) -> None:
        self.src, self.manifest, self.landing, self.got = src, manifest, landing, got
        self.chunks = _chunks(manifest, chunk)
        self.buf = torch.empty(min(chunk, max((hi - lo for _, lo, hi in self.chunks), default=1)), dtype=torch.uint8)
        self._file: Any = None  # the open file's context manager
        self._out: Any = None
        self._crc = 0

    def view(self, k: int) -> torch.Tensor:
        _, lo, hi = self.chunks[k]
        return self.buf[:hi - lo]

    def write(self, k: int) -> None:
        """Write chunk ``k`` (received into :meth:`view`); a failure fails the copy, the rounds go on."""
        if self.got.problem is not None:
            return
        name, lo, hi = self.chunks[k]
        rec = self.manifest.files[name]
        where = f"{self.landing.path}/{name}"
        try:
            if lo == 0:
                self._file = self.landing.storage.open_write(where, size_hint=rec.size)
                self._out = self._file.__enter__()
                self._crc = 0
            mv = byte_view(self.view(k))
            self._out.write(mv)
            self._crc = crc32c(mv, self._crc)
            self.got.nbytes += hi - lo
            if hi == rec.size:
                self._close(None)
                if self._crc != rec.crc32c:
                    raise checksum_error(f"rank {self.src}'s {name}", self._crc, rec.crc32c)
        except Exception as exc:  # noqa: BLE001 - this copy fails; the rounds go on
            self._close(exc)
            self.got.problem = f"{type(exc).__name__}: {exc}"

    def _close(self, exc: Optional[BaseException]) -> None:
        f, self._file, self._out = self._file, None, None
        if f is not None:
            try:
                f.__exit__(None if exc is None else type(exc), exc, None)
            except Exception:  # noqa: BLE001 - after a failure the copy is removed anyway: that error stays
                if exc is None:
                    raise

    def finish(self, sender_ok: bool) -> None:
        """Commit the copy when every file arrived verified and the sender's read verified; else remove it."""
        try:
            if self.got.problem is None and not sender_ok:
                self.got.problem = f"rank {self.src} could not read its copy whole and verified (see its log)"
            if self.got.problem is None:
                for name, rec in self.manifest.files.items():
                    if rec.size == 0:  # sent no chunk: written empty here
                        with self.landing.storage.open_write(f"{self.landing.path}/{name}", size_hint=0):
                            pass
                if self.got.nbytes != sum(r.size for r in self.manifest.files.values()):
                    raise size_error(f"rank {self.src}'s copy", self.got.nbytes,
                                     sum(r.size for r in self.manifest.files.values()))
                self.landing.commit(self.manifest)
                self.got.committed = True
        except Exception as exc:  # noqa: BLE001 - reported with the outcome
            self.got.problem = f"{type(exc).__name__}: {exc}"
        finally:
            self.abort()

    def abort(self) -> None:
        self._close(CheckpointError("the exchange ended"))
        try:
            self.landing.abort()  # nothing once committed
        except Exception as exc:  # noqa: BLE001 - what is left is an incomplete step: the next writer removes it
            if self.got.problem is None and not self.got.committed:
                self.got.problem = f"{type(exc).__name__}: {exc}"


def exchange(group: Any, seq: int, sends: Mapping[int, Optional[Outgoing]], recvs: Mapping[int, Accept], *,
             timeout_s: float, first_timeout_s: Optional[float] = None, verify: bool = True,
             chunk: int = CHUNK_BYTES) -> Outcome:
    """Send and receive whole step copies between this rank and others (see the module docstring).

    Every rank named here calls :func:`exchange` at the same time with the mirror of this call
    (this rank in its ``recvs`` where it is in this one's ``sends``, and the other way round),
    with the same ``seq``.

    Args:
        group: the gloo group (ranks are its group ranks).
        seq: the number both ends of every pair must give (a pair that disagrees is out of step).
        sends: receiving rank -> the copy this rank sends it, or None (nothing to send this time);
            one :class:`Outgoing` object given to several ranks is read once for all of them.
        recvs: sending rank -> how to take the copy it announces (where to write it, or raise to
            refuse it).
        timeout_s: how long each round waits at most.
        first_timeout_s: how long the first round (the headers) waits at most, when the peers
            may come to the exchange much later (None: ``timeout_s``).
        verify: compare CRC-32Cs (sizes are always compared).
        chunk: the bytes sent at a time.

    Returns:
        What was sent and received.

    Raises:
        CheckpointError: a peer died, did not take part in time, or is out of step (another
            ``seq``); nothing was committed by this exchange since the failing round, what was
            being written is removed, and the group is not to be used for exchanges again.
    """
    link = _Link(group, timeout_s)
    out = Outcome(received={s: Received(s) for s in recvs})
    sinks: Dict[int, _Sink] = {}
    sources: Dict[int, _Source] = {}
    try:
        # 1. headers
        mbytes = {d: c.manifest.to_json() for d, c in sends.items() if c is not None}
        heads = {s: torch.zeros(_HEADER, dtype=torch.int64) for s in recvs}
        link.round([(d, torch.tensor([seq, int(d in mbytes), len(mbytes.get(d, b"")), 0], dtype=torch.int64))
                    for d in sends], list(heads.items()), first_timeout_s)
        for s, h in heads.items():
            if int(h[0]) != seq:
                raise CheckpointError(f"rank {s} is out of step: exchange {int(h[0])}, this rank's {seq}")
            if int(h[1]) == 1 and not 0 < int(h[2]) <= MAX_MANIFEST_BYTES:
                raise CheckpointError(f"rank {s} announced a manifest of {int(h[2])} bytes (at most "
                                      f"{MAX_MANIFEST_BYTES}): refused, and this exchange ends")
        # 2. manifests
        texts = {s: torch.empty(int(h[2]), dtype=torch.uint8) for s, h in heads.items() if int(h[1]) == 1}
        link.round([(d, torch.frombuffer(bytearray(b), dtype=torch.uint8)) for d, b in mbytes.items()],
                   list(texts.items()))
        # 3. accept or refuse
        for s, t in texts.items():
            got = out.received[s]
            try:
                manifest = Manifest.from_json(bytes(byte_view(t)), where=f"the manifest rank {s} sent")
                for name in manifest.files:
                    check_file_name(name, where=f"the manifest rank {s} sent")
                got.manifest = manifest
                sinks[s] = _Sink(s, manifest, recvs[s](manifest), chunk, got)
            except Exception as exc:  # noqa: BLE001 - refused: said to the sender, reported here
                got.problem = f"refused: {type(exc).__name__}: {exc}"
        answers = {d: torch.zeros(1, dtype=torch.int64) for d in mbytes}
        link.round([(s, torch.tensor([int(s in sinks)], dtype=torch.int64)) for s in texts], list(answers.items()))
        taken: Dict[int, List[int]] = {}  # id of an Outgoing -> the ranks that take it
        for d, c in sends.items():
            if c is None:
                out.sent[d] = NOTHING_TO_SEND
            elif int(answers[d]) != 1:
                out.sent[d] = f"rank {d} refused the copy (see its log)"
            else:
                taken.setdefault(id(c), []).append(d)
        for c in sends.values():
            if c is not None and id(c) in taken and id(c) not in sources:
                sources[id(c)] = _Source(c, taken[id(c)], chunk, verify)
        # 4. data, round by round
        rounds = max([len(x.chunks) for x in sources.values()] + [len(x.chunks) for x in sinks.values()] + [0])
        for k in range(rounds):
            posted = [(d, src.read(k)) for src in sources.values() if k < len(src.chunks) for d in src.dsts]
            link.round(posted, [(s, sink.view(k)) for s, sink in sinks.items() if k < len(sink.chunks)])
            out.sent_bytes += sum(t.numel() for _, t in posted)
            for sink in sinks.values():
                if k < len(sink.chunks):
                    sink.write(k)
        # 5. trailers: whether each sender's read verified
        for src in sources.values():
            src.close()
        trailers = {s: torch.zeros(1, dtype=torch.int64) for s in sinks}
        link.round([(d, torch.tensor([int(src.problem is None)], dtype=torch.int64))
                    for src in sources.values() for d in src.dsts], list(trailers.items()))
        for src in sources.values():
            for d in src.dsts:
                out.sent[d] = None if src.problem is None else f"reading the copy failed: {src.problem}"
        for s, sink in sinks.items():
            sink.finish(int(trailers[s]) == 1)
        return out
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        raise
    finally:
        for src in sources.values():
            src.close()
