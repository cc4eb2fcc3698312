"""A torchtitan training run on CPU ranks (gloo) with async_ckpt's torchtitan checkpointer
(tests/frameworks/test_torchtitan.py). torchtitan's llama3 ``debugmodel`` built from its config (inner
attention SDPA: FlexAttention has no CPU backward), torchtitan's AdamW and LR-scheduler
containers; gradients all-reduced over the ranks; each step's batch a function of the step and
rank. ``argv``: folder, steps, the step after which to SIGKILL every rank (-1: none),
async_mode, the file rank 0 writes the digest of the final weights, optimizer and schedule to."""

import hashlib
import os
import signal
import sys

import torch
import torch.distributed as dist
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

from async_ckpt.integrations.torchtitan import CheckpointManager


class TrainState:
    step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def digest(model, optimizers, lr_schedulers) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for k, v in sorted(optimizers.state_dict().items()):
        h.update(k.encode() + (v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                               if isinstance(v, torch.Tensor) else repr(v).encode()))
    h.update(repr(lr_schedulers.state_dict()).encode())
    return h.hexdigest()


def main() -> None:
    folder, steps, kill_after, mode, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = model_registry("debugmodel")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                 min_lr_factor=0.0).build(optimizers=optimizers, training_steps=steps)
    train_state = TrainState()
    ckpt = CheckpointManager.Config(enable=True, folder=folder, interval=2, keep_latest_k=2, async_mode=mode,
                                    last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder="")
    ckpt.load()
    print(f"rank {rank}: starting at step {train_state.step + 1}", flush=True)
    while train_state.step < steps:
        train_state.step += 1
        g = torch.Generator().manual_seed(1000 * train_state.step + rank)
        tok = torch.randint(0, 2048, (2, 33), generator=g)
        logits = model(tok[:, :-1], positions=torch.arange(32).expand(2, 32))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten()).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ckpt.maybe_wait_for_staging()  # where torchtitan's trainer calls it
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        ckpt.save(train_state.step, last_step=train_state.step == steps)
        if train_state.step == kill_after:
            ckpt.maybe_wait_for_saving()
            dist.barrier()
            print(f"rank {rank}: killed after step {train_state.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    if rank == 0:
        with open(out, "w") as f:
            f.write(digest(model, optimizers, lr_schedulers))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
