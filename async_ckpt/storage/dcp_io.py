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
import pickle
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.futures import Future
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
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
from torch.distributed.checkpoint._traverse import set_element

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from .fs import Storage
from .manifest import FileRecord, crc32c

METADATA_NAME = ".metadata"

# DCP warns on every single-process save/load; that is our normal case, not news to the user.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class _ChecksumStream:
    """Write-through stream that counts bytes and computes CRC32C as data passes."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.size = 0
        self.crc = 0
        self.error: Optional[BaseException] = None  # torch.save hides it behind a RuntimeError

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.crc = crc32c(mv, self.crc)
        try:
            self._f.write(mv)
        except BaseException as exc:
            self.error = exc
            raise
        self.size += mv.nbytes
        return mv.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def _item_bytes(planner: SavePlanner, item: Any) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return 1024
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize if item.tensor_data else 0


MIN_FILE_BYTES = 16 * 2**20  # below this, more files cost more than they parallelise


def _balance(items: List[Any], planner: SavePlanner, buckets: int) -> List[List[Any]]:
    """Greedy size balancing of write items over at most ``buckets`` files."""
    total = sum(_item_bytes(planner, it) for it in items)
    buckets = min(buckets, max(1, -(-total // MIN_FILE_BYTES)))
    out: List[List[Any]] = [[] for _ in range(max(1, buckets))]
    loads = [0] * len(out)
    for item in sorted(items, key=lambda it: -_item_bytes(planner, it)):
        k = loads.index(min(loads))
        out[k].append(item)
        loads[k] += _item_bytes(planner, item)
    return [b for b in out if b]


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
        prefix = plan.storage_data.prefix
        buckets = _balance(plan.items, planner, self.threads)

        def write_file(k: int, items: List[Any]) -> Tuple[str, FileRecord, List[WriteResult]]:
            # A file is streamed, so a transient failure mid-file is retried by rewriting the
            # whole file (the host snapshot is immutable until the step commits).
            where = f"{self.path}/{prefix}{k}.distcp"
            return self.storage.retry.call(lambda: write_file_once(k, items), f"write {where}")

        def write_file_once(k: int, items: List[Any]) -> Tuple[str, FileRecord, List[WriteResult]]:
            name = f"{prefix}{k}.distcp"
            results = []
            with self.storage.open_write(f"{self.path}/{name}") as f:
                stream = _ChecksumStream(f)
                for item in items:
                    data = planner.resolve_data(item)
                    offset = stream.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                    else:
                        t = data.detach()
                        if t.device.type != "cpu":
                            t = t.cpu()
                        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                            t = t.clone()  # torch.save writes whole storages: keep only this view
                        try:
                            torch.save(t, stream)
                        except RuntimeError:
                            if stream.error is not None:  # the storage's own error decides retrying
                                raise stream.error
                            raise
                    length = stream.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name, offset, length)))
            # A silently short write (a full or flaky disk, a FUSE mount) fails the attempt with
            # EIO, which is transient, so the file is redone. gs:// and s3:// need no check:
            # their uploads are length-checked by the service.
            stored = stream.size if getattr(self.storage, "is_object_store", False) else \
                self.storage.size(f"{self.path}/{name}")
            if stored != stream.size:
                raise OSError(errno.EIO, f"short write: {stream.size} bytes written, storage holds {stored}",
                              f"{self.path}/{name}")
            return name, FileRecord(stream.size, stream.crc), results

        fut: Future = Future()
        if len(buckets) == 1:
            outs = [write_file(0, buckets[0])]
        else:
            with ThreadPoolExecutor(len(buckets), thread_name_prefix="async-ckpt-io") as pool:
                outs = list(pool.map(lambda kv: write_file(*kv), enumerate(buckets)))
        all_results: List[WriteResult] = []
        for name, rec, results in outs:
            self.files[name] = rec
            all_results.extend(results)
        fut.set_result(all_results)
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
        return StorageMeta(checkpoint_id=self.path, save_id="")

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
        elif module == "collections" and name == "OrderedDict":
            return pickle.Unpickler.find_class(self, module, name)
        elif module == "torch.distributed._shard.sharded_tensor.metadata" or module == "torch.distributed.tensor._dtensor_spec":
            obj = pickle.Unpickler.find_class(self, module, name)
            if _plain_data_class(obj):
                return obj
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not an allowed DCP metadata "
            "class; refusing to load it (it could run code)"
        )


def load_metadata(data: bytes, *, where: str = METADATA_NAME) -> Metadata:
    """Unpickle DCP ``.metadata`` bytes safely."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: DCP metadata is unreadable ({type(exc).__name__}: {exc})",
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
                f"{read_item.dest_index.fqn}: refusing to unpickle an object outside torch's safe set "
                f"({exc}); pass allow_pickle=True to restore if you trust this checkpoint"
            ) from exc

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.set_bytes(read_item, self.decode_bytes(read_item, value))

    def set_bytes(self, read_item: Any, obj: Any) -> None:
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class FsspecStorageReader(StorageReader):
    """DCP ``StorageReader``: whole files read concurrently, verified, then deserialised."""

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

    def read_file(self, name: str) -> bytes:
        where = f"{self.path}/{name}"
        try:
            data = self.storage.read_bytes(where)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: file is missing", path=where) from None
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

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = load_metadata(self.read_file(METADATA_NAME), where=f"{self.path}/{METADATA_NAME}")
        return self._metadata

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
        with ThreadPoolExecutor(max(1, min(self.threads, len(names))), thread_name_prefix="async-ckpt-read") as pool:
            blobs = dict(zip(names, pool.map(self.read_file, names)))
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
        for name, reqs in per_file.items():
            blob = memoryview(blobs.pop(name))
            for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                info = self.storage_data[req.storage_index]
                chunk = io.BytesIO(blob[info.offset: info.offset + info.length])
                if req.type == LoadItemType.BYTE_IO:
                    if id(req) in decoded:
                        planner.set_bytes(req, decoded[id(req)])
                    else:
                        planner.load_bytes(req, chunk)
                    continue
                tensor = torch.load(chunk, map_location="cpu", weights_only=True)
                tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise CorruptCheckpointError(
                        f"{req.storage_index.fqn}: stored shape {tuple(tensor.size())} != expected {tuple(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def save_state_dict(storage: Storage, path: str, state_dict: Dict[str, Any], *, threads: int = 8,
                    process_group: Any = None, planner: Optional[SavePlanner] = None) -> Dict[str, FileRecord]:
    """Write ``state_dict`` (host tensors) as a DCP checkpoint under ``path``; return file records.

    ``planner`` defaults to DCP's ``DefaultSavePlanner`` (torch_xla's for staged SPMD shards).
    """
    writer = FsspecStorageWriter(storage, path, threads=threads)
    planner = planner if planner is not None else DefaultSavePlanner()
    _call_dcp(lambda: dcp.save(state_dict, storage_writer=writer, planner=planner,
                               process_group=process_group, no_dist=not _distributed()))
    return writer.files


def load_state_dict(storage: Storage, path: str, state_dict: Dict[str, Any], *, files: Optional[Dict[str, FileRecord]],
                    verify: bool = True, threads: int = 8, allow_pickle: bool = False,
                    metadata: Optional[Metadata] = None, process_group: Any = None,
                    planner: Optional[LoadPlanner] = None) -> None:
    """Load a DCP checkpoint under ``path`` into ``state_dict`` in place (``planner``: see save)."""
    reader = FsspecStorageReader(storage, path, files=files, verify=verify, threads=threads, metadata=metadata)
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


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
