"""The framework integrations: Lightning's ``AsyncCkptIO`` and the HF ``AsyncCkptCallback``.

Lightning runs in this process on CPU; the HF Trainer runs in subprocesses with
``USE_TORCH_XLA=0`` (with torch_xla installed it would pick the XLA device even with
``use_cpu=True``). No model or data is downloaded: tiny models from configs, synthetic data.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from async_ckpt import CheckpointError, CorruptCheckpointError, InvalidStateDictError

from ..support.paths import REPO, WORKERS

ROOT = Path(REPO)
WORKER = os.path.join(WORKERS, "integration_worker.py")

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from async_ckpt.integrations.lightning import AsyncCkptIO  # noqa: E402

from ..conftest import flip_byte  # noqa: E402
from ..support.launch import torchrun_command  # noqa: E402
from ..workers.integration_worker import lit_model_class  # noqa: E402

LitModel = lit_model_class()
LitModel.__module__, LitModel.__qualname__ = __name__, "LitModel"  # picklable by name (torch.save(trainer))


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _trainer(dirpath, max_steps, io=None, **ckpt):
    cb = ModelCheckpoint(dirpath=str(dirpath), every_n_train_steps=2, save_top_k=2, save_last=True,
                         monitor="train_loss", **ckpt)
    plugins = [io] if io is not None else []
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, plugins=plugins, callbacks=[cb],
                     enable_progress_bar=False, logger=False, enable_model_summary=False,
                     deterministic=True), cb


def _tensors(obj):
    """Every tensor of a nested checkpoint, by path (bitwise comparisons)."""
    out = {}

    def walk(v, p):
        if isinstance(v, torch.Tensor):
            out[p] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{p}.{k}")
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, f"{p}.{i}")

    walk(obj, "")
    return out


def io_bytes(data):
    import io

    return io.BytesIO(data)


def _bitwise(a, b):
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].contiguous().view(torch.uint8) if ta[k].dim() else ta[k].reshape(1).view(torch.uint8),
                           tb[k].contiguous().view(torch.uint8) if tb[k].dim() else tb[k].reshape(1).view(torch.uint8)), k


# ---- Lightning ---------------------------------------------------------------------------------

def test_lightning_resume_from_last_is_bitwise_the_uninterrupted_run(tmp_path):
    torch.manual_seed(0)
    full, _ = _trainer(tmp_path / "full", 8, AsyncCkptIO())
    m_full = LitModel()
    full.fit(m_full)

    torch.manual_seed(0)
    first, _ = _trainer(tmp_path / "split", 4, AsyncCkptIO())
    first.fit(LitModel())
    # the files are plain torch.save files: torch.load and load_from_checkpoint read them
    last = torch.load(tmp_path / "split" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 4
    ref = torch.load(tmp_path / "full" / "epoch=0-step=4.ckpt", weights_only=False)
    _bitwise(last["state_dict"], ref["state_dict"])
    _bitwise(last["optimizer_states"], ref["optimizer_states"])
    assert isinstance(last["state_dict"], type(ref["state_dict"]))
    assert last["state_dict"]._metadata == ref["state_dict"]._metadata
    loaded = LitModel.load_from_checkpoint(tmp_path / "split" / "last.ckpt")
    _bitwise(loaded.state_dict(), ref["state_dict"])

    second, _ = _trainer(tmp_path / "split", 8, AsyncCkptIO())
    m_resumed = LitModel()
    second.fit(m_resumed, ckpt_path="last")
    assert second.global_step == full.global_step == 8
    _bitwise(m_resumed.state_dict(), m_full.state_dict())
    _bitwise(second.optimizers[0].state_dict(), full.optimizers[0].state_dict())
    a = torch.load(tmp_path / "split" / "last.ckpt", weights_only=False)
    b = torch.load(tmp_path / "full" / "last.ckpt", weights_only=False)
    _bitwise(a["state_dict"], b["state_dict"])
    _bitwise(a["optimizer_states"], b["optimizer_states"])
    assert a["lr_schedulers"] == b["lr_schedulers"]
    # top-k (2) + last: rotation went through remove_checkpoint
    names = sorted(p.name for p in (tmp_path / "split").iterdir())
    assert "last.ckpt" in names and len([n for n in names if n != "last.ckpt"]) == 2, names


def test_lightning_second_fit_on_same_trainer_and_pool_reuse(tmp_path):
    io = AsyncCkptIO(max_pending=1)
    trainer, cb = _trainer(tmp_path, 4, io)
    model = LitModel()
    trainer.fit(model)
    allocs, first_bytes = io.snapshotter.pool.allocations, io.snapshotter.pool.allocated_bytes
    assert io.saves >= 4 and not io.pending and allocs >= 1
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(model)  # the writer thread ended at teardown; the second fit starts a new one
    assert trainer.global_step == 8
    # Steady state: the buffers are reused, nothing leaks. At most max_pending copies are being
    # written while one more is taken, and the pool may keep one spare block from a quiet moment;
    # which copies overlap depends on the writer's timing (the pool trims to its peak when nothing
    # is leased, and grows back), so the count of fresh allocations may differ from the first
    # fit's. A leak would hold a block per save (8 here).
    pool = io.snapshotter.pool
    per_copy = first_bytes // allocs
    assert pool.allocated_bytes <= (io.writer.max_pending + 2) * per_copy, (pool.allocated_bytes, per_copy)
    assert all(s.nbytes == io.stats[0].nbytes for s in io.stats)  # every copy the same size
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 8


def test_lightning_remove_waits_for_a_pending_write_and_keeps_the_newest(tmp_path):
    io = AsyncCkptIO(max_pending=4, sync_explicit=False)  # direct calls in the background, as ModelCheckpoint's
    a, b = f"faulty://{tmp_path}/a.ckpt", f"faulty://{tmp_path}/b.ckpt"
    stuck = io.filesystem(a).inject("write", ".a.ckpt.*", "hang", times=1)  # the data write of a.ckpt hangs
    io.save_checkpoint({"w": torch.arange(4.0)}, a)
    io.save_checkpoint({"w": torch.arange(8.0)}, b)
    assert stuck.reached.wait(30)
    done = threading.Event()
    t = threading.Thread(target=lambda: (io.remove_checkpoint(a), done.set()))
    t.start()
    assert not done.wait(0.5)  # still waiting for the write of a.ckpt
    stuck.release.set()
    t.join(30)
    assert done.is_set() and not (tmp_path / "a.ckpt").exists()
    io.remove_checkpoint(b)  # the newest: kept
    io.teardown()
    assert torch.equal(torch.load(tmp_path / "b.ckpt")["w"], torch.arange(8.0))


def test_lightning_snapshot_is_taken_at_the_call_and_files_are_compact(tmp_path):
    io = AsyncCkptIO(sync_explicit=False)
    big = torch.randn(1000)
    w = torch.randn(4, 4)
    ck = {"state_dict": {"w": w, "tied": w, "row": w[1], "small": torch.ones(3)}, "hp": {"lr": [0.1]},
          "big": big}
    io.save_checkpoint(ck, tmp_path / "x.ckpt")
    expect = {k: v.clone() for k, v in ck["state_dict"].items()}
    w.add_(1.0)  # mutations after the call do not reach the checkpoint
    ck["hp"]["lr"].append(5)
    loaded = io.load_checkpoint(tmp_path / "x.ckpt")
    io.teardown()
    _bitwise(loaded["state_dict"], expect)
    assert loaded["hp"] == {"lr": [0.1]}
    sd = loaded["state_dict"]
    assert sd["w"] is sd["tied"]  # one tensor, as saved
    assert sd["row"].untyped_storage().data_ptr() == sd["w"].untyped_storage().data_ptr()  # a view, as saved
    # each tensor on a storage of its own bytes: the pool's shared slab does not leak into the file
    assert sd["small"].untyped_storage().nbytes() == 12
    assert loaded["big"].untyped_storage().nbytes() == 4000


def test_lightning_damaged_file_and_background_errors(tmp_path):
    io = AsyncCkptIO(sync_explicit=False)
    io.save_checkpoint({"w": torch.randn(64)}, tmp_path / "x.ckpt")
    io.wait()
    flip_byte(str(tmp_path / "x.ckpt"), at=(tmp_path / "x.ckpt").read_bytes().find(b"data/0") + 200, mask=0xFF)
    with pytest.raises(CorruptCheckpointError, match="x.ckpt"):
        io.load_checkpoint(tmp_path / "x.ckpt")
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    # a write that fails in the background surfaces at teardown, naming the path
    (tmp_path / "blocker").write_text("a file, not a directory")
    io.save_checkpoint({"w": torch.randn(4)}, tmp_path / "blocker" / "y.ckpt")
    with pytest.raises(CheckpointError, match="y.ckpt"):
        io.teardown()
    with pytest.raises(InvalidStateDictError, match="z.ckpt"):
        io.save_checkpoint({"f": lambda: 1}, tmp_path / "z.ckpt")
    with pytest.raises(TypeError, match="storage_options must be a dict of fsspec"):
        io.save_checkpoint({"w": torch.randn(4)}, tmp_path / "s.ckpt", storage_options="a token")


@pytest.mark.slow
def test_lightning_sigkill_mid_write_resumes_from_an_intact_last(tmp_path):
    out = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, WORKER, "lightning-kill", str(out)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line.strip())
            if line.strip() == "WRITING":
                break
        assert "COMMITTED" in seen and seen[-1] == "WRITING", seen
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(60)
    assert any(p.name.startswith(".last.ckpt.tmp-") for p in out.iterdir())  # the torn write, aside
    last = torch.load(out / "last.ckpt", weights_only=False)  # intact: the previous commit
    assert last["global_step"] == 2
    trainer, _ = _trainer(out, 4, AsyncCkptIO())
    model = LitModel()
    trainer.fit(model, ckpt_path="last")
    assert trainer.global_step == 4
    io = AsyncCkptIO()
    io.save_checkpoint({"w": torch.zeros(2)}, out / "last.ckpt")
    io.teardown()
    assert not any(p.name.startswith(".last.ckpt.") for p in out.iterdir())  # the next write of it cleans up


def test_lightning_explicit_save_checkpoint_is_durable_on_return(tmp_path):
    """``trainer.save_checkpoint("manual.ckpt")`` from user code returns once the file is
    committed (``torch.load`` right after it works); ModelCheckpoint's saves stay asynchronous;
    ``stats`` has the core manager's SaveStats for every save."""
    io = AsyncCkptIO()
    trainer, _ = _trainer(tmp_path / "ck", 4, io)
    model = LitModel(width=50_000)  # a few MB with AdamW: the write is not instantaneous
    trainer.fit(model)
    manual = tmp_path / "manual.ckpt"
    trainer.save_checkpoint(manual)
    assert io.pending == [] and manual.exists()
    loaded = torch.load(manual, weights_only=False)
    assert loaded["global_step"] == 4
    _bitwise(loaded["state_dict"], model.state_dict())
    auto = [s for s in io.stats if s.extra["path"] != str(manual)]
    assert [s.step for s in auto if s.extra["path"].endswith("last.ckpt")] == [2, 4]
    assert all(not s.extra["synchronous"] for s in auto)  # ModelCheckpoint: in the background
    last = io.stats[-1]
    assert last.extra == {"path": str(manual), "synchronous": True} and last.step == 4
    for s in io.stats:
        assert s.nbytes > 0 and s.num_tensors > 0 and s.files == 1
        assert s.durable_s is not None and s.commit_time is not None and s.write_s > 0
        assert s.blocking_s >= s.stage_s
    assert last.blocking_s >= last.durable_s  # the explicit save waited for its commit


def test_lightning_remote_storage_options_and_atomic_remote_writes(tmp_path):
    """Remote (fsspec) paths: ``storage_options`` reach the filesystem, and a write that fails
    mid-upload leaves the previous file intact (it goes to a temporary object first)."""
    import fsspec

    from ..support import faulty_fs  # noqa: F401  (registers faulty://)

    mem = fsspec.filesystem("memory")
    io = AsyncCkptIO(storage_options={"target_protocol": "memory"})
    try:
        io.save_checkpoint({"w": torch.arange(6.0)}, "faulty:///acx/m.ckpt")
        assert torch.equal(torch.load(io_bytes(mem.cat("/acx/m.ckpt")))["w"], torch.arange(6.0))
        assert torch.equal(io.load_checkpoint("faulty:///acx/m.ckpt")["w"], torch.arange(6.0))
        io.remove_checkpoint("faulty:///acx/other.ckpt")  # absent: nothing to do
        # per-call options override the plugin's: here the local disk
        local = AsyncCkptIO()
        path = f"faulty://{tmp_path}/last.ckpt"
        first = {"w": torch.randn(5000)}
        local.save_checkpoint(first, path, storage_options={"target_protocol": "file"})
        fs = local.filesystem(path, {"target_protocol": "file"})
        fs.inject("write", "*last.ckpt*", "reset", times=1, after_bytes=4096)
        with pytest.raises(CheckpointError, match="last.ckpt"):
            local.save_checkpoint({"w": torch.randn(5000)}, path, storage_options={"target_protocol": "file"})
        assert fs.hits  # the fault did hit the upload
        _bitwise(torch.load(tmp_path / "last.ckpt"), first)  # the previous file, intact
        assert os.listdir(tmp_path) == ["last.ckpt"]  # no temporary left behind
        local.teardown()
        io.teardown()
    finally:
        if mem.exists("/acx"):
            mem.rm("/acx", recursive=True)


# ---- the save figures, in the frameworks' own loggers (TensorBoard event files read back) -------

def _tb_scalars(logdir):
    """Every scalar of the TensorBoard event files under ``logdir``: tag -> [(step, value)]."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for d in sorted({str(p.parent) for p in Path(logdir).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(d)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def test_lightning_logs_each_save_s_figures_to_the_trainer_s_logger(tmp_path):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger

    io = AsyncCkptIO()
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    logger = TensorBoardLogger(str(tmp_path / "tb"), name="run")
    trainer = L.Trainer(max_steps=6, accelerator="cpu", devices=1, plugins=[io], callbacks=[cb], logger=logger,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(LitModel())
    scalars = _tb_scalars(tmp_path / "tb")
    blocking = scalars["checkpoint/blocking_s"]
    assert [s for s, _ in blocking] == [2, 4, 6] == [s.step for s in io.stats]
    assert [v for _, v in blocking] == pytest.approx([s.blocking_s for s in io.stats], rel=1e-6)  # float32
    assert [v for _, v in scalars["checkpoint/nbytes"]] == [float(s.nbytes) for s in io.stats]
    durable = scalars["checkpoint/durable_s"]  # an earlier save's, once committed, logged at a later one
    assert durable and {s for s, _ in durable} <= {4, 6}
    assert all(any(v == pytest.approx(s.durable_s, rel=1e-6) for s in io.stats) for _, v in durable)
    assert "train_loss" in scalars  # beside the user's own figures
    # a save outside a run (fit is over) logs nothing: a logger would make its own directory
    trainer.save_checkpoint(str(tmp_path / "after.ckpt"))
    io.writer.wait(str(tmp_path / "after.ckpt"))
    logger.experiment.flush()
    assert [s for s, _ in _tb_scalars(tmp_path / "tb")["checkpoint/blocking_s"]] == [2, 4, 6]


@pytest.mark.slow
def test_hf_trainer_sends_each_save_s_figures_to_its_trackers(tmp_path):
    pytest.importorskip("tensorboard")
    out = _hf(tmp_path / "out", 6, False, tmp_path / "log.json", 2, 0, 0,
              env={"TENSORBOARD_LOGGING_DIR": str(tmp_path / "tb")})
    stats = out["stats"]  # SaveStats, as the core manager's
    assert [s["step"] for s in stats] == [2, 4, 6] and all(s["durable_s"] and s["files"] >= 5 for s in stats)
    assert all(s["written_bytes"] > s["nbytes"] > 0 and s["extra"]["path"].endswith(f"checkpoint-{s['step']}")
               for s in stats)
    scalars = _tb_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["train/checkpoint/blocking_s"]] == [2, 4, 6]
    assert [v for _, v in scalars["train/checkpoint/blocking_s"]] == pytest.approx([s["blocking_s"] for s in stats],
                                                                                   rel=1e-6)
    assert {s for s, _ in scalars["train/checkpoint/durable_s"]} <= {4, 6} and "train/loss" in scalars


def test_accelerate_logs_each_save_s_figures_to_its_trackers(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("tensorboard")
    _worker("accelerate-tb", tmp_path)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert [s["step"] for s in stats] == [0, 1, 2] and all(s["durable_s"] and s["written_bytes"] for s in stats)
    scalars = _tb_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["checkpoint/blocking_s"]] == [0, 1, 2]
    assert [v for _, v in scalars["checkpoint/blocking_s"]] == pytest.approx([s["blocking_s"] for s in stats], rel=1e-6)
    assert [(s, v) for s, v in scalars["checkpoint/durable_s"]] == [
        (1, pytest.approx(stats[0]["durable_s"], rel=1e-6)), (2, pytest.approx(stats[1]["durable_s"], rel=1e-6))]


def test_lightning_versioned_names_are_taken_while_their_writes_are_in_flight(tmp_path):
    """ModelCheckpoint versions a name (``epoch=0-v1.ckpt``) only if the name exists: a
    ``filename="{epoch}"`` callback keeping every step's checkpoint reused ``epoch=0.ckpt``
    while its write was in flight, and kept 2 of 6 checkpoints. Here every write is held until training ends:
    the six saves still get six names, each file holding its own step, as with Lightning's own
    synchronous plugin."""
    from lightning.pytorch.callbacks import Callback

    from ..support import faulty_fs  # noqa: F401  (registers faulty://)

    io = AsyncCkptIO(max_pending=8)
    url = f"faulty://{tmp_path}/ck"
    held = io.filesystem(url).inject("write", ".epoch=0.ckpt.*", "hang", times=1)  # the first file's write

    class Release(Callback):
        def on_train_end(self, trainer, pl_module):
            held.release.set()

    def run(dirpath, plugins, callbacks=()):
        cb = ModelCheckpoint(dirpath=dirpath, filename="{epoch}", every_n_train_steps=1, save_top_k=-1,
                             monitor="train_loss")
        L.Trainer(max_steps=6, accelerator="cpu", devices=1, plugins=plugins, callbacks=[cb, *callbacks],
                  enable_progress_bar=False, logger=False, enable_model_summary=False).fit(LitModel())
        return {p.name: torch.load(p, weights_only=False)["global_step"] for p in Path(dirpath.split("://")[-1]).iterdir()}

    ours = run(url, [io], [Release()])
    assert held.reached.is_set()
    reference = run(str(tmp_path / "ref"), [])  # Lightning's own (synchronous) plugin
    assert len(reference) == 6 and sorted(reference.values()) == [1, 2, 3, 4, 5, 6], reference
    assert ours == reference


def test_lightning_a_failed_first_write_leaves_no_file_and_an_interrupted_one_is_named(tmp_path):
    """The name a write takes at the call is given back if the write fails (no empty file
    left); one a killed process left empty is refused by ``load_checkpoint`` as empty."""
    io = AsyncCkptIO(sync_explicit=False)
    (tmp_path / "blocker").write_text("a file, not a directory")
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    io.wait()
    (tmp_path / "a.ckpt").write_bytes(b"")  # what a kill mid-write leaves of a first write
    with pytest.raises(CorruptCheckpointError, match="a.ckpt.*empty"):
        io.load_checkpoint(tmp_path / "a.ckpt")
    from ..support import faulty_fs  # noqa: F401  (registers faulty://)

    url = f"faulty://{tmp_path}/b.ckpt"
    io.filesystem(url).inject("write", ".b.ckpt.*", "eio", times=1)
    io.save_checkpoint({"w": torch.ones(2)}, url)
    with pytest.raises(CheckpointError, match="b.ckpt"):
        io.wait()
    assert not (tmp_path / "b.ckpt").exists()
    io.teardown()


def test_lightning_writer_thread_ends_with_its_work_without_teardown(tmp_path):
    """Lightning's own ``AsyncCheckpointIO`` wrapping the plugin never calls its ``teardown``
    (nor does a script saving outside ``fit``): the writer thread stayed alive for good
    (Lightning's test suite: "Test left zombie thread"). It ends once no write is queued, and a
    later save starts another."""
    import time

    def writers():
        return [t for t in threading.enumerate() if t.name.startswith("async-ckpt-lightning")]

    io = AsyncCkptIO()
    for i in range(2):
        io.save_checkpoint({"w": torch.full((3,), float(i))}, tmp_path / "x.ckpt")  # explicit: committed on return
        deadline = time.monotonic() + 10
        while writers() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not writers() and torch.load(tmp_path / "x.ckpt")["w"][0] == i


def test_lightning_plugin_and_hf_callback_pickle_and_the_copy_saves(tmp_path):
    """``AsyncCkptIO`` could not be pickled (its lock and writer thread), so ``ddp_spawn`` failed,
    and ``torch.save(trainer)`` after ``fit`` failed on the pooled host buffers. A pickled copy
    keeps the settings and rebuilds its runtime state."""
    import pickle

    io = AsyncCkptIO(max_pending=3, fsync=False, sync_explicit=False, storage_options={"anon": True})
    trainer, _ = _trainer(tmp_path / "ck", 2, io)
    trainer.fit(LitModel())
    torch.save(trainer, tmp_path / "trainer.pt")  # the trainer, with its plugin and the pool it used
    copy = torch.load(tmp_path / "trainer.pt", weights_only=False).strategy.checkpoint_io
    again = pickle.loads(pickle.dumps(io))
    for c in (copy, again):
        assert type(c) is AsyncCkptIO and c is not io
        assert (c.writer.max_pending, c.fsync, c.sync_explicit, c.storage_options) == (3, False, False, {"anon": True})
        assert c.pending == [] and c.snapshotter.pool is not io.snapshotter.pool
        c.save_checkpoint({"w": torch.arange(3.0)}, tmp_path / f"{id(c)}.ckpt")
        assert torch.equal(c.load_checkpoint(tmp_path / f"{id(c)}.ckpt")["w"], torch.arange(3.0))
        c.teardown()
    hf = pytest.importorskip("async_ckpt.integrations.transformers")
    cb = pickle.loads(pickle.dumps(hf.AsyncCkptCallback(max_pending=3, fsync=False)))  # the same cause
    assert (cb.writer.max_pending, cb.fsync, cb.trainer, cb.writer.pending()) == (3, False, None, [])


# ---- Hugging Face ------------------------------------------------------------------------------

def _hf(out, max_steps, resume, log, *extra, nproc=0, env=None):
    """One HF run of integration_worker.py ``hf``; ``nproc`` > 0: under torchrun (DDP, gloo)."""
    pytest.importorskip("transformers")
    args = ["hf", str(out), str(max_steps), "1" if resume else "0", str(log), *map(str, extra)]
    cmd = torchrun_command(nproc, WORKER, *args) if nproc else [sys.executable, WORKER, *args]
    r = subprocess.run(cmd, env=_env(USE_TORCH_XLA="0", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
                                     **(env or {})), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads(Path(log).read_text())


def _hf_checkpoints_equal(a, b):
    """Bitwise: every tensor file of two checkpoint directories (safetensors and torch.save)."""
    from safetensors.torch import load_file

    names = sorted(n for n in os.listdir(a) if n.endswith((".safetensors", ".pt", ".pth")))
    assert names == sorted(n for n in os.listdir(b) if n.endswith((".safetensors", ".pt", ".pth")))
    for n in names:
        if n.endswith(".safetensors"):
            _bitwise(load_file(a / n), load_file(b / n))
        else:
            _bitwise(torch.load(a / n, weights_only=False), torch.load(b / n, weights_only=False))
    return names


@pytest.mark.slow
def test_hf_interrupted_run_resumes_with_the_same_losses(tmp_path):
    full = _hf(tmp_path / "full", 8, False, tmp_path / "full.json")
    cut = _hf(tmp_path / "cut", 8, False, tmp_path / "cut.json", 2, 5)  # stops after step 5
    assert sorted(os.listdir(tmp_path / "cut")) == ["checkpoint-2", "checkpoint-4"]
    resumed = _hf(tmp_path / "cut", 8, True, tmp_path / "resumed.json")
    assert set(resumed["losses"]) == {"5", "6", "7", "8"}
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], step  # bit for bit, logged step by step
    for step in ("1", "2", "3", "4", "5"):
        assert cut["losses"][step] == full["losses"][step]
    # save_total_limit=2: the two newest remain, nothing in flight is left behind
    assert sorted(os.listdir(tmp_path / "full")) == ["checkpoint-6", "checkpoint-8"]
    assert sorted(os.listdir(tmp_path / "cut")) == ["checkpoint-6", "checkpoint-8"]
    ck = tmp_path / "full" / "checkpoint-8"
    names = set(os.listdir(ck))
    assert {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json", "training_args.bin"} <= names
    assert json.loads((ck / "trainer_state.json").read_text())["global_step"] == 8
    # the same bytes as the resumed run's step-8 checkpoint (bitwise state)
    a = torch.load(ck / "optimizer.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "checkpoint-8" / "optimizer.pt", weights_only=True)
    _bitwise(a, b)
    from safetensors.torch import load_file

    _bitwise(load_file(ck / "model.safetensors"), load_file(tmp_path / "cut" / "checkpoint-8" / "model.safetensors"))
    # pooled: 4 saves (checkpoint-2 .. checkpoint-8) reuse their buffers; a save that starts while
    # the previous one is still being written needs a second set, and the pool may trim and
    # regrow once, so fewer allocations than saves is what must hold
    assert full["allocations"] < 4, full["allocations"]


@pytest.mark.slow
def test_hf_ddp_two_ranks_saves_asynchronously_and_resumes_bitwise(tmp_path):
    """2 gloo ranks under torchrun: the callback saves in the background (it used to fall back
    to HF's synchronous save for any multi-process run), each rank's RNG file is in the
    checkpoint, and a resumed run logs the uninterrupted run's losses bit for bit."""
    full = _hf(tmp_path / "full", 8, False, tmp_path / "full.json", nproc=2)
    _hf(tmp_path / "cut", 8, False, tmp_path / "cut.json", 2, 5, nproc=2)
    rank1 = json.loads(Path(f"{tmp_path / 'full.json'}.1").read_text())
    assert [s["step"] for s in full["stats"]] == [2, 4, 6, 8]  # the writer rank's background saves
    assert all(s["nbytes"] > 0 for s in full["stats"])
    assert [s["step"] for s in rank1["stats"]] == [2, 4, 6, 8] and all(s["nbytes"] == 0 for s in rank1["stats"])
    assert sorted(os.listdir(tmp_path / "cut")) == ["checkpoint-2", "checkpoint-4"]
    resumed = _hf(tmp_path / "cut", 8, True, tmp_path / "resumed.json", nproc=2)
    assert set(resumed["losses"]) == {"5", "6", "7", "8"}
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], step
    assert sorted(os.listdir(tmp_path / "full")) == ["checkpoint-6", "checkpoint-8"]
    assert sorted(os.listdir(tmp_path / "cut")) == ["checkpoint-6", "checkpoint-8"]
    names = _hf_checkpoints_equal(tmp_path / "full" / "checkpoint-8", tmp_path / "cut" / "checkpoint-8")
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"} <= set(names)


@pytest.mark.slow
def test_hf_peft_lora_model_saves_asynchronously_and_resumes_bitwise(tmp_path):
    """A LoRA (peft) model: written in the background as PEFT's adapter files, resumed bit for bit."""
    pytest.importorskip("peft")
    full = _hf(tmp_path / "full", 8, False, tmp_path / "full.json", 2, 0, 1)
    _hf(tmp_path / "cut", 8, False, tmp_path / "cut.json", 2, 5, 1)
    assert [s["step"] for s in full["stats"]] == [2, 4, 6, 8]  # saved by the callback, not HF's fallback
    resumed = _hf(tmp_path / "cut", 8, True, tmp_path / "resumed.json", 2, 0, 1)
    assert set(resumed["losses"]) == {"5", "6", "7", "8"}
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], step
    ck = tmp_path / "full" / "checkpoint-8"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(ck))
    assert "model.safetensors" not in os.listdir(ck)
    names = _hf_checkpoints_equal(ck, tmp_path / "cut" / "checkpoint-8")
    assert "adapter_model.safetensors" in names


# ---- Accelerate --------------------------------------------------------------------------------

def _worker(*args):
    r = subprocess.run([sys.executable, WORKER, *map(str, args)], env=_env(USE_TORCH_XLA="0", OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


def test_accelerate_save_state_is_asynchronous_and_loads_bitwise(tmp_path):
    """``attach(accelerator)``: ``save_state()`` stages and returns, the background write
    produces accelerate's own files (the same names and the same bytes of state as accelerate's
    synchronous save of that moment), ``total_limit`` holds, and a plain Accelerator's
    ``load_state`` restores model, optimizer, scheduler, registered object and RNG bitwise."""
    pytest.importorskip("accelerate")
    out = _worker("accelerate-save", tmp_path)
    assert "ATTACHED TWICE: AcceleratorAlreadyAttachedError" in out and "REATTACHED AFTER CLOSE" in out
    ckpts = tmp_path / "proj" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["checkpoint_1", "checkpoint_2"]  # total_limit=2
    assert not [n for n in os.listdir(tmp_path / "proj") if n.startswith(".")]  # nothing in flight left
    stats = json.loads((tmp_path / "stats.json").read_text())  # SaveStats, as the core manager's
    assert [Path(s["extra"]["path"]).name for s in stats] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert [s["step"] for s in stats] == [0, 1, 2]
    assert all(s["nbytes"] > 0 and s["blocking_s"] > 0 and s["durable_s"] >= s["blocking_s"] for s in stats)
    assert all(s["files"] >= 5 and s["written_bytes"] > s["nbytes"] / 2 and s["commit_time"] for s in stats)
    ours, own = ckpts / "checkpoint_2", tmp_path / "own7"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(own))
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "custom_checkpoint_0.pkl"} <= set(os.listdir(ours))
    from safetensors.torch import load_file

    _bitwise(load_file(ours / "model.safetensors"), load_file(own / "model.safetensors"))
    for name in ("optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"):
        a, b = torch.load(ours / name, weights_only=False), torch.load(own / name, weights_only=False)
        _bitwise(a, b)
        assert repr(a) == repr(b), name  # the non-tensor parts too (RNG tuples, step, scheduler fields)
    _worker("accelerate-load", ours, tmp_path / "loaded.pt")
    ref, loaded = torch.load(tmp_path / "ref7.pt", weights_only=False), torch.load(tmp_path / "loaded.pt",
                                                                                      weights_only=False)
    _bitwise(loaded, ref)
    assert loaded["scheduler"] == ref["scheduler"] and loaded["step"] == ref["step"]
    assert loaded["python_rng"] == ref["python_rng"]



def test_docs_install_extras_exist_for_every_integration():
    """docs/integrations.md installs each framework through an extra that pyproject.toml
    defines and that pulls that framework in (lightning, transformers + peft, accelerate, torchtitan)."""
    import re

    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (ROOT / "docs" / "integrations.md").read_text()
    named = set(re.findall(r'pip install -e "\.\[([a-z_-]+)\]"', text))
    assert named == {"lightning", "transformers", "accelerate", "torchtitan"}, named
    assert not re.findall(r"async_ckpt\[", text)  # the package is installed from a checkout
    for name in named:
        assert name in extras, f"docs install the extra {name!r}, which pyproject.toml does not define"
    need = {"lightning": {"lightning"}, "transformers": {"transformers", "accelerate", "peft"},
            "accelerate": {"accelerate"}, "torchtitan": {"torchtitan"}}
    for name, pkgs in need.items():
        have = {re.split(r"[<>=\[ ]", req, maxsplit=1)[0] for req in extras[name]}
        assert pkgs <= have, (name, have)
    assert "peft" in {re.split(r"[<>=\[ ]", req, maxsplit=1)[0] for req in extras["dev"]}
