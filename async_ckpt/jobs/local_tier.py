"""The local tier (``local_dir``): a fast local copy often, the persistent root less often.

The local tier is a :class:`~.roots.Root` of its own (its step store, writer, retention and
save policy): the manager stages a state dict once and hands the snapshot to the writer of
every root the step is due for, so the two roots' writes run side by side and a slow upload
never holds up a local save (beyond ``max_pending_async`` per root). Here: making it
(:func:`make_local_tier`), refusing to replace another job's copy, and making room on a full
local disk.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import shutil
from typing import Any, List, Optional, Set

from ..errors import (
    InvalidArgumentError,
    NotACheckpointRootError,
    StorageError,
)
from ..format import step_names
from ..options import LocalTierOptions
from ..policies import CheckpointInfo, apply_retention
from ..ranks.exchange import Exchange, rank_local_exchange
from ..storage import Storage
from ..storage.diagnosis import file_in_the_way, not_a_root_message
from .roots import LOCAL, ForeignCopyError, Root, foreign_steps, open_root
from .write_queue import WriteQueue

log = logging.getLogger("async_ckpt")


def check_roots_differ(persistent: Storage, local: Storage) -> None:
    """Two tiers must not share a root, nor one lie inside the other (each one's retention and
    cleanup would delete the other's steps): ``ValueError``."""
    a, b = persistent.root_identity(), local.root_identity()
    if a.startswith(b) or b.startswith(a):
        raise InvalidArgumentError(f"local_dir ({local.url}) and the checkpoint path ({persistent.url}) must not be the "
                         f"same directory or inside one another")


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
    ``coming`` itself, never another job's copy (see :class:`~.roots.OwnCopies`)."""
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


def make_local_tier(options: LocalTierOptions, persistent: Storage, exchange: Exchange) -> Root:
    """The local tier of a manager: ``local_dir`` itself with one process, ``<local_dir>/rank<r>``
    with several (each rank writes and reads its own shards there, on no collective).

    Args:
        options: the local tier's options (``local_dir``, ``local_policy``, ``local_retention``,
            ``max_pending_async``, its store's).
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
    root = options.local_dir
    if exchange.world_size > 1:
        root = f"{root.rstrip('/')}/{step_names.rank_dir_name(exchange.rank)}"
    storage = Storage(root, None, retry=options.store.retry)
    check_roots_differ(persistent, storage)
    try:
        storage.makedirs(storage.root)
        storage.check_writable()
    except (OSError, StorageError) as exc:
        blocker = file_in_the_way(storage)
        if blocker is not None:
            raise NotACheckpointRootError(not_a_root_message("local_dir", storage, blocker)) from exc
        raise StorageError(f"local_dir {storage.url!r} cannot be written: {exc}") from exc
    return open_root(LOCAL, storage, options.store, exchange=rank_local_exchange(options.collective_timeout_s),
                     # a full local_dir is logged and raised by join()/close(): the bucket's saves go on meanwhile
                     writer=lambda: WriteQueue(options.max_pending_async, name="async-ckpt-local-writer",
                                               defer_if=out_of_space),
                     retention=options.local_retention, policy=options.local_policy, home=persistent.root_identity())
