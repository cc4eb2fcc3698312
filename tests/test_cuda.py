"""CUDA staging: pinned pooled buffers, side-stream copies. Skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.staging import Stager

from .conftest import assert_bitwise_equal

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(1024, 1024, generator=g).cuda(),
        "b": torch.randn(1024, generator=g).cuda().half(),
        "small": [torch.randn(16, generator=g).cuda() for _ in range(50)],
        "cpu": torch.arange(10),
    }


def test_cuda_buffers_are_pinned_and_reused():
    sd = _state()
    st = Stager()
    snap = st.stage(sd)
    assert all(b.is_pinned() for lease in snap.leases for b in lease.buffers)
    assert_bitwise_equal(snap.state_dict["w"], sd["w"].cpu())
    snap.release()
    allocs = st.pool.allocations
    st.stage(sd).release()
    assert st.pool.allocations == allocs


def test_cuda_round_trip_and_mutation_after_call(tmp_path):
    sd = _state()
    expected = {"w": sd["w"].cpu(), "b": sd["b"].cpu(), "small": [t.cpu() for t in sd["small"]], "cpu": sd["cpu"].clone()}
    with CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.save_async(0, sd)
        sd["w"].mul_(-3)  # queued on the training stream right after the call
        for t in sd["small"]:
            t.zero_()
    target = {"w": torch.zeros(1024, 1024, device="cuda"), "b": torch.zeros(1024, device="cuda").half(),
              "small": [torch.zeros(16, device="cuda") for _ in range(50)], "cpu": torch.zeros(10, dtype=torch.long)}
    CheckpointManager(str(tmp_path / "c")).restore(0, target)
    got = {"w": target["w"].cpu(), "b": target["b"].cpu(), "small": [t.cpu() for t in target["small"]], "cpu": target["cpu"]}
    assert_bitwise_equal(expected, got)
