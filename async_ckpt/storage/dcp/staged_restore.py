"""Atomic restore: every file read and verified into host buffers first, then copied into the target.

:func:`load_staged` is the single-process ``restore(..., atomic=True)``:

1. The data files that the checkpoint's ``.metadata`` points at are read whole, in ranges of
   at most ``DIRECT_CHUNK_BYTES`` in parallel over ``threads``, into host buffers that the
   caller's ``acquire`` hands out (the manager's host buffer pool, so that repeated restores
   reuse the same memory and its budget bounds it; without ``acquire``, fresh buffers of the
   files' sizes). Each range's CRC-32C is computed on the thread that read it; every file's
   size and checksum are checked against the manifest.
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

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ...addresses import byte_view
from ...errors import CorruptCheckpointError, StagingBudgetError
from ..fs import Storage
from ..manifest import FileRecord, crc32c
from .crc import crc32c_concat
from .direct import _run, load_direct
from .direct_plan import DIRECT_CHUNK_BYTES
from .reader import close_all, load_state_dict, open_step_file

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
        _read_verified(storage, path, files, views, verify, threads)
        staged = cast(Storage, StagedStorage(storage, path, views))
        if planner is None and load_direct(staged, path, state_dict, files=files, metadata=metadata, verify=False,
                                           threads=threads, allow_pickle=allow_pickle, staged=True):
            return
        load_state_dict(staged, path, state_dict, files=files, verify=False, threads=threads,
                        allow_pickle=allow_pickle, metadata=metadata, planner=planner, strict=strict,
                        process_group=process_group)
    finally:
        release()


def _open(storage: Storage, path: str, name: str, size: int) -> Any:
    return open_step_file(storage, path, name, size)

def _read_verified(storage: Storage, path: str, files: Dict[str, FileRecord], views: Dict[str, torch.Tensor],
                   verify: bool, threads: int) -> None:
    """Read every file of ``views`` whole into its buffer; raise :class:`CorruptCheckpointError`
    for a file of another size than the manifest's or (``verify``) another CRC-32C."""
    readers: Dict[str, Any] = {}
    try:
        for name, buf in views.items():
            readers[name] = _open(storage, path, name, buf.numel())
        # (name, start, end, extra): extra = 1 on the last range of a file whose size the storage
        # does not know, so that a longer file is caught as well as a shorter one
        tasks: List[Tuple[str, int, int, int]] = []
        per: Dict[str, List[int]] = {}
        for name, buf in views.items():
            size = buf.numel()
            per[name] = []  # an empty file is checked too
            ranges = [(lo, min(size, lo + DIRECT_CHUNK_BYTES)) for lo in range(0, size, DIRECT_CHUNK_BYTES)] or [(0, 0)]
            for k, (lo, hi) in enumerate(ranges):
                extra = int(k == len(ranges) - 1 and readers[name].known_size is None)
                if hi > lo or extra:
                    per[name].append(len(tasks))
                    tasks.append((name, lo, hi, extra))

        def run(task: Tuple[str, int, int, int]) -> Tuple[int, int]:
            name, lo, hi, extra = task
            r = readers[name]
            mv = byte_view(views[name])[lo:hi]
            got = r.read_into(lo, mv) if hi > lo else 0
            crc = crc32c(mv[:got]) if verify else 0
            if extra and got == hi - lo:
                got += r.read_into(hi, memoryview(bytearray(1)))  # 1: the file goes on past its size
            return got, crc

        # a run of consecutive ranges of one file per job (one sequential stream per job)
        split = max(1, -(-max(1, threads) // max(1, len(per))))
        groups: List[List[int]] = []
        for idx in per.values():
            if not idx:
                continue
            n = -(-len(idx) // split)
            groups += [idx[k:k + n] for k in range(0, len(idx), n)]
        results: List[Tuple[int, int]] = [(0, 0)] * len(tasks)

        def run_group(group: List[int]) -> None:
            for i in group:
                results[i] = run(tasks[i])

        with ThreadPoolExecutor(max(1, min(threads, len(groups))), thread_name_prefix="async-ckpt-stage") as pool:
            _run(pool, [lambda g=g: run_group(g) for g in groups])  # type: ignore[misc]
    finally:
        close_all(readers)
    for name, idx in per.items():
        where = f"{path}/{name}"
        size = views[name].numel()
        total = 0
        for i in idx:
            _, lo, hi, _ = tasks[i]
            got = results[i][0]
            if got < hi - lo:
                raise CorruptCheckpointError(f"{where}: size is {lo + got} bytes, manifest says {size}", path=where)
            if got > hi - lo:
                raise CorruptCheckpointError(f"{where}: size is more than {size} bytes, manifest says {size}",
                                             path=where)
            total += got
        if verify:
            crc = crc32c_concat((results[i][1], tasks[i][2] - tasks[i][1]) for i in idx)
            if crc != files[name].crc32c:
                raise CorruptCheckpointError(
                    f"{where}: checksum mismatch (crc32c {crc:#010x}, manifest says {files[name].crc32c:#010x})",
                    path=where)


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
    """``storage`` with the files of ``views`` (``path/name`` -> verified bytes) served from
    memory; every other call goes to ``storage``."""

    is_local = True  # reads are memory copies: no request cost

    def __init__(self, storage: Storage, path: str, views: Dict[str, torch.Tensor]) -> None:
        self._storage = storage
        self._staged = {f"{path}/{name}": buf for name, buf in views.items()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    def file_problem(self, where: str, inside: str) -> Optional[str]:
        return None if where in self._staged else self._storage.file_problem(where, inside)

    def open_ranges(self, where: str) -> Any:
        buf = self._staged.get(where)
        return self._storage.open_ranges(where) if buf is None else _StagedRanges(buf)

    def read_into(self, where: str, start: int, out: memoryview) -> int:
        buf = self._staged.get(where)
        return self._storage.read_into(where, start, out) if buf is None else _StagedRanges(buf).read_into(start, out)

    def read_bytes(self, where: str) -> bytes:
        buf = self._staged.get(where)
        return self._storage.read_bytes(where) if buf is None else bytes(byte_view(buf))
