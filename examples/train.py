"""Train a small transformer on synthetic data with asynchronous checkpoints, and resume.

    python examples/train.py                      # CPU, checkpoints in checkpoints/demo
    PJRT_DEVICE=CPU python examples/train.py --device xla
    python examples/train.py --ckpt-dir gs://bucket/run1   # any fsspec URL

Run it twice: the second run resumes from the newest committed checkpoint and says so.
Interrupt it with Ctrl-C: pending saves finish, and the last committed step survives.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time

import torch
import torch.nn as nn

from async_ckpt import CheckpointManager


class TinyLM(nn.Module):
    """A two-layer transformer language model over a small vocabulary."""

    def __init__(self, vocab: int = 256, dim: int = 256, layers: int = 2, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied weights: staged once, restored shared
        nn.init.normal_(self.embed.weight, std=0.02)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.body(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True))


def batch(step: int, batch_size: int, seq: int, vocab: int, device: torch.device):
    """Synthetic data with structure to learn: each sequence counts upward by a random stride."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", default="checkpoints/demo", help="local path or fsspec URL")
    p.add_argument("--device", choices=["cpu", "xla", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=120, help="steps to train in this run")
    p.add_argument("--save-interval", type=int, default=20)
    p.add_argument("--max-to-keep", type=int, default=3)
    p.add_argument("--local-dir", default=None,
                   help="a second, fast tier (e.g. /dev/shm/demo): a local copy every --local-interval steps")
    p.add_argument("--local-interval", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dim", type=int, default=256)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    if args.device == "xla":
        import torch_xla

        device = torch_xla.device()
    else:
        device = torch.device(args.device)
    torch.manual_seed(0)
    seq, vocab = 64, 256
    model = TinyLM(vocab=vocab, dim=args.dim, seq=seq).to(device)
    model.head.weight = model.embed.weight  # .to(xla) can untie weights: tie them again
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loss_fn = nn.CrossEntropyLoss()

    tiers = dict(local_dir=args.local_dir, local_policy=args.local_interval) if args.local_dir else {}
    mgr = CheckpointManager(args.ckpt_dir, save_interval=args.save_interval, max_to_keep=args.max_to_keep, **tiers)
    start = 0
    if mgr.latest_step() is not None:
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        restored = mgr.restore(None, state)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = restored + 1
        print(f"Resuming from checkpoint step {restored} in {args.ckpt_dir}")
    else:
        print(f"No checkpoint in {args.ckpt_dir}: starting from scratch")
    nparams = sum(p.numel() for p in model.parameters())
    print(f"model: {nparams / 1e6:.2f}M parameters on {device}; training steps {start}..{start + args.steps - 1}")

    step = start
    try:
        for step in range(start, start + args.steps):
            x, y = batch(step, args.batch_size, seq, vocab, device)
            loss = loss_fn(model(x).reshape(-1, vocab), y.reshape(-1))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            if args.device == "xla":
                torch_xla.sync()
            if mgr.should_save(step):
                loss_value = float(loss.detach().cpu())
                state = {"model": model.state_dict(), "optim": optim.state_dict()}
                t0 = time.perf_counter()
                mgr.save_async(step, state, metrics={"loss": loss_value})
                ms = (time.perf_counter() - t0) * 1e3
                print(f"step {step:5d}  loss {loss_value:.4f}  save_async blocked {ms:7.2f} ms")
        if args.steps > 0 and not mgr.should_save(step):  # the steps since the last due save are kept too
            state = {"model": model.state_dict(), "optim": optim.state_dict()}
            mgr.save(step, state, force=True, metrics={"loss": float(loss.detach().cpu())})
            print(f"step {step:5d}  final save")
        mgr.close()
    except KeyboardInterrupt:
        print(f"\nInterrupted at step {step}: finishing pending saves (Ctrl-C again to abandon them)...",
              file=sys.stderr)
        try:
            mgr.close()
        except KeyboardInterrupt:
            pass  # abandoned: nothing of those saves was committed
        print(f"Last committed step: {mgr.latest_step()}", file=sys.stderr)
        return 130
    last = mgr.stats[-1] if mgr.stats else None
    if last is not None:
        print("last save:", last.summary())
    if args.local_dir:
        print("done; committed steps (tiers):", {s: "+".join(t) for s, t in sorted(mgr.step_tiers().items())})
    else:
        print(f"done; committed steps: {mgr.all_steps()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
