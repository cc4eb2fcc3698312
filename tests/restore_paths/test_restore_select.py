"""restore(..., cast=True) casts as dcp.load does; keys= / exclude= restore a subset, quietly."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from async_ckpt import CheckpointManager, InvalidArgumentError, StateDictMismatchError

from ..conftest import make_state


def _bf16_step(root: str):
    model, opt = make_state(0)
    bf16 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    big = torch.randn(256, 256).to(torch.bfloat16)  # read straight into its private buffer, then cast
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": {**bf16, "big": big}, "optim": opt.state_dict()})
    return {**bf16, "big": big}


@pytest.mark.parametrize("atomic", [False, True])
def test_cast_restores_a_bf16_step_into_an_fp32_model_as_dcp_load_does(ckpt_dir, atomic):
    saved = _bf16_step(ckpt_dir)
    target = {"model": {k: torch.zeros(v.shape) for k, v in saved.items()}}
    with CheckpointManager(ckpt_dir) as mgr:
        with pytest.raises(StateDictMismatchError, match="dtype"):
            mgr.restore(1, {"model": {k: torch.zeros(v.shape) for k, v in saved.items()}}, strict=False)
        mgr.restore(1, target, cast=True, atomic=atomic, keys=["model"])
    expected = {"model": {k: torch.zeros(v.shape) for k, v in saved.items()}}
    dcp.load(expected, checkpoint_id=os.path.join(ckpt_dir, "1"), no_dist=True)
    for k, v in saved.items():
        assert target["model"][k].dtype == torch.float32
        assert torch.equal(target["model"][k], v.float()) and torch.equal(target["model"][k], expected["model"][k])


def test_keys_and_exclude_restore_a_subset_without_warnings(ckpt_dir):
    model, opt = make_state(0)
    with CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"x": torch.ones(3)}})
    m2, o2 = make_state(1)
    before_opt = {k: v.clone() for k, v in o2.state_dict()["state"][0].items() if torch.is_tensor(v)}
    with CheckpointManager(ckpt_dir) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            target = {"model": m2.state_dict(), "optim": o2.state_dict()}
            mgr.restore(1, target, keys=["model"])  # a model-only load: no word about optim or extra
            for k, v in model.state_dict().items():
                assert torch.equal(target["model"][k], v)
            for k, v in before_opt.items():  # the optimizer was left as it was
                assert torch.equal(target["optim"]["state"][0][k], v)
            m3, _ = make_state(2)
            target = {"model": m3.state_dict()}
            mgr.restore(1, target, exclude=["optim", "extra"])
            for k, v in model.state_dict().items():
                assert torch.equal(target["model"][k], v)
            target = {"model": make_state(3)[0].state_dict()}
            mgr.restore(1, target, keys=["model"], exclude=["model.0.bias"])
            assert torch.equal(target["model"]["0.weight"], model.state_dict()["0.weight"])
            assert not torch.equal(target["model"]["0.bias"], model.state_dict()["0.bias"])
        with pytest.raises(InvalidArgumentError, match="keys"):
            mgr.restore(1, {"model": m2.state_dict()}, keys="model")
