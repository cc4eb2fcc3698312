"""Save: writing a DCP checkpoint through :class:`~async_ckpt.storage.storage.Storage`.

The step directory is a plain ``torch.distributed.checkpoint`` checkpoint (``.metadata`` plus
``__<rank>_<k>.distcp`` files holding ``torch.save``-serialised items, exactly the layout of
DCP's ``FileSystemWriter``), so ``dcp.load`` reads it without async_ckpt. What differs from
DCP's own fsspec writer is the I/O path:

* files of one rank are written concurrently (``threads``), balanced by size, with large
  upload blocks on object stores and ``fsync`` per file on POSIX, never ``os.sync()``;
* each file's size and CRC32C are computed while writing, for the manifest; through
  DCP's planner (:class:`~.dcp_adapters.FsspecStorageWriter`, every multi-process save) each
  item's length and CRC32C too, so that a rank restoring only some items reads and checks only
  those;
* tensors are written from record templates (:mod:`async_ckpt.format.torch_record`) where one fits; where each
  large tensor's data starts in its file is kept for the manifest (``FileRecord.data_at``);
* a single-process save of plain tensors and objects skips DCP's planner
  (:func:`plan_local`, :func:`save_local`), and a :class:`WriteMemo` lets the next save of the
  same layout reuse the file assignment and the pickled ``.metadata``.

Planning and moving bytes are apart: :class:`StepWriter` plans a rank's files (the incremental
splice once: :meth:`~.reuse.Reuse.share`; which items go to which file; the ``.metadata``) and
:func:`write_files` alone writes them (records from templates, CRC-32C per record and per file,
``fsync`` or upload), so that another executor can take its place.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .. import compat
from ..addresses import byte_view
from ..errors import WriterProcessError
from ..format.crc import crc32c
from ..format.dcp_layout import (
    METADATA_NAME,
    FileLayout,
    WriteMemo,
    flatten,
    has_signature,
    is_stateful,
    local_data,
    metadata_index,
    signature,
)
from ..format.manifest import FileRecord
from ..format.torch_record import RECORDS, RecordBatch, RecordTemplate, save_record
from ..storage.storage import Storage
from .read_exec import OpenFiles, Piece, execute
from .record_stream import DATA_AT_MIN_BYTES, RecordStream, keep_data_at, write_record_file
from .reuse import Key, Reuse, Shared, item_key, placed_items
from .writer_process import current_executor

if TYPE_CHECKING:  # the class compat returns, named for the type checker
    from torch.distributed.checkpoint.filesystem import _StorageInfo
else:
    _StorageInfo, _ = compat.dcp_storage_info()


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
    """:class:`~.record_stream.RecordStream` with tensors' records appended from their templates."""

    def append_record(self, t: torch.Tensor) -> int:
        """Write the record of ``t`` from its template (see :mod:`async_ckpt.format.torch_record`): a small one
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
        :meth:`~async_ckpt.format.torch_record.RecordTemplates.template`): short runs one by one, long ones in batches."""
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


def _write_item(stream: _RecordStream, data: Any, data_at: Dict[int, int]) -> int:
    """Append one DCP item: a ``BytesIO``'s bytes, or a tensor as ``torch.save`` writes it.
    Returns its length; where a large tensor's data starts goes into ``data_at``."""
    if type(data) is torch.Tensor:  # the common case: a staged host tensor
        n = _append_template(stream, data, data_at)
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
        n = _append_template(stream, t, data_at)
        if n >= 0:
            return n
    try:
        keep_data_at(data_at, start, save_record(t, stream), t.numel() * t.element_size())
    except RuntimeError:
        if stream.error is not None:  # the storage's own error decides retrying
            raise stream.error from None
        raise
    return stream.tell() - start


def _append_template(stream: _RecordStream, t: torch.Tensor, data_at: Dict[int, int]) -> int:
    """``stream.append_record(t)``, noting where a large tensor's data starts in ``data_at``."""
    at = stream.tell()
    n = stream.append_record(t)
    if n >= 0:
        tpl = _RECORDS.template(t)
        if tpl is not None and tpl.length == n:
            keep_data_at(data_at, at, len(tpl.head), tpl.nbytes)
    return n


def _append_run(stream: _RecordStream, tpl: RecordTemplate, ts: List[torch.Tensor], data_at: Dict[int, int]) -> None:
    """``stream.append_records(tpl, ts)``; where each record's data starts goes into ``data_at``
    for a template of at least ``DATA_AT_MIN_BYTES`` of data."""
    at = stream.tell()
    stream.append_records(tpl, ts)
    for k in range(len(ts)) if tpl.nbytes >= DATA_AT_MIN_BYTES else ():
        keep_data_at(data_at, at + k * tpl.length, len(tpl.head), tpl.nbytes)


def _item_nbytes(data: Any) -> int:
    """About how many bytes an item (a tensor or a BytesIO) adds to its file."""
    if isinstance(data, torch.Tensor):
        return data.nbytes
    return data.getbuffer().nbytes if isinstance(data, io.BytesIO) else 0


@dataclasses.dataclass
class FilePlan:
    """One file a step writer writes: its name, its items in order (each resolved to its data,
    a tensor or a ``BytesIO``, by the writer's ``resolve`` as it is written), and about how many
    bytes they make (lets a small file upload in one request)."""

    name: str
    items: List[Any]
    hint: int


@dataclasses.dataclass
class WrittenFile:
    """What writing one :class:`FilePlan` made: the file's record (with ``records``, each item's
    length and CRC-32C too; ``data_at``: where large tensors' data lies) and each item's length,
    in order (items are contiguous, so offsets follow)."""

    name: str
    record: FileRecord
    lengths: List[int]


def write_files(storage: Storage, path: str, plans: Sequence[FilePlan], *, threads: int,
                resolve: Callable[[Any], Any], records: bool = False) -> List[WrittenFile]:
    """The executor of a step's writes: every file of ``plans`` written into ``path``,
    concurrently, each as a stream of records (from record templates where one fits, gathered
    into large writes), its size and CRC-32C (and with ``records`` each record's) computed on
    the way, durable when it returns (``fsync`` or upload). The one place bytes are moved for a
    step's data files (:class:`StepWriter` calls it).

    A file that fails is written again whole on a transient error (the host snapshot is
    immutable until the step commits); the first file that fails for good ends the step: the
    files not started yet are not.

    Where a save runs with the writer process (:func:`.writer_process.executing`), the files
    whose items all live in its shared staging buffers are written there, the others here.

    Args:
        storage: the root's storage.
        path: the step's (temporary) directory.
        plans: the files.
        threads: how many files are written at once.
        resolve: an item's data (a tensor or a ``BytesIO``).
        records: keep each item's length and CRC-32C in the file's record.

    Returns:
        Per file, in the order of ``plans``, what was written.

    Raises:
        StorageError: a file could not be written (after retries).
        OSError: a short write, or the storage refused the file.
    """
    executor = current_executor()
    if executor is None or not plans:
        return write_files_here(storage, path, plans, threads=threads, resolve=resolve, records=records)

    def in_thread(ks: List[int], datas: List[List[Any]]) -> List[Tuple[str, FileRecord, List[int]]]:
        here = [FilePlan(plans[k].name, d, plans[k].hint) for k, d in zip(ks, datas)]
        outs = write_files_here(storage, path, here, threads=threads, resolve=_same, records=records)
        return [(w.name, w.record, w.lengths) for w in outs]

    written = executor.write_files(storage, path, [p.name for p in plans], [p.items for p in plans],
                                   [p.hint for p in plans], threads, resolve, records, in_thread)
    try:
        check_rendered(storage, path, {name: record for name, record, _ in written}, executor.rendered)
    except WriterProcessError:
        executor.process.kill()  # what it holds is not what this process sent: a new one at the next save
        raise
    return [WrittenFile(name, record, lengths) for name, record, lengths in written]


def check_rendered(storage: Storage, path: str, files: Dict[str, FileRecord], rendered: Dict[str, Dict[int, bytes]]
                   ) -> None:
    """Before a step commits: the bytes of ``rendered`` (per file, by offset: the heads and tails
    of the records the writer process rendered from templates) are where they must be in the
    files written, read back through the one verified read (the records' data left out). Each
    head is one a reader takes for its tensor's dtype and shape (checked when its template was
    made: :meth:`~..format.torch_record.RecordTemplate.reads_as`); a checksum over what was
    written cannot catch a record rendered from the wrong template.

    Raises:
        WriterProcessError: a record's head or tail differs.
    """
    todo = {name: want for name, want in rendered.items() if want and name in files}
    if not todo:
        return
    wrong: List[str] = []

    class Compare:
        def writing(self, piece: Piece) -> None:
            pass

        def arrived(self, piece: Piece, buf: torch.Tensor, data: memoryview) -> None:
            if data[:piece.end - piece.start] != todo[piece.name][piece.start]:
                wrong.append(f"{piece.name}@{piece.start}")

        def finished(self, name: str, error: Optional[BaseException]) -> None:
            pass

    pieces = [Piece(name, at, at + len(b)) for name, want in todo.items() for at, b in want.items()]
    with OpenFiles(storage, path, {name: files[name] for name in todo}) as opened:
        execute(opened, pieces, records={name: [] for name in todo}, consumer=Compare(), threads=1)
    if wrong:
        raise WriterProcessError(
            f"the writer process wrote records in {path} other than their templates ({', '.join(sorted(wrong)[:4])}: "
            "records a reader would refuse): the step is not committed; the next save starts a new writer process")


def _same(item: Any) -> Any:
    return item


def write_files_here(storage: Storage, path: str, plans: Sequence[FilePlan], *, threads: int,
                     resolve: Callable[[Any], Any], records: bool = False) -> List[WrittenFile]:
    """:func:`write_files` by threads of this process (the writer process, where a save has
    one, writes the files whose items all live in shared staging buffers: see
    :mod:`.writer_process`); the arguments, result and errors are :func:`write_files`'s.
    """

    def write_file(plan: FilePlan) -> WrittenFile:
        # A file is streamed, so a transient failure mid-file is retried by rewriting the
        # whole file (the host snapshot is immutable until the step commits).
        return storage.retry.call(lambda: write_file_once(plan), f"write {path}/{plan.name}")

    # Runs of small items are produced by one file at a time: that is Python work, which the
    # GIL serialises anyway, and taking turns lets each file's fsync (or upload) run while the
    # next one is produced, instead of every file finishing production, then all syncing.
    # Big items are written outside the lock, so their I/O still runs concurrently.
    produce_small = threading.Lock()

    def write_file_once(plan: FilePlan) -> WrittenFile:
        def produce(rs: RecordStream, lengths: List[int], data_at: Dict[int, int]) -> None:
            stream = cast(_RecordStream, rs)
            held = False
            run: List[torch.Tensor] = []  # consecutive tensors of one record template
            run_tpl: Optional[RecordTemplate] = None
            try:
                for job in plan.items:
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
                        lengths.append(_write_item(stream, data, data_at))
                        if records:
                            stream.end_record()
                if run:
                    _append_run(stream, cast(RecordTemplate, run_tpl), run, data_at)
                    lengths += [cast(RecordTemplate, run_tpl).length] * len(run)
                stream.flush_pending()
            finally:
                if held:
                    produce_small.release()

        name, record, lengths = write_record_file(storage, path, plan.name, plan.hint, records, produce,
                                                  stream_type=_RecordStream)
        return WrittenFile(name, record, lengths)

    if not plans:  # nothing to write on this rank (e.g. every item de-duplicated to another)
        return []
    if len(plans) == 1:
        return [write_file(plans[0])]
    # The first file that fails ends the step: files not started yet are not (an unreachable
    # storage would otherwise fail every remaining file in turn, each after its deadline).
    with ThreadPoolExecutor(min(threads, len(plans)), thread_name_prefix="async-ckpt-io") as pool:
        futures = [pool.submit(write_file, plan) for plan in plans]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            f.cancel()
        return [f.result() for f in futures]


# ---- planning: which items go where; the incremental splice; the metadata -----------------------

@dataclasses.dataclass
class ItemsWritten:
    """What :meth:`StepWriter.write_items` placed: the data files' records (files taken from
    the last step included), where each item lies (position -> ``(file, offset, length)``), the
    file assignment it wrote (positions per file, their size hints, each item's length per file),
    and whether items were taken from the last step."""

    files: Dict[str, FileRecord]
    placed: Dict[int, Tuple[str, int, int]]
    buckets: List[List[int]]
    hints: List[int]
    lengths: List[List[int]]
    shared: bool


class StepWriter:
    """One rank's files of one step: what goes in which file, and the writing of them.

    The one writer of every save, one process or several (DCP's ``StorageWriter``,
    :class:`~.dcp_adapters.FsspecStorageWriter`, is a thin adapter over it). :meth:`write_items` plans
    (the incremental splice: the items the last step holds unchanged are taken with its files,
    :meth:`~.reuse.Reuse.share`; the others balanced over files by size) and hands the files to
    the executor (:func:`write_files`, the one place bytes are moved); :meth:`write_metadata`
    writes the step's ``.metadata``.

    Args:
        storage: the root's storage.
        path: the step's (temporary) directory.
        threads: how many files are written at once.
        reuse: incremental saves: what this rank's last committed step holds; None: whole saves.
    """

    def __init__(self, storage: Storage, path: str, *, threads: int, reuse: Optional[Reuse] = None) -> None:
        self.storage, self.path = storage, path
        self.threads = max(1, threads)
        self.reuse = reuse

    def write_items(self, prefix: str, count: int, sizes: List[int], resolve: Callable[[int], Any], *,
                    keys: Optional[List[Key]] = None, objs: Optional[List[Any]] = None, records: bool = False,
                    buckets: Optional[List[List[int]]] = None, hints: Optional[List[int]] = None) -> ItemsWritten:
        """Write the items ``0 .. count - 1`` into ``<prefix><k>.distcp`` files.

        Args:
            prefix: this rank's file-name prefix (``__<rank>_``).
            count: the items.
            sizes: about how many bytes each adds to its file.
            resolve: an item's data (a tensor or a ``BytesIO``), by position.
            keys: incremental saves: each item's key (:func:`~.reuse.item_key`).
            objs: incremental saves: each item's tensor (``None`` for others); a declared-frozen
                tensor left uncopied becomes its bytes at the call here (``resolve`` must give
                ``objs[i]`` where it is not None).
            records: keep each item's length and CRC-32C in the files' records.
            buckets: the file assignment to write (positions per file; a remembered layout),
                used unless items are taken from the last step; None: balanced here.
            hints: the size hints of ``buckets``.

        Returns:
            What was placed where.
        """
        reuse = self.reuse
        shared: Optional[Shared] = None
        hashes: List[Optional[int]] = []
        if reuse is not None and keys is not None and objs is not None:
            hashes, shared = reuse.share(self.storage, self.path, prefix, keys, objs)
            if shared.placed:
                buckets = None  # a remembered file assignment holds every item
        if buckets is None or hints is None:
            todo = [k for k in range(count) if shared is None or k not in shared.placed]
            buckets = _balance(todo, [sizes[k] for k in todo], self.threads, self.storage.max_file_bytes)
            hints = [sum(sizes[k] for k in b) for b in buckets]
        plans = [FilePlan(f"{prefix}{k}.distcp", b, hints[k]) for k, b in enumerate(buckets)]
        outs = write_files(self.storage, self.path, plans, threads=self.threads, resolve=resolve, records=records)
        files = {o.name: o.record for o in outs}
        placed: Dict[int, Tuple[str, int, int]] = {}
        for positions, o in zip(buckets, outs):
            offset = 0
            for k, length in zip(positions, o.lengths):
                placed[k] = (o.name, offset, length)
                offset += length
        if shared is not None:
            placed.update(shared.placed)
            files.update(shared.files)
        if reuse is not None and keys is not None and objs is not None:
            reuse.wrote(self.storage, self.path, placed_items(keys, objs, hashes, placed), files, shared)
        return ItemsWritten(files, placed, buckets, hints, [o.lengths for o in outs],
                            shared is not None and bool(shared.placed))

    def write_metadata(self, data: bytes, record: Optional[FileRecord] = None) -> FileRecord:
        """Write the step's ``.metadata`` (``data``: DCP's pickled ``Metadata``); its record
        (``record``: the same bytes' record, known already)."""
        self.storage.write_bytes(f"{self.path}/{METADATA_NAME}", data)
        return record if record is not None else FileRecord(len(data), crc32c(data))


# ---- the planner-free single-process save -------------------------------------------------------

@dataclasses.dataclass
class LocalSave:
    """A single-process save planned without DCP's planner (:func:`plan_local`)."""

    flat: Dict[str, Any]
    mappings: Dict[str, Tuple[Any, ...]]
    fqns: List[str]
    objs: List[Any]
    key: Tuple[Any, ...]  # what else decides the file assignment: (threads, max_file_bytes)
    layout: Optional[FileLayout]  # the remembered layout, when this save has it
    sig: Optional[List[Any]]  # the new signature (None: the remembered layout's)


def plan_local(storage: Storage, state_dict: Dict[str, Any], *, threads: int, memo: WriteMemo) -> Optional[LocalSave]:
    """The planner-free single-process save of ``state_dict``, or ``None`` where DCP's planner
    must write it (DTensors, ShardedTensors, tensor subclasses, ``Stateful`` values): decided
    before anything is written.

    Args:
        storage: the root's storage.
        state_dict: the host snapshot.
        threads: how many files are written at once.
        memo: the owner's memo of its last save's layout.

    Returns:
        The plan, or ``None``.
    """
    if any(is_stateful(value) for value in state_dict.values()):  # what dcp.save's _stateful_to_state_dict calls
        return None
    # Nothing per item outlives this save except what the layout keeps: objects alive through a
    # long write are promoted to the collector's oldest generation, and tens of thousands of them
    # per save trigger a full collection (GIL held) every save or two.
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
    return LocalSave(flat, mappings, fqns, objs, key, layout, sig)


def save_local(writer: StepWriter, plan: LocalSave, memo: WriteMemo) -> Dict[str, FileRecord]:
    """Write ``plan`` (:func:`plan_local`): what ``dcp.save`` with ``DefaultSavePlanner`` and
    :class:`~.dcp_adapters.FsspecStorageWriter` writes — the same flattened keys, the same ``Metadata`` (equal
    field by field), the same item bytes — at a fraction of the per-item cost: DCP's local and
    global planning, plan validation and per-item ``dataclasses.replace`` are a fixed cost per
    item, which dominates a state dict of many small tensors. Equal objects inside the metadata
    (dtypes' properties, shapes, zero offsets) are shared, so its pickle is smaller and quicker.

    A training loop saves the same layout again and again, so the last layout is remembered in
    ``memo``: when the keys, dtypes and shapes are unchanged and every item comes out at the same
    length, the file assignment and the pickled ``.metadata`` are reused rather than rebuilt.

    Returns:
        The step's file records (``.metadata`` included).
    """
    objs, fqns, layout, sig, mappings = plan.objs, plan.fqns, plan.layout, plan.sig, plan.mappings
    keys: Optional[List[Key]] = None
    if writer.reuse is not None:  # incremental: hash, and share what the last step holds unchanged
        keys = [item_key(fqn, (0,) * o.dim() if isinstance(o, torch.Tensor) else None) for fqn, o in zip(fqns, objs)]
    sizes = [o.numel() * o.element_size() if isinstance(o, torch.Tensor) else 1024 for o in objs] \
        if layout is None or writer.reuse is not None else []
    out = writer.write_items("__0_", len(objs), sizes, lambda k: local_data(objs[k]), keys=keys,
                             objs=objs if keys is not None else None,
                             buckets=layout.buckets if layout is not None else None,
                             hints=layout.hints if layout is not None else None)
    files = out.files
    if layout is not None and not out.shared and out.lengths == layout.lengths:  # same bytes where .metadata says
        files[METADATA_NAME] = writer.write_metadata(layout.metadata, layout.files_meta)
        return files
    # a new layout, or an object's pickle changed length: same files, new .metadata
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
    if out.shared:  # in item order, as DCP writes it
        order: List[int] = list(range(len(objs)))
    else:  # file by file, each in file order: the metadata's check reads it in one pass
        order = [k for positions in out.buckets for k in positions]
    where = {indices[k]: _StorageInfo(*out.placed[k]) for k in order}
    metadata = Metadata(state_dict_metadata=md, planner_data=mappings, storage_data=where,
                        storage_meta=StorageMeta(checkpoint_id=None, save_id=""))
    data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)  # DCP's own format
    files[METADATA_NAME] = writer.write_metadata(data)
    if out.shared:
        return files  # a layout that leaves items out is not one to write again
    if sig is None:  # the files were written with the last layout; only .metadata is new
        sig = cast(FileLayout, layout).sig  # sig is None only when the layout was kept
    memo.remember(FileLayout(plan.key, fqns, sig, mappings, out.buckets, out.hints, out.lengths, data,
                             files[METADATA_NAME]))
    return files
