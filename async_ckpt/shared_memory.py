"""Staging buffers in memory shared with the writer process.

A save written by the writer process (``CheckpointManager(writer="process")``) is read there
straight from the buffers the stall copied into: nothing is copied at the hand-off. Each such
buffer is an anonymous shared-memory file (``memfd_create``) mapped into the training process
and, once a save refers to it, into the writer process, which receives its descriptor over the
socket between the two (``SCM_RIGHTS``).

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
from typing import List, Optional

import torch

log = logging.getLogger("async_ckpt")

_ids = itertools.count(1)
_warned = threading.Event()
_closed: List[int] = []  # ids of blocks closed since the writer process last heard (take_closed)
_closed_lock = threading.Lock()


def take_closed() -> List[int]:
    """The ids of the blocks closed since the last call: the writer process unmaps them."""
    with _closed_lock:
        out = _closed[:]
        del _closed[:]
        return out


class SharedBlock:
    """One shared-memory buffer: its descriptor, an id the writer process knows it by, and the
    ``uint8`` tensor over its mapping in this process.

    Args:
        fd: the memfd (kept open while the block lives: a restarted writer process maps it again).
        nbytes: its size.
        tensor: the ``uint8`` tensor over this process's mapping.
        registered: the mapping is page-locked for CUDA (``cudaHostRegister``).
    """

    __slots__ = ("id", "fd", "nbytes", "tensor", "registered", "address")

    def __init__(self, fd: int, nbytes: int, tensor: torch.Tensor, registered: bool) -> None:
        self.id = next(_ids)
        self.fd = fd
        self.nbytes = nbytes
        self.tensor = tensor
        self.registered = registered
        self.address = tensor.data_ptr()

    def close(self) -> None:
        """Give up the block: unlock its pages (CUDA) and close its descriptor. The mapping goes
        with the last tensor viewing it (the pool drops its own right after)."""
        if self.registered:
            self.registered = False
            try:
                torch.cuda.cudart().cudaHostUnregister(self.address)
            except Exception as exc:  # noqa: BLE001 - the memory is unmapped with the tensor anyway
                log.debug("cudaHostUnregister failed: %s", exc)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            with _closed_lock:
                _closed.append(self.id)


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
    create = getattr(os, "memfd_create", None)
    if create is None or nbytes <= 0:
        return None
    fd = -1
    try:
        fd = create("async_ckpt_staging", getattr(os, "MFD_CLOEXEC", 1))
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        tensor = torch.frombuffer(mm, dtype=torch.uint8)  # keeps the mapping alive
    except (OSError, ValueError, RuntimeError) as exc:
        if fd >= 0:
            os.close(fd)
        if not _warned.is_set():
            _warned.set()
            log.warning("no shared memory for staging (%s): saves staged in ordinary memory are written by the "
                        "training process's writer thread", exc)
        return None
    registered = False
    if pinned:
        try:
            err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
            registered = int(err) == 0
        except Exception as exc:  # noqa: BLE001 - not pinned: staged in ordinary pinned memory instead
            log.debug("cudaHostRegister failed: %s", exc)
        if not registered:
            os.close(fd)
            return None
    return SharedBlock(fd, nbytes, tensor, registered)
