"""Scenarios for tests/xla/test_spmd.py, each run alone by ``tests/workers/spmd_worker.py <scenario> <root>``
under ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4`` (torch_xla's SPMD mode on 4 virtual devices).

``manager_*``, ``sgd``, ``adamw``: torch_xla 2.9's ``CheckpointManagerTest`` and
``OptimizerCheckpointTest`` (pytorch/xla ``test/spmd/test_xla_distributed_checkpoint.py``) with
``async_ckpt.CheckpointManager`` in place of torch_xla's: the same models, shardings, calls and
assertions, written here afresh. Two changes of setting, not of substance: the 1-rank gloo group
rendezvous through a file (a fixed TCP port would collide with concurrent runs), and
``manager_async`` holds the background write by patching ``mgr.layout.begin`` instead of
torch_xla's private ``_save`` (which here is the training thread's part of a save: patched to
block, it blocks the caller; see docs/migration.md).

``unsynced_save``: the abort of issue 34 (a model moved with ``.to('xla')`` and saved before
any ``torch_xla.sync()``; and XLA targets restored by async_ckpt, saved again). ``states``: every state issue 34 lists, staged eagerly and lazily and
saved, each compared bit for bit. ``optim_interop``: optimizer state between async_ckpt,
``dcp.load`` with torch_xla's ``SPMDLoadPlanner`` and torch_xla's own manager.
``two_processes``: under torchrun with ``CPU_NUM_DEVICES=2``.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, Dict

import numpy as np
import torch
import torch.distributed as dist
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

xr.use_spmd()  # before any XLA tensor exists

from async_ckpt import CheckpointManager  # noqa: E402  (the one line torch_xla's test changes)
from tests.support.tree import assert_bitwise_equal  # noqa: E402

# ---- torch_xla's test fixtures, as there ------------------------------------------------------

class SimpleLinear(torch.nn.Module):
    """torch_xla's ``XlaShardingTest.SimpleLinear``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(128, 64)
        self.relu = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


def n_devices() -> int:
    return xr.global_runtime_device_count()


def sharded_model(mesh_shape: Any = None) -> SimpleLinear:
    """fc1.weight sharded over the mesh, fc2.weight explicitly replicated; never synced."""
    n = n_devices()
    model = SimpleLinear().to("xla")
    mesh = xs.Mesh(np.arange(n), mesh_shape or (1, n))
    xs.mark_sharding(model.fc1.weight, mesh, (0, 1))
    xs.mark_sharding(model.fc2.weight, mesh, (None, None))
    return model


def process_group(root: str) -> None:
    """torch_xla's setUp: a 1-rank gloo group (and, for CheckpointManagerTest, the coordinator)."""
    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{os.path.abspath(root)}.pg", world_size=1, rank=0)


def same_state_dict(sd1: Any, sd2: Any, keypath: str = "") -> None:
    """torch_xla's ``_assert_same_state_dict``: types, devices, XLA sharding specs, values."""
    assert type(sd1) is type(sd2), f"Different types in state_dict at {keypath}: {sd1} vs {sd2}"
    if isinstance(sd1, torch.Tensor):
        assert sd1.device == sd2.device, f"Tensors on different devices at {keypath}: {sd1} vs {sd2}"
        if sd1.device == torch_xla.device():
            s1 = torch_xla._XLAC._get_xla_sharding_spec(sd1)
            s2 = torch_xla._XLAC._get_xla_sharding_spec(sd2)
            assert s1 == s2, f"Different sharding on tensors at {keypath}: {s1} vs {s2}"
        assert torch.equal(sd1, sd2), f"Different tensors at {keypath}:\n{sd1} vs {sd2}"
    elif isinstance(sd1, dict):
        assert sd1.keys() == sd2.keys(), f"Different keys at {keypath}: {sd1} vs {sd2}"
        for key in sd1:
            same_state_dict(sd1[key], sd2[key], f"{keypath}.{key}")
    elif isinstance(sd1, (list, tuple)):
        for i, (a, b) in enumerate(zip(sd1, sd2)):
            same_state_dict(a, b, f"{keypath}[{i}]")
    else:
        assert sd1 == sd2, f"Different value at {keypath}: {sd1} vs {sd2}"


def host_tree(x: Any) -> Any:
    """``x`` with every tensor copied to the host (for bitwise comparisons), and torch_xla's
    ``_CpuShards`` (a snapshot's staged shards) put together into the global tensor."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if hasattr(x, "shards") and hasattr(x, "global_shape"):
        full = torch.zeros(tuple(x.global_shape), dtype=x.shards[0].data.dtype)
        for s in x.shards:
            full[tuple(s.indices)] = s.unpadded_data
        return full
    if isinstance(x, dict):
        return {k: host_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [host_tree(v) for v in x]
    if isinstance(x, tuple):
        return tuple(host_tree(v) for v in x)
    return x


# ---- CheckpointManagerTest ------------------------------------------------------------------

def manager_checkpointing(root: str) -> None:
    mgr = CheckpointManager(root, save_interval=10, chkpt_on_preemption=False)
    state_dict = sharded_model().state_dict()
    assert mgr.save(0, state_dict)
    new_state_dict = sharded_model().state_dict()
    assert not any(torch.allclose(v, new_state_dict[k]) for k, v in state_dict.items())
    mgr.restore(0, new_state_dict)
    assert all(torch.allclose(v, new_state_dict[k]) for k, v in state_dict.items())
    assert_bitwise_equal(host_tree(new_state_dict), host_tree(state_dict))


def manager_step_tracking(root: str) -> None:
    mgr = CheckpointManager(root, save_interval=10, chkpt_on_preemption=False)
    state_dict = sharded_model().state_dict()
    assert mgr.all_steps() == []
    for step in range(1, 10):
        assert not mgr.save(step, state_dict)
        assert mgr.all_steps() == []
    saved = set()
    for step in range(0, 100, 10):
        assert mgr.save(step, state_dict)
        saved.add(step)
        assert set(mgr.all_steps()) == saved


def manager_max_to_keep(root: str) -> None:
    mgr = CheckpointManager(root, save_interval=10, max_to_keep=2, chkpt_on_preemption=False)
    state_dict = sharded_model().state_dict()
    assert mgr.all_steps() == []
    assert mgr.save(10, state_dict)
    assert set(mgr.all_steps()) == {10}
    assert mgr.save(20, state_dict)
    assert set(mgr.all_steps()) == {10, 20}
    assert mgr.save(30, state_dict)  # the oldest is erased
    assert set(mgr.all_steps()) == {30, 20}
    assert mgr.save(10, state_dict)  # the oldest by creation, not by step
    assert set(mgr.all_steps()) == {30, 10}
    mgr = CheckpointManager(root, save_interval=10, max_to_keep=2, chkpt_on_preemption=False)
    assert mgr.save(20, state_dict)  # the order persists across managers
    assert set(mgr.all_steps()) == {20, 10}


def manager_async(root: str) -> None:
    mgr = CheckpointManager(root, save_interval=10, chkpt_on_preemption=False)
    state_dict = sharded_model().state_dict()
    cond = threading.Condition()
    begin = mgr.layout.begin  # the writer thread's first step of a save (torch_xla's ``_save``)

    def held_begin(*args: Any, **kwargs: Any) -> Any:
        with cond:
            cond.wait()
        return begin(*args, **kwargs)

    from unittest import mock

    with mock.patch.object(mgr.layout, "begin", held_begin):
        mgr.save_async(10, state_dict)
    assert mgr.all_steps() == []
    with cond:
        cond.notify()
    mgr.join()
    assert set(mgr.all_steps()) == {10}


def manager_async_step_tracking(root: str) -> None:
    mgr = CheckpointManager(root, save_interval=10, chkpt_on_preemption=False)
    state_dict = sharded_model().state_dict()
    assert mgr.all_steps() == []
    for step in range(1, 10):
        assert not mgr.save_async(step, state_dict)
        assert mgr.all_steps() == []
    saved = set()
    for step in range(0, 100, 10):
        assert mgr.save_async(step, state_dict)
        saved.add(step)
    mgr.join()
    assert set(mgr.all_steps()) == saved
    new_state_dict = sharded_model().state_dict()
    assert not any(torch.allclose(v, new_state_dict[k]) for k, v in state_dict.items())
    mgr.restore(0, new_state_dict)
    assert all(torch.allclose(v, new_state_dict[k]) for k, v in state_dict.items())
    assert_bitwise_equal(host_tree(new_state_dict), host_tree(state_dict))


# ---- OptimizerCheckpointTest ----------------------------------------------------------------

def model_and_optimizer(optim_cls: Callable[..., torch.optim.Optimizer]) -> Any:
    model = sharded_model()
    return model, optim_cls(params=model.parameters())


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, sync: bool = True) -> None:
    torch.manual_seed(42)
    model(torch.ones(10, 128).to("xla")).square().sum().backward()
    optim.step()
    if sync:
        torch_xla.sync()


def optimizer_round_trip(root: str, optim_cls: Callable[..., torch.optim.Optimizer]) -> None:
    from torch_xla.experimental.distributed_checkpoint import prime_optimizer

    model, optim = model_and_optimizer(optim_cls)
    train_step(model, optim)
    mgr = CheckpointManager(root, 1)
    state_dict = {"model": model.state_dict(), "optim": optim.state_dict()}
    mgr.save(0, state_dict, force=True)
    new_model, new_optim = model_and_optimizer(optim_cls)
    prime_optimizer(new_optim)
    new_state_dict = {"model": new_model.state_dict(), "optim": new_optim.state_dict()}
    mgr.restore(0, new_state_dict)
    same_state_dict(state_dict, new_state_dict)
    new_model.load_state_dict(new_state_dict["model"])
    new_optim.load_state_dict(new_state_dict["optim"])
    same_state_dict(new_model.state_dict(), model.state_dict())
    same_state_dict(new_optim.state_dict(), optim.state_dict())


def sgd(root: str) -> None:
    optimizer_round_trip(root, torch.optim.SGD)


def adamw(root: str) -> None:
    optimizer_round_trip(root, torch.optim.AdamW)


# ---- issue 34 ---------------------------------------------------------------------------------

def unsynced_save(root: str) -> None:
    """A model moved with ``.to('xla')`` and saved before any sync: its tensors hold host data
    only (no PJRT buffer). It aborted the process in ``_to_dlpack``."""
    g = torch.Generator().manual_seed(3)
    cpu = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
    sd = {k: v.to("xla") for k, v in cpu.items()}
    with CheckpointManager(root) as mgr:
        mgr.save(0, sd)
        mgr.save_async(1, {k: v.to("xla") for k, v in cpu.items()})  # the same, asynchronously
    for step in (0, 1):
        target = {k: torch.zeros_like(v) for k, v in cpu.items()}
        CheckpointManager(root).restore(step, target)
        assert_bitwise_equal(target, cpu)
    # A restore into XLA targets leaves them holding host data too: saving right after resuming.
    resumed = {k: torch.zeros_like(v).to("xla") for k, v in cpu.items()}
    torch_xla.sync()
    with CheckpointManager(root) as mgr:
        mgr.restore(1, resumed)
        mgr.save(2, resumed)
    target = {k: torch.zeros_like(v) for k, v in cpu.items()}
    CheckpointManager(root).restore(2, target)
    assert_bitwise_equal(target, cpu)


def states(root: str) -> None:
    """Every state of issue 34, staged alone (eagerly and lazily: nothing else in the state dict
    makes the stage sync first), then all together, and saved and restored bit for bit."""
    from async_ckpt.staging import Stager

    n = n_devices()
    assert n == 4, n
    row = xs.Mesh(np.arange(n), (n, 1))
    grid = xs.Mesh(np.arange(n), (2, 2))
    g = torch.Generator().manual_seed(0)

    def sharded(t: torch.Tensor, mesh: Any, spec: Any) -> torch.Tensor:
        xs.mark_sharding(t, mesh, spec)
        return t

    def synced(t: torch.Tensor) -> torch.Tensor:
        torch_xla.sync()
        return t

    def copied_into(t: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        torch_xla.sync()
        t.copy_(src)  # what load_state_dict of a CPU state dict does: host data again
        return t

    # name -> (expected host value, how to make the XLA tensor in that state from it); the
    # expected values are computed on the CPU, never by reading the XLA tensors before a stage.
    x = torch.randn(8, 6, generator=g)
    pad = torch.randn(7, 5, generator=g)
    makers: Dict[str, Any] = {
        "unsynced": (x, lambda: x.to("xla")),
        "pending": (x * 2 + 1, lambda: synced(x.to("xla")) * 2 + 1),  # exact: the same bits fused or not
        "pending_unsynced_source": (x * 2 + 1, lambda: x.to("xla") * 2 + 1),
        "view_rows": (x[2:5], lambda: synced(x.to("xla"))[2:5]),
        "view_t": (x.t(), lambda: synced(x.to("xla")).t()),
        "row": (x, lambda: sharded(x.to("xla"), row, (0, None))),
        "col": (x, lambda: sharded(x.to("xla"), grid, (None, (0, 1)))),
        "grid": (x, lambda: sharded(x.to("xla"), grid, (0, 1))),
        "partial": (x, lambda: sharded(x.to("xla"), grid, (None, 1))),  # 2-way split, 2-way replicated
        "replicated": (x, lambda: sharded(x.to("xla"), grid, (None, None))),
        "padded": (pad, lambda: sharded(pad.to("xla"), row, (0, None))),  # 7 rows over 4 devices
        "sharded_synced": (x, lambda: synced(sharded(x.to("xla"), row, (0, None)))),
        "sharded_view": (x[1:7], lambda: synced(sharded(x.to("xla"), row, (0, None)))[1:7]),
        "sharded_pending": (x * 2, lambda: synced(sharded(x.to("xla"), grid, (0, 1))) * 2),
        "copied_into_sharded": (x, lambda: copied_into(sharded(torch.zeros(8, 6).to("xla"), row, (0, None)), x)),
        "copied_into_plain": (x, lambda: copied_into(torch.zeros(8, 6).to("xla"), x)),
    }

    def optimizer_stepped() -> Dict[str, Any]:
        """Right after ``optimizer.step()``, no sync: parameters and state are pending."""
        model = sharded_model()
        optim = torch.optim.AdamW(model.parameters())
        train_step(model, optim, sync=False)
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    st = Stager()
    for lazy in (False, True):
        for name, (want, make) in makers.items():
            snap = st.stage({name: make()}, lazy=lazy)
            snap.wait_copied()
            assert_bitwise_equal(host_tree(snap.state_dict[name]), want, f"lazy={lazy} {name}")
            snap.release()
        everything = {name: make() for name, (_, make) in makers.items()}
        snap = st.stage(everything, lazy=lazy)
        snap.wait_copied()
        for name, (want, _) in makers.items():
            assert_bitwise_equal(host_tree(snap.state_dict[name]), want, f"lazy={lazy} together {name}")
        snap.release()
        stepped = optimizer_stepped()
        snap = st.stage(stepped, lazy=lazy)
        snap.wait_copied()
        assert_bitwise_equal(host_tree(snap.state_dict), host_tree(stepped), f"lazy={lazy} after optimizer.step()")
        snap.release()

    # Saved and restored, bitwise.
    stepped = optimizer_stepped()
    with CheckpointManager(root) as mgr:
        mgr.save(0, {name: make() for name, (_, make) in makers.items()})
        mgr.save(1, stepped)
    want_stepped = host_tree(stepped)  # synced by now: what the save must have held
    target = {name: torch.zeros_like(want) for name, (want, _) in makers.items()}
    CheckpointManager(root).restore(0, target)
    assert_bitwise_equal(target, {name: want for name, (want, _) in makers.items()})
    model, optim = model_and_optimizer(torch.optim.AdamW)
    fresh = {"model": model.state_dict(), "optim": optim.state_dict()}  # a fresh optimizer
    CheckpointManager(root).restore(1, fresh)
    assert_bitwise_equal(host_tree(fresh), want_stepped)


def optim_interop(root: str) -> None:
    """Optimizer state (SGD, AdamW; a primed and a fresh optimizer) between async_ckpt,
    ``dcp.load`` with torch_xla's ``SPMDLoadPlanner`` and torch_xla's own manager."""
    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import CheckpointManager as XlaManager
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, prime_optimizer
    from torch_xla.experimental.distributed_checkpoint.manager import _MANAGER_METADATA_FILE, _CheckpointMetadata

    from async_ckpt.format.unpickling import load_metadata

    process_group(root)

    def metadata_keys(step_dir: str) -> set:
        with open(os.path.join(step_dir, ".metadata"), "rb") as f:
            return set(load_metadata(f.read()).state_dict_metadata)

    for name, cls in (("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)):
        model, optim = model_and_optimizer(cls)
        train_step(model, optim)
        saved = {"model": model.state_dict(), "optim": optim.state_dict()}
        want = host_tree(saved)

        def target(primed: bool, cls: Any = cls) -> Dict[str, Any]:
            m, o = model_and_optimizer(cls)
            if primed:
                prime_optimizer(o)
            return {"model": m.state_dict(), "optim": o.state_dict()}

        ours = f"{root}/{name}/ours"
        with CheckpointManager(ours) as mgr:
            mgr.save(0, saved)
        theirs = f"{root}/{name}/theirs"
        txla = XlaManager(theirs, 1, chkpt_on_preemption=False)
        txla.save(0, saved)
        # One format: the same keys (torch_xla's layout: non-tensor subtrees are single items).
        assert metadata_keys(f"{ours}/0") == metadata_keys(f"{theirs}/0"), name

        # async_ckpt's restore, into a primed and into a fresh optimizer.
        for primed in (True, False):
            t = target(primed)
            CheckpointManager(ours).restore(0, t)
            assert_bitwise_equal(host_tree(t), want, f"{name} restore primed={primed}")
            if primed:
                same_state_dict(saved, t)
        # Without XLA: plain CPU targets (a fresh optimizer), and the CLI's structure-free read.
        torch.manual_seed(0)
        cpu_model = SimpleLinear()
        cpu_optim = cls(params=cpu_model.parameters())
        t = {"model": cpu_model.state_dict(), "optim": cpu_optim.state_dict()}
        CheckpointManager(ours).restore(0, t)
        assert_bitwise_equal(t, want, f"{name} restore into CPU targets")
        from async_ckpt.cli.export import load_step

        _, exported = load_step(ours, 0)
        assert_bitwise_equal(exported["optim"]["param_groups"], want["optim"]["param_groups"], name)
        # dcp.load with torch_xla's SPMDLoadPlanner, straight from the step directory.
        t = target(True)
        dcp.load(t, checkpoint_id=f"{ours}/0", planner=SPMDLoadPlanner())
        assert_bitwise_equal(host_tree(t), want, f"{name} dcp.load SPMDLoadPlanner")
        # torch_xla's manager reads ours once it tracks the step (its own pickle, written here).
        import pickle
        from datetime import datetime

        with open(f"{ours}/0/{_MANAGER_METADATA_FILE}", "wb") as f:
            pickle.dump(_CheckpointMetadata(step=0, ts=datetime.now()), f)
        t = target(True)
        XlaManager(ours, 1, chkpt_on_preemption=False).restore(0, t)
        assert_bitwise_equal(host_tree(t), want, f"{name} torch_xla's manager reads ours")
        # torch_xla's checkpoint, imported as docs/migration.md says, then restored by async_ckpt.
        t = target(True)
        txla.restore(0, t)
        with CheckpointManager(f"{root}/{name}/imported") as mgr:
            mgr.save(0, t)
        t = target(False)
        CheckpointManager(f"{root}/{name}/imported").restore(0, t)
        assert_bitwise_equal(host_tree(t), want, f"{name} imported from torch_xla's manager")

    # A checkpoint saved from CPU tensors (DCP's current layout: every non-tensor value its own
    # item) restores into sharded XLA targets.
    torch.manual_seed(0)
    cpu_model = SimpleLinear()
    cpu_optim = torch.optim.AdamW(cpu_model.parameters())
    cpu_model(torch.ones(10, 128)).square().sum().backward()
    cpu_optim.step()
    cpu_saved = {"model": cpu_model.state_dict(), "optim": cpu_optim.state_dict()}
    with CheckpointManager(f"{root}/cpu") as mgr:
        mgr.save(0, cpu_saved)
    m, o = model_and_optimizer(torch.optim.AdamW)
    prime_optimizer(o)
    t = {"model": m.state_dict(), "optim": o.state_dict()}
    CheckpointManager(f"{root}/cpu").restore(0, t)
    assert_bitwise_equal(host_tree(t), host_tree(cpu_saved), "CPU checkpoint into sharded targets")


def two_processes(root: str) -> None:
    """Under torchrun, 2 processes of 2 virtual devices each (``CPU_NUM_DEVICES=2``). torch_xla
    2.9's PJRT CPU client cannot span processes (each sees only its own devices: one mesh per
    process), so each process holds the whole model, sharded over its own 2 devices; the ranks
    save one step together over a gloo group and restore it, sharded, bitwise."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert xr.process_count() == 1 and n_devices() == 2, (xr.process_count(), n_devices())
    torch.manual_seed(0)
    model, optim = model_and_optimizer(torch.optim.AdamW)
    train_step(model, optim)
    saved = {"model": model.state_dict(), "optim": optim.state_dict()}
    want = host_tree(saved)
    with CheckpointManager(root) as mgr:
        mgr.save(0, saved)
    m, o = model_and_optimizer(torch.optim.AdamW)
    t = {"model": m.state_dict(), "optim": o.state_dict()}
    with CheckpointManager(root) as mgr:
        assert mgr.restore(None, t) == 0
    assert_bitwise_equal(host_tree(t), want, f"rank {rank}")
    dist.barrier()


def deferred(root: str) -> None:
    """Issue 46: ``save_async`` takes references to the device data and transfers it later, on
    the copier thread. The copier is held while the state changes, twice, right after the call,
    through each path that gives the tensors new buffers or could donate the old ones
    (``optimizer.step()`` + ``torch_xla.sync()``, in-place ``add_`` + ``xm.mark_step()``, and
    both again after the buffers were marked for donation, which is transferred at the call);
    the step written holds the values at the call, bitwise. Run with and without
    ``XLA_ENABLE_PARAM_ALIASING`` (tests/xla/test_spmd.py)."""
    import time

    import torch_xla.core.xla_model as xm
    from torch.utils._pytree import tree_map_only

    from async_ckpt.testing import hold_copies

    model, optim = model_and_optimizer(torch.optim.AdamW)
    train_step(model, optim)

    def state() -> Dict[str, Any]:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    def xla_tensors() -> list:
        out = list(model.parameters())
        for st in optim.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.device.type == "xla"]
        return out

    def optimizer_sync() -> None:
        train_step(model, optim)

    def add_mark_step() -> None:
        with torch.no_grad():
            for t in xla_tensors():
                t.add_(1.0)
        xm.mark_step()

    def donated(mutate: Callable[[], None]) -> Callable[[], None]:
        def marked() -> None:
            mutate()
        marked.__name__ = f"donated_{mutate.__name__}"
        return marked

    def unheld(mutate: Callable[[], None]) -> Callable[[], None]:
        def concurrent() -> None:
            mutate()
        concurrent.__name__ = f"unheld_{mutate.__name__}"
        return concurrent

    # the last ones with the copier running: the transfers race the steps
    paths = [optimizer_sync, add_mark_step, donated(optimizer_sync), donated(add_mark_step),
             unheld(optimizer_sync), unheld(add_mark_step)]
    with CheckpointManager(root, max_to_keep=0) as mgr:
        for step, mutate in enumerate(paths):
            train_step(model, optim)  # fresh buffers, as a training loop saves them
            torch_xla._XLAC._xla_wait_device_ops([])
            if mutate.__name__.startswith("donated"):
                for t in xla_tensors():
                    torch_xla._XLAC._set_buffer_donation(t, True)
            with hold_copies() as hold:
                if mutate.__name__.startswith("unheld"):
                    hold.release()
                assert mgr.save_async(step, state())
                # the values at the call (read after it, before any change; CPU tensors such
                # as AdamW's step counters cloned: .cpu() would return the live tensor)
                want = tree_map_only(torch.Tensor, torch.clone, host_tree(state()))
                for _ in range(2):
                    mutate()
                    torch_xla._XLAC._xla_wait_device_ops([])
                changed = host_tree(state())
                assert not torch.equal(changed["model"]["fc1.weight"], want["model"]["fc1.weight"]), mutate.__name__
                if step == 0:  # the transfer is really deferred: nothing is written while the copier is held
                    time.sleep(2.0)
                    assert step not in mgr.all_steps(), "the save was written before its transfer was let run"
            mgr.join()
            fresh_model, fresh_optim = model_and_optimizer(torch.optim.AdamW)
            fresh = {"model": fresh_model.state_dict(), "optim": fresh_optim.state_dict()}
            CheckpointManager(root).restore(step, fresh)
            assert_bitwise_equal(host_tree(fresh), want, f"{mutate.__name__}: step {step}")
            print(f"deferred {mutate.__name__} ok", flush=True)


SCENARIOS: Dict[str, Callable[[str], None]] = {f.__name__: f for f in (
    manager_checkpointing, manager_step_tracking, manager_max_to_keep, manager_async, manager_async_step_tracking,
    sgd, adamw, unsynced_save, states, optim_interop, two_processes, deferred)}
#: the scenarios of torch_xla's CheckpointManagerTest: run with its process group and coordinator
MANAGER_TESTS = {"manager_checkpointing", "manager_step_tracking", "manager_max_to_keep", "manager_async",
                 "manager_async_step_tracking"}


def run(name: str, root: str) -> None:
    if name in MANAGER_TESTS or name in ("sgd", "adamw"):
        process_group(root)
        if name in MANAGER_TESTS:
            torch_xla._XLAC._ensure_xla_coordinator_initialized(global_rank=0, world_size=1,
                                                                master_addr="localhost")
    SCENARIOS[name](root)
    print(f"{name} OK", flush=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
