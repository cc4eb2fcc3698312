"""DCP's two storage protocols over async_ckpt's one writer and one verified read: the
``StorageWriter`` (:class:`FsspecStorageWriter`, over :class:`~.write.StepWriter`) and the
``StorageReader`` (:class:`FsspecStorageReader`, over :func:`~.read_exec.execute`), through
:class:`~async_ckpt.storage.storage.Storage`.

Save: every save through DCP's planner (several ranks, or a custom planner) hands its items to
the one :class:`~.write.StepWriter`; each file's record lists its items' lengths and CRC-32Cs,
so that a rank restoring only some items reads and checks only those.

Restore: what the load plan needs is read concurrently and checked against the manifest before
the target state dict is touched (with several ranks, before any rank touches its own: they
exchange their outcomes first), so a failed restore leaves it untouched: of a file whose
manifest entry lists its records (:class:`~async_ckpt.format.manifest.FileRecord`), only the
records the plan's items lie in, adjacent ones in one request, each checked against its CRC32C;
any other file whole (a big one as concurrent ranged reads), checked against its size and
CRC32C. A tensor item stored as one plain ``torch.save`` storage is copied straight from the
read buffer into its target
(:func:`~async_ckpt.format.torch_record.stored_bytes`); anything else goes through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Dict, List, Optional, Protocol, Tuple, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
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
from torch.futures import Future

from .. import compat
from ..addresses import byte_view
from ..errors import CorruptCheckpointError
from ..format.dcp_layout import METADATA_NAME, own_storages, saved_bytes
from ..format.manifest import FileRecord, check_file_name, shown
from ..format.torch_record import PickledObject, stored_bytes
from ..format.unpickling import SafeLoadPlanner, load_metadata
from ..format.validate import check_step_metadata
from ..storage.storage import READ_RANGE_BYTES, Storage
from .dcp_call import call_dcp, distributed
from .read_exec import OpenFiles, StepFiles, execute, read_files, whole_pieces
from .read_plan import record_pieces
from .reuse import Key, Reuse, item_key
from .sinks import FRESH, NULL
from .write import StepWriter

if TYPE_CHECKING:  # the classes compat returns, named for the type checker
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
else:
    _StorageInfo, _StoragePrefix = compat.dcp_storage_info()
narrow_tensor_by_index = compat.narrow_tensor_by_index()


# ---- save: DCP's StorageWriter -----------------------------------------------------------------

def _item_bytes(item: Any) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return 1024
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize if item.tensor_data else 0


def _resolver(planner: SavePlanner) -> Callable[[Any], Any]:
    """``planner.resolve_data``, except that a :class:`PickledObject` (a snapshot's non-tensor
    value, pickled at the call) is written as its archive, not ``torch.save``-d again as an
    object, and a tuple or list holding views of staging buffers is saved with copies of its
    own (see :func:`~async_ckpt.format.dcp_layout.own_storages`). Planners without
    ``lookup_object`` (DCP's and torch_xla's have it) resolve alone."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        return planner.resolve_data

    def resolve(item: Any) -> Any:
        if item.type == WriteItemType.BYTE_IO:
            obj = lookup(item.index)
            if type(obj) is PickledObject:
                return obj.archive()
            own = own_storages(obj)
            if own is not obj:  # a tuple or list holding views of staging buffers: as DCP's, but copied
                return saved_bytes(own)
        return planner.resolve_data(item)

    return resolve


class FsspecStorageWriter(StorageWriter):
    """DCP's ``StorageWriter`` over a :class:`StepWriter` (every save through DCP's planner:
    several ranks, or a custom planner); each file's record in :attr:`files` lists its items'
    lengths and CRC-32Cs."""

    def __init__(self, storage: Storage, path: str, *, threads: int = 8, reuse: Optional[Reuse] = None) -> None:
        super().__init__()
        self.writer = StepWriter(storage, path, threads=threads, reuse=reuse)
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
        resolve = _resolver(planner)
        items = plan.items
        keys: Optional[List[Key]] = None
        objs: Optional[List[Any]] = None
        if self.writer.reuse is not None:  # incremental: the tensors, hashed and compared with the last step's
            keys = [item_key(it.index.fqn, it.index.offset) for it in items]
            objs = [resolve(it) if it.type != WriteItemType.BYTE_IO else None for it in items]
        held = objs

        def data(k: int) -> Any:  # a declared-frozen tensor's bytes at the call, where the splice put them
            o = held[k] if held is not None else None
            return resolve(items[k]) if o is None else o

        out = self.writer.write_items(plan.storage_data.prefix, len(items), [_item_bytes(it) for it in items], data,
                                      keys=keys, objs=objs, records=True)
        self.files.update(out.files)
        fut: Future = Future()
        fut.set_result([WriteResult(index=items[k].index, size_in_bytes=length,
                                    storage_data=_StorageInfo(name, offset, length))
                        for k, (name, offset, length) in sorted(out.placed.items())])
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        self.files[METADATA_NAME] = self.writer.write_metadata(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))

    def storage_meta(self) -> Optional[StorageMeta]:
        # No checkpoint_id: the path written to is a temporary directory renamed at commit,
        # and a step directory may be copied or exported; the id would be stale either way.
        return StorageMeta(checkpoint_id=None, save_id="")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


# ---- restore: DCP's StorageReader --------------------------------------------------------------

class _BytesDecoder(Protocol):
    """A load planner that decodes a non-tensor item apart from setting it (``SafeLoadPlanner``)."""

    def decode_bytes(self, read_item: Any, value: io.BytesIO) -> Any: ...

    def set_bytes(self, read_item: Any, obj: Any) -> None: ...


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
                 agree: Optional[Callable[[Optional[BaseException]], Any]] = None,
                 whole: bool = True) -> None:
        super().__init__()
        #: whether the copy holds every element of every tensor (see check_step_metadata)
        self.whole = whole
        #: several ranks: this rank's read outcome (None: ok, else its error) exchanged with every
        #: rank's; raises on every rank when any rank's failed (see :meth:`read_data`)
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

    def _records(self, names: List[str]) -> Dict[str, FileRecord]:
        """The records of the files ``names`` (every one a plain file name): the manifest's; a
        checkpoint without a manifest (plain DCP): each file's size as the storage reports it,
        and nothing to compare a checksum with."""
        for name in names:
            check_file_name(name, where=f"{self.path}/{METADATA_NAME}")
        if self.files is None:
            return {n: FileRecord(self.storage.size(f"{self.path}/{n}"), 0) for n in names}
        missing = [n for n in names if n not in self.files]
        if missing:
            where = f"{self.path}/{missing[0]}"
            raise CorruptCheckpointError(f"{where}: not listed in the manifest; refusing to read it unchecked",
                                         path=where)
        return {n: self.files[n] for n in names}

    @property
    def _verifies(self) -> bool:
        return self.verify and self.files is not None

    def _read(self, whole: List[str], wanted: Dict[str, List[Tuple[int, int]]], pool: ThreadPoolExecutor
              ) -> Dict[str, Tuple[List[int], List[memoryview]]]:
        """The bytes the load needs, read and verified by the one verified read: the files
        ``whole`` whole (a big one as concurrent ranged reads of ``READ_RANGE_BYTES``), and of
        each file of ``wanted`` (its manifest lists its records) the records that its byte
        ranges ``(offset, length)`` lie in, adjacent ones in one request, each checked against
        its CRC-32C. Per file: where each run read starts, and its bytes."""
        records = self._records(whole + list(wanted))
        pieces, covered, out = record_pieces(records, wanted, READ_RANGE_BYTES)
        for name in whole:
            buf = FRESH.buffer(name, records[name].size)
            assert buf is not None
            out[name] = ([0], [byte_view(buf)[:records[name].size] if records[name].size else memoryview(b"")])
            pieces += whole_pieces(name, records[name].size, buf, READ_RANGE_BYTES)
        with OpenFiles(self.storage, self.path, records) as opened:
            execute(opened, pieces, verify=self._verifies, threads=self.threads, pool=pool, records=covered)
        return out

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata``, read and checked (once; a ``metadata`` given to the constructor is
        taken as checked): :func:`read_metadata`, the files no item points at checked too."""
        if self._metadata is None:
            self._metadata = read_metadata(self.storage, self.path, self.files, verify=self.verify, whole=self.whole,
                                           check_unused=True, threads=self.threads)
        return self._metadata

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
        writes, and every rank raises (the failing rank its own error, the others one naming it)."""
        failure: Optional[Exception] = None
        try:
            ready = self._prepare(plan, planner)
        except Exception as exc:  # noqa: BLE001 - exchanged below, then raised
            ready, failure = {}, exc
        if self.agree is not None:
            self.agree(failure)
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
            parts = self._read(whole, ranged, pool)  # per file: where each read run starts, its bytes

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


def parse_metadata(data: bytes, files: Optional[Dict[str, FileRecord]], *, where: str, whole: bool = True
                   ) -> Tuple[Metadata, Dict[str, int]]:
    """A step's DCP metadata from the bytes of its ``.metadata``: unpickled by the restricted
    unpickler, then checked against itself and (with ``files``) the manifest's records
    (:func:`~async_ckpt.format.validate.check_step_metadata`).

    Args:
        data: the bytes of ``.metadata`` (verified against the manifest already).
        files: the manifest's records, or ``None`` for a checkpoint without a manifest.
        where: the ``.metadata`` file, for messages.
        whole: the copy holds every element of every tensor (``Manifest.whole``).

    Returns:
        The metadata, and per data file where its last item ends.

    Raises:
        CorruptCheckpointError: it does not unpickle, or fails a check (named).
        UnsafeCheckpointError: it names a class outside the allowed ones.
    """
    md = load_metadata(data, where=where)
    return md, check_step_metadata(md, files, where=where, whole=whole)


def read_metadata(storage: StepFiles, path: str, files: Optional[Dict[str, FileRecord]], *, verify: bool = True,
                  whole: bool = True, check_unused: bool = False, threads: int = 8) -> Metadata:
    """Open and check a step's DCP metadata: the one place every path does it (restore, the
    restart recall of an incremental save, ``show``, ``export``).

    ``.metadata`` is read through the one verified read (its manifest size and CRC-32C), then
    :func:`parse_metadata`.

    Args:
        storage: the root's storage.
        path: the step directory.
        files: the manifest's records, or ``None`` for a checkpoint without a manifest (plain DCP).
        verify: compare checksums (sizes are always compared).
        whole: the copy holds every element of every tensor (``Manifest.whole``).
        check_unused: the files the manifest lists that no item points at are read and checked
            too (a restore checks every listed file).
        threads: how many reads run at once.

    Returns:
        The checked metadata.

    Raises:
        CorruptCheckpointError: the manifest lists no ``.metadata``, or it (or, with
            ``check_unused``, an unused file) is damaged.
    """
    where = f"{path}/{METADATA_NAME}"
    if files is not None and METADATA_NAME not in files:
        raise CorruptCheckpointError(f"{path}: the manifest lists no {METADATA_NAME}", path=where)
    records = files if files is not None else {METADATA_NAME: FileRecord(storage.size(where), 0)}
    buf = read_files(storage, path, {METADATA_NAME: records[METADATA_NAME]}, FRESH,
                     verify=verify and files is not None, chunk=READ_RANGE_BYTES)[METADATA_NAME]
    md, ends = parse_metadata(bytes(byte_view(buf)) if buf.numel() else b"", files, where=where, whole=whole)
    unused = [n for n in sorted(files or ()) if n != METADATA_NAME and n not in ends]
    if check_unused and unused and files is not None:  # referenced by no item: still checked (size, checksum)
        read_files(storage, path, {n: files[n] for n in unused}, NULL, verify=verify, threads=threads)
    return md


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
