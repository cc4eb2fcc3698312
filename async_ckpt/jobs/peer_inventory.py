"""What a restore can get from the peers: every rank's inventory of the copies on its disk
(:func:`inventory`), and the saves every rank can get its copy of (:func:`complete_saves`).

Each rank lists its own copies, the copies it holds for others, and any other rank's local-tier
directory on its disk (a node that comes back as other ranks). The newest save that every rank
can get a copy of (same save id) is the one a restore brings home: the ranks that lack their
copy of it in their own local tier get it from their own disk when they see it elsewhere on it,
else from a rank that holds it, balanced by bytes (:class:`Move`). Copies saved at another world
size are never counted (they are reported, :attr:`Inventory.other_worlds`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ..format import step_names
from ..ranks.replicas import assign
from ..storage import Storage
from ..storage.step_dirs import StepDirectories

log = logging.getLogger("async_ckpt")

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


def why_missing(invs: Sequence[Inventory], world_size: int, step: Optional[int],
                candidates: Sequence[Complete]) -> Optional[str]:
    """Why the newest local save (of ``step``, when named) is not among ``candidates``.

    Args:
        invs: every rank's inventory.
        world_size: the ranks.
        step: the step the restore names (None: any).
        candidates: the complete saves (:func:`complete_saves`).

    Returns:
        Which ranks' copies of it no rank sees (None: it is the first candidate, or there is
        no local save).
    """
    seen = [c for i in invs for c in i.copies if step is None or c.step == step]
    if not seen:
        return None
    newest = max(seen, key=lambda c: (c.commit_time, c.step))
    if candidates and candidates[0].save_id == newest.save_id:
        return None
    have = {c.owner for c in seen if c.save_id == newest.save_id}
    return (f"no disk holds the local copies of step {newest.step} of rank(s) "
            f"{[r for r in range(world_size) if r not in have]}")


def inventory(local_dir: str, own_root: str, home: Optional[str], rank: int, world_size: int, *, retry: Any,
              broken: bool) -> Inventory:
    """The committed local copies of this job at this world size on this rank's disk: every
    rank's local-tier directory under ``local_dir``, and the copies held in each. Never raises.

    Args:
        local_dir: the manager's ``local_dir``.
        own_root: this rank's local tier (its own copies are ``own`` there only).
        home: the checkpoint path the copies must have been saved for (None: not checked).
        rank: this rank.
        world_size: the ranks of the job (copies of another world size are only reported).
        retry: the retry policy of the storages listed.
        broken: report the replication group out of use.

    Returns:
        This rank's inventory.
    """
    copies: List[Seen] = []
    others: Set[int] = set()
    mine = own_root.rstrip("/")
    try:
        top = Storage(local_dir, None, retry=retry)
        roots: List[Tuple[str, int]] = []
        for e in top.listdir(top.root):
            q = step_names.rank_of_dir(e["name"])
            if q is None or e.get("type") != "directory":
                continue
            path = top.join(step_names.rank_dir_name(q))
            roots.append((path, q))
            held = Storage(path, None, retry=retry)
            for h in held.listdir(held.root):
                r = step_names.rank_of_held_dir(h["name"])
                if r is not None and h.get("type") == "directory":
                    roots.append((held.join(step_names.held_dir_name(r)), r))
    except Exception as exc:  # noqa: BLE001 - nothing found here: the others may still have it
        log.warning("rank %d: listing %s for peer copies failed: %s", rank, local_dir, exc)
        return Inventory(broken=broken)
    for path, owner in roots:
        try:
            storage = Storage(path, None, retry=retry)
            layout = StepDirectories(storage)
            for s in layout.committed_steps():
                try:
                    m = layout.read_manifest(s)
                except Exception:  # noqa: BLE001 - damaged or vanished: not a copy to count on
                    continue
                ident = m.identity
                if ident.rank != owner or ident.saved_for_another(home) is not None:
                    continue
                if ident.world_size != world_size:
                    others.add(int(ident.world_size or 0))
                    continue
                copies.append(Seen(owner, s, ident.save_id or "", m.commit_time,
                                   sum(r.size for r in m.files.values()), path,
                                   owner == rank and storage.root.rstrip("/") == mine))
        except Exception as exc:  # noqa: BLE001 - that directory counts as empty
            log.warning("rank %d: listing %s for peer copies failed: %s", rank, path, exc)
    return Inventory(tuple(copies), tuple(sorted(others)), broken)
