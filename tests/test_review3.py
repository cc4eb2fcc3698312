"""Review of issues 27/28 (incremental saves, replicated state): reproductions of bugs found.

Each test fails on the code it was written against and passes once the bug is fixed.
"""

from __future__ import annotations

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
