"""Save: writing a DCP checkpoint through :class:`~async_ckpt.storage.storage.Storage`.

The step directory is a plain ``torch.distributed.checkpoint`` checkpoint (``.metadata`` plus
``__<rank>_<k>.distcp`` files holding ``torch.save``-serialised items, exactly the layout of
DCP's ``FileSystemWriter``), so ``dcp.load`` reads it without async_ckpt. What differs from
DCP's own fsspec writer is the I/O path:

* files of one rank are written concurrently (``threads``), balanced by size, with large
  upload blocks on object stores and ``fsync`` per file on POSIX, never ``os.sync()``;
* each file's size and CRC32C are computed while writing, for the manifest; through
  DCP's planner (:class:`FsspecStorageWriter`, every multi-process save) each item's length
  and CRC32C too, so that a rank restoring only some items reads and checks only those;
* tensors are written from record templates (:mod:`..records`) where one fits; where each
  large tensor's data starts in its file is kept for the manifest (``FileRecord.data_at``);
* a single-process save of plain tensors and objects skips DCP's planner
  (:func:`_save_local`), and a :class:`WriteMemo` lets the next save of the same layout reuse
  the file assignment and the pickled ``.metadata``.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ... import compat
from ...addresses import byte_view
from ..manifest import FileRecord, crc32c
from ..record_stream import DATA_AT_MIN_BYTES, RecordStream, write_record_file
from ..storage import Storage
from ..torch_record import RECORDS, PickledObject, RecordBatch, RecordTemplate
from .dcp_call import METADATA_NAME, call_dcp, distributed, world_size
from .file_assignment import (
    FileLayout,
    WriteMemo,
    flatten,
    has_signature,
    local_data,
    metadata_index,
    own_storages,
    saved_bytes,
    signature,
)
from .reuse import Key, Reuse, Shared, item_key, placed_items
from .writer_process import current_executor

if TYPE_CHECKING:  # the classes compat returns, named for the type checker
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
else:
    _StorageInfo, _StoragePrefix = compat.dcp_storage_info()


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


_RECORDS = RECORDS  # shared by every save in the process: templates depend on torch only

_COALESCE_BYTES = 4 * 2**20  # as record_stream's: small records are gathered into writes of about this size
_SMALL_ITEM_BYTES = 64 * 2**10  # runs of items up to this size are produced one file at a time
_BATCH_MIN = 16  # runs of at least this many records of one template are rendered together


class _RecordStream(RecordStream):
    """:class:`~..record_stream.RecordStream` with tensors' records appended from their templates."""

    def append_record(self, t: torch.Tensor) -> int:
        """Write the record of ``t`` from its template (see :mod:`..torch_record`): a small one
        copied into the pending buffer, a large one as its head, the tensor's memory itself (no
        copy) and its tail. Returns the record's length, or ``-1`` (nothing written) if ``t``
        has no template."""
        tpl = _RECORDS.template(t)
        if tpl is None:
            return -1
        if tpl.nbytes > _RECORDS.max_bytes:
            self.write(tpl.head)
            self.write(byte_view(t))
            self.write(tpl.tail)
            return tpl.length
        pending = self._pending
        n = tpl.append_to(pending, tpl.ctype.from_address(t.data_ptr()))
        if n >= 0:
            if self.records is not None:
                with memoryview(pending) as mv:  # released: the buffer grows later
                    self._rec_crc = crc32c(mv[len(mv) - n:], self._rec_crc)
            if len(pending) >= _COALESCE_BYTES:
                self.flush_pending()
        return n

    def append_records(self, tpl: Any, ts: List[torch.Tensor]) -> None:
        """Append the records of ``ts``, every one eligible for template ``tpl`` (see
        :meth:`RecordTemplates.template`): short runs one by one, long ones in batches."""
        if len(ts) < _BATCH_MIN:
            for t in ts:
                tpl.append_to(self._pending, tpl.ctype.from_address(t.data_ptr()))
            self._end_tail_records(tpl.length, len(ts))
            if len(self._pending) >= _COALESCE_BYTES:
                self.flush_pending()
            return
        size = max(1, min(len(ts), _COALESCE_BYTES // tpl.length))
        batch = RecordBatch(tpl, size)
        for k in range(0, len(ts), size):
            chunk = ts[k: k + size]
            self._pending += batch.render(chunk)
            self._end_tail_records(tpl.length, len(chunk))
            if len(self._pending) >= _COALESCE_BYTES:
                self.flush_pending()


def _write_item(stream: _RecordStream, data: Any) -> int:
    """Append one DCP item: a ``BytesIO``'s bytes, or a tensor as ``torch.save`` writes it.
    Returns its length; ``stream.found`` is then where in the file the tensor's data went, for
    a tensor of at least ``DATA_AT_MIN_BYTES`` whose data was seen written (else -1)."""
    stream.found = -1
    if type(data) is torch.Tensor:  # the common case: a staged host tensor
        n = _append_template(stream, data)
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
        n = _append_template(stream, t)
        if n >= 0:
            return n
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t = t.clone()  # torch.save writes whole storages: keep only this view
    if nbytes >= DATA_AT_MIN_BYTES and t.is_contiguous():
        stream.expect = (t.data_ptr(), nbytes)  # torch.save hands the storage's memory to write()
    try:
        compat.torch_save_without_crc(t, stream)  # as the templates write it (see ..torch_record)
    except RuntimeError:
        if stream.error is not None:  # the storage's own error decides retrying
            raise stream.error from None
        raise
    finally:
        stream.expect = None
    return stream.tell() - start


def _append_template(stream: _RecordStream, t: torch.Tensor) -> int:
    """``stream.append_record(t)``, setting ``stream.found`` for a large tensor."""
    at = stream.tell()
    n = stream.append_record(t)
    if n >= 0 and t.numel() * t.element_size() >= DATA_AT_MIN_BYTES:
        tpl = _RECORDS.template(t)
        if tpl is not None and tpl.length == n:
            stream.found = at + len(tpl.head)
    return n


def _append_run(stream: _RecordStream, tpl: RecordTemplate, ts: List[torch.Tensor], data_at: Dict[int, int]) -> None:
    """``stream.append_records(tpl, ts)``; where each record's data starts goes into ``data_at``
    for a template of at least ``DATA_AT_MIN_BYTES`` of data."""
    at = stream.tell()
    stream.append_records(tpl, ts)
    if tpl.nbytes >= DATA_AT_MIN_BYTES:
        data_at.update((at + k * tpl.length, len(tpl.head)) for k in range(len(ts)))


def _item_nbytes(data: Any) -> int:
    """About how many bytes an item (a tensor or a BytesIO) adds to its file."""
    if isinstance(data, torch.Tensor):
        return data.nbytes
    return data.getbuffer().nbytes if isinstance(data, io.BytesIO) else 0


def _write_files(storage: Storage, path: str, prefix: str, buckets: List[List[Any]], hints: List[int],
                 threads: int, resolve: Callable[[Any], Any], records: bool = False
                 ) -> List[Tuple[str, FileRecord, List[int]]]:
    """:func:`write_buckets`, through the executor of :func:`executing` where there is one."""
    executor = current_executor()
    if executor is None or not buckets:
        return write_buckets(storage, path, prefix, buckets, hints, threads, resolve, records)

    def in_thread(ks: List[int], datas: List[List[Any]]) -> List[Tuple[str, FileRecord, List[int]]]:
        return write_buckets(storage, path, prefix, datas, [hints[k] for k in ks], threads, _same, records,
                             names=ks)

    return executor.write_files(storage, path, prefix, buckets, hints, threads, resolve, records, in_thread)


def _same(item: Any) -> Any:
    return item


def write_buckets(storage: Storage, path: str, prefix: str, buckets: List[List[Any]], hints: List[int],
                  threads: int, resolve: Callable[[Any], Any], records: bool = False,
                  names: Optional[List[int]] = None) -> List[Tuple[str, FileRecord, List[int]]]:
    """Write each bucket as one ``<prefix><k>.distcp`` file, concurrently, from this process.

    Args:
        storage: the root's storage.
        path: the step's directory.
        prefix: the files' name prefix (``__<rank>_``).
        buckets: the items of each file; ``resolve(item)`` gives an item's data (a tensor or a
            ``BytesIO``).
        hints: about the data size of each bucket (lets small files upload in one request).
        threads: files written at once.
        resolve: an item's data.
        records: keep each item's length and CRC-32C in its file's record.
        names: the number ``k`` of each bucket's file (default: its position).

    Returns:
        Per file: its name, its record (with ``records``, the length and CRC-32C of each item
        too) and the length of each item in order (items are contiguous, so offsets follow).
    """
    numbers = names if names is not None else list(range(len(buckets)))

    def write_file(k: int, jobs: List[Any]) -> Tuple[str, FileRecord, List[int]]:
        # A file is streamed, so a transient failure mid-file is retried by rewriting the
        # whole file (the host snapshot is immutable until the step commits).
        where = f"{path}/{prefix}{numbers[k]}.distcp"
        return storage.retry.call(lambda: write_file_once(k, jobs), f"write {where}")

    # Runs of small items are produced by one file at a time: that is Python work, which the
    # GIL serialises anyway, and taking turns lets each file's fsync (or upload) run while the
    # next one is produced, instead of every file finishing production, then all syncing.
    # Big items are written outside the lock, so their I/O still runs concurrently.
    produce_small = threading.Lock()

    def write_file_once(k: int, jobs: List[Any]) -> Tuple[str, FileRecord, List[int]]:
        def produce(rs: RecordStream, lengths: List[int], data_at: Dict[int, int]) -> None:
            stream = cast(_RecordStream, rs)
            held = False
            run: List[torch.Tensor] = []  # consecutive tensors of one record template
            run_tpl: Optional[RecordTemplate] = None
            try:
                for job in jobs:
                    data = resolve(job)
                    tpl = _RECORDS.template(data) if type(data) is torch.Tensor else None
                    if tpl is not None and tpl.nbytes > _RECORDS.max_bytes:
                        tpl = None  # a large record is written from the tensor's memory, on its own
                    if tpl is not None and tpl is run_tpl:
                        run.append(data)
                        continue
                    if run:  # then run_tpl is its template
                        _append_run(stream, cast(RecordTemplate, run_tpl), run, data_at)
                        lengths += [cast(RecordTemplate, run_tpl).length] * len(run)
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
                        at = stream.tell()
                        lengths.append(_write_item(stream, data))
                        if stream.found >= 0:
                            data_at[at] = stream.found - at
                        if records:
                            stream.end_record()
                if run:
                    _append_run(stream, cast(RecordTemplate, run_tpl), run, data_at)
                    lengths += [cast(RecordTemplate, run_tpl).length] * len(run)
                stream.flush_pending()
            finally:
                if held:
                    produce_small.release()

        return write_record_file(storage, path, f"{prefix}{numbers[k]}.distcp", hints[k], records, produce,
                          stream_type=_RecordStream)

    if not buckets:  # nothing to write on this rank (e.g. every item de-duplicated to another)
        return []
    if len(buckets) == 1:
        return [write_file(0, buckets[0])]
    # The first file that fails ends the step: files not started yet are not (an unreachable
    # storage would otherwise fail every remaining file in turn, each after its deadline).
    with ThreadPoolExecutor(min(threads, len(buckets)), thread_name_prefix="async-ckpt-io") as pool:
        futures = [pool.submit(write_file, k, b) for k, b in enumerate(buckets)]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            f.cancel()
        return [f.result() for f in futures]


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
    object, and a tuple or list holding views of staging buffers is saved with copies of its
    own (see :func:`~.file_assignment.own_storages`). Planners without ``lookup_object`` (DCP's and torch_xla's have it) resolve alone."""
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


def _resolving_to(resolve: Callable[[Any], Any], items: List[Any], objs: List[Any]) -> Callable[[Any], Any]:
    """``resolve``, except that ``items[i]`` resolves to ``objs[i]`` where that is not None (what
    :meth:`Reuse.share` left there is what is written)."""
    known = {id(it): o for it, o in zip(items, objs) if o is not None}

    def resolved(item: Any) -> Any:
        o = known.get(id(item))
        return resolve(item) if o is None else o

    return resolved


class FsspecStorageWriter(StorageWriter):
    """DCP ``StorageWriter`` with concurrent, checksummed writes through :class:`Storage`; each
    file's record in :attr:`files` lists its items' lengths and CRC32Cs."""

    def __init__(self, storage: Storage, path: str, *, threads: int = 8, reuse: Optional[Reuse] = None) -> None:
        super().__init__()
        self.storage = storage
        self.path = path
        self.threads = max(1, threads)
        self.reuse = reuse  # incremental: what this rank's last committed step holds
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
        shared: Optional[Shared] = None
        reuse = self.reuse
        if reuse is not None:  # incremental: hash, and share what this rank's last step holds unchanged
            keys = [item_key(it.index.fqn, it.index.offset) for it in items]
            objs = [resolve(it) if it.type != WriteItemType.BYTE_IO else None for it in items]
            hashes, shared = reuse.share(self.storage, self.path, plan.storage_data.prefix, keys, objs)
            items = [it for i, it in enumerate(items) if i not in shared.placed]
            resolve = _resolving_to(resolve, plan.items, objs)  # a declared-frozen tensor's bytes at the call
        buckets = _balance(items, [_item_bytes(it) for it in items], self.threads, self.storage.max_file_bytes)
        hints = [sum(_item_bytes(item) for item in bucket) for bucket in buckets]
        outs = _write_files(self.storage, self.path, plan.storage_data.prefix, buckets, hints, self.threads,
                            resolve, records=True)
        files, where = _results([[item.index for item in bucket] for bucket in buckets], outs)
        if reuse is not None and shared is not None:
            position = {id(it): i for i, it in enumerate(plan.items)}
            placed = _positions([[position[id(it)] for it in b] for b in buckets], outs)
            for i, info in shared.placed.items():
                where[plan.items[i].index] = _StorageInfo(*info)
            placed.update(shared.placed)
            files.update(shared.files)
            reuse.wrote(self.storage, self.path, placed_items(keys, objs, hashes, placed), files, shared)
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



def save_state_dict(storage: Storage, path: str, state_dict: Dict[str, Any], *, threads: int = 8,
                    process_group: Any = None, planner: Optional[SavePlanner] = None,
                    memo: Optional["WriteMemo"] = None) -> Dict[str, FileRecord]:
    """Write ``state_dict`` (host tensors) as a DCP checkpoint under ``path``; return file records.

    ``planner`` defaults to DCP's ``DefaultSavePlanner`` (torch_xla's for staged SPMD shards).
    ``memo``: the owner's :class:`WriteMemo`, for a single-process save to reuse the layout
    of the last save through it; ``None``: nothing is reused or remembered.
    """
    if planner is None and world_size(process_group) == 1:  # e.g. `torchrun --nproc_per_node=1` too
        files = _save_local(storage, path, state_dict, threads=threads, memo=memo)
        if files is not None:
            return files
    writer = FsspecStorageWriter(storage, path, threads=threads, reuse=memo.reuse if memo is not None else None)
    planner = planner if planner is not None else DefaultSavePlanner()
    call_dcp(lambda: dcp.save(state_dict, storage_writer=writer, planner=planner,
                               process_group=process_group, no_dist=not distributed()))
    return writer.files


def _save_local(storage: Storage, path: str, state_dict: Dict[str, Any], *, threads: int,
                memo: Optional[WriteMemo] = None) -> Optional[Dict[str, FileRecord]]:
    """Single-process save of plain tensors and objects, without DCP's planning machinery.

    Writes what ``dcp.save`` with ``DefaultSavePlanner`` and :class:`FsspecStorageWriter`
    writes — the same flattened keys, the same ``Metadata`` (equal field by field), the same
    item bytes — at a fraction of the per-item cost: DCP's local and global planning, plan
    validation and per-item ``dataclasses.replace`` are a fixed cost per item, which dominates
    a state dict of many small tensors. Equal objects inside the metadata (dtypes' properties,
    shapes, zero offsets) are shared, so its pickle is smaller and quicker.

    A training loop saves the same layout again and again, so the last layout is remembered in
    ``memo`` (``None``: a fresh one, nothing reused): when the keys, dtypes and shapes are
    unchanged and every item comes out at the same length, the file assignment and the pickled
    ``.metadata`` are reused rather than rebuilt.

    Returns ``None`` (the caller then uses ``dcp.save``) for anything DCP's planner treats
    specially: DTensors, ShardedTensors, tensor subclasses and ``Stateful`` values.
    """
    for value in state_dict.values():  # what dcp.save's _stateful_to_state_dict would call
        if not isinstance(value, torch.Tensor) and callable(getattr(value, "state_dict", None)) \
                and callable(getattr(value, "load_state_dict", None)):
            return None
    # Nothing per item outlives this save except what the layout keeps: objects alive through a
    # long write are promoted to the collector's oldest generation, and tens of thousands of them
    # per save trigger a full collection (GIL held) every save or two.
    if memo is None:
        memo = WriteMemo()
    layout = memo.layout
    flat, mappings = flatten(state_dict, reuse=layout.mappings if layout is not None else None)
    objs = list(flat.values())
    key = (threads, storage.max_file_bytes)
    fqns = list(flat)
    sig: Optional[List[Any]] = None
    if layout is None or not (layout.key == key and layout.fqns == fqns and layout.mappings == mappings
                              and has_signature(objs, layout.sig)):
        layout = None
        sig = signature(objs)
        if sig is None:
            return None  # DTensor, ShardedTensor, a subclass: DCP's planner knows them

    reuse = memo.reuse
    shared: Optional[Shared] = None
    hashes: List[Optional[int]] = []
    keys: List[Key] = []
    if reuse is not None:  # incremental: hash, and share what the last step holds unchanged
        keys = [item_key(fqn, (0,) * o.dim() if isinstance(o, torch.Tensor) else None) for fqn, o in zip(fqns, objs)]
        hashes, shared = reuse.share(storage, path, "__0_", keys, objs)
        if shared.placed:
            layout = None  # the remembered file assignment holds every item
            sig = sig if sig is not None else signature(objs)

    if layout is not None:
        outs = _write_files(storage, path, "__0_", [[objs[k] for k in b] for b in layout.buckets],
                            layout.hints, threads, local_data)
        if [lengths for _, _, lengths in outs] == layout.lengths:  # same bytes where .metadata says
            storage.write_bytes(f"{path}/{METADATA_NAME}", layout.metadata)
            files = {name: rec for name, rec, _ in outs}
            files[METADATA_NAME] = layout.files_meta
            if reuse is not None:
                reuse.wrote(storage, path, placed_items(keys, objs, hashes, _positions(layout.buckets, outs)), files,
                            shared)
            return files
        # An object's pickle changed length: same files, new .metadata (built below).
        buckets, hints = layout.buckets, layout.hints
    else:
        todo = [k for k in range(len(objs)) if shared is None or k not in shared.placed]
        sizes = [o.numel() * o.element_size() if isinstance(o, torch.Tensor) else 1024 for o in objs]
        buckets = _balance(todo, [sizes[k] for k in todo], threads, storage.max_file_bytes)
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
            indices.append(metadata_index(fqn, chunk.offsets, 0))
        else:
            md[fqn] = BytesStorageMetadata()
            indices.append(MetadataIndex(fqn))
    if outs is None:
        outs = _write_files(storage, path, "__0_", [[objs[k] for k in b] for b in buckets], hints, threads,
                            local_data)
    files, where = _results([[indices[k] for k in b] for b in buckets], outs)
    placed = _positions(buckets, outs)
    if shared is not None and shared.placed:
        for k, (name, offset, length) in shared.placed.items():
            where[indices[k]] = _StorageInfo(name, offset, length)
        placed.update(shared.placed)
        files.update(shared.files)
        where = {indices[k]: where[indices[k]] for k in range(len(objs))}  # in item order, as DCP writes it
    metadata = Metadata(state_dict_metadata=md, planner_data=mappings, storage_data=where,
                        storage_meta=StorageMeta(checkpoint_id=None, save_id=""))
    data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)  # DCP's own format
    storage.write_bytes(f"{path}/{METADATA_NAME}", data)
    files[METADATA_NAME] = FileRecord(len(data), crc32c(data))
    if reuse is not None:
        reuse.wrote(storage, path, placed_items(keys, objs, hashes, placed), files, shared)
    if shared is not None and shared.placed:
        return files  # a layout that leaves items out is not one to write again
    if sig is None:  # the files were written with the last layout; only .metadata is new
        sig = cast(FileLayout, layout).sig  # sig is None only when the layout was kept
    memo.remember(FileLayout(key, fqns, sig, mappings, buckets, hints,
                          [lengths for _, _, lengths in outs], data, files[METADATA_NAME]))
    return files


def _positions(buckets: List[List[int]], outs: List[Tuple[str, FileRecord, List[int]]]
               ) -> Dict[int, Tuple[str, int, int]]:
    """Item position -> ``(file name, offset, length)`` from :func:`_write_files`' results."""
    out: Dict[int, Tuple[str, int, int]] = {}
    for positions, (name, _, lengths) in zip(buckets, outs):
        offset = 0
        for k, length in zip(positions, lengths):
            out[k] = (name, offset, length)
            offset += length
    return out

