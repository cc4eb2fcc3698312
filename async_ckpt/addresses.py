"""Reading host memory by address: many same-sized windows copied by one gather.

Used where making a Python tensor per source would cost more than copying its bytes: XLA
buffers on PJRT CPU (:mod:`async_ckpt.staging.xla_gather`) and runs of small records
(:class:`async_ckpt.storage.records.RecordBatch`). Callers guarantee that every window they
name is readable memory for the duration of the call; nothing else in the range is touched.
"""

from __future__ import annotations

import torch


class _AddressRange:
    """``[addr, addr + nbytes)`` as a NumPy array interface (not owned, nothing allocated)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def host_bytes(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over the host memory at ``addr``; it does not own the memory."""
    import numpy as np

    return torch.from_numpy(np.asarray(_AddressRange(addr, nbytes)))


def gather_rows(base: torch.Tensor, starts: torch.Tensor, nbytes: int, out: torch.Tensor) -> None:
    """Copy the ``nbytes`` bytes at each offset ``starts[k]`` of ``base`` into ``out[k]``:
    one ``index_select`` over every ``nbytes``-byte window of ``base`` (a view, no copy)."""
    torch.index_select(base.unfold(0, nbytes, 1), 0, starts, out=out)
