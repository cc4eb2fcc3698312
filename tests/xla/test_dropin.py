"""The torch_xla drop-in contract, behaviour for behaviour.

Each scenario of torch_xla's own manager tests (``CheckpointManagerTest`` in pytorch/xla's
``test/spmd/test_xla_distributed_checkpoint.py``) that applies off TPU, run against async_ckpt
with a CPU and an XLA state dict, plus the rules behind them: commit order is the order,
retention is visible when ``save``/``join`` return, any step may be saved in any order, and a
committed step is deleted only by retention or an explicit ``delete``.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from async_ckpt import CheckpointManager, LeaseHeldError, StepNotFoundError

from ..conftest import assert_bitwise_equal, small_state, target_like

# ---- torch_xla's CheckpointManagerTest ------------------------------------------------------

def test_manager_checkpointing(root):
    mgr = CheckpointManager(root, save_interval=10, chkpt_on_preemption=False)
    assert mgr.save(0, small_state(7))
    target = target_like(small_state(0))
    mgr.restore(0, target)
    assert_bitwise_equal(target, small_state(7))
    mgr.close()


def test_manager_step_tracking(root):
    mgr = CheckpointManager(root, save_interval=10, chkpt_on_preemption=False)
    assert mgr.all_steps() == []
    for step in range(1, 10):
        assert mgr.save(step, small_state(step)) is False
        assert mgr.all_steps() == []
    saved = set()
    for step in range(0, 100, 10):
        assert mgr.save(step, small_state(step)) is True
        saved.add(step)
        assert set(mgr.all_steps()) == saved
    mgr.close()


def test_manager_max_to_keep_by_commit_order_across_restart(root):
    mgr = CheckpointManager(root, save_interval=10, max_to_keep=2, chkpt_on_preemption=False)
    assert mgr.all_steps() == []
    assert mgr.save(10, small_state(10)) and set(mgr.all_steps()) == {10}
    assert mgr.save(20, small_state(20)) and set(mgr.all_steps()) == {10, 20}
    assert mgr.save(30, small_state(30)) and set(mgr.all_steps()) == {20, 30}  # at once, no waiting
    assert mgr.save(10, small_state(11)) and set(mgr.all_steps()) == {30, 10}  # the oldest *commit* went
    assert mgr.latest_step() == 10 and mgr.steps_in_commit_order() == [30, 10]
    mgr.close()
    mgr = CheckpointManager(root, save_interval=10, max_to_keep=2, chkpt_on_preemption=False)
    assert mgr.save(20, small_state(21)) and set(mgr.all_steps()) == {20, 10}
    assert mgr.steps_in_commit_order() == [10, 20]
    for step, value in ((10, 11), (20, 21)):
        target = target_like(small_state(0))
        mgr.restore(step, target)
        assert_bitwise_equal(target, small_state(value))
    mgr.close()


def test_manager_max_to_keep_recreated_without_close_verbatim(root):
    """torch_xla's ``test_manager_max_to_keep`` as it is written there: the second manager is
    created on the same directory while the first was never closed (and still referenced
    until the assignment). Its first save must work, not raise ``LeaseHeldError`` naming its
    own pid."""
    state_dict = small_state(3)
    chkpt_mgr = CheckpointManager(root, save_interval=10, max_to_keep=2, chkpt_on_preemption=False)
    assert chkpt_mgr.all_steps() == []
    assert chkpt_mgr.save(10, state_dict)
    assert set(chkpt_mgr.all_steps()) == {10}
    assert chkpt_mgr.save(20, state_dict)
    assert set(chkpt_mgr.all_steps()) == {10, 20}
    assert chkpt_mgr.save(30, state_dict)
    assert set(chkpt_mgr.all_steps()) == {30, 20}
    assert chkpt_mgr.save(10, state_dict)
    assert set(chkpt_mgr.all_steps()) == {30, 10}
    # The deletion order should persist across executions
    chkpt_mgr = CheckpointManager(root, save_interval=10, max_to_keep=2, chkpt_on_preemption=False)
    assert chkpt_mgr.save(20, state_dict)
    assert set(chkpt_mgr.all_steps()) == {20, 10}
    target = target_like(small_state(0))
    chkpt_mgr.restore(20, target)
    assert_bitwise_equal(target, state_dict)
    chkpt_mgr.close()


def test_a_second_manager_takes_over_an_idle_first_one_of_this_process(root):
    """The issue's scenario (save_interval=10, max_to_keep=3, steps 0..100), with the first
    manager still referenced: the new one takes the lease over; the old one refuses."""
    first = CheckpointManager(root, 10, max_to_keep=3)
    for step in range(0, 101):
        first.save(step, small_state(step))
    assert first.all_steps() == [80, 90, 100]
    mgr = CheckpointManager(root, 10, max_to_keep=3)
    assert mgr.all_steps() == [80, 90, 100]
    assert mgr.save(110, small_state(110))
    assert mgr.all_steps() == [90, 100, 110]
    assert mgr.steps_in_commit_order() == [90, 100, 110]
    with pytest.raises(LeaseHeldError, match="taken over by another CheckpointManager of this process"):
        first.save(120, small_state(120))
    with pytest.raises(LeaseHeldError, match="taken over"):
        first.delete(90)
    assert mgr.all_steps() == [90, 100, 110]
    for step in mgr.all_steps():
        target = target_like(small_state(0))
        mgr.restore(step, target)
        assert_bitwise_equal(target, small_state(step))
    first.close()
    mgr.close()


def test_manager_async_and_join_see_retention(root):
    mgr = CheckpointManager(root, save_interval=10, max_to_keep=2)
    gate = threading.Event()
    real_begin = mgr.layout.begin

    def held_begin(step, token=None):
        gate.wait(30)
        return real_begin(step, token)

    mgr.layout.begin = held_begin
    assert mgr.save_async(10, small_state(10))
    assert mgr.all_steps() == []  # nothing is listed before it commits
    gate.set()
    mgr.join()
    assert set(mgr.all_steps()) == {10}
    for step in (20, 30):
        assert mgr.save_async(step, small_state(step))
    mgr.join()
    assert set(mgr.all_steps()) == {20, 30}  # retention applied before join() returned
    mgr.close()


def test_manager_async_step_tracking(root):
    mgr = CheckpointManager(root, save_interval=10, max_pending_async=2)
    for step in range(1, 10):
        assert mgr.save_async(step, small_state(step)) is False
    saved = set()
    for step in range(0, 100, 10):
        assert mgr.save_async(step, small_state(step)) is True
        saved.add(step)
    mgr.join()
    assert set(mgr.all_steps()) == saved
    target = target_like(small_state(0))
    mgr.restore(0, target)
    assert_bitwise_equal(target, small_state(0))
    mgr.close()


def test_xla_state_dict_max_to_keep(tmp_path, xla_device):
    mgr = CheckpointManager(str(tmp_path / "x"), save_interval=10, max_to_keep=2)
    for step in (10, 20, 30, 10):
        t = {"w": torch.full((64,), float(step), device=xla_device)}
        assert mgr.save_async(step, t)
    mgr.join()
    assert mgr.steps_in_commit_order() == [30, 10]
    target = {"w": torch.zeros(64, device=xla_device)}
    assert mgr.restore(None, target) == 10
    assert torch.equal(target["w"].cpu(), torch.full((64,), 10.0))
    mgr.close()


# ---- commit order, rolling back, lower steps ------------------------------------------------

def test_rollback_resumes_at_the_newest_commit_and_deletes_nothing(root):
    with CheckpointManager(root) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, small_state(s))
    mgr = CheckpointManager(root)
    target = target_like(small_state(0))
    assert mgr.restore(10, target) == 10  # look at step 10, or roll back to it
    mgr.save(11, small_state(11))
    assert mgr.all_steps() == [10, 11, 20, 30]  # saving after a restore deletes nothing
    mgr.save(12, small_state(12))
    assert mgr.latest_step() == 12  # the newest commit, not the abandoned higher step
    mgr.close()
    again = CheckpointManager(root)
    target = target_like(small_state(0))
    assert again.restore(None, target) == 12
    assert_bitwise_equal(target, small_state(12))
    target = target_like(small_state(0))
    again.restore(30, target)
    assert_bitwise_equal(target, small_state(30))  # the old timeline is still there
    again.close()


def test_saving_below_the_top_warns_once_and_is_allowed(root, caplog):
    with CheckpointManager(root) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, small_state(s))
    mgr = CheckpointManager(root, max_to_keep=3)
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        assert mgr.save(0, small_state(0))  # a new run started in an old run's directory
        assert mgr.save(1, small_state(1))
    lower = [r.getMessage() for r in caplog.records if "already holds committed steps" in r.getMessage()]
    assert len(lower) == 1, lower
    assert "step 0" in lower[0] and "up to 30" in lower[0] and "retention by commit order" in lower[0]
    assert mgr.all_steps() == [0, 1, 30]  # the old run's oldest commits went first
    assert mgr.latest_step() == 1
    mgr.close()


def test_restoring_first_silences_the_lower_step_warning(root, caplog):
    with CheckpointManager(root) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, small_state(s))
    mgr = CheckpointManager(root)
    mgr.restore(10, target_like(small_state(0)))
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        mgr.save(11, small_state(11))
    assert not [r for r in caplog.records if "already holds committed steps" in r.getMessage()]
    mgr.close()


def test_commit_order_survives_a_clock_that_goes_back(root):
    now = [1000.0]
    mgr = CheckpointManager(root, max_to_keep=2, wall_clock=lambda: now[0])
    mgr.save(1, small_state(1))
    now[0] = 500.0  # the wall clock stepped back
    mgr.save(2, small_state(2))
    mgr.save(3, small_state(3))
    assert mgr.steps_in_commit_order() == [2, 3] and mgr.latest_step() == 3
    mgr.close()


def test_keep_best_and_custom_policies_see_commit_order(root):
    seen = []

    def policy(checkpoints):
        seen.append([c.step for c in checkpoints])
        return {c.step for c in checkpoints}

    with CheckpointManager(root, retention=policy) as mgr:
        for s in (5, 3, 9, 1):
            mgr.save(s, small_state(s))
    assert seen[-1] == [5, 3, 9, 1]


# ---- explicit deletion ----------------------------------------------------------------------

def test_delete_removes_a_step_and_only_that_step(root):
    mgr = CheckpointManager(root)
    for s in (1, 2, 3):
        mgr.save(s, small_state(s))
    mgr.delete(2)
    assert mgr.all_steps() == [1, 3]
    with pytest.raises(StepNotFoundError, match="step 2"):
        mgr.restore(2, target_like(small_state(0)))
    with pytest.raises(StepNotFoundError, match="step 7"):
        mgr.delete(7)
    mgr.delete(3)  # even the newest: an explicit action
    assert mgr.latest_step() == 1
    mgr.close()
    assert CheckpointManager(root).all_steps() == [1]


# ---- re-saving a step -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["rename", "marker"])
def test_resave_replaces_a_step_and_keeps_the_old_copy_until_committed(tmp_path, mode):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root, commit_mode=mode)
    mgr.save(5, small_state(5))
    seen = {}
    real_commit = mgr.layout.commit

    def commit_and_look(target, manifest):
        target_ = target_like(small_state(0))
        seen["before"] = CheckpointManager(root).restore(5, target_)  # a reader mid re-save
        seen["value"] = target_
        real_commit(target, manifest)

    mgr.layout.commit = commit_and_look
    mgr.save(5, small_state(55))
    assert seen["before"] == 5
    assert_bitwise_equal(seen["value"], small_state(5))  # the old copy is intact until the new one commits
    target = target_like(small_state(0))
    mgr.restore(5, target)
    assert_bitwise_equal(target, small_state(55))
    assert mgr.all_steps() == [5]
    mgr.close()


# ---- torch_xla's key layout -----------------------------------------------------------------

def _layout(entries):
    """DCP metadata naming ``entries`` (flattened key -> path), as a checkpoint lists them."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    return Metadata(state_dict_metadata={k: BytesStorageMetadata() for k in entries}, planner_data=dict(entries))


def test_a_restore_target_is_flattened_in_the_checkpoints_key_layout():
    """torch_xla's ``SPMDSavePlanner`` (its manager; async_ckpt under SPMD) stores a dict or list
    holding no tensor as one item; DCP's default, every value on its own. The target is read in
    the layout of the checkpoint (tests/xla/test_spmd.py restores such steps for real)."""
    from async_ckpt.format.dcp_layout import flatten, flatten_target

    w = torch.zeros(2)
    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]
    adam = {"model": {"w": w}, "optim": {"state": {0: {"exp_avg": w}}, "param_groups": groups}}
    modern = flatten(adam)
    assert flatten_target(adam, _layout(modern[1])) == modern  # DCP's layout: unchanged
    flat, paths = flatten_target(adam, _layout({"model.w": ("model", "w"), "optim.state.0.exp_avg":
                                                ("optim", "state", "0", "exp_avg"),
                                                "optim.param_groups": ("optim", "param_groups")}))
    assert list(flat) == ["model.w", "optim.state.0.exp_avg", "optim.param_groups"]
    assert flat["optim.param_groups"] is groups and paths["optim.param_groups"] == ("optim", "param_groups")
    # SGD without momentum: the whole optimizer state dict is one item, its empty state included.
    sgd = {"model": {"w": w}, "optim": {"state": {}, "param_groups": groups}}
    flat, paths = flatten_target(sgd, _layout({"model.w": ("model", "w"), "optim": ("optim",)}))
    assert list(flat) == ["model.w", "optim"] and flat["optim"] is sgd["optim"]
    # A container the target fills with tensors is not one item: its keys stay the target's.
    assert list(flatten_target(adam, _layout({"optim": ("optim",)}))[0]) == list(modern[0])
