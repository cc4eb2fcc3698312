"""``export`` (a step to one torch.save or safetensors file, or a Hugging Face directory) and
``stats`` (the save log)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..errors import CorruptCheckpointError
from ..stats import format_count
from ..storage.step_dirs import StepDirectories
from ..storage.storage import Storage
from .common import (
    EXIT_OK,
    fmt_time,
    human_bytes,
    naming_step,
    open_root,
    parse_options,
    parse_step,
    print_json,
    progress_bar,
    read_step_metadata,
    render_table,
    restore_order,
)

log = logging.getLogger("async_ckpt.cli")

# ---- export ----------------------------------------------------------------------------------

def load_step(path: str, step: Optional[int] = None, *, key: Optional[str] = None, verify: bool = True,
              allow_pickle: bool = False, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[int, Any]:
    """Read a committed step into a fresh CPU state dict, without knowing its structure.

    Nothing is written.

    Args:
        path: the checkpoint root (a local path or fsspec URL).
        step: the step (None: the step ``restore(None)`` takes: the newest commit that
            verifies; a damaged newer one is skipped with a warning, as a restore skips it).
        key: a dotted prefix such as ``"model"``: only that subtree is read and returned.
        verify: check every file's size and checksum as it is read.
        allow_pickle: unpickle non-tensor values outside torch's safe set (trusted
            checkpoints only).
        storage_options: fsspec options for a remote ``path``.

    Returns:
        ``(step, state)``: the step read and its state dict (or the subtree under ``key``).

    Raises:
        StepNotFoundError: ``step`` (or, for None, any step) has no committed checkpoint.
        ValueError: ``key`` names no entry, or selects inside something other than a dict.
        CorruptCheckpointError: a file of the step fails verification (for None: of every
            committed step); its ``step`` names the step.
        UnsafeCheckpointError: a value needs ``allow_pickle=True``.
    """
    storage = Storage(path, storage_options)
    layout = StepDirectories(storage, "auto")
    step, state, _ = read_newest(storage, layout, step, key=key, verify=verify, allow_pickle=allow_pickle)
    return step, state


class NoSuchKeyError(ValueError):
    """``--key`` names no entry of the step."""


def read_newest(storage: Storage, layout: StepDirectories, step: Optional[int], *, key: Optional[str] = None,
                verify: bool = True, allow_pickle: bool = False) -> Tuple[int, Any, List[int]]:
    """:func:`load_step` on an open root; also returns the damaged newer steps it skipped.

    Args:
        storage: the root.
        layout: its step layout.
        step: the step, or None (the newest that verifies, in ``restore(None)``'s order).
        key: as :func:`load_step`.
        verify: as :func:`load_step`.
        allow_pickle: as :func:`load_step`.

    Returns:
        ``(step, state, skipped)``: ``skipped`` lists the damaged steps tried first (None only).

    Raises:
        StepNotFoundError: no such committed step (or none at all).
        CorruptCheckpointError: the step (every step, for None) is damaged.
    """
    if step is not None:
        step = parse_step(str(step), layout)
        return step, _read_step(storage, layout, step, key, verify, allow_pickle), []
    order = restore_order(layout)
    if not order:
        parse_step(None, layout)  # raises StepNotFoundError, naming what the path holds instead
    skipped: List[int] = []
    last: Optional[CorruptCheckpointError] = None
    for s in order:
        try:
            return s, _read_step(storage, layout, s, key, verify, allow_pickle), skipped
        except NoSuchKeyError:  # found in the metadata alone: said of the step restore(None) takes
            from .verify import verify_step

            problems = verify_step(storage, layout, s, progress_bar(0, "", False))["problems"]
            if not problems:
                raise
            damaged = CorruptCheckpointError(f"step {s} is damaged: {'; '.join(problems)}", step=s)
            log.warning("skipping damaged step %d (restore(None) skips it too): %s", s, damaged)
            skipped.append(s)
            last = damaged
        except CorruptCheckpointError as exc:
            log.warning("skipping damaged step %d (restore(None) skips it too): %s", s, exc)
            skipped.append(s)
            last = exc
    raise CorruptCheckpointError(f"every committed step is damaged ({', '.join(map(str, skipped))}); the "
                                 f"oldest: {last}", step=skipped[-1]) from last


def _read_step(storage: Storage, layout: StepDirectories, step: int, key: Optional[str], verify: bool,
               allow_pickle: bool) -> Any:
    from ..io import load_state_dict

    copy, metadata = read_step_metadata(storage, layout, step)
    man = copy.manifest
    full = _template(metadata, set(man.int_keys))
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
                raise NoSuchKeyError(f"step {step} has no entry {key!r} (top-level keys: "
                                     f"{', '.join(map(str, full))})")
            parts.append(k)
            node = node[k]
            if i == len(names) - 1:
                dst[k] = node
            else:
                dst[k] = {}
                dst = dst[k]
    with naming_step(step):
        load_state_dict(storage, copy.where, target, files=man.files, verify=verify,
                        allow_pickle=allow_pickle, metadata=metadata)
    out: Any = target
    for k in parts:
        out = out[k]
    return out


def _template(metadata: Any, int_keys: set) -> Dict[str, Any]:
    """An empty state dict with the structure a checkpoint was saved from.

    In DCP's paths an ``int`` is a list index; dict keys that were ints at save time are
    strings there and listed in the manifest's ``int_keys``. Tensors become ``torch.empty`` of
    the saved shape and dtype, other values ``None``; DCP's load fills both in.
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..format.dcp_layout import set_element

    root: Dict[str, Any] = {}
    mappings = metadata.planner_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        value = torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        set_element(root, tuple(mappings.get(fqn, (fqn,))), value, int_keys=int_keys)
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
    if getattr(args, "fmt", "auto") == "hf":
        return _export_hf(args)
    ext = out.rsplit(".", 1)[-1].lower() if "." in out.rsplit("/", 1)[-1] else ""
    if ext not in ("pt", "pth", "safetensors"):
        raise ValueError(f"OUT must end in .pt, .pth or .safetensors (or pass --format hf for a Hugging Face "
                         f"directory), got {out!r}")
    options = parse_options(args.storage_option)
    storage, layout = open_root(args)
    out_fs, out_path = _out_fs(out, args.path, options)
    if not args.force and out_fs.exists(out_path):  # checked before reading anything
        raise FileExistsError(f"OUT {out} already exists: pass --force to overwrite it")
    latest = args.step == "latest"
    step, state, skipped = read_newest(storage, layout, None if latest else parse_step(args.step, layout),
                                       key=args.key, allow_pickle=args.allow_pickle)
    flat = flatten(state)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if ext == "safetensors":
        others = sorted(k for k, v in flat.items() if not isinstance(v, torch.Tensor))
        if others:
            prefix = f"{args.key}." if args.key else ""
            subtrees = sorted({k[len(prefix):].split(".", 1)[0] for k in flat if "." in k[len(prefix):]})
            pure = [f"{prefix}{t}" for t in subtrees
                    if not any(o[len(prefix):].split(".", 1)[0] == t for o in others)]
            pick = (f", or pick a tensors-only subtree with --key ({', '.join(f'--key {t}' for t in pure[:5])})"
                    if pure else " (no subtree holds tensors only)")
            raise ValueError(
                f"safetensors holds tensors only, but step {step} also has {len(others)} other entr{'y' if len(others) == 1 else 'ies'} "
                f"({', '.join(others[:5])}{' ...' if len(others) > 5 else ''}); export to .pt{pick}")
        try:
            from safetensors.torch import save as st_save
        except ImportError:
            raise ImportError("exporting .safetensors needs the safetensors package "
                              "(pip install safetensors, or from a checkout of async_ckpt: pip install -e '.[cli]')") from None
        data = st_save({k: v.contiguous() for k, v in tensors.items()},
                       metadata={"format": "pt", "async_ckpt_step": str(step)})
        write: Any = lambda f: f.write(data)  # noqa: E731
        total = len(data)
    else:
        write = lambda f: torch.save(state, f)  # noqa: E731
        total = nbytes
    bar = progress_bar(total, f"export step {step}", args.progress)
    try:
        _write_out(out_fs, out_path, lambda f: write(_Counting(f, bar)), force=args.force)
    finally:
        bar.close()
    if args.json:
        print_json({"step": step, "out": out, "format": ext, "tensors": len(tensors), "tensor_bytes": nbytes,
                     "entries": len(flat), "latest": latest, **({"newer_damaged": skipped} if latest else {})})
    else:
        print(f"exported step {step} ({format_count(len(tensors), 'tensor')}, {human_bytes(nbytes)}"
              f"{f', {len(flat) - len(tensors)} other entries' if len(flat) != len(tensors) else ''}) to {out}"
              + (" (latest: the newest intact step, what restore(None) takes"
                 + (f"; newer, damaged, skipped: {', '.join(map(str, skipped))})" if skipped else ")") if latest else ""))
    return EXIT_OK


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """A byte count written as ``save_pretrained``'s ``max_shard_size`` is: ``5GB`` (10^9),
    ``2GiB`` (2^30), ``500MB``, or a plain number of bytes.

    Args:
        text: the size.

    Returns:
        The bytes.

    Raises:
        ValueError: not a positive size.
    """
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"not a size: {text!r} (write e.g. 5GB, 500MB, 2GiB or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[unit])


def _export_hf(args: argparse.Namespace) -> int:
    """``export --format hf``: the step's tensors as sharded safetensors and their index."""
    import torch

    from ..io.hf import INDEX_NAME, save_hf

    max_shard = parse_size(args.max_shard_size)
    dtype = None
    if args.dtype:
        dtype = getattr(torch, args.dtype.replace("torch.", ""), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"--dtype must name a floating-point dtype such as bfloat16 or float16, got {args.dtype!r}")
    options = parse_options(args.storage_option)
    storage, layout = open_root(args)
    out_fs, out_path = _out_fs(args.out, args.path, options)
    if not args.force and out_fs.exists(out_path) and out_fs.ls(out_path):  # checked before reading anything
        raise FileExistsError(f"OUT {args.out} exists and is not empty: pass --force to write into it (only the "
                              f"shard files and {INDEX_NAME} are replaced; other files stay)")
    latest = args.step == "latest"
    step, state, skipped = read_newest(storage, layout, None if latest else parse_step(args.step, layout),
                                       key=args.key, allow_pickle=args.allow_pickle)
    flat = flatten(state)
    others = sorted(k for k, v in flat.items() if not isinstance(v, torch.Tensor))
    if others:
        raise ValueError(f"a Hugging Face checkpoint holds tensors only, but step {step} also has {len(others)} "
                         f"other entries ({', '.join(others[:5])}{' ...' if len(others) > 5 else ''}); pick a "
                         f"tensors-only subtree with --key")
    same = "://" in args.out and args.out.split("://", 1)[0] == (args.path.split("://", 1)[0] if "://" in args.path else "")
    files = save_hf(flat, args.out, max_shard_bytes=max_shard, dtype=dtype, storage_options=options if same else None,
                    metadata={"async_ckpt_step": str(step)})
    nbytes = sum(t.numel() * (t.element_size() if dtype is None or not t.is_floating_point() else
                              torch.empty((), dtype=dtype).element_size()) for t in flat.values())
    if args.json:
        print_json({"step": step, "out": args.out, "format": "hf", "files": files, "tensors": len(flat),
                    "tensor_bytes": nbytes, "latest": latest, **({"newer_damaged": skipped} if latest else {})})
    else:
        print(f"exported step {step} ({len(flat)} tensor{'s' if len(flat) != 1 else ''}, {human_bytes(nbytes)}) "
              f"to {args.out}: {len(files) - 1} shard{'s' if len(files) != 2 else ''} and {INDEX_NAME}")
    return EXIT_OK


def _out_fs(out: str, path: str, options: Dict[str, Any]) -> Tuple[Any, str]:
    """OUT's filesystem: the ``-o`` storage options apply to it when it is on the same kind of
    storage (URL protocol) as PATH, e.g. a bucket reached through an endpoint."""
    import fsspec

    def protocol(url: str) -> str:
        return url.split("://", 1)[0] if "://" in url else "file"

    same = protocol(out) == protocol(path) and protocol(out) != "file"
    return fsspec.core.url_to_fs(out, **(options if same else {}))


class _Counting:
    """A writable file that advances a progress bar by the bytes written through it."""

    def __init__(self, f: Any, bar: Any) -> None:
        self._f, self._bar = f, bar

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        self._bar.update(len(memoryview(data).cast("B")) if n is None else n)
        return len(memoryview(data).cast("B")) if n is None else n

    def __getattr__(self, name: str) -> Any:  # flush, tell, seek...: the file's own
        return getattr(self._f, name)


def _write_out(fs: Any, p: str, write: Any, *, force: bool) -> None:
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):  # write beside, then rename: never a half-written OUT
        p = os.path.abspath(p)
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        tmp = f"{p}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "xb") as f:  # a new file: never written through a link planted at its name
                write(f)
            if force:
                os.replace(tmp, p)
            else:  # refused if OUT appeared meanwhile: never overwrite without --force
                try:
                    os.link(tmp, p)
                except FileExistsError:
                    raise
                except OSError:  # no hard links on this filesystem
                    if os.path.lexists(p):
                        raise FileExistsError(p) from None
                    os.replace(tmp, p)
        except FileExistsError:
            raise FileExistsError(f"OUT {p} already exists: pass --force to overwrite it") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    else:
        with fs.open(p, "wb") as f:
            write(f)


# ---- stats -----------------------------------------------------------------------------------

def cmd_stats(args: argparse.Namespace) -> int:
    import time

    from ..stats import DEFAULT_STATS_LOG, check_stats_relpath, read_stats_log

    storage, _ = open_root(args)
    path = storage.join(check_stats_relpath(args.log or DEFAULT_STATS_LOG))
    if args.watch is not None and not args.watch > 0:
        raise ValueError(f"--watch needs a number of seconds > 0, got {args.watch:g}")

    def read() -> Optional[List[Any]]:
        if not storage.exists(path):
            if args.watch is not None:
                return None
            raise FileNotFoundError(f"no stats log at {storage.url_of(path)} (create the manager with stats_log=True)")
        return read_stats_log(storage.url_of(path), parse_options(args.storage_option))

    if args.watch is None:
        records = read()
        assert records is not None
        return _show_stats(args, records)
    tty = sys.stdout.isatty()
    try:
        while True:  # until Ctrl-C: the table of the newest saves, again every --watch seconds
            records = read()
            if tty:
                sys.stdout.write("\033[H\033[J")  # clear the terminal: the table stays in place
            print(f"{fmt_time(time.time())}  {args.path}  (every {args.watch:g} s; Ctrl-C to stop)")
            if records is None:
                print(f"waiting for the stats log {storage.url_of(path)} (a manager with stats_log=True)")
            else:
                _show_stats(args, records)
            sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return EXIT_OK


def _show_stats(args: argparse.Namespace, records: List[Any]) -> int:
    from ..stats import FAILED, FALLBACK, UPLOAD_SKIPPED, format_rate, format_seconds
    from .plot import marks, plot_run, sparkline

    if args.last is not None:
        records = records[-args.last:] if args.last > 0 else []
    plotted = None
    if args.plot:
        if not records:
            raise ValueError(f"no saves logged under {args.path}: nothing to plot")
        size = plot_run(records, args.plot, f"async_ckpt saves under {args.path}: steps {records[0].step} to "
                                            f"{records[-1].step} ({len(records)} records)")
        plotted = {"out": args.plot, "width": size[0], "height": size[1]}
    if args.json:
        print_json({"path": args.path, "saves": [r.to_dict() for r in records],
                     **({"plot": plotted} if plotted else {})})
        return EXIT_OK
    if not records:
        print("no saves logged")
        return EXIT_OK
    # Incremental saves: the bytes each save wrote and those it took from the last step (columns
    # shown when a save took any); a manager with a local tier logs each tier's copy: TIER.
    shared = any(getattr(r, "referred_bytes", 0) for r in records)
    tiered = any(r.extra.get("tier") for r in records)

    def note(r: Any) -> str:
        if r.extra.get(FAILED):
            return f"FAILED: {r.extra[FAILED]}"[:80]
        return ", ".join(t for k, t in ((UPLOAD_SKIPPED, "upload skipped"), (FALLBACK, "fell back to the local tier"))
                         if r.extra.get(k))

    def done(r: Any, text: str) -> str:
        return "-" if r.extra.get(FAILED) else text

    rows = [[r.step] + ([r.extra.get("tier", "-")] if tiered else [])
            + [fmt_time(r.commit_time), human_bytes(r.nbytes)]
            + ([human_bytes(getattr(r, "written_bytes", None)), human_bytes(getattr(r, "referred_bytes", None))]
               if shared else [])
            + [done(r, str(r.files)), f"{r.blocking_s * 1e3:.1f}", f"{r.queue_wait_s * 1e3:.1f}",
               f"{r.stage_s * 1e3:.1f}", format_rate(r.nbytes, r.stage_s), done(r, f"{r.write_s:.3f}"),
               done(r, format_rate(r.nbytes, r.write_s)), done(r, f"{r.commit_s:.3f}"),
               "-" if r.durable_s is None else f"{r.durable_s:.3f}", note(r)]
            for r in records]
    headers = (["STEP"] + (["TIER"] if tiered else []) + ["COMMITTED", "DATA"]
               + (["WRITTEN", "SHARED"] if shared else [])
               + ["FILES", "BLOCKED_MS", "SLOT_WAIT_MS", "COPY_MS", "COPY_RATE", "WRITE_S", "WRITE_RATE", "COMMIT_S",
                  "DURABLE_S", "NOTE"])
    left = {1 + tiered, len(headers) - 1} | ({1} if tiered else set())  # TIER, COMMITTED, NOTE
    print(render_table(headers, rows, right=tuple(i for i in range(len(headers)) if i not in left)))
    ok = [r for r in records if not r.extra.get(FAILED)]
    failed = len(records) - len(ok)
    # one save written to both tiers is logged once per tier, with the one stall they shared
    saves = list({(r.step, r.blocking_s, r.stage_s): r for r in ok}.values())
    line = (f"\n{len(saves)} saves" + (f" ({len(records)} records: one per tier)" if tiered else "")
            + (f", {failed} failed" if failed else ""))
    if saves:
        blocked = sorted(r.blocking_s for r in saves)
        worst = max(saves, key=lambda r: r.blocking_s)
        line += (f"; blocked median {format_seconds(blocked[len(blocked) // 2])}, max "
                 f"{format_seconds(worst.blocking_s)} (step {worst.step})")
    for tier in sorted({r.extra.get("tier") for r in ok}, key=str):
        durable = sorted(r.durable_s for r in ok if r.extra.get("tier") == tier and r.durable_s is not None)
        if durable:
            slow = max((r for r in ok if r.extra.get("tier") == tier and r.durable_s is not None),
                       key=lambda r: r.durable_s)
            line += (f"; durable{f' ({tier})' if tier else ''} median {format_seconds(durable[len(durable) // 2])}, "
                     f"max {format_seconds(slow.durable_s)} (step {slow.step})")
    print(line)
    print(f"blocked  {sparkline([r.blocking_s for r in saves])}  (per save, oldest first)")
    for tier in sorted({r.extra.get("tier") for r in ok}, key=str):
        print(f"durable  {sparkline([r.durable_s for r in ok if r.extra.get('tier') == tier])}"
              + (f"  ({tier})" if tier else ""))
    found = marks(records)
    parts = [f"{what}: {', '.join(map(str, found[key]))}" for key, what in
             ((UPLOAD_SKIPPED, "uploads skipped"), (FALLBACK, "fell back to the local tier"), (FAILED, "failed"))
             if found[key]]
    if parts:
        print("; ".join(parts))
    if plotted:
        print(f"wrote {plotted['out']} ({plotted['width']} x {plotted['height']} px)")
    return EXIT_OK
