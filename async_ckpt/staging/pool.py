"""Reusable host buffers for staging, bounded by what the saves need.

Fresh host memory is the enemy of a fast snapshot: a new allocation must be page-faulted in,
which costs more than the copy itself. The pool hands out flat ``uint8`` buffers (pinned for
CUDA sources), takes them back when the writer is done, and hands the same buffers out again
on the next save — so in steady state a save allocates nothing, and an unchanged state dict
gets the very same buffers (same data pointers, same cached views) every time.

How much it keeps
    * Reuse is by size class, not exact size: a request of ``n`` bytes takes a free buffer of
      ``n`` to ``n + n/16`` bytes (it gets a view of exactly ``n`` bytes). A request that
      outgrew a free buffer (a tensor growing from save to save) is allocated ``n/16`` larger,
      so the next saves of that tensor fit in it.
    * When nothing is leased any more (every snapshot released), the free buffers that no
      lease used since the previous such moment are dropped: after the usual one-save-at-a-time
      cycle the pool holds exactly the buffers of the last save.
    * Without a budget, an acquire that must allocate first drops free buffers it does not
      use (least recently used first) while the pool would hold more than ``1.1 x`` the most
      bytes requested by leases out at once (or by the ones out after this request) plus
      64 KiB; a release does the same while other leases stay out (several saves in flight).
    * ``hold_peak=True`` (a manager with a local tier: an upload stays in flight across several
      local saves, then none is, and so on) keeps, at quiescent moments, the buffers of the most
      bytes ever leased at once, instead of only those of the last cycle, so the next overlap
      of an upload with a local save reuses them instead of page-faulting fresh memory.
    Pinned buffers follow the same rules; dropping them also empties the CUDA caching host
    allocator, which would otherwise keep their pinned memory.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .. import shared_memory as _shared_memory
from ..compat import host_empty_cache
from ..errors import InvalidArgumentError, StagingBudgetError
from ..shared_memory import SharedBlock

_HEADROOM = 16  # a buffer may be up to 1/_HEADROOM larger than the request it serves
_BOUND = 1.1  # without a budget: held bytes <= _BOUND x the peak leased bytes + _SLACK
_SLACK = 64 * 1024


def _max_capacity(n: int) -> int:
    """The largest buffer a request of ``n`` bytes may take."""
    return n + n // _HEADROOM


class _Block:
    """One pooled allocation and the view of it handed out last (kept: it carries the views
    cached by :mod:`.views`, reused while the requests keep their size)."""

    __slots__ = ("tensor", "capacity", "pinned", "used", "epoch", "view", "n", "shared")

    def __init__(self, tensor: torch.Tensor, pinned: bool, shared: Optional[SharedBlock] = None) -> None:
        self.shared = shared  # the shared-memory block behind it (a pool made with shared=True)
        self.tensor = tensor
        self.capacity = tensor.numel()
        self.pinned = pinned
        self.used = 0  # the acquire that last took it (least recently used is dropped first)
        self.epoch = 0  # the pool's epoch when last taken
        self.view = tensor
        self.n = self.capacity  # the bytes asked for when last taken (the view's size)

    def buffer(self, n: int) -> torch.Tensor:
        """The block as a buffer of exactly ``n`` bytes (the same tensor as last time if the
        size did not change)."""
        if n != self.n:
            self.view = self.tensor if n == self.capacity else self.tensor[:n]
            self.n = n
        return self.view


class Lease:
    """Buffers taken from a pool for one snapshot; give them back with :meth:`release`.

    Made by :meth:`HostBufferPool.acquire`.

    Args:
        pool: the pool the buffers go back to.
        blocks: the pool's blocks behind the buffers.
        buffers: one flat ``uint8`` buffer per requested size, of exactly that many bytes.
        pinned: the buffers are in pinned memory.
    """

    def __init__(self, pool: "HostBufferPool", blocks: List[_Block], buffers: List[torch.Tensor],
                 pinned: bool) -> None:
        self._pool = pool
        self._blocks = blocks
        self.buffers = buffers  # one per requested size, of exactly that many bytes
        self.pinned = pinned
        self._released = False

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (as requested, without the blocks' headroom)."""
        return sum(b.numel() for b in self.buffers)

    def shared_blocks(self) -> List[SharedBlock]:
        """The shared-memory blocks behind these buffers (those a ``shared`` pool could get)."""
        return [b.shared for b in self._blocks if b.shared is not None]

    def release(self) -> None:
        """Return the buffers to the pool (idempotent)."""
        if not self._released:
            self._released = True
            self._pool._give_back(self._blocks)

    def give_up(self) -> None:
        """Take the buffers out of the pool instead of returning them (idempotent).

        The pool forgets them and never hands them out again; their memory is freed once
        nothing references them (a storage call that timed out and may still read them, see
        ``storage.retry``)."""
        if not self._released:
            self._released = True
            self._pool._give_back(self._blocks, keep=False)


class HostBufferPool:
    """A pool of flat host ``uint8`` buffers.

    ``budget_bytes`` bounds the bytes the pool may hold (free and leased). A request that fits
    the budget but not what is free right now waits for leases to be released (back-pressure
    from the writer); a request larger than the whole budget raises
    :class:`~async_ckpt.errors.StagingBudgetError` at once. ``None``: no fixed bound, the pool
    keeps what recent saves used (see the module docstring).

    ``allocated_bytes`` is what the pool holds (free and leased buffers, at their allocated
    size), ``leased_bytes`` the part of it leased out, ``allocations`` the fresh allocations
    made so far (flat in steady state).

    Args:
        budget_bytes: bound on the bytes the pool holds (None: no fixed bound).
        hold_peak: keep, at quiescent moments, the buffers of the most bytes ever leased at
            once (a manager with a local tier), instead of those of the last cycle.
        shared: allocate in memory shared with the writer process (:mod:`async_ckpt.shared_memory`),
            where the system allows.

    Raises:
        InvalidArgumentError: ``budget_bytes`` is negative.
    """

    def __init__(self, budget_bytes: Optional[int] = None, *, hold_peak: bool = False, shared: bool = False) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise InvalidArgumentError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.hold_peak = hold_peak
        self.shared = shared
        self._free: Dict[Tuple[int, bool], Deque[_Block]] = {}  # (capacity, pinned) -> FIFO
        # sorted capacities, per pinning, of the free lists (entries whose list emptied are
        # dropped lazily, by the searches that meet them: a steady-state pop stays O(1))
        self._caps: Dict[bool, List[int]] = {False: [], True: []}
        self._cond = threading.Condition()
        self.allocated_bytes = 0  # free + leased
        self.leased_bytes = 0
        self.allocations = 0  # fresh allocations so far (flat in steady state)
        self._requested = 0  # bytes the leases out asked for (leased_bytes less the headroom)
        self._acquires = 0
        self._epoch = 0  # advances each time nothing is leased any more
        self._blocks = 0  # blocks held, free and leased
        self._in_epoch = 0  # blocks taken in this epoch
        self._free_requested = 0  # sum of ``n`` over the free blocks
        self._peak = 0  # the most _requested at once (since the last quiescent moment; ever with hold_peak)

    # ---- free-list bookkeeping (callers hold self._cond) ---------------------------------------
    def _put(self, blk: _Block) -> None:
        key = (blk.capacity, blk.pinned)
        dq = self._free.get(key)
        if dq is None:
            dq = self._free[key] = deque()
            caps = self._caps[blk.pinned]
            i = bisect_left(caps, blk.capacity)
            if i == len(caps) or caps[i] != blk.capacity:
                caps.insert(i, blk.capacity)
        dq.append(blk)
        self._free_requested += blk.n

    def _pop(self, key: Tuple[int, bool]) -> _Block:
        dq = self._free[key]
        blk = dq.popleft()
        if not dq:
            del self._free[key]
        self._free_requested -= blk.n
        return blk

    def _free_cap(self, pinned: bool, lo: int, hi: int) -> Optional[int]:
        """The smallest capacity in ``[lo, hi]`` with a free block, or None."""
        caps = self._caps[pinned]
        i = bisect_left(caps, lo)
        while i < len(caps) and caps[i] <= hi:
            if (caps[i], pinned) in self._free:
                return caps[i]
            del caps[i]  # its free list emptied since
        return None

    def _take(self, n: int, pinned: bool) -> Optional[_Block]:
        """A free block that can serve ``n`` bytes (the exact size first), or None."""
        if (n, pinned) in self._free:
            return self._pop((n, pinned))
        cap = self._free_cap(pinned, n, _max_capacity(n))
        return None if cap is None else self._pop((cap, pinned))

    def _outgrew(self, n: int, pinned: bool) -> bool:
        """Whether a free block is a little too small for ``n`` (a tensor that grew)."""
        return n > 1 and self._free_cap(pinned, n // 2, n - 1) is not None

    def _drop_lru(self, excess: int, keep_epoch: Optional[int] = None) -> None:
        """Drop free blocks, least recently used first, until ``excess`` bytes are gone
        (with ``keep_epoch``: every free block last used before that epoch, regardless)."""
        blocks = [b for dq in self._free.values() for b in dq]
        if keep_epoch is None:
            blocks.sort(key=lambda b: b.used)
        pinned = False
        for b in blocks:
            if keep_epoch is not None:
                if b.epoch >= keep_epoch:
                    continue
            elif excess <= 0:
                break
            key = (b.capacity, b.pinned)
            self._free[key].remove(b)
            if not self._free[key]:
                del self._free[key]
            self.allocated_bytes -= b.capacity
            self._free_requested -= b.n
            self._blocks -= 1
            excess -= b.capacity
            pinned = pinned or b.pinned
            if b.shared is not None:
                b.shared.close()
        if pinned:
            _empty_host_cache()

    def _target(self, leased: int) -> float:
        return _BOUND * max(self._peak, leased) + _SLACK

    # ---- the API --------------------------------------------------------------------------------
    def leaser(self) -> Callable[[Sequence[int]], Tuple[Sequence[torch.Tensor], Callable[[], None]]]:
        """This pool's buffers as an atomic restore stages through them.

        Returns:
            ``acquire(sizes)`` -> (one lease's buffers, the function that releases the lease).
        """

        def acquire(sizes: Sequence[int]) -> Tuple[Sequence[torch.Tensor], Callable[[], None]]:
            lease = self.acquire(sizes)
            return lease.buffers, lease.release

        return acquire

    def acquire(self, sizes: Sequence[int], *, pinned: bool = False, timeout: Optional[float] = None) -> Lease:
        """Buffers of exactly ``sizes`` bytes each, reusing free ones where possible.

        Args:
            sizes: the byte size of each buffer.
            pinned: pinned memory (for copies from CUDA).
            timeout: with a budget, seconds to wait at most for leases to be released (None:
                no limit).

        Returns:
            The lease holding the buffers.

        Raises:
            StagingBudgetError: the sizes add up to more than the whole budget, or not enough
                was released within ``timeout``.
        """
        total = sum(sizes)
        if self.budget_bytes is not None and total > self.budget_bytes:
            raise StagingBudgetError(
                f"the state dict needs {total / 2**20:.1f} MiB of host staging memory but the "
                f"budget is {self.budget_bytes / 2**20:.1f} MiB; raise memory_budget_bytes"
            )
        with self._cond:
            while True:
                blocks = [self._take(n, pinned) for n in sizes]
                fresh = [i for i, b in enumerate(blocks) if b is None]
                caps = {i: (_max_capacity(sizes[i]) if self._outgrew(sizes[i], pinned) else sizes[i]) for i in fresh}
                missing = sum(caps.values())
                if self.budget_bytes is None:
                    over = self.allocated_bytes + missing - self._target(self._requested + total)
                    if fresh and over > 0:
                        self._drop_lru(int(over) + 1)  # every free block left is unneeded here
                    break
                exact = sum(sizes[i] for i in fresh)
                if self.allocated_bytes + exact > self.budget_bytes:
                    self._drop_lru(self.allocated_bytes + exact - self.budget_bytes)
                if self.allocated_bytes + exact <= self.budget_bytes:
                    if self.allocated_bytes + missing > self.budget_bytes:
                        caps = {i: sizes[i] for i in fresh}  # no room for growth headroom
                    break
                for b in reversed([b for b in blocks if b is not None]):  # back, in their order
                    self._put(b)
                    dq = self._free[(b.capacity, b.pinned)]
                    dq.rotate(1)  # it was appended last; it was taken first
                if not self._cond.wait(timeout):
                    raise StagingBudgetError(
                        f"timed out after {timeout}s waiting for {exact / 2**20:.1f} MiB of host staging memory"
                    )
            self._acquires += 1
            buffers = []
            for i, n in enumerate(sizes):
                blk = blocks[i]
                if blk is None:
                    blk = blocks[i] = self._allocate(caps[i], pinned)
                    self.allocated_bytes += blk.capacity
                    self.allocations += 1
                    self._blocks += 1
                if blk.epoch != self._epoch or blk.used == 0:
                    self._in_epoch += 1
                blk.used, blk.epoch = self._acquires, self._epoch
                self.leased_bytes += blk.capacity
                buffers.append(blk.buffer(n))
            self._requested += total
            self._peak = max(self._peak, self._requested)
        return Lease(self, blocks, buffers, pinned)  # type: ignore[arg-type]

    def _allocate(self, nbytes: int, pinned: bool) -> _Block:
        shared = _shared_memory.allocate(nbytes, pinned) if self.shared else None
        if shared is not None:
            return _Block(shared.tensor, pinned, shared)
        return _Block(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned), pinned)

    def _give_back(self, blocks: List[_Block], keep: bool = True) -> None:
        with self._cond:
            for b in blocks:
                if keep:
                    self._put(b)
                else:  # given up: no longer the pool's
                    self.allocated_bytes -= b.capacity
                    self._blocks -= 1
                    if b.epoch == self._epoch:  # it was counted as taken in this epoch
                        self._in_epoch -= 1
                    if b.shared is not None:  # its mapping lives on with whoever still reads it
                        b.shared.close()
                self.leased_bytes -= b.capacity
                self._requested -= b.n
            if self.leased_bytes == 0 and self.hold_peak:
                # Quiescent: keep what the most leased at once needed (unused buffers beyond it go).
                if self.budget_bytes is None and self.allocated_bytes > self._target(0):
                    self._drop_lru(int(self.allocated_bytes - self._target(0)) + 1)
                self._epoch += 1
                self._in_epoch = 0
            elif self.leased_bytes == 0:
                # Quiescent: keep only what was used since the last quiescent moment.
                if self._in_epoch < self._blocks:
                    self._drop_lru(0, keep_epoch=self._epoch)
                self._peak = self._free_requested
                self._epoch += 1
                self._in_epoch = 0
            elif self.budget_bytes is None and self.allocated_bytes > self._target(0):
                self._drop_lru(int(self.allocated_bytes - self._target(0)) + 1)
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop every free buffer (leased ones stay with their snapshots)."""
        with self._cond:
            self._drop_lru(0, keep_epoch=self._epoch + 1)


def _empty_host_cache() -> None:
    """Return cached, unused pinned host memory to the system (dropped pinned buffers land in
    torch's caching host allocator, not back with the OS)."""
    try:
        if torch.cuda.is_initialized():
            host_empty_cache()
    except Exception:  # noqa: BLE001 - no CUDA, or an older torch: nothing cached to return
        pass
