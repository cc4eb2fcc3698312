"""Peer copies of the local tier (``local_replicas=``): a lost node restores from its peers.

One manager's peer copies put together (:class:`PeerCopies`): who sends what to whom is the
ranks' topology (:mod:`async_ckpt.ranks.topology`); after the local copy of a save commits, the
replication thread sends it to those peers (:mod:`.replication`, over the wire of
:mod:`async_ckpt.ranks.peer_transfer`); a receiving rank keeps rank ``r``'s copies in a root of
its own inside its local tier (:mod:`.held_copies`), with the local tier's retention.

**Restore.** :meth:`PeerCopies.fill` runs before the restore chooses a step: one exchange
gathers every rank's inventory (:mod:`.peer_inventory`: its own copies, the copies it holds for
others, and any other rank's local-tier directory on its disk: a node that comes back as other
ranks); the newest save that every rank can get a copy of (same save id) wins; the ranks that
lack their copy of it in their own local tier get it (their own disk when they see it elsewhere
on it, else from a rank that holds it, balanced by bytes), read once and verified on both ends,
committed into their own local tier; then the restore runs as without peers (each rank loads its
own local copy). If a transfer fails (a damaged held copy), every rank goes on to the next save
that every rank can get; when none is left, the restore reads the bucket. Copies saved at
another world size are never sent (the restore reads the bucket, and says so).
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

from ..errors import CheckpointError
from ..format.manifest import Manifest
from ..io.copies import copy_files
from ..options import PeerOptions
from ..policies import keeping
from ..ranks import phase
from ..ranks.exchange import Exchange
from ..ranks.peer_transfer import Landing, Outgoing, exchange
from ..ranks.topology import Topology
from ..storage import Storage
from ..storage.step_dirs import StepDirectories
from .held_copies import HeldCopies, check_copy, land
from .peer_inventory import Complete, Inventory, Move, complete_saves, inventory, why_missing
from .replication import MAX_TICKETS, Replication, Ticket, Transfer
from .roots import Root, foreign_steps
from .write_queue import WriteQueue

log = logging.getLogger("async_ckpt")

#: the exchange number of the transfers a restore makes (tickets count from 1)
RESTORE_SEQ = 0


class PeerCopies:
    """One manager's peer copies: the replication thread, the held copies, the restore's fill.

    Args:
        topology: this rank's peers (:func:`~async_ckpt.ranks.topology.peer_topology`).
        local: the manager's local tier.
        options: the peer copies' options (``verify``, ``collective_timeout_s``, the held copies' store).
        exchange: the manager's exchange.
    """

    def __init__(self, topology: Topology, local: Root, options: PeerOptions, exchange: Exchange) -> None:
        self.topology = topology
        self.local = local
        self.options = options
        self.exchange = exchange
        #: the replication thread: one ticket per save due locally, in order
        self.writer = WriteQueue(MAX_TICKETS, name="async-ckpt-peer-copies")
        #: the exchanges of this rank, oldest first (the last 1000)
        self.transfers: Deque[Transfer] = collections.deque(maxlen=1000)
        #: the roots of the copies this rank holds for others
        self.held = HeldCopies(local, options, self.writer, topology.world_size)
        #: the tickets and their exchanges
        self.replication = Replication(topology, local, self.writer, self.held.receive, self.transfers,
                                       timeout_s=options.collective_timeout_s, verify=options.verify)
        #: after :meth:`fill`: which ranks' copies of the newest local save no disk held, or which
        #: transfer failed (None: the newest local save was complete); rank 0 logs it with the step restored
        self.missing: Optional[str] = None

    @property
    def broken(self) -> Optional[str]:
        """Why replication stopped on this rank (a peer that died or did not answer), or None."""
        return self.replication.broken

    @property
    def replicated_step(self) -> Optional[int]:
        """The step of this rank's newest copy every peer took (retention keeps it), or None."""
        return self.replication.replicated_step

    def expect(self, step: int) -> Ticket:
        """Training thread, every rank, right after the ranks agreed on a save due locally:
        queue its replication.

        Args:
            step: the step of the save.

        Returns:
            The ticket, for the local tier's job (:meth:`~.replication.Ticket.around`) or
            :meth:`~.replication.Ticket.release`.
        """
        return self.replication.expect(step)

    # ---- waiting, closing, deleting -----------------------------------------------------------
    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued ticket was exchanged.

        Args:
            timeout: seconds to wait at most (None: the manager's ``collective_timeout_s``; a
                peer may wait much longer for its own local write before its exchange).

        Returns:
            Whether the replication thread is idle.
        """
        try:
            self.writer.wait_idle(self.options.collective_timeout_s if timeout is None else timeout)
            return True
        except CheckpointError:
            return False

    def close(self) -> None:
        """Finish the queued tickets (``collective_timeout_s`` at most, then they are left to
        the daemon thread), stop the thread, close the held roots (deletions finish, leases
        released)."""
        try:
            if not self.wait_idle():
                log.warning("rank %d: peer copies still being exchanged at close() are abandoned",
                            self.topology.rank)
            self.writer.close(timeout=0)
        finally:
            self.replication.release_holds()
            self.local.store.apply_retention(self.local.retention)  # what the holds kept beyond it
            self.held.close()

    def stop_threads(self) -> None:
        """Finalizer of a manager collected without ``close()``: stop without waiting."""
        self.writer.close(timeout=0)
        self.held.stop()

    def delete_held(self, step: int) -> None:
        """Delete the copies of ``step`` this rank holds for others (``delete(step)``: every copy).

        Args:
            step: the step.
        """
        self.wait_idle()  # (bounded; a copy still being received commits, or fails, on its own)
        self.held.delete(step)

    # ---- restore side (training thread, every rank) -----------------------------------------
    def fill(self, step: Optional[int]) -> None:
        """Before a restore chooses a step (collective): bring into each rank's own local tier
        its copy of the newest save every rank can get a copy of (see the module docstring).
        Never raises for a copy that cannot be had (the restore then falls back as without
        peers); a rank that died makes the exchanges fail as any collective does.

        Args:
            step: the step the restore names (None: the newest).
        """
        idle = self.wait_idle()  # a thread still exchanging holds the group: no transfers then
        exchange, topo = self.exchange, self.topology
        invs: List[Inventory] = [i or Inventory() for i in
                                 phase.everyone(exchange, "listing the peer copies", step,
                                                functools.partial(self._inventory, idle))]
        if any(i.broken for i in invs):
            if exchange.is_primary:
                log.warning("restore: copies are not fetched from peers: a rank's replication group is out of use "
                            "or still busy")
            return
        candidates = complete_saves([i.copies for i in invs], topo.world_size, step)
        self.missing = why_missing(invs, topo.world_size, step, candidates)
        if not candidates:
            others = sorted({w for i in invs for w in i.other_worlds})
            if others and exchange.is_primary:
                log.warning("the local tiers hold copies saved at world size %s; this job has %d ranks: they are not "
                            "restored (a restore at another world size reads the checkpoint path)",
                            others[0] if len(others) == 1 else others, topo.world_size)
            return
        for cand in candidates:
            if not cand.moves:
                return  # every rank holds its copy of the newest such save in its own local tier
            results = phase.everyone(exchange, f"fetching the local copies of step {cand.step} from peers",
                                     cand.step, functools.partial(self._fetch, cand))
            problems = [p for r in results if r for p in r[0]]
            if not problems:
                if exchange.is_primary:
                    fetched = [m.owner for m in cand.moves]
                    log.warning("restore: the local copies of step %d of rank(s) %s were brought from their peers "
                                "(%d bytes)", cand.step, fetched, sum(m.nbytes for m in cand.moves))
                return
            if exchange.is_primary:
                log.warning("restore: the local copies of step %d could not all be brought from their peers: %s; "
                            "trying the next step every rank can get", cand.step, "; ".join(problems))
            if self.missing is None:
                self.missing = f"the copies of step {cand.step} could not all be brought from their peers"
            if any(r and r[1] for r in results):
                return  # a replication group out of use: no more transfers

    def _inventory(self, idle: bool = True) -> Inventory:
        """This rank's inventory (``idle``: the replication thread is idle, else the group is
        reported out of use). Never raises."""
        assert self.options.local_dir is not None
        return inventory(self.options.local_dir, self.local.store.storage.root, self.local.home, self.topology.rank,
                         self.topology.world_size, retry=self.options.store.retry,
                         broken=self.replication.broken is not None or not idle)

    def _fetch(self, cand: Complete) -> Tuple[List[str], bool]:
        """This rank's part of bringing ``cand``'s copies home: what it sends, what it receives
        (or copies from its own disk). Returns the problems and whether the group is out of use;
        never raises."""
        me = self.topology.rank
        problems: List[str] = []
        sends: Dict[int, Optional[Outgoing]] = {}
        recvs: Dict[int, Callable[[Manifest], Landing]] = {}
        opened: Dict[str, Optional[Outgoing]] = {}
        t0 = time.perf_counter()
        at_home = [mv for mv in cand.moves if mv.owner == me and mv.sender == me]
        for mv in cand.moves:
            if mv.sender == me and mv.owner != me:
                if mv.where not in opened:
                    opened[mv.where] = self._open(mv.where, cand)
                sends[mv.owner] = opened[mv.where]
            elif mv.owner == me and mv.sender != me:
                recvs[mv.sender] = functools.partial(self._home, cand, mv.nbytes)
        out = None
        if sends or recvs:
            try:
                out = exchange(self.topology.group, RESTORE_SEQ, sends, recvs,
                               timeout_s=self.options.collective_timeout_s, verify=self.options.verify)
            except Exception as exc:  # noqa: BLE001 - reported by every rank; no more transfers
                self.replication.broken = f"{type(exc).__name__}: {exc}"
                return problems + [f"rank {me}: {exc}"], True
        for mv in at_home:  # after the exchange: the peers do not wait for a local copy
            problem = self._copy_home(cand, mv)
            if problem:
                problems.append(f"rank {me}: {problem}")
        if out is None:
            return problems, False
        for d, p in out.sent.items():
            if p is not None:
                problems.append(f"rank {me} sending rank {d}'s copy: {p}")
        for s, got in out.received.items():
            if not got.committed:
                problems.append(f"rank {me} from rank {s}: {got.problem or 'nothing was sent'}")
            else:
                log.info("rank %d: its local copy of step %d came from rank %d (%d bytes in %.2f s)", me, cand.step,
                         s, got.nbytes, time.perf_counter() - t0)
        self.transfers.append(Transfer(cand.step, out.sent_bytes, sum(g.nbytes for g in out.received.values()),
                                       time.perf_counter() - t0, tuple(problems)))
        return problems, False

    def _open(self, where: str, cand: Complete) -> Optional[Outgoing]:
        """The copy of ``cand`` under the root ``where`` on this rank's disk, to send (None,
        logged, when it cannot be opened: the receiver is told there is nothing)."""
        try:
            storage = Storage(where, None, retry=self.options.store.retry)
            opened = StepDirectories(storage).read_committed(cand.step)
            path, manifest = opened.where, opened.manifest
            if manifest.identity.save_id != cand.save_id:
                raise CheckpointError(f"it holds another save of step {cand.step}")
            return Outgoing(storage, path, manifest)
        except Exception as exc:  # noqa: BLE001 - the receiver is told there is nothing to send
            log.warning("rank %d: the copy of step %d in %s cannot be sent: %s", self.topology.rank, cand.step,
                        where, exc)
            return None

    def _home(self, cand: Complete, announced: int, manifest: Manifest) -> Landing:
        """Where this rank's own copy of ``cand`` goes: its own local tier (raises to refuse;
        ``announced``: the bytes of its files the sender listed in its inventory)."""
        check_copy(manifest, self.topology.rank, self.topology.world_size, self.local.home)
        if manifest.step != cand.step or manifest.identity.save_id != cand.save_id:
            raise CheckpointError(f"expected step {cand.step} of save {cand.save_id}, got step {manifest.step} of "
                                  f"save {manifest.identity.save_id}")
        if foreign_steps(self.local, cand.step):
            raise CheckpointError(f"{self.local.url} holds another job's copy of step {cand.step}")
        return land(self.local, manifest, keeping(self.local.retention, cand.step), announced)

    def _copy_home(self, cand: Complete, mv: Move) -> Optional[str]:
        """This rank's own copy, seen elsewhere on its disk, copied (verified) into its local tier."""
        src = self._open(mv.where, cand)
        if src is None:
            return f"its copy in {mv.where} cannot be read"
        landing: Optional[Landing] = None
        try:
            landing = self._home(cand, mv.nbytes, src.manifest)
            copy_files(src.storage, src.path, src.manifest.files, landing.storage, landing.path,
                       verify=self.options.verify)
            landing.commit(src.manifest)
            return None
        except Exception as exc:  # noqa: BLE001 - reported by every rank
            return f"copying {mv.where}: {type(exc).__name__}: {exc}"
        finally:
            if landing is not None:
                landing.abort()  # nothing once committed
