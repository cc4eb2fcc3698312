"""Multi-process checkpoints: a dedicated gloo group, sharded writes, one commit by rank 0.

With ``torch.distributed`` initialised (more than one rank), every rank stages only its own
shards (DTensor / FSDP2 local shards, XLA SPMD local shards) and writes them through DCP into
one step directory; replicated tensors (DDP) are written once, by DCP's de-duplication. The
protocol of one save, run on every rank's writer thread::

    1. rank 0 opens the step (temp dir / unmarked dir)  -> broadcast of where (or why not)
    2. every rank prepares (or reports its staging error) -> all_gather of errors
    3. DCP save over the checkpoint group (DCP itself gathers every rank's write error)
    4. all_gather of (error, file records, sizes)
    5. rank 0 writes manifest + marker and decides retention -> broadcast of the outcome

Every rank reaches the same collectives in the same order whatever fails, so one rank's
failure becomes an error on every rank instead of a hang, and nothing is committed unless every
rank wrote its files. The collectives run on a gloo group of our own, created once per manager
on every rank, so checkpoint traffic never interleaves with training collectives (NCCL or gloo).
The writer thread is the only user of that group while saves are pending; ``restore`` uses it
from the calling thread after waiting for pending saves.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import errors as _errors
from .errors import CheckpointError, CorruptCheckpointError, StepNotFoundError
from .storage.manifest import FileRecord, Manifest
from .storage.layout import StepTarget

if TYPE_CHECKING:  # pragma: no cover
    from .manager import CheckpointManager
    from .staging import HostSnapshot
    from .stats import SaveStats

log = logging.getLogger("async_ckpt")

__all__ = ["CheckpointGroup", "checkpoint_group", "dcp_failure", "save_planner_for", "load_planner_for"]


# ---- the checkpoint process group ----------------------------------------------------------

class CheckpointGroup:
    """A gloo process group used only for checkpoint coordination, and this rank's place in it."""

    def __init__(self, group: Any, control: Any = None) -> None:
        import torch.distributed as dist

        self.group = group
        #: a second gloo group for the training thread's agreements (the writer thread owns
        #: ``group`` while saves are pending; two threads must never share one group).
        self.control = control
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def agree(self, flags: Sequence[bool]) -> List[bool]:
        """Rank 0's ``flags`` on every rank (training thread, over ``control``)."""
        import torch.distributed as dist

        t = torch.tensor([bool(f) for f in flags], dtype=torch.uint8)
        dist.broadcast(t, group=self.control, group_src=0)
        return [bool(v) for v in t.tolist()]

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, indexed by group rank."""
        import torch.distributed as dist

        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def checkpoint_group(process_group: Any = None) -> Optional[CheckpointGroup]:
    """A new gloo group over the ranks of ``process_group`` (default: all ranks).

    Returns ``None`` when ``torch.distributed`` is not initialised or the group has one rank
    (the single-process path applies). Collective: must be called on every rank of
    ``process_group`` (of the default group when it is ``None``), in the same order as other
    ``new_group`` calls — ``CheckpointManager`` does it in its constructor.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = None if process_group is None else sorted(dist.get_process_group_ranks(process_group))
    size = dist.get_world_size() if ranks is None else len(ranks)
    if size <= 1:
        return None

    def make() -> Any:
        if ranks is None:
            return dist.new_group(backend="gloo")
        # a subgroup: only its members take part in creating ours
        return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)

    group, control = make(), make()
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("CheckpointManager was created on a rank outside its process_group")
    return CheckpointGroup(group, control)


# ---- errors across ranks -------------------------------------------------------------------

def dcp_failure(exc: BaseException) -> BaseException:
    """The underlying error of DCP's ``CheckpointException`` (which gathers every rank's errors).

    Prefers an async_ckpt error (so a ``CorruptCheckpointError`` keeps its type), then the
    lowest rank's error; anything else is returned as is.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(exc, CheckpointException):
        return exc
    failures = [(r, f[0] if isinstance(f, tuple) else f) for r, f in sorted(exc.failures.items())]
    failures = [(r, e) for r, e in failures if isinstance(e, BaseException)]
    if not failures:
        return exc
    ours = [(r, e) for r, e in failures if isinstance(e, CheckpointError)]
    rank, err = (ours or failures)[0]
    try:
        err._async_ckpt_rank = rank  # type: ignore[attr-defined]  # for the message: who failed
    except Exception:
        pass
    return err


def _describe(rank: int, exc: BaseException) -> Tuple[str, str]:
    exc = dcp_failure(exc)
    where = getattr(exc, "_async_ckpt_rank", rank)
    return type(exc).__name__, f"rank {where}: {type(exc).__name__}: {exc}"


def _rebuild(kind: str, message: str, step: Optional[int]) -> CheckpointError:
    """An error of async_ckpt's class ``kind`` (else ``CheckpointError``) carrying ``message``."""
    cls = getattr(_errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    try:
        return cls(message, step=step)
    except TypeError:
        return CheckpointError(message, step=step)


def _raise_gathered(outcomes: Sequence[Optional[Tuple[str, str]]], step: int, what: str,
                    local: Optional[BaseException] = None) -> None:
    """Raise on every rank if any rank reported an error (this rank's own error if it has one)."""
    bad = [o for o in outcomes if o is not None]
    if not bad:
        return
    # DCP hands one rank's error to every rank: report each distinct error once.
    summary = "; ".join(dict.fromkeys(msg for _, msg in bad))
    if local is not None:
        local = dcp_failure(local)
        if isinstance(local, CheckpointError):
            if local.step is None:
                local.step = step
            raise local
        raise CheckpointError(f"step {step}: {what} failed: {summary}", step=step) from local
    kind = bad[0][0]
    raise _rebuild(kind, f"step {step}: {what} failed: {summary}", step)


# ---- saving --------------------------------------------------------------------------------

def save(mgr: "CheckpointManager", step: int, state_dict: Any, force: bool, metrics: Dict[str, float],
         wait: bool) -> bool:
    """Training thread of every rank: stage this rank's shards, queue the collective write.

    Must be called on every rank with the same ``step``; rank 0's decision (policy, ``force``,
    preemption) is taken by every rank. A rank whose staging fails raises at once and still
    queues its part of the protocol, so the other ranks raise too instead of waiting for it.
    """
    from .stats import SaveStats

    from .errors import LeaseHeldError

    w = mgr._writer
    w.raise_if_failed()
    take, preempt = mgr._decide(step, force)
    # Rank 0 decides for everyone: time-based policies, preemption signals and "nothing in
    # flight" conditions can answer differently per rank, and a save on some ranks only would
    # leave the others waiting in the protocol. Rank 0 also takes the root's writer lease.
    lease_error: Optional[BaseException] = None
    if take and mgr._dist.is_coordinator:  # type: ignore[union-attr]
        try:
            mgr._become_writer()
            mgr._warn_if_lower(step)
        except LeaseHeldError as exc:
            lease_error = exc
    take, preempt, lease_ok = mgr._dist.agree([take, preempt, lease_error is None])  # type: ignore[union-attr]
    if not take:
        return False
    if not lease_ok:
        if lease_error is not None:
            raise lease_error
        raise LeaseHeldError(f"rank 0 could not take the writer lease of {mgr.storage.url}; see rank 0's error")
    t0 = time.perf_counter()
    w.wait_for_slot()
    t1 = time.perf_counter()
    try:
        plan = mgr.stager.plan(state_dict)
        snap = mgr.stager.stage(state_dict, plan)
    except BaseException as exc:
        # (bind exc now: Python unbinds the name at the end of the except block)
        w.submit(lambda e=exc: persist(mgr, step, None, metrics, None, t0, local_error=e), step=step)
        raise
    mgr._taken(step, preempt)
    t2 = time.perf_counter()
    stats = SaveStats(step=step, nbytes=snap.nbytes, num_tensors=snap.num_tensors,
                      queue_wait_s=t1 - t0, stage_s=t2 - t1, blocking_s=t2 - t0)
    w.submit(lambda: persist(mgr, step, snap, metrics, stats, t0), step=step)
    if wait:
        w.join()
    return True


@dataclass
class _RankResult:
    error: Optional[Tuple[str, str]]
    files: Dict[str, Tuple[int, int]]
    nbytes: int
    num_tensors: int
    int_keys: List[str]


def persist(mgr: "CheckpointManager", step: int, snap: Optional["HostSnapshot"], metrics: Dict[str, float],
            stats: Optional["SaveStats"], t0: float, local_error: Optional[BaseException] = None) -> None:
    """Writer thread of every rank: the five-phase protocol described in the module docstring.

    ``local_error`` is set (and ``snap`` is ``None``) when this rank failed to stage: it still
    takes part in every collective so the other ranks fail cleanly, and raises nothing itself
    (the training thread already raised the staging error).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from .storage.dcp import FsspecStorageWriter

    cg: CheckpointGroup = mgr._dist  # type: ignore[assignment]
    target: Optional[StepTarget] = None
    committed = claimed = False
    try:
        tw = time.perf_counter()
        # 1. rank 0 opens the step; everyone learns where (or why not).
        opened: Any = None
        if cg.is_coordinator:
            try:
                mgr.catalog.begin_write(step)
                claimed = True
                target = mgr.layout.begin(step, uuid.uuid4().hex[:12])
                mgr.catalog.set_path(step, target.path)
                opened = ("ok", target.path, target.final)
            except BaseException as exc:  # noqa: BLE001 - reported to every rank
                opened = ("err",) + _describe(0, exc)
        opened = cg.broadcast(opened)
        if opened[0] != "ok":
            raise _rebuild(opened[1], f"step {step}: could not open the step directory: {opened[2]}", step)
        if not cg.is_coordinator:
            target = StepTarget(step, opened[1], opened[2])
        assert target is not None

        # 2. every rank is ready to write (or says why not).
        prep: Optional[Tuple[str, str]] = None
        if local_error is not None:
            prep = _describe(cg.rank, local_error)
        elif not cg.is_coordinator:
            try:
                mgr.storage.makedirs(target.path)
            except BaseException as exc:  # noqa: BLE001
                prep = _describe(cg.rank, exc)
                local_error = exc
        outcomes = cg.all_gather(prep)
        if local_error is not None and snap is None:
            raise _StagingAlreadyReported()  # raised to this rank's training thread already
        _raise_gathered(outcomes, step, "staging", local_error)
        assert snap is not None
        snap.drop_sources()

        # 3. DCP writes every rank's shards (its own collectives spread any write error).
        write_error: Optional[BaseException] = None
        files: Dict[str, FileRecord] = {}
        try:
            # DCP directly (not through dcp_io.save_state_dict, which unwraps DCP's errors): its
            # CheckpointException says which rank failed, for the message every rank raises.
            writer = FsspecStorageWriter(mgr.storage, target.path, threads=mgr.write_threads)
            dcp.save(snap.state_dict, storage_writer=writer, process_group=cg.group,
                     planner=save_planner_for(snap.state_dict) or DefaultSavePlanner())
            files = writer.files
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            write_error = exc
        finally:
            snap.release()
        tc = time.perf_counter()

        # 4. did every rank write? gather the file records for the manifest.
        mine = _RankResult(_describe(cg.rank, write_error) if write_error is not None else None,
                           {k: (v.size, v.crc32c) for k, v in files.items()},
                           snap.nbytes, snap.num_tensors, list(snap.int_keys))
        results: List[_RankResult] = cg.all_gather(mine)
        _raise_gathered([r.error for r in results], step, "writing", write_error)

        # 5. rank 0 commits and decides retention; everyone learns the outcome.
        done: Any = None
        if cg.is_coordinator:
            try:
                merged: Dict[str, FileRecord] = {}
                for rank, r in enumerate(results):
                    for name, (size, crc) in r.files.items():
                        if name in merged:
                            raise CheckpointError(f"step {step}: file {name} was written by two ranks", step=step)
                        merged[name] = FileRecord(size, crc)
                int_keys = sorted({k for r in results for k in r.int_keys})
                mgr._check_lease()
                manifest = Manifest(step=step, commit_time=mgr.catalog.next_commit_time(), files=merged, metrics=metrics,
                                    nbytes=sum(r.nbytes for r in results),
                                    num_tensors=sum(r.num_tensors for r in results),
                                    world_size=cg.world_size,
                                    extra={"int_keys": int_keys} if int_keys else {})
                mgr.layout.commit(target, manifest)
                committed = True
                from .policies import CheckpointInfo

                mgr.catalog.record_commit(CheckpointInfo(step, manifest.commit_time, dict(metrics), manifest.nbytes))
                mgr.catalog.end_write(step)
                claimed = False
                # decided (markers gone) before any rank's save()/join() returns
                drops = mgr._apply_retention()
                done = ("ok", manifest.commit_time, len(merged), drops)
            except BaseException as exc:  # noqa: BLE001
                done = ("err",) + _describe(0, exc)
        done = cg.broadcast(done)
        if done[0] != "ok":
            raise _rebuild(done[1], f"step {step}: commit failed: {done[2]}", step)
        td = time.perf_counter()
        _, commit_time, nfiles, drops = done
    except _StagingAlreadyReported:
        return
    finally:
        if cg.is_coordinator:
            if claimed:
                mgr.catalog.end_write(step)
            if target is not None and not committed:
                mgr.layout.abort(target)
    if stats is None:
        return
    stats.write_s, stats.commit_s, stats.durable_s = tc - tw, td - tc, td - t0
    stats.files = len(files)
    stats.commit_time = commit_time
    mgr._after_commit(stats)


class _StagingAlreadyReported(Exception):
    """Internal: this rank's staging failed and was raised to its caller; end the job quietly."""


def delete(mgr: "CheckpointManager", step: int) -> None:
    """Every rank (after ``join``): rank 0 deletes ``step`` under the writer lease; every rank
    learns the outcome."""
    cg: CheckpointGroup = mgr._dist  # type: ignore[assignment]
    outcome: Optional[Tuple[str, str]] = None
    if cg.is_coordinator:
        try:
            mgr._become_writer()
            mgr._delete_now(step)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank
            outcome = _describe(0, exc)
    outcome = cg.broadcast(outcome)
    if outcome is not None:
        raise _rebuild(outcome[0], f"step {step}: delete failed: {outcome[1]}", step)


# ---- listing and restoring -----------------------------------------------------------------

def restore(mgr: "CheckpointManager", step: Optional[int], state_dict: Dict[str, Any], verify: bool,
            allow_pickle: bool) -> int:
    """Every rank: agree on the step, check, load (DCP reshards), agree on the outcome.

    Rank 0's listing decides which steps exist. Each attempt has two phases (checks against the
    manifest and metadata; the DCP load), each followed by an exchange of outcomes, so a failure
    on one rank is seen by all of them and they all skip a damaged step or all raise.
    """
    import warnings

    cg: CheckpointGroup = mgr._dist  # type: ignore[assignment]
    steps: List[int] = cg.broadcast(mgr.catalog.steps_newest_first() if cg.is_coordinator else None)
    if step is not None:
        if step not in steps:
            listed = sorted(steps)
            raise StepNotFoundError(
                f"no committed checkpoint for step {step} under {mgr.storage.url} "
                f"(committed: {listed if len(listed) <= 20 else listed[-20:]})", step=step)
        candidates = [step]
    else:
        if not steps:
            raise StepNotFoundError(f"no committed checkpoint under {mgr.storage.url}")
        candidates = list(steps)
    errors: List[CheckpointError] = []
    for s in candidates:
        try:
            _restore_one(mgr, cg, s, state_dict, verify, allow_pickle)
        except CorruptCheckpointError as exc:
            if step is not None:
                raise
            warnings.warn(f"async_ckpt: skipping damaged step {s}: {exc}", RuntimeWarning, stacklevel=3)
            errors.append(exc)
            continue
        return s
    raise CorruptCheckpointError(
        f"no committed step under {mgr.storage.url} passed verification; newest error: {errors[0]}",
        step=steps[0]) from errors[0]


def _restore_one(mgr: "CheckpointManager", cg: CheckpointGroup, step: int, state_dict: Dict[str, Any],
                 verify: bool, allow_pickle: bool) -> None:
    from .manager import _prepare_target
    import torch.distributed.checkpoint as dcp

    from .storage.dcp import METADATA_NAME, FsspecStorageReader
    from .storage.dcp.safety import _SafeLoadPlanner

    added: List[tuple] = []
    local: Optional[BaseException] = None
    manifest = metadata = None
    path = mgr.layout.step_dir(step)
    try:
        path, manifest = mgr.layout.open_step(step)
        if METADATA_NAME not in manifest.files:
            raise CorruptCheckpointError(f"step {step}: manifest lists no {METADATA_NAME}", step=step, path=path)
        reader = FsspecStorageReader(mgr.storage, path, files=manifest.files, verify=verify,
                                     threads=mgr.write_threads)
        metadata = reader.read_metadata()
        added = _prepare_target(state_dict, metadata, step, set(manifest.extra.get("int_keys", ())))
    except BaseException as exc:  # noqa: BLE001 - exchanged below
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        local = exc
    _agree_or_undo(cg, step, "restore checks", local, state_dict, added)
    assert manifest is not None
    try:
        reader = FsspecStorageReader(mgr.storage, path, files=manifest.files, verify=verify,
                                     threads=mgr.write_threads, metadata=metadata)
        dcp.load(state_dict, storage_reader=reader, process_group=cg.group,
                 planner=load_planner_for(state_dict, allow_pickle) or _SafeLoadPlanner(allow_pickle))
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        local = exc
    _agree_or_undo(cg, step, "restore", local, state_dict, added)


def _agree_or_undo(cg: Any, step: int, what: str, local: Optional[BaseException],
                   state_dict: Dict[str, Any], added: List[tuple]) -> None:
    """Every rank learns every rank's outcome of ``what``; on any failure, all raise and take
    out the entries this restore added to ``state_dict``."""
    from .manager import _remove_added

    outcomes = cg.all_gather(None if local is None else _describe(cg.rank, local))
    try:
        _raise_gathered(outcomes, step, what, local)
    except BaseException:
        _remove_added(state_dict, added)
        raise


# ---- XLA SPMD ------------------------------------------------------------------------------

def _cpu_shards_type() -> Optional[type]:
    import sys

    if "torch_xla" not in sys.modules:  # no XLA tensors without torch_xla: do not import it
        return None
    try:
        from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards
    except Exception:
        return None
    return _CpuShards


def _leaves(tree: Any):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def has_xla_shards(state_dict: Any) -> bool:
    """Whether a host snapshot holds staged XLA SPMD shards (torch_xla's ``_CpuShards``)."""
    cls = _cpu_shards_type()
    return cls is not None and any(isinstance(v, cls) for v in _leaves(state_dict))


def xla_sharded(items: List[Tuple[int, torch.Tensor]]) -> List[Tuple[int, torch.Tensor]]:
    """The ``(index, tensor)`` pairs whose tensor is SPMD-sharded (see :func:`is_xla_sharded`).

    Only SPMD mode (``xr.use_spmd()``) can shard a tensor: outside it, a state dict of many
    tensors skips the per-tensor query altogether.
    """
    try:
        import torch_xla.runtime as xr

        spmd = bool(xr.is_spmd())
    except Exception:
        spmd = False
    return [(i, t) for i, t in items if is_xla_sharded(t)] if spmd else []


def is_xla_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is an XLA tensor split over several devices by ``mark_sharding``."""
    if t.device.type != "xla":
        return False
    try:
        import torch_xla
        import torch_xla.distributed.spmd as xs

        kind = torch_xla._XLAC._get_xla_sharding_type(t)
    except Exception:
        return False
    return kind is not None and kind != xs.ShardingType.REPLICATED


def stage_xla_shards(tensors: List[torch.Tensor]) -> List[Any]:
    """Host copies of the local shards of SPMD-sharded XLA tensors, one replica of each shard.

    Returns torch_xla's ``_CpuShards`` (shards with their global indices), which torch_xla's
    ``SPMDSavePlanner`` writes as DCP chunks.
    """
    from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards, _cpu_shards_from_tensors

    out = []
    for cs in _cpu_shards_from_tensors(list(tensors)):
        # Keep one copy of each distinct shard: the replica 0 of a shard lives on exactly one
        # device in the whole job, so every shard is written once, by the host that holds it.
        uniq = [s for s in cs.shards if s.replica_id == 0]
        out.append(_CpuShards(shards=uniq, global_shape=cs.global_shape))
    return out


def save_planner_for(state_dict: Any) -> Any:
    """The DCP save planner for a host snapshot: torch_xla's for staged SPMD shards, else ``None``."""
    if not has_xla_shards(state_dict):
        return None
    import warnings

    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class _Planner(SPMDSavePlanner):
        def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                super().set_up_planner(state_dict, is_coordinator)

    return _Planner()


def load_planner_for(state_dict: Any, allow_pickle: bool) -> Any:
    """The DCP load planner for a restore target: torch_xla's for SPMD-sharded XLA tensors, else ``None``."""
    if not any(isinstance(v, torch.Tensor) and is_xla_sharded(v) for v in _leaves(state_dict)):
        return None
    import io
    import pickle

    from torch.distributed.checkpoint._traverse import set_element
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    from .errors import UnsafeCheckpointError

    class _Planner(SPMDLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=not allow_pickle)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointError(
                    f"{read_item.dest_index.fqn}: refusing to unpickle an object outside torch's safe set "
                    f"({exc}); pass allow_pickle=True to restore if you trust this checkpoint") from exc
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    return _Planner()
