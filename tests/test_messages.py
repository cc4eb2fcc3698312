"""What users see: error types, warnings, log lines, key mismatches, Ctrl-C, read-only roots."""

from __future__ import annotations

import math

import pytest
import torch

import async_ckpt
from async_ckpt import CheckpointError, CheckpointManager, InvalidArgumentError

from .conftest import assert_bitwise_equal, clone_tree


# ---- invalid arguments are CheckpointErrors ------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(save_interval=0), dict(max_to_keep=-1), dict(write_threads=0),
                                    dict(commit_mode="bogus"), dict(lazy="yes"), dict(stats_log=3),
                                    dict(max_pending_async=0), dict(local_dir=".", local_policy=0)])
def test_invalid_constructor_arguments_are_checkpoint_errors(tmp_path, kwargs):
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(str(tmp_path / "ckpt"), **kwargs)
    assert isinstance(info.value, InvalidArgumentError)
    assert isinstance(info.value, (ValueError, TypeError))


@pytest.mark.parametrize("metrics,kind", [({"loss": math.nan}, ValueError), ({"loss": "low"}, TypeError),
                                          ({1: 0.5}, TypeError), ([0.5], TypeError)])
def test_bad_metrics_at_a_save_step_raise_a_checkpoint_error(tmp_path, metrics, kind):
    sd = {"w": torch.arange(4.0)}
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        caught = None
        try:  # the documented loop: catch CheckpointError and go on training
            mgr.save(1, sd, metrics=metrics)
        except CheckpointError as exc:
            caught = exc
        assert isinstance(caught, InvalidArgumentError) and isinstance(caught, kind)
        assert mgr.save(2, sd, metrics={"loss": 1.0})
        assert mgr.all_steps() == [2]


def test_invalid_policy_arguments_are_checkpoint_errors():
    for make in (lambda: async_ckpt.EveryNSteps(0), lambda: async_ckpt.KeepLatest(0),
                 lambda: async_ckpt.EveryTSeconds(-1), lambda: async_ckpt.KeepBest(1, "loss", mode="up"),
                 lambda: async_ckpt.AnyOf([])):
        with pytest.raises(InvalidArgumentError):
            make()
