"""End-to-end behaviour of CheckpointManager on local disk and fsspec memory://."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from async_ckpt import (
    CheckpointError,
    CheckpointManager,
    InvalidStateDictError,
    InvalidStepError,
    StateDictMismatchError,
    StepNotFoundError,
    StorageError,
)
from async_ckpt.storage.lease import LOCK_NAME

from ..conftest import assert_bitwise_equal, clone_tree, make_state


def full_state(model, opt, step=0):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "meta": {"step": step, "name": "run", "lr": [0.1, 0.2]}}


def fresh_target(seed=123):
    model, opt = make_state(seed)
    return model, opt, full_state(model, opt, step=-1)


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"memory://ckpt-{uuid.uuid4().hex}"


def test_bitwise_round_trip_and_resume_through_fresh_manager(root):
    model, opt = make_state(0)
    saved = {}
    with CheckpointManager(root, save_interval=2, max_to_keep=0) as mgr:
        for step in range(6):
            sd = full_state(model, opt, step)
            took = mgr.save_async(step, sd)
            assert took == (step % 2 == 0)
            if took:
                saved[step] = clone_tree(sd)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5).add_(0.25)
    mgr2 = CheckpointManager(root, save_interval=2)
    assert mgr2.all_steps() == [0, 2, 4]
    assert mgr2.latest_step() == 4
    for step in (None, 2, 0):
        _, _, target = fresh_target()
        got = mgr2.restore(step, target)
        assert got == (4 if step is None else step)
        assert_bitwise_equal(saved[got], target)
    mgr2.close()


def test_restore_fills_a_fresh_optimizer_with_int_keys(ckpt_dir):
    model, opt = make_state(0)
    with CheckpointManager(ckpt_dir) as mgr:
        mgr.save(0, {"model": model.state_dict(), "optim": opt.state_dict()})
    m2, _ = make_state(5)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-3)  # never stepped: empty state
    target = {"model": m2.state_dict(), "optim": opt2.state_dict()}
    assert target["optim"]["state"] == {}
    CheckpointManager(ckpt_dir).restore(None, target)
    assert sorted(target["optim"]["state"]) == [0, 1, 2, 3]
    opt2.load_state_dict(target["optim"])
    m2.load_state_dict(target["model"])
    assert_bitwise_equal(opt.state_dict(), opt2.state_dict())
    assert_bitwise_equal(model.state_dict(), m2.state_dict())


def test_mutation_right_after_save_async_does_not_leak(ckpt_dir):
    t = torch.arange(1 << 20, dtype=torch.float32)
    expected = t.clone()
    mgr = CheckpointManager(ckpt_dir)
    mgr.save_async(0, {"t": t, "nested": {"v": t[:10]}})
    t.add_(7)  # mutate immediately, while the writer may still be busy
    mgr.close()
    target = {"t": torch.empty_like(t), "nested": {"v": torch.empty(10)}}
    CheckpointManager(ckpt_dir).restore(0, target)
    assert_bitwise_equal(target["t"], expected)
    assert_bitwise_equal(target["nested"]["v"], expected[:10])


def test_dtypes_shapes_and_views_round_trip(ckpt_dir):
    base = torch.randn(8, 6)
    sd = {
        "f16": torch.randn(5, 3).half(), "bf16": torch.randn(7).bfloat16(), "i64": torch.arange(9),
        "bool": torch.rand(4) > 0.5, "u8": torch.randint(0, 255, (3, 3), dtype=torch.uint8),
        "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4), "c64": torch.randn(3, dtype=torch.complex64),
        "transposed": base.t(), "slice": base[2:5], "col": base[:, 1], "base": base,
        "tied_a": base, "tied_b": base,
        "tuple": (1, "x"), "none": None, "float": 1.5, "str": "hello",
    }
    expected = clone_tree(sd)
    with CheckpointManager(ckpt_dir) as mgr:
        mgr.save(0, sd)
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
    CheckpointManager(ckpt_dir).restore(0, target)
    assert_bitwise_equal(expected, target)


def test_dcp_interop_both_ways(ckpt_dir, tmp_path):
    model, opt = make_state(0)
    sd = {"model": model.state_dict()}
    with CheckpointManager(ckpt_dir) as mgr:
        mgr.save(3, sd)
    # plain DCP reads ours
    m2, _ = make_state(9)
    target = {"model": m2.state_dict()}
    dcp.load(target, checkpoint_id=os.path.join(ckpt_dir, "3"))
    assert_bitwise_equal(sd, target)
    # we read a checkpoint written by plain DCP once it is adopted as a committed step:
    # dcp.save output is a directory of DCP files; our restore reads any DCP dir through
    # the same reader (used by the CLI and migration docs)
    from async_ckpt.io import load_state_dict
    from async_ckpt.storage import Storage

    other = str(tmp_path / "plain_dcp")
    dcp.save(sd, checkpoint_id=other)
    m3, _ = make_state(11)
    target3 = {"model": m3.state_dict()}
    load_state_dict(Storage(other), Storage(other).root, target3, files=None)
    assert_bitwise_equal(sd, target3)


def test_incomplete_step_is_invisible_and_cleaned(ckpt_dir):
    model, opt = make_state(0)
    with CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"model": model.state_dict()})
    # a save killed midway: a temp dir and an unmarked step dir with partial data
    os.makedirs(os.path.join(ckpt_dir, ".tmp-2-abcdef012345"))
    with open(os.path.join(ckpt_dir, ".tmp-2-abcdef012345", "__0_0.distcp"), "wb") as f:
        f.write(b"partial")
    os.makedirs(os.path.join(ckpt_dir, "3"))
    mgr = CheckpointManager(ckpt_dir)
    assert mgr.all_steps() == [1]
    assert mgr.latest_step() == 1
    mgr.restore(None, {"model": make_state(1)[0].state_dict()})
    # a manager that only lists and restores never deletes anything (it holds no writer lease)
    assert sorted(n for n in os.listdir(ckpt_dir) if n != LOCK_NAME) == [".tmp-2-abcdef012345", "1", "3"]
    mgr.save(4, {"model": model.state_dict()})  # the first save takes the lease and cleans up
    mgr.close()  # waits for the background cleanup
    assert sorted(n for n in os.listdir(ckpt_dir) if n != LOCK_NAME) == ["1", "4"]


def test_failing_writer_surfaces_error_and_does_not_hang(ckpt_dir):
    model, _ = make_state(0)
    root = "faulty://" + ckpt_dir  # a storage whose next data write fails: no space left
    mgr = CheckpointManager(root, max_pending_async=1)
    mgr.save(0, {"model": model.state_dict()})
    mgr.storage.fs.inject("write", "*.distcp", "enospc", times=1)
    assert mgr.save_async(1, {"model": model.state_dict()})
    with pytest.raises(CheckpointError) as ei:
        mgr.join()
    assert ei.value.step == 1 and "No space left" in str(ei.value)
    # the slot was released: the next save does not hang, and works once storage is back
    assert mgr.save_async(2, {"model": model.state_dict()})
    mgr.close()
    assert CheckpointManager(root).all_steps() == [0, 2]


def test_background_error_raised_at_next_save_async(ckpt_dir):
    mgr = CheckpointManager("faulty://" + ckpt_dir)
    refused = mgr.storage.fs.inject("write", "*.distcp", "eacces")  # every data write: refused
    mgr.save_async(0, {"x": torch.ones(3)})
    with pytest.raises(CheckpointError, match="Permission denied"):
        for step in range(1, 50):  # the error surfaces at the next call at the latest
            mgr.save_async(step, {"x": torch.ones(3)})
            mgr.roots[-1].writer._idle.acquire(); mgr.roots[-1].writer._idle.release()
    assert refused in mgr.storage.fs.faults and mgr.storage.fs.hits
    mgr.storage.fs.clear()
    mgr.close()


def test_max_to_keep_drops_oldest_by_commit_order(ckpt_dir):
    with CheckpointManager(ckpt_dir, 1, 2) as mgr:
        for s in range(5):
            mgr.save(s, {"x": torch.full((4,), float(s))})
    assert CheckpointManager(ckpt_dir).all_steps() == [3, 4]


def test_bad_inputs_raise_typed_errors(ckpt_dir, tmp_path):
    mgr = CheckpointManager(ckpt_dir)
    mgr.save(0, {"x": torch.ones(2)})
    with pytest.raises(InvalidStepError):
        mgr.save_async(-1, {"x": torch.ones(2)})
    with pytest.raises(InvalidStepError):
        mgr.save_async(1.5, {"x": torch.ones(2)})
    with pytest.raises(InvalidStepError):
        mgr.save_async(True, {"x": torch.ones(2)})
    with pytest.raises(InvalidStateDictError, match="mapping"):
        mgr.save_async(1, [torch.ones(2)])
    with pytest.raises(InvalidStateDictError, match=r"opt\.fn"):
        mgr.save_async(1, {"opt": {"fn": lambda x: x}})
    with open(tmp_path / "f.txt", "w") as fh:
        with pytest.raises(InvalidStateDictError, match="handle"):
            mgr.save_async(1, {"handle": fh})
    with pytest.raises(StepNotFoundError, match="step 7"):
        mgr.restore(7, {"x": torch.ones(2)})
    with pytest.raises(StateDictMismatchError, match="y"):
        mgr.restore(0, {"x": torch.ones(2), "y": torch.ones(2)})
    with pytest.raises(StateDictMismatchError, match="shape"):
        mgr.restore(0, {"x": torch.ones(3)})
    with pytest.raises(StateDictMismatchError, match="dtype"):
        mgr.restore(0, {"x": torch.ones(2, dtype=torch.float64)})
    with pytest.raises(TypeError):
        mgr.save_async(1, {"x": torch.ones(2)}, metrics={"loss": "low"})
    mgr.close()
    # none of that damaged the committed step
    t = {"x": torch.zeros(2)}
    assert CheckpointManager(ckpt_dir).restore(None, t) == 0 and torch.equal(t["x"], torch.ones(2))
    with pytest.raises(StepNotFoundError):
        CheckpointManager(str(tmp_path / "empty")).restore(None, {})


def test_unwritable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(StorageError, match=r"ckpt cannot be written: .*file is a file, not a directory"):
        CheckpointManager(str(blocker / "ckpt"))  # a NotACheckpointRootError, still a StorageError


def test_closed_manager_refuses_saves(ckpt_dir):
    mgr = CheckpointManager(ckpt_dir)
    mgr.close()
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save_async(0, {"x": torch.ones(1)})


def test_max_pending_async_bounds_in_flight_saves(ckpt_dir):
    root = "faulty://" + ckpt_dir
    mgr = CheckpointManager(root, max_pending_async=2)
    stuck = mgr.storage.fs.inject("write", "*.distcp", "hang", times=1)  # the first save's data write waits
    mgr.save_async(0, {"x": torch.ones(2)})
    assert stuck.reached.wait(30)
    mgr.save_async(1, {"x": torch.ones(2)})
    third = threading.Thread(target=mgr.save_async, args=(2, {"x": torch.ones(2)}))
    third.start()
    third.join(0.5)
    assert third.is_alive(), "a third save must wait for a free slot"
    stuck.release.set()
    third.join(30)
    assert not third.is_alive()
    mgr.close()
    assert CheckpointManager(root).all_steps() == [0, 1, 2]


def test_foreign_dcp_checkpoints_in_the_root_are_never_removed(ckpt_dir):
    """A root holding checkpoints of torch_xla's manager / plain dcp.save (numbered directories
    without our marker) is not ours to clean: they are not listed, and never deleted."""
    sd = {"w": torch.arange(6.0)}
    dcp.save(sd, checkpoint_id=os.path.join(ckpt_dir, "100"), no_dist=True)
    before = sorted(os.listdir(os.path.join(ckpt_dir, "100")))
    with CheckpointManager(ckpt_dir) as mgr:
        assert mgr.all_steps() == []
        mgr.save(200, {"w": torch.ones(6)})
    with CheckpointManager(ckpt_dir, commit_mode="marker") as mgr:
        mgr.save(300, {"w": torch.ones(6)})
    assert sorted(os.listdir(os.path.join(ckpt_dir, "100"))) == before
    assert CheckpointManager(ckpt_dir).all_steps() == [200, 300]
    target = {"w": torch.zeros(6)}
    dcp.load(target, checkpoint_id=os.path.join(ckpt_dir, "100"), no_dist=True)
    assert torch.equal(target["w"], sd["w"])


def test_restore_into_an_empty_target_rebuilds_int_keyed_dicts(ckpt_dir):
    model, opt = make_state(0)
    saved = {"optim": opt.state_dict(), "lst": [torch.ones(2), {"a": torch.zeros(1)}]}
    with CheckpointManager(ckpt_dir) as mgr:
        mgr.save(0, saved)
    target = {}
    CheckpointManager(ckpt_dir).restore(0, target)
    assert isinstance(target["optim"]["state"], dict) and sorted(target["optim"]["state"]) == [0, 1, 2, 3]
    assert isinstance(target["lst"], list)
    assert_bitwise_equal(saved, target)


def test_failed_restore_takes_out_what_it_added(ckpt_dir):
    model, opt = make_state(0)
    with CheckpointManager(ckpt_dir) as mgr:
        mgr.save(0, {"optim": opt.state_dict()})
    # damage a data file so the load fails after the target was prepared
    step_dir = os.path.join(ckpt_dir, "0")
    data = [f for f in os.listdir(step_dir) if f.endswith(".distcp")][0]
    with open(os.path.join(step_dir, data), "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    m2, _ = make_state(3)
    opt2 = torch.optim.Adam(m2.parameters())
    target = {"optim": opt2.state_dict()}
    before = clone_tree(target)
    from async_ckpt import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError):
        CheckpointManager(ckpt_dir).restore(0, target)
    assert_bitwise_equal(before, target)
