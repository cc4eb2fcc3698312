"""Restore: reading a DCP checkpoint through :class:`~async_ckpt.storage.storage.Storage`.

What the load plan needs is read concurrently and checked against the manifest before the
target state dict is touched (with several ranks, before any rank touches its own: they
exchange their outcomes first), so a failed restore leaves it untouched: of a file whose
manifest entry lists its records (:class:`~..manifest.FileRecord`), only the records the plan's
items lie in, adjacent ones in one request, each checked against its CRC32C; any other file
whole (a big one as concurrent ranged reads), checked against its size and CRC32C. A tensor item stored as one plain ``torch.save`` storage is
copied straight from the read buffer into its target (:func:`stored_bytes`); anything else
goes through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import bisect
import io
import itertools
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Dict, List, Optional, Protocol, Set, Tuple, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import compat
from ..addresses import byte_view
from ..errors import CorruptCheckpointError
from ..format.crc import crc32c
from ..format.dcp_layout import METADATA_NAME
from ..format.manifest import FileRecord, check_file_name, shown
from ..format.torch_record import plain_data_start
from ..format.unpickling import SafeLoadPlanner, load_metadata
from ..format.validate import check_step_metadata
from ..storage.storage import READ_RANGE_BYTES
from .dcp_call import call_dcp, distributed
from .read_exec import (
    FRESH,
    StepFiles,
    check_file,
    checksum_error,
    close_all,
    open_checked_ranges,
    read_files,
    short_error,
    unreadable_is_damage,
)

if TYPE_CHECKING:  # the class compat returns, named for the type checker
    from torch.distributed.checkpoint.filesystem import _StorageInfo
else:
    _StorageInfo, _ = compat.dcp_storage_info()
narrow_tensor_by_index = compat.narrow_tensor_by_index()

_REQUEST_COST = 2**20  # a read request costs about as much time as reading this many bytes more


class _BytesDecoder(Protocol):
    """A load planner that decodes a non-tensor item apart from setting it (``SafeLoadPlanner``)."""

    def decode_bytes(self, read_item: Any, value: io.BytesIO) -> Any: ...

    def set_bytes(self, read_item: Any, obj: Any) -> None: ...


class PeerReadFailed(Exception):
    """This rank's part of a multi-process restore was read and verified, another rank's was
    not: this rank wrote nothing either. Not a :class:`~async_ckpt.errors.CheckpointError`, so
    that the failing rank's own error is the one every rank raises (see
    :func:`~.dcp_call.unwrap_dcp`)."""


class FsspecStorageReader(StorageReader):
    """DCP ``StorageReader``: what the plan needs read concurrently, verified, then deserialised.

    With ``files`` (the manifest's records) only files it lists are read, each checked against
    its size (and, with ``verify``, its CRC32C); of a file whose record lists its items'
    records, only the records the plan touches are read, each checked against its CRC32C. Every name read must be a plain file name inside
    ``path`` (never ``../x``, an absolute path, or a link leading out); anything else, and a
    directory where a file should be, is a :class:`CorruptCheckpointError`.
    """

    def __init__(self, storage: StepFiles, path: str, *, files: Optional[Dict[str, FileRecord]] = None,
                 verify: bool = True, threads: int = 8, metadata: Optional[Metadata] = None,
                 agree: Optional[Callable[[Optional[str]], List[Optional[str]]]] = None,
                 whole: bool = True) -> None:
        super().__init__()
        #: whether the copy holds every element of every tensor (see check_step_metadata)
        self.whole = whole
        #: every rank's read outcome (None: ok, else its error) from this rank's: a collective
        #: over the load's process group (see :meth:`read_data`)
        self.agree = agree
        #: whether :meth:`read_data` started writing into the caller's state dict
        self.touched = False
        self.storage = storage
        self.path = path
        self.files = files
        self.verify = verify
        self.threads = max(1, threads)
        self._metadata = metadata
        self.storage_data: Dict[MetadataIndex, _StorageInfo] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def _checked_path(self, name: str) -> str:
        """``path/name``, once ``name`` is known safe to read (see the class docstring)."""
        check_file_name(name, where=f"{self.path}/{METADATA_NAME}")
        where = f"{self.path}/{name}"
        if self.files is not None and name not in self.files:
            raise CorruptCheckpointError(f"{where}: not listed in the manifest; refusing to read it unchecked",
                                         path=where)
        problem = self.storage.file_problem(where, self.path)
        if problem is not None:
            raise CorruptCheckpointError(f"{where}: {problem}", path=where)
        return where

    def read_file(self, name: str) -> bytes:
        where = self._checked_path(name)
        with unreadable_is_damage(where):
            data = self.storage.read_bytes(where)
        rec = (self.files or {}).get(name)
        if rec is not None:
            check_file(where, rec.size, [(0, rec.size, len(data), crc32c(data) if self.verify else 0)], rec.crc32c,
                       self.verify)
        return data

    def _read_files(self, names: List[str], pool: ThreadPoolExecutor) -> Dict[str, Any]:
        """Read and verify ``names`` concurrently; a big file as concurrent ranged reads.

        A file of at most ``2 * READ_RANGE_BYTES`` is one whole-object read (one request,
        :meth:`read_file`). A bigger one whose size the manifest gives is read by the one
        verified read (:func:`~.read_exec.read_files`) into a fresh buffer, in ranges of
        ``READ_RANGE_BYTES``, on ``pool``.
        """
        records = self.files or {}
        split = {n: records[n] for n in names if n in records and records[n].size > 2 * READ_RANGE_BYTES}
        for n in split:
            self._checked_path(n)
        whole = [n for n in names if n not in split]
        futs = [pool.submit(self.read_file, n) for n in whole]
        out: Dict[str, Any] = {}
        if split:
            bufs = read_files(self.storage, self.path, split, FRESH, verify=self.verify, chunk=READ_RANGE_BYTES,
                              pool=pool)
            out.update({n: byte_view(b) for n, b in bufs.items()})
        out.update(zip(whole, [f.result() for f in futs]))  # re-raises the first failure
        return out

    def _read_records(self, wanted: Dict[str, List[Tuple[int, int]]], pool: ThreadPoolExecutor
                      ) -> Dict[str, Tuple[List[int], List[memoryview]]]:
        """Per file of ``wanted``, the records that its byte ranges (offset, length) lie in,
        read concurrently and (with ``verify``) checked against their CRC32Cs: the start of
        each run of adjacent records, and its bytes. A run is one request (a big one is split
        into concurrent ranges of about ``READ_RANGE_BYTES``)."""
        files = cast(Dict[str, FileRecord], self.files)
        plans = []  # (name, where, record starts, runs of record indices)
        for name, spans in wanted.items():
            records = cast(Tuple[Tuple[int, int], ...], files[name].records)
            starts = [0, *itertools.accumulate(n for n, _ in records)]  # starts[-1]: the file's size
            needed: Set[int] = set()
            for offset, length in spans:
                first = max(0, bisect.bisect_right(starts, offset) - 1)
                last = max(first + 1, bisect.bisect_left(starts, offset + length))
                needed.update(range(first, min(last, len(records))))
            runs: List[List[int]] = []  # [first record, last record + 1]
            for k in sorted(needed):
                if runs and runs[-1][1] == k:
                    runs[-1][1] = k + 1
                else:
                    runs.append([k, k + 1])
            plans.append((name, self._checked_path(name), starts, runs))
        readers: Dict[str, Any] = {}
        out: Dict[str, Tuple[List[int], List[memoryview]]] = {}
        reads = []  # (reader, where, file offset, buffer): one request each
        try:
            for name, where, starts, runs in plans:
                readers[name] = reader = self._open_ranges(where, files[name].size)
                # not zero-filled: every byte is overwritten by the reads (or the file is too short)
                bufs = [byte_view(torch.empty(starts[b] - starts[a], dtype=torch.uint8))
                        for a, b in runs]
                out[name] = ([starts[a] for a, _ in runs], bufs)
                reads += [(reader, where, starts[a] + lo, buf[lo:lo + READ_RANGE_BYTES])
                          for buf, (a, _) in zip(bufs, runs) for lo in range(0, len(buf), READ_RANGE_BYTES)]
            # Consecutive reads grouped into about 4 tasks per thread of equal cost (a request
            # costs as much as reading _REQUEST_COST bytes), not a task per small record.
            share = sum(len(r[3]) + _REQUEST_COST for r in reads) / (4 * self.threads)
            tasks: List[List[Tuple[Any, str, int, memoryview]]] = [[]]
            held = 0
            for r in reads:
                tasks[-1].append(r)
                held += len(r[3]) + _REQUEST_COST
                if held >= share:
                    tasks.append([])
                    held = 0

            def read(task: List[Tuple[Any, str, int, memoryview]]) -> None:
                for reader, where, start, buf in task:
                    if reader.read_into(start, buf) != len(buf):
                        raise short_error(where, start + len(buf))

            list(pool.map(read, tasks))  # re-raises the first failure
        finally:
            close_all(readers)
        if not self.verify:
            return out
        batches: List[List[Tuple[str, memoryview, int, int]]] = [[]]  # of about READ_RANGE_BYTES each
        held = 0  # bytes in the last batch
        for name, where, starts, runs in plans:
            records = cast(Tuple[Tuple[int, int], ...], files[name].records)
            for buf, (a, b) in zip(out[name][1], runs):
                for k in range(a, b):  # (where, record bytes, crc32c, start)
                    batches[-1].append((where, buf[starts[k] - starts[a]: starts[k + 1] - starts[a]],
                                        records[k][1], starts[k]))
                    held += records[k][0]
                    if held >= READ_RANGE_BYTES:
                        batches.append([])
                        held = 0

        def check(batch: List[Tuple[str, memoryview, int, int]]) -> None:
            for where, data, want, start in batch:
                crc = crc32c(data)
                if crc != want:
                    raise checksum_error(where, crc, want, (start, start + len(data)))

        list(pool.map(check, batches))
        return out

    def _open_ranges(self, where: str, size: int) -> Any:
        return open_checked_ranges(self.storage, where, size)
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata``, read and checked (once; a ``metadata`` given to the constructor is
        taken as checked): see :meth:`check_metadata`."""
        if self._metadata is None:
            md = load_metadata(self.read_file(METADATA_NAME), where=f"{self.path}/{METADATA_NAME}")
            self.check_metadata(md)
            self._metadata = md
        return self._metadata

    def check_metadata(self, md: Metadata) -> None:
        """Raise :class:`CorruptCheckpointError` unless ``md`` passes
        :func:`~.validate.check_step_metadata` against the manifest's records (with ``files``).
        Files the manifest lists that no item points at are read and checked too, so that
        every listed file is checked by a restore."""
        ends = check_step_metadata(md, self.files, where=f"{self.path}/{METADATA_NAME}", whole=self.whole)
        for name in sorted(self.files or ()):
            if name != METADATA_NAME and name not in ends:
                self.read_file(name)  # referenced by no item: still checked (size, checksum)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Read, verify and decode every item of ``plan`` (:meth:`_prepare`), then write them into
        the targets (:meth:`_apply`). With ``agree`` (a multi-process restore), every rank's
        outcome of the first part is exchanged before any rank writes: if any rank failed, none
        writes, and the others raise :class:`PeerReadFailed` naming it."""
        failure: Optional[Exception] = None
        try:
            ready = self._prepare(plan, planner)
        except Exception as exc:  # noqa: BLE001 - exchanged below, then raised
            ready, failure = {}, exc
        if self.agree is not None:
            outcomes = self.agree(None if failure is None else f"{type(failure).__name__}: {failure}")
            bad = [f"rank {r}: {o}" for r, o in enumerate(outcomes) if o is not None]
            if bad and failure is None:
                raise PeerReadFailed(f"{self.path}: not restored: reading another rank's part failed "
                                     f"({'; '.join(bad)}); this rank wrote nothing")
        if failure is not None:
            raise failure
        self.touched = True
        self._apply(ready, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _prepare(self, plan: LoadPlan, planner: LoadPlanner) -> Dict[str, List[Tuple[Any, Any, Any]]]:
        """Per file, ``(req, target, what)`` for each item of ``plan``, in file order: every
        record read and verified, each non-tensor item decoded (``what``: the object), each
        tensor item's data ready to copy (``what``: ``(dst, src)`` straight from the read
        buffer, or the tensor ``torch.load`` read); nothing is written."""
        per_file: Dict[str, List[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        files = self.files or {}
        ranged = {n: [(self.storage_data[r.storage_index].offset, self.storage_data[r.storage_index].length)
                      for r in reqs]
                  for n, reqs in per_file.items() if n in files and files[n].records is not None}
        whole = [n for n in per_file if n not in ranged]
        with ThreadPoolExecutor(self.threads, thread_name_prefix="async-ckpt-read") as pool:
            parts = self._read_records(ranged, pool)  # per file: where each read run starts, its bytes
            parts.update({n: ([0], [memoryview(b)]) for n, b in self._read_files(whole, pool).items()})

        def item_bytes(name: str, info: Any) -> memoryview:
            """The bytes of the item ``info`` places in ``name``, from what was read of it."""
            starts, bufs = parts[name]
            if not starts:  # nothing read: only empty items lie in it
                return memoryview(b"")
            k = max(0, bisect.bisect_right(starts, info.offset) - 1)
            return bufs[k][info.offset - starts[k]: info.offset - starts[k] + info.length]

        out: Dict[str, List[Tuple[Any, Any, Any]]] = {}
        decode = hasattr(planner, "decode_bytes")
        for name, reqs in per_file.items():
            todo = out[name] = []
            for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                data = item_bytes(name, self.storage_data[req.storage_index])
                if req.type == LoadItemType.BYTE_IO:
                    # an unsafe or undecodable object fails the restore with the state dict untouched
                    todo.append((req, None, cast(_BytesDecoder, planner).decode_bytes(req, io.BytesIO(data))
                                 if decode else bytes(data)))
                    continue
                target = planner.resolve_tensor(req).detach()
                raw = stored_bytes(data, req, target)
                if raw is not None:  # one copy, straight from the read buffer into the target
                    todo.append((req, target, raw))
                    continue
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                if target.size() != tensor.size():
                    raise CorruptCheckpointError(
                        f"{shown(req.storage_index.fqn)}: stored shape {tuple(tensor.size())} != expected "
                        f"{tuple(target.size())}")
                todo.append((req, target, tensor))
        return out

    def _apply(self, ready: Dict[str, List[Tuple[Any, Any, Any]]], planner: LoadPlanner) -> None:
        """Write what :meth:`_prepare` made ready into the caller's state dict."""
        copies: List[Tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (req, target, dst, src)
        # DCP's default planner writes into the caller's own tensors and does nothing on commit,
        # so its copies may run together; other planners (torch_xla's) get copy, then commit.
        batch = type(planner) in (SafeLoadPlanner, DefaultLoadPlanner)
        decode = hasattr(planner, "decode_bytes")
        for name in list(ready):
            for req, target, what in ready.pop(name):  # applied: its buffers may go (a pending copy keeps its source)
                if req.type == LoadItemType.BYTE_IO:
                    if decode:
                        cast(_BytesDecoder, planner).set_bytes(req, what)
                    else:
                        planner.load_bytes(req, io.BytesIO(what))
                elif isinstance(what, tuple) and batch:
                    copies.append((req, target, what[0], what[1]))
                else:
                    dst, src = what if isinstance(what, tuple) else (target, what)
                    dst.copy_(src)
                    planner.commit_tensor(req, target)
        if copies:  # large copies, spread over threads (torch releases the GIL while copying)
            with ThreadPoolExecutor(min(4, len(copies)), thread_name_prefix="async-ckpt-copy") as pool:
                list(pool.map(lambda c: c[2].copy_(c[3]), copies))
            for req, target, _, _ in copies:
                planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def stored_bytes(item: memoryview, req: Any, target: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The copy that puts a ``torch.save``-serialised tensor's raw data into its target.

    The data sits in the file wherever the records before it ended, so its address need not
    be a multiple of the dtype's size, and kernels for wide dtypes (complex128) may fault on
    a misaligned source. ``src`` is therefore the data viewed as ``target``'s dtype only where
    it is aligned; otherwise it stays bytes (see :func:`aligned_copy`).

    Args:
        item: the record's bytes, straight from the read buffer.
        req: the read item (its ``storage_offsets`` and ``lengths``).
        target: the tensor the item goes into.

    Returns:
        ``(dst, src)``: copying ``src`` into ``dst`` fills ``target``; ``None`` unless the item
        is the plain case (one little-endian, uncompressed storage of exactly ``target``'s size
        and shape, read whole, see :func:`~..torch_record.plain_data_start`), where
        ``torch.load`` is used.
    """
    nbytes = target.numel() * target.element_size()
    if nbytes == 0 or any(req.storage_offsets) or list(req.lengths) != list(target.size()):
        return None
    start = plain_data_start(item, target.dtype, tuple(target.shape))
    if start is None:
        return None
    with warnings.catch_warnings():  # a read-only buffer (bytes) is fine: it is only copied from
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(item, dtype=torch.uint8, count=nbytes, offset=start)
    return aligned_copy(raw, target)


def aligned_copy(raw: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(dst, src)`` that copy the bytes ``raw`` (flat uint8, ``target``'s size) into ``target``
    without ever reading ``raw`` as a wider type at an address that type is not aligned to.

    Aligned: ``raw`` viewed as ``target``'s dtype and shape. Misaligned, into a contiguous CPU
    or CUDA target without a conjugate or negative bit: ``target``'s bytes (a uint8 view) take
    ``raw`` as bytes (still one copy). Otherwise ``raw`` is first copied into a fresh (aligned)
    buffer, which is then viewed as ``target``'s dtype.
    """
    itemsize = target.element_size()
    if raw.data_ptr() % itemsize == 0:
        return target, raw.view(target.dtype).view(target.shape)
    if target.device.type in ("cpu", "cuda") and target.layout == torch.strided and target.is_contiguous() \
            and not target.is_conj() and not target.is_neg() and not target.is_quantized:
        # as_strided, not view(-1): a one-element target may have any stride (w[:, 0] of a (1, N) matrix)
        return target.as_strided((target.numel(),), (1,)).view(torch.uint8), raw
    return target, raw.clone().view(target.dtype).view(target.shape)


def safe_planner(allow_pickle: bool, strict: bool = True, skip: Optional[AbstractSet[str]] = None) -> SafeLoadPlanner:
    """The default load planner: non-tensor items unpickled safely unless ``allow_pickle``;
    ``strict=False`` skips keys the checkpoint lacks (DCP's ``allow_partial_load``); the
    flattened keys in ``skip`` are not read (another rank reads and sends them)."""
    planner = SafeLoadPlanner(allow_pickle, skip)
    planner.allow_partial_load = not strict
    return planner


def load_state_dict(storage: StepFiles, path: str, state_dict: Dict[str, Any], *, files: Optional[Dict[str, FileRecord]],
                    verify: bool = True, threads: int = 8, allow_pickle: bool = False,
                    metadata: Optional[Metadata] = None, process_group: Any = None,
                    planner: Optional[LoadPlanner] = None, strict: bool = True) -> None:
    """Load a DCP checkpoint under ``path`` into ``state_dict`` in place (``planner``: see save),
    every file read and verified before the first write (``strict=False``: keys the checkpoint
    lacks are skipped)."""
    reader = FsspecStorageReader(storage, path, files=files, verify=verify, threads=threads, metadata=metadata)
    reader.read_metadata()  # read (and check) it here: DCP swallows errors from read_metadata
    planner = planner if planner is not None else safe_planner(allow_pickle, strict)
    call_dcp(lambda: dcp.load(state_dict, storage_reader=reader, planner=planner,
                               process_group=process_group, no_dist=not distributed()))
