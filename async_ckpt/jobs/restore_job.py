"""Restore: choose the step (commit order) -> check -> read into the targets -> fall back.

The same phases for one process and N: each attempt checks the manifest, the DCP metadata and
the target, then loads; after each phase the ranks exchange outcomes through the coordinator,
so a failure on one rank is seen by all and they all skip a damaged step or all raise. With
``step=None`` a damaged step falls back to the next older commit, with a warning naming it,
and that step's data overwrites everything again; keys of the target it lacks (``strict=False``)
but the damaged step's failed attempt wrote are named in a warning, and an error raised after
such an attempt says that the target was partly written (its cause: that attempt's error).

One process reads the files straight into the target tensors and verifies the checksums as
the data arrives (see :mod:`async_ckpt.io.read_targets`): a step found damaged then has
already written part of its data into the target, and the error says so. ``atomic=True``
reads and verifies every file into host memory first, so a failed restore leaves the target
as it was. Several processes load through DCP: every rank reads and verifies its part, and no
rank writes unless every rank's part passed (atomic or not).

Top-level values with ``state_dict()`` / ``load_state_dict()`` (DCP's ``Stateful``: an app
state holding a model and an optimizer) are restored as ``dcp.load`` restores them: into what
their ``state_dict()`` returns, then handed to their ``load_state_dict``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Type

import torch

from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    PartlyWrittenError,
    StateDictMismatchError,
    StepNotFoundError,
    StorageError,
    partly_written_error,
    warn_user,
)
from ..format.dcp_layout import is_stateful, remove_created, set_element
from ..format.manifest import FileRecord
from ..gc_pause import gc_paused
from ..io import step_io
from ..io.dcp_adapters import read_metadata
from ..io.read_targets import PARTLY_WRITTEN, partly_written
from ..options import RestoreOptions
from ..ranks import phase
from ..ranks.exchange import Exchange
from ..ranks.replicas import read_assignment, restore_items, send_replicas
from ..storage.step_dirs import DELETED, StepCopy
from ..storage.storage import Storage
from .store import RootStore

log = logging.getLogger("async_ckpt")

#: How many keys a mismatch report names.
SHOWN_KEYS = 10



def _share_of_this_job(manifest: Any) -> bool:
    """Whether ``manifest`` is one rank's share of a save (a local tier's copy whose chunks
    need not cover each tensor) of a job of this process group's size. Elsewhere a copy must
    hold every element: a share can be restored only by its own job's rank (the local tier
    refuses other ranks' and world sizes' copies as foreign), so a single process never
    accepts chunks that leave a tensor partly unwritten."""
    import torch.distributed as dist

    return (not manifest.whole and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() == manifest.identity.world_size)



@dataclass(frozen=True)
class Candidate:
    """One committed copy of a step that a restore may load.

    Attributes:
        store: the root holding the copy.
        step: the step.
        label: how a warning names the copy when it is skipped ("damaged step 5", "the local
            copy of step 5 (URL)").
        fallback: the errors that send the restore on to the next candidate (others are raised
            at once: a state dict that does not match the checkpoint is the caller's to fix).
        check: this rank's check before loading the copy (raises one of ``fallback``).
        own_copy: every rank loads its own copy (a local tier's ``rank<r>`` directory) through
            a store of its own: the ranks exchange whether every copy loaded, and one rank's
            unusable copy sends every rank on to the next candidate.
        copy: which copy of the step it is, for messages ("local copy"; empty with one root).
        foreign: the step's directory was written by another program (plain DCP: no marker, no
            manifest); it is read through the same reader, its sizes checked against DCP's
            ``.metadata`` (there are no checksums to compare).
    """

    store: RootStore
    step: int
    label: str
    fallback: Tuple[Type[BaseException], ...] = (CorruptCheckpointError,)
    check: Optional[Callable[[], None]] = None
    own_copy: bool = False
    copy: str = ""
    foreign: bool = False


def mark_written(state_dict: Any) -> None:
    """Move the version counter of every tensor of a restore target, as an in-place write by
    the user would: restores write through raw pointers, views and DCP's copies, which do not
    always move it, and a save must never take a restored tensor for an unchanged one
    (``frozen=``, see :mod:`async_ckpt.staging.frozen`)."""
    from torch.autograd.graph import increment_version

    found: List[torch.Tensor] = []

    def walk(v: Any) -> None:
        if type(v) is torch.Tensor:
            found.append(v)
        elif isinstance(v, torch.Tensor):
            found.append(v.to_local() if hasattr(v, "to_local") else v)
        elif isinstance(v, Mapping):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(state_dict)
    try:
        increment_version(found)  # one call: a C++ loop
    except RuntimeError:  # an inference tensor has no version counter: one by one, skipping those
        for t in found:
            try:
                increment_version(t)
            except RuntimeError:
                pass


def restore(listing: Callable[[], Sequence[Candidate]], state_dict: Dict[str, Any], *, exchange: Exchange,
            step: Optional[int], opts: RestoreOptions) -> Tuple[Candidate, bool]:
    """Every rank: load the first intact candidate into ``state_dict`` in place.

    A copy that a live writer moved, replaced or deleted while it was read is not damage: the
    restore lists the candidates again and goes on with the newest (``step=None``), or reads
    the named step where it is now (:class:`StepNotFoundError` once it is deleted), without a
    warning.

    Args:
        listing: lists the copies to try, in order (:meth:`~.roots.Roots.candidates`); the same
            list on every rank. Called collectively once, and again after a writer changed a
            copy being read.
        state_dict: the target.
        exchange: the manager's exchange.
        step: the step asked for (None: the newest commit), for the error messages.
        opts: how it reads (``key_map``: see :func:`check_key_map`; ``replicated_reads``: see
            :func:`_load`).

    Returns:
        The candidate that was restored, and whether a damaged copy was skipped before it.

    Raises:
        StepNotFoundError: nothing (or not ``step``) is committed, or a writer deleted ``step``
            while it was read.
        CorruptCheckpointError: no candidate could be restored (a :class:`PartlyWrittenError`
            too when a failed attempt had written into the target).
        PartlyWrittenError: another error after a failed attempt had written into the target.
        CheckpointError: a failure that is not the copy's fault (raised at once), or a writer
            moved or deleted the steps chosen :data:`MAX_RETRIES` times in a row.
    """
    stateful = {k: v for k, v in state_dict.items() if is_stateful(v)}
    target: Dict[str, Any] = state_dict
    if stateful:  # what dcp.load does: restore into their state_dict(), then load_state_dict
        def targets() -> Dict[str, Any]:  # user code: every rank learns of its failure on one rank
            return {**state_dict, **{k: v.state_dict() for k, v in stateful.items()}}

        target = phase.own(exchange, "state_dict() of the Stateful restore targets", step, targets)
    view, back = (target, None) if not opts.key_map and opts.selects_all() else \
        _remapped(target, opts.key_map or {}, opts.selects)
    try:
        done, skipped = _first_intact(listing, view, exchange, step, opts,
                                      frozenset(stateful) if back is None else frozenset())
    except PartlyWrittenError:
        mark_written(target)
        raise
    mark_written(target)
    if back is not None:
        back()

    def load_stateful() -> None:
        for k, v in target.items():
            if k not in stateful:
                state_dict[k] = v
        for k, v in stateful.items():
            v.load_state_dict(target[k])

    local = phase.attempt(exchange, load_stateful)[0] if stateful else None
    # a rank whose load_state_dict() raised: every rank raises, naming it
    phase.everyone(exchange, "load_state_dict() of the restored Stateful values", done.step, error=local)
    return done, skipped


def as_skipped(problem: str) -> str:
    """The error text of a damaged step that a fallback skips: its "partly written, must not
    be used" sense is replaced (the older step that is restored next overwrites that data).

    Args:
        problem: the skipped attempt's error text.

    Returns:
        The text to put in the warning.
    """
    if PARTLY_WRITTEN in problem:
        problem = problem.replace(f"; {PARTLY_WRITTEN}", "").replace(PARTLY_WRITTEN, "")
        problem += " (it had partly written the target; the step restored instead overwrites that)"
    return problem


def check_key_map(key_map: Any) -> Optional[Dict[str, str]]:
    """Validate ``restore(..., key_map=)``: a mapping of a checkpoint key prefix to the prefix
    that replaces it in the target's keys (flattened, dotted keys as ``async-ckpt show`` prints
    them). ``{"module.": ""}`` loads a DDP checkpoint (``module.w``) into a plain model (``w``),
    ``{"": "_orig_mod."}`` a plain one into a ``torch.compile``'d model; the longest matching
    target prefix wins.

    Args:
        key_map: the mapping, or None.

    Returns:
        The mapping as a dict (None for None or an empty mapping).

    Raises:
        InvalidArgumentError: not a mapping of str to str, or two checkpoint prefixes mapped to
            the same target prefix.
    """
    if key_map is None:
        return None
    if not isinstance(key_map, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in key_map.items()):
        raise InvalidArgumentError(f"key_map must map checkpoint key prefixes (str) to target key prefixes (str), "
                                   f"e.g. {{'module.': ''}}; got {key_map!r}")
    targets = list(key_map.values())
    dup = sorted({t for t in targets if targets.count(t) > 1})
    if dup:
        raise InvalidArgumentError(f"key_map maps several checkpoint prefixes to the target prefix {dup[0]!r}: "
                                   "which one a target key comes from would be ambiguous")
    return dict(key_map) or None


def check_key_list(name: str, keys: Any) -> Optional[Tuple[str, ...]]:
    """Validate ``restore(..., keys=)`` / ``exclude=``: flattened, dotted checkpoint keys (as
    ``async-ckpt show`` prints them), each selecting itself and what lies under it.

    Args:
        name: the argument's name, for the message.
        keys: a sequence of str, or None.

    Returns:
        The keys as a tuple (None for None).

    Raises:
        InvalidArgumentError: a single str, or not a sequence of non-empty str.
    """
    if keys is None:
        return None
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple, set, frozenset)) or \
            not all(isinstance(k, str) and k for k in keys):
        raise InvalidArgumentError(f"{name} must be a list of checkpoint keys (flattened, dotted, e.g. "
                                   f"['model'] or ['optim.state']), got {keys!r}")
    return tuple(keys)


def _remapped(target: Dict[str, Any], key_map: Mapping[str, str],
              selects: Callable[[str], bool] = lambda key: True) -> Tuple[Dict[str, Any], Callable[[], None]]:
    """A flat view of ``target`` keyed by the checkpoint's keys (``key_map`` applied backwards
    to each flattened key of ``target``), holding only the keys ``selects`` (``keys=`` /
    ``exclude=``), and a function that puts the values a restore assigned in the view
    (non-tensor values; tensors are written in place) back into ``target``."""
    from ..format.dcp_layout import flatten

    flat, paths = flatten(target)
    rules = sorted(((dst, src) for src, dst in key_map.items()), key=lambda r: len(r[0]), reverse=True)
    view: Dict[str, Any] = {}
    origin: Dict[str, str] = {}
    for k, v in flat.items():
        ck = next((src + k[len(dst):] for dst, src in rules if k.startswith(dst)), k)
        if not selects(ck):
            continue
        if ck in view:
            raise InvalidArgumentError(f"key_map={dict(key_map)!r} maps the keys {origin[ck]!r} and {k!r} of "
                                       f"state_dict to the same checkpoint key {ck!r}")
        view[ck], origin[ck] = v, k

    def back() -> None:
        for ck, k in origin.items():
            if view[ck] is not flat[k]:
                set_element(target, paths[k], view[ck])
    return view, back


#: errors a writer's move or deletion of the copy being read can cause (a file missing, or of
#: another save): after one, the restore asks the layout whether the copy changed
#: (:meth:`~async_ckpt.storage.step_dirs.StepDirectories.copy_changed`); a storage that fails
#: (``StorageError``: down, refusing, timing out) is not asked again
_MAYBE_MOVED = (CorruptCheckpointError, PartlyWrittenError, StepNotFoundError, FileNotFoundError)
#: times one restore starts again because a writer moved, replaced or deleted the copy it read
MAX_RETRIES = 10


def _writer_changed(c: Candidate, opened: List[StepCopy], exchange: Exchange) -> Optional[str]:
    """Every rank, after a failed attempt of ``c``: whether a writer moved, replaced or deleted
    the copy this rank opened (or, where it opened none, the step), by any rank's look; None:
    no rank saw a change (the failure stands). A look that fails counts as no change."""
    if c.foreign:  # no writer of ours moves or deletes another program's directory: its failure stands
        return None

    def look() -> Optional[str]:
        return c.store.layout.copy_changed(c.step, opened[0] if opened else None)

    try:
        found = [a for a in phase.everyone(exchange, f"checking step {c.step} again", c.step, look) if a]
    except Exception as exc:  # noqa: BLE001 - the storage cannot tell: the attempt's failure stands
        log.debug("could not check whether step %d changed: %s", c.step, exc)
        return None
    if not found:
        return None
    return DELETED if DELETED in found else found[0]


def _first_intact(listing: Callable[[], Sequence[Candidate]], state_dict: Dict[str, Any], exchange: Exchange,
                  step: Optional[int], opts: RestoreOptions, stateful: frozenset) -> Tuple[Candidate, bool]:
    """The one "first intact candidate" loop: try each candidate in turn; one that fails with
    one of its ``fallback`` errors is skipped with a warning (its data, where it wrote some, is
    overwritten by the next attempt); the first that loads is returned, with whether a copy was
    skipped. A failure of a copy that a writer moved, replaced or deleted meanwhile is no
    damage: the named step is read again where it is now (:class:`StepNotFoundError` once it
    is deleted); for ``step=None`` the candidates are listed again, and the newest that exists
    is tried next."""
    errors: List[BaseException] = []
    failed: List[Candidate] = []  # the candidate of each error
    written: Dict[str, int] = {}  # key -> the step whose failed attempt last (partly) wrote it
    first: Optional[PartlyWrittenError] = None  # the first such attempt's error
    copies: Dict[int, str] = {}  # damaged step -> which copy of it wrote
    moved: Set[int] = set()  # steps whose failed attempt read a copy a writer changed meanwhile
    damaged: Set[Tuple[int, int]] = set()  # (id of its store, step) of each damaged copy
    retries = 0
    queue = list(listing())
    i = 0
    while i < len(queue):
        c = queue[i]
        covered: Set[str] = set()
        opened: List[StepCopy] = []
        try:
            _attempt(c, state_dict, exchange, covered, opts, stateful, opened)
        except Exception as exc:
            maybe = isinstance(exc, _MAYBE_MOVED) and not isinstance(exc, StorageError)
            why = _writer_changed(c, opened, exchange) if maybe else None
            if why is not None:  # a live writer's doing: not damage, never warned about
                log.info("step %d %s while it was read; %s", c.step, why,
                         "reading it again" if step is not None and why != DELETED else "listing the steps again")
                if isinstance(exc, PartlyWrittenError):
                    written.update(dict.fromkeys(covered, c.step))
                    moved.add(c.step)
                    first = first or exc
                retries += 1
                problem: Optional[CheckpointError] = None
                if step is not None and why == DELETED:
                    problem = StepNotFoundError(f"step {step} {why} under {c.store.storage.url} while it was being "
                                                f"restored (a live writer's retention or delete())", step=step)
                elif retries > MAX_RETRIES:
                    problem = CheckpointError(
                        f"the steps under {c.store.storage.url} were moved, saved again or deleted by a live writer "
                        f"{retries} times while this restore read them (last: step {c.step} {why}): its retention "
                        "drops steps faster than they can be read here; keep more steps (max_to_keep) or save less "
                        "often", step=c.step)
                if problem is not None:
                    if first is None:
                        raise problem from exc
                    raise _after_partial_write(problem, written, first, moved) from exc
                if step is None:  # the newest copy that exists now (the damaged ones excepted)
                    try:
                        queue, i = [x for x in listing() if (id(x.store), x.step) not in damaged], 0
                    except CheckpointError as gone:  # nothing committed any more, say
                        if first is None:
                            raise
                        raise _after_partial_write(gone, written, first, moved) from gone
                continue  # a named step: its copy where it is now
            if not isinstance(exc, c.fallback):
                if first is None:
                    raise
                if isinstance(exc, PartlyWrittenError):  # this attempt wrote into the target too
                    written.update(dict.fromkeys(covered, c.step))
                raise _after_partial_write(exc, written, first, moved) from exc
            # over two roots, what failed (damage, a storage error), as the text says it: the
            # partly-written sense is replaced (as_skipped), so is its class
            kind = next(k for k in type(exc).__mro__ if not issubclass(k, PartlyWrittenError)).__name__
            kind = f"{kind}: " if c.copy else ""
            warn_user(f"skipping {c.label}: {kind}{as_skipped(str(exc))}", RuntimeWarning)
            errors.append(exc)
            failed.append(c)
            damaged.add((id(c.store), c.step))
            if isinstance(exc, PartlyWrittenError):
                written.update(dict.fromkeys(covered, c.step))
                moved.discard(c.step)
                copies[c.step] = c.copy
                first = first or exc
            i += 1
            continue
        _warn_left_over(written, covered, c.step, copies, moved)
        return c, bool(failed)
    where = " or ".join(dict.fromkeys(c.store.storage.url for c in queue))
    what = "no committed step" if step is None else f"no copy of step {step}"
    if not errors:  # every copy listed again was found damaged before: as they were
        raise StepNotFoundError(f"{what} under {where}", step=step)
    # over two roots each other copy's problem too (another file, another root): not only the first
    others = "".join(f"; {f.label}: {str(e).replace(f'; {PARTLY_WRITTEN}', '')}"
                     for f, e in list(zip(failed, errors))[1:5] if f.copy)
    final = CorruptCheckpointError(f"{what} under {where} passed verification; newest error: {errors[0]}{others}",
                                   step=failed[0].step)
    final.__cause__ = errors[0]
    if first is None:
        raise final
    raise _after_partial_write(final, written, first, moved) from final


def _attempt(c: Candidate, state_dict: Dict[str, Any], exchange: Exchange, covered: Set[str],
             opts: RestoreOptions, stateful: frozenset, opened: List[StepCopy]) -> None:
    """Load one candidate (its check first). Own copies: every rank learns whether every
    rank's copy loaded; a rank whose copy failed raises its error, the others a
    :class:`CorruptCheckpointError` naming it (both send every rank on to the next candidate)."""
    if not c.own_copy or exchange.world_size == 1:
        if c.check is not None:
            c.check()
        _restore_one(c.store, c.step, state_dict, opts, stateful, covered=covered, opened=opened, foreign=c.foreign)
        return
    mine: Optional[BaseException] = None

    def load() -> Optional[str]:
        nonlocal mine
        try:
            if c.check is not None:
                c.check()
            _restore_one(c.store, c.step, state_dict, opts, stateful, covered=covered, opened=opened)
        except c.fallback as exc:
            mine = exc
            return f"rank {exchange.rank}: {type(exc).__name__}: {exc}"
        return None

    # the phase's name is the same on every rank (a label naming a rank's own directory is not)
    what = f"restore of the {c.copy} of step {c.step}" if c.own_copy else f"restore of {c.label}"
    unusable = [u for u in phase.everyone(exchange, what, c.step, load) if u]
    if mine is not None:
        raise mine
    if unusable:
        raise CorruptCheckpointError(f"step {c.step}: " + "; ".join(unusable), step=c.step)


def _after_partial_write(exc: Exception, written: Dict[str, int], first: PartlyWrittenError,
                         moved: AbstractSet[int] = frozenset()) -> PartlyWrittenError:
    """The error to raise for ``exc``, raised after an earlier attempt partly wrote the target
    (``first``: that attempt's error): a :class:`PartlyWrittenError` whose cause is ``exc``, whose
    message names the damaged step(s) (and those ``moved``: read while a writer changed them)
    and whose ``keys_left`` are the keys written by them."""
    damaged = sorted(set(written.values()) | set(first.damaged_steps) | set(getattr(exc, "damaged_steps", ())),
                     reverse=True) or ([first.step] if first.step is not None else [])
    if isinstance(exc, PartlyWrittenError):  # its message says so already: name the earlier step(s) only
        earlier = [d for d in damaged if d != exc.step]
        text = f"so was it by the earlier attempt of {_steps_named(earlier, moved)}"
    else:
        text = (f"the target state dict was partly written with the data of {_steps_named(damaged, moved)} by an "
                "earlier attempt and must not be used as is; restore(..., atomic=True) leaves it untouched on failure")
    what = str(exc) if isinstance(exc, CheckpointError) else f"restore failed ({type(exc).__name__}: {exc})"
    return partly_written_error(f"{what}; {text}", step=exc.step if isinstance(exc, CheckpointError) else None,
                                cause=exc, damaged_steps=damaged, keys_left=sorted(written))


def _steps_named(steps: Sequence[int], moved: AbstractSet[int]) -> str:
    """``"damaged step 5, 4"``, and the steps a writer changed while they were read as such."""
    bad = [s for s in steps if s not in moved]
    raced = [s for s in steps if s in moved]
    parts = [f"damaged step {', '.join(map(str, bad))}"] if bad else []
    if raced:
        parts.append(f"step {', '.join(map(str, raced))} (a live writer moved or deleted it while it was read)")
    return " and ".join(parts)


def _warn_left_over(written: Dict[str, int], covered: Set[str], step: int, copies: Dict[int, str],
                    moved: AbstractSet[int] = frozenset()) -> None:
    """Warn about the keys a damaged step's failed attempt wrote that ``step`` (restored in the
    end, ``strict=False``) did not overwrite: they hold the damaged step's data (``copies``:
    which copy of each damaged step wrote them, where there are several roots)."""
    left: Dict[int, List[str]] = {}
    for k, s in written.items():
        if k not in covered:
            left.setdefault(s, []).append(k)
    for s, keys in sorted(left.items(), reverse=True):
        copy = f" ({copies[s]})" if copies.get(s) else ""
        named = _steps_named([s], moved)
        warn_user(f"restored step {step}, which lacks keys that the failed restore of {named}{copy} had partly "
                  f"written: they hold data of step {s}, not of step {step} (a key the restored step lacks may "
                  f"hold a failed attempt's data): {_keys(keys)}", RuntimeWarning)


def _restore_one(store: RootStore, step: int, state_dict: Dict[str, Any], opts: RestoreOptions, stateful: frozenset,
                 *, covered: Optional[Set[str]] = None, opened: Optional[List[StepCopy]] = None,
                 foreign: bool = False) -> None:
    """Check and load ``step`` into ``state_dict``; ``covered`` gets the keys of
    ``state_dict`` the step holds (those its load writes), once they are known, and ``opened``
    the copy this rank opened. ``foreign``: the step's directory is another program's (plain
    DCP), read without a manifest."""
    exchange = store.exchange
    added: List[tuple] = []

    def check() -> Tuple[str, Optional[Dict[str, FileRecord]], Any]:
        if foreign:
            where, files, int_keys = store.layout.step_dir(step), None, set()
            metadata = read_metadata(store.storage, where, None, threads=opts.threads)
        else:
            copy = store.layout.read_committed(step)
            if opened is not None:
                opened.append(copy)
            where, files, int_keys = copy.where, copy.manifest.files, set(copy.manifest.int_keys)
            metadata = read_metadata(store.storage, where, files, verify=opts.verify, threads=opts.threads,
                                     whole=not _share_of_this_job(copy.manifest), check_unused=True)
        int_keys |= _stateful_int_keys(metadata, stateful)
        added.extend(prepare_target(state_dict, metadata, step, int_keys, strict=opts.strict, covered=covered,
                                    cast=opts.cast, selects=None if opts.selects_all() else opts.selects))
        return where, files, metadata

    local, checked = phase.attempt(exchange, check, keep_alone=True)  # (the entries it added are taken out)
    _agree_or_undo(store, step, "restore checks", local, state_dict, added)
    assert checked is not None
    where, files, metadata = checked
    local, _ = phase.attempt(exchange, lambda: _load(exchange, store.storage, where, state_dict,
                                                    files=files, metadata=metadata, opts=opts,
                                                    step=step), keep_alone=True)
    _agree_or_undo(store, step, "restore", local, state_dict, added)


def _load(exchange: Exchange, storage: Storage, path: str, state_dict: Dict[str, Any], *,
          files: Optional[Dict[str, FileRecord]], metadata: Any, opts: RestoreOptions, step: int) -> None:
    """Read a checked step into ``state_dict`` in place (:func:`~async_ckpt.io.step_io.read_step`).

    One process: straight into the target, or (``atomic``) staged through the pool's buffers
    within its budget. Several ranks: through ``dcp.load`` over the group; no rank writes before
    every rank's reads passed (a phase inside DCP's read), so ``atomic`` holds either way
    (the pool is not used). Read once (``replicated_reads`` ``"once"``, or ``"auto"`` on storage
    that is not a local path; never with ``atomic``): a tensor every rank restores whole is read
    by one rank, balanced by bytes (:func:`~async_ckpt.ranks.replicas.read_assignment`), then
    sent to the others (:func:`~async_ckpt.ranks.replicas.send_replicas`); a failure there, once
    targets were written, is a :class:`~async_ckpt.errors.PartlyWrittenError` on every rank.
    """
    if exchange.world_size == 1:
        step_io.read_step(storage, path, state_dict, files=files, metadata=metadata, opts=opts, group=exchange.group)
        return

    def agree(error: Optional[BaseException]) -> None:  # no rank writes unless every rank's reads passed
        phase.everyone(exchange, "reading", step, error=error)

    # atomic: no rank may write before every read is done and verified, which a send after
    # the reads cannot promise; every rank then reads what it restores
    once = opts.planner is None and metadata is not None and not opts.atomic and \
        (opts.replicated_reads == "once" or (opts.replicated_reads == "auto" and not storage.is_local))
    if not once:
        exchange.dcp("reading", lambda: step_io.read_step(storage, path, state_dict, files=files, metadata=metadata,
                                                          opts=opts, group=exchange.group, agree=agree))
        return
    mine = restore_items(state_dict, metadata)
    readers = read_assignment(exchange.all_gather(list(mine)))
    skip = {key.split("\0", 1)[0] for (key, _), r in readers.items() if r != exchange.rank}
    exchange.dcp("reading", lambda: step_io.read_step(storage, path, state_dict, files=files, metadata=metadata,
                                                      opts=opts, group=exchange.group, agree=agree, skip=skip))
    try:
        problem = send_replicas(exchange.group, exchange.rank, exchange.world_size, readers, mine,
                                exchange.collective)
        phase.everyone(exchange, "sending restored tensors", step,
                       error=None if problem is None else CheckpointError(problem, step=step))
    except CheckpointError as exc:
        raise partly_written(path, exc) from exc


def read_plain_dcp(storage: Storage, path: str, *, threads: int = 8, allow_pickle: bool = False) -> Dict[str, Any]:
    """Everything a plain DCP checkpoint (another program's: no manifest) holds, as a new state
    dict: its ``.metadata`` read and checked, then every file read by the one read (sizes
    checked against ``.metadata``; there are no checksums).

    Args:
        storage: the checkpoint's storage.
        path: its directory.
        threads: how many reads run at once.
        allow_pickle: unpickle values outside torch's ``weights_only`` safe set.

    Returns:
        The state dict (nested as it was saved).

    Raises:
        CorruptCheckpointError: its ``.metadata`` or a file is damaged or missing.
    """
    metadata = read_metadata(storage, path, None, threads=threads)
    target: Dict[str, Any] = {}
    prepare_target(target, metadata, 0, set())  # an empty target takes every entry
    step_io.read_step(storage, path, target, files=None, metadata=metadata,
                      opts=RestoreOptions(threads=threads, allow_pickle=allow_pickle))
    return target


def _stateful_int_keys(metadata: Any, stateful: frozenset) -> Set[str]:
    """Dict keys inside ``Stateful`` values that were ints: a checkpoint that DCP wrote through
    the value's ``state_dict()`` (``dcp.save``; async_ckpt before it planned that state dict
    itself) does not record them, so an all-digit key there is taken as an int (an optimizer's
    ``state`` is keyed by parameter index)."""
    out: Set[str] = set()
    if not stateful:
        return out
    for path in (metadata.planner_data or {}).values():
        if not path or path[0] not in stateful:
            continue
        prefix = str(path[0])
        for p in path[1:]:
            prefix = f"{prefix}.{p}"
            if isinstance(p, str) and p.isdigit():
                out.add(prefix)
    return out


def _agree_or_undo(store: RootStore, step: int, what: str, local: Optional[BaseException],
                   state_dict: Dict[str, Any], added: List[tuple]) -> None:
    """Every rank learns every rank's outcome of ``what``; on any failure, all raise and take
    out the entries this restore added to ``state_dict``."""
    if isinstance(local, PartlyWrittenError) and not local.damaged_steps:
        local = local.with_context(step=step, damaged_steps=(step,))
    try:
        phase.everyone(store.exchange, what, step, error=local)
    except BaseException:
        remove_created(state_dict, added)
        raise


def _keys(keys: List[str]) -> str:
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f" (and {len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else "")


def prepare_target(state_dict: Dict[str, Any], metadata: Any, step: int, int_keys: Set[str], *,
                   strict: bool = True, covered: Optional[Set[str]] = None, cast: bool = False,
                   selects: Optional[Callable[[str], bool]] = None) -> List[tuple]:
    """Check ``state_dict`` against a checkpoint's DCP metadata; add entries it lacks.

    Keys of ``state_dict`` the checkpoint lacks raise :class:`StateDictMismatchError` naming
    up to ten (``strict=False``: a warning; they are left as they are). A tensor whose shape or
    dtype differs, a tensor where the checkpoint has a non-tensor value, or a target tensor that
    cannot be written in place (a meta tensor, an expanded one), always raises, before any write. Keys
    of the checkpoint that ``state_dict`` lacks are added (a fresh optimizer's empty ``state``,
    or everything for an empty target); with ``strict=False`` only the intersection is loaded
    and those keys are listed in a warning instead.

    ``cast``: a tensor of another dtype is no mismatch (the read casts, as ``dcp.load``).
    ``selects``: only the checkpoint's keys it selects are restored (``keys=`` / ``exclude=``):
    the others are neither added nor warned about.

    Returns the paths added, so that a failed restore can take them out again; ``covered``
    gets the keys of ``state_dict`` the checkpoint holds. The cyclic garbage collector is
    paused meanwhile (one pass over every item).
    """
    with gc_paused():
        return _prepare_target(state_dict, metadata, step, int_keys, strict=strict, covered=covered, cast=cast,
                               selects=selects)


def _prepare_target(state_dict: Dict[str, Any], metadata: Any, step: int, int_keys: Set[str], *,
                    strict: bool, covered: Optional[Set[str]] = None, cast: bool = False,
                    selects: Optional[Callable[[str], bool]] = None) -> List[tuple]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..format.dcp_layout import flatten_target

    flat, _ = flatten_target(state_dict, metadata)
    md = metadata.state_dict_metadata
    missing = [k for k in flat if k not in md]
    problems = []
    for k, v in flat.items():
        if k not in md:
            continue
        m = md[k]
        if isinstance(m, TensorStorageMetadata):
            if not isinstance(v, torch.Tensor):
                problems.append(f"{k}: checkpoint has a tensor, state_dict has {type(v).__name__}")
            elif tuple(v.shape) != tuple(m.size):
                problems.append(f"{k}: shape {tuple(v.shape)} in state_dict vs {tuple(m.size)} in checkpoint")
            elif v.dtype != m.properties.dtype and not cast:
                problems.append(f"{k}: dtype {v.dtype} in state_dict vs {m.properties.dtype} in checkpoint")
            else:
                unwritable = _unwritable(v)
                if unwritable is not None:
                    problems.append(f"{k}: {unwritable}")
        elif isinstance(v, torch.Tensor):
            problems.append(f"{k}: state_dict has a tensor, checkpoint has a non-tensor value")
    unmatched = [k for k in md if k not in flat and k in (metadata.planner_data or {})
                 and (selects is None or selects(k))]
    if (missing and strict) or problems:
        lines = [f"state_dict keys missing from checkpoint: {_keys(missing)}"] if missing and strict else []
        lines += problems[:SHOWN_KEYS]
        text = f"state_dict does not match checkpoint step {step}: " + "; ".join(lines)
        if missing and strict:
            text += "; " + _unmatched_hint(missing, unmatched, step)
        raise StateDictMismatchError(text, step=step)
    if covered is not None:
        covered.update(k for k in flat if k in md)
    if missing:
        warn_user(f"restore(strict=False) of step {step}: keys not in the checkpoint, left as they are: "
                  f"{_keys(missing)}")
    mappings = metadata.planner_data or {}
    added: List[tuple] = []
    extra = []
    # A key of the checkpoint is added only inside a container that is empty in the target (a
    # fresh optimizer's ``state``, an empty ``{}``): decided on the target as it was, before any
    # addition. Elsewhere (a model whose state_dict lacks a layer) it is left out, with a warning.
    fillable = [k for k in unmatched if strict and _fillable(state_dict, mappings[k], int_keys)]
    for k in fillable:
        m = md[k]
        path = mappings[k]
        value = torch.empty(tuple(m.size), dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
        set_element(state_dict, path, value, int_keys=int_keys, created=added)
    extra = [k for k in unmatched if k not in set(fillable)] if len(fillable) != len(unmatched) else []
    if extra:
        warn_user(f"checkpoint step {step} has keys the state_dict lacks; they were not restored "
                  f"(nor added to state_dict): {_keys(extra)}"
                  f". {_cause_hint(extra, missing)}")
    return added


def _fillable(state_dict: Dict[str, Any], path: Sequence[Any], int_keys: Set[str]) -> bool:
    """Whether restore may add the checkpoint entry at ``path`` to ``state_dict``: the deepest
    container on ``path`` that ``state_dict`` has is empty (a fresh optimizer's ``state``, an
    empty target), or the first key it lacks was an int at save time (an optimizer's
    ``state`` keyed by parameter index, holding entries for some parameters only)."""
    cur: Any = state_dict
    prefix = ""
    for p in path[:-1]:
        prefix = f"{prefix}.{p}" if prefix else str(p)
        nxt = None
        if isinstance(cur, dict):
            nxt = cur.get(int(p) if prefix in int_keys else p)
        elif isinstance(cur, list) and isinstance(p, int) and p < len(cur):
            nxt = cur[p]
        if not isinstance(nxt, (dict, list)):
            return len(cur) == 0 or prefix in int_keys
        cur = nxt
    return len(cur) == 0


def suggest_key_map(missing: Sequence[str], unmatched: Sequence[str]) -> Optional[Dict[str, str]]:
    """A ``key_map`` that turns the checkpoint's ``unmatched`` keys into the target's
    ``missing`` ones (a prefix added or dropped: DDP's ``module.``, torch.compile's
    ``_orig_mod.``, a ``{"model": ...}`` level), if one prefix change explains most of them.

    Args:
        missing: keys of the target the checkpoint lacks.
        unmatched: keys of the checkpoint that match no key of the target.

    Returns:
        ``{checkpoint_prefix: target_prefix}`` or None.
    """
    if not missing or not unmatched:
        return None
    t = missing[0].split(".")

    def suffix(u: List[str]) -> int:
        n = 0
        while n < min(len(u), len(t)) and u[-1 - n] == t[-1 - n]:
            n += 1
        return n
    best = max((u.split(".") for u in unmatched[:100_000]), key=suffix)
    n = suffix(best)
    if n == 0:
        return None
    head_u, head_t = best[:len(best) - n], t[:len(t) - n]
    src = ".".join(head_u) + "." if head_u else ""
    dst = ".".join(head_t) + "." if head_t else ""
    want = set(missing)
    hits = sum(1 for u in unmatched if u.startswith(src) and dst + u[len(src):] in want)
    return {src: dst} if hits * 2 >= min(len(missing), len(unmatched)) and hits else None


def _cause_hint(unmatched: Sequence[str], missing: Sequence[str]) -> str:
    km = suggest_key_map(missing, unmatched)
    fix = f"restore(..., key_map={km!r}) maps them; " if km else ""
    return (f"{fix}the usual causes are a renamed module, torch.compile's '_orig_mod.', DDP's 'module.' or a "
            "missing {'model': ...} level (restore(..., key_map={'module.': ''}) strips a prefix); "
            "`async-ckpt show <root> <step>` lists the checkpoint's keys")


def _unmatched_hint(missing: Sequence[str], unmatched: Sequence[str], step: int) -> str:
    head = (f"keys of the checkpoint that match no key of state_dict: {_keys(list(unmatched))}; "
            if unmatched else "")
    return head + _cause_hint(unmatched, missing) + "; strict=False loads only the keys both have"


def _unwritable(t: torch.Tensor) -> Optional[str]:
    """Why the target tensor ``t`` cannot take a checkpoint's values in place, or ``None``."""
    if t.is_meta:
        return ("the target is a meta tensor, which has no memory to restore into; materialize it first "
                "(module.to_empty(device=...), or torch.empty_like(t, device='cpu'))")
    if t.layout == torch.strided and t.numel() > 1:  # no elements: nothing to write
        for n, st in zip(t.shape, t.stride()):
            if n > 1 and st == 0:
                return (f"the target is an expanded tensor (stride 0 over a dimension of size {n}, shape "
                        f"{tuple(t.shape)}), whose elements share memory and cannot each be restored; restore "
                        "into a tensor of its own (t.clone(), torch.empty(shape)) and expand that")
    return None
