"""The XLA path, for real, on PJRT CPU (PJRT_DEVICE=CPU)."""

from __future__ import annotations

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.staging import Stager
from async_ckpt.staging import xla as backends

from ..conftest import assert_bitwise_equal

pytestmark = pytest.mark.xla


def _xla_state(dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {"w": w.to(dev), "b": torch.randn(32, generator=g).to(dev),
                  "h": torch.randn(4, 4, generator=g).half().to(dev), "i": torch.arange(10).to(dev)},
        "step": 5,
    }


def test_xla_round_trip_bitwise(ckpt_dir, xla_device):
    sd = _xla_state(xla_device)
    expected = {k: ({n: t.cpu() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in sd.items()}
    with CheckpointManager(ckpt_dir) as mgr:
        assert mgr.save_async(0, sd)
        # pending (lazy) XLA computation after the call does not change the snapshot
        sd["model"]["w"].add_(100.0)
        sd["model"]["b"].mul_(0.0)
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
    CheckpointManager(ckpt_dir).restore(0, target)
    assert target["model"]["w"].device.type == "xla"
    got = {"model": {k: v.cpu() for k, v in target["model"].items()}, "step": target["step"]}
    assert_bitwise_equal(expected, got)


def test_xla_pending_computation_is_materialised_before_snapshot(ckpt_dir, xla_device):
    x = torch.ones(16, device=xla_device)
    y = x * 3 + 1  # not yet executed: lazy IR
    with CheckpointManager(ckpt_dir) as mgr:
        mgr.save(0, {"y": y})
    t = {"y": torch.zeros(16)}
    CheckpointManager(ckpt_dir).restore(0, t)
    assert torch.equal(t["y"], torch.full((16,), 4.0))


def test_xla_zero_copy_view_is_used_and_reuses_pool(xla_device):
    sd = _xla_state(xla_device)
    assert backends.xla_host_views([sd["model"]["w"]]) is not None, "PJRT CPU exposes host buffers via DLPack"
    st = Stager()
    s1 = st.stage(sd)
    s1.release()
    allocs = st.pool.allocations
    s2 = st.stage(sd)
    assert st.pool.allocations == allocs, "steady-state XLA saves must not allocate host memory"
    assert_bitwise_equal(s2.state_dict["model"]["w"], sd["model"]["w"].cpu())
    s2.release()


def test_xla_batched_fallback_matches(xla_device, monkeypatch):
    sd = _xla_state(xla_device)
    monkeypatch.setattr("async_ckpt.staging.eager.xla_host_views", lambda ts: None)
    snap = Stager().stage(sd)
    for k, v in sd["model"].items():
        assert_bitwise_equal(snap.state_dict["model"][k], v.cpu())
    snap.release()


def test_xla_tied_parameters_staged_once(xla_device):
    w = torch.randn(8, 8).to(xla_device)
    snap = Stager().stage({"a": w, "b": w})
    assert snap.state_dict["a"] is snap.state_dict["b"]
    snap.release()



_RACE = r"""
import torch, torch_xla
from async_ckpt.staging import Stager
dev = torch_xla.device()
# big tensors (DLPack views) and small ones (read by buffer address)
xs = [torch.randn(1 << 20).to(dev) for _ in range(16)] + [torch.randn(256).to(dev) for _ in range(200)]
torch_xla.sync()
st = Stager()
for rep in range(40):
    xs = [x * 1.0001 + 1 for x in xs]
    torch_xla.sync()  # asynchronous: the outputs may not exist yet when the stage starts
    snap = st.stage({str(i): x for i, x in enumerate(xs)})
    for i, x in enumerate(xs):
        assert torch.equal(snap.state_dict[str(i)], x.cpu()), (rep, i)
    snap.release()
print("RACE-OK")
"""


def test_xla_stage_right_after_async_sync_does_not_abort(xla_device):
    """A training loop's ``torch_xla.sync()`` returns before the execution finishes; a DLPack
    view of an output taken then aborted the process. Run in a subprocess: an abort is fatal."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, "-c", _RACE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "RACE-OK" in proc.stdout, proc.stderr[-2000:]


_HOST_DATA = r"""
import sys, torch, torch_xla
from async_ckpt import CheckpointManager
dev = torch_xla.device()
g = torch.Generator().manual_seed(0)
cpu = {"big": torch.randn(512, 512, generator=g), "small": torch.randn(7, generator=g)}
for step, lazy in ((0, False), (1, True)):
    sd = {k: v.to(dev) for k, v in cpu.items()}  # the data stays on the host until a sync
    with CheckpointManager(sys.argv[1]) as mgr:
        mgr.save_async(step, sd, lazy=lazy)
    t = {k: torch.zeros_like(v) for k, v in cpu.items()}
    CheckpointManager(sys.argv[1]).restore(step, t)
    assert all(torch.equal(t[k], cpu[k]) for k in cpu), step
print("HOST-DATA-OK")
"""


def test_xla_tensor_holding_host_data_is_staged_without_dlpack(xla_device, tmp_path):
    """With ``XLA_TENSOR_UPDATE_SYNC=0`` (as always under SPMD) a copy from the CPU keeps the
    data on the host until the next sync: such a tensor has no PJRT buffer, and ``_to_dlpack``
    on it ended the process. Run in a subprocess: an abort is fatal."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PJRT_DEVICE="CPU", XLA_TENSOR_UPDATE_SYNC="0")
    proc = subprocess.run([sys.executable, "-c", _HOST_DATA, str(tmp_path / "ckpt")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "HOST-DATA-OK" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("lazy", [False, True])
def test_xla_states_a_training_loop_hands_over_are_staged_bitwise(xla_device, lazy):
    """Without SPMD: a tensor never synced since ``.to()``, pending work, views, and a model and
    optimizer right after ``optimizer.step()`` without a sync (expected values computed on the
    CPU, or read after the stage)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 48, generator=g)
    a = x.to(xla_device)
    model = torch.nn.Linear(48, 8).to(xla_device)
    optim = torch.optim.AdamW(model.parameters())
    model(a).square().sum().backward()
    optim.step()  # no sync: parameters and optimizer state are pending
    sd = {"unsynced": x.to(xla_device), "pending": a * 2 + 1, "rows": a[3:40], "t": a.t(),
          "model": model.state_dict(), "optim": optim.state_dict()}
    snap = Stager().stage(sd, lazy=lazy)
    snap.wait_copied()
    got = snap.state_dict
    for k, want in (("unsynced", x), ("pending", x * 2 + 1), ("rows", x[3:40]), ("t", x.t())):
        assert_bitwise_equal(got[k], want)
    assert_bitwise_equal(got["model"], {k: v.cpu() for k, v in model.state_dict().items()})
    assert_bitwise_equal(got["optim"]["state"][0]["exp_avg"], optim.state[model.weight]["exp_avg"].cpu())
    snap.release()
