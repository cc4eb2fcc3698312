"""Peer copies of the local tier (``local_replicas=``): a lost node restores from its peers.

**Who sends what to whom.** The ranks are grouped into nodes (torchrun's ``GROUP_RANK`` when
every rank has it, else the host name), nodes ordered by their lowest rank. The ``i``-th rank
of node ``n`` sends each of its local copies to the ``i``-th rank (modulo that node's size) of
each of the next ``local_replicas - 1`` nodes, a ring over the nodes: every local copy is on
``local_replicas`` nodes, so losing fewer nodes than that loses no rank's copy. The receiving
rank keeps rank ``r``'s copies in ``<its local tier>/held-rank<r>/``
(:func:`~async_ckpt.format.step_names.held_dir_name`), a root of its own committed exactly as
the local tier is (same manifest, same atomic commit), with the local tier's retention.

**When.** After the local copy of a save commits, in the background, on one replication thread
per manager, over a gloo group of the manager's own (:mod:`async_ckpt.ranks.peer_transfer`:
one exchange per save, files read once and verified, CRC-32C checked on arrival). The training
thread only queues a ticket for each save due locally: the ranks agreed on that save, so every
rank queues the same tickets in the same order and the n-th exchange of every rank is the same
save's, whatever each rank's local write did (a rank without a copy sends a header saying so).
A ticket whose save is no longer the newest when its turn comes sends nothing but that header:
replication never builds a backlog, it sends the newest copy when it can. A peer that cannot be
reached (dead, or not taking part within ``collective_timeout_s``) stops replication on this
rank, logged; training, local saves and uploads go on.

**Restore.** :meth:`PeerCopies.fill` runs before the restore chooses a step: one exchange
gathers every rank's inventory (its own copies, the copies it holds for others, and any other
rank's local-tier directory on its disk: a node that comes back as other ranks); the newest save
that every rank can get a copy of (same save id) wins; the ranks that lack their copy of it in
their own local tier get it (their own disk when they see it elsewhere on it, else from a rank
that holds it, balanced by bytes), read once and verified on both ends, committed into their own
local tier; then the restore runs as without peers (each rank loads its own local copy). If a
transfer fails (a damaged held copy), every rank goes on to the next save that every rank can
get; when none is left, the restore reads the bucket. Copies saved at another world size are
never sent (the restore reads the bucket, and says so).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

from ..errors import CheckpointError, InvalidArgumentError, warn_user
from ..format import step_names
from ..format.manifest import Manifest
from ..io.sinks import copy_files
from ..options import PeerOptions
from ..policies import CheckpointInfo, RetentionPolicy, apply_retention, as_retention_policy
from ..ranks import phase
from ..ranks.exchange import Exchange, LocalExchange, checkpoint_group
from ..ranks.peer_transfer import NOTHING_TO_SEND, Landing, Outcome, Outgoing, exchange
from ..ranks.replicas import assign
from ..storage import Storage
from ..storage.step_dirs import StepDirectories
from .local_tier import droppable, free_bytes, make_room, space_needed
from .roots import HELD, Root, foreign_steps, open_root
from .store import PendingCommit
from .write_queue import WriteQueue

log = logging.getLogger("async_ckpt")

#: tickets queued at most (each is a few bytes; stale ones end after one header exchange)
MAX_TICKETS = 64
#: how long the replication thread waits for the local save of a ticket to end
TICKET_WAIT_S = 3600.0
#: the exchange number of the transfers a restore makes (tickets count from 1)
RESTORE_SEQ = 0


# ---- topology ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Topology:
    """Where the ranks are and who holds whose copies.

    Attributes:
        rank: this rank (in the manager's group).
        world_size: the ranks of the manager's group.
        nodes: the ranks of each node, nodes ordered by their lowest rank.
        replicas: nodes that hold each local copy (the owner's included): ``local_replicas``,
            or the number of nodes when there are fewer.
        dests: the ranks this rank sends its local copies to.
        sources: the ranks whose local copies this rank holds.
        group: the gloo group of the replication thread and of restores' transfers.
    """

    rank: int
    world_size: int
    nodes: Tuple[Tuple[int, ...], ...]
    replicas: int
    dests: Tuple[int, ...]
    sources: Tuple[int, ...]
    group: Any


def ring(nodes: Sequence[Sequence[int]], replicas: int) -> Dict[int, List[int]]:
    """Who sends its local copies to whom: the ``i``-th rank of node ``n`` to the ``i``-th rank
    (modulo the node's size) of nodes ``n+1 .. n+replicas-1`` (modulo the number of nodes).

    Args:
        nodes: the ranks of each node, in node order.
        replicas: nodes holding each copy, the owner's included.

    Returns:
        rank -> the ranks it sends to.
    """
    n = len(nodes)
    out: Dict[int, List[int]] = {}
    for ni, node in enumerate(nodes):
        for i, r in enumerate(node):
            dests = []
            for k in range(1, min(replicas, n)):
                other = nodes[(ni + k) % n]
                dests.append(other[i % len(other)])
            out[r] = dests
    return out


def node_of() -> Tuple[Optional[int], str]:
    """This process's node: torchrun's ``GROUP_RANK`` (None when not set) and the host name."""
    raw = os.environ.get("GROUP_RANK")
    try:
        group_rank = int(raw) if raw is not None else None
    except ValueError:
        group_rank = None
    return group_rank, socket.gethostname()


def peer_topology(options: PeerOptions, exchange: Exchange) -> Optional[Topology]:
    """The peers of this rank, and the replication group (collective, on every rank of the
    manager's group, at construction, before anything that may fail on one rank only).

    Args:
        options: the peer copies' options (``local_replicas``, ``process_group``, ``collective_timeout_s``).
        exchange: the manager's exchange.

    Returns:
        The topology; None when ``local_replicas`` is 1, or the ranks are on one node (warned).

    Raises:
        InvalidArgumentError: ``local_replicas`` > 1 in a single process, or the ranks were
            given different ``local_replicas`` (on every rank).
    """
    want = options.local_replicas
    if want <= 1:
        return None
    if exchange.world_size <= 1:
        raise InvalidArgumentError(f"local_replicas={want} keeps copies of each rank's local copy on other nodes: it "
                                   f"needs several ranks (torch.distributed initialised with more than one process); "
                                   f"pass local_replicas=1 in a single process")
    gathered = exchange.gather_objects((want, *node_of()))
    asked = sorted({g[0] for g in gathered})
    if len(asked) > 1:
        raise InvalidArgumentError(f"the ranks were given different local_replicas ({asked}): pass the same value on "
                                   f"every rank")
    by_group = all(g[1] is not None for g in gathered)
    keys = [g[1] if by_group else g[2] for g in gathered]
    members: Dict[Any, List[int]] = {}
    for r, k in enumerate(keys):
        members.setdefault(k, []).append(r)
    nodes = tuple(tuple(m) for m in sorted(members.values(), key=lambda m: m[0]))
    replicas = min(want, len(nodes))
    if replicas <= 1:
        if exchange.is_primary:
            warn_user(f"local_replicas={want}: all {exchange.world_size} ranks are on one node "
                      f"({'GROUP_RANK' if by_group else 'host'} {keys[0]}): no peer copies are kept (a lost node "
                      f"restores from the checkpoint path)")
        return None
    if replicas < want and exchange.is_primary:
        warn_user(f"local_replicas={want}: the ranks are on {len(nodes)} nodes: each local copy is kept on "
                  f"{replicas} nodes")
    group = checkpoint_group(options.process_group, options.collective_timeout_s)
    sends = ring(nodes, replicas)
    rank = exchange.rank
    return Topology(rank, exchange.world_size, nodes, replicas, tuple(sends[rank]),
                    tuple(sorted(r for r, ds in sends.items() if rank in ds)), group)


# ---- restore: who can get which copy -----------------------------------------------------------

@dataclass(frozen=True)
class Seen:
    """A committed local copy a rank can read on its own disk.

    Attributes:
        owner: the rank whose shards it holds.
        step: its step.
        save_id: the save that wrote it (the same on every rank's copy of that save).
        commit_time: its commit time.
        nbytes: the bytes of its files.
        where: the root holding it on the reporting rank's disk.
        own: it is the reporting rank's own copy, in its own local tier.
    """

    owner: int
    step: int
    save_id: str
    commit_time: float
    nbytes: int
    where: str
    own: bool


@dataclass(frozen=True)
class Inventory:
    """What one rank reports before a restore: the copies it sees, the world sizes of copies of
    another world size it saw, and whether its replication group is out of use."""

    copies: Tuple[Seen, ...] = ()
    other_worlds: Tuple[int, ...] = ()
    broken: bool = False


@dataclass(frozen=True)
class Move:
    """One rank's copy brought into its own local tier: read by ``sender`` from ``where`` (on
    the sender's disk; ``sender == owner``: the owner's own disk, copied there)."""

    owner: int
    sender: int
    where: str
    nbytes: int


@dataclass(frozen=True)
class Complete:
    """A save every rank can get its copy of, and the moves that bring each copy home."""

    step: int
    save_id: str
    commit_time: float
    moves: Tuple[Move, ...]


def complete_saves(inventories: Sequence[Sequence[Seen]], world_size: int,
                   step: Optional[int] = None) -> List[Complete]:
    """The saves (step, save id) that every rank can get its copy of, newest commit first, each
    with the moves that bring a copy into the own local tier of each rank that lacks it there.

    A rank that sees its copy on its own disk (another directory of its node's ``local_dir``)
    copies it there; otherwise a rank that holds it sends it, balanced by bytes over the ranks
    that hold copies (:func:`~async_ckpt.ranks.replicas.assign`). Deterministic: every rank
    computes the same answer from the same inventories.

    Args:
        inventories: per rank, the copies it sees.
        world_size: the ranks.
        step: only this step (None: any).

    Returns:
        The complete saves.
    """
    by: Dict[Tuple[int, str], Dict[int, Dict[int, Seen]]] = {}  # save -> owner -> reporter -> copy
    for rep, seen in enumerate(inventories):
        for c in seen:
            if (step is None or c.step == step) and 0 <= c.owner < world_size and c.save_id:
                holders = by.setdefault((c.step, c.save_id), {}).setdefault(c.owner, {})
                if rep not in holders or (c.own and not holders[rep].own):
                    holders[rep] = c
    out: List[Complete] = []
    for (s, sid), owners in by.items():
        if len(owners) != world_size:
            continue
        newest = max(c.commit_time for held in owners.values() for c in held.values())
        moves: List[Move] = []
        shared: List[List[Tuple[str, Tuple[int, ...], int]]] = [[] for _ in range(world_size)]
        away: List[int] = []
        for r in range(world_size):
            held = owners[r]
            if r in held and held[r].own:
                continue  # in its own local tier already
            if r in held:
                moves.append(Move(r, r, held[r].where, held[r].nbytes))
                continue
            away.append(r)
            for rep, c in held.items():
                shared[rep].append((str(r), (), c.nbytes))
        chosen = assign(shared)
        for r in away:
            held = owners[r]
            q = chosen.get((str(r), ()), min(held))
            moves.append(Move(r, q, held[q].where, held[q].nbytes))
        out.append(Complete(s, sid, newest, tuple(sorted(moves, key=lambda m: m.owner))))
    return sorted(out, key=lambda c: (c.commit_time, c.step), reverse=True)


def _missing(invs: Sequence[Inventory], world_size: int, step: Optional[int],
             candidates: Sequence[Complete]) -> Optional[str]:
    """Why the newest local save (of ``step``, when named) is not among ``candidates``: which
    ranks' copies of it no rank sees (None: it is the first candidate, or there is no local save)."""
    seen = [c for i in invs for c in i.copies if step is None or c.step == step]
    if not seen:
        return None
    newest = max(seen, key=lambda c: (c.commit_time, c.step))
    if candidates and candidates[0].save_id == newest.save_id:
        return None
    have = {c.owner for c in seen if c.save_id == newest.save_id}
    return (f"no disk holds the local copies of step {newest.step} of rank(s) "
            f"{[r for r in range(world_size) if r not in have]}")


# ---- the save side: tickets ----------------------------------------------------------------------

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


class _StepLanding:
    """A received copy's :class:`~async_ckpt.ranks.peer_transfer.Landing`: a step being
    written to a root, committed there with ``policy`` (the root's retention, or one that also
    keeps the step)."""

    def __init__(self, write: PendingCommit, policy: RetentionPolicy) -> None:
        assert write.target is not None
        self.write, self.policy = write, policy
        self.storage = write.store.storage
        self.path = write.target.path

    def commit(self, manifest: Manifest) -> None:
        self.write.commit(manifest, self.policy)

    def abort(self) -> None:
        self.write.abort()


def _keeping(policy: RetentionPolicy, step: int) -> RetentionPolicy:
    """``policy``, keeping ``step`` too (a copy a restore brings home is not dropped at once)."""
    return as_retention_policy(lambda cps: apply_retention(policy, cps) | {step})


class PeerCopies:
    """One manager's peer copies: the replication thread, the held copies, the restore's fill.

    Args:
        topology: this rank's peers (:func:`peer_topology`).
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
        self._held: Dict[int, Root] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._newest = 0
        self._broken: Optional[str] = None
        #: the hold on this rank's newest copy every peer took: retention keeps it until a newer one is
        self._replicated: Optional[contextlib.ExitStack] = None
        #: the step of that copy
        self.replicated_step: Optional[int] = None
        #: the last ticket exchanged: (seq, step, its hold, whether this rank sent and received it whole)
        self._pending: Optional[Tuple[int, int, Optional[contextlib.ExitStack], bool]] = None
        #: after :meth:`fill`: which ranks' copies of the newest local save no disk held, or which
        #: transfer failed (None: the newest local save was complete); rank 0 logs it with the step restored
        self.missing: Optional[str] = None

    @property
    def broken(self) -> Optional[str]:
        """Why replication stopped on this rank (a peer that died or did not answer), or None."""
        return self._broken

    # ---- save side (training thread, then the replication thread) -----------------------------
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
        ready = self._broken is None and ticket.wait(TICKET_WAIT_S)
        hold = ticket.handed_over()
        try:
            if self._broken is not None:
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
        bound = max(TICKET_WAIT_S, self.options.collective_timeout_s)
        try:
            work = dist.all_gather(out, mine, group=self.topology.group, async_op=True)
            if work is not None and work.wait(datetime.timedelta(seconds=bound)) is False:
                raise RuntimeError(f"timed out after {bound:g} s")
        except Exception as exc:  # noqa: BLE001 - replication must never fail a save
            if held is not None:
                held.close()
            self._broken = f"{type(exc).__name__}: {exc}"
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
        recvs = {s: functools.partial(self._hold, s) for s in self.topology.sources}
        try:
            # the peers may come to it much later (their local write of the save is still running)
            out = exchange(self.topology.group, ticket.seq, {d: copy for d in self.topology.dests}, recvs,
                           timeout_s=self.options.collective_timeout_s,
                           first_timeout_s=max(TICKET_WAIT_S, self.options.collective_timeout_s),
                           verify=self.options.verify)
        except CheckpointError as exc:
            self._broken = str(exc)
            log.error("rank %d: peer copies stopped at step %d (local saves and the checkpoint path go on; a lost "
                      "node restores from the checkpoint path): %s", self.topology.rank, ticket.step, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - replication must never fail a save
            self._broken = f"{type(exc).__name__}: {exc}"
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

    def _check_copy(self, manifest: Manifest, owner: int) -> None:
        """Refuse a copy that is not ``owner``'s of this job at this world size."""
        ident = manifest.identity
        if (ident.rank, ident.world_size) != (owner, self.topology.world_size):
            raise CheckpointError(f"the copy of step {manifest.step} is rank {ident.rank}'s of "
                                  f"{ident.world_size}, expected rank {owner}'s of {self.topology.world_size}")
        other = ident.saved_for_another(self.local.home)
        if other is not None:
            raise CheckpointError(f"the copy of step {manifest.step} was saved for the checkpoint path {other}, "
                                  f"not {self.local.home}")
        if not ident.save_id:
            raise CheckpointError(f"the copy of step {manifest.step} names no save")

    def _hold(self, owner: int, manifest: Manifest) -> Landing:
        """Replication thread: where ``owner``'s announced copy goes (its held root), after
        making room as a local save does; raises to refuse it."""
        self._check_copy(manifest, owner)
        root = self.held_root(owner)
        step = manifest.step
        if foreign_steps(root, step):
            raise CheckpointError(f"{root.url} holds another job's copy of step {step}")
        return self._landing(root, manifest, root.retention)

    def _landing(self, root: Root, manifest: Manifest, policy: RetentionPolicy,
                 announced: Optional[int] = None) -> Landing:
        """Where a copy announced with ``manifest`` is written under ``root``, after making room
        as a local save does. Refused at once (before anything is deleted or written) when its
        files add up to more than ``announced`` (the bytes its sender listed for it) or than
        the disk can hold (free, with what retention drops to make room)."""
        total = sum(r.size for r in manifest.files.values())
        if announced is not None and total != announced:
            raise CheckpointError(f"the copy of step {manifest.step} lists {total} bytes of files, its sender "
                                  f"announced {announced}: refused")
        root.store.become_writer()
        coming = CheckpointInfo(manifest.step, manifest.commit_time, dict(manifest.metrics), manifest.nbytes,
                                manifest.all_extra())
        need = space_needed(total)
        free = free_bytes(root)
        if free is not None and free < need:
            infos = root.store.catalog.infos()
            room = free + sum(infos[s].nbytes for s in droppable(root, coming) if s in infos)
            if room < need:
                raise CheckpointError(f"the copy of step {manifest.step} needs {need} bytes, {root.url} can hold "
                                      f"{room} (free, and what retention drops to make room): refused")
        make_room(root, coming, need)
        return _StepLanding(root.store.begin_write(manifest.step), policy)

    def held_root(self, owner: int) -> Root:
        """The root of the copies this rank holds for ``owner`` (made at first use).

        Args:
            owner: the rank whose copies it holds.

        Returns:
            The root (``<local tier>/held-rank<owner>``).
        """
        with self._lock:
            root = self._held.get(owner)
            if root is None:
                opts = self.options
                storage = Storage(self.local.store.storage.join(step_names.held_dir_name(owner)), None,
                                  retry=opts.store.retry)
                storage.makedirs(storage.root)
                root = open_root(HELD, storage, opts.store, exchange=LocalExchange(), writer=lambda: self.writer,
                                 retention=opts.local_retention, home=self.local.home)
                self._held[owner] = root
            return root

    def _held_owners(self) -> List[int]:
        """The ranks whose copies this rank's local tier holds a directory for."""
        st = self.local.store.storage
        try:
            names = [e["name"] for e in st.listdir(st.root) if e.get("type") == "directory"]
        except FileNotFoundError:
            return []
        return sorted(r for r in (step_names.rank_of_held_dir(n) for n in names) if r is not None)

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
            pending, self._pending = self._pending, None
            for kept in (self._replicated, pending[2] if pending is not None else None):
                if kept is not None:
                    kept.close()
            self._replicated = None
            self.local.store.apply_retention(self.local.retention)  # what the holds kept beyond it
            for root in list(self._held.values()):
                root.store.close()

    def stop_threads(self) -> None:
        """Finalizer of a manager collected without ``close()``: stop without waiting."""
        self.writer.close(timeout=0)
        for root in list(self._held.values()):
            root.store.deleter.shutdown(wait=False)
            if root.store.lease is not None:
                root.store.lease.release()

    def delete_held(self, step: int) -> None:
        """Delete the copies of ``step`` this rank holds for others (``delete(step)``: every copy).

        Args:
            step: the step.
        """
        self.wait_idle()  # (bounded; a copy still being received commits, or fails, on its own)
        for owner in self._held_owners():
            root = self.held_root(owner)
            if step in root.store.layout.committed_steps() and not foreign_steps(root, step):
                root.store.become_writer()
                root.store.delete(step)

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
        self.missing = _missing(invs, topo.world_size, step, candidates)
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
        """The committed local copies of this job at this world size on this rank's disk: every
        rank's local-tier directory under ``local_dir``, and the copies held in each (``idle``:
        the replication thread is idle, else the group is reported out of use). Never raises."""
        copies: List[Seen] = []
        others: Set[int] = set()
        assert self.options.local_dir is not None
        mine = self.local.store.storage.root.rstrip("/")
        try:
            top = Storage(self.options.local_dir, None, retry=self.options.store.retry)
            roots: List[Tuple[str, int]] = []
            for e in top.listdir(top.root):
                q = step_names.rank_of_dir(e["name"])
                if q is None or e.get("type") != "directory":
                    continue
                path = top.join(step_names.rank_dir_name(q))
                roots.append((path, q))
                held = Storage(path, None, retry=self.options.store.retry)
                for h in held.listdir(held.root):
                    r = step_names.rank_of_held_dir(h["name"])
                    if r is not None and h.get("type") == "directory":
                        roots.append((held.join(step_names.held_dir_name(r)), r))
        except Exception as exc:  # noqa: BLE001 - nothing found here: the others may still have it
            log.warning("rank %d: listing %s for peer copies failed: %s", self.topology.rank, self.options.local_dir,
                        exc)
            return Inventory(broken=self._broken is not None or not idle)
        for path, owner in roots:
            try:
                storage = Storage(path, None, retry=self.options.store.retry)
                layout = StepDirectories(storage)
                for s in layout.committed_steps():
                    try:
                        m = layout.read_manifest(s)
                    except Exception:  # noqa: BLE001 - damaged or vanished: not a copy to count on
                        continue
                    ident = m.identity
                    if ident.rank != owner or ident.saved_for_another(self.local.home) is not None:
                        continue
                    if ident.world_size != self.topology.world_size:
                        others.add(int(ident.world_size or 0))
                        continue
                    copies.append(Seen(owner, s, ident.save_id or "", m.commit_time,
                                       sum(r.size for r in m.files.values()), path,
                                       owner == self.topology.rank and storage.root.rstrip("/") == mine))
            except Exception as exc:  # noqa: BLE001 - that directory counts as empty
                log.warning("rank %d: listing %s for peer copies failed: %s", self.topology.rank, path, exc)
        return Inventory(tuple(copies), tuple(sorted(others)), self._broken is not None or not idle)

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
                self._broken = f"{type(exc).__name__}: {exc}"
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
        self._check_copy(manifest, self.topology.rank)
        if manifest.step != cand.step or manifest.identity.save_id != cand.save_id:
            raise CheckpointError(f"expected step {cand.step} of save {cand.save_id}, got step {manifest.step} of "
                                  f"save {manifest.identity.save_id}")
        if foreign_steps(self.local, cand.step):
            raise CheckpointError(f"{self.local.url} holds another job's copy of step {cand.step}")
        return self._landing(self.local, manifest, _keeping(self.local.retention, cand.step), announced)

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
