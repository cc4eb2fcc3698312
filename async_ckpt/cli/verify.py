"""``verify`` (every byte against the manifest) and ``prune`` (retention by hand)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from ..addresses import byte_view
from ..errors import CheckpointError, StepNotFoundError
from ..format import step_names
from ..format.manifest import MARKER_NAME, shown
from ..jobs.catalog import StepCatalog
from ..storage.lease import writer_lease
from ..storage.step_dirs import StepDirectories
from ..storage.storage import Storage
from .common import (
    EXIT_DAMAGED,
    EXIT_OK,
    fmt_metrics,
    fmt_time,
    foreign_note,
    home_identity,
    human_bytes,
    intact_line,
    no_checkpoint_message,
    open_root,
    open_roots,
    parse_step,
    print_json,
    progress_bar,
    render_table,
    restore_order,
)

# ---- verify ----------------------------------------------------------------------------------

def verify_step(storage: Storage, layout: StepDirectories, step: int, bar: Any) -> Dict[str, Any]:
    """Read every file of a committed step and check it against the manifest; list the problems.

    Args:
        storage: The root.
        layout: Its step layout.
        step: A committed step.
        bar: A progress bar (:func:`~async_ckpt.cli.common.progress_bar`) the bytes read advance.

    Returns:
        ``step``, ``ok``, ``files``, ``bytes`` (read), ``problems`` (one line each), and the
        manifest's ``written_bytes`` / ``referred_bytes``.
    """
    from ..format.dcp_layout import METADATA_NAME
    from ..io.dcp_adapters import parse_metadata
    from ..io.read_exec import check_sizes, read_files
    from ..io.sinks import FRESH, NULL

    res: Dict[str, Any] = {"step": step, "ok": False, "files": 0, "bytes": 0, "problems": []}
    try:
        copy = layout.read_committed(step)
        bad = check_sizes(storage, copy.where, copy.manifest.files)  # what ls checks: verify reports all, and more
    except CheckpointError as exc:
        res["problems"].append(str(exc))
        return res
    man, where = copy.manifest, copy.where
    res["files"] = len(man.files)
    res["written_bytes"], res["referred_bytes"] = man.written_bytes, man.referred_bytes
    meta_bytes: Optional[bytes] = None

    def counted(n: int) -> None:
        res["bytes"] += n
        bar.update(n)

    for name, rec in sorted(man.files.items()):
        if name in bad:
            res["problems"].append(f"{shown(name)}: {bad[name]}")
            continue
        bar.set_description(f"step {step} {shown(name)}")
        keep = name == METADATA_NAME
        try:  # the one verified read (into nothing, except .metadata's bytes)
            got = read_files(storage, where, {name: rec}, FRESH if keep else NULL, progress=counted)
        except CheckpointError as exc:  # named by the file's name in the step, as every problem here
            text = str(exc)
            res["problems"].append(text[len(where) + 1:] if text.startswith(f"{where}/") else text)
            continue
        except OSError as exc:
            res["problems"].append(f"{name}: cannot be read ({exc})")
            continue
        if keep:
            meta_bytes = bytes(byte_view(got[name])) if rec.size else b""
    if METADATA_NAME not in man.files:
        res["problems"].append(f"manifest lists no {METADATA_NAME}")
    elif meta_bytes is not None and not any(p.startswith(METADATA_NAME) for p in res["problems"]):
        try:  # the checks a restore makes of it, against the manifest
            parse_metadata(meta_bytes, man.files, where=f"step {step} {METADATA_NAME}", whole=man.whole)
        except CheckpointError as exc:
            res["problems"].append(str(exc))
    res["ok"] = not res["problems"]
    return res


def _foreign_copies(roots: List[Tuple[str, Storage, StepDirectories]]) -> Dict[int, str]:
    """The local tier's committed copies another job saved (their manifests record another
    checkpoint path than PATH): step -> that path. A manifest that does not read counts as
    this job's (verify reports it damaged)."""
    home = home_identity(roots)
    out: Dict[int, str] = {}
    for tier, _, layout in roots:
        if tier != "local":
            continue
        for s in layout.committed_steps():
            try:
                other = layout.read_manifest(s).identity.saved_for_another(home)
            except CheckpointError:
                continue
            if other is not None:
                out[s] = other
    return out


def _restore_order(roots: List[Tuple[str, Storage, StepDirectories]], own: Any) -> List[int]:
    """The steps in the order ``restore(None)`` tries them, over every tier (copies another
    job saved left out): steps whose manifest does not read first, then newest commit first."""
    if len(roots) == 1:
        return restore_order(roots[0][2])
    unread: List[int] = []
    timed: List[Tuple[float, int]] = []
    for tier, _, lay in roots:
        infos = StepCatalog(lay, time.time).in_commit_order()
        seen = {c.step for c in infos}
        unread += [s for s in lay.committed_steps() if s not in seen and own(tier, s)]
        timed += [(c.commit_time, c.step) for c in infos if own(tier, c.step)]
    order = sorted(set(unread), reverse=True) + [s for _, s in sorted(timed, reverse=True)]
    return list(dict.fromkeys(order))


def _newest_intact(order: List[int], results: List[Dict[str, Any]]) -> Tuple[Optional[int], List[int]]:
    """The first step of ``order`` with a copy that verified, and the damaged ones before it."""
    ok = {r["step"] for r in results if r["ok"]}
    seen = {r["step"] for r in results}
    skipped: List[int] = []
    for s in order:
        if s in ok:
            return s, skipped
        if s in seen:
            skipped.append(s)
    return None, skipped


def cmd_verify(args: argparse.Namespace) -> int:
    roots = open_roots(args)
    foreign = _foreign_copies(roots)  # another job's local copies: skipped, with a note

    def own(tier: str, s: int) -> bool:
        return tier != "local" or s not in foreign

    def none_found() -> StepNotFoundError:
        return StepNotFoundError(no_checkpoint_message(
            roots[-1][1], f"no committed checkpoint {'of this job ' if len(roots) > 1 else ''}under "
            + " or ".join(r[1].url for r in roots), name=args.path))

    tiered = len(roots) > 1
    walk = False  # STEP omitted or 'latest': verify as restore(None) reads, until a step verifies
    todo: List[Tuple[str, Storage, StepDirectories, int]] = []
    order: List[int] = []
    if args.all:
        if args.step is not None:
            raise ValueError("give a STEP or --all, not both")
        for tier, storage, layout in roots:
            todo += [(tier, storage, layout, s) for s in layout.committed_steps() if own(tier, s)]
        if not todo:
            raise none_found()
        order = _restore_order(roots, own)
    elif args.step in (None, "latest"):
        walk = True
        order = _restore_order(roots, own)
        if not order:
            raise none_found()
    else:
        if not args.step.isdigit():
            raise ValueError(f"STEP must be a non-negative integer or 'latest', got {args.step!r}")
        step = int(args.step)
        if not tiered:
            step = parse_step(args.step, roots[0][2])
        todo = [(tier, st, lay, step) for tier, st, lay in roots if step in lay.committed_steps() and own(tier, step)]
        if not todo:
            raise StepNotFoundError(f"no committed checkpoint of this job for step {step} in either tier"
                                    + (" (the local copy is another job's)" if step in foreign else ""), step=step)

    def copies(step: int) -> List[Tuple[str, Storage, StepDirectories, int]]:
        return [(tier, st, lay, step) for tier, st, lay in roots if step in lay.committed_steps() and own(tier, step)]

    def size_of(items: List[Tuple[str, Storage, StepDirectories, int]]) -> int:
        total = 0
        for _, _, layout, s in items:
            try:
                total += sum(r.size for r in layout.read_manifest(s).files.values())
            except CheckpointError:
                pass
        return total

    results: List[Dict[str, Any]] = []
    bar = progress_bar(size_of(todo if not walk else copies(order[0])), "verify", args.progress)
    try:
        if walk:  # newest first, as restore(None): the first step with a copy that verifies ends it
            for i, s in enumerate(order):
                items = copies(s)
                if i and hasattr(bar, "total"):
                    bar.total += size_of(items)
                    bar.refresh()
                got = [dict(verify_step(storage, layout, s, bar), tier=tier) for tier, storage, layout, s in items]
                results += got
                if any(r["ok"] for r in got):
                    break
        else:
            results = [dict(verify_step(storage, layout, s, bar), tier=tier) for tier, storage, layout, s in todo]
    finally:
        bar.close()
    damaged = [r for r in results if not r["ok"]]
    skipped = sorted(foreign)  # never verified, never the latest
    newest, newer_damaged = _newest_intact(order, results) if order else (None, [])
    if args.json:
        out: Dict[str, Any] = {"path": args.path, "ok": not damaged, "steps": results,
                               "skipped_foreign": [{"step": s, "tier": "local", "saved_for": foreign[s]}
                                                   for s in skipped]}
        if order:
            out.update(newest_intact=newest, newer_damaged=newer_damaged)
        print_json(out)
    else:
        for s in skipped:
            print(f"step {s} (local): skipped: saved for the checkpoint path {foreign[s]} (another job's copy)")
        if skipped:
            print(foreign_note(len(skipped), home_identity(roots), "skipped, not verified"))
        for r in results:
            state = "ok" if r["ok"] else "DAMAGED"
            where = f" ({r['tier']})" if tiered else ""
            shared = (f"; {human_bytes(r['written_bytes'])} written, {human_bytes(r['referred_bytes'])} taken "
                      f"from earlier steps" if r.get("referred_bytes") else "")
            print(f"step {r['step']}{where}: {state} ({r['files']} files, {human_bytes(r['bytes'])} read{shared})")
            for p in r["problems"]:
                print(f"  {p}")
        if order:
            print(intact_line(newest, newer_damaged, verified=True))
        if damaged:
            print(f"{len(damaged)} of {len(results)} step(s) damaged: {', '.join(str(r['step']) for r in damaged)}",
                  file=sys.stderr)
    return EXIT_DAMAGED if damaged else EXIT_OK


# ---- prune -----------------------------------------------------------------------------------

def _retention(args: argparse.Namespace) -> Any:
    """The policy of prune's flags: ``AnyOf`` of ``KeepLatest``, ``KeepEveryNSteps`` and
    ``KeepBest`` (those given)."""
    from .. import policies

    members: List[Any] = []
    if args.keep_last is not None:
        if args.keep_last < 1:
            raise ValueError(f"--keep-last must be >= 1, got {args.keep_last}")
        members.append(policies.KeepLatest(args.keep_last))
    if args.keep_best is not None:
        if args.keep_best < 1:
            raise ValueError(f"--keep-best must be >= 1, got {args.keep_best}")
        if not args.metric:
            raise ValueError("--keep-best needs --metric NAME (a metric the saves recorded, e.g. val_loss)")
        members.append(policies.KeepBest(args.keep_best, args.metric, args.mode))
    elif args.metric is not None:
        raise ValueError("--metric goes with --keep-best N")
    if not members:
        raise ValueError("give --keep-last N and/or --keep-best N --metric NAME")
    if args.keep_every is not None:
        if args.keep_every < 1:
            raise ValueError(f"--keep-every must be >= 1, got {args.keep_every}")
        members.append(policies.KeepEveryNSteps(args.keep_every))
    return members[0] if len(members) == 1 else policies.AnyOf(members)


def _job_retention(layout: StepDirectories, step: int) -> Tuple[Optional[Dict[str, Any]], Any]:
    """The retention the job recorded in ``step``'s manifest (its spec, and the policy; the
    policy is None for a custom one, whose choices a tool cannot know)."""
    from ..policies import RETENTION_KEY, retention_from_spec

    spec = layout.read_manifest(step).extra.get(RETENTION_KEY)
    return (spec, retention_from_spec(spec)) if isinstance(spec, dict) else (None, None)


def cmd_prune(args: argparse.Namespace) -> int:
    from ..io.read_exec import check_sizes
    from ..policies import CheckpointInfo, apply_retention

    storage, layout = open_root(args)
    policy = _retention(args)
    infos: List[CheckpointInfo] = []
    unreadable: Dict[int, str] = {}
    sizes: Dict[int, int] = {}
    for step in layout.committed_steps():
        try:  # damaged steps (marker, manifest, a file missing or of the wrong size) are left alone
            opened = layout.read_committed(step)
            m, bad = opened.manifest, check_sizes(storage, opened.where, opened.manifest.files)
        except CheckpointError as exc:
            unreadable[step] = str(exc)
            continue
        if bad:
            unreadable[step] = "; ".join(f"{shown(n)}: {what}" for n, what in bad.items())
            continue
        infos.append(CheckpointInfo(step, m.commit_time, dict(m.metrics), m.nbytes))
        sizes[step] = sum(r.size for r in m.files.values())
    ordered = sorted(infos, key=lambda c: (c.commit_time, c.step))
    if args.metric is not None and ordered and not any(args.metric in c.metrics for c in ordered):
        have = sorted({k for c in ordered for k in c.metrics})
        raise ValueError(f"no committed step recorded the metric {args.metric!r} (the steps' metrics: "
                         f"{', '.join(have) or 'none'}): --keep-best would keep every step")
    # The step always kept is the newest commit that verifies in full (checksums, metadata):
    # newer ones that fail are damaged, left alone and never count as the newest kept. With
    # none that verifies, nothing is deleted.
    anchor = None
    for c in reversed(ordered):
        bar = progress_bar(sizes[c.step], f"verify step {c.step}", None)
        try:
            res = verify_step(storage, layout, c.step, bar)
        finally:
            bar.close()
        if res["ok"]:
            anchor = c
            break
        unreadable[c.step] = "; ".join(res["problems"])
    ordered = [c for c in ordered if c.step not in unreadable] if anchor is not None else []
    keep = set(policy.keep(ordered)) if ordered else set()
    if anchor is not None:  # the same guarantee as the manager's retention, among intact steps
        keep.add(anchor.step)
    # What the job's own retention keeps (recorded in the newest intact manifest) stays too,
    # unless --force: the job would otherwise resume without the steps it meant to keep.
    spec, job_policy = _job_retention(layout, anchor.step) if anchor is not None else (None, None)
    protected: Set[int] = set()
    if spec is not None and ordered:
        wanted = apply_retention(job_policy, ordered) if job_policy is not None else {c.step for c in ordered}
        protected = {c.step for c in ordered if c.step in wanted and c.step not in keep}
    if not args.force:
        keep |= protected
    doomed = [c.step for c in ordered if c.step not in keep]
    deleted: List[int] = []
    if not args.dry_run and doomed:
        lease = writer_lease(storage)
        lease.acquire(args.lease_timeout)  # LeaseHeldError while a training job writes here: nothing is deleted
        try:
            for s in doomed:
                lease.check()  # proven before every deletion (an object store's lease may lapse meanwhile)
                layout.delete(s)
                deleted.append(s)
        finally:
            lease.release()
    kept = sorted(keep & {c.step for c in ordered})
    job_text = _describe_job_retention(spec, job_policy)
    if args.json:
        print_json({"path": args.path, "dry_run": args.dry_run, "kept": kept,
                     "deleted": sorted(doomed) if args.dry_run else deleted,
                     "skipped_damaged": {str(k): v for k, v in sorted(unreadable.items())},
                     "job_retention": spec, "kept_for_job_retention": sorted(protected) if not args.force else [],
                     "forced": sorted(protected) if args.force else []})
        return EXIT_OK
    action = "would delete" if args.dry_run else "deleted"

    def what(step: int) -> str:
        if step in protected:
            return f"{action} (--force)" if args.force else "keep (job's retention)"
        return "keep" if step in keep else action

    rows = [[c.step, fmt_time(c.commit_time), human_bytes(c.nbytes), fmt_metrics(c.metrics), what(c.step)]
            for c in sorted(ordered, key=lambda c: c.step)]
    rows += [[s, "-", "-", "-", "skip (damaged)"] for s in sorted(unreadable)]
    if rows:
        print(render_table(["STEP", "COMMITTED", "DATA", "METRICS", "ACTION"], rows, right=(0, 2)))
    print(f"{'dry run: ' if args.dry_run else ''}{len(kept)} kept, {len(doomed)} "
          f"{'to delete' if args.dry_run else 'deleted'}"
          + (f", {len(unreadable)} damaged step(s) left alone" if unreadable else ""))
    if protected and not args.force:
        print(f"kept {len(protected)} step(s) the job's own retention ({job_text}) keeps: "
              f"{', '.join(map(str, sorted(protected)))}; pass --force to delete them too")
    elif protected:
        print(f"--force: {'would delete' if args.dry_run else 'deleted'} {len(protected)} step(s) the job's own "
              f"retention ({job_text}) keeps: {', '.join(map(str, sorted(protected)))}")
    return EXIT_OK


def _describe_job_retention(spec: Optional[Dict[str, Any]], policy: Any) -> str:
    if spec is None:
        return "none recorded"
    if policy is None:
        return (f"a custom policy, {spec.get('repr', spec)}, whose choices cannot be known here: every step "
                f"counts as kept")
    return repr(policy)


# ---- promote ---------------------------------------------------------------------------------

def cmd_promote(args: argparse.Namespace) -> int:
    """Upload a local tier's step to PATH and commit it there (takes PATH's writer lease).

    Everything that can be checked without the lease is checked first (``--local-dir`` exists
    and holds ``STEP`` committed, PATH does not hold it): such a failure leaves both untouched
    (a manager's first write to a root also cleans it up, and creates a missing local_dir).
    """
    from ..manager import CheckpointManager
    from .common import parse_options

    try:
        step = int(args.step)
    except ValueError:
        raise ValueError(f"STEP must be a step number, got {args.step!r}") from None
    storage, layout = open_root(args)
    roots = open_roots(args)  # FileNotFoundError for a missing --local-dir, before anything is created
    local_layout = roots[0][2]
    if step not in local_layout.committed_steps():
        held = local_layout.committed_steps()
        raise StepNotFoundError(f"{args.local_dir} holds no committed step {step} (committed there: "
                                f"{', '.join(map(str, held[-20:])) or 'none'})", step=step)
    if step in layout.committed_steps():
        raise CheckpointError(f"{args.path} already holds a committed step {step}: delete it there first "
                              f"(async-ckpt rm {args.path} {step}) to replace it with the local copy")
    with CheckpointManager(args.path, storage_options=parse_options(args.storage_option),
                           local_dir=args.local_dir, local_retention=2**31 - 1, max_to_keep=0,
                           lease_timeout=args.lease_timeout) as mgr:
        mgr.promote(step)
    if args.json:
        print_json({"path": args.path, "local_dir": args.local_dir, "promoted": step})
    else:
        print(f"step {step}: copied from {args.local_dir} to {args.path} and committed")
    return EXIT_OK


# ---- rm --------------------------------------------------------------------------------------

def cmd_rm(args: argparse.Namespace) -> int:
    """Delete committed steps through :meth:`CheckpointManager.delete` (PATH's writer lease,
    marker first). Every STEP is checked first: one that is not committed deletes nothing."""
    from ..manager import CheckpointManager
    from .common import parse_options

    steps: List[int] = []
    for text in args.steps:
        if not text.isdigit():
            raise ValueError(f"STEP must be a non-negative integer, got {text!r}")
        if int(text) not in steps:
            steps.append(int(text))
    storage, layout = open_root(args)
    committed = layout.committed_steps()
    missing = [s for s in steps if s not in committed]
    if missing:
        shown_steps = committed if len(committed) <= 20 else ["..."] + committed[-20:]
        unfinished = {layout.step_of(p) for p in layout.incomplete()}
        hint = ("; step(s) " + ", ".join(str(s) for s in missing if s in unfinished) + " never committed "
                f"(incomplete): `async-ckpt rm {args.path} --incomplete` deletes the steps that never committed"
                if any(s in unfinished for s in missing) else "")
        raise StepNotFoundError(f"no committed checkpoint for step{'s' if len(missing) > 1 else ''} "
                                f"{', '.join(map(str, missing))} under {layout.storage.url} (committed: "
                                f"{', '.join(map(str, shown_steps)) or 'none'}){hint}; nothing deleted",
                                step=missing[0])
    deleted: List[int] = []
    if steps:  # only these: keep_incomplete, so that the lease's clean-up removes nothing unasked
        with CheckpointManager(args.path, storage_options=parse_options(args.storage_option), max_to_keep=0,
                               keep_incomplete=True, lease_timeout=args.lease_timeout) as mgr:
            for s in steps:
                mgr.delete(s)  # takes the writer lease at the first: LeaseHeldError deletes nothing
                deleted.append(s)
    removed = _rm_incomplete(storage, layout, args.lease_timeout) if args.incomplete else []
    if args.json:
        print_json({"path": args.path, "deleted": deleted, "deleted_incomplete": removed})
        return EXIT_OK
    if deleted:
        print(f"deleted step{'s' if len(deleted) > 1 else ''} {', '.join(map(str, deleted))} from {args.path}")
    if args.incomplete:
        print(f"deleted {len(removed)} incomplete step director{'y' if len(removed) == 1 else 'ies'} from "
              f"{args.path}" + (f": {', '.join(removed)}" if removed else ""))
    return EXIT_OK


def _rm_incomplete(storage: Storage, layout: StepDirectories, lease_timeout: float) -> List[str]:
    """Delete what never committed under the root (what a writer's clean-up removes when it takes
    the lease), holding the writer lease: :class:`LeaseHeldError` while a writer holds it (a save
    may be in progress), and nothing is deleted. Returns the directory names deleted."""
    lease = writer_lease(storage)
    lease.acquire(lease_timeout)
    removed: List[str] = []
    try:
        for path in layout.incomplete():
            if not step_names.is_kind(path, step_names.TRASH) and storage.exists(f"{path}/{MARKER_NAME}"):
                continue  # committed since it was listed (cannot be, under the lease: never deleted)
            lease.check()  # proven before every deletion (an object store's lease may lapse meanwhile)
            layout.remove(layout.condemn_dir(path))
            removed.append(path.rsplit("/", 1)[-1])
    finally:
        lease.release()
    return removed


def cmd_import(args: argparse.Namespace) -> int:
    """Save SOURCE, a plain DCP checkpoint directory, as STEP of PATH
    (:meth:`CheckpointManager.import_step`)."""
    from ..manager import CheckpointManager
    from .common import parse_options

    if not args.step.isdigit():
        raise ValueError(f"STEP must be a non-negative integer, got {args.step!r}")
    step = int(args.step)
    options = parse_options(args.storage_option)
    with CheckpointManager(args.path, storage_options=options, max_to_keep=0,
                           lease_timeout=args.lease_timeout) as mgr:
        mgr.import_step(args.source, step, storage_options=options, allow_pickle=args.allow_pickle)
    if args.json:
        print_json({"path": args.path, "source": args.source, "step": step})
    else:
        print(f"imported {args.source} as step {step} of {args.path}")
    return EXIT_OK
