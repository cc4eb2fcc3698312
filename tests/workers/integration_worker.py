"""Training scenarios for tests/frameworks/test_integrations.py, run in subprocesses.

``hf OUT_DIR MAX_STEPS RESUME LOG_JSON [LIMIT]``: a tiny GPT-2 trained by the Hugging Face
``Trainer`` with :class:`AsyncCkptCallback` (``USE_TORCH_XLA=0`` must be set by the caller);
``RESUME`` is 0/1; the losses logged at each step go to ``LOG_JSON``. Under ``torchrun`` (DDP on
gloo) every rank runs it; ranks other than 0 write ``LOG_JSON.<rank>``. ``PEFT`` 1 wraps the model
in a LoRA adapter (peft).

With ``TENSORBOARD_LOGGING_DIR`` set, HF's ``TensorBoardCallback`` logs there too.

``accelerate-tb OUT_DIR``: three ``save_state`` calls through :func:`attach` with accelerate's
TensorBoard tracker logging into ``OUT_DIR/tb``; ``OUT_DIR/stats.json`` gets the saver's stats.

``lightning-kill OUT_DIR``: Lightning training with :class:`AsyncCkptIO` whose writer is
slowed down after the first committed ``last.ckpt``, printing ``WRITING`` when the next write
of it has begun; the test then SIGKILLs the process.
"""

from __future__ import annotations

import json
import os
import sys


def hf(out_dir: str, max_steps: int, resume: bool, log_json: str, limit: int = 2, stop_at: int = 0,
       peft: int = 0) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from async_ckpt.integrations.transformers import AsyncCkptCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1,
                                                 fan_in_fan_out=True))
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (48, 16), generator=g)

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    losses = {}

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

        def on_step_end(self, args, state, control, **kw):
            if stop_at and state.global_step >= stop_at:
                control.should_training_stop = True

    args = TrainingArguments(
        output_dir=out_dir, max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_steps=2, save_total_limit=limit, report_to=[], use_cpu=True, seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0, warmup_steps=2, lr_scheduler_type="linear",
    )
    cb = AsyncCkptCallback()
    callbacks = [cb, Record()]
    if os.environ.get("TENSORBOARD_LOGGING_DIR"):  # HF's own TensorBoard callback writes there
        from transformers.integrations import TensorBoardCallback

        callbacks.append(TensorBoardCallback())
    trainer = Trainer(model=model, args=args, train_dataset=DS(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if resume else None)
    rank = int(os.environ.get("RANK", "0"))
    with open(log_json if rank == 0 else f"{log_json}.{rank}", "w") as f:
        json.dump({"losses": losses, "stats": [st.to_dict() for st in cb.stats],
                   "allocations": cb.snapshotter.pool.allocations}, f)


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "hf":
        hf(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5],
           *(int(a) for a in sys.argv[6:]))
    elif kind not in ("lightning-kill", "accelerate-save", "accelerate-load", "accelerate-tb"):
        raise SystemExit(f"unknown scenario {kind}")


def lit_model_class():
    """A small LightningModule on a fixed dataset of 4 batches per epoch (built on first use so
    that importing this module needs no Lightning)."""
    import lightning as L
    import torch

    class LitModel(L.LightningModule):
        def __init__(self, width: int = 8):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch, i):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(16, self.hparams.width, generator=g), torch.randn(16, 1, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    return LitModel


def lightning_kill(out_dir: str) -> None:
    import threading

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    import async_ckpt.integrations.lightning as mod

    real = mod.write_file
    commits = []

    def slow_write(path, write, fsync=True):
        if os.path.basename(path) == "last.ckpt" and commits:
            def half(f):
                import io

                buf = io.BytesIO()
                write(buf)
                data = buf.getvalue()
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                print("WRITING", flush=True)
                threading.Event().wait(120)
            return real(path, half, fsync=fsync)
        real(path, write, fsync=fsync)
        if os.path.basename(path) == "last.ckpt":
            commits.append(path)
            print("COMMITTED", flush=True)

    mod.write_file = slow_write
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=1, plugins=[mod.AsyncCkptIO()],
                        enable_progress_bar=False, logger=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=out_dir, every_n_train_steps=2, save_top_k=-1,
                                                   save_last=True)])
    trainer.fit(lit_model_class()())


if __name__ == "__main__" and sys.argv[1] == "lightning-kill":
    lightning_kill(sys.argv[2])


def _acc_objects(project_dir: str, seed: int):
    """An Accelerator on CPU (automatic checkpoint naming, total_limit 2) with a small model,
    AdamW, a LambdaLR, a shuffled DataLoader and a registered stateful object, all prepared."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    class Counter:
        def __init__(self):
            self.n = torch.zeros(3, dtype=torch.int64)

        def state_dict(self):
            return {"n": self.n.clone()}

        def load_state_dict(self, sd):
            self.n = sd["n"].clone()

    torch.manual_seed(seed)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g))
    dl = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, dl, sch = acc.prepare(model, opt, dl, sch)
    return acc, model, opt, sch, dl, counter


def _acc_state(acc, model, opt, sch, counter):
    import copy
    import random

    import numpy as np
    import torch

    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sch.state_dict(),
                          "counter": counter.state_dict(), "torch_rng": torch.get_rng_state(),
                          "python_rng": list(random.getstate()[1]),
                          "numpy_rng": torch.from_numpy(np.random.get_state()[1].copy()), "step": acc.step})


def accelerate_save(out_dir: str) -> None:
    """Trains with ``attach(accelerator)`` for 9 steps; saves at steps 3, 5 and 7; at step 7 also
    writes the state as it was at the call (``ref7.pt``) and accelerate's own synchronous
    ``save_state`` of that moment (``own7/``); ``stats.json`` gets the saver's stats."""
    import torch
    from accelerate import Accelerator

    from async_ckpt.integrations.accelerate import AcceleratorAlreadyAttachedError, attach

    acc, model, opt, sch, dl, counter = _acc_objects(os.path.join(out_dir, "proj"), 0)
    attach(acc).close()  # close() gives the accelerator its own save_state back
    print("REATTACHED AFTER CLOSE", flush=True)
    saver = attach(acc)
    try:
        attach(acc)
    except AcceleratorAlreadyAttachedError as exc:
        print("ATTACHED TWICE:", type(exc).__name__, exc, flush=True)
    step = 0
    for epoch in range(3):
        for x, y in dl:
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sch.step()
            opt.zero_grad()
            counter.n += 1
            step += 1
            if step in (3, 5, 7):
                if step == 7:  # accelerate's own save of the same moment, to a directory of its own
                    cfg = acc.project_configuration
                    cfg.automatic_checkpoint_naming = False
                    Accelerator.save_state(acc, os.path.join(out_dir, "own7"))
                    cfg.automatic_checkpoint_naming = True
                    cfg.iteration -= 1  # that save counted one
                    torch.save(_acc_state(acc, model, opt, sch, counter), os.path.join(out_dir, "ref7.pt"))
                returned = acc.save_state()
                print("SAVED", returned, flush=True)
            if step == 9:
                break
        if step == 9:
            break
    saver.close()
    with open(os.path.join(out_dir, "stats.json"), "w") as f:
        json.dump([st.to_dict() for st in saver.stats], f)


def accelerate_load(ckpt_dir: str, out: str) -> None:
    """A plain Accelerator (no attach) loads ``ckpt_dir`` into fresh objects; their state goes to ``out``."""
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as proj:
        acc, model, opt, sch, dl, counter = _acc_objects(proj, 1)
        acc.load_state(ckpt_dir)
        torch.save(_acc_state(acc, model, opt, sch, counter), out)


if __name__ == "__main__" and sys.argv[1] == "accelerate-save":
    accelerate_save(sys.argv[2])
if __name__ == "__main__" and sys.argv[1] == "accelerate-load":
    accelerate_load(sys.argv[2], sys.argv[3])


def accelerate_tb(out_dir: str) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from async_ckpt.integrations.accelerate import attach

    acc = Accelerator(cpu=True, log_with="tensorboard",
                      project_config=ProjectConfiguration(project_dir=os.path.join(out_dir, "tb")))
    acc.init_trackers("run")
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    saver = attach(acc)
    for i in range(3):
        acc.backward(model(torch.randn(2, 8)).sum())
        opt.step()
        opt.zero_grad()
        acc.save_state(os.path.join(out_dir, f"ckpt{i}"))
        saver.wait()  # the next save logs this one's durable time
    saver.close()
    acc.end_training()
    with open(os.path.join(out_dir, "stats.json"), "w") as f:
        json.dump([st.to_dict() for st in saver.stats], f)


if __name__ == "__main__" and sys.argv[1] == "accelerate-tb":
    accelerate_tb(sys.argv[2])
