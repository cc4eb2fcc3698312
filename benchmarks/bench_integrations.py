"""Per-save stall of the framework integrations against the frameworks' own saves.

Lightning: the ``CheckpointIO.save_checkpoint`` call for a checkpoint dict of an MLP with its
AdamW state (``--mb`` MiB of parameters, so about 3x that in all), through

* ``TorchCheckpointIO`` (Lightning's default: ``torch.save`` in the call),
* Lightning's ``AsyncCheckpointIO`` (clones the tensors in the call, ``torch.save`` in a thread),
* ``AsyncCkptIO`` (pooled host snapshot in the call, atomic write in a thread).

Hugging Face: ``Trainer._save_checkpoint`` (what the training loop blocks on at a save step)
for a GPT-2 built from a config (no download) after one AdamW step, with HF's own save and
with ``AsyncCkptCallback``. CPU only (``USE_TORCH_XLA=0``).

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_integrations.py [--saves 3] [--mb 24]

Stall = wall time of the call; the background writes are waited for between saves (outside
the timing), so every save starts from the same state. Prints the medians and ratios and
writes ``benchmarks/results/bench_integrations.json``. One short run on a small shared
machine: treat differences under ~20% as noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("USE_TORCH_XLA", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def lightning_part(saves: int, mb: int, root: str) -> dict:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

    from async_ckpt.integrations.lightning import AsyncCkptIO

    width = int((mb * 2**20 / 4 / 4) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()

    def checkpoint(step):
        return {"epoch": 0, "global_step": step, "state_dict": model.state_dict(),
                "optimizer_states": [opt.state_dict()], "hyper_parameters": {"width": width}}

    out = {}
    for name, make, wait in (
        ("TorchCheckpointIO", TorchCheckpointIO, lambda io: None),
        ("AsyncCheckpointIO", lambda: AsyncCheckpointIO(TorchCheckpointIO()), lambda io: io.teardown()),
        ("AsyncCkptIO", AsyncCkptIO, lambda io: io.wait()),
    ):
        io = make()
        times = []
        for s in range(saves):
            ck = checkpoint(s)
            t0 = time.perf_counter()
            io.save_checkpoint(ck, os.path.join(root, "lit", name, f"step={s}.ckpt"))
            times.append(time.perf_counter() - t0)
            wait(io)
        io.teardown()
        out[name] = times
    nbytes = sum(t.nbytes for t in model.state_dict().values()) * 3
    return {"checkpoint_mib": nbytes / 2**20, "stall_s": out}


def hf_part(saves: int, root: str) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from async_ckpt.integrations.transformers import AsyncCkptCallback

    cfg = GPT2Config(n_layer=4, n_embd=384, n_head=6, vocab_size=16384, n_positions=64)
    data = torch.randint(0, cfg.vocab_size, (8, 32))

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    out = {}
    nbytes = 0
    for name in ("HF default", "AsyncCkptCallback"):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
        nbytes = sum(p.nbytes for p in model.parameters()) * 3
        args = TrainingArguments(output_dir=os.path.join(root, "hf", name.replace(" ", "_")), max_steps=1,
                                 per_device_train_batch_size=4, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True)
        cb = AsyncCkptCallback() if name != "HF default" else None
        trainer = Trainer(model=model, args=args, train_dataset=DS(), callbacks=[cb] if cb else None)
        trainer.train()
        times = []
        for s in range(saves):
            trainer.state.global_step = 100 + s
            t0 = time.perf_counter()
            trainer._save_checkpoint(trainer.model, None)
            times.append(time.perf_counter() - t0)
            if cb is not None:
                cb.wait()
        out[name] = times
    return {"checkpoint_mib": nbytes / 2**20, "stall_s": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--mb", type=int, default=24, help="MiB of Lightning model parameters")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "bench_integrations.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        res = {"lightning": lightning_part(a.saves, a.mb, root), "transformers": hf_part(a.saves, root)}
    med = {part: {k: statistics.median(v) for k, v in r["stall_s"].items()} for part, r in res.items()}
    ratios = {
        "lightning: TorchCheckpointIO / AsyncCkptIO": med["lightning"]["TorchCheckpointIO"] / med["lightning"]["AsyncCkptIO"],
        "lightning: AsyncCheckpointIO / AsyncCkptIO": med["lightning"]["AsyncCheckpointIO"] / med["lightning"]["AsyncCkptIO"],
        "transformers: HF default / AsyncCkptCallback": med["transformers"]["HF default"] / med["transformers"]["AsyncCkptCallback"],
    }
    res["median_stall_s"] = med
    res["ratios"] = ratios
    for part, r in res.items():
        if part in ("lightning", "transformers"):
            print(f"{part}: checkpoint {r['checkpoint_mib']:.0f} MiB")
            for k, v in med[part].items():
                print(f"  {k:20s} median stall {v * 1e3:8.1f} ms  ({', '.join(f'{x * 1e3:.1f}' for x in r['stall_s'][k])})")
    for k, v in ratios.items():
        print(f"{k}: {v:.1f}x")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
