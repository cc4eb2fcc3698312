"""The ``async-ckpt`` command: look into, verify, prune and export checkpoint directories, and read
the save statistics log.

Every subcommand takes a checkpoint root (a local path or any fsspec URL), prints a readable
table, and with ``--json`` prints one JSON document instead. Nothing here writes to the
checkpoint root except ``prune`` (and ``prune --dry-run`` does not); nothing here follows a
step directory that is a symbolic link (it is listed as foreign and left alone). Exit codes: 0 success,
1 a damaged checkpoint was found (``verify``) or read, 2 any other error (bad arguments, no
such step or path, storage errors). Expected errors print one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .errors import CheckpointError, CorruptCheckpointError, StepNotFoundError
from .lifecycle.catalog import StepCatalog
from .storage.fs import Storage
from .storage.layout import _STEP_RE, _TMP_RE, _TRASH_RE, _VER_RE, CheckpointLayout
from .storage.lease import writer_lease
from .storage.manifest import MARKER_NAME, Manifest, shown

EXIT_OK, EXIT_DAMAGED, EXIT_ERROR = 0, 1, 2
_CHUNK = 8 * 2**20


# ---- formatting ------------------------------------------------------------------------------

def human_bytes(n: Optional[float]) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def _fmt_time(t: Optional[float]) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _fmt_metrics(metrics: Dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())) or "-"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Sequence[int] = ()) -> str:
    rows = [[_cell(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def _cell(c: Any) -> str:
    """A table cell: names and values read from a checkpoint may hold control characters
    (terminal escape codes); those are shown ``repr``-escaped."""
    text = str(c)
    return text if text.isprintable() else repr(text)[1:-1]


def _strict(o: Any) -> Any:
    """Non-finite floats (an ``inf`` metric) as strings: the output stays strict JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _strict(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_strict(v) for v in o]
    return o


def _print_json(obj: Any) -> None:
    print(json.dumps(_strict(obj), indent=2, sort_keys=True, allow_nan=False))


def _progress(total: int, desc: str, enabled: Optional[bool]) -> Any:
    """A tqdm bar on stderr (shown on a terminal, or always with ``--progress``)."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the [cli] extra; without it there is no bar
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=None if enabled is None else not enabled, leave=False)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_description(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


# ---- opening a root --------------------------------------------------------------------------

def _parse_options(pairs: Optional[List[str]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for p in pairs or []:
        if "=" not in p:
            raise ValueError(f"--storage-option needs KEY=VALUE, got {p!r}")
        k, v = p.split("=", 1)
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def _open(args: argparse.Namespace) -> Tuple[Storage, CheckpointLayout]:
    storage = Storage(args.path, _parse_options(args.storage_option))
    if not storage.exists(storage.root):
        raise FileNotFoundError(f"no such checkpoint directory: {args.path}")
    return storage, CheckpointLayout(storage, "auto")


def _parse_step(text: Optional[str], layout: CheckpointLayout) -> int:
    """An explicit step, or the most recently committed one for ``None``/``latest``."""
    if text is None or text == "latest":
        latest = StepCatalog(layout, time.time).latest()
        if latest is None:
            steps = layout.committed_steps()  # none whose manifest reads: the highest, to report it
            if not steps:
                raise StepNotFoundError(f"no committed checkpoint under {layout.storage.url}")
            return steps[-1]
        return latest
    if not text.isdigit():
        raise ValueError(f"STEP must be a non-negative integer or 'latest', got {text!r}")
    step = int(text)
    steps = layout.committed_steps()
    if step not in steps:
        shown = steps if len(steps) <= 20 else ["..."] + steps[-20:]
        raise StepNotFoundError(f"no committed checkpoint for step {step} under {layout.storage.url} "
                                f"(committed: {', '.join(map(str, shown)) or 'none'})", step=step)
    return step


# ---- ls --------------------------------------------------------------------------------------

def _step_entry(storage: Storage, layout: CheckpointLayout, name: str, locations: Dict[int, str]) -> Dict[str, Any]:
    """What ``ls`` reports for one directory under the root (read only, contents never read).

    ``listed``: committed, and :meth:`CheckpointLayout.check_step` passes (the marker vouches
    for the manifest; every file it lists is a regular file in the step directory, of the
    listed size); ``damaged``: committed, but that check fails; ``superseded``: an older
    committed copy of a step that a newer copy replaced (a crash interrupted the re-save; the
    next writer removes it); ``incomplete``: never committed; ``foreign``: a symbolic link,
    never followed.
    """
    path = storage.join(name)
    step_of = CheckpointLayout.step_of(name)
    if layout.is_foreign_link(name):
        return {"step": step_of, "name": name, "status": "foreign", "commit_time": None, "bytes": None,
                "files": None, "metrics": {},
                "problem": f"{name} is a symbolic link (to {os.path.realpath(path)!r}); async_ckpt never reads, "
                           "restores or deletes through it"}
    listing = {e["name"]: e for e in storage.listdir(path)}
    disk = sum(int(e.get("size") or 0) for e in listing.values() if e.get("type") != "directory")
    current = step_of is not None and locations.get(step_of) == path
    if not current and MARKER_NAME in listing and not _TRASH_RE.match(name):
        kept = locations.get(step_of, "?") if step_of is not None else "?"
        return {"step": step_of, "name": name, "status": "superseded", "commit_time": None, "bytes": disk,
                "files": len(listing), "metrics": {},
                "problem": f"an older committed copy of step {step_of} (the current one is "
                           f"{shown(kept.rsplit('/', 1)[-1])}); the next writer removes it"}
    m = (_TMP_RE.match(name) or _TRASH_RE.match(name)) if not current else None
    if m:
        what = "a save in progress or one that never finished" if name.startswith(".tmp-") else "a replaced step being deleted"
        return {"step": int(m.group(1)), "name": name, "status": "incomplete", "commit_time": None,
                "bytes": disk, "files": len(listing), "metrics": {}, "problem": f"{name}: {what}"}
    step = int(step_of) if step_of is not None else -1
    entry: Dict[str, Any] = {"step": step, "name": name, "status": "listed", "commit_time": None, "bytes": disk,
                             "files": len(listing), "metrics": {}, "problem": None}
    if MARKER_NAME not in listing:
        entry["status"] = "incomplete"
        entry["problem"] = "no COMMITTED marker (a save in progress or one that never finished, or not written by async_ckpt)"
        return entry
    try:
        man, bad = layout.check_step(step)
    except CheckpointError as exc:
        entry.update(status="damaged", problem=str(exc))
        return entry
    problems = [f"{shown(n)}: {what}" for n, what in bad.items()]
    entry.update(commit_time=man.commit_time, metrics=dict(man.metrics), files=len(man.files),
                 bytes=sum(r.size for r in man.files.values()), nbytes=man.nbytes,
                 num_tensors=man.num_tensors, world_size=man.world_size)
    if problems:
        entry.update(status="damaged", problem="; ".join(problems))
    return entry


def cmd_ls(args: argparse.Namespace) -> int:
    storage, layout = _open(args)
    names = [e["name"] for e in storage.listdir(storage.root)
             if (e.get("type") == "directory" or e.get("islink"))
             and (_STEP_RE.match(e["name"]) or _VER_RE.match(e["name"]) or _TMP_RE.match(e["name"])
                  or _TRASH_RE.match(e["name"]))]
    locations = layout.locations()
    with ThreadPoolExecutor(max(1, min(16, len(names)))) as pool:
        entries = list(pool.map(lambda n: _step_entry(storage, layout, n, locations), names))
    entries.sort(key=lambda e: (e["step"], e["name"]))
    # Commit order is the order: 1 is the oldest commit; the newest is the latest step.
    timed = sorted((e for e in entries if e["status"] in ("listed", "damaged") and e["commit_time"] is not None),
                   key=lambda e: (e["commit_time"], e["step"]))
    for i, e in enumerate(timed, 1):
        e["commit_order"] = i
    latest = timed[-1]["step"] if timed else None
    if args.json:
        _print_json({"path": args.path, "steps": entries, "latest": latest,
                     "commit_order": [e["step"] for e in timed]})
        return EXIT_OK
    if not entries:
        print(f"no checkpoints under {args.path}")
        return EXIT_OK
    rows = []
    for e in entries:
        status = e["status"] if e["status"] == "listed" else e["status"].upper()
        order = e.get("commit_order")
        rows.append([e["step"], "-" if order is None else f"{order}{' latest' if e['step'] == latest and order == len(timed) else ''}",
                     _fmt_time(e["commit_time"]), human_bytes(e["bytes"]),
                     "-" if e["files"] is None else e["files"], status, _fmt_metrics(e["metrics"])])
    print(_table(["STEP", "ORDER", "COMMITTED", "SIZE", "FILES", "STATUS", "METRICS"], rows, right=(0, 3, 4)))
    ok = [e for e in entries if e["status"] == "listed"]
    bad = [e for e in entries if e["status"] != "listed"]
    ndamaged = sum(e["status"] == "damaged" for e in entries)
    nforeign = sum(e["status"] == "foreign" for e in entries)
    print(f"\n{len(ok) + ndamaged} committed ({ndamaged} damaged), "
          f"{sum(e['status'] == 'incomplete' for e in entries)} incomplete"
          + (f", {nforeign} foreign" if nforeign else "")
          + f"; {human_bytes(sum(e['bytes'] or 0 for e in entries))} in all"
          + ("; contents not read (run verify for checksums)" if ok else ""))
    if timed:
        print(f"commit order (oldest first): {', '.join(str(e['step']) for e in timed)}; "
              f"latest (the newest commit): {latest}")
    for e in bad:
        print(f"  step {e['step']} ({e['name']}): {e['status']}: {e['problem']}")
    return EXIT_OK


# ---- show ------------------------------------------------------------------------------------

def _read_metadata(storage: Storage, layout: CheckpointLayout, step: int) -> Tuple[Manifest, Any]:
    from .storage.dcp import METADATA_NAME, FsspecStorageReader

    man = layout.read_manifest(step)
    if METADATA_NAME not in man.files:
        raise CorruptCheckpointError(f"step {step}: manifest lists no {METADATA_NAME}", step=step)
    reader = FsspecStorageReader(storage, layout.locate(step), files=man.files, verify=True)
    return man, reader.read_metadata()


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


def _read_values(storage: Storage, where: str, metadata: Any, leaves: List[Dict[str, Any]]) -> None:
    """Add ``value`` (a short repr) to the small non-tensor leaves, read by byte range."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    by_file: Dict[str, List[Tuple[Dict[str, Any], Any]]] = {}
    for leaf in leaves:
        info = (metadata.storage_data or {}).get(MetadataIndex(leaf["key"]))
        if leaf["kind"] == "object" and info is not None and info.length <= _MAX_VALUE_BYTES:
            by_file.setdefault(info.relative_path, []).append((leaf, info))
    for name, items in by_file.items():
        problem = storage.file_problem(f"{where}/{name}", where)  # names were checked with the metadata
        if problem is not None:
            for leaf, _ in items:
                leaf["value"] = f"<not shown: {name} {problem}>"
            continue
        with storage.fs.open(f"{where}/{name}", "rb") as f:
            for leaf, info in sorted(items, key=lambda x: x[1].offset):
                f.seek(info.offset)
                try:  # weights_only: plain values and torch types only, never arbitrary classes
                    value = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
                    text = repr(value)
                except Exception as exc:
                    text = f"<not shown: {type(exc).__name__}>"
                leaf["value"] = text if len(text) <= 60 else text[:57] + "..."


def cmd_show(args: argparse.Namespace) -> int:
    storage, layout = _open(args)
    step = _parse_step(args.step, layout)
    man, metadata = _read_metadata(storage, layout, step)
    leaves = _leaves(metadata)
    if args.values:
        _read_values(storage, layout.locate(step), metadata, leaves)
    tensors = [x for x in leaves if x["kind"] == "tensor"]
    if args.json:
        _print_json({"step": step, "commit_time": man.commit_time, "metrics": man.metrics,
                     "world_size": man.world_size, "files": {k: v.size for k, v in man.files.items()},
                     "entries": leaves})
        return EXIT_OK
    print(f"step {step}  committed {_fmt_time(man.commit_time)}  {len(tensors)} tensors, "
          f"{human_bytes(sum(x['bytes'] for x in tensors))}  "
          f"({len(man.files)} files, {human_bytes(sum(r.size for r in man.files.values()))} on storage)")
    if man.metrics:
        print(f"metrics: {_fmt_metrics(man.metrics)}")
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
    print(_table(["KEY", "DTYPE", "SHAPE", "SIZE", ""], rows, right=(3,)))
    return EXIT_OK


# ---- verify ----------------------------------------------------------------------------------

def _verify_step(storage: Storage, layout: CheckpointLayout, step: int, bar: Any) -> Dict[str, Any]:
    """Read every file of a committed step and check it against the manifest; list the problems."""
    from .storage.dcp import METADATA_NAME, load_metadata
    from .storage.manifest import crc32c

    res: Dict[str, Any] = {"step": step, "ok": False, "files": 0, "bytes": 0, "problems": []}
    try:
        man, bad = layout.check_step(step)  # what ls checks: verify reports all of it, and more
    except CheckpointError as exc:
        res["problems"].append(str(exc))
        return res
    res["files"] = len(man.files)
    where = layout.locate(step)
    meta_bytes: Optional[bytes] = None
    for name, rec in sorted(man.files.items()):
        if name in bad:
            res["problems"].append(f"{shown(name)}: {bad[name]}")
            continue
        bar.set_description(f"step {step} {shown(name)}")
        size = crc = 0
        try:
            with storage.fs.open(f"{where}/{name}", "rb") as f:
                keep = name == METADATA_NAME
                parts = []
                while True:
                    chunk = f.read(_CHUNK)
                    if not chunk:
                        break
                    crc = crc32c(chunk, crc)
                    size += len(chunk)
                    bar.update(len(chunk))
                    if keep:
                        parts.append(chunk)
                if keep:
                    meta_bytes = b"".join(parts)
        except FileNotFoundError:
            res["problems"].append(f"{name}: file is missing")
            continue
        except OSError as exc:
            res["problems"].append(f"{name}: cannot be read ({exc})")
            continue
        res["bytes"] += size
        if size != rec.size:
            res["problems"].append(f"{name}: size is {size} bytes, manifest says {rec.size}")
        elif crc != rec.crc32c:
            res["problems"].append(f"{name}: checksum mismatch (crc32c {crc:#010x}, manifest says {rec.crc32c:#010x})")
    if METADATA_NAME not in man.files:
        res["problems"].append(f"manifest lists no {METADATA_NAME}")
    elif meta_bytes is not None and not any(p.startswith(METADATA_NAME) for p in res["problems"]):
        try:
            md = load_metadata(meta_bytes, where=f"step {step} {METADATA_NAME}")
        except CheckpointError as exc:
            res["problems"].append(str(exc))
        else:  # every byte range the metadata points at must lie inside a listed file
            try:
                for idx, info in (md.storage_data or {}).items():
                    held = man.files.get(info.relative_path)
                    if held is None:
                        res["problems"].append(f"{shown(idx.fqn)}: stored in {shown(info.relative_path)}, "
                                               "which the manifest lacks")
                    elif info.offset < 0 or info.length < 0 or info.offset + info.length > held.size:
                        res["problems"].append(f"{shown(idx.fqn)}: byte range ends past the end of "
                                               f"{shown(info.relative_path)}")
            except (AttributeError, TypeError) as exc:
                res["problems"].append(f"{METADATA_NAME}: storage data is malformed ({shown(exc)})")
    res["ok"] = not res["problems"]
    return res


def cmd_verify(args: argparse.Namespace) -> int:
    storage, layout = _open(args)
    if args.all:
        if args.step is not None:
            raise ValueError("give a STEP or --all, not both")
        steps = layout.committed_steps()
        if not steps:
            raise StepNotFoundError(f"no committed checkpoint under {storage.url}")
    else:
        steps = [_parse_step(args.step, layout)]
    total = 0
    for s in steps:
        try:
            total += sum(r.size for r in layout.read_manifest(s).files.values())
        except CheckpointError:
            pass
    bar = _progress(total, "verify", args.progress)
    try:
        results = [_verify_step(storage, layout, s, bar) for s in steps]
    finally:
        bar.close()
    damaged = [r for r in results if not r["ok"]]
    if args.json:
        _print_json({"path": args.path, "ok": not damaged, "steps": results})
    else:
        for r in results:
            state = "ok" if r["ok"] else "DAMAGED"
            print(f"step {r['step']}: {state} ({r['files']} files, {human_bytes(r['bytes'])} read)")
            for p in r["problems"]:
                print(f"  {p}")
        if damaged:
            print(f"{len(damaged)} of {len(results)} step(s) damaged: {', '.join(str(r['step']) for r in damaged)}",
                  file=sys.stderr)
    return EXIT_DAMAGED if damaged else EXIT_OK


# ---- prune -----------------------------------------------------------------------------------

def _retention(keep_last: int, keep_every: Optional[int]) -> Any:
    from . import policies

    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"--keep-last must be >= 1, got {keep_last}")
    latest = policies.KeepLatest(keep_last)
    if keep_every is None:
        return latest
    if keep_every < 1:
        raise ValueError(f"--keep-every must be >= 1, got {keep_every}")
    return policies.AnyOf([latest, policies.KeepEveryNSteps(keep_every)])


def cmd_prune(args: argparse.Namespace) -> int:
    from .policies import CheckpointInfo

    storage, layout = _open(args)
    policy = _retention(args.keep_last, args.keep_every)
    infos: List[CheckpointInfo] = []
    unreadable: Dict[int, str] = {}
    sizes: Dict[int, int] = {}
    for step in layout.committed_steps():
        try:  # damaged steps (marker, manifest, a file missing or of the wrong size) are left alone
            m, bad = layout.check_step(step)
        except CheckpointError as exc:
            unreadable[step] = str(exc)
            continue
        if bad:
            unreadable[step] = "; ".join(f"{shown(n)}: {what}" for n, what in bad.items())
            continue
        infos.append(CheckpointInfo(step, m.commit_time, dict(m.metrics), m.nbytes))
        sizes[step] = sum(r.size for r in m.files.values())
    ordered = sorted(infos, key=lambda c: (c.commit_time, c.step))
    # The step always kept is the newest commit that verifies in full (checksums, metadata):
    # newer ones that fail are damaged, left alone and never count as the newest kept. With
    # none that verifies, nothing is deleted.
    anchor = None
    for c in reversed(ordered):
        bar = _progress(sizes[c.step], f"verify step {c.step}", None)
        try:
            res = _verify_step(storage, layout, c.step, bar)
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
    doomed = [c.step for c in ordered if c.step not in keep]
    deleted: List[int] = []
    if not args.dry_run and doomed:
        lease = writer_lease(storage)
        lease.acquire(0.0)  # LeaseHeldError while a training job writes here: nothing is deleted
        try:
            for s in doomed:
                layout.delete(s)
                deleted.append(s)
        finally:
            lease.release()
    kept = sorted(keep & {c.step for c in ordered})
    if args.json:
        _print_json({"path": args.path, "dry_run": args.dry_run, "kept": kept,
                     "deleted": sorted(doomed) if args.dry_run else deleted,
                     "skipped_damaged": {str(k): v for k, v in sorted(unreadable.items())}})
        return EXIT_OK
    action = "would delete" if args.dry_run else "deleted"
    rows = [[c.step, _fmt_time(c.commit_time), human_bytes(c.nbytes),
             "keep" if c.step in keep else action] for c in sorted(ordered, key=lambda c: c.step)]
    rows += [[s, "-", "-", "skip (damaged)"] for s in sorted(unreadable)]
    if rows:
        print(_table(["STEP", "COMMITTED", "DATA", "ACTION"], rows, right=(0, 2)))
    print(f"{'dry run: ' if args.dry_run else ''}{len(kept)} kept, {len(doomed)} "
          f"{'to delete' if args.dry_run else 'deleted'}"
          + (f", {len(unreadable)} damaged step(s) left alone" if unreadable else ""))
    return EXIT_OK


# ---- export ----------------------------------------------------------------------------------

def load_step(path: str, step: Optional[int] = None, *, key: Optional[str] = None, verify: bool = True,
              allow_pickle: bool = False, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[int, Any]:
    """Read a committed step into a fresh CPU state dict, without knowing its structure.

    ``step=None`` reads the newest committed step. ``key`` (a dotted prefix such as ``"model"``)
    reads only that subtree and returns it. Returns ``(step, state)``. Nothing is written.
    """
    from .storage.dcp import load_state_dict

    storage = Storage(path, storage_options)
    layout = CheckpointLayout(storage, "auto")
    step = _parse_step(None if step is None else str(step), layout)
    man, metadata = _read_metadata(storage, layout, step)
    full = _template(metadata, set(man.extra.get("int_keys", ())))
    target: Dict[str, Any] = full
    parts: List[Any] = []
    if key:  # keep only the subtree, at its real position, so that DCP loads nothing else
        node: Any = full
        target = {}
        dst: Any = target
        names = key.split(".")
        for i, name in enumerate(names):
            if not isinstance(node, dict):
                raise ValueError(f"--key {key!r}: cannot select inside {type(node).__name__} "
                                 f"{'.'.join(names[:i])!r}; select it whole")
            k: Any = name if name in node else (int(name) if name.isdigit() and int(name) in node else None)
            if k is None:
                raise ValueError(f"step {step} has no entry {key!r} (top-level keys: {', '.join(map(str, full))})")
            parts.append(k)
            node = node[k]
            if i == len(names) - 1:
                dst[k] = node
            else:
                dst[k] = {}
                dst = dst[k]
    load_state_dict(storage, layout.locate(step), target, files=man.files, verify=verify,
                    allow_pickle=allow_pickle, metadata=metadata)
    out: Any = target
    for k in parts:
        out = out[k]
    return step, out


def _template(metadata: Any, int_keys: set) -> Dict[str, Any]:
    """An empty state dict with the structure a checkpoint was saved from.

    In DCP's paths an ``int`` is a list index; dict keys that were ints at save time are
    strings there and listed in the manifest's ``int_keys``. Tensors become ``torch.empty`` of
    the saved shape and dtype, other values ``None``; DCP's load fills both in.
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root: Dict[str, Any] = {}
    mappings = metadata.planner_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        raw = tuple(mappings.get(fqn, (fqn,)))
        value = torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        cur: Any = root
        prefix = ""
        for i, part in enumerate(raw):
            prefix = f"{prefix}.{part}" if prefix else str(part)
            key = int(part) if isinstance(part, str) and prefix in int_keys else part
            if i == len(raw) - 1:
                new: Any = value
            else:
                new = [] if isinstance(raw[i + 1], int) else {}
            if isinstance(cur, list):
                while len(cur) <= key:
                    cur.append(None)
                if cur[key] is None or i == len(raw) - 1:
                    cur[key] = new
            elif key not in cur or i == len(raw) - 1:
                cur[key] = new
            cur = cur[key]
    return root


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """Nested dicts/lists -> ``{"a.b.0": leaf}`` (the key style of ``state_dict()``)."""
    out: Dict[str, Any] = {}
    if isinstance(tree, dict):
        items: Iterable[Tuple[Any, Any]] = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    for k, v in items:
        name = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (dict, list, tuple)) and len(v):
            out.update(flatten(v, name))
        else:
            out[name] = v
    return out


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    out = args.out
    ext = out.rsplit(".", 1)[-1].lower() if "." in out.rsplit("/", 1)[-1] else ""
    if ext not in ("pt", "pth", "safetensors"):
        raise ValueError(f"OUT must end in .pt, .pth or .safetensors, got {out!r}")
    storage, layout = _open(args)
    step = _parse_step(args.step, layout)
    step, state = load_step(args.path, step, key=args.key, allow_pickle=args.allow_pickle,
                            storage_options=_parse_options(args.storage_option))
    flat = flatten(state)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if ext == "safetensors":
        others = sorted(k for k, v in flat.items() if not isinstance(v, torch.Tensor))
        if others:
            raise ValueError(
                f"safetensors holds tensors only, but step {step} also has {len(others)} other entries "
                f"({', '.join(others[:5])}{' ...' if len(others) > 5 else ''}); export to .pt, or pick a "
                f"tensors-only subtree with --key (e.g. --key model)")
        try:
            from safetensors.torch import save as st_save
        except ImportError:
            raise ImportError("exporting .safetensors needs the safetensors package "
                              "(pip install 'async_ckpt[cli]')") from None
        data = st_save({k: v.contiguous() for k, v in tensors.items()},
                       metadata={"format": "pt", "async_ckpt_step": str(step)})
        _write_out(out, lambda f: f.write(data))
    else:
        _write_out(out, lambda f: torch.save(state, f))
    if args.json:
        _print_json({"step": step, "out": out, "format": ext, "tensors": len(tensors), "tensor_bytes": nbytes,
                     "entries": len(flat)})
    else:
        print(f"exported step {step} ({len(tensors)} tensors, {human_bytes(nbytes)}"
              f"{f', {len(flat) - len(tensors)} other entries' if len(flat) != len(tensors) else ''}) to {out}")
    return EXIT_OK


def _write_out(out: str, write: Any) -> None:
    import fsspec

    fs, p = fsspec.core.url_to_fs(out)
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):  # write beside, then rename: never a half-written OUT
        p = os.path.abspath(p)
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        tmp = f"{p}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, p)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    else:
        with fs.open(p, "wb") as f:
            write(f)


# ---- stats -----------------------------------------------------------------------------------

def cmd_stats(args: argparse.Namespace) -> int:
    from .stats import DEFAULT_STATS_LOG, _check_relpath, read_stats_log

    storage, _ = _open(args)
    path = storage.join(_check_relpath(args.log or DEFAULT_STATS_LOG))
    if not storage.exists(path):
        raise FileNotFoundError(f"no stats log at {storage.url_of(path)} (create the manager with stats_log=True)")
    records = read_stats_log(storage.url_of(path), _parse_options(args.storage_option))
    if args.last is not None:
        records = records[-args.last:] if args.last > 0 else []
    if args.json:
        _print_json({"path": args.path, "saves": [r.to_dict() for r in records]})
        return EXIT_OK
    if not records:
        print("no saves logged")
        return EXIT_OK
    rows = [[r.step, _fmt_time(r.commit_time), human_bytes(r.nbytes), r.files, f"{r.blocking_s * 1e3:.1f}",
             f"{r.queue_wait_s * 1e3:.1f}", f"{r.stage_s * 1e3:.1f}", f"{r.host_copy_gbps:.2f}", f"{r.write_s:.3f}",
             f"{r.write_gbps:.2f}", f"{r.commit_s:.3f}", "-" if r.durable_s is None else f"{r.durable_s:.3f}"]
            for r in records]
    print(_table(["STEP", "COMMITTED", "DATA", "FILES", "BLOCKED_MS", "SLOT_WAIT_MS", "COPY_MS", "COPY_GB/S",
                  "WRITE_S", "WRITE_GB/S", "COMMIT_S", "DURABLE_S"], rows, right=tuple(i for i in range(12) if i != 1)))
    blocked = sorted(r.blocking_s for r in records)
    worst = max(records, key=lambda r: r.blocking_s)
    print(f"\n{len(records)} saves; blocked median {blocked[len(blocked) // 2] * 1e3:.1f} ms, "
          f"max {worst.blocking_s * 1e3:.1f} ms (step {worst.step})")
    return EXIT_OK


# ---- entry point -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("path", metavar="PATH", help="checkpoint root: a local path or an fsspec URL")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable; VALUE is parsed as JSON when it can be)")

    p = argparse.ArgumentParser(prog="async-ckpt", description="Inspect, verify, prune and export async_ckpt "
                                "checkpoint directories (local paths or fsspec URLs).")
    from . import __version__

    p.add_argument("--version", action="version", version=f"async-ckpt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("ls", parents=[common], help="list steps: commit time, size, metrics, status")
    s.set_defaults(fn=cmd_ls)

    s = sub.add_parser("show", parents=[common], help="the tree of keys of a step, with shapes, dtypes, sizes")
    s.add_argument("step", metavar="STEP", nargs="?", help="a step, or 'latest' (default)")
    s.add_argument("--values", action="store_true",
                   help="also read and print small non-tensor values (learning rates, step counters)")
    s.set_defaults(fn=cmd_show)

    s = sub.add_parser("verify", parents=[common], help="check every file's checksum; exit 1 on damage")
    s.add_argument("step", metavar="STEP", nargs="?", help="a step, or 'latest' (default)")
    s.add_argument("--all", action="store_true", help="verify every committed step")
    bar = s.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always show the progress bar (default: only on a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show it")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("prune", parents=[common], help="delete committed steps a retention policy drops")
    s.add_argument("--keep-last", type=int, required=True, metavar="N", help="keep the N newest commits")
    s.add_argument("--keep-every", type=int, metavar="K", help="also keep every step divisible by K")
    s.add_argument("--dry-run", action="store_true", help="show what would be deleted, delete nothing")
    s.set_defaults(fn=cmd_prune)

    s = sub.add_parser("export", parents=[common], help="write a step as one .pt or .safetensors file")
    s.add_argument("step", metavar="STEP", help="a step, or 'latest'")
    s.add_argument("out", metavar="OUT", help="output file (.pt/.pth: torch.save; .safetensors: tensors only)")
    s.add_argument("--key", metavar="PREFIX", help="export only this subtree, e.g. 'model'")
    s.add_argument("--allow-pickle", action="store_true",
                   help="unpickle non-tensor entries outside torch's safe set (only for trusted checkpoints)")
    s.set_defaults(fn=cmd_export)
    s = sub.add_parser("stats", parents=[common], help="the save statistics log (stats_log=True), as a table")
    s.add_argument("--log", metavar="RELPATH", help="the log's path under PATH (default: save_stats.jsonl)")
    s.add_argument("--last", type=int, metavar="N", help="only the N most recent saves")
    s.set_defaults(fn=cmd_stats)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.fn(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `async-ckpt ls ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except CorruptCheckpointError as exc:
        _error(exc)
        return EXIT_DAMAGED
    except (CheckpointError, OSError, ValueError, ImportError) as exc:
        _error(exc)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("async-ckpt: interrupted", file=sys.stderr)
        return 130


def _error(exc: BaseException) -> None:
    msg = _cell(" ".join(str(exc).split()) or type(exc).__name__)  # no control characters on the terminal
    print(f"async-ckpt: error: {msg}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
