"""A manager's roots: ``Root`` (one checkpoint root: the persistent root and the local tier
alike) and ``Roots`` (all of them, nearest first), one root being the case N=1.

A root is where steps go (its :class:`~.store.RootStore`: catalog, writer lease, deletions),
the background writer that writes them, the retention that drops them, the save policy that
says when a step is due there, and when this manager last took a save for it. Every root (the
persistent root, the local tier, the copies held for a peer) is made by :func:`open_root` from
its :class:`~async_ckpt.options.StoreOptions`.

:class:`Roots` lists, merges and orders what the roots hold. Listing merges them by commit
time. A save written to both tiers is stamped, in both, with the time it was taken (or just
after the tier's newest commit) and with one save id, so the merged order is the order of the
saves even while the persistent writer lags behind the local one; a step both tiers hold
counts once, at its newest copy's commit (two copies with different save ids are different
saves: a re-save replaces a step, the newest one counts). :meth:`Roots.candidates` orders the
copies a restore tries (:mod:`.restore_job`'s one loop): newest commit first and, of the two
copies of one save, the local one before the persistent one; a copy that is damaged,
unreadable, or written by another rank or world size is skipped with a warning naming the tier
and why. With several ranks each rank has its own local directory; the ranks agree on the
newest step every rank holds locally from one save (same save id), and one rank's unusable copy
sends every rank to the next candidate, so all restore the same step of the same save.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from ..errors import CheckpointError, CorruptCheckpointError, RankFailure, StepNotFoundError, StorageError, warn_user
from ..format.manifest import Manifest, copy_identity
from ..format.step_names import StepNaming
from ..io import Reuse
from ..options import StoreOptions
from ..policies import CheckpointInfo, RetentionPolicy, SavePolicy, apply_retention
from ..ranks import phase
from ..ranks.exchange import Exchange
from ..staging.frozen import version_of
from ..storage import Storage
from ..storage.step_dirs import StepDirectories
from .restore_job import Candidate
from .store import RootStore
from .write_queue import WriteQueue

log = logging.getLogger("async_ckpt")

#: the name of the local tier's root (``local_dir``)
LOCAL = "local"
#: the name of the persistent root (the manager's ``path``)
PERSISTENT = "persistent"
#: the name of a root of copies a rank holds for another rank (``local_replicas=``: peer copies)
HELD = "held"


@dataclass
class Root:
    """One checkpoint root: its steps, its writer, its retention, its save schedule state.

    Attributes:
        name: :data:`PERSISTENT`, :data:`LOCAL` or :data:`HELD`.
        store: the steps under the root (catalog, lease, deletions).
        writer: the background writer of the root's saves (a held root's: the replication thread).
        retention: which committed steps stay (applied after each commit there).
        policy: when a save is due at this root; None: whenever one is due at the persistent
            root (a local tier without a ``local_policy``).
        last_save_time: when this manager last took a save for the root (interval clock).
        last_save_step: the step of that save.
        home: a local tier's persistent root (``root_identity`` of it): a local copy saved
            for another root is another job's. None for the persistent root.
        unshared: a local tier of several ranks: this rank's copies, as (step, save id), of
            saves that not every rank committed (a save that failed on another rank), found
            when the ranks last compared their copies: not listed, so
            every rank lists the same steps (retention still drops them in turn; see
            :func:`common_local_steps`).
    """

    name: str
    store: RootStore
    writer: WriteQueue
    retention: RetentionPolicy
    policy: Optional[SavePolicy] = None
    last_save_time: Optional[float] = None
    last_save_step: Optional[int] = None
    home: Optional[str] = None
    unshared: Set[Tuple[int, str]] = field(default_factory=set)

    @property
    def url(self) -> str:
        """The root's URL (as given, with its protocol)."""
        return self.store.storage.url

    def record_save(self, step: int, now: float) -> None:
        """Remember that a save of ``step`` was taken for this root at ``now`` (interval clock).

        Args:
            step: the step saved.
            now: the interval clock's time of the save.
        """
        self.last_save_time, self.last_save_step = now, step


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


@dataclass
class OwnCopies:
    """The retention of a root with a ``home`` (the local tier, copies held for a peer):
    ``policy`` over this job's copies only; copies another job saved (see :func:`foreign_root`)
    are kept: never this job's to delete."""

    policy: RetentionPolicy
    tier: Root

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Set[int]:
        foreign = {c.step for c in checkpoints if foreign_root(self.tier, c.extra) is not None}
        return apply_retention(self.policy, [c for c in checkpoints if c.step not in foreign]) | foreign


def open_root(name: str, storage: Storage, options: StoreOptions, *, exchange: Exchange,
              writer: Callable[[], WriteQueue], retention: RetentionPolicy, policy: Optional[SavePolicy] = None,
              home: Optional[str] = None, naming: Optional[StepNaming] = None) -> Root:
    """One root over ``storage``, the persistent root, the local tier and a peer's held copies
    alike: its step directories, its store (writer lease, catalog, deletions; what the last step
    holds, for incremental saves), the writer given, its retention and save policy.

    Args:
        name: :data:`PERSISTENT`, :data:`LOCAL` or :data:`HELD`.
        storage: the root's storage (made, and checked where the caller needs, by the caller).
        options: how the root keeps its steps (``commit_mode``, ``incremental``, ...).
        exchange: the exchange of the root's saves (the manager's, or a rank-local one).
        writer: makes the background writer of its saves (called once the store is made: a
            root refused here leaves no thread behind).
        retention: which committed steps stay; with a ``home``, of this job's copies only
            (:class:`OwnCopies`: another job's copies are never this job's to delete).
        policy: when a save is due there (None: whenever one is due at the persistent root).
        home: a local root's persistent root (``root_identity`` of it); None for the persistent root.
        naming: how step directories are named (None: the root's recorded naming, else the default).

    Returns:
        The root.

    Raises:
        InvalidArgumentError: ``commit_mode`` does not fit the storage (``"rename"`` off POSIX).
    """
    store = RootStore(storage, StepDirectories(storage, options.commit_mode, naming), exchange, options.wall_clock,
                      keep_incomplete=options.keep_incomplete, lease_timeout=options.lease_timeout,
                      reuse=Reuse(options.full_every, version_of) if options.incremental else None)
    root = Root(name, store, writer(), retention, policy, home=home)
    if home is not None:
        root.retention = OwnCopies(retention, root)
    return root


@dataclass(frozen=True)
class Held:
    """A committed step and the tiers that hold it (preferred first)."""

    step: int
    commit_time: float
    tiers: Tuple[str, ...]


def _infos(tier: Root, others: int, failed: Optional[List[BaseException]] = None, unshared: bool = False
           ) -> Tuple[Dict[int, CheckpointInfo], List[int]]:
    """(records, steps newest first) of one tier, without another job's local copies (see
    :func:`foreign_root`: skipped with a warning) and, unless ``unshared``, without the copies of
    saves not every rank holds (``tier.unshared``). With other tiers to fall back on, a tier
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
    hidden = set(foreign) | {s for s, info in infos.items() if not unshared and (s, _save_id(info)) in tier.unshared}
    if hidden:
        infos = {s: info for s, info in infos.items() if s not in hidden}
        newest_first = [s for s in newest_first if s not in hidden]
    return infos, newest_first


def _save_id(info: Optional[CheckpointInfo]) -> str:
    """The save id of a copy ("" when its manifest does not read, or it has none)."""
    return "" if info is None else copy_identity(info.extra).save_id or ""


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


@dataclass(frozen=True)
class StepMetadata:
    """What a committed step holds, read without its tensors' bytes (:meth:`CheckpointManager.metadata`).

    Attributes:
        step: the step.
        commit_time: when it was committed (the wall clock's seconds).
        nbytes: the bytes of its files.
        metrics: the metrics saved with it.
        user_metadata: what its save was given as ``metadata=`` (JSON values; empty if none).
        tensors: flattened, dotted key -> ``(shape, dtype name)`` of every tensor (``"float32"``).
        values: flattened keys of its non-tensor values.
    """

    step: int
    commit_time: float
    nbytes: int
    metrics: Dict[str, float]
    user_metadata: Dict[str, Any]
    tensors: Dict[str, Tuple[Tuple[int, ...], str]]
    values: Tuple[str, ...]


def step_metadata(tiers: Sequence[Root], step: int, threads: int = 8) -> StepMetadata:
    """The :class:`StepMetadata` of ``step``'s newest committed copy over ``tiers`` (its
    ``.metadata`` read through the one verified read: that file only).

    Args:
        tiers: the manager's roots.
        step: the step.
        threads: how many reads run at once.

    Returns:
        The step's metadata.

    Raises:
        StepNotFoundError: no tier holds the step.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..format.manifest import USER_METADATA_KEY
    from ..io.dcp_adapters import read_metadata

    found = [(t, t.store.layout.read_committed(step)) for t in tiers if step in t.store.layout.committed_steps()]
    if not found:
        raise StepNotFoundError(f"no committed checkpoint for step {step} under "
                                f"{' or '.join(t.url for t in tiers)}", step=step)
    tier, copy = max(found, key=lambda f: f[1].manifest.commit_time)
    m = copy.manifest
    md = read_metadata(tier.store.storage, copy.where, m.files, threads=threads, whole=m.whole)
    tensors: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    values: List[str] = []
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensors[key] = (tuple(item.size), str(item.properties.dtype).replace("torch.", ""))
        else:
            values.append(key)
    user = m.extra.get(USER_METADATA_KEY)
    return StepMetadata(step, m.commit_time, m.nbytes, dict(m.metrics), dict(user) if isinstance(user, dict) else {},
                        tensors, tuple(values))


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


def own_local_copies(local: Root) -> List[Tuple[int, str]]:
    """This rank's local copies as (step, save id), newest commit first (a copy whose manifest
    does not read counts with no id), those of ``local.unshared`` too."""
    infos, newest_first = _infos(local, 1, unshared=True)
    return [(s, _save_id(infos.get(s) or _reread(local, s))) for s in newest_first]


def _common(gathered: Sequence[Optional[Sequence[Tuple[int, str]]]]) -> Set[int]:
    """The steps every rank's listing holds with one save id."""
    by_rank = [dict(pairs or ()) for pairs in gathered]
    return {s for s, sid in by_rank[0].items() if all(g.get(s) == sid for g in by_rank[1:])}


def common_local_steps(local: Optional[Root], exchange: Exchange, error: Optional[BaseException] = None) -> Set[int]:
    """The local steps every rank holds from one save (collective): each rank's (step, save
    id) pairs are exchanged, and a step whose copies carry different save ids on different
    ranks (a crash or a failed write between the ranks' local commits of a re-save) is left
    out: restoring it would mix two saves' shards. A copy whose manifest does not read counts
    with no id (every rank's such copy: tried, and reported, by the restore).

    Each rank's other copies (a save that failed on another rank, or whose copies another
    rank lost) become ``local.unshared``: not listed, so that every rank lists the same steps.
    The ranks compare as a manager opens its local tier and at each restore (after peers
    brought lost copies home).

    Args:
        local: this rank's local tier (None where opening it failed: ``error``).
        exchange: the manager's exchange.
        error: this rank's failure to open its local tier, reported to every rank.

    Returns:
        The steps.

    Raises:
        CheckpointError: on every rank, when a rank could not open or list its local tier.
    """
    gathered = phase.everyone(exchange, "listing the local copies", None,
                              None if local is None else (lambda: own_local_copies(local)), error=error)
    assert local is not None  # (everyone raised otherwise)
    common = _common(gathered)
    unshared = {(s, sid) for s, sid in gathered[exchange.rank] or () if s not in common}
    if unshared - local.unshared:
        log.info("%s: local copies of step(s) %s are not listed: not every rank holds them (a save that "
                 "failed on another rank, or a lost disk)", local.url, sorted({s for s, _ in unshared - local.unshared}))
    local.unshared = unshared
    return common


def is_foreign_step(store: RootStore, step: Optional[int], listed: Sequence[int]) -> bool:
    """Whether a restore of ``step`` reads another program's directory under ``store``'s root:
    a named step that no root lists (``listed``) whose directory is foreign
    (:meth:`~async_ckpt.storage.step_dirs.StepDirectories.is_foreign`)."""
    return step is not None and step not in listed and store.layout.is_foreign(store.layout.step_dir(step))


def foreign_candidate(store: RootStore, step: int) -> Candidate:
    """The one candidate of a restore of another program's step (plain DCP), read as it is."""
    return Candidate(store, step, f"step {step} ({store.layout.step_dir(step)}, written by another program)",
                     fallback=(), foreign=True)


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
        The candidates for :func:`~async_ckpt.jobs.restore_job.restore`. A named step no root
        holds a committed copy of, whose directory under the persistent root another program
        wrote (plain DCP), is one foreign candidate.

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

    persistent = by_name[PERSISTENT]

    def listing() -> Tuple[List[Held], List[RankFailure], bool]:
        copies = held_copies(tiers, only, failed)
        foreign = is_foreign_step(persistent.store, step, [h.step for h in copies])
        return copies, [phase.failure_of(0, e) for e in failed], foreign

    held, problems, foreign = phase.primary(exchange, "listing the tiers", step, listing)
    if foreign:
        assert step is not None
        return [foreign_candidate(persistent.store, step)]
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




class Roots(Sequence[Root]):
    """A manager's roots, nearest first: the local tier (with ``local_dir``), then the persistent
    root (always last); one root is the case N=1.

    Args:
        persistent: the persistent root.
        local: the local tier, or None.
    """

    def __init__(self, persistent: Root, local: Optional[Root] = None) -> None:
        self.persistent = persistent
        self.local = local
        self._all: List[Root] = [persistent] if local is None else [local, persistent]

    def __getitem__(self, i: Any) -> Any:
        return self._all[i]

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[Root]:
        return iter(self._all)

    def held(self) -> List[Held]:
        """Every committed step, newest commit first, with the roots holding it (:func:`held_steps`)."""
        return held_steps(self._all)

    def steps(self) -> List[int]:
        """Committed steps over every root, ascending."""
        if len(self._all) == 1:
            return self.persistent.store.layout.committed_steps()
        return sorted(h.step for h in self.held())

    def records(self) -> List[CheckpointInfo]:
        """Records of every committed step, oldest commit first (:func:`commit_records`)."""
        return commit_records(self._all)

    def step_metadata(self, step: int, threads: int = 8) -> StepMetadata:
        """:func:`step_metadata` over these roots."""
        return step_metadata(self._all, step, threads)

    def metrics(self, step: int) -> Dict[str, float]:
        """The metrics stored with ``step``'s newest save (:func:`step_metrics`)."""
        return step_metrics(self._all, step)

    def tier_of(self, store: RootStore) -> str:
        """The name of the root that ``store`` is."""
        return next(r.name for r in self._all if r.store is store)

    def candidates(self, exchange: Exchange, step: Optional[int]) -> List[Candidate]:
        """The copies a restore of ``step`` (None: the newest commit) tries, in order (rank 0's
        listing, on every rank).

        One root: its steps newest commit first, after those whose manifest does not read
        (highest first: a restore tries them first and says why it skips them); damage sends a
        restore of ``None`` on to the next older commit, a named step does not fall back.
        A named step only another program's directory holds: :func:`foreign_candidate`.
        Several: :func:`tier_candidates` (a copy that cannot be listed now comes after every
        copy whose time is known, and a storage that fails sends the restore to the other root).

        Args:
            exchange: the manager's exchange.
            step: the step asked for, or None.

        Returns:
            The candidates for :func:`~async_ckpt.jobs.restore_job.restore`.

        Raises:
            StepNotFoundError: no root holds ``step`` (or any step).
            StorageError: a root could not be listed and the others do not hold ``step``.
        """
        if len(self._all) > 1:
            return tier_candidates(self._all, exchange, step)
        store = self.persistent.store

        def listing() -> Tuple[List[int], bool]:
            steps = store.catalog.steps_newest_first()
            return steps, is_foreign_step(store, step, steps)

        steps, foreign = phase.primary(store.exchange, "listing the committed steps", step, listing)
        if foreign:
            assert step is not None
            return [foreign_candidate(store, step)]
        if step is not None:
            if step not in steps:
                listed = sorted(steps)
                raise StepNotFoundError(
                    f"no committed checkpoint for step {step} under {store.storage.url} "
                    f"(committed: {listed if len(listed) <= 20 else listed[-20:]})", step=step)
            return [Candidate(store, step, f"damaged step {step}", fallback=())]
        if not steps:
            raise StepNotFoundError(f"no committed checkpoint under {store.storage.url}")
        return [Candidate(store, s, f"damaged step {s}") for s in steps]
