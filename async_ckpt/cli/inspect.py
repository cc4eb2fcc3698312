"""``ls`` and ``show``: what a root holds, and what a step holds."""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

from ..errors import CheckpointError
from ..format import step_names
from ..format.manifest import MARKER_NAME, CopyIdentity, shown
from ..io.read_exec import check_sizes
from ..stats import format_count
from ..storage.diagnosis import DCP_HINT, PARENT_OF_ROOTS, STEP_DIR
from ..storage.lease import lease_holder
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
    latest_intact,
    open_root,
    open_roots,
    parse_step,
    path_findings,
    print_json,
    progress_bar,
    read_step_metadata,
    render_table,
)

# ---- ls --------------------------------------------------------------------------------------

def _step_entry(storage: Storage, layout: StepDirectories, name: str, locations: Dict[int, str],
                home: Optional[str] = None) -> Dict[str, Any]:
    """What ``ls`` reports for one directory under the root (read only, contents never read).

    ``listed``: committed, and the step check passes (the marker vouches
    for the manifest; every file it lists is a regular file in the step directory, of the
    listed size); ``damaged``: committed, but that check fails; ``superseded``: an older
    committed copy of a step that a newer copy replaced (a crash interrupted the re-save; the
    next writer removes it); ``incomplete``: never committed; ``foreign``: a symbolic link,
    never followed, or (a local tier, ``home``: PATH's :meth:`~async_ckpt.storage.storage.Storage.root_identity`)
    a committed copy whose manifest records another checkpoint path (another job's copy;
    ``saved_for`` names that path).
    """
    path = storage.join(name)
    parsed = layout.naming.parse(name)
    step_of = parsed.step if parsed is not None else None
    kind = parsed.kind if parsed is not None else None
    if layout.is_foreign_link(name):
        return {"step": step_of, "name": name, "status": "foreign", "commit_time": None, "bytes": None,
                "files": None, "metrics": {},
                "problem": f"{name} is a symbolic link (to {os.path.realpath(path)!r}); async_ckpt never reads, "
                           "restores or deletes through it"}
    listing = {e["name"]: e for e in storage.listdir(path)}
    disk = sum(int(e.get("size") or 0) for e in listing.values() if e.get("type") != "directory")
    current = step_of is not None and locations.get(step_of) == path
    if not current and MARKER_NAME in listing and kind != step_names.TRASH:
        kept = locations.get(step_of, "?") if step_of is not None else "?"
        return {"step": step_of, "name": name, "status": "superseded", "commit_time": None, "bytes": disk,
                "files": len(listing), "metrics": {},
                "problem": f"an older committed copy of step {step_of} (the current one is "
                           f"{shown(kept.rsplit('/', 1)[-1])}); the next writer removes it"}
    if not current and kind in (step_names.TMP, step_names.TRASH):
        what = "a save in progress or one that never finished" if kind == step_names.TMP else "a replaced step being deleted"
        return {"step": step_of, "name": name, "status": "incomplete", "commit_time": None,
                "bytes": disk, "files": len(listing), "metrics": {}, "problem": f"{name}: {what}"}
    step = int(step_of) if step_of is not None else -1
    entry: Dict[str, Any] = {"step": step, "name": name, "status": "listed", "commit_time": None, "bytes": disk,
                             "files": len(listing), "metrics": {}, "problem": None}
    if MARKER_NAME not in listing:
        entry["status"] = "incomplete"
        if kind == step_names.STEP and layout.is_foreign(path):  # another program's: listed, never touched
            entry["status"] = "foreign"
            what = DCP_HINT if ".metadata" in listing else "written by another program (no COMMITTED marker)"
            entry["problem"] = f"{what}; read-only: never replaced or deleted, restore({step}, ...) reads it"
            return entry
        if ".metadata" in listing and "manifest.json" not in listing:
            entry["problem"] = DCP_HINT  # dcp.save's or torch_xla's: no hint otherwise what to do
        else:
            entry["problem"] = ("no COMMITTED marker (a save in progress or one that never finished, or not "
                                "written by async_ckpt)")
        return entry
    try:
        opened = layout.read_committed(step)
        man, bad = opened.manifest, check_sizes(storage, opened.where, opened.manifest.files)
    except CheckpointError as exc:
        entry.update(status="damaged", problem=str(exc))
        return entry
    problems = [f"{shown(n)}: {what}" for n, what in bad.items()]
    entry.update(commit_time=man.commit_time, save_id=man.identity.save_id, metrics=dict(man.metrics),
                 files=len(man.files),
                 bytes=sum(r.size for r in man.files.values()), nbytes=man.nbytes,
                 num_tensors=man.num_tensors, world_size=man.world_size,
                 written_bytes=man.written_bytes, referred_bytes=man.referred_bytes)
    other = man.identity.saved_for_another(home)
    if other is not None:
        entry.update(status="foreign", saved_for=other,
                     problem=f"saved for the checkpoint path {other}, not {home} (another job's copy: not in "
                             f"this job's commit order, never its latest)")
    elif problems:
        entry.update(status="damaged", problem="; ".join(problems))
    return entry


def _entries(storage: Storage, layout: StepDirectories, home: Optional[str] = None) -> List[Dict[str, Any]]:
    names = [e["name"] for e in storage.listdir(storage.root)
             if (e.get("type") == "directory" or e.get("islink"))
             and layout.naming.parse(e["name"]) is not None]
    locations = layout.locations()
    with ThreadPoolExecutor(max(1, min(16, len(names)))) as pool:
        return list(pool.map(lambda n: _step_entry(storage, layout, n, locations, home), names))


def _number_saves(timed: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Set ``commit_order`` (1: the oldest) of committed entries, per save: the copies of one
    save in both tiers (:meth:`~async_ckpt.format.manifest.CopyIdentity.same_save`) share a number, at the newer
    copy's commit time. Returns the entries in that order."""
    def info(e: Dict[str, Any]) -> CopyIdentity:
        return CopyIdentity(save_id=e.get("save_id"))

    for e in timed:
        e["_at"] = max(o["commit_time"] for o in timed if o is e or (o["step"] == e["step"] and info(e).same_save(info(o))))
    timed.sort(key=lambda e: (e["_at"], e["step"], e["tier"] != "local"))
    n, last = 0, None
    for e in timed:
        key = (e["step"], e.pop("_at"))
        n += key != last
        last, e["commit_order"] = key, n
    return timed


def _verify_newest(roots: List[Tuple[str, Storage, StepDirectories]], timed: List[Dict[str, Any]]) -> None:
    """``ls --verify``: read and checksum the committed copies newest commit first, as
    ``restore(None)`` reads them, until a save has a copy that verifies; its copies that verify
    become ``verified``, those that do not ``damaged`` (with the problems)."""
    from .verify import verify_step

    where = {tier: (storage, layout) for tier, storage, layout in roots}
    for order in sorted({e["commit_order"] for e in timed}, reverse=True):
        found = False
        for e in [e for e in timed if e["commit_order"] == order and e["status"] == "listed"]:
            storage, layout = where[e["tier"]]
            res = verify_step(storage, layout, e["step"], progress_bar(0, "", False))
            if res["ok"]:
                e["status"], found = "verified", True
            else:
                e.update(status="damaged", problem="; ".join(res["problems"]))
        if found:
            return


def cmd_ls(args: argparse.Namespace) -> int:
    roots = open_roots(args)
    tiered = len(roots) > 1
    home = home_identity(roots)
    entries = []
    for tier, storage, layout in roots:
        for e in _entries(storage, layout, home if tier == "local" else None):
            e["tier"] = tier
            entries.append(e)
    entries.sort(key=lambda e: (e["step"], e["tier"] != "local", e["name"]))
    # Commit order is the order: 1 is the oldest commit; the newest is the latest step.
    timed = _number_saves([e for e in entries if e["status"] in ("listed", "damaged") and e["commit_time"] is not None])
    saves = sorted({e["commit_order"]: e["step"] for e in timed}.items())
    if args.verify:
        _verify_newest(roots, timed)
    # The latest is what restore(None) takes: the newest commit that passes these checks (it
    # skips a damaged one); with --verify, the newest whose bytes verified. Without it, damage
    # inside a file's bytes shows only in verify (restore skips such a step too, when it reads it).
    intact = [e for e in timed if e["status"] in ("listed", "verified")]
    latest_order = max((e["commit_order"] for e in intact), default=None)
    latest = next((e["step"] for e in intact if e["commit_order"] == latest_order), None)
    skipped = [step for order, step in saves if latest_order is None or order > latest_order]
    # --verify: verify's exit rule; a step it had to read (restore(None)'s order, newest first,
    # until one verifies) is damaged: 1
    code = EXIT_DAMAGED if args.verify and skipped else EXIT_OK
    findings = path_findings(roots[-1][1], args.path)
    others = [{"kind": f.kind, "names": list(f.names), "hint": f.message} for f in findings
              if f.kind not in (STEP_DIR, PARENT_OF_ROOTS)]
    incomplete = [e for e in entries if e["status"] == "incomplete"]
    holder = lease_holder(roots[-1][1]) if incomplete or args.json else None
    if args.json:
        print_json({"path": args.path, "steps": entries, "latest": latest, "writer_lease": holder,
                     "commit_order": [step for _, step in saves], "newer_damaged": skipped,
                     "verified": bool(args.verify), "other_checkpoints": others,
                     "diagnosis": [f.to_dict() for f in findings]})
        return code
    if not entries:
        print(f"no checkpoints under {args.path}")
        for f in findings:
            print(f.message)
        return EXIT_OK
    # Incremental saves (a step that took files from earlier ones): two more columns, the bytes
    # each step wrote and those it took from earlier steps (the SIZE of a step counts both).
    shared = any(e.get("referred_bytes") for e in entries)
    rows = []
    for e in entries:
        status = e["status"] if e["status"] in ("listed", "verified") else e["status"].upper()
        order = e.get("commit_order")
        row = [e["step"], "-" if order is None else f"{order}{' latest' if order == latest_order else ''}",
               fmt_time(e["commit_time"]), human_bytes(e["bytes"])]
        if shared:
            row += [human_bytes(e.get("written_bytes")), human_bytes(e.get("referred_bytes"))]
        row += ["-" if e["files"] is None else e["files"], status, fmt_metrics(e["metrics"])]
        rows.append(row[:1] + [e["tier"]] + row[1:] if tiered else row)
    headers = ["STEP", "ORDER", "COMMITTED", "SIZE"] + (["WRITTEN", "SHARED"] if shared else []) + [
        "FILES", "STATUS", "METRICS"]
    right = (0, 3, 4, 5, 6) if shared else (0, 3, 4)
    if tiered:
        print(render_table(headers[:1] + ["TIER"] + headers[1:], rows, right=tuple(i + (i > 0) for i in right)))
    else:
        print(render_table(headers, rows, right=right))
    ok = [e for e in entries if e["status"] in ("listed", "verified")]
    bad = [e for e in entries if e["status"] not in ("listed", "verified")]
    ndamaged = sum(e["status"] == "damaged" for e in entries)
    nforeign = sum(e["status"] == "foreign" for e in entries)
    print(f"\n{len(ok) + ndamaged} committed ({ndamaged} damaged), "
          f"{sum(e['status'] == 'incomplete' for e in entries)} incomplete"
          + (f", {nforeign} foreign" if nforeign else "")
          + f"; {human_bytes(sum(e['bytes'] or 0 for e in entries))} in all"
          + (f" ({human_bytes(sum(e.get('written_bytes') or 0 for e in entries))} written by the steps, "
             f"{human_bytes(sum(e.get('referred_bytes') or 0 for e in entries))} taken from earlier steps: "
             f"on local paths hard links, stored once)" if shared else "")
          + ("; contents not read (run verify for checksums)" if ok and not args.verify else ""))
    if timed:
        print(f"commit order (oldest first): {', '.join(str(step) for _, step in saves)}")
        print(intact_line(latest, skipped, verified=bool(args.verify)))
    for e in bad:
        where = f"{e['tier']} {e['name']}" if tiered else e["name"]
        print(f"  step {e['step']} ({where}): {e['status']}: {e['problem']}")
    if incomplete:
        state = holder["text"] if holder is not None else "no writer ever took the writer lease"
        print(f"incomplete: {state}; `async-ckpt rm {args.path} --incomplete` deletes the steps that never "
              f"committed (refused while a writer holds the lease)")
    nother = sum("saved_for" in e for e in entries)
    if nother:
        print(foreign_note(nother, home, "FOREIGN, left out of the commit order and latest"))
    for f in findings:
        print(f.message)
    return code


# ---- show ------------------------------------------------------------------------------------

def _leaves(metadata: Any) -> List[Dict[str, Any]]:
    """One record per saved entry: its path, kind, dtype, shape and size."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    mappings = metadata.planner_data or {}
    storage_data = metadata.storage_data or {}
    out = []
    for fqn, md in metadata.state_dict_metadata.items():
        path = [str(p) for p in mappings.get(fqn, fqn.split("."))]
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            shape = list(md.size)
            numel = 1
            for d in shape:
                numel *= d
            out.append({"key": fqn, "path": path, "kind": "tensor", "dtype": str(dtype).replace("torch.", ""),
                        "shape": shape, "bytes": numel * dtype.itemsize, "shards": len(md.chunks)})
        else:
            info = storage_data.get(MetadataIndex(fqn))
            out.append({"key": fqn, "path": path, "kind": "object", "dtype": None, "shape": None,
                        "bytes": getattr(info, "length", None), "shards": 1})
    return out


_MAX_VALUE_BYTES = 64 * 1024


def _read_values(storage: Storage, where: str, files: Dict[str, Any], metadata: Any,
                 leaves: List[Dict[str, Any]]) -> None:
    """Add ``value`` (a short repr) to the small non-tensor leaves, read by byte range through
    the one verified read (:func:`~async_ckpt.io.ranges.read_ranges`)."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from ..errors import CheckpointError
    from ..format.unpickling import load_value
    from ..io.ranges import read_ranges

    by_file: Dict[str, List[Tuple[Dict[str, Any], Any]]] = {}
    for leaf in leaves:
        info = (metadata.storage_data or {}).get(MetadataIndex(leaf["key"]))
        if leaf["kind"] == "object" and info is not None and info.length <= _MAX_VALUE_BYTES:
            by_file.setdefault(info.relative_path, []).append((leaf, info))
    for name, items in by_file.items():
        try:
            got = read_ranges(storage, where, {name: files[name]}, {name: [(i.offset, i.length) for _, i in items]})
        except CheckpointError as exc:  # the file is damaged: its values are not shown (verify says why)
            problem = str(exc)[len(f"{where}/{name}: "):] if str(exc).startswith(f"{where}/{name}: ") else str(exc)
            for leaf, _ in items:
                leaf["value"] = f"<not shown: {name} {problem}>"
            continue
        for leaf, info in items:
            try:  # plain values, torch types and RNG states only, never arbitrary classes
                value = load_value(io.BytesIO(got[(name, info.offset)]), leaf["key"])
                text = repr(value)
            except Exception as exc:  # noqa: BLE001 - one value that cannot be shown is named, the others shown
                text = f"<not shown: {type(exc).__name__}>"
            leaf["value"] = text if len(text) <= 60 else text[:57] + "..."


def cmd_show(args: argparse.Namespace) -> int:
    storage, layout = open_root(args)
    latest = args.step in (None, "latest")
    intact, skipped = latest_intact(layout) if latest else (None, [])
    step = parse_step(args.step, layout)
    copy, metadata = read_step_metadata(storage, layout, step)
    man = copy.manifest
    leaves = _leaves(metadata)
    if args.values:
        _read_values(storage, copy.where, man.files, metadata, leaves)
    tensors = [x for x in leaves if x["kind"] == "tensor"]
    if args.json:
        print_json({"step": step, "commit_time": man.commit_time, "metrics": man.metrics,
                     "world_size": man.world_size, "files": {k: v.size for k, v in man.files.items()},
                     "written_bytes": man.written_bytes, "referred_bytes": man.referred_bytes,
                     "shared_files": {k: {"size": v.size, "ref": v.ref} for k, v in sorted(man.files.items())
                                      if v.ref is not None},
                     "entries": leaves, "latest": latest,
                     **({"newer_damaged": skipped} if latest else {})})
        return EXIT_OK
    print(f"step {step}  committed {fmt_time(man.commit_time)}  {format_count(len(tensors), 'tensor')}, "
          f"{human_bytes(sum(x['bytes'] for x in tensors))}  "
          f"({len(man.files)} files, {human_bytes(sum(r.size for r in man.files.values()))} on storage)")
    if latest:
        print(intact_line(intact, skipped, verified=False, checks="its files' sizes"))
    if man.metrics:
        print(f"metrics: {fmt_metrics(man.metrics)}")
    # Build the tree, with the size and tensor count of every inner node.
    tree: Dict[str, Any] = {}
    for leaf in leaves:
        node = tree
        for p in leaf["path"][:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):  # a key that is both a leaf and a prefix: keep both visible
                break
        else:
            node[leaf["path"][-1]] = leaf

    def totals(node: Dict[str, Any]) -> Tuple[int, int]:
        n = b = 0
        for v in node.values():
            if isinstance(v, dict) and "kind" not in v:
                n2, b2 = totals(v)
                n, b = n + n2, b + b2
            elif v["kind"] == "tensor":
                n, b = n + 1, b + v["bytes"]
        return n, b

    rows: List[List[str]] = []

    def walk(node: Dict[str, Any], depth: int) -> None:
        for name, v in node.items():
            pad = "  " * depth
            if isinstance(v, dict) and "kind" not in v:
                n, b = totals(v)
                rows.append([f"{pad}{name}/", "", "", human_bytes(b) if n else "",
                             f"{n} tensor{'s' if n != 1 else ''}" if n else ""])
                walk(v, depth + 1)
            elif v["kind"] == "tensor":
                shape = "[" + ", ".join(map(str, v["shape"])) + "]"
                note = f"{v['shards']} shards" if v["shards"] > 1 else ""
                rows.append([f"{pad}{name}", v["dtype"], shape, human_bytes(v["bytes"]), note])
            else:
                rows.append([f"{pad}{name}", "object", "", human_bytes(v["bytes"]), v.get("value", "pickled value")])

    walk(tree, 0)
    print(render_table(["KEY", "DTYPE", "SHAPE", "SIZE", ""], rows, right=(3,)))
    if man.referred_bytes:  # an incremental save: which files it took from earlier steps
        refs = sorted((k, v) for k, v in man.files.items() if v.ref is not None)
        print(f"\nincremental: {human_bytes(man.written_bytes)} written, {human_bytes(man.referred_bytes)} "
              f"taken from earlier steps ({len(refs)} shared file{'s' if len(refs) != 1 else ''}; "
              f"hard links on local paths: stored once)")
        for name, rec in refs:
            print(f"  {shown(name)}  {human_bytes(rec.size)}  first written as {shown(rec.ref or '')}")
    return EXIT_OK
