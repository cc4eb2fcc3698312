"""Fine-tune a tiny Llama with PEFT LoRA, checkpointing incrementally, and resume.

The base model is frozen; only the LoRA adapters and their AdamW state change from step to
step. With ``CheckpointManager(..., incremental=True)`` every save after the first writes only
those (and the small values); the frozen base is taken from the last step (a hard link on a
local path, so it is stored once for all retained steps). See docs/incremental.md.

    python examples/lora_incremental.py                       # checkpoints in checkpoints/lora
    python examples/lora_incremental.py --ckpt-dir /tmp/lora --steps 6 --save-interval 2

Run it twice: the second run restores the newest step (model and optimizer) and goes on. The
model is built from a config (no download): ``transformers.LlamaConfig`` with tiny sizes and a
fixed seed, so every run builds the same base weights.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, Tuple

import torch

import async_ckpt
from async_ckpt import CheckpointManager


def build_model(seed: int = 0, hidden: int = 128, layers: int = 2, vocab: int = 512) -> Any:
    """A tiny Llama with LoRA adapters on its attention projections, identical for a given seed.

    Args:
        seed: the seed of the base weights and of the adapters' initialisation.
        hidden: the hidden size (the attention projections are ``hidden x hidden``).
        layers: the number of decoder layers.
        vocab: the vocabulary size.

    Returns:
        The ``peft`` model: the base frozen (``requires_grad=False``), the adapters trainable.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64, tie_word_embeddings=False)
    base = LlamaForCausalLM(config)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(base, lora)


def batch(step: int, batch_size: int = 4, seq: int = 32, vocab: int = 512) -> torch.Tensor:
    """Synthetic token sequences for ``step`` (each counts upward by a random stride).

    Args:
        step: the training step (the seed of its batch).
        batch_size: sequences per batch.
        seq: tokens per sequence.
        vocab: the vocabulary size.

    Returns:
        Token ids of shape ``(batch_size, seq)``.
    """
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    return (start + stride * torch.arange(seq)) % vocab


def make_optimizer(model: Any) -> torch.optim.Optimizer:
    """AdamW over the trainable (LoRA) parameters only.

    Args:
        model: the model of :func:`build_model`.

    Returns:
        The optimizer.
    """
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def train_state(model: Any, optim: torch.optim.Optimizer, step: int) -> Dict[str, Any]:
    """What a checkpoint holds: the whole model (base and adapters), the optimizer, the step.

    Args:
        model: the model.
        optim: its optimizer.
        step: the last step trained.

    Returns:
        The state dict to save, or to restore into in place.
    """
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}


def manager_kwargs(model: Any) -> Dict[str, Any]:
    """The manager's incremental options: ``incremental=True``, and the frozen base declared
    with ``frozen=`` where the installed async_ckpt has it (it then skips even the host copy of
    the unchanged base).

    Args:
        model: the model (its ``requires_grad=False`` parameters are the frozen base).

    Returns:
        Keyword arguments for :class:`CheckpointManager`.
    """
    kwargs: Dict[str, Any] = {"incremental": True}
    if hasattr(async_ckpt, "frozen_keys"):
        kwargs["frozen"] = async_ckpt.frozen_keys(model, prefix="model.")
    return kwargs


def resume(mgr: CheckpointManager, model: Any, optim: torch.optim.Optimizer) -> int:
    """Restore the newest committed step into ``model`` and ``optim``, if there is one.

    Args:
        mgr: the checkpoint manager.
        model: the freshly built model.
        optim: its fresh optimizer.

    Returns:
        The first step to train (0 without a checkpoint).
    """
    if mgr.latest_step() is None:
        return 0
    state = train_state(model, optim, 0)
    step = mgr.restore(None, state)  # model tensors in place; the optimizer's state filled in
    optim.load_state_dict(state["optim"])
    return step + 1


def train(ckpt_dir: str, steps: int, save_interval: int = 2, max_to_keep: int = 3,
          seed: int = 0) -> Tuple[int, int]:
    """Train ``steps`` steps from the newest checkpoint under ``ckpt_dir`` (or from scratch).

    Args:
        ckpt_dir: the checkpoint root (a local path or an fsspec URL).
        steps: steps to train in this run.
        save_interval: save every this many steps.
        max_to_keep: retained checkpoints.
        seed: the model's seed (the same in every run, so the frozen base is the same).

    Returns:
        ``(first step trained, last step trained)``.
    """
    model = build_model(seed)
    optim = make_optimizer(model)
    with CheckpointManager(ckpt_dir, save_interval=save_interval, max_to_keep=max_to_keep,
                           **manager_kwargs(model)) as mgr:
        start = resume(mgr, model, optim)
        if start:
            print(f"resumed from step {start - 1}")
        end = start + steps - 1
        for step in range(start, end + 1):
            tokens = batch(step)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            if mgr.save_async(step, train_state(model, optim, step), force=step == end):
                mgr.join()  # only to print this save's sizes below; a training loop would go on
                st = mgr.stats[-1]
                man = mgr.layout.read_manifest(step)
                print(f"step {step}: loss {loss.item():.4f}; saved in {st.blocking_s * 1e3:.1f} ms of stall, "
                      f"{man.written_bytes / 2**10:.1f} KiB written, "
                      f"{man.referred_bytes / 2**10:.1f} KiB taken from earlier steps")
    return start, end


def main(argv: Any = None) -> int:
    """The command line (see the module docstring).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", default="checkpoints/lora", help="local path or fsspec URL")
    p.add_argument("--steps", type=int, default=8, help="steps to train in this run")
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--max-to-keep", type=int, default=3)
    args = p.parse_args(argv)
    start, end = train(args.ckpt_dir, args.steps, args.save_interval, args.max_to_keep)
    print(f"trained steps {start}..{end}; checkpoints under {args.ckpt_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
