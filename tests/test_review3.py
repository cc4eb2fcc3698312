"""Review of issues 27/28 (incremental saves, replicated state): reproductions of bugs found.

Each test fails on the code it was written against and passes once the bug is fixed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from async_ckpt import CheckpointError, CheckpointManager

from .conftest import assert_bitwise_equal, clone_tree

N = 64 * 1024  # floats: 256 KiB, above the 64 KiB sharing threshold


def test_a_promoted_incremental_step_restores_from_the_persistent_root(tmp_path):
    # step 2 takes step 1's file whole (its first half, "a", is unchanged; "b" behind it is
    # stale); promote copies that file, so the persistent copy must still restore bitwise
    path, local = str(tmp_path / "p"), str(tmp_path / "l")
    sd = {"a": torch.arange(N, dtype=torch.float32), "b": torch.ones(N)}
    with CheckpointManager(path, save_interval=10, local_dir=local, local_policy=1, incremental=True) as mgr:
        mgr.save(1, sd)
        sd["b"] = sd["b"] + 1
        mgr.save(2, sd)
        mgr.promote(2)
    with CheckpointManager(path) as mgr:
        got = {"a": torch.zeros(N), "b": torch.zeros(N)}
        assert mgr.restore(2, got) == 2
    assert_bitwise_equal(got, clone_tree(sd))


def test_a_declared_frozen_tensor_restored_by_another_manager_is_saved_with_its_new_bytes(tmp_path):
    # restore() writes the file bytes into the target tensors without moving their version
    # counter, so a manager that declared the tensor frozen takes its old bytes from its last
    # step: the new step restores the bytes w had before the restore
    sd = {"w": torch.full((N,), 1.0), "x": torch.full((N,), 2.0)}
    with CheckpointManager(str(tmp_path / "other")) as other:
        other.save(0, {"w": torch.full((N,), 3.0), "x": torch.full((N,), 2.0)})
    with CheckpointManager(str(tmp_path / "run"), incremental=True, frozen=["w"]) as mgr:
        mgr.save(0, sd)
        mgr.save(1, sd)
        with CheckpointManager(str(tmp_path / "other")) as other:
            other.restore(0, sd)
        mgr.save(2, sd)
        got = {"w": torch.zeros(N), "x": torch.zeros(N)}
        mgr.restore(2, got)
    assert_bitwise_equal(got, clone_tree(sd))


def test_a_declared_frozen_xla_tensor_replaced_by_another_is_saved_with_the_new_bytes(tmp_path, xla_device):
    # an XLA tensor has no data pointer (version_of gives 0) and a new tensor's version counter
    # starts at 0 again, so the new tensor under the frozen key passes for the old one: the step
    # refers to the old tensor's bytes
    sd = {"w": torch.full((N,), 1.0, device=xla_device), "x": torch.full((N,), 2.0)}
    with CheckpointManager(str(tmp_path / "run"), incremental=True, frozen=["w"]) as mgr:
        mgr.save(0, sd)
        mgr.save(1, sd)
        sd["w"] = torch.full((N,), 5.0, device=xla_device)  # e.g. load_state_dict(assign=True)
        try:
            mgr.save(2, sd)
        except CheckpointError:
            pass  # FrozenTensorChangedError is a fine answer: step 2 must still hold the new bytes
        got = {"w": torch.zeros(N), "x": torch.zeros(N)}
        mgr.restore(2, got)
    assert_bitwise_equal(got, {"w": torch.full((N,), 5.0), "x": torch.full((N,), 2.0)})


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
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update({"OMP_NUM_THREADS": "1", "PJRT_DEVICE": "CPU", "TMPDIR": str(tmp_path),  # torchrun's own temp dirs
                "PYTHONPATH": os.pathsep.join([here, env.get("PYTHONPATH", "")])})
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(worker), root], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "differ between the ranks" not in out.stdout
    with CheckpointManager(root) as mgr:
        assert "diverged_keys" not in mgr.layout.read_manifest(0).extra
        got = {"small": torch.zeros(10), "own0": torch.zeros(3), "own1": torch.zeros(3)}
        mgr.restore(0, got)
    assert_bitwise_equal(got, {"small": torch.arange(10.0), "own0": torch.ones(3), "own1": torch.ones(3)})
