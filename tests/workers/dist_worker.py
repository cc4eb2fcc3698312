"""Worker script for tests/ranks/test_distributed.py, launched with torchrun (gloo, CPU, FSDP2).

    torchrun --standalone --nproc-per-node 4 tests/workers/dist_worker.py save   <root> <ref.pt>
    torchrun --standalone --nproc-per-node 2 tests/workers/dist_worker.py restore <root> <ref.pt>
    torchrun --standalone --nproc-per-node 2 tests/workers/dist_worker.py ranges  <root> -   (that check alone)
    torchrun --standalone --nproc-per-node 2 tests/workers/dist_worker.py peer    <root> -   (that check alone)
    torchrun --standalone --nproc-per-node 2 tests/workers/dist_worker.py ranks   <root> -   (steps past int64,
                                                                                 a failing load_state_dict)
    torchrun --standalone --nproc-per-node 2 tests/workers/dist_worker.py coordination <root> -  (ranks in
                                                      different calls, a local save failed on one rank)

``save`` runs several checks in one launch (a torchrun start costs 6-16 s): sharded async saves
from every rank, retention agreed by every rank with deletions by rank 0 only, a rank that
fails mid-write, a rank that fails to stage, a save that works again afterwards, and a restore
at the same world size. ``restore`` loads the 4-rank checkpoint into a 2-rank job, then saves
and restores a 2-rank checkpoint of its own shards, counting the bytes each rank reads, then
restores a step damaged in one rank's shard (neither rank's target changes). Every
comparison is bitwise against the full state dict written to ``ref.pt``. Each rank prints
``RANK <r> OK`` at the end; any failed check raises (non-zero exit).
"""

from __future__ import annotations

import errno
import glob
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from async_ckpt import CheckpointError, CheckpointManager, InvalidStateDictError, PartlyWrittenError  # noqa: E402
from async_ckpt.format.unpickling import load_metadata
from async_ckpt.testing import lazy_cpu_copies  # noqa: E402
from tests.support.damage import flip_byte  # noqa: E402
from tests.support.tree import assert_bitwise_equal  # noqa: E402


def build(seed: int):
    torch.manual_seed(seed)
    # Odd sizes: FSDP2 shards dim 0 unevenly (50 rows over 4 ranks: 13/13/12/12; 7 rows: 2/2/2/1).
    model = torch.nn.Sequential(torch.nn.Linear(37, 50), torch.nn.ReLU(), torch.nn.Linear(50, 7))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optim


def train(model, optim, steps: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        loss = model(torch.randn(8, 37, generator=g)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()


def state(model, optim, step: int):
    msd, osd = get_state_dict(model, optim)
    # "extra.replicated" is the same on every rank (DDP-like): DCP must write it once.
    return {"model": msd, "optim": osd,
            "extra": {"replicated": torch.arange(1000, dtype=torch.float32) + step, "step": step}}


def full(model, optim):
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}




def agree(value, what: str):
    """Assert that every rank computed the same ``value``."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    assert all(v == out[0] for v in out), f"{what} differs across ranks: {out}"
    return out


def expect_error(fn, cls, *needles):
    try:
        fn()
    except cls as exc:
        for n in needles:
            assert n in str(exc), f"{n!r} not in {exc}"
        return exc
    raise AssertionError(f"expected {cls.__name__}")


def scenario_save(root: str, ref_path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Debris from a crashed run: rank 0 (only) removes it when the manager starts.
    if rank == 0:
        os.makedirs(os.path.join(root, ".tmp-99-0123456789ab"), exist_ok=True)
    dist.barrier()
    model, optim = build(seed=0)
    # writer="thread": step 2 injects a write failure into this process's storage object, which
    # the writer thread writes through (the writer process's failures: test_writer_process.py)
    mgr = CheckpointManager(root, max_to_keep=2, writer="thread")
    deletes = []
    real_delete = mgr.layout.condemn
    mgr.layout.condemn = lambda step: (deletes.append(step), real_delete(step))[1]

    # 1. sharded async saves of steps 1..3, each rank staging only its own shards.
    from torch.distributed.tensor import DTensor

    def nbytes(tree, local: bool) -> int:
        if isinstance(tree, dict):
            return sum(nbytes(v, local) for v in tree.values())
        if isinstance(tree, list):
            return sum(nbytes(v, local) for v in tree)
        if isinstance(tree, torch.Tensor):
            t = tree.to_local() if local and isinstance(tree, DTensor) else tree
            return t.numel() * t.element_size()
        return 0

    for step in (1, 2, 3):
        train(model, optim, 1, rank)
        assert mgr.save_async(step, state(model, optim, step))
        assert mgr.roots[-1].writer.pending <= 1
    mgr.join()
    sd3 = state(model, optim, 3)
    # Each rank staged its own shards only (plus the small replicated entries).
    assert mgr.last_stats.nbytes == nbytes(sd3, local=True) < nbytes(sd3, local=False), mgr.last_stats.nbytes
    assert not os.path.exists(os.path.join(root, ".tmp-99-0123456789ab")), "debris not cleaned up"
    agree(mgr.all_steps(), "all_steps")
    assert mgr.all_steps() == [2, 3], mgr.all_steps()
    assert mgr.latest_step() == 3

    # The committed step holds every rank's files, once, in DCP's sharded format.
    step_dir = os.path.join(root, "3")
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["world_size"] == world, manifest["world_size"]
    names = set(manifest["files"])
    for r in range(world):
        assert any(n.startswith(f"__{r}_") for n in names), f"rank {r} wrote no file: {sorted(names)}"
    assert names == {os.path.basename(p) for p in glob.glob(os.path.join(step_dir, "*"))
                     if os.path.basename(p) not in ("manifest.json", "COMMITTED")} | {".metadata"}
    with open(os.path.join(step_dir, ".metadata"), "rb") as f:
        md = load_metadata(f.read())
    assert len(md.state_dict_metadata["model.0.weight"].chunks) == world  # one shard per rank
    assert len(md.state_dict_metadata["extra.replicated"].chunks) == 1  # replicated: written once
    assert sum(1 for idx in md.storage_data if idx.fqn == "extra.replicated") == 1

    # 2. a rank fails mid-write: nothing is committed, every rank raises, older steps stay.
    if rank == 1:
        real_open = mgr.storage.open_write

        def failing_open(path, *args, **kwargs):
            if "/.tmp-4-" in path or path.endswith("/4") or "/4/" in path:
                raise OSError(errno.ENOSPC, "No space left on device (injected on rank 1)", path)
            return real_open(path, *args, **kwargs)

        mgr.storage.open_write = failing_open
    train(model, optim, 1, rank)
    exc = expect_error(lambda: mgr.save(4, state(model, optim, 4)), CheckpointError, "rank 1", "No space left")
    assert exc.step == 4, exc.step
    assert [f.rank for f in exc.failures] == [1], exc.failures  # the same failures, named by rank, everywhere
    if rank == 1:
        mgr.storage.open_write = real_open
    dist.barrier()
    agree(mgr.all_steps(), "all_steps after a failed save")
    assert mgr.all_steps() == [2, 3], mgr.all_steps()
    assert not glob.glob(os.path.join(root, ".tmp-4-*")) and not os.path.exists(os.path.join(root, "4"))

    # 3. a rank fails to stage (an unsaveable leaf): it raises at once; the others raise too.
    sd = state(model, optim, 5)
    if rank == 2:
        sd["extra"]["bad"] = lambda: None
        expect_error(lambda: mgr.save(5, sd), InvalidStateDictError, "bad")
    else:
        expect_error(lambda: mgr.save(5, sd), CheckpointError, "rank 2")
    dist.barrier()
    assert mgr.all_steps() == [2, 3], mgr.all_steps()

    # 4. the protocol is still in step on every rank: the next save commits.
    assert mgr.save(6, state(model, optim, 6), metrics={"loss": 0.5})
    agree(mgr.all_steps(), "all_steps after recovery")
    assert mgr.all_steps() == [3, 6], mgr.all_steps()
    assert mgr.metrics(6) == {"loss": 0.5}
    ref = full(model, optim)
    if rank == 0:
        torch.save(ref, ref_path)
    mgr.close()
    counts = [None] * world
    dist.all_gather_object(counts, sorted(deletes))
    assert counts[0] == [1, 2], counts  # retention dropped steps 1 and 2 ...
    assert all(c == [] for c in counts[1:]), counts  # ... deleted by rank 0 only

    # 5. restore at the same world size into a fresh model (different init), bitwise.
    model2, optim2 = build(seed=1)
    mgr2 = CheckpointManager(root)
    sd2 = state(model2, optim2, 0)
    assert mgr2.restore(None, sd2) == 6
    set_state_dict(model2, optim2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])
    got = full(model2, optim2)  # the full tensors land on rank 0 (empty elsewhere)
    if rank == 0:
        assert got["model"] and got["optim"]["state"]
        assert_bitwise_equal(got, ref)
    assert torch.equal(sd2["extra"]["replicated"], torch.arange(1000, dtype=torch.float32) + 6)
    assert sd2["extra"]["step"] == 6
    # A step that does not exist is an error on every rank, not a hang.
    from async_ckpt import StepNotFoundError

    expect_error(lambda: mgr2.restore(5, sd2), StepNotFoundError, "step 5")
    mgr2.close()

    # 6. a save policy that answers differently per rank: rank 0's decision holds everywhere.
    class RankPolicy:
        def should_save(self, step: int) -> bool:
            return (rank == 0) == (step % 2 == 1)  # rank 0: odd steps; the others: even steps

    with CheckpointManager(root + "_policy", save_policy=RankPolicy()) as mgr3:
        small = {"x": torch.full((4,), float(rank))}
        assert mgr3.save(7, small) is True
        assert mgr3.save(8, small) is False
        assert mgr3.all_steps() == [7]


def scenario_restore(root: str, ref_path: str) -> None:
    """Restore the 4-rank checkpoint with this job's world size (DCP reshards), bitwise."""
    model, optim = build(seed=2)
    mgr = CheckpointManager(root)
    assert mgr.all_steps() == [3, 6], mgr.all_steps()
    sd = state(model, optim, 0)
    assert mgr.restore(None, sd) == 6
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = full(model, optim)  # collective; the full tensors land on rank 0
    if dist.get_rank() == 0:
        assert_bitwise_equal(got, torch.load(ref_path, weights_only=True))
    # and an older step too, by number
    assert mgr.restore(3, sd) == 3
    mgr.close()
    dropin_checks(root + "_dropin")
    ranges_checks(root + "_ranges")
    damaged_peer_checks(root + "_peer")


def counting_reads(storage) -> dict:
    """Count the bytes read from each file (by name) through ``storage``, however they are read."""
    counts: dict = {}

    def add(path, n):
        name = os.path.basename(path)
        counts[name] = counts.get(name, 0) + n

    real_bytes, real_into, real_ranges = storage.read_bytes, storage.read_into, storage.open_ranges

    def read_bytes(path):
        data = real_bytes(path)
        add(path, len(data))
        return data

    def read_into(path, start, out):
        got = real_into(path, start, out)
        add(path, min(got, len(out)))
        return got

    def open_ranges(path):
        ranges = real_ranges(path)
        real = ranges.read_into

        def counted(start, out):
            got = real(start, out)
            add(path, min(got, len(out)))
            return got

        ranges.read_into = counted
        return ranges

    storage.read_bytes, storage.read_into, storage.open_ranges = read_bytes, read_into, open_ranges
    return counts


def ranges_checks(root: str) -> None:
    """Each rank restores only the records of its own shards (plus the replicated items),
    bitwise; a flipped byte in a record one rank needs makes both fall back to the older step."""
    import warnings

    from torch.distributed.tensor import Shard, distribute_tensor

    from async_ckpt import CorruptCheckpointError

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = 64

    def full(step: int):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(world * rows, 4096, generator=g),  # 1 MiB per rank
                "v": torch.randn(world * rows, 300, generator=g).to(torch.bfloat16),
                "replicated": torch.arange(5000, dtype=torch.float64) + step, "step": step}

    def sharded(values):
        return {k: distribute_tensor(v, mesh, [Shard(0)]) if k in ("w", "v") else v for k, v in values.items()}

    def local(tree):
        return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in tree.items()}

    def fresh():
        return sharded({k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in full(0).items()})

    def expect_equal(got, step: int):
        want = local(sharded(full(step)))
        got = local(got)
        assert got["step"] == step, got["step"]
        for k in ("w", "v", "replicated"):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k

    mgr = CheckpointManager(root)
    for step in (1, 2):
        assert mgr.save(step, sharded(full(step)))
    step_dir = os.path.join(root, "2")
    with open(os.path.join(step_dir, ".metadata"), "rb") as f:
        md = load_metadata(f.read())
    with open(os.path.join(step_dir, "manifest.json")) as f:
        sizes = {n: v["size"] for n, v in json.load(f)["files"].items()}
    need: dict = {}  # per file, the bytes of the records this rank needs
    others = 0  # bytes of shards only the other ranks need
    for idx, info in md.storage_data.items():
        mine = idx.fqn in ("replicated", "step") or idx.offset[0] == rank * rows
        if mine:
            need[info.relative_path] = need.get(info.relative_path, 0) + info.length
        else:
            others += info.length
    assert others > 0 and len({i.relative_path for i in md.storage_data.values()}) == world, md.storage_data

    counts = counting_reads(mgr.storage)
    target = fresh()
    assert mgr.restore(None, target) == 2
    expect_equal(target, 2)
    read = {n: c for n, c in counts.items() if n.endswith(".distcp")}
    print(f"RANGES rank {rank}: read {sum(read.values())} bytes of data files {sorted(read.items())}; "
          f"the whole files holding them: {sum(sizes[n] for n in need)}", flush=True)
    assert read == need, (read, need)
    totals: list = [None] * world
    dist.all_gather_object(totals, (sum(read.values()), sum(sizes[n] for n in need)))
    assert sum(r for r, _ in totals) < sum(w for _, w in totals), totals  # whole files: more

    # A flipped byte in rank 1's own shard of "w": only rank 1 reads it, both fall back.
    dist.barrier()
    shard1 = next(i for x, i in md.storage_data.items() if x.fqn == "w" and x.offset[0] == rows)
    if rank == 0:
        flip_byte(os.path.join(step_dir, shard1.relative_path), at=shard1.offset + shard1.length - 100, mask=0x10)
    dist.barrier()
    target = fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.restore(None, target) == 1
    expect_equal(target, 1)
    if rank == 1:
        assert any("checksum mismatch" in str(w.message) for w in caught), [str(w.message) for w in caught]
    damaged = os.path.join(step_dir, shard1.relative_path)
    exc = expect_error(lambda: mgr.restore(2, fresh()), CorruptCheckpointError, "checksum mismatch", damaged)
    assert exc.step == 2, exc.step
    mgr.close()


def dropin_checks(root: str) -> None:
    """torch_xla's max_to_keep scenario with 2 ranks: commit order, retention visible on every
    rank when save()/join() return, across a restart; delete() by rank 0 for everyone."""
    from async_ckpt import StepNotFoundError

    rank = dist.get_rank()

    def sd(v: float):
        return {"x": torch.full((16,), float(v)), "mine": {f"r{rank}": torch.full((4,), float(rank))}}

    def expect(steps, order=None):
        agree(mgr.all_steps(), "all_steps")
        assert set(mgr.all_steps()) == set(steps), (mgr.all_steps(), steps)
        if order is not None:
            assert mgr.steps_in_commit_order() == order, (mgr.steps_in_commit_order(), order)

    mgr = CheckpointManager(root, save_interval=10, max_to_keep=2)
    assert mgr.save(10, sd(10)) and mgr.save(20, sd(20))
    expect({10, 20})
    assert mgr.save(30, sd(30))
    expect({20, 30})
    assert mgr.save(10, sd(11))  # a lower step: accepted; the oldest commit goes
    expect({30, 10}, [30, 10])
    assert mgr.latest_step() == 10
    mgr.close()
    mgr = CheckpointManager(root, save_interval=10, max_to_keep=2)
    assert mgr.save(20, sd(21))
    expect({20, 10}, [10, 20])
    assert mgr.save_async(30, sd(31))
    mgr.join()
    expect({20, 30}, [20, 30])
    t = sd(0)
    assert mgr.restore(None, t) == 30 and torch.equal(t["x"], torch.full((16,), 31.0))
    mgr.delete(20)
    expect({30})
    expect_error(lambda: mgr.delete(20), StepNotFoundError, "step 20")
    mgr.close()

    # lazy=True with 2 ranks: each rank's copies run in the background (tensors > 64 KiB; CPU
    # tensors staged lazily through the testing seam, as a lazy save stages device tensors)
    def big(v: float):
        return {"x": torch.full((32768,), float(v)), "mine": {f"r{rank}": torch.full((20000,), float(v + rank))}}

    with lazy_cpu_copies(), CheckpointManager(root + "_lazy", lazy=True) as lm:
        for s in (1, 2):
            assert lm.save_async(s, big(100 + s))
        lm.join()
        t = big(0)
        assert lm.restore(2, t) == 2
        assert torch.equal(t["x"], big(102)["x"]) and torch.equal(t["mine"][f"r{rank}"], big(102)["mine"][f"r{rank}"])
        agree(lm.all_steps(), "lazy all_steps")


def damaged_peer_checks(root: str) -> None:
    """A step damaged in a record only rank 1 reads (its Shard(0) half of "w"): restore(2) raises
    CorruptCheckpointError on both ranks and neither target changes, atomic=True or not;
    restore(None, strict=False) then restores step 1 on both, with no data of step 2 left in
    "new" (a key step 1 lacks)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from async_ckpt import CorruptCheckpointError

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded(t):
        return distribute_tensor(t, mesh, [Shard(0)])

    w = torch.arange(128 * 1024, dtype=torch.float32).reshape(128, 1024) + 1
    mgr = CheckpointManager(root)
    assert mgr.save(1, {"w": sharded(w)})
    assert mgr.save(2, {"w": sharded(w * 2), "new": sharded(torch.full((128, 16), 7.0))})
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, "2", ".metadata"), "rb") as f:
            md = load_metadata(f.read())
        info = next(i for x, i in md.storage_data.items() if x.fqn == "w" and x.offset[0] == 64)
        flip_byte(os.path.join(root, "2", info.relative_path), at=info.offset + info.length - 100, mask=0x10)
    dist.barrier()
    for atomic in (True, False):
        t = {"w": sharded(torch.zeros(128, 1024)), "new": sharded(torch.zeros(128, 16))}
        exc = expect_error(lambda: mgr.restore(2, t, atomic=atomic), CorruptCheckpointError, "checksum mismatch")
        assert not isinstance(exc, PartlyWrittenError), (atomic, exc)
        assert not t["w"].to_local().any() and not t["new"].to_local().any(), f"rank {rank} wrote (atomic={atomic})"
    t = {"w": sharded(torch.zeros(128, 1024)), "new": sharded(torch.zeros(128, 16))}
    assert mgr.restore(None, t, strict=False) == 1
    assert torch.equal(t["w"].full_tensor(), w) and not t["new"].to_local().any()
    mgr.close()
    print(f"PEER DAMAGE RANK {rank} OK", flush=True)


class FailsOnRank:
    """A ``Stateful`` value whose ``load_state_dict`` raises on one rank only."""

    def __init__(self, bad_rank: int) -> None:
        self.bad_rank = bad_rank
        self.t = torch.zeros(8)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, sd) -> None:
        if dist.get_rank() == self.bad_rank:
            raise ValueError("this rank's load_state_dict refuses the state")
        self.t.copy_(sd["t"])


class StateDictFailsOnRank(FailsOnRank):
    """A ``Stateful`` value whose ``state_dict`` raises on one rank only."""

    def state_dict(self):
        if dist.get_rank() == self.bad_rank:
            raise RuntimeError("this rank's state_dict cannot give its state")
        return {"t": self.t}


def ranks_checks(root: str) -> None:
    """2 ranks, each check on its own root and printing its own marker (a failed check prints
    its error and the next one still runs): steps near and past 2**63 save and restore as in
    one process; one rank's failing ``load_state_dict`` or ``state_dict`` raises on every rank,
    naming it, and the next collective works; after a real collective timeout every later call
    fails at once, and a new manager saves again."""
    failed = []
    for name, check in (("BIG STEPS", big_step_checks), ("STATEFUL", failing_stateful_checks),
                        ("METRICS", metrics_checks), ("STATE_DICT", failing_state_dict_checks),
                        ("TIMEOUT", collective_timeout_checks)):
        try:
            check(root + "_" + name.lower().replace(" ", "_"))
            print(f"{name} RANK {dist.get_rank()} OK", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, then the next check
            print(f"{name} RANK {dist.get_rank()} FAILED: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
    assert not failed, failed


def big_step_checks(root: str) -> None:
    rank = dist.get_rank()
    big = [2**63 - 1, 2**63, 2**70]
    with CheckpointManager(root) as mgr:
        for i, s in enumerate(big):
            assert mgr.save(s, {"x": torch.full((4,), float(i))}) is True
        agree(mgr.all_steps(), "all_steps")
        assert mgr.all_steps() == big and mgr.latest_step() == 2**70, mgr.all_steps()
        for i, s in enumerate(big):
            t = {"x": torch.zeros(4)}
            assert mgr.restore(s, t) == s
            assert torch.equal(t["x"], torch.full((4,), float(i)))
        t = {"x": torch.zeros(4)}
        assert mgr.restore(None, t) == 2**70 and torch.equal(t["x"], torch.full((4,), 2.0))
        # ranks naming different large steps still disagree (exact comparison, not a marker)
        expect_error(lambda: mgr.restore(big[rank], {"x": torch.zeros(4)}), CheckpointError, "rank(s) [1]")
        mgr.delete(2**63)
        assert mgr.all_steps() == [2**63 - 1, 2**70], mgr.all_steps()


def metrics_checks(root: str) -> None:
    """``metrics_reduce``: each rank gives its own metrics (one name on rank 0 only); the step
    records rank 0's, or the mean, min or max over the ranks that gave each name."""
    from async_ckpt import KeepBest

    rank = dist.get_rank()
    mine = {"loss": float(rank + 1), "acc": 0.5 + rank, **({"only0": 7.0} if rank == 0 else {})}
    want = {"rank0": {"loss": 1.0, "acc": 0.5, "only0": 7.0}, "mean": {"loss": 1.5, "acc": 1.0, "only0": 7.0},
            "min": {"loss": 1.0, "acc": 0.5, "only0": 7.0}, "max": {"loss": 2.0, "acc": 1.5, "only0": 7.0}}
    for how, expected in want.items():
        with CheckpointManager(f"{root}_{how}", metrics_reduce=how, retention=KeepBest(1, "loss")) as mgr:
            mgr.save(1, {"w": torch.ones(4)}, metrics=mine)
            assert mgr.metrics(1) == expected, (how, mgr.metrics(1))
            mgr.save(2, {"w": torch.ones(4)}, metrics={k: v - 0.25 * (rank == 1) for k, v in mine.items()})
            # mean/max see rank 1's lower loss at step 2 (best now: step 1 dropped by KeepBest(1))
            best = 1 if how in ("rank0", "min") else 2
            assert mgr.best_step("loss") == best and mgr.all_steps() == sorted({best, 2}), (how, mgr.all_steps())


def failing_stateful_checks(root: str) -> None:
    with CheckpointManager(root) as mgr:
        app = FailsOnRank(bad_rank=1)
        app.t.fill_(5.0)
        assert mgr.save(1, {"app": app, "w": torch.ones(4)})
        fresh = FailsOnRank(bad_rank=1)
        exc = expect_error(lambda: mgr.restore(1, {"app": fresh, "w": torch.zeros(4)}), CheckpointError,
                           "rank 1", "load_state_dict", "step 1")
        assert [(f.rank, f.kind) for f in exc.failures] == [(1, "ValueError")], exc.failures
        # the next collective pairs up on both ranks
        assert mgr.save(2, {"app": app, "w": torch.ones(4)})
        ok = FailsOnRank(bad_rank=-1)
        assert mgr.restore(2, {"app": ok, "w": torch.zeros(4)}) == 2 and torch.equal(ok.t, torch.full((8,), 5.0))


def failing_state_dict_checks(root: str) -> None:
    """A Stateful's ``state_dict()`` raising on rank 1, in a save and in a restore: both ranks
    raise at once (with the default 300 s collective timeout), naming rank 1 and its error, and
    the next save and restore work on both ranks."""
    rank = dist.get_rank()
    with CheckpointManager(root) as mgr:
        good = FailsOnRank(bad_rank=-1)
        good.t.fill_(3.0)
        assert mgr.save(1, {"app": good, "w": torch.ones(4)})
        # save: rank 1's own error is raised by its save(); rank 0's save() names rank 1 and it
        exc = expect_error(lambda: mgr.save(2, {"app": StateDictFailsOnRank(bad_rank=1), "w": torch.ones(4)}),
                           CheckpointError, "'app'", "state_dict", "RuntimeError",
                           "this rank's state_dict cannot give its state")
        if rank == 0:
            assert "rank 1" in str(exc) and "step 2" in str(exc), exc
            assert [(f.rank, f.kind) for f in exc.failures] == [(1, "CheckpointError")], exc.failures
        assert mgr.all_steps() == [1], mgr.all_steps()
        good.t.fill_(4.0)
        assert mgr.save(3, {"app": good, "w": torch.ones(4)})  # the next save pairs up and commits
        # restore: DCP would ask the Stateful target for its state_dict(); here it is asked inside a phase
        bad = StateDictFailsOnRank(bad_rank=1)
        exc = expect_error(lambda: mgr.restore(3, {"app": bad, "w": torch.zeros(4)}), CheckpointError,
                           "rank 1", "RuntimeError", "this rank's state_dict cannot give its state", "step 3")
        assert [(f.rank, f.kind) for f in exc.failures] == [(1, "RuntimeError")], exc.failures
        ok = FailsOnRank(bad_rank=-1)
        w = torch.zeros(4)
        assert mgr.restore(None, {"app": ok, "w": w}) == 3
        assert torch.equal(ok.t, torch.full((8,), 4.0)) and torch.equal(w, torch.ones(4))
        assert mgr.all_steps() == [1, 3], mgr.all_steps()


def collective_timeout_checks(root: str) -> None:
    """A rank that stalls past ``collective_timeout_s``: the save fails on both ranks; every later
    call of that manager fails at once (a ``CoordinationError`` saying why, no second wait), and a
    new manager made on both ranks saves and restores again."""
    import time

    from async_ckpt import CoordinationError

    rank = dist.get_rank()
    timeout = 3.0
    mgr = CheckpointManager(root, collective_timeout_s=timeout)
    sd = {"w": torch.arange(32768, dtype=torch.float32)}
    assert mgr.save(1, sd)
    if rank == 1:
        time.sleep(2 * timeout)  # rank 0's next exchange times out while rank 1 is away
    first = expect_error(lambda: mgr.save(2, sd), CheckpointError)
    print(f"TIMEOUT RANK {rank}: step 2: {type(first).__name__}: {first}", flush=True)
    assert mgr.all_steps() == [1], mgr.all_steps()  # no exchange: still answers
    for call in (lambda: mgr.save(3, sd), lambda: mgr.restore(1, {"w": torch.zeros(32768)})):
        t0 = time.monotonic()
        exc = expect_error(call, CoordinationError, "collective_timeout_s", "new CheckpointManager")
        assert time.monotonic() - t0 < timeout, f"it waited {time.monotonic() - t0:.1f} s: {exc}"
    mgr.close()  # never hangs
    with CheckpointManager(root, collective_timeout_s=60) as again:
        assert again.all_steps() == [1], again.all_steps()
        assert again.save(4, sd)
        out = {"w": torch.zeros(32768)}
        assert again.restore(4, out) == 4
        assert_bitwise_equal(out, sd)


def coordination_checks(root: str) -> None:
    """2 ranks, each check printing its own marker (tests/ranks/test_distributed.py ``coordination_job``)."""
    failed = []
    for name, check in (("DIFFERENT CALLS", different_calls_checks), ("FAILED LOCAL SAVE", failed_local_save_checks),
                        ("SHARED LOCAL DIR", shared_local_dir_checks), ("LATE RANK", late_rank_checks)):
        try:
            check(root + "_" + name.lower().replace(" ", "_"))
            print(f"{name} RANK {dist.get_rank()} OK", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, then the next check
            print(f"{name} RANK {dist.get_rank()} FAILED: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
        dist.barrier()
    assert not failed, failed


def different_calls_checks(root: str) -> None:
    """Rank 0 restores while rank 1 saves (and the other way round): both raise a
    CoordinationError naming both calls (gloo aborted the process before), and the manager then
    saves and restores on both ranks."""
    from async_ckpt import CoordinationError

    rank = dist.get_rank()
    sd = {"w": torch.arange(64, dtype=torch.float32)}
    with CheckpointManager(root, collective_timeout_s=60) as mgr:
        assert mgr.save(1, sd)
        for restorer in (0, 1):
            if rank == restorer:
                call = lambda: mgr.restore(1, {"w": torch.zeros(64)})  # noqa: E731
            else:
                call = lambda: (mgr.save_async(2, sd), mgr.join())  # noqa: E731
            expect_error(call, CoordinationError, f"rank {restorer}: restore", f"rank {1 - restorer}: save_async")
        assert mgr.all_steps() == [1], mgr.all_steps()
        assert mgr.save(3, sd)
        out = {"w": torch.zeros(64)}
        assert mgr.restore(None, out) == 3
        assert_bitwise_equal(out, sd)


def failed_local_save_checks(root: str) -> None:
    """A local save that fails on rank 1 only (its local directory replaced by a file): a new
    manager lists the same steps on both ranks (not rank 0's copy of the failed save), and
    restore(latest_step()) works on both."""
    from async_ckpt.format.step_names import rank_dir_name

    rank = dist.get_rank()
    bucket, local = root + "_bucket", root + "_local"
    sd = {"w": torch.full((64,), float(rank))}
    opts = dict(save_interval=10, local_dir=local, local_policy=1, collective_timeout_s=60)
    mgr = CheckpointManager(bucket, **opts)
    assert mgr.save(10, sd)
    mine = os.path.join(local, rank_dir_name(rank))
    if rank == 1:
        os.rename(mine, mine + ".away")
        open(mine, "w").close()
    try:
        mgr.save_async(11, {"w": torch.full((64,), 11.0 + rank)})  # due for the local tier only
        mgr.join()
    except CheckpointError:
        pass
    try:
        mgr.close()
    except CheckpointError:
        pass
    if rank == 1:
        os.remove(mine)
        os.rename(mine + ".away", mine)
    dist.barrier()
    assert ("11" in os.listdir(mine)) == (rank == 0), os.listdir(mine)  # rank 0 committed its copy
    with CheckpointManager(bucket, **opts) as again:
        steps = again.all_steps()
        agree(steps, "all_steps")
        assert steps == [10] and again.latest_step() == 10, steps
        out = {"w": torch.zeros(64)}
        assert again.restore(again.latest_step(), out) == 10
        assert_bitwise_equal(out, sd)
        assert again.save(12, sd)  # a later local save is listed everywhere
        assert again.all_steps() == [10, 12], again.all_steps()


def shared_local_dir_checks(root: str) -> None:
    """Another job holds rank 0's local directory (its writer lease, as that job's rank 0 does):
    this job's manager is refused at construction on both ranks (LeaseHeldError on rank 0),
    instead of skipping every local save with a log line; once the other job ends, it opens."""
    import subprocess

    from async_ckpt import LeaseHeldError
    from async_ckpt.format.step_names import rank_dir_name

    rank = dist.get_rank()
    bucket, local = root + "_bucket", root + "_local"
    other = None
    if rank == 0:
        mine = os.path.join(local, rank_dir_name(0))
        os.makedirs(mine)
        hold = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
                "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()")
        other = subprocess.Popen([sys.executable, "-c", hold, os.path.join(mine, ".async_ckpt.lock")],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert other.stdout.readline().strip() == "held"
    dist.barrier()
    opts = dict(local_dir=local, collective_timeout_s=60)
    exc = expect_error(lambda: CheckpointManager(bucket, **opts), CheckpointError, "rank0", "live writer")
    assert isinstance(exc, LeaseHeldError) or rank != 0, exc
    assert [f.rank for f in exc.failures] == [0], exc.failures
    dist.barrier()
    if other is not None:
        other.stdin.close()
        other.wait(30)
    dist.barrier()
    with CheckpointManager(bucket, **opts) as mgr:
        sd = {"w": torch.ones(8)}
        assert mgr.save(1, sd)
        assert mgr.step_tiers() == {1: ("local", "persistent")}, mgr.step_tiers()


def late_rank_checks(root: str) -> None:
    """Rank 1 creates its manager more than collective_timeout_s after rank 0: both raise a
    CoordinationError naming collective_timeout_s (not torch's DistStoreError), and managers
    created together afterwards work."""
    import time

    from async_ckpt import CoordinationError

    rank = dist.get_rank()
    if rank == 1:
        time.sleep(5)
    expect_error(lambda: CheckpointManager(root, collective_timeout_s=2), CoordinationError,
                 "collective_timeout_s=2", "CheckpointManager")
    dist.barrier()
    with CheckpointManager(root, collective_timeout_s=60) as mgr:
        assert mgr.save(1, {"w": torch.ones(8)})


def main() -> None:
    import faulthandler
    import time

    # A hang is a failure: dump every thread's stack and exit instead of waiting forever.
    faulthandler.dump_traceback_later(float(os.environ.get("DIST_WORKER_TIMEOUT", "100")), exit=True)
    t0 = time.time()
    dist.init_process_group("gloo")
    try:
        what, root, ref = sys.argv[1], sys.argv[2], sys.argv[3]
        {"save": scenario_save, "restore": scenario_restore,
         "ranges": lambda root, _ref: ranges_checks(root),
         "peer": lambda root, _ref: damaged_peer_checks(root),
         "ranks": lambda root, _ref: ranks_checks(root),
         "coordination": lambda root, _ref: coordination_checks(root)}[what](root, ref)
        dist.barrier()
        print(f"RANK {dist.get_rank()} OK ({time.time() - t0:.1f} s after init)", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
