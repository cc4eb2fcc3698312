"""Worker for tests/ranks/test_replicated.py (issue 28: replicated state staged, written and read once),
launched with torchrun (gloo, CPU):

    torchrun --standalone --nproc-per-node 2 tests/workers/replicated_worker.py save2    <base>
    torchrun --standalone --nproc-per-node 4 tests/workers/replicated_worker.py main4    <base>
    torchrun --standalone --nproc-per-node 2 tests/workers/replicated_worker.py restore2 <base>

and, without torchrun (a rank that dies must not take the others down with it):

    RANK=r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python replicated_worker.py death-<how> <base>

All checkpoints live under ``<base>``: ``save2`` writes the 2-rank ones (``ddp2``, ``fsdp2``),
``main4`` restores them at 4 ranks and writes the 4-rank ones (``ddp4``, ``fsdp4``, ``hsdp4``,
``tiers4``), ``restore2`` restores those at 2 ranks; the test restores them in one process.

Each check runs on its own and prints ``<NAME> RANK <r> OK`` or ``<NAME> RANK <r> FAILED: ...``
(a failed check does not hide the next); lines ``STATS <name> <json>`` report what rank 0
gathered. The ``death-*`` mode prints ``RAISED <seconds> <type> <message>`` on the surviving ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List

import fsspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from async_ckpt import CheckpointError, CheckpointManager, CorruptCheckpointError  # noqa: E402
from async_ckpt.format.unpickling import load_metadata
from async_ckpt.testing import lazy_cpu_copies  # noqa: E402
from tests.support.damage import flip_byte  # noqa: E402
from tests.support.faulty_fs import FaultyFileSystem  # noqa: E402
from tests.support.tree import assert_bitwise_equal  # noqa: E402
from tests.workers.dist_worker import build, full, train  # noqa: E402

KIB = 1024
#: each of the 4 replicated model tensors: 256 KiB (float32, bfloat16, float64, int64)
REPLICATED_BYTES = 4 * 256 * KIB
#: each rank's own tensor ("rank<r>.x"): 16 KiB, under the 64 KiB threshold (always staged by its rank)
OWN_BYTES = 16 * KIB
DEATH_TIMEOUT_S = 10.0


# ---- a filesystem that counts the bytes read ---------------------------------------------------

#: bytes returned by reads through ``countfs://`` in this process, per file base name
READS: Dict[str, int] = {}


class _CountedFile:
    def __init__(self, f: Any, name: str) -> None:
        self._f, self._name = f, name

    def read(self, *args: Any) -> bytes:
        data = self._f.read(*args)
        READS[self._name] = READS.get(self._name, 0) + len(data)
        return data

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        READS[self._name] = READS.get(self._name, 0) + (n or 0)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> "_CountedFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


class CountingFileSystem(FaultyFileSystem):
    """``countfs:///abs/path``: the local files at ``/abs/path`` through fsspec (not a
    ``LocalFileSystem``, so async_ckpt treats it like an object store), counting in
    :data:`READS` every byte a read returns."""

    protocol = "countfs"

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        data = super().cat_file(path, start=start, end=end, **kwargs)
        name = path.rstrip("/").rsplit("/", 1)[-1]
        READS[name] = READS.get(name, 0) + len(data)
        return data

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        f = super()._open(path, mode, *args, **kwargs)
        if "r" in mode:
            return _CountedFile(f, path.rstrip("/").rsplit("/", 1)[-1])
        return f


fsspec.register_implementation("countfs", CountingFileSystem, clobber=True)


def data_read() -> int:
    """Bytes read from data files (``*.distcp``) through ``countfs://`` in this process."""
    return sum(n for name, n in READS.items() if name.endswith(".distcp"))


# ---- state dicts ---------------------------------------------------------------------------------

def ddp_model(step: int) -> Dict[str, torch.Tensor]:
    """The replicated model of a DDP-style state: 4 tensors of 256 KiB, one per dtype."""
    g = torch.Generator().manual_seed(step)
    return {"w0": torch.randn(256, 256, generator=g),
            "w1": torch.randn(512, 256, generator=g).to(torch.bfloat16),
            "w2": torch.randn(128, 256, generator=g, dtype=torch.float64),
            "w3": torch.randint(-(2**62), 2**62, (128, 256), generator=g)}


def own(step: int, rank: int) -> torch.Tensor:
    return torch.randn(OWN_BYTES // 4, generator=torch.Generator().manual_seed(1000 * step + rank))


def ddp_state(step: int, rank: int) -> Dict[str, Any]:
    """A DDP-style state dict: the model (the same on every rank), ``rank<r>.x`` (this rank's
    only) and a non-tensor ``step``. A job of more ranks than the one that saved restores
    ``ddp_state(step, rank % saved_world)``."""
    return {"model": ddp_model(step), f"rank{rank}": {"x": own(step, rank)}, "step": step}


def ddp_state_bytes(world: int) -> int:
    """The tensor bytes of a DDP-style checkpoint of ``world`` ranks (each byte once)."""
    return REPLICATED_BYTES + world * OWN_BYTES


def blank(tree: Any) -> Any:
    """A restore target like ``tree`` holding other values (tensors of 7, ints -1)."""
    if isinstance(tree, torch.Tensor):
        return torch.full_like(tree, 7)
    if isinstance(tree, dict):
        return {k: blank(v) for k, v in tree.items()}
    if isinstance(tree, int):
        return -1
    return tree


def hsdp_full(step: int) -> Dict[str, Any]:
    """The full tensors of the HSDP-style state: ``w`` (512 KiB, float32), ``v`` (256 KiB,
    bfloat16), ``b`` (a small one) and ``step``."""
    g = torch.Generator().manual_seed(500 + step)
    return {"w": torch.randn(128, 1024, generator=g), "v": torch.randn(64, 2048, generator=g).to(torch.bfloat16),
            "b": torch.randn(100, generator=g), "step": step}


HSDP_BIG_BYTES = 128 * 1024 * 4 + 64 * 2048 * 2  # w and v: chunks of 256 and 128 KiB
HSDP_SMALL_BYTES = 100 * 4  # b: under the threshold, staged by every rank


def hsdp_mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def hsdp_state(values: Dict[str, Any], mesh) -> Dict[str, Any]:
    """``values`` as DTensors on the 2x2 mesh: ``w`` and ``v`` (Replicate(), Shard(0)), ``b``
    replicated on both dims."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out: Dict[str, Any] = {}
    for k, v in values.items():
        if k in ("w", "v"):
            out[k] = distribute_tensor(v, mesh, [Replicate(), Shard(0)])
        elif k == "b":
            out[k] = distribute_tensor(v, mesh, [Replicate(), Replicate()])
        else:
            out[k] = v
    return out


def local_view(tree: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in tree.items()}


# ---- helpers ---------------------------------------------------------------------------------------

def gather(value: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def report(name: str, value: Any) -> None:
    if dist.get_rank() == 0:
        print(f"STATS {name} {json.dumps(value)}", flush=True)


def expect_error(fn: Callable[[], Any], cls: type, *needles: str) -> BaseException:
    try:
        fn()
    except cls as exc:
        for n in needles:
            assert n in str(exc), f"{n!r} not in {exc}"
        return exc
    raise AssertionError(f"expected {cls.__name__}")


def check_staged_once(name: str, nbytes: List[int], unique: int, small_everywhere: int = 0) -> None:
    """Each replicated byte staged by one rank: the ranks' ``nbytes`` sum to the state's bytes
    (within 5%, plus ``small_everywhere``: bytes every rank stages), and are balanced."""
    total = sum(nbytes)
    report(name, {"nbytes": nbytes, "unique": unique})
    assert unique <= total <= 1.05 * unique + small_everywhere, \
        f"{name}: the ranks staged {total} bytes in all ({nbytes}) for a state of {unique} bytes"
    assert max(nbytes) <= 2 * min(nbytes), f"{name}: unbalanced shares {nbytes}"


def data_bytes(step_dir: str) -> int:
    """The bytes of a step's data files (``*.distcp``) on disk."""
    return sum(os.path.getsize(os.path.join(step_dir, n)) for n in os.listdir(step_dir) if n.endswith(".distcp"))


# ---- checks: DDP-style state ------------------------------------------------------------------

def ddp_save(base: str) -> None:
    """Save the DDP-style state (steps 1, 2) at this world size into ``<base>/ddp<world>``:
    each replicated byte is staged once across the ranks, balanced; the data files hold the
    state once; restores at the same world size are bitwise (auto, once, every_rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(base, f"ddp{world}")
    with CheckpointManager(root) as mgr:
        for step in (1, 2):
            assert mgr.save(step, ddp_state(step, rank))
            st = mgr.stats[-1]
            assert st.step == step, st
            check_staged_once(f"ddp{world}.step{step}", gather(st.nbytes), ddp_state_bytes(world))
            written = gather(st.written_bytes)
            files = data_bytes(os.path.join(root, str(step)))
            report(f"ddp{world}.step{step}.written", {"written_bytes": written, "data_files": files})
            # the data files hold each byte once (plus DCP's small framing), not world times
            assert ddp_state_bytes(world) <= files <= 1.05 * ddp_state_bytes(world) + 64 * KIB, files
            assert files <= sum(written) <= files + 256 * KIB * world, (written, files)
    for mode in ("auto", "once", "every_rank"):
        with CheckpointManager(root, replicated_reads=mode) as mgr:
            for step in (2, 1):
                target = blank(ddp_state(0, rank))
                assert mgr.restore(step, target) == step
                assert_bitwise_equal(target, ddp_state(step, rank))


def ddp_legacy(base: str) -> None:
    """``replicated_saves=False`` (the behaviour before issue 28): every rank stages its whole
    state; the checkpoint is the same and restores bitwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(base, f"ddp{world}_legacy")
    with CheckpointManager(root, replicated_saves=False) as mgr:
        assert mgr.save(1, ddp_state(1, rank))
        nbytes = gather(mgr.stats[-1].nbytes)
        report(f"ddp{world}_legacy", nbytes)
        assert nbytes == [REPLICATED_BYTES + OWN_BYTES] * world, nbytes
        assert data_bytes(os.path.join(root, "1")) <= 1.05 * ddp_state_bytes(world) + 64 * KIB
        target = blank(ddp_state(0, rank))
        assert mgr.restore(1, target) == 1
        assert_bitwise_equal(target, ddp_state(1, rank))


def ddp_restore_from(base: str, saved_world: int) -> None:
    """Restore ``<base>/ddp<saved_world>`` at this world size, bitwise (rank r's target: the
    model and ``rank<r % saved_world>.x``, which the saving job's rank of that number wrote)."""
    rank = dist.get_rank() % saved_world
    for mode in ("auto", "once"):
        with CheckpointManager(os.path.join(base, f"ddp{saved_world}"), replicated_reads=mode) as mgr:
            assert mgr.all_steps() == [1, 2], mgr.all_steps()
            for step in (2, 1):
                target = blank(ddp_state(0, rank))
                assert mgr.restore(step, target) == step
                assert_bitwise_equal(target, ddp_state(step, rank))


def structure_changes(base: str) -> None:
    """The ranks' agreement on who stages what follows the state dict's structure: a key added,
    a shape changed, a key held by 2 of the 4 ranks only; every step restores bitwise and each
    replicated byte is staged once."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def state(step: int, variant: int) -> Dict[str, Any]:
        sd = ddp_state(step, rank)
        g = torch.Generator().manual_seed(77 + step)
        if variant >= 1:  # one more replicated tensor (128 KiB)
            sd["model"]["extra"] = torch.randn(32768, generator=g)
        if variant >= 2:  # a shape changes (same bytes), and a key held by a pair of ranks only
            sd["model"]["w0"] = sd["model"]["w0"].reshape(128, 512)
            pair = rank // 2
            sd[f"pair{pair}"] = {"y": torch.randn(32768, generator=torch.Generator().manual_seed(900 + 10 * step + pair))}
        return sd

    extra_bytes = {0: 0, 1: 128 * KIB, 2: 128 * KIB + (world // 2) * 128 * KIB}
    plan = [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2), (7, 0)]
    with CheckpointManager(os.path.join(base, f"structure{world}")) as mgr:
        for step, variant in plan:
            assert mgr.save(step, state(step, variant))
            check_staged_once(f"structure{world}.step{step}", gather(mgr.stats[-1].nbytes),
                              ddp_state_bytes(world) + extra_bytes[variant])
        for step, variant in plan:
            target = blank(state(0, variant))
            assert mgr.restore(step, target) == step
            assert_bitwise_equal(target, state(step, variant))


# ---- checks: FSDP2 and HSDP ---------------------------------------------------------------------

def fsdp_save(base: str) -> None:
    """FSDP2 (fully_shard over every rank): save, then restore bitwise at the same world size
    into a model of another init; rank 0 writes the full state to ``<base>/fsdp<world>_ref.pt``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(base, f"fsdp{world}")
    model, optim = build(seed=0)
    train(model, optim, 2, rank)
    msd, osd = get_state_dict(model, optim)
    with CheckpointManager(root) as mgr:
        assert mgr.save(1, {"model": msd, "optim": osd})
    ref = full(model, optim)
    if rank == 0:
        torch.save(ref, os.path.join(base, f"fsdp{world}_ref.pt"))
    fsdp_restore_from(base, world, ref if rank == 0 else None)


def fsdp_restore_from(base: str, saved_world: int, ref: Any = None) -> None:
    """Restore ``<base>/fsdp<saved_world>`` into a fresh FSDP2 model at this world size, bitwise
    against the saving job's full state."""
    rank = dist.get_rank()
    model, optim = build(seed=1)
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    with CheckpointManager(os.path.join(base, f"fsdp{saved_world}"), replicated_reads="once") as mgr:
        assert mgr.restore(1, sd) == 1
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = full(model, optim)  # collective; the full tensors land on rank 0
    if rank == 0:
        if ref is None:
            ref = torch.load(os.path.join(base, f"fsdp{saved_world}_ref.pt"), weights_only=True)
        assert got["model"] and got["optim"]["state"]
        assert_bitwise_equal(got, ref)


def hsdp_save(base: str) -> None:
    """A 2x2 HSDP-style mesh (Replicate(), Shard(0)): each chunk is held by 2 ranks and staged by
    one; restores bitwise at the same world size (auto and once)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    mesh = hsdp_mesh()
    root = os.path.join(base, "hsdp4")
    with CheckpointManager(root) as mgr:
        for step in (1, 2):
            assert mgr.save(step, hsdp_state(hsdp_full(step), mesh))
            check_staged_once(f"hsdp4.step{step}", gather(mgr.stats[-1].nbytes), HSDP_BIG_BYTES,
                              small_everywhere=world * HSDP_SMALL_BYTES)
    for mode in ("auto", "once"):
        with CheckpointManager(root, replicated_reads=mode) as mgr:
            for step in (2, 1):
                target = hsdp_state(blank(hsdp_full(0)), mesh)
                assert mgr.restore(step, target) == step
                assert_bitwise_equal(local_view(target), local_view(hsdp_state(hsdp_full(step), mesh)))


def hsdp_restore_1d(base: str) -> None:
    """The 2x2 HSDP checkpoint restores into DTensors sharded on a 1-D mesh of this world size
    (Shard(0) for every tensor), bitwise."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded(values: Dict[str, Any]) -> Dict[str, Any]:
        return {k: distribute_tensor(v, mesh, [Shard(0)]) if isinstance(v, torch.Tensor) else v
                for k, v in values.items()}

    with CheckpointManager(os.path.join(base, "hsdp4"), replicated_reads="once") as mgr:
        for step in (1, 2):
            target = sharded(blank(hsdp_full(0)))
            assert mgr.restore(step, target) == step
            got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in target.items()}
            assert_bitwise_equal(got, hsdp_full(step))


# ---- checks: reads counted, damage, local tier -----------------------------------------------------

def counted_reads(base: str) -> None:
    """Restore from a root whose reads are counted (``countfs://``): with ``once`` (and ``auto``,
    not a local POSIX path) the ranks together read the data files' bytes about once; with
    ``every_rank`` each rank reads the replicated tensors itself."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(base, f"counted{world}")
    root = "countfs://" + path
    with CheckpointManager(root) as mgr:
        assert mgr.save(1, ddp_state(1, rank))
    data = data_bytes(os.path.join(path, "1"))
    totals = {}
    for mode in ("every_rank", "once", "auto"):
        with CheckpointManager(root, replicated_reads=mode) as mgr:
            dist.barrier()
            READS.clear()
            target = blank(ddp_state(0, rank))
            assert mgr.restore(1, target) == 1
            mine = data_read()
            assert_bitwise_equal(target, ddp_state(1, rank))
        totals[mode] = gather(mine)
    report(f"counted{world}", {"data_bytes": data, "reads": totals})
    every = sum(totals["every_rank"])
    # the counter sees every rank's reads: with every_rank, each rank read the replicated model
    assert every >= 0.95 * world * REPLICATED_BYTES, (every, totals)
    for mode in ("once", "auto"):
        assert data * 0.95 <= sum(totals[mode]) <= 1.05 * data, (mode, data, totals)


def damaged_replicated(base: str) -> None:
    """A flipped byte in a replicated record (``model.w1``) of step 2, read by one rank with
    ``once``: restore(2) raises CorruptCheckpointError on every rank; restore(None) falls back
    to step 1 on every rank together, bitwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(base, f"damaged{world}")
    with CheckpointManager(root) as mgr:
        assert mgr.save(1, ddp_state(1, rank)) and mgr.save(2, ddp_state(2, rank))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, "2", ".metadata"), "rb") as f:
            md = load_metadata(f.read())
        infos = [i for x, i in md.storage_data.items() if x.fqn == "model.w1"]
        assert len(infos) == 1, infos  # one record, written once
        info = infos[0]
        flip_byte(os.path.join(root, "2", info.relative_path), at=info.offset + info.length // 2, mask=0x10)
    dist.barrier()
    for mode in ("once", "every_rank"):
        with CheckpointManager(root, replicated_reads=mode) as mgr:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exc = expect_error(lambda: mgr.restore(2, blank(ddp_state(0, rank))), CorruptCheckpointError)
                assert exc.step == 2, exc.step
                target = blank(ddp_state(0, rank))
                got = mgr.restore(None, target)
            assert gather(got) == [1] * world, (mode, gather(got))
            assert_bitwise_equal(target, ddp_state(1, rank))


def local_tier(base: str) -> None:
    """With a local tier due every 2nd step: a save due for the persistent root only stages each
    replicated byte once; a save due for the local tier too stages everything on every rank
    (each rank's local copy restores it by itself: checked by the test in one process)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bucket, local = os.path.join(base, f"tiers{world}"), os.path.join(base, f"tiers{world}_local")
    with CheckpointManager(bucket, save_interval=1, local_dir=local, local_policy=2) as mgr:
        assert mgr.save(1, ddp_state(1, rank))
        check_staged_once(f"tiers{world}.step1", gather(mgr.stats[-1].nbytes), ddp_state_bytes(world))
        assert mgr.save(2, ddp_state(2, rank))
        nbytes = gather(max(s.nbytes for s in mgr.stats if s.step == 2))
        report(f"tiers{world}.step2", nbytes)
        assert nbytes == [REPLICATED_BYTES + OWN_BYTES] * world, nbytes
        assert mgr.step_tiers().get(2) == ("local", "persistent"), mgr.step_tiers()
        for step in (2, 1):
            target = blank(ddp_state(0, rank))
            assert mgr.restore(step, target) == step
            assert_bitwise_equal(target, ddp_state(step, rank))


# ---- checks: edge cases of the agreement and the transfer -------------------------------------

def odd_state(step: int) -> Dict[str, Any]:
    """Replicated tensors of several dtypes whose byte counts are not multiples of the next one's
    element size (packed back to back, the next one starts misaligned), each >= 64 KiB."""
    g = torch.Generator().manual_seed(300 + step)
    return {"a_f32_odd": torch.randn(16385, generator=g),  # 65,540 bytes
            "b_f64": torch.randn(8193, generator=g, dtype=torch.float64),
            "c_bool_odd": torch.rand(65537, generator=g) > 0.5,
            "d_c64": torch.randn(8200, generator=g, dtype=torch.complex64),
            "e_f16_odd": torch.randn(32769, generator=g).to(torch.float16),
            "f_i16": torch.randint(-(2**15), 2**15, (40000,), generator=g, dtype=torch.int16),
            "g_u8_odd": torch.randint(0, 256, (70001,), generator=g, dtype=torch.uint8),
            "h_i64": torch.randint(-(2**62), 2**62, (8200,), generator=g),
            "step": step}


def odd_sizes(base: str) -> None:
    """Replicated tensors of mixed dtypes and odd byte counts save and restore bitwise with
    ``once`` (the transfer packs each reading rank's tensors into one buffer) and ``every_rank``."""
    world = dist.get_world_size()
    root = os.path.join(base, f"odd{world}")
    with CheckpointManager(root) as mgr:
        assert mgr.save(1, odd_state(1))
    for mode in ("once", "every_rank"):
        with CheckpointManager(root, replicated_reads=mode, collective_timeout_s=20) as mgr:
            target = blank(odd_state(0))
            assert mgr.restore(1, target) == 1, mode
            assert_bitwise_equal(target, odd_state(1))


def strided(step: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(400 + step)
    return {"t": torch.randn(512, 256, generator=g).t(),  # (256, 512), a transposed view
            "s": torch.randn(256, 1024, generator=g)[:, ::2],  # (256, 512), every other column
            "c": torch.randn(256, 512, generator=g)}


def strided_targets(base: str) -> None:
    """Non-contiguous replicated tensors (a transposed view, a strided slice) save and restore
    bitwise into non-contiguous targets of the same kind, with ``once`` and ``every_rank``,
    writing nothing outside them."""
    world = dist.get_world_size()
    root = os.path.join(base, f"strided{world}")
    with CheckpointManager(root) as mgr:
        assert mgr.save(1, strided(1))
    for mode in ("once", "every_rank"):
        with CheckpointManager(root, replicated_reads=mode, collective_timeout_s=20) as mgr:
            t_store, s_store = torch.zeros(512, 256), torch.zeros(256, 1024)
            target = {"t": t_store.t(), "s": s_store[:, ::2], "c": torch.zeros(256, 512)}
            assert mgr.restore(1, target) == 1, mode
            want = strided(1)
            assert torch.equal(t_store.t(), want["t"]) and torch.equal(s_store[:, ::2], want["s"]), mode
            assert torch.equal(target["c"], want["c"]), mode
            assert not s_store[:, 1::2].any(), f"{mode}: wrote outside the strided target"


def threshold(base: str) -> None:
    """A replicated tensor of exactly 64 KiB is staged by one rank; one of 64 KiB - 4 bytes by
    every rank (DCP still writes it once); both restore bitwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    sd = {"at": torch.randn(16384, generator=g), "below": torch.randn(16383, generator=g)}
    with CheckpointManager(os.path.join(base, f"threshold{world}")) as mgr:
        assert mgr.save(1, sd)
        nbytes = gather(mgr.stats[-1].nbytes)
        report(f"threshold{world}", nbytes)
        assert sum(nbytes) == 65536 + world * 65532, nbytes
        target = blank(sd)
        assert mgr.restore(1, target) == 1
        assert_bitwise_equal(target, sd)


def lazy_saves(base: str) -> None:
    """``lazy=True`` (copies issued in the background): each replicated byte staged once, every
    step restores bitwise (the state changes in place after save_async returns: the copies
    must have been taken by then or be of the saved values). CPU tensors staged lazily through
    the testing seam (a lazy save otherwise copies them at the call)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with lazy_cpu_copies(), CheckpointManager(os.path.join(base, f"lazy{world}"), lazy=True) as mgr:
        live = ddp_state(1, rank)
        for step in (1, 2, 3):
            fresh = ddp_state(step, rank)
            for k, v in fresh["model"].items():
                live["model"][k].copy_(v)
            live[f"rank{rank}"]["x"].copy_(fresh[f"rank{rank}"]["x"])
            live["step"] = step
            assert mgr.save_async(step, live)
            mgr.join()
            check_staged_once(f"lazy{world}.step{step}", gather(mgr.stats[-1].nbytes), ddp_state_bytes(world))
        for step in (1, 2, 3):
            target = blank(ddp_state(0, rank))
            assert mgr.restore(step, target) == step
            assert_bitwise_equal(target, ddp_state(step, rank))


def incremental_saves(base: str) -> None:
    """``incremental=True``: step 2 keeps step 1's model (only ``rank<r>.x`` and ``step``
    change): the ranks write less than the state and take step 1's files; step 3 changes the
    model. Every step restores bitwise, with ``once`` and ``every_rank``."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def state(step: int) -> Dict[str, Any]:
        sd = ddp_state(step, rank)
        sd["model"] = ddp_model(1 if step < 3 else step)
        return sd

    root = os.path.join(base, f"incremental{world}")
    with CheckpointManager(root, incremental=True) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, state(step))
            st = mgr.stats[-1]
            written, referred = gather(st.written_bytes), gather(st.referred_bytes)
            report(f"incremental{world}.step{step}", {"written": written, "referred": referred})
            if step == 2:
                assert sum(referred) >= 0.5 * REPLICATED_BYTES, (written, referred)
                assert sum(written) < 0.5 * ddp_state_bytes(world), (written, referred)
    for mode in ("once", "every_rank"):
        with CheckpointManager(root, replicated_reads=mode) as mgr:
            for step in (3, 2, 1):
                target = blank(ddp_state(0, rank))
                assert mgr.restore(step, target) == step
                assert_bitwise_equal(target, state(step))


def frozen_saves(base: str) -> None:
    """``incremental=True, frozen=`` the replicated model's keys, checked at every save
    (``frozen_check_every=1``): a declared-frozen tensor changed behind its version counter
    (through ``.data``) before step 3 makes step 3 write it in full, and a later call raise on
    every rank (FrozenTensorChangedError naming it where it was found, a CheckpointError
    naming that rank elsewhere); every committed step restores bitwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = [f"model.w{i}" for i in range(4)]
    live = ddp_state(1, rank)
    saved: Dict[int, Any] = {}
    raised: Any = None
    root = os.path.join(base, f"frozen{world}")
    mgr = CheckpointManager(root, incremental=True, frozen=keys, frozen_check_every=1, collective_timeout_s=60)
    try:
        for step in (1, 2, 3, 4):
            if step == 3:
                version = live["model"]["w0"]._version
                live["model"]["w0"].data.add_(1)  # a declared-frozen tensor changes after all ...
                assert live["model"]["w0"]._version == version  # ... behind its version counter
            live[f"rank{rank}"]["x"] = own(step, rank)
            saved[step] = {"model": {k: v.clone() for k, v in live["model"].items()},
                           f"rank{rank}": {"x": own(step, rank)}, "step": 1}
            mgr.save(step, live)
        mgr.join()
    except CheckpointError as exc:
        raised = exc
    try:
        mgr.close()
    except CheckpointError as exc:
        raised = raised or exc
    kinds = gather(None if raised is None else (type(raised).__name__, sorted(getattr(raised, "keys", None) or [])))
    report(f"frozen{world}.raised", kinds)
    assert all(k is not None for k in kinds), kinds  # every rank raised
    assert any(k[0] == "FrozenTensorChangedError" and "model.w0" in k[1] for k in kinds), kinds
    with CheckpointManager(root) as mgr:
        steps = mgr.all_steps()
        assert gather(steps) == [steps] * world and {1, 2, 3} <= set(steps), steps
        for step in steps:
            target = blank(ddp_state(0, rank))
            assert mgr.restore(step, target) == step
            assert_bitwise_equal(target, saved[step])


def partial_targets(base: str) -> None:
    """``once`` when rank 0's target lacks ``model.w3``: it is not read once (the others read it
    themselves); every rank's target restores bitwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(base, f"partial{world}")
    with CheckpointManager(root) as mgr:
        assert mgr.save(1, ddp_state(1, rank))
    with CheckpointManager(root, replicated_reads="once") as mgr:
        target = blank(ddp_state(0, rank))
        want = ddp_state(1, rank)
        if rank == 0:
            del target["model"]["w3"], want["model"]["w3"]
        assert mgr.restore(1, target) == 1
        assert_bitwise_equal(target, want)


def dtype_change(base: str) -> None:
    """Step 2 holds two replicated keys with the same byte counts in another dtype and shape (the
    cached agreement's fingerprint only names keys, offsets and sizes); steps 1-3 restore bitwise."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def state(step: int) -> Dict[str, Any]:
        sd = ddp_state(step, rank)
        if step == 2:
            sd["model"]["w0"] = torch.randint(-(2**31), 2**31 - 1, (512, 128), dtype=torch.int32,
                                              generator=torch.Generator().manual_seed(5))
            sd["model"]["w1"] = sd["model"]["w1"].view(torch.int16).reshape(256, 512)
        return sd

    with CheckpointManager(os.path.join(base, f"dtype{world}")) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, state(step))
        for step in (1, 2, 3):
            target = blank(state(step))
            assert mgr.restore(step, target) == step
            assert_bitwise_equal(target, state(step))


def diverged_state(rank: int) -> Dict[str, Any]:
    """Large values under one key that differ between the ranks, beside a replicated model: a
    per-rank buffer, BatchNorm-like statistics (``broadcast_buffers=False``), and float32 on rank
    0 / int32 on rank 1 of equal shape and bytes; and a small per-rank value (compared before)."""
    g = torch.Generator().manual_seed(77 + rank)
    mixed = torch.arange(65536, dtype=torch.float32)
    return {"model": {"w": torch.arange(65536, dtype=torch.float32)},
            "buf": torch.randn(65536, generator=g),
            "bn": {"running_mean": torch.randn(32768, generator=g, dtype=torch.float64)},
            "mixed": mixed if rank == 0 else mixed.view(torch.int32),
            "small": torch.full((8,), float(rank))}


def divergence(base: str) -> None:
    """Values that differ between the ranks under one key, large ones included (they are staged by
    one rank): rank 0 warns once per key, every manifest names them in ``diverged_keys``, and the
    checkpoint holds one rank's value of each, bitwise; float32 and int32 of equal bytes under one
    key are not one replicated tensor (dtype is part of the match). The same with
    ``replicated_saves=False`` (every rank stages everything)."""
    import logging

    rank, world = dist.get_rank(), dist.get_world_size()
    want = ["bn.running_mean", "buf", "mixed", "small"]
    for flag in (True, False):
        records: List[str] = []

        class Catch(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record.getMessage())

        handler = Catch(level=logging.WARNING)
        logging.getLogger("async_ckpt").addHandler(handler)
        root = os.path.join(base, f"diverged{world}_{flag}")
        try:
            with CheckpointManager(root, replicated_saves=flag) as mgr:
                for step in (1, 2):
                    assert mgr.save(step, diverged_state(rank))
                    if flag and step == 1:  # "mixed" is two tensors (each rank stages its own), the rest shared
                        check_staged_once("diverged", gather(mgr.stats[-1].nbytes),
                                          3 * 256 * KIB + world * (256 * KIB + 32))
            manifests = [json.load(open(os.path.join(root, str(step), "manifest.json"))) for step in (1, 2)]
        finally:
            logging.getLogger("async_ckpt").removeHandler(handler)
        for m in manifests:
            assert m["extra"].get("diverged_keys") == want, m["extra"]
        differ = [r for r in records if "differ between the ranks" in r]
        if rank == 0:
            assert len(differ) == 1, records  # once per key: step 2 repeats no warning
            for key in want:
                assert key in differ[0], differ
            assert "model.w" not in differ[0], differ
        else:
            assert not differ, records
        # what the checkpoint holds: one rank's value of each key, bitwise; the model as saved
        with open(os.path.join(root, "2", ".metadata"), "rb") as f:
            kept = load_metadata(f.read()).state_dict_metadata["mixed"].properties.dtype
        with CheckpointManager(root) as mgr:
            states = [diverged_state(r) for r in range(world)]
            holder = next(r for r in range(world) if states[r]["mixed"].dtype == kept)
            target = blank(states[holder])
            assert mgr.restore(2, target) == 2
            assert_bitwise_equal(target["model"], states[0]["model"])
            for key in ("buf", "mixed", "small"):
                assert any(torch.equal(target[key], st[key]) for st in states if st[key].dtype == target[key].dtype), key
            assert any(torch.equal(target["bn"]["running_mean"], st["bn"]["running_mean"]) for st in states)


# ---- a rank that dies during the save's exchange ---------------------------------------------------

def death(base: str, how: str) -> None:
    """3 ranks, collective_timeout_s=10: step 1 saves; rank 2 then exits (os._exit) instead of
    saving step 2 (``same``: the same structure, the cached agreement's check; ``changed``: a new
    key, a full exchange). The others raise a CheckpointError from save_async()/join() and
    commit nothing for step 2."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mgr = CheckpointManager(os.path.join(base, f"death_{how}"), collective_timeout_s=DEATH_TIMEOUT_S)
    assert mgr.save(1, ddp_state(1, rank))
    sd = ddp_state(2, rank)
    if how == "changed":
        sd["model"]["new"] = torch.ones(65536)
    dist.barrier()
    if rank == 2:
        os._exit(17)
    t0 = time.monotonic()
    try:
        mgr.save_async(2, sd)
        mgr.join()
    except CheckpointError as exc:
        print(f"RAISED {time.monotonic() - t0:.1f} {type(exc).__name__} {exc}".replace("\n", " "), flush=True)
        assert mgr.all_steps() == [1], mgr.all_steps()
        print(f"RANK {rank} OK", flush=True)
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001 - the wrong kind of error is a failure, reported
        print(f"RAISED {time.monotonic() - t0:.1f} {type(exc).__name__} {exc}".replace("\n", " "), flush=True)
        os._exit(4)
    print("NO ERROR", flush=True)
    os._exit(3)


# ---- launch ------------------------------------------------------------------------------------------

def run_checks(checks: List[tuple]) -> None:
    rank = dist.get_rank()
    failed = []
    for name, fn in checks:
        t0 = time.time()
        try:
            fn()
            print(f"{name} RANK {rank} OK ({time.time() - t0:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, then the next check runs
            print(f"{name} RANK {rank} FAILED: {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)
            traceback.print_exc()
            failed.append(name)
        dist.barrier()
    print(f"RANK {rank} DONE failed={failed}", flush=True)


def main() -> None:
    import faulthandler

    what, base = sys.argv[1], sys.argv[2]
    if what.startswith("death-"):
        death(base, what[len("death-"):])
        return
    import datetime

    faulthandler.dump_traceback_later(float(os.environ.get("DIST_WORKER_TIMEOUT", "150")), exit=True)
    # a check that fails on some ranks only must not leave the others waiting for long
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        b = base
        checks = {
            "save2": [("DDP SAVE", lambda: ddp_save(b)), ("DDP LEGACY", lambda: ddp_legacy(b)),
                      ("FSDP SAVE", lambda: fsdp_save(b)), ("DIVERGED", lambda: divergence(b))],
            "main4": [("DDP SAVE", lambda: ddp_save(b)), ("DDP LEGACY", lambda: ddp_legacy(b)),
                      ("DDP FROM 2", lambda: ddp_restore_from(b, 2)), ("STRUCTURE", lambda: structure_changes(b)),
                      ("FSDP SAVE", lambda: fsdp_save(b)), ("FSDP FROM 2", lambda: fsdp_restore_from(b, 2)),
                      ("HSDP SAVE", lambda: hsdp_save(b)), ("COUNTED READS", lambda: counted_reads(b)),
                      ("DAMAGE", lambda: damaged_replicated(b)), ("LOCAL TIER", lambda: local_tier(b)),
                      ("ODD SIZES", lambda: odd_sizes(b)), ("STRIDED TARGETS", lambda: strided_targets(b)),
                      ("THRESHOLD", lambda: threshold(b)),
                      ("LAZY", lambda: lazy_saves(b)), ("INCREMENTAL", lambda: incremental_saves(b)),
                      ("FROZEN", lambda: frozen_saves(b)), ("PARTIAL TARGETS", lambda: partial_targets(b)),
                      ("DTYPE CHANGE", lambda: dtype_change(b))],
            "restore2": [("DDP FROM 4", lambda: ddp_restore_from(b, 4)), ("FSDP FROM 4", lambda: fsdp_restore_from(b, 4)),
                         ("HSDP FROM 4", lambda: hsdp_restore_1d(b))],
        }[what]
        run_checks(checks)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
