"""Host snapshots of arbitrary checkpoint objects, for the framework integrations.

A framework's checkpoint is a nested object (dicts, lists, tuples, ``OrderedDict`` state dicts
with their ``_metadata``, hyper-parameter containers, NumPy RNG states, ...) with tensors
anywhere inside. :class:`Snapshotter` takes it apart at the call: one pickle of the object in
which every tensor is replaced by a reference (so the non-tensor parts are copied, with their
exact types, and a later mutation cannot reach the checkpoint), and the tensors themselves
staged to host memory by :class:`~async_ckpt.staging.Stager` through one reused
:class:`~async_ckpt.staging.HostBufferPool` (one batched copy; no fresh host allocation per
save in steady state). :meth:`HostCopy.materialize` rebuilds the object around the host copies
in the background, each tensor on a storage of exactly its own bytes, so ``torch.save`` writes
what it would have written for the original (storage sharing between tensors kept).
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Dict, List, Optional, Tuple, cast

import torch

from ..errors import CheckpointError, InvalidStateDictError
from ..staging import HostBufferPool, Stager


class _RefPickler(pickle.Pickler):
    """Pickles an object with every tensor replaced by its index in ``tensors``."""

    def __init__(self, file: Any, tensors: List[torch.Tensor]) -> None:
        super().__init__(file, protocol=2)  # torch.save's protocol: what pickles here, saves there
        self.tensors = tensors
        self._index: Dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            k = self._index.get(id(obj))
            if k is None:
                k = self._index[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return k
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            raise pickle.PicklingError("a bare tensor storage cannot be checkpointed asynchronously")
        return None


class _RefUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, tensors: List[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[pid]


class HostCopy:
    """One checkpoint object at the moment of the call: its skeleton and its tensors' host copies.

    The host copies live in pooled buffers, given back by :meth:`release`. Made by
    :meth:`Snapshotter.take`.

    Args:
        skeleton: the object pickled with every tensor replaced by a reference.
        snapshot: the staged host copies of the tensors (a ``HostSnapshot``).
        groups: per tensor, the id of the original storage it viewed (tensors of one storage
            share one storage again in :meth:`materialize`).
        nbytes: tensor bytes copied.
    """

    def __init__(self, skeleton: bytes, snapshot: Any, groups: List[int], nbytes: int) -> None:
        self._skeleton = skeleton
        self._snapshot = snapshot
        self._groups = groups  # per tensor: the original storage's group id
        self.nbytes = nbytes

    @property
    def num_tensors(self) -> int:
        """How many tensors the snapshot holds."""
        return len(self._groups)

    def materialize(self) -> Any:
        """The checkpoint object, its tensors replaced by compact host tensors.

        Valid until :meth:`release`.

        Returns:
            A new object of the same structure and types as the one copied.

        Raises:
            CheckpointError: the host copy was released already.
        """
        if self._snapshot is None:
            raise CheckpointError("the host copy was already released")
        sd = self._snapshot.state_dict
        host = [sd[str(i)] for i in range(len(self._groups))]
        return _RefUnpickler(io.BytesIO(self._skeleton), _compact(host, self._groups)).load()

    def release(self) -> None:
        """Give the host buffers back to the pool (idempotent)."""
        if self._snapshot is not None:
            self._snapshot.release()
            self._snapshot = None


def _bytes_span(storage: torch.UntypedStorage, lo: int, hi: int) -> torch.UntypedStorage:
    """A storage of exactly the bytes ``[lo, hi)`` of ``storage``, sharing its memory (no copy)."""
    span = torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,), (1,))
    return torch.from_numpy(span.numpy()).untyped_storage()


def _extent(t: torch.Tensor) -> Tuple[int, int]:
    es = t.element_size()
    lo = cast(int, t.storage_offset()) * es  # typed int | SymInt (symbolic shapes); host tensors have ints
    return lo, lo + (1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride()))) * es


def _compact(host: List[torch.Tensor], groups: List[int]) -> List[torch.Tensor]:
    """Host tensors on storages of their own bytes: the tensors of one original storage (tied
    weights, views) share one storage spanning what they use; other tensors share nothing, even
    where the pool coalesced them into one buffer."""
    out: List[Optional[torch.Tensor]] = [None] * len(host)
    by_group: Dict[Tuple[int, int], List[int]] = {}
    for i, (h, g) in enumerate(zip(host, groups)):
        if h.numel() == 0:
            out[i] = torch.empty(h.shape, dtype=h.dtype)
        else:
            by_group.setdefault((g, h.untyped_storage().data_ptr()), []).append(i)
    for members in by_group.values():
        if len(members) == 1:
            h = host[members[0]]
            if h.is_contiguous():
                es = h.element_size()
                lo = cast(int, h.storage_offset()) * es  # an int on a host tensor (typed int | SymInt)
                st = _bytes_span(h.untyped_storage(), lo, lo + h.numel() * es)
                out[members[0]] = torch.empty(0, dtype=h.dtype).set_(st, 0, h.size(), h.stride())
                continue
        extents = [_extent(host[i]) for i in members]
        lo, hi = min(e[0] for e in extents), max(e[1] for e in extents)
        if any((e[0] - lo) % host[i].element_size() for i, e in zip(members, extents)):
            for i in members:  # mixed dtypes at odd offsets: each on its own
                out[i] = host[i].clone()
            continue
        st = _bytes_span(host[members[0]].untyped_storage(), lo, hi)
        done: Dict[int, torch.Tensor] = {}
        for i in members:
            h = host[i]
            if id(h) not in done:
                done[id(h)] = torch.empty(0, dtype=h.dtype).set_(
                    st, h.storage_offset() - lo // h.element_size(), h.size(), h.stride())
            out[i] = done[id(h)]
    return out  # type: ignore[return-value]


class Snapshotter:
    """Takes :class:`HostCopy` objects of checkpoint objects through one pooled :class:`Stager`.

    A pickled copy (a framework object holding it sent to a spawned process, or saved whole)
    is a new snapshotter with the same budget: host buffers are never pickled.

    Args:
        memory_budget_bytes: bound on the host staging pool (None: the pool keeps what recent
            saves used).
    """

    def __init__(self, memory_budget_bytes: Optional[int] = None) -> None:
        self.stager = Stager(HostBufferPool(memory_budget_bytes))

    def __getstate__(self) -> Dict[str, Any]:
        return {"memory_budget_bytes": self.pool.budget_bytes}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["memory_budget_bytes"])  # type: ignore[misc]

    @property
    def pool(self) -> HostBufferPool:
        """The host buffer pool of the stager."""
        return self.stager.pool

    def take(self, obj: Any, what: str = "checkpoint") -> HostCopy:
        """Host copy of ``obj``, taken now: its non-tensor parts pickled, its tensors staged.

        Args:
            obj: the checkpoint object (any picklable nesting with tensors anywhere).
            what: names the object in error messages.

        Returns:
            The host copy.

        Raises:
            InvalidStateDictError: ``obj`` cannot be pickled, or a tensor cannot be staged.
            StagingBudgetError: the tensors need more host memory than the pool's budget.
        """
        tensors: List[torch.Tensor] = []
        buf = io.BytesIO()
        try:
            _RefPickler(buf, tensors).dump(obj)
        except Exception as exc:
            raise InvalidStateDictError(f"{what}: cannot be saved ({type(exc).__name__}: {exc})") from exc
        groups: List[int] = []
        gid: Dict[Tuple[str, int], int] = {}
        for t in tensors:
            try:
                key: Tuple[str, int] = (t.device.type, t.untyped_storage().data_ptr())
            except Exception:  # no addressable storage (XLA, meta, sparse): a group of its own
                key = ("", id(t))
            groups.append(gid.setdefault(key, len(gid)))
        flat = {str(i): t for i, t in enumerate(tensors)}
        try:
            snap = self.stager.stage(flat, self.stager.plan(flat))
        except InvalidStateDictError as exc:
            raise InvalidStateDictError(f"{what}: tensor #{exc}") from exc
        return HostCopy(buf.getvalue(), snap, groups, snap.nbytes)
