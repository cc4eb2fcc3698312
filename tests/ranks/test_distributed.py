"""Multi-process checkpoints on CPU: real torchrun jobs (gloo, FSDP2) and XLA SPMD on PJRT CPU.

One module fixture launches everything once (a torchrun start costs 6-16 s, more on a loaded
machine): a 4-rank job that saves and runs the failure checks (tests/workers/dist_worker.py ``save``),
then a 2-rank job that restores its checkpoint (``restore``); an SPMD job with 4 virtual XLA
devices runs at the same time (tests/workers/spmd_worker.py). The tests below read their outcomes, and
restore the 4-rank checkpoint in this process, without any process group.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.ranks.exchange import LocalExchange, exchange_for

from ..conftest import assert_bitwise_equal
from ..support.launch import finish, start_ranks, torchrun, worker_env
from ..support.paths import WORKERS

pytestmark = pytest.mark.slow

TIMEOUT = 240  # per job; the workers dump their stacks and exit after DIST_WORKER_TIMEOUT


def _env(**extra: str) -> dict:
    return worker_env(**{"DIST_WORKER_TIMEOUT": "180", **extra})


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return torchrun(nproc, "dist_worker.py", *args, env={"DIST_WORKER_TIMEOUT": "180"}, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dist")
    root, ref = str(base / "ckpt"), str(base / "ref.pt")
    spmd = None
    if importlib.util.find_spec("torch_xla") is not None:
        spmd = subprocess.Popen([sys.executable, os.path.join(WORKERS, "spmd_worker.py"), str(base / "spmd")],
                                env=_env(CPU_NUM_DEVICES="4"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    spmd_out = None
    try:
        save = _torchrun(4, "save", root, ref)
        restore = _torchrun(2, "restore", root, ref) if save.returncode == 0 else None
        if spmd is not None:
            spmd_out, _ = spmd.communicate(timeout=TIMEOUT)
    finally:
        if spmd is not None and spmd.poll() is None:
            spmd.kill()
            spmd.wait()
    for name, out in (("save", save.stdout), ("restore", restore.stdout if restore else ""), ("spmd", spmd_out)):
        (base / f"{name}.log").write_text(out or "")  # for a post-mortem
    return {"root": root, "ref": ref, "save": save, "restore": restore,
            "spmd": None if spmd is None else (spmd.returncode, spmd_out)}


def _ok(proc: subprocess.CompletedProcess, ranks: int) -> None:
    key = [ln for ln in proc.stdout.splitlines() if "Error" in ln or "RANK" in ln or "Timeout" in ln]
    tail = "\n".join(key[-40:]) + "\n----\n" + proc.stdout[-3000:]
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{tail}"
    for r in range(ranks):
        assert f"RANK {r} OK" in proc.stdout, f"rank {r} did not finish:\n{tail}"


def test_four_ranks_save_commit_retention_and_rank_failures(jobs):
    """4 ranks: sharded async saves, one commit, retention agreed, a failed write and a failed
    staging on one rank raise on every rank and commit nothing, and the next save commits."""
    _ok(jobs["save"], 4)


def test_restore_with_two_ranks_reshards_bitwise(jobs):
    assert jobs["restore"] is not None, "the 4-rank save job failed"
    _ok(jobs["restore"], 2)


def test_two_ranks_restore_of_a_step_damaged_in_one_ranks_shard_writes_neither_target(jobs):
    """tests/workers/dist_worker.py ``damaged_peer_checks``: a record only rank 1 reads is damaged;
    restore raises on both ranks, atomic=True or not, and neither rank's target changes;
    restore(None) falls back to the older step with nothing of the damaged one left."""
    assert jobs["restore"] is not None, "the 4-rank save job failed"
    for r in range(2):
        assert f"PEER DAMAGE RANK {r} OK" in jobs["restore"].stdout, jobs["restore"].stdout[-3000:]


def test_restore_in_one_process_without_process_group(jobs):
    """The 4-rank checkpoint loads into a plain (unsharded) model and optimizer, bitwise."""
    _ok(jobs["save"], 4)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(37, 50), torch.nn.ReLU(), torch.nn.Linear(50, 7))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd, "extra": {"replicated": torch.zeros(1000), "step": 0}}
    with CheckpointManager(jobs["root"]) as mgr:
        assert mgr.all_steps() == [3, 6]
        assert mgr.restore(None, sd) == 6
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = dict(zip(("model", "optim"), get_state_dict(model, optim)))
    ref = torch.load(jobs["ref"], weights_only=True)
    assert_bitwise_equal(got, ref)
    assert torch.equal(sd["extra"]["replicated"], torch.arange(1000, dtype=torch.float32) + 6)
    assert sd["extra"]["step"] == 6


def test_two_rank_shards_restore_in_one_process_past_a_damaged_step(jobs):
    """The 2-rank job's checkpoint of sharded tensors (its files list their records; step 2 has
    a flipped byte in rank 1's shard) restores in one process without a process group: step 2
    is skipped, step 1 loads whole, bitwise."""
    assert jobs["restore"] is not None, "the 4-rank save job failed"
    _ok(jobs["restore"], 2)
    import json

    root = jobs["root"] + "_ranges"
    with open(os.path.join(root, "1", "manifest.json")) as f:
        files = json.load(f)["files"]
    assert all("records" in rec for name, rec in files.items() if name.endswith(".distcp")), files
    g = torch.Generator().manual_seed(1)
    want = {"w": torch.randn(128, 4096, generator=g), "v": torch.randn(128, 300, generator=g).to(torch.bfloat16),
            "replicated": torch.arange(5000, dtype=torch.float64) + 1, "step": 1}
    sd = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in want.items()}
    with CheckpointManager(root) as mgr:
        with pytest.warns(RuntimeWarning, match="checksum mismatch"):
            assert mgr.restore(None, sd) == 1
    assert_bitwise_equal(sd, want)


def test_xla_spmd_local_shards_restore_into_another_mesh(jobs):
    if jobs["spmd"] is None:
        pytest.skip("torch_xla is not installed")
    rc, out = jobs["spmd"]
    assert rc == 0 and "SPMD OK" in out, out[-6000:]


@pytest.fixture(scope="module")
def ranks_job(tmp_path_factory):
    """tests/workers/dist_worker.py ``ranks``: one small 2-rank launch for the checks below."""
    base = tmp_path_factory.mktemp("ranks")
    return torchrun(2, "dist_worker.py", "ranks", str(base / "ck"), "-", env={"DIST_WORKER_TIMEOUT": "90"},
                    timeout=TIMEOUT)


def test_two_ranks_save_and_restore_steps_past_int64_as_one_process(ranks_job):
    """Steps 2**63 - 1, 2**63 and 2**70 save, list, restore (by number and None) and delete
    with 2 ranks as in one process; ranks naming different such steps still all raise."""
    for r in range(2):
        assert f"BIG STEPS RANK {r} OK" in ranks_job.stdout, ranks_job.stdout[-4000:]


def test_one_ranks_failing_load_state_dict_raises_on_every_rank(ranks_job):
    """A Stateful value whose load_state_dict raises on rank 1 only: restore raises on both
    ranks, naming rank 1, and the next save and restore pair up."""
    for r in range(2):
        assert f"STATEFUL RANK {r} OK" in ranks_job.stdout, ranks_job.stdout[-4000:]
    _ok(ranks_job, 2)


def test_the_metrics_of_several_ranks_are_reduced_as_asked(ranks_job):
    """metrics_reduce="rank0" | "mean" | "min" | "max": what the step records (and KeepBest ranks)."""
    for r in range(2):
        assert f"METRICS RANK {r} OK" in ranks_job.stdout, ranks_job.stdout[-4000:]


def test_one_ranks_failing_state_dict_raises_on_every_rank_at_once(ranks_job):
    """A Stateful value whose state_dict() raises on rank 1 only, in a save and in a restore:
    both ranks raise within seconds (not the 300 s collective timeout), naming rank 1 and its
    error, and the next save and restore work on both ranks."""
    for r in range(2):
        assert f"STATE_DICT RANK {r} OK" in ranks_job.stdout, ranks_job.stdout[-4000:]


def test_after_a_collective_timeout_later_calls_fail_at_once_and_a_new_manager_works(ranks_job):
    """A rank stalls past collective_timeout_s: every later save or restore of that manager
    raises a CoordinationError at once on both ranks (never a second wait, never a silent
    mismatch), and a new manager saves and restores."""
    for r in range(2):
        assert f"TIMEOUT RANK {r} OK" in ranks_job.stdout, ranks_job.stdout[-4000:]


@pytest.fixture(scope="module")
def coordination_job(tmp_path_factory):
    """tests/workers/dist_worker.py ``coordination``: one small 2-rank launch for the checks below."""
    base = tmp_path_factory.mktemp("coordination")
    return torchrun(2, "dist_worker.py", "coordination", str(base / "ck"), "-", env={"DIST_WORKER_TIMEOUT": "120"},
                    timeout=TIMEOUT)


def test_ranks_in_different_calls_raise_coordination_error_on_every_rank(coordination_job):
    """Rank 0 restores while rank 1 saves, and the other way round: every rank raises a
    CoordinationError naming both calls (no gloo abort), and the manager then saves and restores."""
    for r in range(2):
        assert f"DIFFERENT CALLS RANK {r} OK" in coordination_job.stdout, coordination_job.stdout[-4000:]


def test_a_local_save_that_failed_on_one_rank_is_listed_on_no_rank(coordination_job):
    """A local save failed on rank 1 only: a new manager lists the same steps on both ranks, without
    rank 0's copy of it, and restore(latest_step()) works on both."""
    for r in range(2):
        assert f"FAILED LOCAL SAVE RANK {r} OK" in coordination_job.stdout, coordination_job.stdout[-4000:]


def test_a_local_dir_another_job_holds_is_refused_at_construction_on_every_rank(coordination_job):
    """Another job holds rank 0's local directory: the manager is refused at construction on both
    ranks (LeaseHeldError on rank 0), not a log line per save and no local copy; it opens once
    the other job is gone."""
    for r in range(2):
        assert f"SHARED LOCAL DIR RANK {r} OK" in coordination_job.stdout, coordination_job.stdout[-4000:]
    _ok(coordination_job, 2)


def test_a_manager_created_too_late_on_one_rank_raises_coordination_error(coordination_job):
    """Rank 1 creates its manager more than collective_timeout_s after rank 0: both raise a
    CoordinationError naming the timeout (was torch's DistStoreError); later managers work."""
    for r in range(2):
        assert f"LATE RANK RANK {r} OK" in coordination_job.stdout, coordination_job.stdout[-4000:]


def test_single_process_has_a_local_coordinator():
    assert isinstance(exchange_for(), LocalExchange)


def test_a_rank_that_dies_mid_save_makes_the_other_raise_within_the_timeout(tmp_path):
    procs = start_ranks(2, "dist_death_worker.py", str(tmp_path / "ck"), env={"DIST_WORKER_TIMEOUT": "180"})
    _, out0 = finish(procs[0], TIMEOUT)
    finish(procs[1], 60)
    assert procs[1].returncode == 17  # rank 1 really died mid-write (faulty_fs.DIE_STATUS)
    assert procs[0].returncode == 0, out0[-4000:]
    line = next(ln for ln in out0.splitlines() if ln.startswith("RAISED"))
    seconds = float(line.split()[1])
    assert seconds < 15 + 30, line  # bounded by the collective timeout (15 s), not gloo's 30 minutes
