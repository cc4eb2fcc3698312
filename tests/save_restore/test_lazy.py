"""Lazy snapshots: the checkpoint equals, bitwise, the state at the save_async call.

The copies of a lazy save run in the background; the guard (optimizer pre-step hook, module
forward pre-hook) waits for them before the tensors change, and a mutation nothing sees makes
the save fail with TornSnapshotError rather than commit a torn checkpoint. ``hold_copies``
keeps the copies in flight so the mutations really race them. A lazy save copies CPU tensors
at the call (as an eager save does); ``lazy_cpu_copies`` makes it stage them lazily here, so
that these tests exercise the lazy machinery on a machine without an accelerator.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_ckpt import CheckpointManager
from async_ckpt.errors import CheckpointError, TornSnapshotError
from async_ckpt.staging import Stager
from async_ckpt.staging import lazy as lazy_mod
from async_ckpt.testing import hold_copies, lazy_cpu_copies

from ..conftest import assert_bitwise_equal, clone_tree


@pytest.fixture(autouse=True, scope="module")
def _cpu_tensors_staged_lazily():
    with lazy_cpu_copies():
        yield


class Net:
    """Two modules (one with BatchNorm), two optimizers, a big extra buffer."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.enc = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 300)  # 300*64*4 = 75 KiB: a "big" unit (own buffer)
        self.opt_a = torch.optim.SGD(self.enc.parameters(), lr=0.1, momentum=0.9)
        self.opt_b = torch.optim.Adam(self.head.parameters(), lr=0.01)
        self.extra = torch.randn(40000)  # not touched by any optimizer
        self.train("ab")

    def train(self, which: str) -> None:
        loss = self.head(self.enc(torch.randn(16, 32))).square().mean()
        loss.backward()
        if "a" in which:
            self.opt_a.step()
        if "b" in which:
            self.opt_b.step()
        self.opt_a.zero_grad()
        self.opt_b.zero_grad()

    def state_dict(self, step: int):
        return {"enc": self.enc.state_dict(), "head": self.head.state_dict(), "opt_a": self.opt_a.state_dict(),
                "opt_b": self.opt_b.state_dict(), "extra": self.extra, "step": step}


def _restore_and_check(mgr, net, step, ref):
    target = clone_tree(net.state_dict(step))
    mgr.restore(step, target)
    assert_bitwise_equal(target, ref, f"step{step}")


# ---- random schedules ----------------------------------------------------------------------
ACTIONS = st.sampled_from(["train_a", "train_b", "train_ab", "forward", "manual_after_wait", "unseen"])
STEP = st.tuples(
    st.booleans(),  # lazy
    st.sampled_from([None, 0.0, 0.002, 0.01]),  # hold the copies for this long after the call
    st.lists(ACTIONS, min_size=0, max_size=3),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_pending=st.integers(1, 3), chunk_kib=st.sampled_from([4, 64, 8192]),
       schedule=st.lists(STEP, min_size=2, max_size=5))
def test_random_schedules_never_write_a_wrong_checkpoint(max_pending, chunk_kib, schedule):
    old_chunk = lazy_mod.CHUNK_BYTES
    lazy_mod.CHUNK_BYTES = chunk_kib * 1024  # small chunks: many per-chunk waits
    try:
        _run_schedule(max_pending, schedule)
    finally:
        lazy_mod.CHUNK_BYTES = old_chunk


def _run_schedule(max_pending, schedule):
    net = Net()
    refs = {}
    may_tear = set()
    with tempfile.TemporaryDirectory() as d:
        mgr = CheckpointManager(d, max_pending_async=max_pending)
        failed_at_call = []
        outstanding = set()  # lazy saves whose copies nothing has waited for yet
        for step, (lazy, hold, actions) in enumerate(schedule):
            sd = net.state_dict(step)
            ref = clone_tree(sd)
            holder = hold_copies(release_after=hold) if hold is not None else None
            try:
                if holder is not None:
                    holder.__enter__()
                mgr.save_async(step, sd, lazy=lazy)
                refs[step] = ref
                outstanding = {step} if lazy else set()  # save_async waited for the earlier ones
            except TornSnapshotError as exc:  # an earlier save failed; this one was not taken
                assert exc.step in may_tear
                failed_at_call.append(step)
            for act in actions:
                if act.startswith("train_"):
                    net.train(act[len("train_"):])
                elif act == "forward":
                    with torch.no_grad():
                        net.enc(torch.randn(8, 32))  # train mode: BatchNorm updates its statistics
                elif act == "manual_after_wait":
                    mgr.wait_for_staging()
                    outstanding = set()
                    with torch.no_grad():
                        net.head.bias.add_(1.0)
                        net.extra.mul_(0.5)
                else:  # a write the guard cannot see (no optimizer, no module forward)
                    with torch.no_grad():
                        net.extra.add_(1.0)
                    may_tear |= outstanding  # any lazy save still in flight may be torn
            if holder is not None:
                holder.__exit__(None, None, None)
        try:
            mgr.close()
        except TornSnapshotError as exc:
            assert exc.step in may_tear
        mgr2 = CheckpointManager(d)
        committed = set(mgr2.all_steps())
        for step, ref in refs.items():
            if step in committed:
                _restore_and_check(mgr2, net, step, ref)
            else:
                assert step in may_tear, f"step {step} was not committed but nothing could tear it"
        mgr2.close()


# ---- deterministic cases -------------------------------------------------------------------
def test_unseen_mutation_before_copy_fails_the_save(ckpt_dir):
    net = Net()
    with CheckpointManager(ckpt_dir, lazy=True) as mgr:
        with hold_copies():
            mgr.save_async(1, net.state_dict(1))
            with torch.no_grad():
                net.extra.add_(1.0)  # the copy has not run yet
        with pytest.raises(TornSnapshotError, match="extra") as info:
            mgr.join()
        assert info.value.step == 1
        assert mgr.all_steps() == []
        ref = clone_tree(net.state_dict(2))  # the manager still works afterwards
        mgr.save_async(2, net.state_dict(2))
        mgr.join()
        assert mgr.all_steps() == [2]
        _restore_and_check(mgr, net, 2, ref)


def test_optimizer_step_waits_for_its_tensors(ckpt_dir):
    net = Net()
    sd = net.state_dict(1)
    ref = clone_tree(sd)
    with CheckpointManager(ckpt_dir, lazy=True) as mgr:
        with hold_copies(release_after=0.05):
            mgr.save_async(1, sd)
            for _ in range(3):
                net.train("ab")  # each step waits for the copies of the tensors it changes
                with torch.no_grad():
                    net.enc(torch.randn(4, 32))
        mgr.join()
        _restore_and_check(mgr, net, 1, ref)


def test_guard_waits_only_for_the_stepping_optimizers_tensors(ckpt_dir):
    net = Net()
    other = torch.nn.Linear(8, 8)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with CheckpointManager(ckpt_dir, lazy=True) as mgr:
        holder = hold_copies(release_after=60.0)
        with holder:
            mgr.save_async(1, {"head": net.head.state_dict()})
            pending = mgr.stager.lazy.pending[-1]
            other(torch.randn(2, 8)).sum().backward()
            other_opt.step()  # not in the checkpoint: must not wait for the held copies
            assert not pending.done
            holder.release()
        mgr.join()


def test_batchnorm_forward_is_guarded(ckpt_dir):
    """BatchNorm updates its running statistics without bumping ``_version``: only the forward
    pre-hook keeps them exact."""
    bn = torch.nn.BatchNorm1d(20000)  # 78 KiB statistics: copied lazily (small ones are not)
    sd = bn.state_dict()
    ref = clone_tree(sd)
    with CheckpointManager(ckpt_dir, lazy=True) as mgr:
        with hold_copies(release_after=0.02):
            mgr.save_async(1, sd)
            bn(torch.randn(8, 20000))
        mgr.join()
        target = clone_tree(bn.state_dict())
        mgr.restore(1, target)
        assert_bitwise_equal(target, ref)
    assert not torch.equal(bn.running_mean, ref["running_mean"])  # the forward did change them


def test_small_tensors_are_copied_before_a_lazy_save_returns(ckpt_dir):
    """Tensors up to 64 KiB are copied at the call (cheaper than guarding them): a mutation
    nothing sees right after ``save_async`` neither tears the save nor reaches the checkpoint,
    while a big tensor's copy is still held back."""
    small, big = torch.randn(1000), torch.randn(100000)
    sd = {"small": small, "big": big}
    ref = clone_tree(sd)
    with CheckpointManager(ckpt_dir, lazy=True) as mgr:
        with hold_copies(release_after=0.05):
            mgr.save_async(1, sd)
            pending = mgr.stager.lazy.pending[-1]
            assert not pending.done, "the big tensor's copy is still held"
            with torch.no_grad():
                small.add_(1.0)  # unseen by the guard: fine, its copy was already made
        mgr.join()
        target = clone_tree(sd)
        mgr.restore(1, target)
        assert_bitwise_equal(target, ref)


def test_manual_wait_then_mutate(ckpt_dir):
    t = torch.arange(300000, dtype=torch.float32)
    ref = t.clone()
    with CheckpointManager(ckpt_dir, lazy=True) as mgr:
        with hold_copies(release_after=0.01):
            mgr.save_async(1, {"t": t})
            mgr.wait_for_staging()
            t.zero_()
        mgr.join()
        target = {"t": torch.empty_like(t)}
        mgr.restore(1, target)
        assert torch.equal(target["t"], ref)


def test_next_save_waits_for_previous_copies_and_max_pending(ckpt_dir):
    net = Net()
    refs = {}
    with CheckpointManager(ckpt_dir, lazy=True, max_pending_async=3) as mgr:
        for s in range(6):
            sd = net.state_dict(s)
            refs[s] = clone_tree(sd)
            with hold_copies(release_after=0.003):
                mgr.save_async(s, sd)
            net.train("ab")
        mgr.join()
        assert mgr.all_steps() == list(range(6))
        for s, ref in refs.items():
            _restore_and_check(mgr, net, s, ref)


def test_tied_and_view_tensors_lazy(ckpt_dir):
    base = torch.randn(50000)
    sd = {"a": base, "view": base[10:20000], "tied": base, "small": torch.randn(7), "empty": torch.empty(0)}
    ref = clone_tree(sd)
    with CheckpointManager(ckpt_dir, lazy=True) as mgr:
        with hold_copies(release_after=0.01):
            mgr.save_async(1, sd)
            mgr.wait_for_staging()
            base.add_(1)
        mgr.join()
        target = clone_tree(ref)
        for v in target.values():
            v.zero_() if v.numel() else None
        mgr.restore(1, target)
        assert_bitwise_equal(target, ref)


def test_stager_lazy_snapshot_and_eager_unchanged():
    stager = Stager()
    sd = {"w": torch.randn(100000), "b": torch.randn(10), "i": torch.arange(5)}
    ref = clone_tree(sd)
    eager = stager.stage(sd)
    assert eager.pending is None
    eager.release()
    with hold_copies(release_after=0.01):
        snap = stager.stage(sd, lazy=True)
        assert snap.pending is not None and snap.nbytes == sum(t.nbytes for t in sd.values())
    snap.wait_copied()
    assert_bitwise_equal(snap.state_dict, ref)
    snap.release()
    assert stager.pool.leased_bytes == 0


def test_save_with_lazy_manager_blocks_and_lazy_type_checked(ckpt_dir):
    with pytest.raises(TypeError, match="lazy"):
        CheckpointManager(ckpt_dir, lazy="yes")  # type: ignore[arg-type]
    t = torch.randn(1000)
    with CheckpointManager(ckpt_dir, lazy=True) as mgr:
        mgr.save(1, {"t": t})  # blocking save: committed on return
        assert mgr.all_steps() == [1]
        assert not mgr.stager.lazy.pending


def test_torn_error_is_a_checkpoint_error():
    assert issubclass(TornSnapshotError, CheckpointError)


def test_xla_lazy_snapshot_survives_steps_with_donation(ckpt_dir, xla_device):
    """PJRT CPU: the snapshot holds the (immutable) device buffers; optimizer steps, with
    torch_xla's default input/output aliasing and with explicit buffer donation, never change
    what the checkpoint holds."""
    import torch_xla

    X = torch_xla._XLAC
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)).to(xla_device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(donate: bool) -> None:
        model(torch.ones(4, 64, device=xla_device)).sum().backward()
        opt.step()
        opt.zero_grad()
        if donate:
            for p in model.parameters():
                X._set_buffer_donation(p, True)
        torch_xla.sync()

    old = X._xla_get_enable_alias_with_buffer_donor_config()
    try:
        step(False)
        with CheckpointManager(ckpt_dir, lazy=True) as mgr:
            for s, donate in enumerate([False, True, True]):
                X._xla_set_enable_alias_with_buffer_donor_config(donate)
                sd = {"model": model.state_dict(), "optim": opt.state_dict()}
                torch_xla.sync()
                ref = _cpu_tree(sd)
                with hold_copies(release_after=0.01):
                    mgr.save_async(s, sd)
                    step(donate)
                    step(donate)
                mgr.join()
                target = clone_tree(ref)
                for t in target["model"].values():
                    t.zero_()
                mgr.restore(s, target)
                assert_bitwise_equal(target, ref)
                assert not torch.equal(model[0].weight.cpu(), ref["model"]["0.weight"])
    finally:
        X._xla_set_enable_alias_with_buffer_donor_config(old)


def _cpu_tree(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _cpu_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_cpu_tree(v) for v in x]
    return x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_lazy_snapshot_exact(ckpt_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024),
                                torch.nn.Linear(1024, 1024)).cuda()
    opt = torch.optim.Adam(model.parameters())

    def train() -> None:
        model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()

    train()
    refs = {}
    with CheckpointManager(ckpt_dir, lazy=True, max_pending_async=2) as mgr:
        for s in range(4):
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            refs[s] = _cpu_tree(clone_tree(sd))
            mgr.save_async(s, sd)
            train()
            train()
        mgr.join()
        for s, ref in refs.items():
            target = _cpu_tree(clone_tree({"model": model.state_dict(), "optim": opt.state_dict()}))
            mgr.restore(s, target)
            assert_bitwise_equal(target, ref)


def test_guard_copies_what_it_needs_itself_when_the_copier_is_busy(ckpt_dir):
    """Work stealing: with the background copier stuck, optimizer steps and forwards copy the
    chunks they need on the training thread, so training proceeds and the checkpoint is exact."""
    net = Net()
    sd = net.state_dict(1)
    ref = clone_tree(sd)
    with CheckpointManager(ckpt_dir, lazy=True) as mgr:
        with hold_copies(release_after=300.0) as holder:
            mgr.save_async(1, sd)
            for _ in range(2):
                net.train("ab")
                with torch.no_grad():
                    net.enc(torch.randn(4, 32))
            pending = mgr.stager.lazy.pending[-1]
            stolen = [c for c in pending.chunks if c.done.is_set()]
            assert stolen, "the guard should have copied the chunks it needed"
            holder.release()
        mgr.join()
        _restore_and_check(mgr, net, 1, ref)
