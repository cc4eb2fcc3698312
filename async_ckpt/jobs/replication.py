"""The replication thread of peer copies: one ticket per save due for the local tier, exchanged
with the peers in order (:class:`Replication`).

After the local copy of a save commits, in the background, on one replication thread per
manager, over a gloo group of the manager's own (:mod:`async_ckpt.ranks.peer_transfer`: one
exchange per save, files read once and verified, CRC-32C checked on arrival). The training
thread only queues a ticket for each save due locally (:class:`Ticket`): the ranks agreed on
that save, so every rank queues the same tickets in the same order and the n-th exchange of
every rank is the same save's, whatever each rank's local write did (a rank without a copy
sends a header saying so). A ticket whose save is no longer the newest when its turn comes
sends nothing but that header: replication never builds a backlog, it sends the newest copy
when it can. A peer that cannot be reached (dead, or not taking part within
``collective_timeout_s``) stops replication on this rank, logged (``Replication.broken``);
training, local saves and uploads go on.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Optional, Tuple

from ..errors import CheckpointError
from ..format.manifest import Manifest
from ..ranks.peer_transfer import NOTHING_TO_SEND, Landing, Outcome, Outgoing, exchange
from ..ranks.topology import Topology
from .roots import Root
from .write_queue import WriteQueue

log = logging.getLogger("async_ckpt")

#: tickets queued at most (each is a few bytes; stale ones end after one header exchange)
MAX_TICKETS = 64
#: how long the replication thread waits for the local save of a ticket to end
TICKET_WAIT_S = 3600.0


class Ticket:
    """One save due for the local tier, queued for replication on every rank (training thread).

    The local tier's job of that save is wrapped by :meth:`around` (its end lets the replication
    thread go on); a ticket whose save queued no local job is released by :meth:`release`.
    """

    def __init__(self, seq: int, step: int, hold: Optional[Callable[[int], Any]] = None) -> None:
        self.seq = seq
        self.step = step
        self._ended = threading.Event()
        self._handed = False
        self._hold = hold
        self._lock = threading.Lock()
        self._kept: Optional[contextlib.ExitStack] = None
        self._done = False

    def around(self, job: Callable[[], Any]) -> Callable[[], Any]:
        """``job`` (the local tier's save of this step), telling the ticket when it ends.

        Args:
            job: the local writer's job.

        Returns:
            The job to queue instead.
        """
        self._handed = True

        def run() -> Any:
            try:
                out = job()
                self._keep()  # committed: retention keeps it until it is replicated (or skipped)
                return out
            finally:
                self._ended.set()
        return run

    def _keep(self) -> None:
        with self._lock:
            if self._hold is not None and not self._done:
                stack = contextlib.ExitStack()
                stack.enter_context(self._hold(self.step))
                self._kept = stack

    def handed_over(self) -> Optional[contextlib.ExitStack]:
        """Replication thread, done with the ticket: the hold on the committed step (None: none
        was taken; a local job ending later takes none); the caller releases it (``close()``)
        or keeps it."""
        with self._lock:
            self._done = True
            kept, self._kept = self._kept, None
            return kept

    def release(self, *, failed: bool = False) -> None:
        """No local job of this save will end the ticket: it ends now (``failed``: also when a
        job was handed over, whose queueing then failed)."""
        if failed or not self._handed:
            self._ended.set()

    def wait(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) for the local job to end; whether it did."""
        return self._ended.wait(timeout)


@dataclass(frozen=True)
class Transfer:
    """One exchange of the replication thread (or a restore's), as this rank saw it.

    Attributes:
        step: the step of the save.
        sent_bytes: file bytes this rank sent (once per receiving rank).
        received_bytes: file bytes it received.
        seconds: how long the exchange took (waiting for the local save not counted).
        problems: what failed (an empty tuple: every copy sent and received was committed).
    """

    step: int
    sent_bytes: int
    received_bytes: int
    seconds: float
    problems: Tuple[str, ...] = ()


class Replication:
    """The replication thread's side of one manager's peer copies: the tickets, their
    exchanges, and the hold on the newest copy every peer took.

    Args:
        topology: this rank's peers.
        local: the manager's local tier (the copies sent).
        writer: the replication thread (:data:`MAX_TICKETS` tickets queued at most).
        receive: where a peer's announced copy goes (``receive(owner, manifest)``; raises to
            refuse it).
        transfers: where each exchange is recorded (:class:`Transfer`).
        timeout_s: the bound of each exchange (``collective_timeout_s``).
        verify: check CRC-32Cs of the files sent and received.
    """

    def __init__(self, topology: Topology, local: Root, writer: WriteQueue,
                 receive: Callable[[int, Manifest], Landing], transfers: Deque[Transfer], *, timeout_s: float,
                 verify: bool) -> None:
        self.topology = topology
        self.local = local
        self.writer = writer
        self._receive = receive
        self.transfers = transfers
        self.timeout_s = timeout_s
        self.verify = verify
        self._seq = 0
        self._newest = 0
        #: why replication stopped on this rank (a peer that died or did not answer), or None
        self.broken: Optional[str] = None
        #: the hold on this rank's newest copy every peer took: retention keeps it until a newer one is
        self._replicated: Optional[contextlib.ExitStack] = None
        #: the step of that copy
        self.replicated_step: Optional[int] = None
        #: the last ticket exchanged: (seq, step, its hold, whether this rank sent and received it whole)
        self._pending: Optional[Tuple[int, int, Optional[contextlib.ExitStack], bool]] = None

    def expect(self, step: int) -> Ticket:
        """Training thread, every rank, right after the ranks agreed on a save due locally:
        queue its replication.

        Args:
            step: the step of the save.

        Returns:
            The ticket, for the local tier's job (:meth:`Ticket.around`) or :meth:`Ticket.release`.
        """
        self._seq += 1
        ticket = Ticket(self._seq, step, self.local.store.catalog.hold)
        self._newest = ticket.seq
        self.writer.take_slot()
        self.writer.submit(functools.partial(self._replicate, ticket), step=step)
        return ticket

    def _replicate(self, ticket: Ticket) -> None:
        """Replication thread: the exchange of one ticket with every peer. Never raises.

        Every rank sends the same saves: before each ticket the ranks gather (one small
        all-gather over the replication group) the number of their newest queued ticket, and
        whether the last ticket they exchanged was sent and received whole; a ticket is skipped
        on every rank when every rank has a newer one queued. The committed step is held (the
        local tier's retention keeps it) from its commit until it is sent, then until the next
        gather says whether every rank's copies of it were taken: if so it becomes the copy the
        owner keeps (the one held before is released, and retention drops it), else it is
        released. So the owners keep the newest save their peers hold for every rank."""
        ready = self.broken is None and ticket.wait(TICKET_WAIT_S)
        hold = ticket.handed_over()
        try:
            if self.broken is not None:
                return
            skip = self._gather(ticket)
            if skip:
                return
            copy = self._own_copy(ticket.step) if ready and hold is not None else None
            out = self._send(ticket, copy)
            whole = out is not None and copy is not None and \
                all(out.sent.get(d) is None for d in self.topology.dests) and \
                all(g.committed for g in out.received.values())
            self._pending = (ticket.seq, ticket.step, hold if whole else None, whole)
            if whole:
                hold = None  # until the next gather
        except Exception:  # noqa: BLE001 - replication must never fail a save
            log.exception("rank %d: peer copies of step %d", self.topology.rank, ticket.step)
        finally:
            if hold is not None:
                hold.close()

    def _gather(self, ticket: Ticket) -> bool:
        """The gather before ``ticket`` (see :meth:`_replicate`); whether to skip it. The peers
        may come to it much later (their local write of the save is still running)."""
        import torch
        import torch.distributed as dist

        seq, step, held, whole = self._pending if self._pending is not None else (0, None, None, False)
        self._pending = None
        mine = torch.tensor([self._newest, seq if whole else -1], dtype=torch.int64)
        out = [torch.zeros(2, dtype=torch.int64) for _ in range(self.topology.world_size)]
        bound = max(TICKET_WAIT_S, self.timeout_s)
        try:
            work = dist.all_gather(out, mine, group=self.topology.group, async_op=True)
            if work is not None and work.wait(datetime.timedelta(seconds=bound)) is False:
                raise RuntimeError(f"timed out after {bound:g} s")
        except Exception as exc:  # noqa: BLE001 - replication must never fail a save
            if held is not None:
                held.close()
            self.broken = f"{type(exc).__name__}: {exc}"
            log.error("rank %d: peer copies stopped at step %d (local saves and the checkpoint path go on; a lost "
                      "node restores from the checkpoint path): %s", self.topology.rank, ticket.step, exc)
            return True
        rows = [t.tolist() for t in out]
        if seq and all(r[1] == seq for r in rows):  # every rank's copies of it are held by its peers
            old, self._replicated, self.replicated_step = self._replicated, held, step
            if old is not None:
                old.close()
                self.local.store.apply_retention(self.local.retention)  # drops it now if it would have before
        elif held is not None:
            held.close()
        return min(r[0] for r in rows) > ticket.seq

    def _send(self, ticket: Ticket, copy: Optional[Outgoing]) -> Optional[Outcome]:
        """The exchange of ``ticket`` with the peers (None: it failed, replication stopped)."""
        t0 = time.perf_counter()
        recvs = {s: functools.partial(self._receive, s) for s in self.topology.sources}
        try:
            # the peers may come to it much later (their local write of the save is still running)
            out = exchange(self.topology.group, ticket.seq, {d: copy for d in self.topology.dests}, recvs,
                           timeout_s=self.timeout_s,
                           first_timeout_s=max(TICKET_WAIT_S, self.timeout_s),
                           verify=self.verify)
        except CheckpointError as exc:
            self.broken = str(exc)
            log.error("rank %d: peer copies stopped at step %d (local saves and the checkpoint path go on; a lost "
                      "node restores from the checkpoint path): %s", self.topology.rank, ticket.step, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - replication must never fail a save
            self.broken = f"{type(exc).__name__}: {exc}"
            log.exception("rank %d: peer copies stopped at step %d", self.topology.rank, ticket.step)
            return None
        problems = [f"to rank {d}: {p}" for d, p in out.sent.items() if p not in (None, NOTHING_TO_SEND)]
        problems += [f"from rank {s}: {g.problem}" for s, g in out.received.items() if g.problem is not None]
        if copy is not None or any(g.manifest is not None for g in out.received.values()):
            self.transfers.append(Transfer(ticket.step, out.sent_bytes,
                                           sum(g.nbytes for g in out.received.values()),
                                           time.perf_counter() - t0, tuple(problems)))
        for p in problems:
            log.warning("rank %d: peer copy of step %d not kept %s (the next save is replicated again)",
                        self.topology.rank, ticket.step, p)
        return out

    def _own_copy(self, step: int) -> Optional[Outgoing]:
        """This rank's committed local copy of ``step``, to send (None: there is none, or it is
        not this rank's of this job)."""
        store = self.local.store
        try:
            opened = store.layout.read_committed(step)
            path, manifest = opened.where, opened.manifest
        except Exception as exc:  # noqa: BLE001 - nothing to send: the peers are told so
            log.warning("rank %d: the local copy of step %d is not replicated: %s", self.topology.rank, step, exc)
            return None
        ident = manifest.identity
        if (ident.rank, ident.world_size) != (self.topology.rank, self.topology.world_size) \
                or ident.saved_for_another(self.local.home) is not None:
            return None
        return Outgoing(store.storage, path, manifest)


    def release_holds(self) -> None:
        """Release the holds on the copies kept for replication (at close: the local tier's
        retention may then drop them)."""
        pending, self._pending = self._pending, None
        for kept in (self._replicated, pending[2] if pending is not None else None):
            if kept is not None:
                kept.close()
        self._replicated = None
