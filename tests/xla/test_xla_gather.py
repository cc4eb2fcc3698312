"""Small XLA tensors staged by buffer address (staging/xla.py), for real on PJRT CPU."""

from __future__ import annotations

import pytest
import torch

from async_ckpt.staging import Stager
from async_ckpt.staging import eager as stager_mod
from async_ckpt.staging import xla as xla_gather

from ..conftest import assert_bitwise_equal

xla = pytest.mark.xla


def _mixed_state(dev, seed=0):
    """Small tensors of many dtypes, sizes (odd ones too) and kinds, plus big ones."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(6, 10, generator=g).to(dev)
    sd = {
        "f32": torch.randn(1000, generator=g),
        "bf16": torch.randn(37, generator=g).bfloat16(),
        "f16": torch.randn(3, 5, generator=g).half(),
        "i8": torch.randint(-128, 127, (3,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (1, 1, 7), dtype=torch.uint8, generator=g),
        "i64": torch.randint(-(2**40), 2**40, (9,), generator=g),
        "bool": torch.randint(0, 2, (11,), generator=g).bool(),
        "scalar": torch.tensor(2.5),
        "f64": torch.randn(4, 4, dtype=torch.float64, generator=g),
        "big": torch.randn(128, 1024, generator=g),  # 512 KiB: the DLPack path
        "exactly64k": torch.randn(16384, generator=g),  # the largest small tensor
        "empty": torch.empty(0, 3),
    }
    sd = {k: v.to(dev) for k, v in sd.items()}
    sd["mat"] = a
    sd["matT"] = a.T  # XLA views: materialised by the stage's sync, then read like the rest
    sd["row"] = a[2]
    for i in range(50):  # a run of one size, as a model's many norms and biases
        sd[f"layer{i}.bias"] = torch.randn(64, generator=g).to(dev)
    return sd


def _expected(sd):
    return {k: v.cpu() for k, v in sd.items()}


@xla
def test_small_xla_tensors_are_gathered_bitwise(xla_device, monkeypatch):
    sd = _mixed_state(xla_device)
    expected = _expected(sd)
    seen = []
    real = stager_mod.xla_host_views
    monkeypatch.setattr(stager_mod, "xla_host_views", lambda ts: seen.extend(ts) or real(ts))
    st = Stager()
    snap = st.stage(sd)
    assert_bitwise_equal(snap.state_dict, expected)
    # Only the tensors the gather does not take went through DLPack: the big one and the empty one.
    assert sorted(t.nbytes for t in seen) == sorted([0, sd["big"].nbytes])
    snap.release()


@xla
def test_gather_reuses_the_pool_and_follows_new_values(xla_device):
    sd = _mixed_state(xla_device)
    st = Stager()
    s1 = st.stage(sd)
    s1.release()
    allocs = st.pool.allocations
    for rep in range(3):
        for k, v in sd.items():
            if v.dtype.is_floating_point and v.numel() and k not in ("matT", "row"):
                v.mul_(1.5).add_(rep)
        expected = _expected(sd)
        held = st.stage(sd)  # kept while the next one is taken: it must get other buffers
        assert_bitwise_equal(held.state_dict, expected)
        nxt = st.stage(sd)
        assert_bitwise_equal(nxt.state_dict, expected)
        assert nxt.state_dict["layer0.bias"].data_ptr() != held.state_dict["layer0.bias"].data_ptr()
        for k, v in sd.items():  # training goes on: neither snapshot moves
            if v.dtype.is_floating_point and v.numel() and k not in ("matT", "row"):
                v.add_(1000)
        assert_bitwise_equal(held.state_dict, expected)
        assert_bitwise_equal(nxt.state_dict, expected)
        held.release()
        nxt.release()
    assert st.pool.allocations == 2 * allocs, "a second snapshot in flight needs its own buffers, no more"


@xla
def test_layout_change_is_followed(xla_device):
    st = Stager()
    sd = {f"t{i}": torch.full((8,), float(i)).to(xla_device) for i in range(20)}
    st.stage(sd).release()
    sd["t3"] = torch.arange(12, dtype=torch.int32).reshape(3, 4).to(xla_device)  # new dtype and shape
    sd["t4"] = torch.ones(5).to(xla_device)
    snap = st.stage(sd)
    assert_bitwise_equal(snap.state_dict, _expected(sd))
    assert snap.state_dict["t3"].shape == (3, 4) and snap.state_dict["t3"].dtype == torch.int32
    snap.release()


@xla
def test_tied_small_tensors_fall_back_and_stay_shared(xla_device, monkeypatch):
    b = torch.randn(16).to(xla_device)
    sd = {"enc.bias": b, "dec.bias": b, "other": torch.randn(16).to(xla_device)}
    snap = Stager().stage(sd)
    assert snap.state_dict["enc.bias"] is snap.state_dict["dec.bias"]
    assert_bitwise_equal(snap.state_dict, _expected(sd))
    snap.release()


def _reads_by_address(monkeypatch, sd):
    """Record every read by address (the gather); first, as a positive control, stage ``sd`` as
    it is and check that it is read by address, so that an empty record later means the read was
    skipped, not that the spy sits where the call no longer goes."""
    reads = []
    real = xla_gather.gather
    monkeypatch.setattr(xla_gather, "gather", lambda *a: reads.append(a[1]) or real(*a))
    Stager().stage(sd).release()
    assert reads, "control: this state is read by address when nothing stops it"
    reads.clear()
    return reads


@xla
def test_failed_check_falls_back_to_dlpack(xla_device, monkeypatch):
    """When DLPack does not confirm an address (another PJRT device, a changed layout), the
    tensors take the DLPack path and nothing is read by address."""
    sd = _mixed_state(xla_device, seed=3)
    reads = _reads_by_address(monkeypatch, sd)
    monkeypatch.setattr(xla_gather, "_probe_ok", lambda t, addr: False)
    snap = Stager().stage(sd)
    assert_bitwise_equal(snap.state_dict, _expected(sd))
    assert reads == [], "read by address after a failed check"
    snap.release()


@xla
def test_probe_checks_address_and_layout(xla_device):
    import torch_xla

    t = torch.randn(4, 6).to(xla_device)
    torch_xla.sync()
    addr = torch_xla._XLAC._unsafe_buffer_pointer(t)
    assert xla_gather._probe_ok(t, addr)
    assert not xla_gather._probe_ok(t, addr + 64)


@xla
def test_without_the_binding_everything_goes_through_dlpack(xla_device, monkeypatch):
    sd = _mixed_state(xla_device, seed=4)
    reads = _reads_by_address(monkeypatch, sd)
    monkeypatch.setattr(xla_gather, "_buffer_address_of", lambda: None)
    snap = Stager().stage(sd)
    assert_bitwise_equal(snap.state_dict, _expected(sd))
    assert reads == [], "no addresses to read"
    snap.release()


def _checked(monkeypatch):
    """Record how many tensors each pending-work check covers."""
    import torch_xla

    sizes = []
    real = torch_xla._XLAC._check_tensor_need_materialization
    monkeypatch.setattr(torch_xla._XLAC, "_check_tensor_need_materialization",
                        lambda ts: sizes.append(len(ts)) or real(ts))
    return sizes


@xla
def test_pending_work_on_small_tensors_is_synced_before_they_are_read(xla_device, monkeypatch):
    """Small tensors are read by address before any pending-work check; one with pending work
    has no buffer to read, so the stage syncs everything and reads again, then keeps syncing
    first until a sync finds nothing pending."""
    import torch_xla

    cpu = {f"s{i}": torch.arange(16, dtype=torch.float32) + i for i in range(30)}
    cpu["big"] = torch.arange(40_000, dtype=torch.float32)
    sd = {k: v.to(xla_device) for k, v in cpu.items()}
    torch_xla.sync()
    st = Stager()
    st.stage(sd).release()
    checked = _checked(monkeypatch)
    for rep in range(3):
        for k in ("s0", "s17", "big"):  # pending in-place work, not synced
            sd[k].mul_(2).add_(rep)
            cpu[k].mul_(2).add_(rep)
        snap = st.stage(sd)
        assert_bitwise_equal(snap.state_dict, cpu)  # integers in float32: exact on both sides
        snap.release()
        assert st.xla_gather.sync_first, "pending work seen: the next save syncs first"
    checked.clear()
    snap = st.stage(sd)  # nothing pending now: the sync-first save finds none and stops it
    assert_bitwise_equal(snap.state_dict, cpu)
    snap.release()
    assert checked == [31] and not st.xla_gather.sync_first
    checked.clear()
    snap = st.stage(sd)
    assert_bitwise_equal(snap.state_dict, cpu)
    snap.release()
    assert checked == [1], "only the big tensor is checked for pending work"


@xla
def test_pending_work_on_a_big_tensor_is_still_synced(xla_device, monkeypatch):
    import torch_xla

    cpu = {f"s{i}": torch.arange(16, dtype=torch.float32) * i for i in range(30)}
    cpu["big"] = torch.arange(40_000, dtype=torch.float32)
    sd = {k: v.to(xla_device) for k, v in cpu.items()}
    torch_xla.sync()
    st = Stager()
    st.stage(sd).release()
    sd["big"].add_(3)  # pending; every small tensor ready
    cpu["big"].add_(3)
    checked = _checked(monkeypatch)
    for lazy in (False, True):
        snap = st.stage(sd, lazy=lazy)
        snap.wait_copied()
        assert_bitwise_equal(snap.state_dict, cpu)
        snap.release()
    assert checked[0] == 1 and not st.xla_gather.sync_first
