"""Staging buffers in memory shared with the writer process.

A save written by the writer process (``CheckpointManager(writer="process")``) is read there
straight from the buffers the stall copied into: nothing is copied at the hand-off. The
buffers are ranges of a few large *segments*, anonymous shared-memory files
(``memfd_create``) mapped into the training process and, once a save refers to one, into the
writer process, which receives its descriptor over the socket between the two
(``SCM_RIGHTS``). A segment costs two descriptors (its memfd, kept so that a restarted writer
process can map it again, and the one its mapping holds), whatever number of buffers it holds:
the segments grow with what is allocated (each new one at least half of what is live), so
thousands of buffers take a handful of descriptors.

A buffer's range goes back to its segment when the last tensor viewing it is freed (its pages
are returned to the system then); a segment with no buffer left is closed and unmapped.
Memory from ``memfd_create`` is not bounded by the size of ``/dev/shm`` (a container's
``/dev/shm`` is often 64 MiB), is freed when the last mapping and descriptor go, and is never
left behind by a crash. A buffer for copies from CUDA is page-locked in place with
``cudaHostRegister``, as a pinned allocation would be.

Where shared memory cannot be had (no ``memfd_create``, out of descriptors), :func:`allocate`
returns ``None`` and the pool allocates ordinary memory: saves staged there are written by the
training process's own writer thread, as without a writer process.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import weakref
from typing import List, Optional, Tuple

import torch

log = logging.getLogger("async_ckpt")

SEGMENT_MIN_BYTES = 64 * 2**20  # the smallest segment made (its pages are only allocated when used)
_PAGE = mmap.PAGESIZE

_ids = itertools.count(1)
_warned = threading.Event()
_closed: List[int] = []  # ids of segments closed since the writer process last heard (take_closed)
_lock = threading.RLock()  # the segments, their free ranges, _closed (a finalizer may run under it)


def take_closed() -> List[int]:
    """The ids of the segments closed since the last call: the writer process unmaps them."""
    with _lock:
        out = _closed[:]
        del _closed[:]
        return out


class Segment:
    """One shared-memory file holding many buffers: its id (the writer process knows it by),
    its descriptor (``-1`` once closed) and size."""

    __slots__ = ("id", "fd", "nbytes", "_mm", "_free", "_live")

    def __init__(self, nbytes: int) -> None:
        fd = os.memfd_create("async_ckpt_staging", getattr(os, "MFD_CLOEXEC", 1))
        try:
            os.ftruncate(fd, nbytes)
            self._mm: Optional[mmap.mmap] = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.id = next(_ids)
        self.fd = fd
        self.nbytes = nbytes
        self._free: List[Tuple[int, int]] = [(0, nbytes)]  # (offset, size), by offset
        self._live = 0

    def _take(self, size: int) -> Optional[int]:
        """A free range of ``size`` bytes (first fit), or None (under ``_lock``)."""
        for i, (off, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, n - size)
                self._live += 1
                return off
        return None

    def _give(self, off: int, size: int) -> None:
        """A range back (its pages to the system); the segment closes with its last range."""
        with _lock:
            self._live -= 1
            if self._live == 0:
                _segments.remove(self)
                os.close(self.fd)
                self.fd = -1
                self._mm = None  # unmapped with the last view of it (none left)
                _closed.append(self.id)
                return
            try:  # its pages back to the system, before another buffer may take the range
                assert self._mm is not None
                self._mm.madvise(mmap.MADV_REMOVE, off, size)
            except (OSError, ValueError, AttributeError) as exc:  # kept resident: reused by the next buffer
                log.debug("madvise(MADV_REMOVE) failed: %s", exc)
            free = self._free
            k = 0
            while k < len(free) and free[k][0] < off:
                k += 1
            free.insert(k, (off, size))
            if k + 1 < len(free) and off + size == free[k + 1][0]:  # merge with the next
                free[k] = (off, size + free.pop(k + 1)[1])
            if k > 0 and free[k - 1][0] + free[k - 1][1] == off:  # and the previous
                free[k - 1] = (free[k - 1][0], free[k - 1][1] + free.pop(k)[1])


_segments: List[Segment] = []


class SharedBlock:
    """One buffer in shared memory: its range of a :class:`Segment` and the ``uint8`` tensor
    over it in this process (its range is given back when the last tensor viewing it goes).

    Args:
        segment: the segment.
        offset: where the buffer starts in it.
        nbytes: its size.
        tensor: the ``uint8`` tensor over this process's mapping.
        registered: the mapping is page-locked for CUDA (``cudaHostRegister``).
    """

    __slots__ = ("segment", "offset", "nbytes", "tensor", "registered", "address")

    def __init__(self, segment: Segment, offset: int, nbytes: int, tensor: torch.Tensor, registered: bool) -> None:
        self.segment = segment
        self.offset = offset
        self.nbytes = nbytes
        self.tensor = tensor
        self.registered = registered
        self.address = tensor.data_ptr()

    def close(self) -> None:
        """Give up the block: unlock its pages (CUDA). Its range goes back to the segment with
        the last tensor viewing it (the pool drops its own right after)."""
        if self.registered:
            self.registered = False
            try:
                torch.cuda.cudart().cudaHostUnregister(self.address)
            except Exception as exc:  # noqa: BLE001 - the memory is unmapped with the tensor anyway
                log.debug("cudaHostUnregister failed: %s", exc)


def segments() -> int:
    """How many segments are open (each holds two descriptors)."""
    with _lock:
        return len(_segments)


def _range(nbytes: int) -> Tuple[Segment, int, memoryview]:
    size = -(-nbytes // _PAGE) * _PAGE
    with _lock:
        for seg in list(_segments):
            off = seg._take(size)
            if off is not None:
                break
        else:
            live = sum(s.nbytes for s in _segments)
            seg = Segment(max(size, SEGMENT_MIN_BYTES, -(-(live // 2) // _PAGE) * _PAGE))
            _segments.append(seg)
            off = seg._take(size)
            assert off is not None
        assert seg._mm is not None
        view = memoryview(seg._mm)[off:off + nbytes]
    weakref.finalize(view, seg._give, off, size)  # the range back once no tensor views it
    return seg, off, view


def allocate(nbytes: int, pinned: bool) -> Optional[SharedBlock]:
    """A shared-memory block of ``nbytes`` bytes (page-locked for CUDA when ``pinned``), or
    ``None`` where the system cannot give one (then the caller allocates ordinary memory; the
    first such case is logged).

    Args:
        nbytes: the size (> 0).
        pinned: page-lock it for copies from CUDA.

    Returns:
        The block, or ``None``.
    """
    if not hasattr(os, "memfd_create") or nbytes <= 0:
        return None
    try:
        seg, off, view = _range(nbytes)
        tensor = torch.frombuffer(view, dtype=torch.uint8)  # keeps the range (and the mapping) alive
    except (OSError, ValueError, RuntimeError) as exc:
        if not _warned.is_set():
            _warned.set()
            log.warning("no shared memory for staging (%s): saves staged in ordinary memory are written by the "
                        "training process's writer thread", exc)
        return None
    del view
    registered = False
    if pinned:
        try:
            err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
            registered = int(err) == 0
        except Exception as exc:  # noqa: BLE001 - not pinned: staged in ordinary pinned memory instead
            log.debug("cudaHostRegister failed: %s", exc)
        if not registered:
            return None
    return SharedBlock(seg, off, nbytes, tensor, registered)
