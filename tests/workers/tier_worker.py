"""Worker for tests/tiers/test_tiers_dist.py, launched with torchrun (gloo, CPU, FSDP2).

    torchrun --standalone --nproc-per-node 2 tests/workers/tier_worker.py <bucket> <local_dir> <ref_dir>

A sharded model saves steps 1..4 locally (every rank to its own ``<local_dir>/rank<r>``) and
every third step to the bucket. Then, with fresh managers each time:

1. every rank holds steps 2-4 locally: both restore step 4, from their local copies;
2. rank 1 loses its local step 4: both restore step 3 (the newest step every rank holds);
3. rank 1's local copy of step 3 is damaged: both skip the local copies (rank 0's too) and
   restore the bucket's copy of step 3;
4. rank 1 loses its whole local dir: both restore step 3 from the bucket.
5. a fresh bucket that rank 0 cannot reach at its first save (taking the lease fails): both
   ranks save that step locally and raise the bucket's error at join(); the next step due for
   the bucket commits there once it is reachable.
6. rank 1's local tier fails a write (its directory is replaced by a file): at the next save
   both ranks raise at once (rank 1 its own error, rank 0 one naming rank 1), well within the
   collective timeout; once the directory is back both ranks save again.

Each restore is compared bitwise with the full state dict gathered at that step. Each rank
prints ``RANK <r> OK`` at the end.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from async_ckpt import CheckpointManager  # noqa: E402
from async_ckpt.io import step_io
from tests.support.tree import assert_bitwise_equal, clone_tree  # noqa: E402
from tests.workers.dist_worker import build, train  # noqa: E402


def state(model, optim, step: int):
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "extra": {"replicated": torch.arange(100, dtype=torch.float32) + step}}


def full(model, optim):
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def unreachable(model, optim, rank: int, ref_dir: str) -> None:
    """Scenario 5: rank 0 cannot take the bucket's lease at step 3; no rank waits for another."""
    from async_ckpt.errors import StorageError

    bucket, local = os.path.join(ref_dir, "bucket2"), os.path.join(ref_dir, "local2")
    with CheckpointManager(bucket, save_interval=3, local_dir=local, local_policy=1, collective_timeout_s=60) as m:
        real = m.roots[-1].store.become_writer
        if rank == 0:
            def down() -> None:
                raise FileNotFoundError(2, "No such file or directory", os.path.join(bucket, ".async_ckpt.lock"))

            m.roots[-1].store.become_writer = down
        assert m.save_async(3, state(model, optim, 3))
        try:
            m.join()
            raise AssertionError("join() did not raise the bucket's failure")
        except StorageError as exc:
            assert "step 3" in str(exc) and "bucket2" in str(exc), exc
        assert m.step_tiers() == {3: ("local",)}, m.step_tiers()
        m.roots[-1].store.become_writer = real
        assert m.save_async(6, state(model, optim, 6))
        m.join()
        assert m.step_tiers() == {6: ("local", "persistent"), 3: ("local",)}, m.step_tiers()


def local_failure_on_one_rank(model, optim, rank: int, ref_dir: str) -> None:
    """Scenario 6: a local write fails on rank 1 only; no rank waits for another."""
    import time

    from async_ckpt.errors import CheckpointError

    bucket, local = os.path.join(ref_dir, "bucket3"), os.path.join(ref_dir, "local3")
    with CheckpointManager(bucket, save_interval=100, local_dir=local, local_policy=1, collective_timeout_s=60) as m:
        assert m.save(1, state(model, optim, 1))
        mine = os.path.join(local, f"rank{rank}")
        if rank == 1:  # the local disk goes away under the job
            os.rename(mine, mine + ".away")
            open(mine, "w").close()
        assert m.save_async(2, state(model, optim, 2))
        if rank == 1:
            deadline = time.monotonic() + 30
            while not m.roots[0].writer._errors and time.monotonic() < deadline:  # the write has failed
                time.sleep(0.05)
            assert m.roots[0].writer._errors, "the local write did not fail"
        dist.barrier()
        t0 = time.monotonic()
        try:
            m.save_async(3, state(model, optim, 3))
            raise AssertionError("save_async did not raise the failed local save")
        except CheckpointError as exc:
            took = time.monotonic() - t0
            assert took < 20, f"rank {rank} waited {took:.1f} s for the other rank"
            assert ("rank(s) [1]" in str(exc)) if rank == 0 else ("step 2" in str(exc)), exc
        if rank == 1:
            os.remove(mine)
            os.rename(mine + ".away", mine)
        dist.barrier()
        assert m.save(4, state(model, optim, 4))
        assert 4 in m.step_tiers() and "local" in m.step_tiers()[4], m.step_tiers()


def fail_first_local_commit(m, after_s: float, gate=None) -> None:
    """This rank's first local commit fails (EROFS) ``after_s`` seconds in (the others pass), or,
    with ``gate`` (a ``threading.Event``), once the gate is set (at most 60 s). Not ENOSPC: a full
    local_dir is logged and raised by join()/close(), not by the next save
    (tests/tiers/test_tiers_space.py); every other local failure is raised by the next agreement."""
    import errno
    import time

    real, calls = m.roots[0].store.layout.commit, [0]

    def slow_fail(target, manifest):
        calls[0] += 1
        if calls[0] == 1:
            if gate is not None:
                gate.wait(60)
            else:
                time.sleep(after_s)
            raise OSError(errno.EROFS, "Read-only file system (simulated)")
        return real(target, manifest)

    m.roots[0].store.layout.commit = slow_fail


def small(rank: int, step: int):
    return {f"r{rank}": torch.full((1000,), float(step))}


def fails_after_agreement(rank: int, ref_dir: str) -> None:
    """Scenario 7: rank 1's earlier local save fails only after the ranks agreed on step 2: no
    rank raises it there (it would leave the others' step 2 without rank 1's part); step 2
    commits with every rank's step-2 data, the failure is raised by the next agreement on every
    rank together (step 3: not saved), and step 4 commits."""
    import threading
    import time

    from async_ckpt.errors import CheckpointError

    bucket, local = os.path.join(ref_dir, "bucket7"), os.path.join(ref_dir, "local7")
    m = CheckpointManager(bucket, save_interval=1, local_dir=local, local_policy=1, collective_timeout_s=30)
    agreed = threading.Event()  # set once step 2's agreement is done: the failure comes after it
    if rank == 1:
        fail_first_local_commit(m, after_s=2, gate=agreed)
        real_agree, calls = m._exchange.agree_signal, [0]

        def agree_then_fail(*a, **k):
            out = real_agree(*a, **k)
            calls[0] += 1
            if calls[0] == 2:
                agreed.set()
            return out

        m._exchange.agree_signal = agree_then_fail
    t0 = time.monotonic()
    assert m.save_async(1, small(rank, 1))
    assert m.save_async(2, small(rank, 2))  # agreed before rank 1's local step 1 failed
    if rank == 1:  # the failure is recorded before step 3's agreement
        deadline = time.monotonic() + 30
        while not m.roots[0].writer.failed() and time.monotonic() < deadline:
            time.sleep(0.01)
    try:
        m.save_async(3, small(rank, 3))
        raise AssertionError(f"rank {rank}: the failed local save of step 1 was not raised at step 3")
    except CheckpointError as exc:
        assert ("step 1" in str(exc)) if rank == 1 else ("rank(s) [1]" in str(exc)), exc
    assert m.save_async(4, small(rank, 4))
    m.join()
    m.close()
    assert time.monotonic() - t0 < 20, "a rank waited for the other"
    steps = sorted(int(n) for n in os.listdir(bucket) if n.isdigit())
    assert steps == [1, 2, 4], steps
    for step in (2, 4):  # every rank's part of the same step
        target = small(rank, -1)
        with CheckpointManager(bucket, save_interval=1) as m2:
            assert m2.restore(step, target) == step
        assert torch.equal(target[f"r{rank}"], small(rank, step)[f"r{rank}"]), (step, target)


def invalid_on_one_rank(rank: int, ref_dir: str) -> None:
    """Scenario 8: rank 1's metrics (a NaN loss) or step do not validate: every rank raises at
    that call (rank 1 its own error, rank 0 one naming rank 1), nothing is saved for it, and the
    next step saves on every rank."""
    import time

    from async_ckpt.errors import CheckpointError

    bucket, local = os.path.join(ref_dir, "bucket8"), os.path.join(ref_dir, "local8")
    with CheckpointManager(bucket, save_interval=1, local_dir=local, local_policy=1, collective_timeout_s=30) as m:
        assert m.save(1, small(rank, 1), metrics={"loss": 1.0})
        for case in ("nan", "step"):
            step, loss = (2, float("nan")) if case == "nan" else (-2, 2.0)
            if rank == 0:
                step, loss = 2, 2.0
            t0 = time.monotonic()
            try:
                m.save_async(step, small(rank, 2), metrics={"loss": loss})
                raise AssertionError(f"rank {rank} did not raise ({case})")
            except (ValueError, CheckpointError) as exc:
                assert time.monotonic() - t0 < 15, f"rank {rank} waited for the other"
                assert isinstance(exc, ValueError) if rank == 1 else "rank(s) [1]" in str(exc), exc
            dist.barrier()
        assert m.save(3, small(rank, 3), metrics={"loss": 3.0})
    assert sorted(int(n) for n in os.listdir(bucket) if n.isdigit()) == [1, 3]


def out_of_step(rank: int, ref_dir: str) -> None:
    """Scenario 9: rank 1 is called with step 3 while rank 0 saves step 2: the agreement fails
    on every rank at once (rank 0's error names rank 1). With that check bypassed, the save
    jobs still see it (rank 0 opens step 2 for rank 1's step-3 job): neither is committed and
    both ranks raise at join()."""
    import time

    from async_ckpt.errors import CheckpointError

    bucket = os.path.join(ref_dir, "bucket9")
    with CheckpointManager(bucket, save_interval=1, collective_timeout_s=30) as m:
        assert m.save(1, small(rank, 1))
        t0 = time.monotonic()
        try:
            m.save_async(3 if rank == 1 else 2, small(rank, 2))
            raise AssertionError(f"rank {rank} did not raise")
        except CheckpointError as exc:
            assert time.monotonic() - t0 < 15, f"rank {rank} waited for the other"
            assert "rank(s) [1]" in str(exc), exc
        dist.barrier()
        real = m._exchange.agree_signal  # the agreement of save_async (with every rank's preemption flag)
        m._exchange.agree_signal = lambda flags, ok=True, step=None, signal=False, what="agree": real(
            flags, ok, None, signal, what=what)
        assert m.save_async(3 if rank == 1 else 2, small(rank, 2))  # no step in the exchange
        try:
            m.join()
            raise AssertionError(f"rank {rank}: join did not raise")
        except CheckpointError as exc:
            assert "out of step" in str(exc), exc
        m._exchange.agree_signal = real
        assert m.save(4, small(rank, 4))
    assert sorted(int(n) for n in os.listdir(bucket) if n.isdigit()) == [1, 4]


def resave_on_one_rank(rank: int, ref_dir: str) -> None:
    """Scenario 10: a second run re-saves step 5, and rank 0's local commit of it fails (a
    crash or a full disk between the ranks' commits): the ranks' local copies of step 5 are
    from two saves, so a fresh job restores step 4 (the newest step every rank holds from one
    save), never rank 0's first step 5 with rank 1's second."""
    import errno

    bucket, local = os.path.join(ref_dir, "bucket10"), os.path.join(ref_dir, "local10")
    opts = dict(save_interval=1000, local_dir=local, local_policy=1, local_retention=3, collective_timeout_s=30)

    def sd(v):
        return {"w": torch.full((8,), float(v))}

    with CheckpointManager(bucket, **opts) as m:
        m.save(4, sd(4))
        m.save(5, sd(5))
    with CheckpointManager(bucket, **opts) as m:
        m.restore(4, sd(0))
        if rank == 0:
            def fail(*a, **k):
                raise OSError(errno.EROFS, "Read-only file system (simulated)")

            m.roots[0].store.layout.commit = fail
        m.save_async(5, sd(55))
        try:
            m.join()
        except Exception:
            assert rank == 0
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with CheckpointManager(bucket, **opts) as m:
            target = sd(-1)
            got = m.restore(None, target)
    assert (got, target["w"][0].item()) == (4, 4.0), (rank, got, target["w"][0].item())


def settle_on_one_rank(rank: int, ref_dir: str) -> None:
    """Scenario 11: rank 1's local save fails, then every rank calls restore() (then, after a
    second such failure, delete()): every rank raises at once (rank 1 its own error, rank 0 one
    naming rank 1) instead of rank 0 waiting in the restore's collectives."""
    import time

    from async_ckpt.errors import CheckpointError

    bucket, local = os.path.join(ref_dir, "bucket11"), os.path.join(ref_dir, "local11")
    with CheckpointManager(bucket, save_interval=100, local_dir=local, local_policy=1, collective_timeout_s=30) as m:
        m.save(100, small(rank, 100))
        mine = os.path.join(local, f"rank{rank}")
        for step, action in ((101, lambda: m.restore(None, small(rank, 0))), (102, lambda: m.delete(100))):
            if rank == 1:  # the local disk goes away under the job
                os.rename(mine, mine + ".away")
                open(mine, "w").close()
            m.save_async(step, small(rank, step))
            if rank == 1:
                m.roots[0].writer.wait_idle()
            dist.barrier()
            t0 = time.monotonic()
            try:
                action()
                raise AssertionError(f"rank {rank}: step {step}: no error")
            except CheckpointError as exc:
                assert time.monotonic() - t0 < 15, f"rank {rank} waited for the other"
                assert f"step {step}" in str(exc) if rank == 1 else "rank(s) [1]" in str(exc), exc
            if rank == 1:
                os.remove(mine)
                os.rename(mine + ".away", mine)
            dist.barrier()
        assert m.restore(None, small(rank, 0)) == 100


def saves_resume_after_one_failure(rank: int, ref_dir: str) -> None:
    """Scenario 12: rank 1's state dict of step 3 cannot be saved (a list): step 3 fails on every
    rank, the next call may raise that failure (on every rank together), and from then on
    saves commit again on both ranks (they failed one after the other, forever, before)."""
    from async_ckpt.errors import CheckpointError

    root = os.path.join(ref_dir, "bucket12")
    raised = []
    with CheckpointManager(root, save_interval=1, collective_timeout_s=30) as m:
        for step in range(1, 9):
            sd = [torch.ones(3)] if (rank == 1 and step == 3) else small(rank, step)
            try:
                m.save_async(step, sd)
            except (CheckpointError, TypeError):
                raised.append(step)
        m.join()
    committed = sorted(int(n) for n in os.listdir(root) if n.isdigit())
    assert (3 in raised) == (rank == 1), (rank, raised)  # rank 1's own staging error, at the call
    assert not [s for s in raised if s > 5], (rank, raised)  # the others learn it by step 5 at most
    assert 3 not in committed and {6, 7, 8} <= set(committed), (rank, committed)
    later = [None, None]
    dist.all_gather_object(later, [s for s in raised if s != 3])
    assert later[0] == later[1] and later[0], later  # ... and every rank raises it at the same call


def restore_named_steps_differ(rank: int, ref_dir: str) -> None:
    """Scenario 13: the ranks name different steps to restore() (or delete()), or one rank an
    invalid one: every rank raises at once, nothing is read or deleted."""
    import time

    from async_ckpt.errors import CheckpointError

    root = os.path.join(ref_dir, "bucket13")
    with CheckpointManager(root, save_interval=1, collective_timeout_s=30) as m:
        for step in (3, 5):
            m.save(step, small(rank, step))
        target = small(rank, 0)
        for mine in ((5 if rank == 0 else 3), (5 if rank == 0 else -1)):
            t0 = time.monotonic()
            try:
                m.restore(mine, target)
                raise AssertionError(f"rank {rank} restored step {mine}")
            except (CheckpointError, ValueError):
                assert time.monotonic() - t0 < 15, f"rank {rank} waited for the other"
            assert torch.equal(target[f"r{rank}"], torch.zeros(1000)), "the target changed"
            dist.barrier()
        try:
            m.delete(5 if rank == 0 else 3)
            raise AssertionError(f"rank {rank}: delete of different steps passed")
        except CheckpointError:
            pass
        assert m.all_steps() == [3, 5], m.all_steps()
        assert m.restore(None, target) == 5


def preemption_on_one_rank(rank: int, ref_dir: str) -> None:
    """Scenario 14: a preemption signal reaches rank 1 only (``"signal"`` mode): every rank
    takes the preemption checkpoint at the same step and is told to stop there."""
    import time

    root = os.path.join(ref_dir, "bucket14")
    t0 = time.monotonic()
    with CheckpointManager(root, save_interval=100, chkpt_on_preemption=True, preemption_sync="signal",
                           collective_timeout_s=20) as m:
        stopped = None
        for step in range(1, 8):
            if rank == 1 and step == 3:
                m.trigger_preemption()  # as if SIGTERM reached this host only
            m.save_async(step, small(rank, step))
            if m.reached_preemption(step):
                stopped = step
                break
        m.join()
    assert stopped == 3, (rank, stopped)
    assert time.monotonic() - t0 < 15, f"rank {rank} waited for the other"
    assert sorted(int(n) for n in os.listdir(root) if n.isdigit()) == [3]


def save_raises_on_every_rank(rank: int, ref_dir: str) -> None:
    """Scenario 15: rank 1's local save of step 1 fails after the ranks agreed on step 2, and
    step 2 is a blocking save(): every rank's save(2) raises (rank 1 its own error, rank 0 one
    naming rank 1), not rank 1's alone. Then ranks whose chkpt_on_preemption differs save."""
    import time

    from async_ckpt.errors import CheckpointError

    bucket, local = os.path.join(ref_dir, "bucket15"), os.path.join(ref_dir, "local15")
    with CheckpointManager(bucket, save_interval=1, local_dir=local, local_policy=1, collective_timeout_s=20) as m:
        if rank == 1:
            fail_first_local_commit(m, after_s=1.5)
        t0 = time.monotonic()
        assert m.save_async(1, small(rank, 1))
        try:
            m.save(2, small(rank, 2))
            raise AssertionError(f"rank {rank}: save(2) did not raise")
        except CheckpointError as exc:
            assert ("step 1" in str(exc)) if rank == 1 else ("rank(s) [1]" in str(exc)), exc
        assert time.monotonic() - t0 < 15, f"rank {rank} waited for the other"
        assert m.save(3, small(rank, 3))
    root = os.path.join(ref_dir, "bucket15b")
    with CheckpointManager(root, save_interval=1, chkpt_on_preemption=rank == 0, preemption_sync="signal",
                           collective_timeout_s=20) as m:
        for step in (1, 2):
            assert m.save(step, small(rank, step))
    assert sorted(int(n) for n in os.listdir(root) if n.isdigit()) == [1, 2]


def run_only(names: str) -> None:
    """Only the named scenarios (``TIER_WORKER_ONLY``, comma-separated), each rank printing
    ``RANK <r> OK`` at the end."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ref_dir = sys.argv[3]
    for name in names.split(","):
        scenarios = {"fails_after_agreement": fails_after_agreement, "invalid_on_one_rank": invalid_on_one_rank,
                     "out_of_step": out_of_step, "resave_on_one_rank": resave_on_one_rank,
                     "settle_on_one_rank": settle_on_one_rank,
                     "saves_resume_after_one_failure": saves_resume_after_one_failure,
                     "restore_named_steps_differ": restore_named_steps_differ,
                     "preemption_on_one_rank": preemption_on_one_rank,
                     "save_raises_on_every_rank": save_raises_on_every_rank}
        scenarios[name](rank, ref_dir)
        dist.barrier()
    print(f"RANK {rank} OK", flush=True)
    dist.destroy_process_group()


def main() -> None:
    if os.environ.get("TIER_WORKER_ONLY"):
        return run_only(os.environ["TIER_WORKER_ONLY"])
    bucket, local, ref_dir = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optim = build(0)
    refs = {}
    opts = dict(save_interval=3, local_dir=local, local_policy=1, local_retention=3)
    with CheckpointManager(bucket, **opts) as mgr:
        for step in range(1, 5):
            train(model, optim, 1, rank)
            assert mgr.save_async(step, state(model, optim, step))
            refs[step] = clone_tree(full(model, optim))  # plain tensors (Adam's step) come back live
        mgr.join()
        tiers = mgr.step_tiers()
        assert tiers == {4: ("local",), 3: ("local", "persistent"), 2: ("local",)}, tiers
    mine = os.path.join(local, f"rank{rank}")
    assert sorted(n for n in os.listdir(mine) if n.isdigit()) == ["2", "3", "4"]

    loads = []
    real = step_io.read_step  # one process's read (a rank's own local copy); the bucket's is over DCP (agree)
    step_io.read_step = lambda storage, *a, **k: (
        loads.append(storage.url) if k.get("agree") is None else None, real(storage, *a, **k))[1]

    def restore_and_check(expect: int, local_reads: int) -> None:
        """Restore into a fresh model; ``local_reads``: how many local copies this rank read
        (the bucket's restore is collective, over DCP, not a local read)."""
        fresh_model, fresh_optim = build(1)  # other values: every byte must come from the checkpoint
        target = state(fresh_model, fresh_optim, -1)
        loads.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with CheckpointManager(bucket, **opts) as m:
                got = m.restore(None, target)
        assert got == expect, (rank, got, expect)
        set_state_dict(fresh_model, fresh_optim, model_state_dict=target["model"],
                       optim_state_dict=target["optim"])
        assert_bitwise_equal(full(fresh_model, fresh_optim), refs[expect])
        assert torch.equal(target["extra"]["replicated"], torch.arange(100, dtype=torch.float32) + expect)
        assert loads == [mine] * local_reads, (rank, loads)

    restore_and_check(4, 1)
    dist.barrier()
    if rank == 1:
        shutil.rmtree(os.path.join(mine, "4"))
    dist.barrier()
    restore_and_check(3, 1)
    dist.barrier()
    if rank == 1:
        d = os.path.join(mine, "3")
        f = sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0]
        with open(os.path.join(d, f), "r+b") as fh:
            fh.seek(os.path.getsize(os.path.join(d, f)) // 2)
            b = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    restore_and_check(3, 1)  # the local copies of 3 (one damaged), then the bucket's
    dist.barrier()
    if rank == 1:
        shutil.rmtree(mine)
    dist.barrier()
    restore_and_check(3, 0)  # no local step on every rank: the bucket
    dist.barrier()
    unreachable(model, optim, rank, ref_dir)
    local_failure_on_one_rank(model, optim, rank, ref_dir)
    dist.barrier()
    print(f"RANK {rank} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
