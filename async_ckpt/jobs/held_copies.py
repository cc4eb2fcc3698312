"""Where a copy sent by a peer lands: the roots this rank holds other ranks' copies in
(:class:`HeldCopies`: ``<its local tier>/held-rank<r>``,
:func:`~async_ckpt.format.step_names.held_dir_name`), and the landing of any received copy
(:func:`land`), made room for as a local save is and committed as the local tier commits.

A held root is a root of its own committed exactly as the local tier is (same manifest, same
atomic commit), with the local tier's retention. A copy is refused before anything is deleted or
written when it is not its owner's of this job at this world size (:func:`check_copy`), or when
it cannot fit.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional

from ..errors import CheckpointError
from ..format import step_names
from ..format.manifest import Manifest
from ..options import PeerOptions
from ..policies import CheckpointInfo, RetentionPolicy
from ..ranks.exchange import LocalExchange
from ..ranks.peer_transfer import Landing
from ..storage import Storage
from .local_tier import droppable, free_bytes, make_room, space_needed
from .roots import HELD, Root, foreign_steps, open_root
from .store import PendingCommit
from .write_queue import WriteQueue


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


def check_copy(manifest: Manifest, owner: int, world_size: int, home: Optional[str]) -> None:
    """Refuse a copy that is not ``owner``'s of this job at this world size.

    Args:
        manifest: the copy's manifest, as its sender announced it.
        owner: the rank whose copy it must be.
        world_size: the ranks of the job.
        home: the checkpoint path it must have been saved for (None: not checked).

    Raises:
        CheckpointError: it is another rank's, another world size's or another job's copy, or
            names no save.
    """
    ident = manifest.identity
    if (ident.rank, ident.world_size) != (owner, world_size):
        raise CheckpointError(f"the copy of step {manifest.step} is rank {ident.rank}'s of "
                              f"{ident.world_size}, expected rank {owner}'s of {world_size}")
    other = ident.saved_for_another(home)
    if other is not None:
        raise CheckpointError(f"the copy of step {manifest.step} was saved for the checkpoint path {other}, "
                              f"not {home}")
    if not ident.save_id:
        raise CheckpointError(f"the copy of step {manifest.step} names no save")


def land(root: Root, manifest: Manifest, policy: RetentionPolicy, announced: Optional[int] = None) -> Landing:
    """Where a copy announced with ``manifest`` is written under ``root``, after making room
    as a local save does. Refused at once (before anything is deleted or written) when its
    files add up to more than ``announced`` (the bytes its sender listed for it) or than
    the disk can hold (free, with what retention drops to make room).

    Args:
        root: the root it goes to (a held root, or the own local tier).
        manifest: its manifest.
        policy: the retention its commit applies.
        announced: the bytes of its files its sender listed (None: not checked).

    Returns:
        The landing: written there, committed with ``policy`` or aborted.

    Raises:
        CheckpointError: it is refused.
    """
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


class HeldCopies:
    """The roots of the copies this rank holds for its peers (made at first use).

    Args:
        local: the manager's local tier (the held roots are directories inside it).
        options: the peer copies' options (the held copies' store; the local tier's retention).
        writer: the replication thread (the held roots' writer).
        world_size: the ranks of the job.
    """

    def __init__(self, local: Root, options: PeerOptions, writer: WriteQueue, world_size: int) -> None:
        self.local = local
        self.options = options
        self.writer = writer
        self.world_size = world_size
        self._held: Dict[int, Root] = {}
        self._lock = threading.Lock()

    def root(self, owner: int) -> Root:
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

    def owners(self) -> List[int]:
        """The ranks whose copies this rank's local tier holds a directory for."""
        st = self.local.store.storage
        try:
            names = [e["name"] for e in st.listdir(st.root) if e.get("type") == "directory"]
        except FileNotFoundError:
            return []
        return sorted(r for r in (step_names.rank_of_held_dir(n) for n in names) if r is not None)


    def receive(self, owner: int, manifest: Manifest) -> Landing:
        """Replication thread: where ``owner``'s announced copy goes (its held root), after
        making room as a local save does.

        Args:
            owner: the rank whose copy it is.
            manifest: its manifest, as announced.

        Returns:
            The landing in ``owner``'s held root.

        Raises:
            CheckpointError: the copy is refused.
        """
        check_copy(manifest, owner, self.world_size, self.local.home)
        root = self.root(owner)
        step = manifest.step
        if foreign_steps(root, step):
            raise CheckpointError(f"{root.url} holds another job's copy of step {step}")
        return land(root, manifest, root.retention)

    def delete(self, step: int) -> None:
        """Delete the copies of ``step`` this rank holds for others.

        Args:
            step: the step.
        """
        for owner in self.owners():
            root = self.root(owner)
            if step in root.store.layout.committed_steps() and not foreign_steps(root, step):
                root.store.become_writer()
                root.store.delete(step)

    def close(self) -> None:
        """Close the held roots (deletions finish, leases released)."""
        for root in list(self._held.values()):
            root.store.close()

    def stop(self) -> None:
        """Finalizer of a manager collected without ``close()``: stop without waiting."""
        for root in list(self._held.values()):
            root.store.deleter.shutdown(wait=False)
            if root.store.lease is not None:
                root.store.lease.release()
