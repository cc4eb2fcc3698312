"""Per-save statistics: where the time of a save went, and an optional JSON-lines log of them."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

if TYPE_CHECKING:  # pragma: no cover
    from .storage.fs import Storage

log = logging.getLogger("async_ckpt")

DEFAULT_STATS_LOG = "save_stats.jsonl"


@dataclass
class SaveStats:
    """Timings and sizes of one save.

    ``blocking_s`` is what the training loop waited for inside ``save``/``save_async``:
    ``queue_wait_s`` (waiting for a free slot) plus ``stage_s`` (the host copy).
    ``write_s`` is the background write of the data files, ``commit_s`` manifest + marker
    (+ rename), and ``durable_s`` the time from the call until the step was committed.
    ``nbytes`` counts tensor bytes staged, ``files`` the files written for the step, and
    ``commit_time`` is the wall-clock time (``time.time()``) of the commit.
    """

    step: int
    nbytes: int = 0
    num_tensors: int = 0
    files: int = 0
    blocking_s: float = 0.0
    queue_wait_s: float = 0.0
    stage_s: float = 0.0
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
        """Inverse of :meth:`to_dict`; derived and unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        if "step" not in d:
            raise ValueError(f"a SaveStats record needs a 'step', got keys {sorted(d)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def summary(self) -> str:
        """One line for logs."""
        durable = f"{self.durable_s:.3f}s" if self.durable_s is not None else "pending"
        return (
            f"step {self.step}: {self.nbytes / 2**20:.1f} MiB in {self.num_tensors} tensors, "
            f"blocked {self.blocking_s * 1e3:.1f} ms (slot wait {self.queue_wait_s * 1e3:.1f} ms, "
            f"host copy {self.stage_s * 1e3:.1f} ms, {self.host_copy_gbps:.2f} GB/s), "
            f"write {self.write_s:.3f}s ({self.write_gbps:.2f} GB/s), commit {self.commit_s:.3f}s, "
            f"durable after {durable}, {self.files} files"
        )


def _check_relpath(relpath: str) -> str:
    p = relpath.replace("\\", "/").strip()
    parts = [x for x in p.split("/") if x not in ("", ".")]
    if not parts or p.startswith("/") or "://" in p or ".." in parts:
        raise ValueError(f"stats_log must be True or a path relative to the checkpoint root, got {relpath!r}")
    if parts[0].isdigit() or parts[0].startswith((".tmp-", ".trash-")):
        raise ValueError(f"stats_log={relpath!r} would collide with step directories; choose another name")
    return "/".join(parts)


class StatsLog:
    """Appends one JSON line per committed save to a file under the checkpoint root.

    On a local path the file is opened in append mode, written and fsynced for each save. Object
    stores cannot append, so there the log is kept in memory (seeded once with the file's
    existing content) and the whole object is rewritten after each save: a few hundred bytes
    per save, and a reader always sees a complete file. Two processes logging to the same
    object-store file would overwrite each other's lines; only rank 0 of a process group logs.
    A failure to write the log is logged as a warning and never fails the save.
    """

    def __init__(self, storage: "Storage", relpath: str = DEFAULT_STATS_LOG) -> None:
        self.storage = storage
        self.relpath = _check_relpath(relpath)
        self.path = storage.join(self.relpath)
        self._lock = threading.Lock()
        self._buf: Optional[bytearray] = None

    @classmethod
    def from_option(cls, storage: "Storage", option: Union[bool, str, os.PathLike, None]) -> Optional["StatsLog"]:
        """``None``/``False``: no log; ``True``: ``<root>/save_stats.jsonl``; a str: that relative path."""
        if option is None or option is False:
            return None
        if option is True:
            return cls(storage)
        if isinstance(option, (str, os.PathLike)):
            return cls(storage, os.fspath(option))
        raise TypeError(f"stats_log must be a bool or a relative path, got {type(option).__name__}")

    def append(self, stats: SaveStats, process_group: Any = None) -> None:
        """Write one record; never raises (a failure is logged as a warning)."""
        try:
            if not _is_coordinator(process_group):
                return
            line = (stats.to_json() + "\n").encode()
            with self._lock:
                if self.storage.is_local:
                    os.makedirs(os.path.dirname(self.path), exist_ok=True)
                    with open(self.path, "ab") as f:
                        f.write(line)
                        f.flush()
                        os.fsync(f.fileno())
                else:
                    if self._buf is None:
                        try:
                            self._buf = bytearray(self.storage.read_bytes(self.path))
                        except FileNotFoundError:
                            self._buf = bytearray()
                        if self._buf and not self._buf.endswith(b"\n"):
                            self._buf += b"\n"
                    self._buf += line
                    self.storage.write_bytes(self.path, bytes(self._buf))
        except Exception as exc:  # statistics must never break a committed save
            log.warning("async_ckpt: could not write the stats log %s: %s", self.path, exc)


def _is_coordinator(process_group: Any) -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(process_group) == 0
    except Exception:
        pass
    return True


def read_stats_log(path: str, storage_options: Optional[Dict[str, Any]] = None) -> List[SaveStats]:
    """Read a stats log (a local path or fsspec URL of the ``.jsonl`` file) into ``SaveStats``.

    A truncated last line (a crash mid-write) is skipped; any other bad line raises ``ValueError``.
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
