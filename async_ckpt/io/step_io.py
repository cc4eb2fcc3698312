"""One step's files written and read: the choice of data path, in one place.

:func:`write_step` writes this rank's part of a step: one process through async_ckpt's own
DCP-format writer (no planner round trips, the layout remembered in a ``memo``:
:func:`~.write.plan_local` says whether it applies, before anything is written), several (or a
custom planner) through ``dcp.save`` over the checkpoint group (which de-duplicates replicated
tensors); either way :class:`~.write.StepWriter` writes the files.

:func:`read_step` reads a step into a target in place:

* several ranks: ``dcp.load`` over the group; each rank reads and verifies what its plan needs,
  the ranks exchange their outcomes (``agree``) and only then does any rank write;
* straight into the target tensors (:func:`~.read_targets.read_direct`), unless a custom
  ``planner`` or a target it does not handle (:func:`~.read_targets.plan_direct`, asked once,
  before anything is read) sends it to DCP's reader (:func:`~.dcp_adapters.load_state_dict`);
* ``atomic``: every data file read and verified into host buffers first
  (:func:`~.read_targets.staged`), then read from there into the target the same way.

A failure after the first write into the target is a
:class:`~async_ckpt.errors.PartlyWrittenError` (raised by the path that wrote).
"""

from __future__ import annotations

from typing import AbstractSet, Any, Callable, Dict, Optional

from ..format.dcp_layout import WriteMemo
from ..format.manifest import FileRecord
from ..options import RestoreOptions
from ..storage.storage import Storage
from .dcp_adapters import FsspecStorageReader, FsspecStorageWriter, load_state_dict, safe_planner
from .dcp_call import call_dcp, distributed, unwrap_dcp
from .read_targets import partly_written, plan_direct, read_direct, staged
from .reuse import Reuse
from .write import StepWriter, plan_local, save_local


def write_step(storage: Storage, path: str, state_dict: Dict[str, Any], *, threads: int, planner: Any,
               memo: Optional[WriteMemo] = None, reuse: Optional[Reuse] = None, group: Any = None,
               several_ranks: bool = False
               ) -> Dict[str, FileRecord]:
    """Write this rank's files of a step into ``path``.

    Args:
        storage: the root's storage.
        path: the step's (temporary) directory.
        state_dict: what to write (a host snapshot).
        threads: how many files are written at once.
        planner: a DCP save planner, or ``None``.
        memo: the root's memo of its last save: one process, the file layout, reused by a
            save of the same shape.
        reuse: incremental saves: what the last committed step holds (a save shares what did
            not change); ``None``: the save is whole.
        group: the process group DCP runs over (one process: a one-rank group or ``None``).
        several_ranks: every rank of ``group`` writes its part through ``dcp.save``.

    Returns:
        The records of the files this rank wrote.

    Raises:
        Exception: what the write raised; with ``several_ranks``, DCP's ``CheckpointException``
            (its collectives report one rank's failure to every rank, so every rank raises it).
    """
    memo = memo if memo is not None else WriteMemo()  # (None: nothing reused or remembered)
    local = None if several_ranks or planner is not None else plan_local(storage, state_dict, threads=threads,
                                                                         memo=memo)
    if local is not None:  # one process, plain tensors and objects: without DCP's planner
        return save_local(StepWriter(storage, path, threads=threads, reuse=reuse), local, memo)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = FsspecStorageWriter(storage, path, threads=threads, reuse=reuse)
    if several_ranks:  # DCP's collectives report one rank's failure on every rank (CheckpointException)
        dcp.save(state_dict, storage_writer=writer, process_group=group, planner=planner or DefaultSavePlanner())
    else:
        call_dcp(lambda: dcp.save(state_dict, storage_writer=writer, planner=planner or DefaultSavePlanner(),
                                  process_group=group, no_dist=not distributed()))
    return writer.files


def save_state_dict(storage: Storage, path: str, state_dict: Dict[str, Any], *, threads: int = 8,
                    process_group: Any = None, planner: Any = None, memo: Optional[WriteMemo] = None,
                    reuse: Optional[Reuse] = None) -> Dict[str, FileRecord]:
    """Write ``state_dict`` (host tensors) as a DCP checkpoint under ``path`` from this one
    process; return the file records (:func:`write_step` of one process).

    ``planner`` defaults to DCP's ``DefaultSavePlanner`` (torch_xla's for staged SPMD shards).
    ``memo``: the owner's :class:`~async_ckpt.format.dcp_layout.WriteMemo`, for a save to reuse
    the layout of the last save through it; ``None``: nothing is reused or remembered.
    """
    return write_step(storage, path, state_dict, threads=threads, planner=planner, memo=memo, reuse=reuse,
                      group=process_group)


def read_step(storage: Storage, path: str, state_dict: Dict[str, Any], *, files: Optional[Dict[str, FileRecord]],
              metadata: Any, opts: RestoreOptions, group: Any = None,
              agree: Optional[Callable[[Optional[BaseException]], Any]] = None,
              skip: Optional[AbstractSet[str]] = None) -> None:
    """Read a step into ``state_dict`` in place, by the data path that fits (module docstring).

    Args:
        storage: the root's storage.
        path: the step directory.
        state_dict: the target.
        files: the manifest's file records (sizes, checksums); None for a plain DCP checkpoint
            (another program's: read through DCP's reader, sizes checked against ``.metadata``).
        metadata: the step's checked DCP metadata.
        opts: how it reads (``verify``, ``threads``, ``allow_pickle``, a custom ``planner``,
            ``atomic``: every file verified before the first write, one process; several ranks
            always verify before writing; ``strict``; ``pool``: where ``atomic``'s host buffers
            come from, within its budget).
        group: the process group DCP runs over.
        agree: several ranks: exchanges this rank's read outcome (None, or its error) with
            every rank's and raises on every rank when any rank's failed (a phase over
            ``group``); ``None`` for one process.
        skip: several ranks: flattened keys this rank does not read (another rank reads them
            and sends them; see :mod:`async_ckpt.ranks.replicas`).

    Raises:
        CorruptCheckpointError: damaged data, found before anything was written.
        StagingBudgetError: ``atomic`` over a ``budget`` too small, before anything was read.
        PartlyWrittenError: a failure after the target was written into.
    """
    verify, threads, allow_pickle, planner = opts.verify, opts.threads, opts.allow_pickle, opts.planner
    if agree is not None:
        import torch.distributed.checkpoint as dcp

        reader = FsspecStorageReader(storage, path, files=files, verify=verify, threads=threads, metadata=metadata,
                                     agree=agree)
        try:
            dcp.load(state_dict, storage_reader=reader, process_group=group,
                     planner=planner or safe_planner(allow_pickle, opts.strict, skip))
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
            if not reader.touched or isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            _, err = unwrap_dcp(exc)
            raise partly_written(path, err) from exc
        return
    # one process: straight into the targets where the direct path handles them, else DCP's reader
    if files is None:  # a plain DCP checkpoint (another program's): DCP's reader reads every file before a write
        load_state_dict(storage, path, state_dict, files=None, verify=verify, threads=threads,
                        allow_pickle=allow_pickle, metadata=metadata, planner=planner, strict=opts.strict,
                        process_group=group)
        return
    known = metadata is not None
    plan = plan_direct(state_dict, files, metadata, local=opts.atomic or storage.is_local, cast=opts.cast) \
        if planner is None and known else None
    if opts.atomic and known:
        pool = opts.pool
        with staged(storage, path, files=files, metadata=metadata, verify=verify, threads=threads,
                    acquire=None if pool is None else pool.leaser(),
                    budget=None if pool is None else pool.budget_bytes) as in_memory:  # verified before any write
            if plan is not None:
                read_direct(in_memory, path, state_dict, plan, files=files, verify=False, threads=threads,
                            allow_pickle=allow_pickle, staged=True)
            else:
                load_state_dict(in_memory, path, state_dict, files=files, verify=False, threads=threads,
                                allow_pickle=allow_pickle, metadata=metadata, planner=planner, strict=opts.strict,
                                process_group=group)
        return
    if plan is not None:
        read_direct(storage, path, state_dict, plan, files=files, verify=verify, threads=threads,
                    allow_pickle=allow_pickle)
        return
    load_state_dict(storage, path, state_dict, files=files, verify=verify, threads=threads,
                    allow_pickle=allow_pickle, metadata=metadata, planner=planner, strict=opts.strict,
                    process_group=group)
