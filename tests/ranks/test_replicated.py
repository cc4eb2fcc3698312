"""Replicated state across ranks (issue 28): each replicated byte staged once, written once, read
once; checkpoints that restore bitwise at any world size.

One module fixture launches the torchrun jobs of tests/workers/replicated_worker.py once, in order (each
restores the previous one's checkpoints): ``save2`` (2 ranks), ``main4`` (4 ranks), ``restore2``
(2 ranks); two 3-rank jobs in which a rank dies before a save's exchange run alongside the first.
The tests read the jobs' per-check markers, and restore their checkpoints in this process
(a 1-process manager and plain ``torch.distributed.checkpoint.load``).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from typing import Dict, List

import pytest
import torch
import torch.distributed.checkpoint as dcp

from async_ckpt import CheckpointManager, InvalidArgumentError

from ..conftest import assert_bitwise_equal
from ..support.launch import finish, start_ranks, torchrun
from ..workers.replicated_worker import (
    DEATH_TIMEOUT_S,
    blank,
    ddp_model,
    ddp_state,
    hsdp_full,
    own,
)

pytestmark = pytest.mark.slow

TIMEOUT = 300  # per job; the workers dump their stacks and exit after DIST_WORKER_TIMEOUT


def _torchrun(nproc: int, what: str, base: str) -> subprocess.CompletedProcess:
    return torchrun(nproc, "replicated_worker.py", what, base, env={"DIST_WORKER_TIMEOUT": "240"}, timeout=TIMEOUT)


def _start_death(how: str, base: str) -> List[subprocess.Popen]:
    """3 ranks without torchrun (which would end the others when one dies)."""
    return start_ranks(3, "replicated_worker.py", f"death-{how}", base, env={"DIST_WORKER_TIMEOUT": "240"})


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Dict[str, object]:
    base = tmp_path_factory.mktemp("replicated")
    out: Dict[str, object] = {"base": str(base)}
    deaths = {how: _start_death(how, str(base)) for how in ("same", "changed")}
    try:
        out["save2"] = _torchrun(2, "save2", str(base))
        out["main4"] = _torchrun(4, "main4", str(base))
        out["restore2"] = _torchrun(2, "restore2", str(base))
        for how, procs in deaths.items():
            out[f"death-{how}"] = [finish(p, TIMEOUT) for p in procs]
    finally:
        for procs in deaths.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for name in ("save2", "main4", "restore2"):
        (base / f"{name}.log").write_text(out[name].stdout)  # for a post-mortem
    return out


def _passed(jobs, job: str, check: str, ranks: int) -> None:
    proc = jobs[job]
    text = proc.stdout
    for r in range(ranks):
        if f"{check} RANK {r} OK" not in text:
            mine = [ln for ln in text.splitlines() if check in ln or "STATS" in ln or "Error" in ln]
            pytest.fail(f"{job}: {check} did not pass on rank {r} (exit {proc.returncode}):\n"
                        + "\n".join(mine[-30:]) + "\n----\n" + text[-3000:])


def _stats(jobs, job: str, name: str):
    """The JSON value of the job's ``STATS <name>`` line (another rank's output may come before or
    after it on the same line: the ranks share one stdout)."""
    tag = f"STATS {name} "
    for ln in jobs[job].stdout.splitlines():
        at = ln.find(tag)
        if at >= 0:
            return json.JSONDecoder().raw_decode(ln[at + len(tag):])[0]
    return None


# ---- DDP-style state -------------------------------------------------------------------------------

@pytest.mark.parametrize("job,ranks", [("save2", 2), ("main4", 4)])
def test_ddp_state_each_replicated_byte_staged_once_balanced_and_restored_bitwise(jobs, job, ranks):
    """4 replicated tensors of 256 KiB + 16 KiB per rank: the ranks' SaveStats.nbytes sum to the
    state's bytes (within 5%), max/min within 2x; the data files hold it once; restores at the
    same world size (auto / once / every_rank) are bitwise (tests/workers/replicated_worker.py ddp_save)."""
    _passed(jobs, job, "DDP SAVE", ranks)
    shares = _stats(jobs, job, f"ddp{ranks}.step2")["nbytes"]
    assert len(shares) == ranks and all(s > 0 for s in shares), shares


@pytest.mark.parametrize("job,ranks", [("save2", 2), ("main4", 4)])
def test_replicated_saves_false_stages_everything_on_every_rank(jobs, job, ranks):
    _passed(jobs, job, "DDP LEGACY", ranks)


def test_ddp_checkpoint_of_two_ranks_restores_at_four(jobs):
    _passed(jobs, "main4", "DDP FROM 2", 4)


def test_ddp_checkpoint_of_four_ranks_restores_at_two(jobs):
    _passed(jobs, "restore2", "DDP FROM 4", 2)


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_checkpoints_restore_in_one_process(jobs, world):
    """Both DDP-style checkpoints load in one process, every rank's part bitwise, through a
    1-process manager and through plain ``torch.distributed.checkpoint.load``."""
    _passed(jobs, "save2" if world == 2 else "main4", "DDP SAVE", world)
    root = os.path.join(jobs["base"], f"ddp{world}")

    def whole(step: int):
        sd = {"model": ddp_model(step), "step": step}
        sd.update({f"rank{r}": {"x": own(step, r)} for r in range(world)})
        return sd

    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1, 2]
        for step in (1, 2):
            target = blank(whole(0))
            assert mgr.restore(step, target) == step
            assert_bitwise_equal(target, whole(step))
    target = blank(whole(0))
    target.pop("step")  # a plain dcp.load: the tensors (the non-tensor value is checked above)
    dcp.load(target, checkpoint_id=os.path.join(root, "2"))
    want = whole(2)
    want.pop("step")
    assert_bitwise_equal(target, want)


def test_structure_changes_between_saves_still_stage_once_and_restore_bitwise(jobs):
    """A key added, a shape changed, a key held by 2 of 4 ranks, then the first structure again:
    each save stages each replicated byte once and every step restores bitwise."""
    _passed(jobs, "main4", "STRUCTURE", 4)


# ---- FSDP2 and HSDP -----------------------------------------------------------------------------------

@pytest.mark.parametrize("job,ranks", [("save2", 2), ("main4", 4)])
def test_fsdp2_restores_bitwise_at_the_same_world_size(jobs, job, ranks):
    _passed(jobs, job, "FSDP SAVE", ranks)


def test_fsdp2_restores_bitwise_at_another_world_size(jobs):
    _passed(jobs, "main4", "FSDP FROM 2", 4)
    _passed(jobs, "restore2", "FSDP FROM 4", 2)


def test_fsdp2_checkpoint_restores_in_one_process(jobs):
    """The 4-rank FSDP2 checkpoint loads into a plain model and optimizer, bitwise."""
    _passed(jobs, "main4", "FSDP SAVE", 4)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(37, 50), torch.nn.ReLU(), torch.nn.Linear(50, 7))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 37)).sum().backward()
    optim.step()  # the optimizer's state exists, to be overwritten
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    with CheckpointManager(os.path.join(jobs["base"], "fsdp4")) as mgr:
        assert mgr.restore(1, sd) == 1
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = dict(zip(("model", "optim"), get_state_dict(model, optim)))
    ref = torch.load(os.path.join(jobs["base"], "fsdp4_ref.pt"), weights_only=True)
    assert_bitwise_equal(got, ref)


def test_hsdp_2x2_mesh_stages_each_chunk_once_and_restores_bitwise(jobs):
    """DTensors (Replicate(), Shard(0)) on a 2x2 mesh of 4 ranks: each chunk (held by 2 ranks)
    is staged by one; restores bitwise at 4 ranks (the same mesh)."""
    _passed(jobs, "main4", "HSDP SAVE", 4)


def test_hsdp_checkpoint_restores_at_two_ranks_and_in_one_process(jobs):
    _passed(jobs, "restore2", "HSDP FROM 4", 2)
    with CheckpointManager(os.path.join(jobs["base"], "hsdp4")) as mgr:
        for step in (1, 2):
            target = blank(hsdp_full(0))
            assert mgr.restore(step, target) == step
            assert_bitwise_equal(target, hsdp_full(step))


# ---- edge cases of the agreement and the transfer ------------------------------------------------------

def test_replicated_tensors_of_odd_byte_counts_and_mixed_dtypes_restore_bitwise_when_read_once(jobs):
    """float32/float64/bool/complex64/float16/int16/uint8/int64 tensors >= 64 KiB whose byte
    counts are not multiples of 8, read once and sent (packed into one buffer per reading
    rank): bitwise on every rank (tests/workers/replicated_worker.py odd_sizes)."""
    _passed(jobs, "main4", "ODD SIZES", 4)


def test_non_contiguous_replicated_tensors_restore_bitwise_into_non_contiguous_targets(jobs):
    """A transposed view and an every-other-column slice, saved and restored into targets of the
    same kind with ``once`` and ``every_rank``: bitwise, nothing written outside the targets."""
    _passed(jobs, "main4", "STRIDED TARGETS", 4)


def test_the_64_kib_threshold(jobs):
    """A replicated tensor of exactly 64 KiB is staged by one rank, one of 64 KiB - 4 bytes by
    every rank: the ranks' nbytes sum to 64 KiB + 4 x (64 KiB - 4)."""
    _passed(jobs, "main4", "THRESHOLD", 4)
    assert sum(_stats(jobs, "main4", "threshold4")) == 65536 + 4 * 65532


def test_lazy_saves_stage_each_replicated_byte_once_and_restore_bitwise(jobs):
    _passed(jobs, "main4", "LAZY", 4)


def test_incremental_saves_of_replicated_state_take_unchanged_files_and_restore_bitwise(jobs):
    _passed(jobs, "main4", "INCREMENTAL", 4)
    step2 = _stats(jobs, "main4", "incremental4.step2")
    assert sum(step2["referred"]) > sum(step2["written"]), step2


def test_declared_frozen_replicated_tensor_changed_raises_on_every_rank_and_restores_bitwise(jobs):
    """frozen= the replicated model's keys, checked at every save: one changed behind its version
    counter makes every rank raise (the rank that staged it: FrozenTensorChangedError naming it;
    the others: a CheckpointError naming that rank), and every committed step restores bitwise
    (the save that found the change wrote it in full)."""
    _passed(jobs, "main4", "FROZEN", 4)


def test_read_once_when_one_ranks_target_lacks_a_key(jobs):
    _passed(jobs, "main4", "PARTIAL TARGETS", 4)


def test_a_replicated_key_changing_dtype_and_shape_between_saves_restores_bitwise(jobs):
    _passed(jobs, "main4", "DTYPE CHANGE", 4)


# ---- reads, damage, tiers, failures -----------------------------------------------------------------

def test_large_values_that_differ_between_ranks_under_one_key_are_reported_once_and_recorded(jobs):
    """tests/workers/replicated_worker.py ``divergence``: a per-rank buffer, BatchNorm-like statistics and
    float32/int32 of equal bytes under one key (all >= 64 KiB, staged by one rank): rank 0 warns
    once per key, both steps' manifests list them in ``diverged_keys``, the checkpoint holds one
    rank's value of each (bitwise), with replicated_saves True and False."""
    _passed(jobs, "save2", "DIVERGED", 2)


def test_large_tensor_fingerprints_follow_values_not_strides_and_taken_samples_match_host_copies():
    """The fingerprint of a large tensor (a sample of it) is the same for equal values whatever
    their strides, taken from the live tensor at the call (a rank that leaves it to another) or
    from a host copy on the writer thread (the rank that stages it); it differs for other values
    (BatchNorm-like statistics, a permutation, another dtype of equal bytes)."""
    from async_ckpt.ranks.replicas import DroppedSamples, fingerprints
    from async_ckpt.staging import make_plan

    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 256, generator=g)
    live = {"w": w.t().contiguous().t(), "b": torch.randn(65536, generator=g),  # w: equal values, other strides
            "p": torch.randperm(65536, generator=g), "x": torch.arange(65536, dtype=torch.float32)}
    plan = make_plan(live)
    taken = DroppedSamples(plan, set(range(len(plan.tensors)))).prints()
    host = fingerprints({k: v.clone() for k, v in live.items()})
    assert taken == host and set(host) == {"w", "b", "p", "x"}
    assert fingerprints({"w": w})["w"] == host["w"]
    other = fingerprints({"b": torch.randn(65536, generator=g), "p": torch.randperm(65536, generator=g),
                          "x": torch.arange(65536, dtype=torch.float32).view(torch.int32)})
    assert all(other[k] != host[k] for k in other), (other, host)


def test_samples_taken_at_the_call_hold_the_values_at_the_call_for_every_dtype_and_layout():
    """The samples a rank takes of the tensors it leaves to others (one batched copy per device)
    fingerprint as the host copies of the same tensors do, for dtypes of every element size
    (bool, int8, bfloat16, float64, complex64), a transposed tensor, a small one and a view at an
    offset; and they are the values at the call: the tensors changed in place right after it
    (before the writer fingerprints the samples) do not change what is compared."""
    from async_ckpt.ranks.replicas import DroppedSamples, fingerprints
    from async_ckpt.staging import make_plan

    g = torch.Generator().manual_seed(3)
    base = torch.randn(40000, generator=g)
    live = {"bool": torch.rand(70000, generator=g) > 0.5,
            "int8": torch.randint(-128, 127, (70000,), dtype=torch.int8, generator=g),
            "bf16": torch.randn(300, 200, generator=g).to(torch.bfloat16),
            "f64": torch.randn(9000, generator=g, dtype=torch.float64),
            "c64": torch.randn(9000, generator=g, dtype=torch.complex64),
            "t": torch.randn(256, 512, generator=g).t(),
            "small": torch.randn(100, generator=g),
            "offset": base[7:40000]}
    plan = make_plan(live)
    at_call = fingerprints({k: v.clone() for k, v in live.items()})
    taken = DroppedSamples(plan, set(range(len(plan.tensors))))
    with torch.no_grad():  # the next training step, before the writer thread looks at the samples
        for v in live.values():
            v.copy_(torch.zeros_like(v) if v.dtype == torch.bool else v * 2 + 1)
    assert taken.prints() == at_call and set(at_call) == set(live)
    assert fingerprints({k: v.clone() for k, v in live.items()}) != at_call


def test_replicated_reads_once_reads_each_byte_once_across_ranks(jobs):
    """A counting fsspec filesystem over a local dir: with ``once`` (and ``auto``: not a local
    POSIX path) the 4 ranks read <= 1.05x the checkpoint's data bytes; with ``every_rank`` each
    rank reads the replicated tensors itself (>= ~4x them)."""
    _passed(jobs, "main4", "COUNTED READS", 4)
    stats = _stats(jobs, "main4", "counted4")
    data = stats["data_bytes"]
    assert sum(stats["reads"]["once"]) <= 1.05 * data < sum(stats["reads"]["every_rank"]), stats


def test_damage_in_a_replicated_record_read_by_one_rank_falls_back_on_every_rank(jobs):
    _passed(jobs, "main4", "DAMAGE", 4)


def test_a_save_due_for_the_local_tier_stages_everything_and_each_local_copy_restores_its_rank(jobs):
    """Step 1 (persistent root only) stages each replicated byte once; step 2 (local tier too)
    stages every rank's whole state; each rank's local copy of step 2 loads alone, bitwise."""
    _passed(jobs, "main4", "LOCAL TIER", 4)
    local = os.path.join(jobs["base"], "tiers4_local")
    for r in range(4):
        target = blank(ddp_state(0, r))
        target.pop("step")
        dcp.load(target, checkpoint_id=os.path.join(local, f"rank{r}", "2"))
        want = ddp_state(2, r)
        want.pop("step")
        assert_bitwise_equal(target, want)


@pytest.mark.parametrize("how", ["same", "changed"])
def test_a_rank_killed_before_the_save_exchange_makes_the_others_raise_within_the_timeout(jobs, how):
    """3 ranks, collective_timeout_s=10; rank 2 exits where it would save step 2 (``same``: the
    structure the ranks agreed on at step 1; ``changed``: a new key): ranks 0 and 1 raise a
    CheckpointError instead of hanging, and commit nothing for step 2."""
    outs = jobs[f"death-{how}"]
    assert outs[2][0] == 17, outs[2][1][-2000:]
    for r in (0, 1):
        rc, text = outs[r]
        assert rc == 0 and f"RANK {r} OK" in text, f"rank {r}: exit {rc}\n{text[-4000:]}"
        line = next(ln for ln in text.splitlines() if ln.startswith("RAISED"))
        seconds = float(line.split()[1])
        # bounded by the collective timeout, not gloo's 30 minutes (margin for a loaded machine)
        assert seconds < DEATH_TIMEOUT_S + 30, line


# ---- one process ---------------------------------------------------------------------------------------

def test_replicated_options_are_validated(tmp_path):
    for bad in ("twice", None, 1):
        with pytest.raises(InvalidArgumentError, match="replicated_reads"):
            CheckpointManager(str(tmp_path / "a"), replicated_reads=bad)
    for bad in ("yes", None, 1):
        with pytest.raises(InvalidArgumentError, match="replicated_saves"):
            CheckpointManager(str(tmp_path / "b"), replicated_saves=bad)


@pytest.mark.parametrize("saves", [True, False])
@pytest.mark.parametrize("reads", ["auto", "once", "every_rank"])
def test_one_process_saves_and_restores_bitwise_with_every_option(tmp_path, saves, reads):
    with CheckpointManager(str(tmp_path / "ck"), replicated_saves=saves, replicated_reads=reads) as mgr:
        assert mgr.save(1, ddp_state(1, 0))
        assert mgr.stats[-1].nbytes == sum(t.numel() * t.element_size() for t in ddp_model(1).values()) + 16 * 1024
        target = blank(ddp_state(0, 0))
        assert mgr.restore(1, target) == 1
        assert_bitwise_equal(target, ddp_state(1, 0))


_EQUAL_SMALL_WORKER = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from async_ckpt import CheckpointManager
    dist.init_process_group("gloo")
    # "small" is the same tensor on every rank (a replicated value under 64 KiB)
    with CheckpointManager(sys.argv[1]) as mgr:
        mgr.save(0, {"small": torch.arange(10.0), f"own{dist.get_rank()}": torch.ones(3)})
    dist.destroy_process_group()
""")


def test_equal_small_replicated_tensors_are_not_reported_as_differing_between_ranks(tmp_path):
    # replicas.fingerprints mixes in Python's hash() of the dtype's name, which differs between
    # processes (PYTHONHASHSEED): every small tensor all ranks hold looks diverged
    worker = tmp_path / "worker.py"
    worker.write_text(_EQUAL_SMALL_WORKER)
    root = str(tmp_path / "ck")
    out = torchrun(2, str(worker), root, env={"TMPDIR": str(tmp_path)},  # torchrun's own temp dirs
                   drop=["PYTHONHASHSEED"], timeout=240)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "differ between the ranks" not in out.stdout
    with CheckpointManager(root) as mgr:
        assert "diverged_keys" not in mgr.layout.read_manifest(0).extra
        got = {"small": torch.zeros(10), "own0": torch.zeros(3), "own1": torch.zeros(3)}
        mgr.restore(0, got)
    assert_bitwise_equal(got, {"small": torch.arange(10.0), "own0": torch.ones(3), "own1": torch.ones(3)})
