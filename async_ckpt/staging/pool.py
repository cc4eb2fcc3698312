"""Reusable host buffers for staging, bounded by a memory budget.

Fresh host memory is the enemy of a fast snapshot: a new allocation must be page-faulted in,
which costs more than the copy itself. The pool hands out flat ``uint8`` buffers keyed by size
(and pinning), takes them back when the writer is done, and hands the same buffers out again on
the next save — so in steady state a save allocates nothing.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import StagingBudgetError

_Key = Tuple[int, bool]  # (nbytes, pinned)


class Lease:
    """Buffers taken from a pool for one snapshot; give them back with :meth:`release`."""

    def __init__(self, pool: "HostBufferPool", buffers: List[torch.Tensor], pinned: bool) -> None:
        self._pool = pool
        self.buffers = buffers
        self.pinned = pinned
        self._released = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def release(self) -> None:
        """Return the buffers to the pool (idempotent)."""
        if not self._released:
            self._released = True
            self._pool._give_back(self.buffers, self.pinned)


class HostBufferPool:
    """A pool of flat host ``uint8`` buffers.

    ``budget_bytes`` bounds the bytes the pool may hold (free and leased). A request that fits
    the budget but not what is free right now waits for leases to be released (back-pressure
    from the writer); a request larger than the whole budget raises
    :class:`~async_ckpt.errors.StagingBudgetError` at once. ``None`` means no bound.
    """

    def __init__(self, budget_bytes: Optional[int] = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._free: Dict[_Key, List[torch.Tensor]] = defaultdict(list)
        self._cond = threading.Condition()
        self.allocated_bytes = 0  # free + leased
        self.leased_bytes = 0
        self.allocations = 0  # fresh allocations so far (flat in steady state)

    def acquire(self, sizes: Sequence[int], *, pinned: bool = False, timeout: Optional[float] = None) -> Lease:
        """Buffers of exactly ``sizes`` bytes each, reusing free ones where possible."""
        total = sum(sizes)
        if self.budget_bytes is not None and total > self.budget_bytes:
            raise StagingBudgetError(
                f"the state dict needs {total / 2**20:.1f} MiB of host staging memory but the "
                f"budget is {self.budget_bytes / 2**20:.1f} MiB; raise memory_budget_bytes"
            )
        with self._cond:
            while True:
                need: Dict[_Key, int] = defaultdict(int)
                for n in sizes:
                    need[(n, pinned)] += 1
                missing = sum(
                    n * max(0, cnt - len(self._free.get((n, p), ()))) for (n, p), cnt in need.items()
                )
                if self.budget_bytes is None or self.allocated_bytes + missing <= self.budget_bytes:
                    break
                self._evict_unneeded(need, self.allocated_bytes + missing - self.budget_bytes)
                if self.allocated_bytes + missing <= self.budget_bytes:
                    break
                if not self._cond.wait(timeout):
                    raise StagingBudgetError(
                        f"timed out after {timeout}s waiting for {missing / 2**20:.1f} MiB of host staging memory"
                    )
            buffers = []
            for n in sizes:
                free = self._free.get((n, pinned))
                if free:
                    buffers.append(free.pop())
                else:
                    buffers.append(torch.empty(n, dtype=torch.uint8, pin_memory=pinned))
                    self.allocated_bytes += n
                    self.allocations += 1
            self.leased_bytes += total
        return Lease(self, buffers, pinned)

    def _evict_unneeded(self, need: Dict[_Key, int], excess: int) -> None:
        for key, free in list(self._free.items()):
            keep = need.get(key, 0)
            while len(free) > keep and excess > 0:
                buf = free.pop()
                self.allocated_bytes -= buf.numel()
                excess -= buf.numel()

    def _give_back(self, buffers: List[torch.Tensor], pinned: bool) -> None:
        with self._cond:
            for b in buffers:
                self._free[(b.numel(), pinned)].append(b)
                self.leased_bytes -= b.numel()
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop every free buffer (leased ones stay with their snapshots)."""
        with self._cond:
            for free in self._free.values():
                for b in free:
                    self.allocated_bytes -= b.numel()
            self._free.clear()
