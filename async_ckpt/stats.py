"""Per-save statistics: where the time of a save went (the JSON-lines log of them is written by
:class:`async_ckpt.storage.stats_log.StatsLog`)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional

from .errors import InvalidArgumentError
from .format import step_names

log = logging.getLogger("async_ckpt")

DEFAULT_STATS_LOG = "save_stats.jsonl"
#: ``SaveStats.extra`` keys of a manager with a local tier: the step was saved to the local tier
#: only because the upload slots were busy (``UPLOAD_SKIPPED``) or the checkpoint path could not
#: be reached (``FALLBACK``); in the stats log, ``FAILED`` holds the error of a save that failed
UPLOAD_SKIPPED = "upload_skipped"
FALLBACK = "fallback"
FAILED = "failed"


@dataclass
class SaveStats:
    """Timings and sizes of one save.

    ``blocking_s`` is what the training loop waited for inside ``save``/``save_async``:
    ``queue_wait_s`` (waiting for a free slot) plus ``stage_s`` (the host copy). The background
    fields (``write_s``, ``commit_s``, ``durable_s``, ``commit_time``) are filled in as the save
    completes.

    Attributes:
        step: the step saved.
        nbytes: tensor bytes this rank copied to host memory (not counting declared-frozen
            tensors left uncopied, nor replicated tensors another rank takes).
        num_tensors: tensors staged.
        files: files written for the step.
        written_bytes: bytes of the files this rank wrote for the step (data and metadata).
        referred_bytes: bytes of the files an incremental save took from the root's last step
            (``incremental=True``: hard links on POSIX paths, server-side copies on object
            stores) instead of writing them.
        blocking_s: seconds the training loop waited inside ``save``/``save_async``.
        queue_wait_s: seconds of that spent waiting for a free writer slot.
        stage_s: seconds of that spent on the host copy.
        exchange_s: several ranks: seconds of the training thread's exchanges for this save
            (the agreement, before ``blocking_s`` starts, and the replicated-state fingerprint
            exchange, inside ``stage_s``); about 0 for one process.
        write_s: seconds of the background write of the data files.
        commit_s: seconds of manifest + marker (+ rename).
        durable_s: seconds from the call until the step was committed (None while pending).
        commit_time: wall-clock time (``time.time()``) of the commit, or None.
        extra: further entries: with a local tier, ``tier`` (``"local"`` or ``"persistent"``),
            ``upload_skipped`` / ``fallback`` (saved to the local tier only: the upload slots were
            busy / the checkpoint path could not be reached); in the stats log, ``failed`` (the
            error of a save that failed, whose background fields stay empty); an integration's
            ``path``.
    """

    step: int
    nbytes: int = 0
    num_tensors: int = 0
    files: int = 0
    written_bytes: int = 0
    referred_bytes: int = 0
    blocking_s: float = 0.0
    queue_wait_s: float = 0.0
    stage_s: float = 0.0
    exchange_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    durable_s: Optional[float] = None
    commit_time: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def host_copy_gbps(self) -> float:
        """Host-copy bandwidth of the staging step, in GB/s (0 when nothing was copied)."""
        return self.nbytes / self.stage_s / 1e9 if self.stage_s > 0 else 0.0

    @property
    def write_gbps(self) -> float:
        """Write bandwidth of the background data write, in GB/s (0 when nothing was written)."""
        return self.nbytes / self.write_s / 1e9 if self.write_s > 0 else 0.0

    def to_dict(self) -> Dict[str, Any]:
        """The fields plus the derived ``host_copy_gbps`` and ``write_gbps``."""
        d = asdict(self)
        d["host_copy_gbps"] = self.host_copy_gbps
        d["write_gbps"] = self.write_gbps
        return d

    def to_json(self) -> str:
        """One line of JSON (the format of the stats log)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "SaveStats":
        """Inverse of :meth:`to_dict`; derived and unknown keys are ignored.

        Args:
            d: a record as :meth:`to_dict` (or one line of the stats log) gives it.

        Returns:
            The statistics.

        Raises:
            ValueError: ``d`` has no ``"step"``.
        """
        names = {f.name for f in fields(cls)}
        if "step" not in d:
            raise ValueError(f"a SaveStats record needs a 'step', got keys {sorted(d)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def summary(self) -> str:
        """One line for logs, in units that fit the sizes and times (KiB or GiB, us or s).

        A manager with a local tier names the tier: ``step 20 to the local tier: ...``.
        """
        durable = format_seconds(self.durable_s) if self.durable_s is not None else "pending"
        tier = self.extra.get("tier")
        return (
            f"step {self.step}{f' to {tier_name(tier)}' if tier else ''}: {format_bytes(self.nbytes)} in "
            f"{format_count(self.num_tensors, 'tensor')}, "
            f"blocked {format_seconds(self.blocking_s)} (slot wait {format_seconds(self.queue_wait_s)}, "
            f"host copy {format_seconds(self.stage_s)}, {format_rate(self.nbytes, self.stage_s)}), "
            f"write {format_seconds(self.write_s)} ({format_rate(self.nbytes, self.write_s)}), "
            f"commit {format_seconds(self.commit_s)}, durable after {durable}, {format_count(self.files, 'file')}"
            + (f" ({format_bytes(self.written_bytes)} written, {format_bytes(self.referred_bytes)} taken from "
               "the last step)" if self.referred_bytes else "")
        )


def tier_name(tier: str) -> str:
    """How messages name a manager's root: ``"the local tier"``, ``"the persistent root"``.

    Args:
        tier: ``"local"`` or ``"persistent"`` (``SaveStats.extra["tier"]``).

    Returns:
        The words.
    """
    return "the persistent root" if tier == "persistent" else f"the {tier} tier"


def format_bytes(n: float) -> str:
    """A byte count in the binary unit that fits it: ``"512 B"``, ``"20.2 KiB"``, ``"1.5 GiB"``.

    Args:
        n: the number of bytes.

    Returns:
        The text.
    """
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def format_seconds(s: float) -> str:
    """A duration in the unit that fits it: ``"35 us"``, ``"1.2 ms"``, ``"3.40 s"``.

    Args:
        s: seconds.

    Returns:
        The text.
    """
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def format_count(n: int, noun: str) -> str:
    """A count with its noun in the number it takes: ``"1 tensor"``, ``"3 tensors"``.

    Args:
        n: how many.
        noun: the singular noun (its plural adds an ``s``).

    Returns:
        The text.
    """
    return f"{n} {noun}{'' if n == 1 else 's'}"


def format_rate(nbytes: float, seconds: float) -> str:
    """A bandwidth in the binary unit that fits it: ``"350.00 KiB/s"``, ``"2.41 GiB/s"``.

    Binary as the sizes are (``KiB``, ``MiB``, ``GiB``).

    ``"-"`` when nothing was timed.

    Args:
        nbytes: bytes moved.
        seconds: the time it took.

    Returns:
        The text.
    """
    if seconds <= 0:
        return "-"
    rate = nbytes / seconds
    for unit, scale in (("TiB/s", 2.0**40), ("GiB/s", 2.0**30), ("MiB/s", 2.0**20), ("KiB/s", 2.0**10)):
        if rate >= scale:
            return f"{rate / scale:.2f} {unit}"
    return f"{rate:.0f} B/s"


def check_stats_relpath(relpath: str) -> str:
    """Check the path of a stats log relative to the checkpoint root.

    Args:
        relpath: The path, ``/`` or ``\\`` separated.

    Returns:
        The path normalised to ``/``-separated parts, without empty and ``.`` parts.

    Raises:
        InvalidArgumentError: An absolute path, a URL, one with ``..``, or one that would collide
            with step directories.
    """
    p = relpath.replace("\\", "/").strip()
    parts = [x for x in p.split("/") if x not in ("", ".")]
    if not parts or p.startswith("/") or "://" in p or ".." in parts:
        raise InvalidArgumentError(f"stats_log must be True or a path relative to the checkpoint root, got {relpath!r}")
    if step_names.parse(parts[0]) is not None:
        raise InvalidArgumentError(f"stats_log={relpath!r} would collide with step directories; choose another name")
    return "/".join(parts)


def read_stats_log(path: str, storage_options: Optional[Dict[str, Any]] = None) -> List[SaveStats]:
    """Read a stats log into ``SaveStats``; a truncated last line (a crash mid-write) is skipped.

    Args:
        path: a local path or fsspec URL of the ``.jsonl`` file.
        storage_options: fsspec options for a remote ``path``.

    Returns:
        One :class:`SaveStats` per line, in the order of the file.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        ValueError: a line other than a truncated last one is not a ``SaveStats`` record.
    """
    import fsspec

    with fsspec.open(path, "rb", **(storage_options or {})) as f:
        data = f.read().decode()
    lines = data.splitlines()
    out: List[SaveStats] = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            out.append(SaveStats.from_dict(json.loads(ln)))
        except (ValueError, TypeError) as exc:
            if i == len(lines) - 1 and not data.endswith("\n"):
                break
            raise ValueError(f"{path}:{i + 1}: not a SaveStats record ({exc})") from exc
    return out
