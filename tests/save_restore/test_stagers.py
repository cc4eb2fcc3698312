"""The stager protocol: eager and lazy stagers over one pool, layering, per-stager state."""

from __future__ import annotations

import ast
import os

import torch

from async_ckpt import CheckpointManager
from async_ckpt.staging import EagerStager, LazyStager, SnapshotStager, Stager
from async_ckpt.testing import hold_copies, lazy_cpu_copies

from ..conftest import assert_bitwise_equal, clone_tree
from ..support.paths import REPO

STAGING = os.path.join(REPO, "async_ckpt", "staging")


def _staging_modules():
    for name in sorted(os.listdir(STAGING)):
        if name.endswith(".py"):
            with open(os.path.join(STAGING, name)) as f:
                yield name[:-3], f.read()


def _relative_imports(src: str):
    """``(level, module)`` of every relative import in ``src`` (also those inside functions)."""
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.module:
                yield node.level, node.module
            else:  # ``from .. import compat``
                for alias in node.names:
                    yield node.level, alias.name


def test_eager_and_lazy_stagers_implement_the_protocol_over_one_pool():
    st = Stager()
    assert isinstance(st.eager, EagerStager) and isinstance(st.lazy, LazyStager)
    assert isinstance(st.eager, SnapshotStager) and isinstance(st.lazy, SnapshotStager)
    assert st.lazy.pool is st.eager.pool is st.pool
    sd = {"w": torch.randn(100_000), "b": torch.randn(10), "i": torch.arange(5)}
    ref = clone_tree(sd)
    eager = st.eager.stage(sd)  # plans itself when not given a plan
    assert eager.pending is None and not eager.xla_shards
    assert_bitwise_equal(eager.state_dict, ref)
    eager.release()
    with hold_copies(release_after=0.05):
        snap = st.lazy.stage(sd, st.plan(sd))
        assert snap.pending is not None and snap.nbytes == sum(t.nbytes for t in sd.values())
        st.lazy.synchronize_staging()  # waits for the held copies (the guard copies them itself)
        assert snap.pending.done
    assert_bitwise_equal(snap.state_dict, ref)
    snap.release()
    assert st.pool.leased_bytes == 0
    st.eager.synchronize_staging()  # nothing outstanding: returns


def test_staging_imports_only_downward_and_has_no_cycle():
    """Staging knows tensors and devices: nothing above it (manager, distributed, lifecycle,
    cli), and no two staging modules import each other (directly or around a cycle)."""
    graph = {}
    for mod, src in _staging_modules():
        deps = set()
        for level, name in _relative_imports(src):
            top = name.split(".")[0]
            if level >= 2:
                assert top in {"compat", "errors", "policies", "addresses", "shared_memory", "gc_pause", "storage",
                               "format"}, (mod, name)
            elif top:
                deps.add(top)
        graph[mod] = deps
    state = {}

    def visit(m, path):
        assert state.get(m) != "open", f"import cycle: {' -> '.join(path + [m])}"
        if state.get(m) == "done":
            return
        state[m] = "open"
        for d in graph.get(m, ()):
            visit(d, path + [m])
        state[m] = "done"

    for m in graph:
        visit(m, [])


def test_private_torch_names_go_through_compat():
    for mod, src in _staging_modules():
        for name in ("torch._C", "_XLAC", "torch._foreach", "._helpers", "_host_emptyCache"):
            assert name not in src, (mod, name)


def _storage_keys(*trees):
    keys = set()
    for tree in trees:
        stack = [tree]
        while stack:
            v = stack.pop()
            if isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
            elif isinstance(v, torch.Tensor):
                keys.add((v.is_cuda, v.untyped_storage().data_ptr()))
    return keys


def test_two_managers_alternate_lazy_saves_and_keep_their_own_state(tmp_path):
    """Two managers' lazy saves are outstanding at once while both models train: each save
    restores bitwise to what was saved, and what each lazy stager learns from the guard (the
    order it needed the storages in) holds only that stager's own storages."""
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 256))
            for _ in range(2)]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9) for n in nets]
    mgrs = [CheckpointManager(str(tmp_path / name), max_to_keep=0) for name in ("a", "b")]

    def train(k):
        nets[k](torch.randn(16, 256)).square().mean().backward()
        opts[k].step()
        opts[k].zero_grad()

    for k in (0, 1):
        train(k)  # optimizer state exists from here on
    saved = {}
    try:
        for step in range(1, 7):
            order = (0, 1) if step % 2 else (1, 0)  # alternate which manager saves first
            with lazy_cpu_copies(), hold_copies(release_after=0.05):
                for k in order:
                    sd = {"model": nets[k].state_dict(), "optim": opts[k].state_dict()}
                    saved[k, step] = clone_tree(sd)
                    mgrs[k].save_async(step, sd, lazy=True)
                for k in order:  # both saves are in flight: train both models
                    train(k)
            for k in order:
                mgrs[k].wait_for_staging()
        for k in (0, 1):
            mgrs[k].join()
            for step in range(1, 7):
                target = clone_tree(saved[k, step])
                for v in target["model"].values():
                    v.zero_()
                mgrs[k].restore(step, target)
                assert_bitwise_equal(target["model"], saved[k, step]["model"])
        own = [_storage_keys(nets[k].state_dict(), opts[k].state_dict()) for k in (0, 1)]
        assert not own[0] & own[1]
        for k in (0, 1):
            learned = set(mgrs[k].stager.lazy.order.rank)
            assert learned, "the guard waited for this manager's storages and noted them"
            assert learned <= own[k], "one manager's order holds another's storages"
    finally:
        for m in mgrs:
            m.close()


def test_a_lazy_save_copies_cpu_tensors_at_the_call_and_device_tensors_later(ckpt_dir, xla_device):
    """``lazy=True`` chooses per device: CPU tensors are copied before ``save_async`` returns
    (as an eager save copies them: a background copy would take the training loop's own cores),
    so the loop may change them at once, outside any optimizer step, and the step restores the
    values at the call; XLA tensors of the same save are still copied in the background
    (``lazy_cpu_copies`` stages CPU tensors lazily too, for the tests of the lazy machinery)."""
    g = torch.Generator().manual_seed(0)
    big, small = torch.randn(2_000_000, generator=g), torch.arange(10.0)  # 8 MB: a background copy if lazy
    dev = torch.randn(1_000_000, generator=g).to(xla_device)
    sd = {"big": big, "small": small, "dev": dev}
    ref = {"big": big.clone(), "small": small.clone(), "dev": dev.cpu()}
    with CheckpointManager(ckpt_dir, lazy=True) as mgr:
        with hold_copies():
            assert mgr.save_async(1, sd)
            pending = mgr.stager.lazy.pending[-1]
            assert not pending.done  # the XLA tensor's copy waits behind the hold
            with torch.no_grad():
                big.add_(1.0)  # no guard sees these: fine, their copies were made at the call
                small.mul_(3.0)
        mgr.join()
        target = {"big": torch.zeros_like(big), "small": torch.zeros_like(small), "dev": torch.zeros(1_000_000)}
        assert mgr.restore(1, target) == 1
        assert_bitwise_equal(target, ref)
        with lazy_cpu_copies(), hold_copies():  # the testing seam: CPU tensors lazily, a change tears the save
            assert mgr.save_async(2, {"big": big, "small": small})
            assert not mgr.stager.lazy.pending[-1].done
        mgr.join()
