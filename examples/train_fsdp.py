"""FSDP2 training on CPU with asynchronous sharded checkpoints, resumable at any world size.

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py            # checkpoints/fsdp
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py --steps 60  # resumes, reshards

Every rank stages and writes only its own parameter and optimizer shards; rank 0 commits the
step once every rank has written. Run it again (with the same or another number of processes)
and it resumes from the newest committed step. On GPUs, pass ``--backend nccl``: checkpoint
traffic still goes over the manager's own gloo group.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from async_ckpt import CheckpointManager


def make_model(dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.GELU(), nn.Linear(dim, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt-dir", default="checkpoints/fsdp", help="local path or fsspec URL")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--backend", default="gloo")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if args.backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh(device, (world,))
    model = make_model(args.dim).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state(step: int) -> dict:
        msd, osd = get_state_dict(model, optim)  # sharded (DTensor) state dicts
        return {"model": msd, "optim": osd, "train": {"step": step}}

    # Construct on every rank (it creates the checkpoint group collectively).
    mgr = CheckpointManager(args.ckpt_dir, save_interval=args.save_every, max_to_keep=args.keep)
    start = 0
    if mgr.latest_step() is not None:
        sd = state(0)
        start = mgr.restore(None, sd)  # collective; reshards if the world size changed
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if rank == 0:
            print(f"resumed from step {start} (saved by {mgr.layout.read_manifest(start).world_size} "
                  f"ranks, restored by {world})", flush=True)

    g = torch.Generator().manual_seed(1234 + rank)
    w_true = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(7))
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(32, args.dim, generator=g)
        loss = (model(x.to(device)) - (x @ w_true).to(device)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if mgr.should_save(step):  # the same answer on every rank: save is collective
            sd = state(step)
            t0 = time.perf_counter()
            mgr.save_async(step, sd, metrics={"loss": loss.item()})
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, save blocked "
                      f"{(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    mgr.close()  # waits for the last save to commit on every rank
    if rank == 0:
        print(f"committed steps: {mgr.all_steps()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
