"""Formatting and opening a checkpoint root: shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import CheckpointError, NotACheckpointRootError, StepNotFoundError, StorageUnreachableError
from ..jobs.catalog import StepCatalog
from ..storage.diagnosis import LIGHTNING_HINT, Finding, diagnose
from ..storage.diagnosis import other_kinds as _other_kinds
from ..storage.retry import RetryPolicy
from ..storage.step_dirs import StepCopy, StepDirectories
from ..storage.storage import CONNECT_TIMEOUT_HINT, Storage

EXIT_OK, EXIT_DAMAGED, EXIT_ERROR = 0, 1, 2
#: bytes read per call when a command reads a data file chunk by chunk
CHUNK_BYTES = 8 * 2**20
DEFAULT_CONNECT_TIMEOUT = RetryPolicy.connect_timeout


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


def fmt_time(t: Optional[float]) -> str:
    """A time for a table cell.

    Args:
        t: Seconds since the epoch, or None.

    Returns:
        ``YYYY-mm-dd HH:MM:SS`` in local time, or ``"-"`` for None.
    """
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def fmt_metrics(metrics: Dict[str, float]) -> str:
    """Metrics for a table cell.

    Args:
        metrics: Name -> value.

    Returns:
        ``name=value`` pairs by name, or ``"-"`` for none.
    """
    return " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())) or "-"


def render_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A plain-text table, columns padded to their widest cell (cells through :func:`cell_text`).

    Args:
        headers: The column titles.
        rows: The rows, one value per column.
        right: Indices of the columns aligned right.

    Returns:
        The table's lines, joined by newlines.
    """
    rows = [[cell_text(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def cell_text(c: Any) -> str:
    """A value as terminal-safe text: names and values read from a checkpoint may hold control
    characters (terminal escape codes); those are shown ``repr``-escaped.

    Args:
        c: Any value.

    Returns:
        ``str(c)``, escaped if it is not printable.
    """
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


def print_json(obj: Any) -> None:
    """Print ``obj`` as strict JSON on stdout (non-finite floats as strings, keys sorted).

    Args:
        obj: A JSON-serialisable value.
    """
    print(json.dumps(_strict(obj), indent=2, sort_keys=True, allow_nan=False))


def progress_bar(total: int, desc: str, enabled: Optional[bool]) -> Any:
    """A tqdm bar on stderr (shown on a terminal, or always with ``--progress``).

    Args:
        total: Bytes to be done.
        desc: The bar's label.
        enabled: ``--progress``: True always, False never, None on a terminal.

    Returns:
        The bar (``update``, ``set_description``, ``close``); one that shows nothing without tqdm.
    """
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the [cli] extra; without it there is no bar
        if enabled:  # asked for with --progress: say why there is none, once
            global _TQDM_NOTED
            if not _TQDM_NOTED:
                _TQDM_NOTED = True
                print("async-ckpt: note: --progress needs tqdm, which is not installed (pip install tqdm, "
                      "or from a checkout of async_ckpt: pip install -e '.[cli]'); continuing without a progress bar", file=sys.stderr)
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=None if enabled is None else not enabled, leave=False)


_TQDM_NOTED = False


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_description(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


# ---- opening a root --------------------------------------------------------------------------

def parse_options(pairs: Optional[List[str]]) -> Dict[str, Any]:
    """``--storage-option KEY=VALUE`` pairs as fsspec storage options.

    Args:
        pairs: ``KEY=VALUE`` strings; a value that parses as JSON is taken as JSON.

    Returns:
        Key -> value.

    Raises:
        ValueError: A pair without ``=``.
    """
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


def _retry(args: argparse.Namespace) -> RetryPolicy:
    """The retry policy of the command's storage: ``--connect-timeout`` bounds the first request."""
    t = getattr(args, "connect_timeout", DEFAULT_CONNECT_TIMEOUT)
    if t is None:
        return RetryPolicy()
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"--connect-timeout must be a number of seconds > 0, got {t}")
    return RetryPolicy(connect_timeout=t)


def cli_unreachable_message(exc: StorageUnreachableError) -> str:
    """The unreachable-storage error with the command's option, ``--connect-timeout SECONDS``,
    instead of the Python setting (which the message names in the API)."""
    return str(exc).replace(CONNECT_TIMEOUT_HINT, "pass --connect-timeout SECONDS")


def open_root(args: argparse.Namespace) -> Tuple[Storage, StepDirectories]:
    """Open PATH, the checkpoint root of a command.

    Args:
        args: The parsed command line (``path``, ``storage_option``, ``connect_timeout``).

    Returns:
        The root's storage and step layout.

    Raises:
        FileNotFoundError: PATH does not exist.
        NotACheckpointRootError: PATH is a file.
        StorageUnreachableError: The storage did not answer within ``--connect-timeout``
            (:meth:`~async_ckpt.storage.storage.Storage.probe`).
    """
    storage = Storage(args.path, parse_options(args.storage_option), retry=_retry(args))
    exists = storage.probe()
    is_file = exists and not storage.fs.isdir(storage.root)
    if not exists:
        raise FileNotFoundError(f"no such checkpoint directory: {args.path}")
    if is_file:
        what = (f"a Lightning checkpoint file ({LIGHTNING_HINT})" if args.path.endswith(".ckpt")
                else "a file, not a checkpoint directory")
        raise NotACheckpointRootError(f"{args.path} is {what}")
    return storage, StepDirectories(storage, "auto")


def other_kinds(storage: Storage) -> List[Dict[str, Any]]:
    """Checkpoints of other kinds directly under the root (see
    :func:`~async_ckpt.storage.diagnosis.other_kinds`): one record per kind, ``kind``,
    ``names``, ``hint``."""
    return [{"kind": f.kind, "names": list(f.names), "hint": f.message}
            for f in _other_kinds(storage.listdir(storage.root))]


def path_findings(storage: Storage, name: str) -> List[Finding]:
    """What PATH holds instead of (or besides) async_ckpt's steps: the manager's diagnosis
    (:func:`~async_ckpt.storage.diagnosis.diagnose`), with PATH called ``name``; none when
    PATH cannot be listed."""
    try:
        return diagnose(storage, name=name)
    except OSError:
        return []


def no_checkpoint_message(storage: Storage, what: str, name: Optional[str] = None) -> str:
    """The message for a root without a committed step, with what the path holds instead
    (one step's directory, the parent of roots, checkpoints of other kinds).

    Args:
        storage: the root.
        what: The message's start.
        name: how to call the root (default: its URL).

    Returns:
        ``what``, followed by the diagnosis of the path.
    """
    return what + "".join(f"; {f.message}" for f in path_findings(storage, name or storage.url))


def open_roots(args: argparse.Namespace) -> List[Tuple[str, Storage, StepDirectories]]:
    """Open PATH and, with ``--local-dir``, the local tier (a multi-rank job's local tier is one
    rank's ``<local_dir>/rank<r>``).

    Args:
        args: The parsed command line (as :func:`open_root`, and ``local_dir``).

    Returns:
        ``(tier, storage, layout)`` per root: ``local`` first if given, then ``persistent``.

    Raises:
        FileNotFoundError: PATH or the local directory does not exist.
    """
    storage, layout = open_root(args)
    roots = [("persistent", storage, layout)]
    local = getattr(args, "local_dir", None)
    if local:
        lstorage = Storage(local, retry=_retry(args))
        if not lstorage.probe():
            raise FileNotFoundError(f"no such local checkpoint directory: {local}")
        roots.insert(0, ("local", lstorage, StepDirectories(lstorage, "auto")))
    return roots


def home_identity(roots: List[Tuple[str, Storage, StepDirectories]]) -> Optional[str]:
    """PATH as local manifests record the checkpoint path they were saved for.

    Args:
        roots: What :func:`open_roots` returned.

    Returns:
        :meth:`~async_ckpt.storage.storage.Storage.root_identity` of PATH with a local tier; None
        without one.
    """
    return roots[-1][1].root_identity() if len(roots) > 1 else None


def foreign_note(count: int, home: Optional[str], what: str) -> str:
    """The note line for local copies another job saved (for another checkpoint path).

    Args:
        count: How many such copies.
        home: This job's checkpoint path (:func:`home_identity`).
        what: What the command did with them.

    Returns:
        The line.
    """
    return (f"note: {count} local cop{'y' if count == 1 else 'ies'} saved for another checkpoint path than "
            f"{home} (another job's, in a shared local_dir): {what}")


def restore_order(layout: StepDirectories) -> List[int]:
    """The committed steps in the order ``restore(None)`` tries them: those whose manifest
    does not read first (highest first), then newest commit first
    (:meth:`~async_ckpt.jobs.catalog.StepCatalog.steps_newest_first`). The first that
    verifies is the one it restores.

    Args:
        layout: The root's step layout.

    Returns:
        The steps, in that order.
    """
    return StepCatalog(layout, time.time).steps_newest_first()


def intact_line(step: Optional[int], skipped: Sequence[int], verified: bool, checks: str = "ls's checks") -> str:
    """The line naming the step ``restore(None)`` takes (``ls``, ``verify``, ``export``).

    Args:
        step: The newest intact step, or None.
        skipped: Newer committed steps found damaged (restore(None) skips them).
        verified: Whether ``step``'s files were read and checksummed.
        checks: What found it intact when not ``verified``.

    Returns:
        ``newest intact step (what restore(None) takes): N; newer, damaged, skipped: ...``.
    """
    if step is None:
        text = "no intact step: restore(None) has nothing to restore"
    else:
        text = f"newest intact step (what restore(None) takes): {step}"
        if not verified:
            text += f" (by {checks}, contents not read: ls --verify or verify checksums it)"
    if skipped:
        text += f"; newer, damaged, skipped: {', '.join(map(str, skipped))}"
    return text


class naming_step:
    """A context in which a :class:`~async_ckpt.errors.CheckpointError` raised without a step
    gets ``step`` (so that the command's error line names it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __enter__(self) -> "naming_step":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, CheckpointError) and exc.step is None:
            raise exc.with_context(step=self.step) from exc.__cause__


def latest_intact(layout: StepDirectories) -> Tuple[Optional[int], List[int]]:
    """The step ``restore(None)`` takes, by the checks that read no data (``ls``'s): the first
    of :func:`restore_order` whose manifest reads and whose files have their listed sizes.

    Args:
        layout: The root's step layout.

    Returns:
        ``(step, skipped)``: that step (None when every committed step fails) and the newer
        committed steps that fail these checks (restore(None) skips them).
    """
    from ..io.read_exec import check_sizes

    skipped: List[int] = []
    for step in restore_order(layout):
        try:
            copy = layout.read_committed(step)
            bad = check_sizes(layout.storage, copy.where, copy.manifest.files)
        except CheckpointError:
            bad = {"manifest": "damaged"}
        if not bad:
            return step, skipped
        skipped.append(step)
    return None, skipped


def parse_step(text: Optional[str], layout: StepDirectories) -> int:
    """The STEP argument of a command.

    Args:
        text: A step number, ``latest`` or None: the step ``restore(None)`` takes
            (:func:`latest_intact`; the newest committed one when none passes, to report it).
        layout: The root's step layout.

    Returns:
        A committed step.

    Raises:
        StepNotFoundError: No such committed step (or none at all).
        ValueError: ``text`` is neither a non-negative integer nor ``latest``.
    """
    if text is None or text == "latest":
        latest, skipped = latest_intact(layout)
        if latest is None:
            steps = skipped or layout.committed_steps()  # none passes: the newest, to report it
            if not steps:
                raise StepNotFoundError(no_checkpoint_message(layout.storage,
                                                       f"no committed checkpoint under {layout.storage.url}"))
            return steps[0] if skipped else steps[-1]
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


def read_step_metadata(storage: Storage, layout: StepDirectories, step: int) -> Tuple[StepCopy, Any]:
    """The committed copy of a step and its DCP metadata, opened and checked
    (:func:`~async_ckpt.io.dcp_adapters.read_metadata`: the metadata file verified).

    Args:
        storage: The root.
        layout: The root's step layout.
        step: A committed step.

    Returns:
        ``(copy, metadata)``: where the copy is, its manifest; the metadata.

    Raises:
        CorruptCheckpointError: The manifest lists no metadata file, or it is damaged.
    """
    from ..io.dcp_adapters import read_metadata

    with naming_step(step):
        copy = layout.read_committed(step)
        return copy, read_metadata(storage, copy.where, copy.manifest.files, whole=copy.manifest.whole)
