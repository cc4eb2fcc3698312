"""Restore into XLA tensors (PJRT CPU, for real) by direct reads into host stand-ins, then one
transfer: bitwise equal to the DCP path, the caller's tensor objects kept, mixed state dicts,
damage caught before any XLA target changes."""

from __future__ import annotations

import os

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt import compat as compat_mod
from async_ckpt.errors import CorruptCheckpointError, StateDictMismatchError
from async_ckpt.io import device_targets

from ..restore_paths.test_restore_fast import _flip_in_record, direct_calls  # noqa: F401 - the fixture, shared
from ..support.tree import assert_bitwise_equal

pytestmark = pytest.mark.xla


def saved_state(seed: int) -> dict:
    """CPU values of a mixed state dict: big and small tensors of many dtypes, non-tensor items."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": torch.randn(256, 513, generator=g),  # >= DIRECT_MIN_BYTES: straight into its stand-in
            "big_bf16": torch.randn(300, 1024, generator=g).to(torch.bfloat16),
            "c64": torch.randn(37, dtype=torch.complex64, generator=g),
            "mask": torch.rand(5, generator=g) > 0.5,
            "i64": torch.randint(-(2**40), 2**40, (7, 3), generator=g),
            "h": torch.randn(11, generator=g).to(torch.float16),
            "scalar": torch.tensor(float(seed) + 0.5),
            "empty": torch.zeros(0, 4),
            "param": torch.randn(64, 33, generator=g),
        },
        "small": {f"p{i}": torch.randn(17 + i, generator=g) for i in range(30)},
        "cpu": {"big": torch.randn(200, 400, generator=g), "small": torch.randn(9, generator=g)},
        "step": seed,
        "tag": f"s{seed}",
        "lrs": [0.1 * seed, 0.2],
    }


def xla_target(saved: dict, dev, fill: float = 3.0) -> dict:
    """Fresh targets: ``model`` and ``small`` on the XLA device (``model.param`` an
    ``nn.Parameter``), ``cpu`` on the host, non-tensor items of another value."""
    def fresh(t, device):
        return (torch.zeros_like(t) if t.dtype == torch.bool else torch.full_like(t, fill)).to(device)

    model = {k: fresh(v, dev) for k, v in saved["model"].items()}
    model["param"] = torch.nn.Parameter(model["param"])
    return {"model": model, "small": {k: fresh(v, dev) for k, v in saved["small"].items()},
            "cpu": {k: fresh(v, "cpu") for k, v in saved["cpu"].items()}, "step": -1, "tag": "", "lrs": [0.0, 0.0]}


def ids(tree: dict) -> dict:
    return {f"{k}.{n}": id(t) for k in ("model", "small", "cpu") for n, t in tree[k].items()}


@pytest.mark.parametrize("host_backed", [True, False], ids=["dlpack", "batched"])
def test_xla_restore_is_direct_bitwise_and_in_place(tmp_path, xla_device, direct_calls, monkeypatch, host_backed):
    monkeypatch.setattr(device_targets, "HOST_BACKED", host_backed)
    transfers = []
    real_batched = compat_mod.xla_tensors_from_aten

    def spy(tensors, device):
        transfers.append(len(tensors))
        return real_batched(tensors, device)

    monkeypatch.setattr(compat_mod, "xla_tensors_from_aten", spy)
    saved = saved_state(1)
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)

    target = xla_target(saved, xla_device)
    target["model"]["tied"] = target["model"]["big"]  # one XLA tensor under two keys
    saved_tied = dict(saved, model=dict(saved["model"], tied=saved["model"]["big"]))
    with CheckpointManager(root) as mgr:
        mgr.save(2, saved_tied)
    before = ids(target)
    assert CheckpointManager(root).restore(2, target) == 2
    assert direct_calls == [True], "restored by direct reads, not through DCP"
    assert ids(target) == before, "the caller's tensor objects are kept"
    assert type(target["model"]["param"]) is torch.nn.Parameter and target["model"]["param"].requires_grad
    assert target["model"]["tied"] is target["model"]["big"]
    assert all(t.device.type == "xla" for k in ("model", "small") for t in target[k].values())
    assert all(t.device.type == "cpu" for t in target["cpu"].values())
    assert_bitwise_equal(target, saved_tied)
    # Every XLA target with data (the empty one has none), the tied pair once: one batched call.
    n_xla = len(saved["model"]) - 1 + len(saved["small"])
    assert transfers == ([] if host_backed else [n_xla])

    # The slow path (plain dcp.load of the step: one copy_ per tensor) gives the same bytes.
    import torch.distributed.checkpoint as dcp

    slow = xla_target(saved, xla_device, fill=-1.0)
    slow["model"]["tied"] = slow["model"]["big"]
    dcp.load(slow, checkpoint_id=os.path.join(root, "2"), no_dist=True)
    assert_bitwise_equal(slow, target)


def test_restored_xla_tensors_train_and_save_again(tmp_path, xla_device, direct_calls):
    """The device buffers taken over from the stand-ins behave like any other: a training step
    (in-place updates, parameter aliasing on sync) and a save of the result round-trip."""
    import torch_xla

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model.state_dict()})
    ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(xla_device)
    ref.load_state_dict(model.state_dict())
    mine = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(xla_device)
    params = list(mine.parameters())
    target = {"model": mine.state_dict(keep_vars=True)}
    CheckpointManager(root).restore(1, target)
    assert direct_calls == [True]
    assert [id(p) for p in mine.parameters()] == [id(p) for p in params]
    x = torch.randn(4, 64).to(xla_device)
    for m in (ref, mine):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
    assert_bitwise_equal(mine.state_dict(), ref.state_dict())
    with CheckpointManager(root) as mgr:
        mgr.save(2, {"model": mine.state_dict()})
    back = {"model": {k: torch.zeros_like(v) for k, v in ref.state_dict().items()}}
    CheckpointManager(root).restore(2, back)
    assert_bitwise_equal(back["model"], ref.state_dict())


def test_xla_view_target_updates_its_base(tmp_path, xla_device, direct_calls):
    saved = {"w": torch.randn(300, 400), "v": torch.randn(400)}
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
    base = torch.zeros(3, 400, device=xla_device)
    target = {"w": torch.zeros(300, 400, device=xla_device), "v": base[1]}
    CheckpointManager(root).restore(1, target)
    assert direct_calls == [True]
    got = base.cpu()
    assert torch.equal(got[1], saved["v"]) and not got[0].any() and not got[2].any()
    assert_bitwise_equal(target, saved)


@pytest.mark.parametrize("fqn", ["model.big", "small.p7"])
def test_damage_is_caught_before_any_xla_target_changes(tmp_path, xla_device, fqn):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved_state(1))
        mgr.save(2, saved_state(2))
    _flip_in_record(os.path.join(root, "2"), fqn)
    target = xla_target(saved_state(0), xla_device)
    del target["cpu"]  # XLA targets and non-tensor items only
    before = {k: {n: t.cpu() for n, t in target[k].items()} for k in ("model", "small")}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as ei:
        CheckpointManager(root).restore(2, target, strict=False)
    assert "partly written" not in str(ei.value)
    assert_bitwise_equal({k: target[k] for k in before}, before)
    assert target["step"] == -1

    # restore(None) skips the damaged step and restores step 1, in place.
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2.*checksum mismatch"):
        assert CheckpointManager(root).restore(None, target, strict=False) == 1
    expected = saved_state(1)
    del expected["cpu"]
    assert_bitwise_equal(target, expected)


def test_mixed_target_damage_says_partly_written(tmp_path, xla_device):
    """A CPU target is written as its data arrives: with one in the state dict, a damaged file
    is reported as a partly written target, as for CPU-only restores."""
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved_state(1))
    _flip_in_record(os.path.join(root, "1"), "model.big")
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch.*partly written"):
        CheckpointManager(root).restore(1, xla_target(saved_state(0), xla_device))


def test_xla_target_of_another_shape_or_dtype_is_refused(tmp_path, xla_device):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.randn(8, 4), "b": torch.randn(4)})
    for bad, msg in (({"w": torch.zeros(4, 8, device=xla_device), "b": torch.zeros(4, device=xla_device)}, "w: shape"),
                     ({"w": torch.zeros(8, 4, device=xla_device),
                       "b": torch.zeros(4, dtype=torch.float16, device=xla_device)}, "b: dtype")):
        with pytest.raises(StateDictMismatchError, match=msg):
            CheckpointManager(root).restore(1, bad)


@pytest.mark.parametrize("atomic", [False, True])
def test_tied_xla_target_restored_from_untied_data(tmp_path, xla_device, direct_calls, atomic):
    """One XLA tensor under two keys, restored from a checkpoint that holds them untied: each
    key's data is read and verified apart (no false checksum mismatch, no mix of the two), and
    the last key's data stays."""
    n = 6 * 2**20  # 24 MiB of float32: several direct reads per record
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"a": torch.full((n,), 1.0), "b": torch.full((n,), 2.0)})
    mgr = CheckpointManager(root)
    for _ in range(5):
        t = torch.zeros(n, device=xla_device)
        mgr.restore(1, {"a": t, "b": t}, atomic=atomic)
        assert torch.equal(t.cpu(), torch.full((n,), 2.0))
    assert direct_calls == ([] if atomic else [True] * 5)  # atomic: through atomic_restore's load_direct
