"""Reading host memory by address: many same-sized windows copied by one gather.

Used where making a Python tensor per source would cost more than copying its bytes: XLA
buffers on PJRT CPU (:mod:`async_ckpt.staging.xla`) and runs of small records
(:class:`async_ckpt.format.torch_record.RecordBatch`). Callers guarantee that every window they
name is readable memory for the duration of the call; nothing else in the range is touched.
"""

from __future__ import annotations

import ctypes

import torch

#: The most elements one unfolded range may have (its ``numel`` must fit in int64): windows
#: far apart (the main heap and an mmap'd file, ~2**45 bytes) are gathered range by range.
MAX_UNFOLDED = 2**62


class _AddressRange:
    """``[addr, addr + nbytes)`` as a NumPy array interface (not owned, nothing allocated)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def host_bytes(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over the host memory at ``addr``; it does not own the memory."""
    try:
        import numpy as np
    except ImportError:  # NumPy is optional (torch does not require it)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(addr), dtype=torch.uint8)
    return torch.from_numpy(np.asarray(_AddressRange(addr, nbytes)))


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable unsigned-byte (``"B"``) memoryview of the memory of ``t``, a contiguous CPU
    tensor (``t.nbytes`` bytes from its first element); it keeps ``t`` alive.

    ``memoryview(t.numpy())`` where NumPy is installed; without it (async_ckpt does not require
    it) a ``ctypes`` array over the same memory.
    """
    try:
        return memoryview(t.numpy())  # type: ignore[arg-type, unused-ignore]  # numpy declares the buffer protocol for Python >= 3.12 only
    except (RuntimeError, TypeError):  # "Numpy is not available"; a dtype NumPy lacks (bfloat16, float8)
        n = t.numel() * t.element_size()
        if n == 0:
            return memoryview(bytearray())
        arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
        arr._owner = t  # type: ignore[attr-defined]  # the memory lives as long as the view
        return memoryview(arr).cast("B")


def _windows(lo: int, hi: int, nbytes: int) -> torch.Tensor:
    """Every ``nbytes``-byte window of ``[lo, hi)``, as rows (a view, no copy)."""
    return host_bytes(lo, hi - lo).unfold(0, nbytes, 1)


def gather(addrs: torch.Tensor, nbytes: int, out: torch.Tensor) -> None:
    """Copy the ``nbytes`` bytes at each address ``addrs[k]`` (int64) into ``out[k]``.

    One ``index_select`` over every ``nbytes``-byte window of ``[lowest, highest end)``; where
    that range unfolded would have too many elements (:data:`MAX_UNFOLDED`), the addresses are
    sorted and split into ranges that fit, one ``index_select`` each.
    """
    lo = int(addrs.min())
    hi = int(addrs.max()) + nbytes
    if (hi - lo) * nbytes < MAX_UNFOLDED:
        torch.index_select(_windows(lo, hi, nbytes), 0, addrs - lo, out=out)
        return
    order = torch.argsort(addrs)
    ordered = addrs.index_select(0, order).tolist()
    extent = max(nbytes, MAX_UNFOLDED // nbytes - 1)  # the widest range that fits
    start = 0
    for k in range(1, len(ordered) + 1):
        if k == len(ordered) or ordered[k] + nbytes - ordered[start] > extent:
            idx = order[start:k]
            first = ordered[start]
            part = torch.index_select(_windows(first, ordered[k - 1] + nbytes, nbytes), 0,
                                      addrs.index_select(0, idx) - first)
            out.index_copy_(0, idx, part)
            start = k
