"""torchtitan's checkpointer contract (``BaseCheckpointManager``) on async_ckpt:
``async_ckpt.integrations.torchtitan.CheckpointManager``, selected through torchtitan's config.

Needs torchtitan (0.3.0: torch >= 2.11; the newest-torch leg installs it); skipped without it.
Tiny models and torchtitan's own AdamW and LR-scheduler containers, on CPU.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from concurrent.futures import Future

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("torchtitan")
from torchtitan.components.checkpointer import BaseCheckpointManager  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402

from async_ckpt import CheckpointManager as AsyncManager  # noqa: E402
from async_ckpt import ForeignStepError, InvalidArgumentError  # noqa: E402
from async_ckpt.integrations.torchtitan import CheckpointManager  # noqa: E402
from async_ckpt.stats import SaveStats  # noqa: E402

from ..support.tree import assert_bitwise_equal, clone_tree  # noqa: E402


class TrainState:
    """The trainer's own ``Stateful`` (torchtitan passes ``{"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


class Run:
    """A model, torchtitan's optimizer and LR-scheduler containers, a train state, and the
    checkpointer built from ``CheckpointManager.Config`` as torchtitan's trainer builds it."""

    def __init__(self, folder: str, seed: int = 0, **config) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers,
                                                                                 training_steps=20)
        self.train_state = TrainState()
        config.setdefault("enable", True)
        config.setdefault("interval", 1)
        config.setdefault("keep_latest_k", 0)
        config.setdefault("last_save_model_only", False)
        self.ckpt = CheckpointManager.Config(folder=folder, **config).build(
            dataloader=None, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"train_state": self.train_state}, sd_adapter=None,
            base_folder="")

    def train(self, n: int = 1) -> None:
        for _ in range(n):
            self.train_state.step += 1
            self.train_state.ntokens_seen += 32
            g = torch.Generator().manual_seed(self.train_state.step)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            torch.nn.functional.mse_loss(self.model(x), y).backward()
            self.ckpt.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()

    def everything(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizers.state_dict(),
                "lr_scheduler": self.lr_schedulers.state_dict(), "train_state": self.train_state.state_dict()}


def _steps(folder: str):
    m = AsyncManager(folder, read_only=True)
    try:
        return m.all_steps()
    finally:
        m.close()


def _digest(path: str) -> dict:
    out = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(dirpath, n), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, n), path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_selected_through_torchtitans_trainer_config(tmp_path):
    from torchtitan.trainer import Trainer

    config = Trainer.Config(checkpoint=CheckpointManager.Config(enable=True, folder=str(tmp_path / "ck")))
    run_model = torch.nn.Linear(2, 2)
    opt = default_adamw().build(model_parts=[run_model])
    ckpt = config.checkpoint.build(dataloader=None, model_parts=[run_model], optimizers=opt,
                                   lr_schedulers=LRSchedulersContainer.Config().build(optimizers=opt, training_steps=5),
                                   states={}, sd_adapter=None, base_folder="")
    assert isinstance(ckpt, CheckpointManager) and isinstance(ckpt, BaseCheckpointManager)
    assert ckpt.save(500) and _steps(str(tmp_path / "ck")) == [500]
    ckpt.close()


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_resume_is_bitwise_the_saved_state(tmp_path, async_mode):
    folder = str(tmp_path / "ck")
    a = Run(folder, async_mode=async_mode, interval=3)
    a.train(3)
    assert a.ckpt.save(3)
    expected = clone_tree(a.everything())
    a.train(2)  # goes on while the save is written
    assert not a.ckpt.save(5)  # not due (interval 3)
    if async_mode == "disabled":
        assert a.ckpt.save_future is None
    else:
        fut = a.ckpt.save_future
        assert isinstance(fut, Future)
        a.ckpt.maybe_wait_for_saving()
        assert a.ckpt.save_future is None
        stats = fut.result(timeout=0)
        assert isinstance(stats, SaveStats) and stats.step == 3
    a.ckpt.close()
    assert _steps(folder) == [3]

    b = Run(folder, seed=1, async_mode=async_mode, interval=3)
    b.train(1)  # different weights, optimizer state, schedule and train state
    assert b.ckpt.load()
    assert_bitwise_equal(b.everything(), expected)
    b.ckpt.close()


def test_interval_first_step_keep_latest_k_and_load_only(tmp_path):
    folder = str(tmp_path / "ck")
    r = Run(folder, interval=2, keep_latest_k=2, enable_first_step_checkpoint=True)
    saved = []
    for step in range(1, 8):
        r.train()
        saved.append(r.ckpt.save(step))
    assert saved == [True, True, False, True, False, True, False]
    r.ckpt.close()
    assert _steps(folder) == [4, 6]

    before = _digest(folder)
    ro = Run(folder, load_only=True)
    assert ro.ckpt.load() and ro.train_state.step == 6
    ro.train()
    assert ro.ckpt.save(7, last_step=True) is False
    ro.ckpt.close()
    assert _digest(folder) == before


def test_last_step_is_the_model_only_in_export_dtype(tmp_path):
    folder = str(tmp_path / "ck")
    r = Run(folder, interval=10, last_save_model_only=True, export_dtype="bfloat16")
    r.train(3)
    assert r.ckpt.save(3, last_step=True)
    r.ckpt.close()
    assert _steps(folder) == [3]
    meta = dcp.FileSystemReader(os.path.join(folder, "step-3")).read_metadata().state_dict_metadata
    assert set(meta) == set(r.model.state_dict())
    assert {m.properties.dtype for m in meta.values()} == {torch.bfloat16}
    m = AsyncManager(folder, read_only=True)
    got = {k: torch.empty_like(v, dtype=torch.bfloat16) for k, v in r.model.state_dict().items()}
    m.restore(3, got)
    m.close()
    assert_bitwise_equal(got, {k: v.to(torch.bfloat16) for k, v in r.model.state_dict().items()})


def test_exclude_from_loading_keeps_the_excluded_state(tmp_path):
    folder = str(tmp_path / "ck")
    a = Run(folder)
    a.train(2)
    a.ckpt.save(2)
    saved_model = clone_tree(a.model.state_dict())
    a.ckpt.close()
    b = Run(folder, seed=1, exclude_from_loading=["optimizer", "lr_scheduler"])
    b.train(1)
    optimizer_before = clone_tree(b.optimizers.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the steps' other keys are not warned about
        assert b.ckpt.load()
    assert_bitwise_equal(b.model.state_dict(), saved_model)
    assert_bitwise_equal(b.optimizers.state_dict(), optimizer_before)
    assert b.train_state.step == 2
    b.ckpt.close()


def test_load_step_and_config_errors(tmp_path):
    folder = str(tmp_path / "ck")
    r = Run(folder)
    assert r.ckpt.load() is False  # a fresh start
    r.train()
    r.ckpt.save(1)
    with pytest.raises(FileNotFoundError, match=r"--checkpoint.load_step=5 not found"):
        r.ckpt.load(step=5)
    assert r.ckpt.load(step=1)
    r.ckpt.close()
    with pytest.raises(InvalidArgumentError, match="sd_adapter"):
        Run(str(tmp_path / "hf"), last_save_in_hf=True, last_save_model_only=True)


def _titan_dcp(run: Run, folder: str):
    """torchtitan's own DCP backend over the same run's states."""
    from torchtitan.components.checkpointer import CheckpointManager as DCPManager

    return DCPManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0,
                             last_save_model_only=False).build(
        dataloader=None, model_parts=[run.model], optimizers=run.optimizers, lr_schedulers=run.lr_schedulers,
        states={"train_state": run.train_state}, sd_adapter=None, base_folder="")


def test_a_run_switches_between_torchtitans_dcp_backend_and_this_one(tmp_path):
    """A folder torchtitan's DCP backend wrote (``step-4``) is resumed from, read-only: never
    replaced nor deleted; torchtitan's backend then resumes from this backend's ``step-5``."""
    folder = str(tmp_path / "ck")
    a = Run(str(tmp_path / "unused"))
    a.ckpt.close()
    a.train(4)
    theirs = _titan_dcp(a, folder)
    assert theirs.save(4)
    theirs.close()
    expected = clone_tree(a.everything())
    foreign = _digest(os.path.join(folder, "step-4"))

    b = Run(folder, seed=1, keep_latest_k=2)
    assert b.ckpt.load()
    assert_bitwise_equal(b.everything(), expected)
    with pytest.raises(ForeignStepError, match="async-ckpt import"):
        b.ckpt.save(4)
    for step in (5, 6, 7):
        b.train()
        assert b.ckpt.save(step)
    expected = clone_tree(b.everything())
    b.ckpt.close()
    assert _digest(os.path.join(folder, "step-4")) == foreign  # retention kept 6, 7 and never touched it
    assert _steps(folder) == [6, 7]

    c = Run(str(tmp_path / "unused2"), seed=2)
    c.ckpt.close()
    c.train(1)
    theirs = _titan_dcp(c, folder)
    assert theirs.load()  # torchtitan finds step-7 (it holds DCP's .metadata) and dcp.load reads it
    assert_bitwise_equal(c.everything(), expected)
    theirs.close()


def test_initial_load_path_when_the_folder_holds_no_step(tmp_path):
    """``initial_load_path`` (another run's DCP step, here torchtitan's backend's) is read when
    the folder holds no step: the model only (``initial_load_model_only``) or everything."""
    a = Run(str(tmp_path / "unused"))
    a.ckpt.close()
    a.train(3)
    theirs = _titan_dcp(a, str(tmp_path / "seed"))
    assert theirs.save(3)
    theirs.close()
    seed = str(tmp_path / "seed" / "step-3")

    b = Run(str(tmp_path / "ck"), seed=1, initial_load_path=seed, initial_load_model_only=True)
    b.train(1)
    optimizer_before = clone_tree(b.optimizers.state_dict())
    assert b.ckpt.load()
    assert_bitwise_equal(b.model.state_dict(), a.model.state_dict())
    assert_bitwise_equal(b.optimizers.state_dict(), optimizer_before)
    assert b.train_state.step == 1
    b.ckpt.close()

    c = Run(str(tmp_path / "ck2"), seed=2, initial_load_path=seed, initial_load_model_only=False)
    assert c.ckpt.load()
    assert_bitwise_equal(c.everything(), a.everything())
    c.train()
    assert c.ckpt.save(4)  # the run goes on in its own folder; the seed is not touched
    c.ckpt.close()
    assert _steps(str(tmp_path / "ck2")) == [4]
    d = Run(str(tmp_path / "ck2"), seed=3, initial_load_path=seed)
    assert d.ckpt.load() and d.train_state.step == 4  # the folder's step wins over initial_load_path
    d.ckpt.close()

@pytest.mark.slow
def test_a_killed_two_rank_llama_run_resumes_bitwise(tmp_path):
    """torchtitan's llama3 debugmodel on 2 gloo ranks, ``async_with_pinned_mem``: SIGKILLed after
    step 5 (step 4 committed, 5 lost), restarted: its final weights, optimizer and schedule are
    bitwise those of a run that was never interrupted."""
    from ..support.launch import torchrun

    mode = "async_with_pinned_mem"
    full = torchrun(2, "torchtitan_worker.py", str(tmp_path / "full"), "8", "-1", mode, str(tmp_path / "full.txt"),
                    timeout=600)
    assert full.returncode == 0, full.stdout[-3000:]
    killed = torchrun(2, "torchtitan_worker.py", str(tmp_path / "split"), "8", "5", mode, str(tmp_path / "split.txt"),
                      timeout=600)
    assert killed.returncode != 0 and "killed after step 5" in killed.stdout, killed.stdout[-3000:]
    assert _steps(str(tmp_path / "split")) == [2, 4]
    resumed = torchrun(2, "torchtitan_worker.py", str(tmp_path / "split"), "8", "-1", mode,
                       str(tmp_path / "split.txt"), timeout=600)
    assert resumed.returncode == 0 and "starting at step 5" in resumed.stdout, resumed.stdout[-3000:]
    assert (tmp_path / "split.txt").read_text() == (tmp_path / "full.txt").read_text()
    assert _steps(str(tmp_path / "split")) == [6, 8]
