"""CUDA -> pinned host: ``non_blocking`` copies on one side stream per device, one wait each."""

from __future__ import annotations

import threading
from typing import Dict, List, Sequence

import torch


class CudaTransfer:
    """The side streams of one stager (made on first use, one per device) and the batched copy."""

    def __init__(self) -> None:
        self._streams: Dict[int, "torch.cuda.Stream"] = {}
        self._lock = threading.Lock()

    def stream(self, device: torch.device) -> "torch.cuda.Stream":
        """The side stream for ``device``."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if idx not in self._streams:
                self._streams[idx] = torch.cuda.Stream(device=idx)
            return self._streams[idx]

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        """Queue every copy on its device's side stream, then wait once per device."""
        by_dev: Dict[torch.device, List[int]] = {}
        for i, s in enumerate(srcs):
            by_dev.setdefault(s.device, []).append(i)
        events = []
        for dev, idx in by_dev.items():
            stream = self.stream(dev)
            # The side stream must see every kernel already queued on the training stream.
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for i in idx:  # every copy is queued before anything is waited on
                    dsts[i].copy_(srcs[i], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            events.append(ev)
        for ev in events:  # one wait per device, after every copy was issued
            ev.synchronize()
