"""Incremental saves of a real PEFT LoRA model (examples/lora_incremental.py): later steps write
only ~the adapters and their optimizer state, and restore bitwise into a freshly built model.

(a) the example's plain training loop, run twice (the second run resumes);
(b) the Hugging Face ``Trainer``: ``AsyncCkptCallback`` writes HF's own checkpoint layout and has
no ``CheckpointManager`` (so no ``incremental=``), so the Trainer here drives a
``CheckpointManager(incremental=True)`` from a small ``TrainerCallback`` of its own, in a
subprocess with ``USE_TORCH_XLA=0`` (with torch_xla installed HF would pick the XLA device).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from ..support.paths import REPO

pytest.importorskip("peft")
pytest.importorskip("transformers")

from async_ckpt import CheckpointManager  # noqa: E402

from ..support.tree import assert_bitwise_equal  # noqa: E402

ROOT = REPO
MIN_SHARED = 64 * 2**10  # tensors smaller than this are always written (docs/incremental.md)


def _example():
    spec = importlib.util.spec_from_file_location("lora_incremental", os.path.join(ROOT, "examples", "lora_incremental.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tensors(tree, out=None):
    out = [] if out is None else out
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            _tensors(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _tensors(v, out)
    return out


def _nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def _bounds(model, optim):
    """(bytes of the frozen base's tensors that a save may take, bytes a later save must write
    at most: the trainable parameters, the optimizer state, every tensor under 64 KiB)."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    small = [t for t in model.state_dict().values() if t.numel() * t.element_size() < MIN_SHARED]
    changing = _nbytes(trainable) + _nbytes(_tensors(optim.state_dict()["state"])) + _nbytes(small)
    return _nbytes([t for t in frozen if t.numel() * t.element_size() >= MIN_SHARED]), changing


def _check_manifests(root, steps, base_bytes, changing_bytes):
    """The first step wrote everything; every later one took the base and wrote ~the rest."""
    layout = CheckpointManager(root).layout
    first, *later = steps
    assert layout.read_manifest(first).referred_bytes == 0
    for s in later:
        man = layout.read_manifest(s)
        meta = man.files[".metadata"].size
        # the changed tensors (+ their DCP record framing, 10% + 64 KiB) and the metadata
        assert man.written_bytes <= 1.1 * changing_bytes + 64 * 2**10 + meta, (s, man.written_bytes, changing_bytes)
        assert man.referred_bytes >= base_bytes, (s, man.referred_bytes, base_bytes)
        assert man.written_bytes < base_bytes / 4, (s, man.written_bytes, base_bytes)
        assert all(r.ref is not None and r.ref.split("/")[0] == str(first) for r in man.files.values()
                   if r.ref is not None)


def _restore_fresh(ex, root, step):
    model = ex.build_model(0)
    optim = ex.make_optimizer(model)
    state = ex.train_state(model, optim, -1)
    assert CheckpointManager(root).restore(step, state) == step
    optim.load_state_dict(state["optim"])
    return model, optim, state


def test_plain_loop_writes_only_the_adapters_and_restores_bitwise(tmp_path, capsys):
    ex = _example()
    root = str(tmp_path / "lora")
    assert ex.train(root, steps=5, save_interval=2, max_to_keep=5) == (0, 4)
    assert CheckpointManager(root).all_steps() == [0, 2, 4]
    # the trained state at step 4, rebuilt the way the example trains: the same seeds and batches
    model = ex.build_model(0)
    optim = ex.make_optimizer(model)
    base_bytes, changing_bytes = None, None
    for step in range(5):
        tokens = ex.batch(step)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if base_bytes is None:
            base_bytes, changing_bytes = _bounds(model, optim)
    assert base_bytes > 1.5 * 2**20  # the frozen base dominates (2 MiB against ~0.2)
    _check_manifests(root, [0, 2, 4], base_bytes, changing_bytes)

    got_model, got_optim, state = _restore_fresh(ex, root, 4)
    assert state["step"] == 4
    assert_bitwise_equal(model.state_dict(), got_model.state_dict())
    assert_bitwise_equal(optim.state_dict(), got_optim.state_dict())

    # Run twice: the second run resumes from step 4, and its first save (a new manager) compares
    # with step 4, read back from its manifest: the base is not written again.
    capsys.readouterr()
    assert ex.train(root, steps=3, save_interval=2, max_to_keep=5) == (5, 7)
    assert "resumed from step 4" in capsys.readouterr().out
    layout = CheckpointManager(root).layout
    assert layout.read_manifest(6).referred_bytes >= base_bytes
    _check_manifests(root, [0, 6, 7], base_bytes, changing_bytes)
    for step in range(5, 8):
        tokens = ex.batch(step)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    got_model, got_optim, _ = _restore_fresh(ex, root, 7)
    assert_bitwise_equal(model.state_dict(), got_model.state_dict())
    assert_bitwise_equal(optim.state_dict(), got_optim.state_dict())
    # the base's bytes on disk once: the steps' base files are one inode (hard links)
    inodes = {os.stat(os.path.join(layout.locate(s), n)).st_ino
              for s in (0, 2, 4, 6, 7) for n, r in layout.read_manifest(s).files.items()
              if r.size >= base_bytes}
    assert len(inodes) == 1, inodes


# ---- (b) the Hugging Face Trainer -----------------------------------------------------------------

def _tokens(ex):
    """64 causal-LM examples from the example's batches, as the HF Trainer takes them."""

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = ex.batch(i, batch_size=1)[0]
            return {"input_ids": ids, "labels": ids}

    return Tokens()


def _hf_worker(root: str, out: str, max_steps: int) -> None:
    """Train the example's model with ``transformers.Trainer`` for ``max_steps``, checkpointing
    every 2 steps through a ``CheckpointManager(incremental=True)`` driven by a callback; write
    the final model and optimizer state with ``torch.save`` to ``out`` and the bounds as JSON."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ex = _example()
    model = ex.build_model(0)

    class Incremental(TrainerCallback):
        def __init__(self):
            self.mgr = CheckpointManager(root, incremental=True, **{k: v for k, v in ex.manager_kwargs(model).items()
                                                                     if k != "incremental"})
            self.trainer = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 2 == 0:
                self.mgr.save(state.global_step, ex.train_state(model, self.trainer.optimizer, state.global_step))

        def on_train_end(self, args, state, control, **kwargs):
            self.mgr.close()

    cb = Incremental()
    args = TrainingArguments(output_dir=os.path.join(out, "hf"), max_steps=max_steps, per_device_train_batch_size=4,
                             learning_rate=1e-3, save_strategy="no", report_to=[], logging_strategy="no",
                             use_cpu=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=_tokens(ex), callbacks=[cb])
    cb.trainer = trainer
    trainer.train()
    optim = trainer.optimizer
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, os.path.join(out, "final.pt"))
    base_bytes, changing_bytes = _bounds(model, optim)
    with open(os.path.join(out, "bounds.json"), "w") as f:
        json.dump({"base_bytes": base_bytes, "changing_bytes": changing_bytes}, f)


def test_hf_trainer_with_an_incremental_manager(tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    os.makedirs(out)
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    code = ("import sys; from tests.incremental.test_peft_incremental import _hf_worker; "
            "_hf_worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))")
    r = subprocess.run([sys.executable, "-c", code, root, out, "6"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bounds = json.load(open(os.path.join(out, "bounds.json")))
    assert CheckpointManager(root).all_steps() == [2, 4, 6]
    _check_manifests(root, [2, 4, 6], bounds["base_bytes"], bounds["changing_bytes"])
    final = torch.load(os.path.join(out, "final.pt"), weights_only=True)
    # The Trainer's AdamW has two parameter groups (decay / no decay) and the scheduler's
    # initial_lr: the target has that structure, every tensor zeroed and every float set to -1,
    # so that only the restore can make them equal to what was trained.
    def blank(x):
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        if isinstance(x, dict):
            return {k: blank(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(blank(v) for v in x)
        return -1.0 if isinstance(x, float) else x

    model = _example().build_model(0)
    state = {"model": model.state_dict(), "optim": blank(final["optim"]), "step": -1}
    assert CheckpointManager(root).restore(6, state) == 6 and state["step"] == 6
    assert_bitwise_equal(final["model"], model.state_dict())
    assert_bitwise_equal(final["optim"], state["optim"])


def _hf_async_worker(out: str, max_steps: int) -> None:
    """Train the example's LoRA model with ``transformers.Trainer`` and async_ckpt's
    ``AsyncCkptCallback`` (HF's own checkpoint layout, written in the background), saving every 2
    steps; write the adapters' final state dict and the bounds as JSON."""
    from transformers import Trainer, TrainingArguments

    from async_ckpt.integrations.transformers import AsyncCkptCallback

    ex = _example()
    model = ex.build_model(0)

    args = TrainingArguments(output_dir=os.path.join(out, "hf"), max_steps=max_steps, per_device_train_batch_size=4,
                             learning_rate=1e-3, save_strategy="steps", save_steps=2, report_to=[],
                             logging_strategy="no", use_cpu=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=_tokens(ex), callbacks=[AsyncCkptCallback()])
    trainer.train()
    trainable = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    torch.save(trainable, os.path.join(out, "adapters.pt"))
    base_bytes, changing_bytes = _bounds(model, trainer.optimizer)
    with open(os.path.join(out, "bounds.json"), "w") as f:
        json.dump({"base_bytes": base_bytes, "changing_bytes": changing_bytes}, f)


def test_hf_async_callback_with_a_peft_model_writes_only_what_changes(tmp_path):
    """Through async_ckpt's HF Trainer callback, a PEFT model's checkpoints hold its adapters and
    their optimizer state (HF saves a PeftModel through ``save_pretrained``, adapters only): each
    checkpoint costs what changed, not the frozen base, and its adapters are the trained ones."""
    from safetensors.torch import load_file

    out = str(tmp_path / "out")
    os.makedirs(out)
    env = {**os.environ, "USE_TORCH_XLA": "0", "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    code = ("import sys; from tests.incremental.test_peft_incremental import _hf_async_worker; "
            "_hf_async_worker(sys.argv[1], int(sys.argv[2]))")
    r = subprocess.run([sys.executable, "-c", code, out, "4"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bounds = json.load(open(os.path.join(out, "bounds.json")))
    hf = os.path.join(out, "hf")
    assert sorted(n for n in os.listdir(hf) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
    for name in ("checkpoint-2", "checkpoint-4"):
        d = os.path.join(hf, name)
        total = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        # the adapters, AdamW's two moments of them, and small files (configs, RNG, trainer state)
        assert total <= 1.1 * bounds["changing_bytes"] + 256 * 2**10, (name, total, bounds)
        assert total < bounds["base_bytes"] / 2, (name, total, bounds)
    saved = load_file(os.path.join(hf, "checkpoint-4", "adapter_model.safetensors"))
    trained = torch.load(os.path.join(out, "adapters.pt"), weights_only=True)
    assert len(saved) == len(trained) > 0
    by_suffix = {k.split("base_model.model.", 1)[-1].replace(".default", ""): v for k, v in trained.items()}
    for k, v in saved.items():
        assert torch.equal(v, by_suffix[k.split("base_model.model.", 1)[-1]]), k
