"""Per-save statistics: where the time of a save went."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional


@dataclass
class SaveStats:
    """Timings and sizes of one save.

    ``blocking_s`` is what the training loop waited for inside ``save``/``save_async``:
    ``queue_wait_s`` (waiting for a free slot) plus ``stage_s`` (the host copy).
    ``write_s`` is the background write of the data files, ``commit_s`` manifest + marker
    (+ rename), and ``durable_s`` the time from the call until the step was committed.
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
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def host_copy_gbps(self) -> float:
        """Host-copy bandwidth of the staging step, in GB/s (0 when nothing was copied)."""
        return self.nbytes / self.stage_s / 1e9 if self.stage_s > 0 else 0.0

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["host_copy_gbps"] = self.host_copy_gbps
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def summary(self) -> str:
        """One line for logs."""
        durable = f"{self.durable_s:.3f}s" if self.durable_s is not None else "pending"
        return (
            f"step {self.step}: {self.nbytes / 2**20:.1f} MiB in {self.num_tensors} tensors, "
            f"blocked {self.blocking_s * 1e3:.1f} ms (slot wait {self.queue_wait_s * 1e3:.1f} ms, "
            f"host copy {self.stage_s * 1e3:.1f} ms, {self.host_copy_gbps:.2f} GB/s), "
            f"write {self.write_s:.3f}s, commit {self.commit_s:.3f}s, durable after {durable}, "
            f"{self.files} files"
        )
