"""Host snapshots of arbitrary checkpoint objects, for the framework integrations.

A framework's checkpoint is a nested object (dicts, lists, tuples, ``OrderedDict`` state dicts
with their ``_metadata``, hyper-parameter containers, modules, NumPy RNG states, ...) with
tensors anywhere inside. :class:`Snapshotter` takes it apart at the call as ``torch.save``
does (:func:`~async_ckpt.format.torch_record.pickle_archive`): ``torch.save``'s own pickle of
the object, in which every tensor is reduced as ``torch.save`` reduces it (its class,
``requires_grad``, subclass and attributes, conj/neg bits, sparse, quantized and meta layouts)
and refers to its *storage* by key; and the storages themselves, each staged once (views of
one storage stay views of one storage) by :class:`~async_ckpt.staging.Stager` through one
reused :class:`~async_ckpt.staging.HostBufferPool` (one batched copy per device type; no fresh
host allocation per save in steady state). A later mutation cannot reach the checkpoint.

:meth:`HostCopy.save` writes the file ``torch.save`` would have written for the original,
byte for byte (``data.pkl`` and every storage record; locations are the originals', so
``torch.load`` puts each tensor back on its device). :meth:`HostCopy.materialize` rebuilds the
object around the host copies, as ``torch.load`` of that file with every storage kept on the
host would.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Dict, List, Optional

import torch

from ..errors import CheckpointError, InvalidStateDictError
from ..format.torch_record import pickle_archive, save_archive
from ..staging import HostBufferPool, Stager


class _HostUnpickler(pickle.Unpickler):
    """Unpickles a :func:`pickle_archive` ``data.pkl`` around host storages, as ``torch.load``
    resolves its storage ids (every storage left on the host)."""

    def __init__(self, file: Any, storages: List[torch.UntypedStorage]) -> None:
        super().__init__(file)
        self.storages = storages
        self._typed: Dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        _, storage_type, key, _location, _numel = pid
        typed = self._typed.get(key)
        if typed is None:
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            typed = self._typed[key] = torch.storage.TypedStorage(
                wrap_storage=self.storages[int(key)], dtype=dtype, _internal=True)
        return typed


class HostCopy:
    """One checkpoint object at the moment of the call: its pickle and its storages' host copies.

    The host copies live in pooled buffers, given back by :meth:`release`. Made by
    :meth:`Snapshotter.take`.

    Args:
        data: the object's ``data.pkl`` as ``torch.save`` writes it.
        snapshot: the staged host copies of the storages (a ``HostSnapshot``; entry ``str(i)``
            holds the bytes of storage ``i``).
        sizes: per storage, its size in bytes.
        num_tensors: tensors that refer to the storages.
    """

    def __init__(self, data: bytes, snapshot: Any, sizes: List[int], num_tensors: int) -> None:
        self._data = data
        self._snapshot = snapshot
        self._sizes = sizes
        self.num_tensors = num_tensors
        self.nbytes = sum(sizes)

    def storages(self) -> List[torch.UntypedStorage]:
        """The host copies of the storages, each exactly the size of its original.

        Valid until :meth:`release`.

        Returns:
            The storage of record ``data/<i>`` at index ``i``.

        Raises:
            CheckpointError: the host copy was released already.
        """
        if self._snapshot is None:
            raise CheckpointError("the host copy was already released")
        sd = self._snapshot.state_dict
        return [_bytes_span(sd[str(i)]) for i in range(len(self._sizes))]

    def save(self, f: Any) -> None:
        """Write the ``torch.save`` file of the object copied.

        Byte for byte what ``torch.save`` writes for the original.

        Args:
            f: a writable binary file object or a path.

        Raises:
            CheckpointError: the host copy was released already.
        """
        save_archive(self._data, self.storages(), f)

    def materialize(self) -> Any:
        """The checkpoint object, rebuilt around the host copies (as ``torch.load`` rebuilds it).

        Valid until :meth:`release`.

        Returns:
            A new object of the same structure and types as the one copied.

        Raises:
            CheckpointError: the host copy was released already.
        """
        return _HostUnpickler(io.BytesIO(self._data), self.storages()).load()

    def release(self) -> None:
        """Give the host buffers back to the pool (idempotent)."""
        if self._snapshot is not None:
            self._snapshot.release()
            self._snapshot = None


def _bytes_span(host: torch.Tensor) -> torch.UntypedStorage:
    """A storage of exactly the bytes of the flat ``uint8`` tensor ``host``, sharing its memory
    (the pool may have placed it inside a larger buffer)."""
    if host.numel() == 0:
        return torch.UntypedStorage(0)
    return torch.from_numpy(host.numpy()).untyped_storage()


def _flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The bytes of ``storage`` as a flat ``uint8`` tensor on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


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
        try:
            data, storages, refs = pickle_archive(obj)
        except Exception as exc:
            raise InvalidStateDictError(f"{what}: cannot be saved ({type(exc).__name__}: {exc})") from exc
        flat = {str(i): _flat_bytes(s) for i, s in enumerate(storages)}
        try:
            snap = self.stager.stage(flat, self.stager.plan(flat))
        except InvalidStateDictError as exc:
            raise InvalidStateDictError(f"{what}: storage #{exc}") from exc
        return HostCopy(data, snap, [s.nbytes() for s in storages], refs)
