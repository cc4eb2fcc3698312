"""Atomic restore: every file read and verified into host buffers first, then copied into the target.

:func:`load_staged` is the single-process ``restore(..., atomic=True)``:

1. The data files that the checkpoint's ``.metadata`` points at are read whole and verified by
   the one verified read (:func:`~.read_exec.read_files`), into host buffers that the
   caller's ``acquire`` hands out (the manager's host buffer pool, so that repeated restores
   reuse the same memory and its budget bounds it; without ``acquire``, fresh buffers of the
   files' sizes).
2. Only once every file passed, the target is written: the direct restore
   (:func:`~.direct.load_direct`) runs over the verified buffers instead of the files, so the
   record layout, scatter and XLA handling are the direct path's; told that they are staged,
   it also checks where each record's data lies and reads the records that only ``torch.load``
   reads before its first write into a target. Targets it does not handle
   (or a custom ``planner``) are loaded by DCP (:func:`~.reader.load_state_dict`), reading
   from the same buffers.
3. The buffers go back (``release``) whatever happened.

A checkpoint larger than ``budget`` raises :class:`~async_ckpt.errors.StagingBudgetError`
before anything is read. Any failure in step 1, or one the direct restore finds, leaves the
target untouched.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..addresses import byte_view
from ..errors import StagingBudgetError
from ..format.manifest import FileRecord
from ..storage.storage import Storage
from .dcp_adapters import load_state_dict
from .read_exec import IntoBuffers, StepFiles, read_files
from .read_targets import load_direct

#: ``acquire(sizes)`` -> (one flat uint8 CPU buffer of exactly each size, a function that gives them back).
Acquire = Callable[[Sequence[int]], Tuple[Sequence[torch.Tensor], Callable[[], None]]]

#: Copies out of a staged buffer at least this large go through ``torch`` (which releases the GIL).
_TORCH_COPY_BYTES = 2**20


def staged_files(metadata: Metadata, files: Dict[str, FileRecord]) -> Dict[str, int]:
    """The data files ``metadata`` points at, with their manifest sizes (in file-name order)."""
    data = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    names = sorted({info.relative_path for info in data.values()})
    return {n: files[n].size for n in names if n in files}


def _fresh(sizes: Sequence[int]) -> Tuple[Sequence[torch.Tensor], Callable[[], None]]:
    return [torch.empty(n, dtype=torch.uint8) for n in sizes], lambda: None  # never zero-filled


def load_staged(storage: Storage, path: str, state_dict: Dict[str, Any], *, files: Dict[str, FileRecord],
                metadata: Metadata, verify: bool = True, threads: int = 8, allow_pickle: bool = False,
                planner: Any = None, strict: bool = True, process_group: Any = None,
                acquire: Optional[Acquire] = None, budget: Optional[int] = None) -> None:
    """Load the checked ``metadata``'s checkpoint under ``path`` into ``state_dict`` in place,
    every file read and verified into buffers from ``acquire`` before the first write (see the
    module docstring). ``budget``: the most bytes ``acquire`` may hand out."""
    sizes = staged_files(metadata, files)
    total = sum(sizes.values())
    if budget is not None and total > budget:
        raise StagingBudgetError(
            f"restore(..., atomic=True) of {path} stages its {len(sizes)} data files "
            f"({total / 2**20:.1f} MiB, {total} bytes) in host memory, but memory_budget_bytes is "
            f"{budget / 2**20:.1f} MiB ({budget} bytes); raise memory_budget_bytes, or restore with "
            "atomic=False, which reads straight into the target without that memory; the target "
            "was not touched")
    buffers, release = (acquire or _fresh)(list(sizes.values()))
    try:
        views = dict(zip(sizes, buffers))
        read_files(storage, path, {n: files[n] for n in views}, IntoBuffers(views), verify=verify, threads=threads)
        staged = StagedStorage(storage, path, views)
        if planner is None and load_direct(staged, path, state_dict, files=files, metadata=metadata, verify=False,
                                           threads=threads, allow_pickle=allow_pickle, staged=True):
            return
        load_state_dict(staged, path, state_dict, files=files, verify=False, threads=threads,
                        allow_pickle=allow_pickle, metadata=metadata, planner=planner, strict=strict,
                        process_group=process_group)
    finally:
        release()


class _StagedRanges:
    """A :class:`~.fs.RetriedRanges` over a staged buffer."""

    def __init__(self, buf: torch.Tensor) -> None:
        self._buf = buf
        self._mv = byte_view(buf)
        self.known_size: Optional[int] = buf.numel()

    def read_into(self, start: int, out: memoryview) -> int:
        n = max(0, min(len(out), self._buf.numel() - start))
        if n >= _TORCH_COPY_BYTES:
            torch.frombuffer(out, dtype=torch.uint8, count=n).copy_(self._buf[start:start + n])
        elif n:
            out[:n] = self._mv[start:start + n]
        return n

    def close(self) -> None:
        pass

    def __enter__(self) -> "_StagedRanges":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class StagedStorage:
    """The files of ``views`` (``path/name`` -> verified bytes) served from memory, as the
    readers read a step (:class:`~.read_exec.StepFiles`); any other file from ``storage``."""

    is_local = True  # reads are memory copies: no request cost

    def __init__(self, storage: StepFiles, path: str, views: Dict[str, torch.Tensor]) -> None:
        self._storage = storage
        self._staged = {f"{path}/{name}": buf for name, buf in views.items()}

    def file_problem(self, where: str, inside: str) -> Optional[str]:
        return None if where in self._staged else self._storage.file_problem(where, inside)

    def open_ranges(self, where: str) -> Any:
        buf = self._staged.get(where)
        return self._storage.open_ranges(where) if buf is None else _StagedRanges(buf)

    def read_bytes(self, where: str) -> bytes:
        buf = self._staged.get(where)
        return self._storage.read_bytes(where) if buf is None else bytes(byte_view(buf))
