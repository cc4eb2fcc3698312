"""The result of staging: host copies of one state dict, holding pooled buffers."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .pool import Lease


@dataclass
class HostSnapshot:
    """Host copies of one state dict. Owns its pooled buffers until :meth:`release`.

    Attributes:
        state_dict: the host copy, in the structure of the state dict staged.
        nbytes: tensor bytes copied.
        num_tensors: tensors copied.
        int_keys: dotted paths of dict entries whose key is an int (see ``StagingPlan``).
        leases: the pooled buffers the copies live in.
        pending: lazy stage only: the copies still in flight
            (:class:`~async_ckpt.staging.lazy_copies.PendingCopies`); None when all are done.
        sources: zero-copy views of XLA device buffers the copies were read from; dropping
            many of them is slow, so the writer thread drops them (:meth:`drop_sources`), not
            the training thread.
        xla_shards: the snapshot holds staged XLA SPMD shards (torch_xla's ``_CpuShards``).
        xla_spmd: XLA tensors were staged in torch_xla's SPMD mode: the snapshot is written as
            torch_xla's manager writes it (its ``SPMDSavePlanner`` and key layout), shards or not.
        holders: writers that still read the snapshot (one per checkpoint tier it is written to).
    """

    state_dict: Dict[str, Any]
    nbytes: int
    num_tensors: int
    int_keys: List[str] = field(default_factory=list)
    leases: List[Lease] = field(default_factory=list)
    pending: Optional[Any] = None
    sources: Optional[List[torch.Tensor]] = None
    xla_shards: bool = False
    xla_spmd: bool = False
    holders: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _reuse: bool = field(default=True, repr=False)

    def share(self, holders: int) -> None:
        """Hand the snapshot to several writers.

        The buffers go back to the pool once each of them called :meth:`release`. Call it before
        handing it to any of them.

        Args:
            holders: the number of writers (>= 1).

        Raises:
            ValueError: ``holders`` is below 1.
        """
        if holders < 1:
            raise ValueError(f"holders must be >= 1, got {holders}")
        self.holders = holders

    def drop_sources(self) -> None:
        """Release the device-buffer views the host copies were made from (copies are done)."""
        self.sources = None

    def wait_copied(self) -> None:
        """Lazy snapshots: wait until every host copy is done (eager ones: return at once).

        Raises:
            TornSnapshotError: a source tensor changed before its copy was taken
                (:class:`~async_ckpt.errors.TornSnapshotError`).
        """
        if self.pending is not None:
            self.pending.result()

    def release(self, reuse: bool = True) -> None:
        """One holder is done: the last one gives the buffers back to the pool.

        A holder must call it once and not read the snapshot afterwards.

        Args:
            reuse: False: something of this holder's may still read the buffers (a write that
                timed out, its request stuck): once the last holder is done they are given up
                (freed when the last reference goes), never handed out again by the pool.
        """
        with self._lock:
            self._reuse = self._reuse and reuse
            self.holders -= 1
            if self.holders > 0:
                return
        if self.pending is not None:
            self.pending.wait_all()  # never hand out a buffer a lazy copy still writes into
        for lease in self.leases:
            if self._reuse:
                lease.release()
            else:
                lease.give_up()
        self.leases = []
