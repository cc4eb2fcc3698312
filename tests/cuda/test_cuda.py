"""CUDA staging: pinned pooled buffers, side-stream copies. Skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.staging import Stager

from ..conftest import assert_bitwise_equal, flip_data_byte

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


def test_cuda_targets_restore_by_direct_reads_and_stay_untouched_when_damaged(tmp_path, monkeypatch):
    """CUDA targets are read into pinned host stand-ins by the direct path, verified, then copied
    on a side stream: the same objects, bitwise equal to a plain dcp.load; a damaged file
    leaves them untouched."""
    import os

    import torch.distributed.checkpoint as dcp

    from async_ckpt.errors import CorruptCheckpointError
    from async_ckpt.io import step_io

    calls = []
    real = step_io.read_direct
    monkeypatch.setattr(step_io, "read_direct", lambda *a, **k: calls.append(True) or real(*a, **k))
    root = str(tmp_path / "c")
    sd = _state()
    with CheckpointManager(root) as mgr:
        mgr.save(0, sd)
    target = {"w": torch.zeros(1024, 1024, device="cuda"), "b": torch.zeros(1024, device="cuda").half(),
              "small": [torch.zeros(16, device="cuda") for _ in range(50)], "cpu": torch.zeros(10, dtype=torch.long)}
    w = target["w"]
    CheckpointManager(root).restore(0, target)
    assert calls == [True] and target["w"] is w
    slow = {"w": torch.zeros(1024, 1024, device="cuda"), "b": torch.zeros(1024, device="cuda").half(),
            "small": [torch.zeros(16, device="cuda") for _ in range(50)], "cpu": torch.zeros(10, dtype=torch.long)}
    dcp.load(slow, checkpoint_id=os.path.join(root, "0"), no_dist=True)
    assert_bitwise_equal({k: v for k, v in target.items()}, slow)
    flip_data_byte(os.path.join(root, "0"), mask=0xFF)
    fresh = {"w": torch.full((1024, 1024), 7.0, device="cuda"), "b": torch.zeros(1024, device="cuda").half(),
             "small": [torch.zeros(16, device="cuda") for _ in range(50)], "cpu": torch.zeros(10, dtype=torch.long)}
    with pytest.raises(CorruptCheckpointError):
        CheckpointManager(root).restore(0, fresh)
    assert torch.equal(fresh["w"], torch.full((1024, 1024), 7.0, device="cuda"))  # CUDA targets untouched
