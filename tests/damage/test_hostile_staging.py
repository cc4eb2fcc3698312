"""Hostile staging: storages freed or swapped under a lazy save, and the host pool's bound.

A lazy save whose source storage is freed (``untyped_storage().resize_(0)``, as FSDP does with
unsharded parameters) or replaced (``set_()``) before its background copy runs must fail that
save with ``TornSnapshotError``, never read freed memory (CPU tensors, staged lazily through
``lazy_cpu_copies``: a lazy save otherwise copies them at the call). Each case runs in a
subprocess: a segfault there fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from async_ckpt.staging import Stager

from ..conftest import assert_bitwise_equal
from ..support.paths import REPO

SLACK = 64 * 1024  # the pool's small constant above 1.1x the need

_WORKER = textwrap.dedent(r"""
    import json, sys
    import torch
    from async_ckpt import CheckpointManager
    from async_ckpt.errors import TornSnapshotError
    from async_ckpt.testing import hold_copies, lazy_cpu_copies

    LAZY_CPU = lazy_cpu_copies()
    LAZY_CPU.__enter__()  # CPU tensors staged lazily for the whole run (kept referenced: entered until exit)
    mode, root = sys.argv[1], sys.argv[2]
    out = {}

    def same_bits(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    g = torch.Generator().manual_seed(0)
    base = torch.randn(2_000_000, generator=g)  # 8 MB: copied in the background
    if mode == "resize_span":  # two views of one storage: copied as one span of it
        sd = {"a": base[:1_000_000], "b": base[1_000_000:], "step": 1}
    else:
        sd = {"p": base, "q": torch.randn(300_000, generator=g), "step": 1}
    ref1 = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    with CheckpointManager(root, lazy=True) as mgr:
        mgr.save_async(1, sd)
        mgr.join()  # step 1 committed
        with hold_copies():
            mgr.save_async(2, sd)  # its copies wait behind the hold
            if mode == "resize":
                sd["p"].untyped_storage().resize_(0)
            elif mode == "resize_span":
                base.untyped_storage().resize_(0)
            elif mode == "set":
                sd["p"].set_(torch.zeros(10))
        try:
            mgr.join()
            out["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["error"] = type(exc).__name__
            out["torn"] = isinstance(exc, TornSnapshotError)
            out["message"] = str(exc)
            out["step"] = getattr(exc, "step", None)
        out["steps"] = mgr.all_steps()
        target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in ref1.items()}
        mgr.restore(1, target)
        out["step1_bitwise"] = all(same_bits(target[k], ref1[k]) for k in ref1 if isinstance(ref1[k], torch.Tensor))
        # the next save works
        sd3 = {"p": torch.randn(1_500_000, generator=g), "n": torch.arange(7), "step": 3}
        ref3 = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd3.items()}
        mgr.save_async(3, sd3)
        mgr.join()
        target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in ref3.items()}
        mgr.restore(3, target)
        out["step3_bitwise"] = all(same_bits(target[k], ref3[k]) for k in ref3 if isinstance(ref3[k], torch.Tensor))
        out["steps_after"] = mgr.all_steps()
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.parametrize("mode,name", [("resize", "p"), ("resize_span", "a"), ("set", "p")])
def test_lazy_save_of_freed_or_swapped_storage_fails_typed(tmp_path, mode, name):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = dict(os.environ, PYTHONPATH=REPO, PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, str(script), mode, str(tmp_path / "ckpt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker died (rc {proc.returncode}): {proc.stderr[-3000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    assert out["error"] == "TornSnapshotError" and out["torn"], out
    assert out["step"] == 2
    assert "freed, resized or replaced" in out["message"] and name in out["message"]
    assert out["steps"] == [1], "the failed save must not be committed"
    assert out["step1_bitwise"], "the committed earlier step must restore bit for bit"
    assert out["step3_bitwise"] and out["steps_after"] == [1, 3], "the next save must work"


# ---- the host pool's bound -------------------------------------------------------------------
def _need(snap) -> int:
    """The bytes a snapshot's buffers must hold: its tensors (the slab pads each to 64 B)."""
    return sum(b.numel() for lease in snap.leases for b in lease.buffers)


def _growing_state(i: int, g: torch.Generator):
    n = int(250_000 * 1.04 ** i)  # one tensor grows by 4% a save
    return {"fixed": {"w": torch.randn(500_000, generator=g), "v": torch.randn(300_001, generator=g)},
            "grow": torch.randn(n, generator=g), "small": torch.arange(5), "step": i}


def test_pool_stays_bounded_while_a_tensor_grows():
    g = torch.Generator().manual_seed(1)
    st = Stager()
    pool = st.pool
    max_need = 0
    fixed_ptrs = None
    allocs_after_first = None
    for i in range(30):
        sd = _growing_state(i, g)
        snap = st.stage(sd)
        assert_bitwise_equal(snap.state_dict, sd, f"save {i}")
        max_need = max(max_need, _need(snap))
        assert pool.allocated_bytes <= 1.1 * max_need + SLACK, (i, pool.allocated_bytes, max_need)
        ptrs = [snap.state_dict["fixed"][k].data_ptr() for k in ("w", "v")]
        if fixed_ptrs is None:
            fixed_ptrs, allocs_after_first = ptrs, pool.allocations
        assert ptrs == fixed_ptrs, "unchanged tensors keep their buffers while another one grows"
        snap.release()
        assert pool.leased_bytes == 0
        assert pool.allocated_bytes <= 1.1 * max_need + SLACK, (i, pool.allocated_bytes, max_need)
    regrown = pool.allocations - allocs_after_first
    assert regrown <= 20, f"the growing tensor reused its size class too rarely: {regrown} fresh buffers in 29 saves"


def test_pool_through_the_manager_is_bounded_by_default(tmp_path):
    from async_ckpt import CheckpointManager

    g = torch.Generator().manual_seed(2)
    max_need = 0
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:  # memory_budget_bytes=None
        pool = mgr.stager.pool
        for i in range(30):
            sd = _growing_state(i, g)
            mgr.save_async(i, sd, lazy=bool(i % 2))
            mgr.join()
            max_need = max(max_need, 4 * (800_001 + int(250_000 * 1.04 ** i)) + 64)
            assert pool.allocated_bytes <= 1.1 * max_need + SLACK, (i, pool.allocated_bytes, max_need)
        target = _growing_state(29, torch.Generator().manual_seed(99))  # same layout, other values
        mgr.restore(29, target)
        assert_bitwise_equal(target, sd)


def test_pool_drops_buffers_the_last_save_did_not_use():
    st = Stager()
    st.stage({"big": torch.zeros(2_000_000), "b2": torch.ones(1_000_000)}).release()
    assert st.pool.allocated_bytes == 12_000_000
    sd = {"w": torch.randn(100_000)}
    for _ in range(2):
        snap = st.stage(sd)
        assert_bitwise_equal(snap.state_dict, sd)
        snap.release()
    assert st.pool.allocated_bytes == 400_000, "buffers of an earlier, larger save must be released"


def test_pool_with_two_saves_in_flight_reuses_and_stays_bounded():
    g = torch.Generator().manual_seed(3)
    st = Stager()
    pool = st.pool
    peak_need = 0
    held = None
    for i in range(30):
        sd = _growing_state(i, g)
        snap = st.stage(sd)  # staged while the previous snapshot is still held
        assert_bitwise_equal(snap.state_dict, sd, f"save {i}")
        if held is not None:
            assert_bitwise_equal(held[0].state_dict, held[1])  # neither snapshot moves
            peak_need = max(peak_need, _need(snap) + _need(held[0]))
            assert pool.allocated_bytes <= 1.1 * peak_need + SLACK, (i, pool.allocated_bytes, peak_need)
            held[0].release()
        held = (snap, sd)
    held[0].release()
    assert pool.allocated_bytes <= 1.1 * peak_need + SLACK


@pytest.mark.parametrize("lazy", [False, True])
def test_steady_state_reuses_the_same_buffers(lazy):
    g = torch.Generator().manual_seed(4)
    sd = {"a": torch.randn(300_000, generator=g), "b": torch.randn(300_000, generator=g),
          "c": torch.randn(70_000, generator=g).double(), "s": torch.randn(10, generator=g), "n": 7}
    st = Stager()
    ptrs = allocs = None
    for i in range(5):
        snap = st.stage(sd, lazy=lazy)
        snap.wait_copied()
        assert_bitwise_equal(snap.state_dict, sd)
        now = {k: v.data_ptr() for k, v in snap.state_dict.items() if isinstance(v, torch.Tensor)}
        if ptrs is None:
            ptrs, allocs = now, st.pool.allocations
        assert now == ptrs, "an unchanged state dict gets the very same buffers every save"
        assert st.pool.allocations == allocs, "steady-state saves allocate nothing"
        snap.release()
        for v in sd.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_pinned_pool_stays_bounded_while_a_cuda_tensor_grows():
    st = Stager()
    pool = st.pool
    w = torch.randn(500_000, device="cuda")
    max_need = 0
    w_ptr = None
    for i in range(30):
        sd = {"w": w, "grow": torch.randn(int(250_000 * 1.04 ** i), device="cuda")}
        snap = st.stage(sd)
        assert all(b.is_pinned() for lease in snap.leases for b in lease.buffers)
        assert_bitwise_equal(snap.state_dict["grow"], sd["grow"].cpu())
        max_need = max(max_need, _need(snap))
        assert pool.allocated_bytes <= 1.1 * max_need + SLACK, (i, pool.allocated_bytes, max_need)
        w_ptr = w_ptr or snap.state_dict["w"].data_ptr()
        assert snap.state_dict["w"].data_ptr() == w_ptr
        snap.release()
        assert pool.allocated_bytes <= 1.1 * max_need + SLACK


@cuda
def test_lazy_cuda_save_of_freed_storage_fails_typed(tmp_path):
    from async_ckpt import CheckpointManager
    from async_ckpt.errors import TornSnapshotError

    p = torch.randn(2_000_000, device="cuda")
    with CheckpointManager(str(tmp_path / "ckpt"), lazy=True) as mgr:
        mgr.save_async(1, {"p": p})
        p.untyped_storage().resize_(0)  # the side-stream copy may not have read it yet
        with pytest.raises(TornSnapshotError, match="freed, resized or replaced"):
            mgr.join()
        assert mgr.all_steps() == []
        q = torch.randn(1000, device="cuda")
        mgr.save_async(2, {"q": q})
        mgr.join()
        target = {"q": torch.zeros(1000, device="cuda")}
        mgr.restore(2, target)
        assert_bitwise_equal(target["q"].cpu(), q.cpu())
