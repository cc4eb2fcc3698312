"""Checkpoint tiers: a fast local copy (``local_dir``) often, the persistent root less often.

Each tier is a :class:`~async_ckpt.lifecycle.root.Root`: its own step store (catalog, writer
lease, retention), its own background writer and its own save policy. The manager stages a state dict once and hands
the snapshot to the writer of every tier the step is due for, so the two tiers' writes run side
by side and a slow upload never holds up a local save (beyond ``max_pending_async`` per tier).

Listing merges the tiers by commit time. A save written to both tiers is stamped, in both,
with the time it was taken (or just after the tier's newest commit) and with one save id, so
the merged order is the order of the saves even while the persistent writer lags behind the
local one; a step both tiers hold counts once, at its newest copy's commit (two copies with
different save ids are different saves: a re-save replaces a step, the newest one counts).
:func:`tier_candidates` orders the copies a restore tries (``lifecycle.restore``'s one loop):
newest commit first and, of the two copies of one save, the local one before the persistent
one; a copy that is damaged, unreadable, or written by another rank or world size is skipped
with a warning naming the tier and why. With several ranks each rank
has its own local directory; the ranks agree on the newest step every rank holds locally from
one save (same save id), and one rank's unusable copy sends every rank to the next candidate,
so all restore the same step of the same save.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ..dist import phase
from ..dist.exchange import Exchange, rank_local_exchange
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointRootError,
    RankFailure,
    StepNotFoundError,
    StorageError,
    warn_user,
)
from ..format import step_names
from ..format.manifest import CopyIdentity, Manifest, copy_identity
from ..io import Reuse
from ..io.sinks import copy_files
from ..lifecycle.restore import Candidate
from ..lifecycle.root import LOCAL, PERSISTENT, Root
from ..lifecycle.steps import StepStore
from ..options import ManagerOptions
from ..policies import CheckpointInfo, RetentionPolicy, apply_retention, as_retention_policy
from ..save_queue import AsyncWriter
from ..staging.frozen import version_of
from ..stats import SaveStats
from ..storage import Storage
from ..storage.diagnosis import file_in_the_way, not_a_root_message
from ..storage.step_dirs import StepDirectories

log = logging.getLogger("async_ckpt")

#: what makes a restore go on to the next copy (anything else, e.g. a state dict that does not
#: match the checkpoint, is the caller's to fix and is raised at once)
FALLBACK_ERRORS = (CorruptCheckpointError, StorageError, OSError)


def same_save(a: CheckpointInfo, b: CheckpointInfo) -> bool:
    """Whether two copies of one step were written by one save: both carry a save id, the same
    (:meth:`~async_ckpt.format.manifest.CopyIdentity.same_save`).

    Args:
        a: one copy's record. b: the other's.

    Returns:
        True for two copies of one save.
    """
    return copy_identity(a.extra).same_save(copy_identity(b.extra))


class ForeignCopyError(CheckpointError):
    """A local copy that is not this job's or this rank's: saved for another persistent root
    (another job's: never restored, and a save of its step is refused rather than replacing it)
    or by another rank or at another world size (not this rank's shards)."""


def check_roots_differ(persistent: Storage, local: Storage) -> None:
    """Two tiers must not share a root, nor one lie inside the other (each one's retention and
    cleanup would delete the other's steps): ``ValueError``."""
    a, b = persistent.root_identity(), local.root_identity()
    if a.startswith(b) or b.startswith(a):
        raise InvalidArgumentError(f"local_dir ({local.url}) and the checkpoint path ({persistent.url}) must not be the "
                         f"same directory or inside one another")


def foreign_root(tier: Root, extra: Mapping[str, Any]) -> Optional[str]:
    """The persistent root a copy of the local ``tier`` (its record's ``extra``) was saved for,
    when that is not the root this tier belongs to
    (:meth:`~async_ckpt.format.manifest.CopyIdentity.saved_for_another`)."""
    return copy_identity(extra).saved_for_another(tier.home)


def warn_foreign(tier: Root, foreign: Dict[int, str]) -> None:
    """The warning for local copies another job saved (step -> the root it was saved for)."""
    roots = sorted(set(foreign.values()))
    warn_user(f"async_ckpt: skipping the local copies of steps {sorted(foreign)} in {tier.url}: saved for the "
                  f"checkpoint path {' and '.join(roots)}, not {tier.home} (another job's: never restored, "
                  f"replaced or deleted by this one)", RuntimeWarning)


def foreign_steps(tier: Root, step: Optional[int] = None) -> Dict[int, str]:
    """The committed copies of ``tier`` (or only ``step``) that another job saved: step -> the
    persistent root they were saved for (writer side: from the catalog's records)."""
    if tier.home is None:
        return {}
    infos = tier.store.catalog.infos()
    return {s: r for s, info in infos.items() if (step is None or s == step)
            for r in [foreign_root(tier, info.extra)] if r is not None}


def refuse_foreign_save(tier: Root, step: int, snap: Any) -> None:
    """Local writer thread, before a save of ``step`` to ``tier``: when another job's committed
    copy of ``step`` is there (a save would replace it), this job's hold on ``snap`` is
    released and :class:`ForeignCopyError` is raised, naming the step, the local directory and
    both persistent roots: the local save of that step fails, as any failed local save does."""
    foreign = foreign_steps(tier, step)
    if not foreign:
        return
    if snap is not None:
        snap.release()
    raise ForeignCopyError(f"step {step} was not saved to local_dir {tier.url}: it holds another job's copy of "
                           f"step {step}, saved for the checkpoint path {foreign[step]}, not {tier.home} (another "
                           f"job's copy is never replaced; give this job its own local_dir)", step=step)


#: how long making room in a full local tier waits for the deletions retention queued before
DELETIONS_WAIT_S = 60.0

#: the errnos of a full local tier (no space; over a quota)
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says the filesystem is full
    (``ENOSPC``) or the quota is used up (``EDQUOT``)."""
    seen: Set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in OUT_OF_SPACE:
            return True
        e = e.__cause__ or e.__context__
    return False


def space_needed(nbytes: int) -> int:
    """The free bytes a local save of ``nbytes`` tensor bytes is taken to need: the data, plus
    1% and 64 KiB for the metadata, the manifest and the filesystem's block rounding."""
    return nbytes + nbytes // 100 + 64 * 1024


def free_bytes(tier: Root) -> Optional[int]:
    """Free bytes of the filesystem holding a local ``tier``'s directory (None where that is
    not known: a tier that is not a local path, or a filesystem that does not say)."""
    if not tier.store.storage.is_local:
        return None
    try:
        return int(shutil.disk_usage(tier.store.storage.root).free)
    except OSError:
        return None


def droppable(tier: Root, coming: CheckpointInfo) -> List[int]:
    """The committed copies of ``tier`` that its retention drops once the save ``coming`` (its
    record: step, commit time, metrics) commits, oldest commit first: never the newest
    committed copy (the save may still fail), never a step being written, never the step of
    ``coming`` itself, never another job's copy (see :class:`OwnCopies`)."""
    store = tier.store
    ordered = sorted(store.catalog.infos().values(), key=lambda c: (c.commit_time, c.step))
    if not ordered:
        return []
    newest = ordered[-1].step
    at = max(coming.commit_time, ordered[-1].commit_time + 1e-6)  # it commits after every copy there
    after = [c for c in ordered if c.step != coming.step] + [dataclasses.replace(coming, commit_time=at)]
    keep = apply_retention(tier.retention, after) | {newest, coming.step} | store.catalog.in_flight()
    return [c.step for c in ordered if c.step not in keep]


def make_room(tier: Root, coming: CheckpointInfo, need: Optional[int]) -> List[int]:
    """Local writer thread, before the save ``coming`` (its record) to the local ``tier``, or
    after one that found the tier full: when fewer than ``need`` bytes are free (``need``
    None: free space unknown, the tier was found full), wait (at most :data:`DELETIONS_WAIT_S`) for the
    deletions retention queued, then delete now, oldest commit first, the copies retention
    drops anyway once it commits (:func:`droppable`: never the newest committed copy), until
    ``need`` bytes are free. Returns the steps deleted. Never raises: a failure is logged and
    the save goes on (and fails as it would)."""
    step = coming.step
    try:
        if need is not None:
            free = free_bytes(tier)
            if free is None or free >= need:
                return []
        try:  # the deleter runs one job at a time, in order: this one ends after those queued
            tier.store.deleter.submit(lambda: None).result(timeout=DELETIONS_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - shut down, or slower than the bound
            log.warning("making room in local_dir %s: pending deletions did not finish: %s",
                        tier.url, exc)
        dropped: List[int] = []
        for s in droppable(tier, coming):
            if need is not None:
                free = free_bytes(tier)
                if free is None or free >= need:
                    break
            paths = tier.store.catalog.condemn(s)
            if not paths:
                continue
            tier.store.catalog.remove(s, paths)
            dropped.append(s)
            log.warning("local_dir %s is full: deleted step %d before saving step %d (retention "
                        "drops it once step %d commits)", tier.url, s, step, step)
        return dropped
    except Exception as exc:  # noqa: BLE001 - the save goes on and fails as it would
        log.warning("could not make room in local_dir %s for step %d: %s", tier.url, step, exc)
        return []


@dataclass
class OwnCopies:
    """The local tier's retention: ``policy`` over this job's copies only; copies another job
    saved (see :func:`foreign_root`) are kept: never this job's to delete."""

    policy: RetentionPolicy
    tier: Root

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        foreign = {c.step for c in checkpoints if foreign_root(self.tier, c.extra) is not None}
        return apply_retention(self.policy, [c for c in checkpoints if c.step not in foreign]) | foreign


def make_local_tier(options: ManagerOptions, persistent: Storage, exchange: Exchange) -> Root:
    """The local tier of a manager: ``local_dir`` itself with one process, ``<local_dir>/rank<r>``
    with several (each rank writes and reads its own shards there, on no collective).

    Args:
        options: the manager's validated options (``local_dir`` set).
        persistent: the storage of the manager's persistent root.
        exchange: the manager's exchange (its rank names the directory).

    Returns:
        The local tier's root.

    Raises:
        InvalidArgumentError: the two roots are one directory or one lies inside the other
            (checked before anything is created).
        NotACheckpointRootError: ``local_dir`` (or a parent of it) is a file.
        StorageError: ``local_dir`` cannot be created or written.
    """
    assert options.local_dir is not None
    root = options.local_dir
    if exchange.world_size > 1:
        root = f"{root.rstrip('/')}/{step_names.rank_dir_name(exchange.rank)}"
    retry, keep = options.retry, options.local_retention
    storage = Storage(root, None, retry=retry)
    check_roots_differ(persistent, storage)
    try:
        storage.makedirs(storage.root)
        storage.check_writable()
    except (OSError, StorageError) as exc:
        blocker = file_in_the_way(storage)
        if blocker is not None:
            raise NotACheckpointRootError(not_a_root_message("local_dir", storage, blocker)) from exc
        raise StorageError(f"local_dir {storage.url!r} cannot be written: {exc}") from exc
    store = StepStore(storage, StepDirectories(storage, options.commit_mode),
                      rank_local_exchange(options.collective_timeout_s), options.wall_clock,
                      keep_incomplete=options.keep_incomplete, lease_timeout=options.lease_timeout,
                      reuse=Reuse(options.full_every, version_of) if options.incremental else None)
    # a full local_dir is logged and raised by join()/close(): the bucket's saves go on meanwhile
    writer = AsyncWriter(options.max_pending_async, name="async-ckpt-local-writer", defer_if=out_of_space)
    tier = Root(LOCAL, store, writer, keep, options.local_policy, home=persistent.root_identity())
    tier.retention = OwnCopies(keep, tier)
    return tier


@dataclass(frozen=True)
class Held:
    """A committed step and the tiers that hold it (preferred first)."""

    step: int
    commit_time: float
    tiers: Tuple[str, ...]


def _infos(tier: Root, others: int, failed: Optional[List[BaseException]] = None
           ) -> Tuple[Dict[int, CheckpointInfo], List[int]]:
    """(records, steps newest first) of one tier, without another job's local copies (see
    :func:`foreign_root`: skipped with a warning). With other tiers to fall back on, a tier
    that cannot be listed (a bucket that is down) counts as empty, with a warning (and its
    error is added to ``failed``)."""
    try:
        infos = tier.store.catalog.infos()
        newest_first = tier.store.catalog.steps_newest_first()
    except FALLBACK_ERRORS as exc:
        if not others:
            raise
        warn_user(f"async_ckpt: the {tier.name} tier ({tier.url}) cannot be listed, using the other tier: "
                      f"{type(exc).__name__}: {exc}", RuntimeWarning)
        if failed is not None:
            failed.append(exc)
        return {}, []
    foreign = {s: r for s, info in infos.items() for r in [foreign_root(tier, info.extra)] if r is not None}
    if foreign:
        warn_foreign(tier, foreign)
        infos = {s: info for s, info in infos.items() if s not in foreign}
        newest_first = [s for s in newest_first if s not in foreign]
    return infos, newest_first


def _nothing_listed(failed: List[BaseException]) -> None:
    """Nothing was found and a tier could not be listed: what it holds is unknown, so its
    error is raised (an empty answer would read as "no checkpoint" and a job would start over)."""
    if failed:
        raise failed[0]


def _reread(tier: Root, step: int) -> Optional[CheckpointInfo]:
    """The record of a committed ``step`` whose manifest did not read while ``tier`` was listed
    (a transient error, say), read once more; None if it still does not read."""
    try:
        m = tier.store.layout.read_manifest(step)
    except Exception:  # noqa: BLE001 - the listing has warned; the restore reports it
        return None
    return CheckpointInfo(step, m.commit_time, dict(m.metrics), m.nbytes, m.all_extra())


def held_copies(tiers: Sequence[Root], only: Optional[Dict[str, Optional[set]]] = None,
                failed: Optional[List[BaseException]] = None) -> List[Held]:
    """Every committed copy of ``tiers`` (one :class:`Held` per tier and step), newest commit
    first; the two copies of one save (written to both tiers: see :func:`same_save`) count at
    the newer stamp, the local one first. A copy whose manifest did not read while listing is
    read once more; if it still does not read, its time is unknown and it comes after every
    other copy (an intact newer step is not passed over for it; a restore tries it last). Two copies of a step written by different saves (a re-save
    replaces a step) are each ordered by their own commit: the newest save wins.
    ``only``: per tier name, the steps to count (None: all). A tier that cannot be listed is
    skipped with a warning (its error added to ``failed``), unless nothing is found in the
    others: then its error is raised."""
    if failed is None:
        failed = []
    copies: List[Tuple[str, int, Optional[CheckpointInfo]]] = []  # (tier, step, record if it reads)
    for tier in tiers:
        infos, newest_first = _infos(tier, len(tiers) - 1, failed)
        allowed = (only or {}).get(tier.name)
        for s in newest_first:
            info = infos.get(s) or _reread(tier, s)
            if (allowed is None or s in allowed) and (info is None or foreign_root(tier, info.extra) is None):
                copies.append((tier.name, s, info))
    if not copies:
        _nothing_listed(failed)
    newest: Dict[int, CheckpointInfo] = {}
    for _, s, info in copies:
        if info is not None and (s not in newest or info.commit_time > newest[s].commit_time):
            newest[s] = info
    out: List[Held] = []
    for name, s, info in copies:
        if info is None:
            t = float("-inf")  # unknown: after every copy whose time is known
        else:  # a copy of the step's newest save counts at that save's newest stamp
            t = newest[s].commit_time if same_save(info, newest[s]) else info.commit_time
        out.append(Held(s, t, (name,)))
    return sorted(out, key=lambda h: (h.commit_time, h.step, h.tiers[0] == LOCAL), reverse=True)


def held_steps(tiers: Sequence[Root], only: Optional[Dict[str, Optional[set]]] = None) -> List[Held]:
    """Every committed step of ``tiers``, newest commit first: a step at its newest copy's
    commit, with the tiers holding it in the order :func:`held_copies` tries them."""
    merged: Dict[int, Held] = {}
    for h in held_copies(tiers, only):
        old = merged.get(h.step)
        merged[h.step] = h if old is None else dataclasses.replace(old, tiers=old.tiers + h.tiers)
    return list(merged.values())


def commit_records(tiers: Sequence[Root]) -> List[CheckpointInfo]:
    """Records of every committed step over the tiers, oldest commit first (a step both hold:
    its newest copy's record). A tier that cannot be listed: as in :func:`held_copies`."""
    best: Dict[int, CheckpointInfo] = {}
    failed: List[BaseException] = []
    for tier in tiers:
        infos, _ = _infos(tier, len(tiers) - 1, failed)
        for s, info in infos.items():
            if s not in best or info.commit_time > best[s].commit_time:
                best[s] = info
    if not best:
        _nothing_listed(failed)
    return sorted(best.values(), key=lambda c: (c.commit_time, c.step))


def step_metrics(tiers: Sequence[Root], step: int) -> Dict[str, float]:
    """The metrics stored with a committed step (of its newest save, over ``tiers``).

    A tier that cannot be read (a bucket that is down) is skipped with a warning while another
    tier holds the step; when none does, its error is raised (it may hold the step). Another
    job's local copy (see :func:`foreign_root`) is not read.

    Args:
        tiers: the manager's roots.
        step: the step.

    Returns:
        The metrics (name -> value).

    Raises:
        StepNotFoundError: no tier holds this job's copy of the step.
    """
    copies: List[Manifest] = []
    failed: List[BaseException] = []
    foreign: List[str] = []
    for t in tiers:
        try:
            if step in t.store.layout.committed_steps():
                manifest = t.store.layout.read_manifest(step)
                root = manifest.identity.saved_for_another(t.home)
                if root is None:
                    copies.append(manifest)
                else:
                    foreign.append(f"the copy in {t.url} was saved for the checkpoint path {root}")
        except FALLBACK_ERRORS as exc:
            if len(tiers) == 1:
                raise
            warn_user(f"async_ckpt: the {t.name} tier ({t.url}) cannot be read, using the other tier: "
                      f"{type(exc).__name__}: {exc}", RuntimeWarning)
            failed.append(exc)
    if not copies:
        if failed:
            raise failed[0]
        if foreign:
            raise StepNotFoundError(f"no committed checkpoint of this job for step {step} under "
                                    f"{' or '.join(t.url for t in tiers)} ({'; '.join(foreign)}: "
                                    f"another job's)", step=step)
        return dict(tiers[-1].store.layout.read_manifest(step).metrics)  # raises the not-found error
    return dict(max(copies, key=lambda m: m.commit_time).metrics)


def check_local_copy(tier: Root, step: int, rank: int, world_size: int) -> None:
    """Raise :class:`ForeignCopyError` when the local copy of ``step`` was saved for another
    persistent root, holds another rank's shards or was saved at another world size (only
    that job's ranks could use it)."""
    identity = tier.store.layout.read_manifest(step).identity
    r, w = identity.rank or 0, identity.world_size or 1
    root = identity.saved_for_another(tier.home)
    if root is not None:
        raise ForeignCopyError(f"the local copy of step {step} in {tier.url} was saved for the checkpoint path "
                               f"{root}, not {tier.home}", step=step)
    if (r, w) != (rank, world_size):
        raise ForeignCopyError(f"the local copy of step {step} in {tier.url} was saved by rank {r} of {w}, "
                               f"this is rank {rank} of {world_size}", step=step)


def common_local_steps(local: Root, exchange: Exchange) -> Set[int]:
    """The local steps every rank holds from one save (collective): each rank's (step, save
    id) pairs are exchanged, and a step whose copies carry different save ids on different
    ranks (a crash or a failed write between the ranks' local commits of a re-save) is left
    out: restoring it would mix two saves' shards. A copy whose manifest does not read counts
    with no id (every rank's such copy: tried, and reported, by the restore)."""
    infos, newest_first = _infos(local, 1)
    mine = []
    for s in newest_first:
        info = infos.get(s) or _reread(local, s)  # a manifest that does not read: no id
        mine.append((s, "" if info is None else copy_identity(info.extra).save_id or ""))
    gathered = [dict(pairs or ()) for pairs in phase.everyone(exchange, "listing the local copies", None, lambda: mine)]
    return {s for s, sid in gathered[0].items() if all(g.get(s) == sid for g in gathered[1:])}


def tier_candidates(tiers: Sequence[Root], exchange: Exchange, step: Optional[int]) -> List[Candidate]:
    """The copies a restore of ``step`` (None: the newest commit) tries over the tiers, in order:
    newest commit first, of the two copies of one save the local one first. Every rank calls
    it; rank 0 lists (with several ranks, of the steps every rank holds locally from one save:
    :func:`common_local_steps`), and every rank gets its listing.

    Args:
        tiers: the manager's roots.
        exchange: the manager's exchange.
        step: the step asked for, or None.

    Returns:
        The candidates for :func:`~async_ckpt.lifecycle.restore.restore`.

    Raises:
        StepNotFoundError: no tier holds ``step`` (or any step).
        StorageError: a tier could not be listed and the others do not hold ``step``.
    """
    by_name = {t.name: t for t in tiers}
    several = exchange.world_size > 1
    only: Optional[Dict[str, Optional[set]]] = None
    local = by_name.get(LOCAL)
    if several and local is not None:
        only = {LOCAL: common_local_steps(local, exchange), PERSISTENT: None}
    failed: List[BaseException] = []

    def listing() -> Tuple[List[Held], List[RankFailure]]:
        copies = held_copies(tiers, only, failed)
        return copies, [phase.failure_of(0, e) for e in failed]

    held, problems = phase.primary(exchange, "listing the tiers", step, listing)
    if step is not None:
        held = [h for h in held if h.step == step]
        if not held:
            if problems:  # a tier that could not be listed may hold it: its error, not "not found"
                if failed:
                    raise failed[0]
                phase.raise_if_failed(problems[:1], step, "listing a tier")
            urls = " or ".join(t.url for t in tiers)
            raise StepNotFoundError(f"no committed checkpoint for step {step} under {urls}", step=step)
    if not held:
        raise StepNotFoundError("no committed checkpoint under " + " or ".join(t.url for t in tiers))
    out: List[Candidate] = []
    for h in held:
        for name in h.tiers:
            tier = by_name[name]
            own = several and name == LOCAL  # each rank's own directory, on no collective
            out.append(Candidate(
                tier.store, h.step, f"the {name} copy of step {h.step} ({tier.url})",
                fallback=FALLBACK_ERRORS + ((ForeignCopyError, StepNotFoundError) if own else ()),
                check=functools.partial(check_local_copy, tier, h.step, exchange.rank, exchange.world_size) if own else None,
                own_copy=own, copy=f"{name} copy"))
    return out


def promote(local: Root, persistent: Root, step: int, *, verify: bool = True,
            threads: int = 8) -> Tuple[Manifest, List[int]]:
    """Copy the local tier's committed ``step`` to the persistent tier and commit it there,
    with the local copy's commit time (the persistent tier's order stays the order of the
    saves); returns its manifest and the steps the persistent tier's retention then dropped
    (that pass keeps the promoted step, which an explicit request put there; later passes
    treat it as any other step). Every file is checked
    against the local manifest (size, and CRC-32C with ``verify``) before anything is
    committed; a copy another job saved (for another persistent root) or one rank of a
    multi-rank job saved (its shards only) is refused, and so is
    a step the persistent tier already holds (it may be a newer save). The caller holds the
    persistent tier's writer lease."""
    if step not in local.store.layout.committed_steps():
        raise StepNotFoundError(f"no committed local checkpoint for step {step} under {local.url}", step=step)
    opened = local.store.layout.read_committed(step)
    path, manifest = opened.where, opened.manifest
    identity = manifest.identity
    r, w = identity.rank or 0, identity.world_size or 1
    root = identity.saved_for_another(local.home)
    if root is not None:
        raise CheckpointError(f"the local copy of step {step} in {local.url} was saved for the checkpoint path "
                              f"{root}, not {local.home}: another job's step is not promoted", step=step)
    if w != 1:  # <local_dir>/rank<r> of a multi-rank job: that rank's shards only
        raise CheckpointError(f"the local copy of step {step} in {local.url} was saved by rank {r} of {w}: it holds "
                              f"that rank's shards only, not a whole checkpoint (save the step with force=True "
                              f"from the job instead)", step=step)
    if step in persistent.store.layout.committed_steps():  # never replace a (maybe newer) save
        raise CheckpointError(f"step {step} is already committed under {persistent.url}; delete it there first "
                              f"to replace it with the local copy", step=step)
    dst = persistent.store
    write = dst.open_step(step)
    try:
        assert write.target is not None
        target = write.target.path
        dst.storage.makedirs(target)

        # through the one verified read, in blocks: never a whole file in memory
        copy_files(local.store.storage, path, manifest.files, dst.storage, target, verify=verify,
                   threads=max(1, min(threads, 4)))
        # keeps its commit time (the order of the saves) and its files' checksums; every file is
        # written here (a copy: nothing is shared with an earlier step of this root), so a file an
        # incremental local save took loses its ref and count, and keeps only that it may hold
        # records the step does not use
        files = {name: rec if not rec.may_hold_unused else
                 dataclasses.replace(rec, ref=None, carried=None, unused_records=True)
                 for name, rec in manifest.files.items()}
        new = dataclasses.replace(manifest, files=files, identity=CopyIdentity(save_id=identity.save_id))
        policy = persistent.retention
        dropped = write.commit(new, as_retention_policy(lambda cps: apply_retention(policy, cps) | {step}))
        return new, dropped
    finally:
        write.abort()  # nothing once committed


# ---- uploads a busy bucket made save_async skip -----------------------------------------------

#: ``SaveStats.extra`` keys, with a local tier: how far the bucket (``path``) was behind when the
#: save committed: this manager's saves taken since the newest of them committed to ``path``,
#: and the seconds between the two saves (None while ``path`` holds none of them)
UPLOAD_LAG, UPLOAD_LAG_S = "upload_lag", "upload_lag_s"
#: ``SaveStats.extra`` key of a skipped upload that a free upload slot made up for
CAUGHT_UP = "caught_up"


def save_number(sid: Optional[str]) -> Optional[int]:
    """The manager's count of the save that wrote a copy (from its save id), or None."""
    try:
        return int(str(sid).rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return None


@dataclass
class _Skipped:
    step: int
    save: int  # the manager's count of the save
    taken_at: float  # its wall-clock time (the commit time of its copies)
    t0: float  # perf_counter() at the save_async call
    local: "Future[Any]"  # its local save's job


class UploadCatchUp:
    """Skipped uploads, made up for by the next free upload slot (one process, a local tier).

    A ``save_async`` due for the bucket while its uploads are busy saves the step to the local
    tier only (:meth:`skipped`). When the upload running then ends, the bucket's writer thread,
    still in that slot, promotes the newest local copy of the skipped saves (:meth:`run`), and
    again while saves were skipped meanwhile: the bucket is never more than one upload behind.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted: Optional[_Skipped] = None
        self._uploaded: Optional[Tuple[int, float]] = None  # (save, taken at) of the newest save in the bucket
        self._warned = False  # a skip was warned about since the last upload

    def skipped(self, step: int, save: int, taken_at: float, t0: float, local: "Future[Any]") -> bool:
        """Training thread: the save ``save`` of ``step`` (its local job ``local``) skipped the
        bucket. Returns whether it is the first skip since the bucket's last upload (warned
        about; the rest are logged at INFO)."""
        with self._lock:
            self._wanted = _Skipped(step, save, taken_at, t0, local)
            first, self._warned = not self._warned, True
        return first

    def uploaded(self, save: Optional[int], taken_at: Optional[float]) -> None:
        """The bucket's writer committed the save ``save``, taken at ``taken_at``."""
        if save is None or taken_at is None:
            return
        with self._lock:
            if self._uploaded is None or save > self._uploaded[0]:
                self._uploaded = (save, taken_at)
            self._warned = False

    def lag(self, save: Optional[int], taken_at: Optional[float]) -> Dict[str, Any]:
        """The :data:`UPLOAD_LAG` and :data:`UPLOAD_LAG_S` entries of a save's statistics."""
        with self._lock:
            up = self._uploaded
        if save is None:
            return {}
        if up is None:
            return {UPLOAD_LAG: save, UPLOAD_LAG_S: None}
        return {UPLOAD_LAG: max(0, save - up[0]),
                UPLOAD_LAG_S: None if taken_at is None else max(0.0, taken_at - up[1])}

    def run(self, local: Root, persistent: Root, *, verify: bool, threads: int,
            committed: Callable[[SaveStats], None], failed: Callable[[int, BaseException], None]) -> None:
        """The bucket's writer thread, at the end of an upload: promote the newest skipped
        save's local copy, and again while saves were skipped meanwhile (the caller holds the
        bucket's lease and its upload slot). ``committed`` gets each promotion's statistics,
        ``failed`` each failure (a failed upload of that step)."""
        while True:
            with self._lock:
                want, self._wanted = self._wanted, None
                up = self._uploaded
            if want is None:
                return
            if up is not None and want.save <= up[0]:
                continue  # the bucket holds a newer save already
            try:
                want.local.result()  # its local copy committed (a local write, bounded as every one)
            except BaseException as exc:  # noqa: BLE001 - that local save's failure is raised on its own
                log.info("not uploading step %d from local_dir %s: its local save failed (%s)", want.step, local.url,
                         exc)
                continue
            t = time.perf_counter()
            try:
                with local.store.catalog.hold(want.step):  # the local tier's retention keeps it meanwhile
                    if want.step in persistent.store.layout.committed_steps():
                        continue  # saved there since (a forced save)
                    manifest, dropped = promote(local, persistent, want.step, verify=verify, threads=threads)
            except StepNotFoundError:
                log.info("not uploading step %d: local_dir %s no longer holds it", want.step, local.url)
                continue
            except Exception as exc:  # noqa: BLE001 - a failed upload, raised by join()/close()
                failed(want.step, exc)
                continue
            if dropped:
                log.info("the retention of %s dropped steps %s", persistent.url, dropped)
            self.uploaded(want.save, want.taken_at)
            done = time.perf_counter()
            stats = SaveStats(step=want.step, nbytes=manifest.nbytes, num_tensors=manifest.num_tensors,
                              files=len(manifest.files), written_bytes=sum(r.size for r in manifest.files.values()),
                              write_s=done - t, durable_s=done - want.t0, commit_time=manifest.commit_time,
                              extra={"tier": PERSISTENT, CAUGHT_UP: True, **self.lag(want.save, want.taken_at)})
            log.info("uploaded step %d from local_dir %s (its upload had been skipped)", want.step, local.url)
            committed(stats)
