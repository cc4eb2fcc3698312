"""Formatting and opening a checkpoint root: shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import CorruptCheckpointError, StepNotFoundError
from ..lifecycle.catalog import StepCatalog
from ..storage.fs import Storage
from ..storage.layout import CheckpointLayout
from ..storage.manifest import Manifest

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


def _roots(args: argparse.Namespace) -> List[Tuple[str, Storage, CheckpointLayout]]:
    """(tier, storage, layout) of PATH (``persistent``) and, with ``--local-dir``, of the local
    tier (``local``; a multi-rank job's local tier is one rank's ``<local_dir>/rank<r>``)."""
    storage, layout = _open(args)
    roots = [("persistent", storage, layout)]
    local = getattr(args, "local_dir", None)
    if local:
        lstorage = Storage(local)
        if not lstorage.exists(lstorage.root):
            raise FileNotFoundError(f"no such local checkpoint directory: {local}")
        roots.insert(0, ("local", lstorage, CheckpointLayout(lstorage, "auto")))
    return roots


def _home(roots: List[Tuple[str, Storage, CheckpointLayout]]) -> Optional[str]:
    """With a local tier: PATH as local manifests record the checkpoint path they were saved
    for (:func:`~async_ckpt.tiers.root_identity`); None without one."""
    from ..tiers import root_identity

    return root_identity(roots[-1][1]) if len(roots) > 1 else None


def _foreign_note(count: int, home: Optional[str], what: str) -> str:
    """The note line for local copies another job saved (for another checkpoint path)."""
    return (f"note: {count} local cop{'y' if count == 1 else 'ies'} saved for another checkpoint path than "
            f"{home} (another job's, in a shared local_dir): {what}")


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


def _read_metadata(storage: Storage, layout: CheckpointLayout, step: int) -> Tuple[Manifest, Any]:
    from ..storage.dcp import METADATA_NAME, FsspecStorageReader

    man = layout.read_manifest(step)
    if METADATA_NAME not in man.files:
        raise CorruptCheckpointError(f"step {step}: manifest lists no {METADATA_NAME}", step=step)
    reader = FsspecStorageReader(storage, layout.locate(step), files=man.files, verify=True)
    return man, reader.read_metadata()
