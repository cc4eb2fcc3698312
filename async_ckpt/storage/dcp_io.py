"""DCP-format save and load over fsspec, fast.

The step directory is a plain ``torch.distributed.checkpoint`` checkpoint (``.metadata`` plus
``__<rank>_<k>.distcp`` files holding ``torch.save``-serialised items, exactly the layout of
DCP's ``FileSystemWriter``), so ``dcp.load`` reads it without async_ckpt. What differs from
DCP's own fsspec writer/reader is the I/O path:

* files of one rank are written concurrently (``threads``), balanced by size, with large
  upload blocks on object stores and ``fsync`` per file on POSIX — never ``os.sync()``;
* each file's size and CRC32C are computed while writing, for the manifest;
* restore reads whole files concurrently, verifies them, and only then touches the target
  state dict, so a failed restore leaves it untouched;
* ``.metadata`` (a pickle, DCP's format) is read through a restricted unpickler, and
  non-tensor items are loaded with ``weights_only=True`` unless ``allow_pickle`` is set.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import io
import itertools
import operator
import pickle
import struct
import sys
import threading
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.futures import Future
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint import _version as _dcp_version

from ..errors import CorruptCheckpointError, StorageError, UnsafeCheckpointError
from .fs import READ_RANGE_BYTES, Storage
from .manifest import FileRecord, check_file_name, crc32c, shown
from .records import PickledObject, RecordBatch, RecordTemplates

METADATA_NAME = ".metadata"

# DCP warns on every single-process save/load; that is our normal case, not news to the user.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _item_bytes(item: Any) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return 1024
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize if item.tensor_data else 0


MIN_FILE_BYTES = 16 * 2**20  # below this, more files cost more than they parallelise


MAX_FILES = 4096  # per rank and checkpoint, whatever ``max_file_bytes`` asks for


def _balance(items: List[Any], sizes: List[int], buckets: int,
             max_file_bytes: Optional[int] = None) -> List[List[Any]]:
    """Greedy size balancing of write items (``sizes[i]`` bytes each) over at most ``buckets`` files.

    With ``max_file_bytes`` (object stores) there are more files, about that size each, so
    that they upload as many concurrent single-request objects; threads stay ``buckets``.
    """
    total = sum(sizes)
    buckets = min(buckets, max(1, -(-total // MIN_FILE_BYTES)))
    if max_file_bytes:
        buckets = max(buckets, min(MAX_FILES, len(items), -(-total // max_file_bytes)))
    out: List[List[Any]] = [[] for _ in range(max(1, buckets))]
    loads = [0] * len(out)
    for i in sorted(range(len(items)), key=lambda i: -sizes[i]):
        k = loads.index(min(loads))
        out[k].append(items[i])
        loads[k] += sizes[i]
    return [b for b in out if b]


_RECORDS = RecordTemplates()  # shared by every save in the process: templates depend on torch only

_COALESCE_BYTES = 4 * 2**20  # small records are gathered into writes of about this size
_SMALL_ITEM_BYTES = 64 * 2**10  # runs of items up to this size are produced one file at a time
_BATCH_MIN = 16  # runs of at least this many records of one template are rendered together


class _RecordStream:
    """Write-through stream that counts bytes and computes CRC32C as data passes, gathering
    small writes into large ones (fewer syscalls/requests)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.size = 0  # bytes passed on to ``f``
        self.crc = 0
        self.error: Optional[BaseException] = None  # torch.save hides it behind a RuntimeError
        self._pending = bytearray()

    def _write_through(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.crc = crc32c(mv, self.crc)
        try:
            self._f.write(mv)
        except BaseException as exc:
            self.error = exc
            raise
        self.size += mv.nbytes
        return mv.nbytes

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        if n >= 65536:
            self.flush_pending()
            return self._write_through(b)
        self._pending += b  # no cast: a memoryview cast costs more than the copy of a small record
        if len(self._pending) >= _COALESCE_BYTES:
            self.flush_pending()
        return n

    def append_record(self, t: torch.Tensor) -> int:
        """Append ``torch.save(t)``'s bytes from a template (see :mod:`.records`) straight into
        the pending buffer; return their length, or ``-1`` (nothing written) if ``t`` has none."""
        pending = self._pending
        n = _RECORDS.append(pending, t)
        if n >= 0 and len(pending) >= _COALESCE_BYTES:
            self.flush_pending()
        return n

    def append_records(self, tpl: Any, ts: List[torch.Tensor]) -> None:
        """Append the records of ``ts``, every one eligible for template ``tpl`` (see
        :meth:`RecordTemplates.template`): short runs one by one, long ones in batches."""
        if len(ts) < _BATCH_MIN:
            for t in ts:
                tpl.append_to(self._pending, tpl.ctype.from_address(t.data_ptr()))
            if len(self._pending) >= _COALESCE_BYTES:
                self.flush_pending()
            return
        size = max(1, min(len(ts), _COALESCE_BYTES // tpl.length))
        batch = RecordBatch(tpl, size)
        for k in range(0, len(ts), size):
            self._pending += batch.render(ts[k: k + size])
            if len(self._pending) >= _COALESCE_BYTES:
                self.flush_pending()

    def tell(self) -> int:
        return self.size + len(self._pending)

    def flush_pending(self) -> None:
        if self._pending:
            data, self._pending = self._pending, bytearray()
            self._write_through(data)

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def _write_item(stream: _RecordStream, data: Any) -> int:
    """Append one DCP item: a ``BytesIO``'s bytes, or a tensor as ``torch.save`` writes it.
    Returns its length."""
    if type(data) is torch.Tensor:  # the common case: a staged host tensor
        n = stream.append_record(data)
        if n >= 0:
            return n
    start = stream.tell()
    if isinstance(data, io.BytesIO):
        stream.write(data.getbuffer())
        return stream.tell() - start
    t = data.detach() if data.requires_grad else data
    if not t.is_cpu:
        t = t.cpu()
    if t is not data and type(t) is torch.Tensor:  # now a plain host tensor: a template may fit
        n = stream.append_record(t)
        if n >= 0:
            return n
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()  # torch.save writes whole storages: keep only this view
    try:
        torch.save(t, stream)
    except RuntimeError:
        if stream.error is not None:  # the storage's own error decides retrying
            raise stream.error
        raise
    return stream.tell() - start


def _item_nbytes(data: Any) -> int:
    """About how many bytes an item (a tensor or a BytesIO) adds to its file."""
    if isinstance(data, torch.Tensor):
        return data.nbytes
    return data.getbuffer().nbytes if isinstance(data, io.BytesIO) else 0


def _write_files(storage: Storage, path: str, prefix: str, buckets: List[List[Any]], hints: List[int],
                 threads: int, resolve: Callable[[Any], Any]) -> List[Tuple[str, FileRecord, List[int]]]:
    """Write each bucket as one ``<prefix><k>.distcp`` file, concurrently; ``resolve(item)``
    gives an item's data (a tensor or a BytesIO).

    Returns, per file, its name, its record and the length of each item in order (items are
    contiguous, so offsets follow). ``hints[k]`` is about the data size of bucket ``k`` (lets
    small files upload in one request).
    """

    def write_file(k: int, jobs: List[Any]) -> Tuple[str, FileRecord, List[int]]:
        # A file is streamed, so a transient failure mid-file is retried by rewriting the
        # whole file (the host snapshot is immutable until the step commits).
        where = f"{path}/{prefix}{k}.distcp"
        return storage.retry.call(lambda: write_file_once(k, jobs), f"write {where}")

    # Runs of small items are produced by one file at a time: that is Python work, which the
    # GIL serialises anyway, and taking turns lets each file's fsync (or upload) run while the
    # next one is produced, instead of every file finishing production, then all syncing.
    # Big items are written outside the lock, so their I/O still runs concurrently.
    produce_small = threading.Lock()

    def write_file_once(k: int, jobs: List[Any]) -> Tuple[str, FileRecord, List[int]]:
        name = f"{prefix}{k}.distcp"
        lengths = []
        with storage.open_write(f"{path}/{name}", size_hint=hints[k]) as f:
            stream = _RecordStream(f)
            held = False
            run: List[torch.Tensor] = []  # consecutive tensors of one record template
            run_tpl = None
            try:
                for job in jobs:
                    data = resolve(job)
                    tpl = _RECORDS.template(data) if type(data) is torch.Tensor else None
                    if tpl is not None and tpl is run_tpl:
                        run.append(data)
                        continue
                    if run:
                        stream.append_records(run_tpl, run)
                        lengths += [run_tpl.length] * len(run)
                    run, run_tpl = [], None
                    small = _item_nbytes(data) <= _SMALL_ITEM_BYTES
                    if small != held:
                        if small:
                            produce_small.acquire()
                        else:
                            stream.flush_pending()  # the small records before it, still in turn
                            produce_small.release()
                        held = small
                    if tpl is not None:
                        run, run_tpl = [data], tpl
                    else:
                        lengths.append(_write_item(stream, data))
                if run:
                    stream.append_records(run_tpl, run)
                    lengths += [run_tpl.length] * len(run)
                stream.flush_pending()
            finally:
                if held:
                    produce_small.release()
        # A silently short write (a full or flaky disk, a FUSE mount) fails the attempt with
        # EIO, which is transient, so the file is redone. gs:// and s3:// need no check:
        # their uploads are length-checked by the service.
        stored = stream.size if getattr(storage, "is_object_store", False) else storage.size(f"{path}/{name}")
        if stored != stream.size:
            raise OSError(errno.EIO, f"short write: {stream.size} bytes written, storage holds {stored}",
                          f"{path}/{name}")
        return name, FileRecord(stream.size, stream.crc), lengths

    if not buckets:  # nothing to write on this rank (e.g. every item de-duplicated to another)
        return []
    if len(buckets) == 1:
        return [write_file(0, buckets[0])]
    with ThreadPoolExecutor(min(threads, len(buckets)), thread_name_prefix="async-ckpt-io") as pool:
        return list(pool.map(lambda kv: write_file(*kv), enumerate(buckets)))


def _results(buckets: List[List[MetadataIndex]], outs: List[Tuple[str, FileRecord, List[int]]]
             ) -> Tuple[Dict[str, FileRecord], Dict[MetadataIndex, _StorageInfo]]:
    """File records and DCP's ``storage_data`` (where each item sits) from :func:`_write_files`."""
    files: Dict[str, FileRecord] = {}
    where: Dict[MetadataIndex, _StorageInfo] = {}
    for indices, (name, rec, lengths) in zip(buckets, outs):
        files[name] = rec
        offset = 0
        for index, length in zip(indices, lengths):
            where[index] = _StorageInfo(name, offset, length)
            offset += length
    return files, where


def _resolver(planner: SavePlanner) -> Callable[[Any], Any]:
    """``planner.resolve_data``, except that a :class:`PickledObject` (a snapshot's non-tensor
    value, pickled at the call) is written as its archive, not ``torch.save``-d again as an
    object. Planners without ``lookup_object`` (DCP's and torch_xla's have it) resolve alone."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        return planner.resolve_data

    def resolve(item: Any) -> Any:
        if item.type == WriteItemType.BYTE_IO:
            obj = lookup(item.index)
            if type(obj) is PickledObject:
                return obj.archive()
        return planner.resolve_data(item)

    return resolve


class FsspecStorageWriter(StorageWriter):
    """DCP ``StorageWriter`` with concurrent, checksummed writes through :class:`Storage`."""

    def __init__(self, storage: Storage, path: str, *, threads: int = 8) -> None:
        super().__init__()
        self.storage = storage
        self.path = path
        self.threads = max(1, threads)
        self.files: Dict[str, FileRecord] = {}
        self.rank = 0
        self.is_coordinator = True

    def reset(self, checkpoint_id: Any = None) -> None:
        self.files = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        buckets = _balance(plan.items, [_item_bytes(it) for it in plan.items], self.threads,
                           self.storage.max_file_bytes)
        hints = [sum(_item_bytes(item) for item in bucket) for bucket in buckets]
        outs = _write_files(self.storage, self.path, plan.storage_data.prefix, buckets, hints, self.threads,
                            _resolver(planner))
        files, where = _results([[item.index for item in bucket] for bucket in buckets], outs)
        self.files.update(files)
        fut: Future = Future()
        fut.set_result([WriteResult(index=index, size_in_bytes=info.length, storage_data=info)
                        for index, info in where.items()])
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)  # DCP's own format
        self.storage.write_bytes(f"{self.path}/{METADATA_NAME}", data)
        self.files[METADATA_NAME] = FileRecord(len(data), crc32c(data))

    def storage_meta(self) -> Optional[StorageMeta]:
        # No checkpoint_id: the path written to is a temporary directory renamed at commit,
        # and a step directory may be copied or exported; the id would be stale either way.
        return StorageMeta(checkpoint_id=None, save_id="")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


# ---- metadata safety -----------------------------------------------------------------------

_SAFE_BUILTINS = {"set", "frozenset", "dict", "list", "tuple", "slice", "bytearray", "complex", "int", "float"}


def _plain_data_class(obj: Any) -> bool:
    """A dataclass, enum or named tuple: calling it only builds a record (DCP's metadata types),
    unlike the other classes of those modules (writers, readers, executors)."""
    return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
                                      or (issubclass(obj, tuple) and hasattr(obj, "_fields")))


class _MetadataUnpickler(pickle.Unpickler):
    """Allows only DCP's metadata classes, torch's dtypes/sizes and plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or module == "torch.distributed.checkpoint":
            obj = pickle.Unpickler.find_class(self, module, name)
            if _plain_data_class(obj):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.memory_format, torch.layout)) or obj is torch.Size:
                return obj
        elif module == "torch.serialization" and name == "_get_layout":  # maps "torch.strided" -> layout
            return pickle.Unpickler.find_class(self, module, name)
        elif module == "builtins" and name in _SAFE_BUILTINS:
            return pickle.Unpickler.find_class(self, module, name)
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return pickle.Unpickler.find_class(self, module, name)  # DCP's own writer stores the checkpoint_id path
        elif module == "collections" and name == "OrderedDict":
            return pickle.Unpickler.find_class(self, module, name)
        elif module == "torch.distributed._shard.sharded_tensor.metadata" or module == "torch.distributed.tensor._dtensor_spec":
            obj = pickle.Unpickler.find_class(self, module, name)
            if _plain_data_class(obj):
                return obj
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {shown(f'{module}.{name}')}, which is not an allowed DCP metadata "
            "class; refusing to load it (it could run code)"
        )


def load_metadata(data: bytes, *, where: str = METADATA_NAME) -> Metadata:
    """Unpickle DCP ``.metadata`` bytes safely."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: DCP metadata is unreadable ({type(exc).__name__}: {shown(exc)})",
                                     path=where) from exc
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{where}: not DCP metadata (got {type(md).__name__})", path=where)
    return md


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor items with ``weights_only`` unless allowed."""

    def __init__(self, allow_pickle: bool = False) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle

    def decode_bytes(self, read_item: Any, value: io.BytesIO) -> Any:
        """Deserialise one non-tensor item without touching the state dict."""
        try:
            return torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"{shown(read_item.dest_index.fqn)}: refusing to unpickle an object outside torch's safe set "
                f"({shown(exc)}); pass allow_pickle=True to restore if you trust this checkpoint"
            ) from exc

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.set_bytes(read_item, self.decode_bytes(read_item, value))

    def set_bytes(self, read_item: Any, obj: Any) -> None:
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class FsspecStorageReader(StorageReader):
    """DCP ``StorageReader``: whole files read concurrently, verified, then deserialised.

    With ``files`` (the manifest's records) only files it lists are read, each checked against
    its size (and, with ``verify``, its CRC32C). Every name read must be a plain file name inside
    ``path`` (never ``../x``, an absolute path, or a link leading out); anything else, and a
    directory where a file should be, is a :class:`CorruptCheckpointError`.
    """

    def __init__(self, storage: Storage, path: str, *, files: Optional[Dict[str, FileRecord]] = None,
                 verify: bool = True, threads: int = 8, metadata: Optional[Metadata] = None) -> None:
        super().__init__()
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
        try:
            data = self.storage.read_bytes(where)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: file is missing", path=where) from None
        except StorageError as exc:
            if isinstance(exc.__cause__, (IsADirectoryError, NotADirectoryError)):
                raise CorruptCheckpointError(f"{where}: is not a readable file ({exc.__cause__})", path=where) from exc
            raise
        rec = (self.files or {}).get(name)
        if rec is not None:
            if len(data) != rec.size:
                raise CorruptCheckpointError(f"{where}: size is {len(data)} bytes, manifest says {rec.size}",
                                             path=where)
            if self.verify and crc32c(data) != rec.crc32c:
                raise CorruptCheckpointError(
                    f"{where}: checksum mismatch (crc32c {crc32c(data):#010x}, manifest says {rec.crc32c:#010x})",
                    path=where)
        return data

    def _read_files(self, names: List[str], pool: ThreadPoolExecutor) -> Dict[str, Any]:
        """Read and verify ``names`` concurrently; a big file as concurrent ranged reads.

        A file of at most ``2 * READ_RANGE_BYTES`` is one whole-object read (one request). A
        bigger one whose size the manifest gives is read into one preallocated buffer in
        ranges of about ``READ_RANGE_BYTES``, on the pool; the last range asks for one byte more
        than the manifest says, so a longer file is caught as well as a shorter one.
        """
        records = self.files or {}
        split = {n: records[n].size for n in names if n in records and records[n].size > 2 * READ_RANGE_BYTES}
        for n in split:
            self._checked_path(n)
        whole = [n for n in names if n not in split]
        bufs = {n: bytearray(size + 1) for n, size in split.items()}
        tasks = []
        for n, size in split.items():
            starts = list(range(0, size, READ_RANGE_BYTES))
            if len(starts) > 1 and size - starts[-1] < READ_RANGE_BYTES // 2:
                starts.pop()  # no small tail request: the last range takes the remainder
            ends = starts[1:] + [size + 1]
            tasks += [(n, a, b) for a, b in zip(starts, ends)]

        def read_range(task: Tuple[str, int, int]) -> int:
            n, start, end = task
            where = f"{self.path}/{n}"
            try:
                return self.storage.read_into(where, start, memoryview(bufs[n])[start:end])
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{where}: file is missing", path=where) from None

        futs = [pool.submit(read_range, t) for t in tasks] + [pool.submit(self.read_file, n) for n in whole]
        results = [f.result() for f in futs]  # re-raises the first failure
        out: Dict[str, Any] = dict(zip(whole, results[len(tasks):]))
        got_bytes: Dict[str, int] = {n: 0 for n in split}
        for (n, _a, _b), got in zip(tasks, results):
            got_bytes[n] += got
        for n, size in split.items():
            where = f"{self.path}/{n}"
            if got_bytes[n] != size:
                got = f"more than {size}" if got_bytes[n] > size else str(got_bytes[n])
                raise CorruptCheckpointError(f"{where}: size is {got} bytes, manifest says {size}", path=where)
            data = memoryview(bufs[n])[:size]
            if self.verify and crc32c(data) != records[n].crc32c:
                raise CorruptCheckpointError(
                    f"{where}: checksum mismatch (crc32c {crc32c(data):#010x}, manifest says "
                    f"{records[n].crc32c:#010x})", path=where)
            out[n] = data
        return out

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata``, read and checked (once; a ``metadata`` given to the constructor is
        taken as checked): see :meth:`check_metadata`."""
        if self._metadata is None:
            md = load_metadata(self.read_file(METADATA_NAME), where=f"{self.path}/{METADATA_NAME}")
            self.check_metadata(md)
            self._metadata = md
        return self._metadata

    def check_metadata(self, md: Metadata) -> None:
        """Raise :class:`CorruptCheckpointError` unless every file ``md`` points at is a plain
        file name that the manifest lists (with ``files``), and every item's byte range lies
        inside it. Files the manifest lists that no item points at are read and checked too,
        so that every listed file is checked by a restore."""
        where = f"{self.path}/{METADATA_NAME}"
        data = md.storage_data if md.storage_data is not None else {}
        ends: Dict[str, int] = {}
        first: Dict[str, str] = {}  # a key stored in each file, for messages
        try:
            for idx, info in data.items():
                rel, offset, length = info.relative_path, info.offset, info.length
                if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
                    raise CorruptCheckpointError(f"{where}: {shown(idx.fqn)}: invalid byte range "
                                                 f"{shown(offset)}+{shown(length)}", path=where)
                end = offset + length
                old = ends.get(rel)
                if old is None:
                    check_file_name(rel, where=where)
                    first[rel] = idx.fqn
                if old is None or end > old:
                    ends[rel] = end
        except (AttributeError, TypeError) as exc:
            raise CorruptCheckpointError(f"{where}: storage data is malformed ({shown(exc)})", path=where) from exc
        if self.files is None:
            return
        for rel, end in ends.items():
            rec = self.files.get(rel)
            if rec is None:
                raise CorruptCheckpointError(f"{where}: {shown(first[rel])} is stored in {rel}, which the manifest "
                                             "does not list; refusing to read it unchecked", path=where)
            if end > rec.size:
                raise CorruptCheckpointError(f"{self.path}/{rel}: manifest says {rec.size} bytes, but an item "
                                             f"{METADATA_NAME} places in it ends at byte {end}",
                                             path=f"{self.path}/{rel}")
        for name in sorted(self.files):
            if name != METADATA_NAME and name not in ends:
                self.read_file(name)  # referenced by no item: still checked (size, checksum)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: Dict[str, List[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        names = list(per_file)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="async-ckpt-read") as pool:
            blobs = self._read_files(names, pool)
        # Non-tensor items are decoded before anything is applied, so that an unsafe or
        # undecodable object fails the restore with the caller's state dict untouched.
        decoded: Dict[int, Any] = {}
        if hasattr(planner, "decode_bytes"):
            for name, reqs in per_file.items():
                for req in reqs:
                    if req.type == LoadItemType.BYTE_IO:
                        info = self.storage_data[req.storage_index]
                        decoded[id(req)] = planner.decode_bytes(
                            req, io.BytesIO(memoryview(blobs[name])[info.offset: info.offset + info.length]))
        # Everything is read and verified: only now touch the caller's state dict.
        copies: List[Tuple[Any, torch.Tensor, torch.Tensor]] = []
        # DCP's default planner writes into the caller's own tensors and does nothing on commit,
        # so its copies may run together; other planners (torch_xla's) get resolve, copy, commit.
        batch = type(planner) in (_SafeLoadPlanner, DefaultLoadPlanner)
        for name, reqs in per_file.items():
            blob = memoryview(blobs.pop(name))
            for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                info = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    if id(req) in decoded:
                        planner.set_bytes(req, decoded[id(req)])
                    else:
                        planner.load_bytes(req, io.BytesIO(blob[info.offset: info.offset + info.length]))
                    continue
                target = planner.resolve_tensor(req).detach()
                raw = _stored_bytes(blob[info.offset: info.offset + info.length], req, target)
                if raw is not None:  # one copy, straight from the read buffer into the target
                    dst, src = raw
                    if batch:
                        copies.append((req, target, dst, src))
                    else:
                        dst.copy_(src)
                        planner.commit_tensor(req, target)
                    continue
                chunk = io.BytesIO(blob[info.offset: info.offset + info.length])  # (a copy)
                tensor = torch.load(chunk, map_location="cpu", weights_only=True)
                tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                if target.size() != tensor.size():
                    raise CorruptCheckpointError(
                        f"{shown(req.storage_index.fqn)}: stored shape {tuple(tensor.size())} != expected "
                        f"{tuple(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
        if copies:  # large copies, spread over threads (torch releases the GIL while copying)
            with ThreadPoolExecutor(min(4, len(copies)), thread_name_prefix="async-ckpt-copy") as pool:
                list(pool.map(lambda c: c[2].copy_(c[3]), copies))
            for req, target, _, _ in copies:
                planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class _ViewReader(io.RawIOBase):
    """Seekable read-only file over a memoryview (zipfile reads only the directory of it)."""

    def __init__(self, mv: memoryview) -> None:
        super().__init__()
        self._mv, self._pos = mv, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = max(0, offset if whence == 0 else (self._pos + offset if whence == 1 else len(self._mv) + offset))
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = len(self._mv) if n is None or n < 0 else min(len(self._mv), self._pos + n)
        out = bytes(self._mv[self._pos:end])
        self._pos = end
        return out


try:  # "FloatStorage" -> torch.float32, as torch.save names storages in data.pkl
    from torch.storage import _dtype_to_storage_type_map

    _STORAGE_DTYPES = {v: k for k, v in _dtype_to_storage_type_map().items()}
except Exception:  # pragma: no cover - a torch without it: always fall back to torch.load
    _STORAGE_DTYPES = {}


class _TensorDescUnpickler(pickle.Unpickler):
    """Reads a single-tensor ``data.pkl`` as ``(dtype, storage_offset, size, stride)``; refuses
    anything else (nothing is constructed, no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "collections" and name == "OrderedDict":
            return lambda *a: None
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 2 and pid[0] == "storage" and isinstance(pid[1], torch.dtype):
            return pid[1]
        raise pickle.UnpicklingError(f"persistent id {pid!r}")


def _stored_bytes(item: memoryview, req: Any, target: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)``: copying ``src`` into ``dst`` puts the raw data of the ``torch.save``-
    serialised tensor ``item`` into ``target``, straight from the read buffer; ``None`` unless
    the item is the plain case (one little-endian, uncompressed storage of exactly ``target``'s
    size, read whole), where ``torch.load`` is used.

    The data sits in the file wherever the records before it ended, so its address need not
    be a multiple of the dtype's size, and kernels for wide dtypes (complex128) may fault on
    a misaligned source. ``src`` is therefore the data viewed as ``target``'s dtype only where
    it is aligned; otherwise it stays bytes (see :func:`_aligned_copy`).
    """
    nbytes = target.numel() * target.element_size()
    if nbytes == 0 or any(req.storage_offsets) or list(req.lengths) != list(target.size()):
        return None
    try:
        with zipfile.ZipFile(_ViewReader(item)) as zf:
            infos = zf.infolist()
            data = [i for i in infos if i.filename.rsplit("/", 2)[-2:-1] == ["data"]]
            order = [i for i in infos if i.filename.endswith("/byteorder")]
            pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
            if len(data) != 1 or len(pkl) != 1 or data[0].compress_type != zipfile.ZIP_STORED \
                    or data[0].file_size != nbytes:
                return None
            if order and zf.read(order[0]) != b"little" or sys.byteorder != "little":
                return None
            desc = _TensorDescUnpickler(io.BytesIO(zf.read(pkl[0]))).load()
            contiguous, acc = [], 1
            for d in reversed(target.shape):
                contiguous.insert(0, acc)
                acc *= d
            if desc != (target.dtype, 0, tuple(target.shape), tuple(contiguous)):
                return None  # a view, a strided layout or another dtype: torch.load handles it
            off = data[0].header_offset
            if bytes(item[off:off + 4]) != b"PK\x03\x04":
                return None
            name_len, extra_len = struct.unpack_from("<HH", item, off + 26)
            start = off + 30 + name_len + extra_len
            if start + nbytes > len(item):
                return None
    except (zipfile.BadZipFile, ValueError, struct.error, pickle.UnpicklingError, EOFError, TypeError,
            AttributeError, IndexError):
        return None
    with warnings.catch_warnings():  # a read-only buffer (bytes) is fine: it is only copied from
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(item, dtype=torch.uint8, count=nbytes, offset=start)
    return _aligned_copy(raw, target)


def _aligned_copy(raw: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
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
        return target.view(-1).view(torch.uint8), raw
    return target, raw.clone().view(target.dtype).view(target.shape)


def save_state_dict(storage: Storage, path: str, state_dict: Dict[str, Any], *, threads: int = 8,
                    process_group: Any = None, planner: Optional[SavePlanner] = None) -> Dict[str, FileRecord]:
    """Write ``state_dict`` (host tensors) as a DCP checkpoint under ``path``; return file records.

    ``planner`` defaults to DCP's ``DefaultSavePlanner`` (torch_xla's for staged SPMD shards).
    """
    if planner is None and _world_size(process_group) == 1:  # e.g. `torchrun --nproc_per_node=1` too
        files = _save_local(storage, path, state_dict, threads=threads)
        if files is not None:
            return files
    writer = FsspecStorageWriter(storage, path, threads=threads)
    planner = planner if planner is not None else DefaultSavePlanner()
    _call_dcp(lambda: dcp.save(state_dict, storage_writer=writer, planner=planner,
                               process_group=process_group, no_dist=not _distributed()))
    return writer.files


def _metadata_index(fqn: str, offset: torch.Size, index: int) -> MetadataIndex:
    """``MetadataIndex(fqn, offset, index)`` without its ``__init__``, which rebuilds ``offset``
    as a new ``torch.Size`` (~10 µs, a tenth of a small tensor's whole write). Same fields, so
    equal, hashed and pickled alike; ``offset`` is shared, so pickled once."""
    idx = object.__new__(MetadataIndex)
    object.__setattr__(idx, "fqn", fqn)
    object.__setattr__(idx, "offset", offset)
    object.__setattr__(idx, "index", index)
    return idx


def _flatten(state_dict: Dict[str, Any], reuse: Optional[Dict[str, Tuple[Any, ...]]] = None
             ) -> Tuple[Dict[str, Any], Dict[str, Tuple[Any, ...]]]:
    """``flatten_state_dict(state_dict)``: the same keys in the same order, values, mappings and
    errors, at ~1 µs per entry instead of ~8: nested mappings and their leaves are walked here;
    lists (whose flattening depends on what they hold) are handed to DCP's own traversal.

    ``reuse``: an earlier result's mappings; a path equal to the one there is taken from it, so
    the new tuples die at once instead of living as long as the result."""
    if _dcp_version._derived_version == "2_3":  # DCP's pre-2.4 layout: its own code only
        return flatten_state_dict(state_dict)
    flat: Dict[str, Any] = {}
    mappings: Dict[str, Tuple[Any, ...]] = {}
    tensor = torch.Tensor

    def put(fqn: str, path: Tuple[Any, ...], value: Any) -> None:
        if fqn in flat:
            raise ValueError(f"duplicated flatten key {fqn}")
        flat[fqn] = value
        mappings[fqn] = path

    def walk(path: Tuple[Any, ...], prefix: str, mapping: Any) -> None:
        for k, v in mapping.items():
            ks = str(k)
            if type(v) is tensor:  # the common case first: a terminal leaf
                fqn = prefix + ks
                if fqn in flat:
                    raise ValueError(f"duplicated flatten key {fqn}")
                flat[fqn] = v
                full = path + (ks,)
                if reuse is not None:
                    old = reuse.get(fqn)
                    if old == full:
                        full = old
                mappings[fqn] = full
            elif isinstance(v, Mapping):
                walk(path + (ks,), prefix + ks + ".", v)
            elif isinstance(v, list):
                base = path + (ks,)

                def visit(sub: Tuple[Any, ...], value: Any, base: Tuple[Any, ...] = base) -> None:
                    full = base + sub[1:]
                    put(".".join(map(str, full)), full, value)

                traverse_state_dict({"": v}, visit)
            else:  # anything else is a leaf, a tuple included
                put(prefix + ks, path + (ks,), v)

    walk((), "", state_dict)
    return flat, mappings


@dataclasses.dataclass
class _Layout:
    """What one state dict layout writes: reused while the next saves have the same layout."""

    key: Tuple[Any, ...]  # (threads, max_file_bytes): what else decides the bucketing
    fqns: List[str]
    sig: List[Any]  # per item: dtype, shape, requires_grad, pinned for tensors; None for objects
    mappings: Dict[str, Any]
    buckets: List[List[int]]  # item positions, per file
    hints: List[int]
    lengths: List[List[int]]  # per file, each item's length as written
    metadata: bytes  # the pickled .metadata for exactly these lengths
    files_meta: FileRecord


_layout_lock = threading.Lock()
_last_layout: Optional[_Layout] = None


_NEEDS_PLANNER = object()  # a signature entry: DCP's planner must handle this object


def _signature_entries(objs: List[Any]) -> Iterator[Any]:
    """What decides a layout besides the keys: per tensor its dtype, shape, ``requires_grad``
    and pinning (four entries), ``None`` per other object; :data:`_NEEDS_PLANNER` (and the end)
    at the first DTensor, ShardedTensor or tensor subclass."""
    tensor_type = torch.Tensor
    for obj in objs:
        if type(obj) is tensor_type:
            yield obj.dtype
            yield obj.shape
            yield obj.requires_grad
            yield obj.is_cpu and obj.is_pinned()
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            yield _NEEDS_PLANNER
            return
        else:
            yield None


def _signature(objs: List[Any]) -> Optional[List[Any]]:
    """The signature of ``objs`` (see :func:`_signature_entries`); ``None`` if DCP's planner must run."""
    sig = list(_signature_entries(objs))
    return None if sig and sig[-1] is _NEEDS_PLANNER else sig


def _has_signature(objs: List[Any], sig: List[Any]) -> bool:
    """``_signature(objs) == sig``, entry by entry, without keeping a new ``torch.Size`` per
    tensor alive."""
    pairs = itertools.zip_longest(_signature_entries(objs), sig, fillvalue=object())  # unequal to all
    return all(itertools.starmap(operator.eq, pairs))


def _local_data(obj: Any) -> Any:
    """An item's data as ``DefaultSavePlanner.resolve_data`` gives it: tensors as they are,
    anything else ``torch.save``-d into a ``BytesIO`` (a :class:`PickledObject`: the archive of
    the bytes it holds)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if type(obj) is PickledObject:
        return obj.archive()
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf


def _save_local(storage: Storage, path: str, state_dict: Dict[str, Any], *,
                threads: int) -> Optional[Dict[str, FileRecord]]:
    """Single-process save of plain tensors and objects, without DCP's planning machinery.

    Writes what ``dcp.save`` with ``DefaultSavePlanner`` and :class:`FsspecStorageWriter`
    writes — the same flattened keys, the same ``Metadata`` (equal field by field), the same
    item bytes — at a fraction of the per-item cost: DCP's local and global planning, plan
    validation and per-item ``dataclasses.replace`` cost ~150 µs per tensor, which dominates
    a state dict of many small tensors. Equal objects inside the metadata (dtypes' properties,
    shapes, zero offsets) are shared, so its pickle is smaller and quicker.

    A training loop saves the same layout again and again, so the last layout is remembered:
    when the keys, dtypes and shapes are unchanged and every item comes out at the same length,
    the file assignment and the pickled ``.metadata`` are reused rather than rebuilt.

    Returns ``None`` (the caller then uses ``dcp.save``) for anything DCP's planner treats
    specially: DTensors, ShardedTensors, tensor subclasses and ``Stateful`` values.
    """
    global _last_layout
    for value in state_dict.values():  # what dcp.save's _stateful_to_state_dict would call
        if not isinstance(value, torch.Tensor) and callable(getattr(value, "state_dict", None)) \
                and callable(getattr(value, "load_state_dict", None)):
            return None
    # Nothing per item outlives this save except what the layout keeps: objects alive through a
    # long write are promoted to the collector's oldest generation, and tens of thousands of them
    # per save trigger a full collection (~150 ms with torch imported, GIL held) every save or two.
    with _layout_lock:
        layout = _last_layout
    flat, mappings = _flatten(state_dict, reuse=layout.mappings if layout is not None else None)
    objs = list(flat.values())
    key = (threads, storage.max_file_bytes)
    fqns = list(flat)
    sig: Optional[List[Any]] = None
    if layout is None or not (layout.key == key and layout.fqns == fqns and layout.mappings == mappings
                              and _has_signature(objs, layout.sig)):
        layout = None
        sig = _signature(objs)
        if sig is None:
            return None  # DTensor, ShardedTensor, a subclass: DCP's planner knows them

    if layout is not None:
        outs = _write_files(storage, path, "__0_", [[objs[k] for k in b] for b in layout.buckets],
                            layout.hints, threads, _local_data)
        if [lengths for _, _, lengths in outs] == layout.lengths:  # same bytes where .metadata says
            storage.write_bytes(f"{path}/{METADATA_NAME}", layout.metadata)
            files = {name: rec for name, rec, _ in outs}
            files[METADATA_NAME] = layout.files_meta
            return files
        # An object's pickle changed length: same files, new .metadata (built below).
        buckets, hints = layout.buckets, layout.hints
    else:
        sizes = [o.numel() * o.element_size() if isinstance(o, torch.Tensor) else 1024 for o in objs]
        buckets = _balance(list(range(len(objs))), sizes, threads, storage.max_file_bytes)
        hints = [sum(sizes[k] for k in b) for b in buckets]
        outs = None

    sizes_: Dict[torch.Size, torch.Size] = {}
    props: Dict[Tuple[Any, ...], TensorProperties] = {}
    chunks: Dict[torch.Size, ChunkStorageMetadata] = {}
    md: Dict[str, Any] = {}
    indices: List[MetadataIndex] = []
    for fqn, obj in zip(fqns, objs):
        if isinstance(obj, torch.Tensor):
            size = sizes_.get(obj.shape)
            if size is None:
                size = sizes_[obj.shape] = torch.Size(obj.shape)
            chunk = chunks.get(size)
            if chunk is None:
                zeros = sizes_.setdefault(torch.Size((0,) * len(size)), torch.Size((0,) * len(size)))
                chunk = chunks[size] = ChunkStorageMetadata(offsets=zeros, sizes=size)
            pkey = (obj.dtype, obj.requires_grad, obj.is_cpu and obj.is_pinned())
            prop = props.get(pkey)
            if prop is None:
                prop = props[pkey] = TensorProperties.create_from_tensor(obj)
            md[fqn] = TensorStorageMetadata(properties=prop, size=size, chunks=[chunk])
            indices.append(_metadata_index(fqn, chunk.offsets, 0))
        else:
            md[fqn] = BytesStorageMetadata()
            indices.append(MetadataIndex(fqn))
    if outs is None:
        outs = _write_files(storage, path, "__0_", [[objs[k] for k in b] for b in buckets], hints, threads,
                            _local_data)
    files, where = _results([[indices[k] for k in b] for b in buckets], outs)
    metadata = Metadata(state_dict_metadata=md, planner_data=mappings, storage_data=where,
                        storage_meta=StorageMeta(checkpoint_id=None, save_id=""))
    data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)  # DCP's own format
    storage.write_bytes(f"{path}/{METADATA_NAME}", data)
    files[METADATA_NAME] = FileRecord(len(data), crc32c(data))
    if sig is None:  # the files were written with the last layout; only .metadata is new
        sig = layout.sig
    with _layout_lock:
        _last_layout = _Layout(key, fqns, sig, mappings, buckets, hints,
                               [lengths for _, _, lengths in outs], data, files[METADATA_NAME])
    return files


def load_state_dict(storage: Storage, path: str, state_dict: Dict[str, Any], *, files: Optional[Dict[str, FileRecord]],
                    verify: bool = True, threads: int = 8, allow_pickle: bool = False,
                    metadata: Optional[Metadata] = None, process_group: Any = None,
                    planner: Optional[LoadPlanner] = None) -> None:
    """Load a DCP checkpoint under ``path`` into ``state_dict`` in place (``planner``: see save)."""
    reader = FsspecStorageReader(storage, path, files=files, verify=verify, threads=threads, metadata=metadata)
    reader.read_metadata()  # read (and check) it here: DCP swallows errors from read_metadata
    planner = planner if planner is not None else _SafeLoadPlanner(allow_pickle)
    _call_dcp(lambda: dcp.load(state_dict, storage_reader=reader, planner=planner,
                               process_group=process_group, no_dist=not _distributed()))


def _call_dcp(fn: Callable[[], Any]) -> Any:
    """Run a DCP call; re-raise the error a ``CheckpointException`` wraps (this rank's, else the first).

    DCP wraps every failure in a ``CheckpointException`` (a ``BaseException``), which would hide
    our typed errors (``CorruptCheckpointError``, ``StorageError``, ...) from callers.
    """
    try:
        return fn()
    except CheckpointException as exc:
        failures = getattr(exc, "failures", None) or {}
        rank = _rank()
        wrapped = failures.get(rank) if rank in failures else next(iter(failures.values()), None)
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else None
        if not isinstance(inner, Exception):
            raise
    raise inner  # outside the handler: keeps the inner error's own cause and context


def _rank() -> int:
    return torch.distributed.get_rank() if _distributed() else 0


def _world_size(process_group: Any = None) -> int:
    """Ranks taking part in a save: 1 without ``torch.distributed``, else the group's size."""
    import torch.distributed as dist

    return dist.get_world_size(process_group) if _distributed() else 1


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
