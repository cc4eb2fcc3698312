"""Review of issues 27/28 (incremental saves, replicated state): reproductions of bugs found.

Each test fails on the code it was written against and passes once the bug is fixed.
"""

from __future__ import annotations

import torch

from async_ckpt import CheckpointManager

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
