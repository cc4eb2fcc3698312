"""Step directories other programs wrote (plain ``dcp.save``, torch_xla's or torchtitan's
checkpointer) under a root: listed read-only, restorable, never replaced or deleted."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp

from async_ckpt import CheckpointManager, ForeignStepError, StepAlreadyExistsError, StepNotFoundError
from async_ckpt.cli import main as cli_main

from ..conftest import assert_bitwise_equal, make_state


def _foreign(root: str, step: int, sd=None) -> dict:
    """A plain DCP step ``<root>/<step>`` (as torch_xla's manager lays it out); returns what it holds."""
    sd = sd if sd is not None else {"w": torch.arange(6.0), "b": torch.full((3,), 7, dtype=torch.int64)}
    dcp.save(sd, checkpoint_id=os.path.join(root, str(step)), no_dist=True)
    return sd


def _digest(path: str) -> dict:
    """Every file under ``path``, by name: its bytes' SHA-256."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(dirpath, n), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, n), path)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.parametrize("commit_mode", ["rename", "marker"])
@pytest.mark.parametrize("call", ["save", "save_async"])
def test_a_save_over_a_foreign_step_is_refused_and_keeps_it(ckpt_dir, commit_mode, call):
    os.makedirs(ckpt_dir)
    _foreign(ckpt_dir, 100)
    where = os.path.join(ckpt_dir, "100")
    before = _digest(where)
    with CheckpointManager(ckpt_dir, commit_mode=commit_mode) as mgr:
        with pytest.raises(ForeignStepError) as info:
            getattr(mgr, call)(100, {"w": torch.ones(6)}, force=True)
        assert info.value.step == 100 and info.value.path == where
        assert where in str(info.value) and "import" in str(info.value)
        assert isinstance(info.value, StepAlreadyExistsError)
        mgr.save(200, {"w": torch.ones(6)})  # the manager goes on: other steps save
    assert _digest(where) == before
    assert sorted(n for n in os.listdir(ckpt_dir) if not n.startswith(".")) == ["100", "200"]
    assert CheckpointManager(ckpt_dir).all_steps() == [200]


def test_a_foreign_step_written_after_the_call_is_refused_by_the_writer(ckpt_dir):
    """A directory another program writes while our save of that step waits in the queue is
    refused when the write begins (raised by join), and kept."""
    mgr = CheckpointManager(ckpt_dir)
    gate = threading.Event()
    begin = mgr.layout.begin

    def held_begin(*args, **kwargs):
        gate.wait(30)
        return begin(*args, **kwargs)

    with mock.patch.object(mgr.layout, "begin", held_begin):
        assert mgr.save_async(5, {"w": torch.ones(6)}, force=True)
        sd = _foreign(ckpt_dir, 5)
        before = _digest(os.path.join(ckpt_dir, "5"))
        fut = mgr.last_save_future()
        gate.set()
        with pytest.raises(ForeignStepError):  # the save's future raises its failure
            fut.result(timeout=30)
        with pytest.raises(ForeignStepError):
            mgr.join()
    mgr.close()
    assert _digest(os.path.join(ckpt_dir, "5")) == before
    target = {"w": torch.zeros(6), "b": torch.zeros(3, dtype=torch.int64)}
    dcp.load(target, checkpoint_id=os.path.join(ckpt_dir, "5"), no_dist=True)
    assert_bitwise_equal(sd, target)


def test_retention_delete_rm_and_cleanup_never_remove_a_foreign_step(ckpt_dir):
    os.makedirs(ckpt_dir)
    _foreign(ckpt_dir, 1)
    other = os.path.join(ckpt_dir, "2")  # not even DCP: another tool's step-numbered directory
    os.makedirs(other)
    with open(os.path.join(other, "weights.bin"), "wb") as f:
        f.write(b"x" * 100)
    before = {s: _digest(os.path.join(ckpt_dir, s)) for s in ("1", "2")}
    with CheckpointManager(ckpt_dir, max_to_keep=1) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"w": torch.full((6,), float(step))})
        assert mgr.all_steps() == [30]
        for s in (1, 2):
            with pytest.raises(StepNotFoundError):
                mgr.delete(s)
    assert cli_main(["rm", ckpt_dir, "1"]) != 0
    with CheckpointManager(ckpt_dir, max_to_keep=1) as mgr:  # a new writer's cleanup of incomplete steps
        mgr.save(40, {"w": torch.ones(6)})
        mgr.join()
        for r in mgr.roots:
            assert r.store.wait_idle(30)
    assert {s: _digest(os.path.join(ckpt_dir, s)) for s in ("1", "2")} == before


def test_foreign_steps_are_listed_read_only_and_restorable(ckpt_dir, capsys):
    os.makedirs(ckpt_dir)
    model, opt = make_state(0)
    saved = {"model": model.state_dict(), "optim": opt.state_dict()}
    _foreign(ckpt_dir, 100, saved)
    where = os.path.join(ckpt_dir, "100")
    with CheckpointManager(ckpt_dir) as mgr:
        assert mgr.foreign_steps() == {100: where}
        assert mgr.all_steps() == []
        with pytest.raises(StepNotFoundError):  # restore(None) takes only steps of ours
            mgr.restore(None, {"model": make_state(1)[0].state_dict()})
        m2, o2 = make_state(1)
        target = {"model": m2.state_dict(), "optim": o2.state_dict()}
        assert mgr.restore(100, target) == 100
        assert_bitwise_equal(saved, target)
        mgr.save(200, target)
        assert mgr.all_steps() == [200] and mgr.foreign_steps() == {100: where}
    capsys.readouterr()
    assert cli_main(["ls", ckpt_dir, "--json"]) == 0
    entries = {e["step"]: e for e in json.loads(capsys.readouterr().out)["steps"]}
    assert entries[100]["status"] == "foreign" and entries[200]["status"] == "listed"


def test_a_damaged_foreign_step_is_reported_as_damage_not_as_deleted(ckpt_dir):
    """A foreign step's unreadable ``.metadata`` is that directory's damage: restoring it names
    the damage (it was reported as deleted by a live writer while being restored)."""
    from async_ckpt import CorruptCheckpointError

    os.makedirs(ckpt_dir)
    _foreign(ckpt_dir, 5, {"w": torch.ones(4)})
    with open(os.path.join(ckpt_dir, "5", ".metadata"), "r+b") as f:
        f.truncate(7)
    with CheckpointManager(ckpt_dir) as mgr:
        assert 5 in mgr.foreign_steps()
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(5, {"w": torch.zeros(4)})
    assert os.path.exists(os.path.join(ckpt_dir, "5", ".metadata"))  # never touched


def test_overwrite_false_refuses_to_save_an_existing_step(ckpt_dir):
    with CheckpointManager(ckpt_dir, overwrite=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        with pytest.raises(StepAlreadyExistsError) as info:
            mgr.save(1, {"w": torch.zeros(2)}, force=True)
        assert not isinstance(info.value, ForeignStepError) and "overwrite" in str(info.value)
        target = {"w": torch.zeros(2)}
        mgr.restore(1, target)
        assert torch.equal(target["w"], torch.ones(2))
    with CheckpointManager(ckpt_dir) as mgr:  # the default replaces it, as torch_xla's manager does
        mgr.save(1, {"w": torch.zeros(2)}, force=True)


def test_metadata_user_metadata_and_saving_in_progress(ckpt_dir):
    """Orbax parity: metadata(step) without the tensors' bytes, user metadata per save (JSON),
    is_saving_in_progress()."""
    from async_ckpt import InvalidArgumentError

    mgr = CheckpointManager(ckpt_dir)
    gate = threading.Event()
    begin = mgr.layout.begin

    def held_begin(*args, **kwargs):
        gate.wait(30)
        return begin(*args, **kwargs)

    sd = {"model": {"w": torch.ones(4, 2, dtype=torch.bfloat16)}, "step": 7}
    assert not mgr.is_saving_in_progress() and mgr.last_save_future() is None
    with mock.patch.object(mgr.layout, "begin", held_begin):
        assert mgr.save_async(3, sd, force=True, metrics={"loss": 0.5}, metadata={"run": "a", "tokens": [1, 2]}) is True
        assert mgr.is_saving_in_progress() and not mgr.last_save_future().done()
        gate.set()
        mgr.join()
    assert not mgr.is_saving_in_progress()
    assert mgr.last_save_future().result(timeout=30) == 3
    with pytest.raises(InvalidArgumentError, match="JSON"):
        mgr.save(4, sd, force=True, metadata={"bad": object()})
    mgr.close()
    # every data file removed: metadata() reads the manifest and .metadata only
    where = os.path.join(ckpt_dir, "3")
    for n in os.listdir(where):
        if n.endswith(".distcp"):
            os.remove(os.path.join(where, n))
    md = CheckpointManager(ckpt_dir).metadata(3)
    assert md.step == 3 and md.metrics == {"loss": 0.5} and md.user_metadata == {"run": "a", "tokens": [1, 2]}
    assert md.tensors == {"model.w": ((4, 2), "bfloat16")} and md.values == ("step",)
    with pytest.raises(StepNotFoundError):
        CheckpointManager(ckpt_dir).metadata(9)


@pytest.mark.parametrize("prefix,width,name", [("step-", None, "step-20"), (None, 8, "00000020"),
                                               ("ckpt_", 4, "ckpt_0020")])
def test_step_naming_is_recorded_and_found_unprompted(ckpt_dir, prefix, width, name, capsys):
    from async_ckpt import InvalidArgumentError

    with CheckpointManager(ckpt_dir, step_prefix=prefix, step_width=width) as mgr:
        mgr.save(10, {"w": torch.zeros(2)})
        mgr.save(20, {"w": torch.ones(2)})
        assert mgr.layout.step_dir(20) == os.path.join(ckpt_dir, name)
    assert name in os.listdir(ckpt_dir) and "20" not in os.listdir(ckpt_dir)
    mgr = CheckpointManager(ckpt_dir)  # not told: the root's record says
    assert mgr.all_steps() == [10, 20]
    target = {"w": torch.zeros(2)}
    assert mgr.restore(None, target) == 20 and torch.equal(target["w"], torch.ones(2))
    mgr.close()
    capsys.readouterr()
    assert cli_main(["ls", ckpt_dir, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(e["step"] for e in out["steps"] if e["status"] == "listed") == [10, 20]
    with pytest.raises(InvalidArgumentError, match="names its steps"):
        CheckpointManager(ckpt_dir, step_prefix="other-")


def test_torchtitan_step_directories_are_foreign_under_its_naming(ckpt_dir):
    """torchtitan's layout: <folder>/step-N holding plain DCP. With step_prefix="step-" they are
    listed as foreign, restorable, and never replaced; a root of <step> names refuses the naming."""
    from async_ckpt import InvalidArgumentError

    os.makedirs(ckpt_dir)
    sd = _foreign(ckpt_dir, 0)
    os.rename(os.path.join(ckpt_dir, "0"), os.path.join(ckpt_dir, "step-5"))
    with CheckpointManager(ckpt_dir, step_prefix="step-") as mgr:
        assert mgr.foreign_steps() == {5: os.path.join(ckpt_dir, "step-5")}
        target = {"w": torch.zeros(6), "b": torch.zeros(3, dtype=torch.int64)}
        mgr.restore(5, target)
        assert_bitwise_equal(sd, target)
        with pytest.raises(ForeignStepError):
            mgr.save(5, target, force=True)
        mgr.save(10, target)
    assert sorted(n for n in os.listdir(ckpt_dir) if not n.startswith(".")) == ["step-10", "step-5"]
    other = os.path.join(ckpt_dir, "..", "plain")
    with CheckpointManager(other) as mgr:
        mgr.save(1, {"w": torch.ones(1)})
    with pytest.raises(InvalidArgumentError, match="would hide them"):
        CheckpointManager(other, step_prefix="step-")


def test_import_saves_a_plain_dcp_directory_as_a_step(tmp_path):
    """`async-ckpt import` (CheckpointManager.import_step) reads another program's DCP step and
    commits it as a step of ours; the source is only read."""
    model, opt = make_state(0)
    saved = {"model": model.state_dict(), "optim": opt.state_dict(), "note": "hi"}
    src = str(tmp_path / "old" / "100")
    dcp.save(saved, checkpoint_id=src, no_dist=True)
    before = _digest(src)
    new = str(tmp_path / "new")
    assert cli_main(["import", new, src, "100"]) == 0
    assert _digest(src) == before
    with CheckpointManager(new) as mgr:
        assert mgr.all_steps() == [100]
        m2, o2 = make_state(1)
        target = {"model": m2.state_dict(), "optim": o2.state_dict(), "note": None}
        mgr.restore(100, target)
    assert_bitwise_equal(saved, target)
