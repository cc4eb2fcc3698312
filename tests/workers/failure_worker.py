"""Worker for tests/damage/test_failure_reporting.py (torchrun, 2 gloo ranks): one rank's
KeyboardInterrupt during a restore or a Stateful load_state_dict.

    torchrun --standalone --nproc-per-node 2 tests/workers/failure_worker.py <root> [interrupt|apply]

Each rank prints ``RANK <r> OK`` at the end; a failed check raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from async_ckpt import CheckpointError, CheckpointManager  # noqa: E402

TIMEOUT_S = 30.0  # the collective timeout: a rank left waiting fails only after it


class InterruptedOnRank:
    """A Stateful value whose load_state_dict is interrupted (Ctrl-C) on one rank only."""

    def __init__(self, bad_rank: int) -> None:
        self.bad_rank = bad_rank
        self.t = torch.zeros(8)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, sd) -> None:
        if dist.get_rank() == self.bad_rank:
            raise KeyboardInterrupt
        self.t.copy_(sd["t"])


def interrupted(fn, rank: int) -> None:
    t0 = time.monotonic()
    try:
        fn()
    except KeyboardInterrupt:
        assert rank == 1, f"rank {rank} got the KeyboardInterrupt of rank 1"
    except CheckpointError as exc:
        assert rank == 0, f"rank {rank}: {exc!r}"
        assert "rank 1" in str(exc) and "KeyboardInterrupt" in str(exc), exc
        assert [f.rank for f in exc.failures] == [1], exc.failures
    else:
        raise AssertionError(f"rank {rank}: no error")
    took = time.monotonic() - t0
    assert took < TIMEOUT_S / 2, f"rank {rank} waited {took:.1f} s (the collective timeout: the ranks hung)"


def checks(root: str) -> None:
    rank = dist.get_rank()
    from async_ckpt.storage.step_dirs import StepDirectories

    with CheckpointManager(root, collective_timeout_s=TIMEOUT_S) as mgr:
        assert mgr.save(1, {"app": InterruptedOnRank(-1), "w": torch.ones(4)})
        # 1. Ctrl-C on rank 1 while it checks the step
        real = StepDirectories.read_committed

        def read_committed(self, step):
            if rank == 1:
                raise KeyboardInterrupt
            return real(self, step)

        StepDirectories.read_committed = read_committed  # type: ignore[method-assign]
        try:
            interrupted(lambda: mgr.restore(1, {"w": torch.zeros(4)}), rank)
        finally:
            StepDirectories.read_committed = real  # type: ignore[method-assign]
        # 2. Ctrl-C on rank 1 in a Stateful value's load_state_dict
        interrupted(lambda: mgr.restore(1, {"app": InterruptedOnRank(1), "w": torch.zeros(4)}), rank)
        # the ranks still pair up
        ok = InterruptedOnRank(-1)
        assert mgr.restore(1, {"app": ok, "w": torch.zeros(4)}) == 1


def apply_checks(root: str) -> None:
    """Rank 1 fails while it writes into its target (after every rank's reads passed), so both
    ranks had written: every rank raises a PartlyWrittenError whose ``failures`` name rank 1
    only (the rank whose write failed), not each rank that had written."""
    from async_ckpt import PartlyWrittenError
    from async_ckpt.io import FsspecStorageReader

    rank = dist.get_rank()
    with CheckpointManager(root, collective_timeout_s=TIMEOUT_S) as mgr:
        assert mgr.save(1, {"w": torch.ones(64), "v": torch.full((8,), float(rank))})
        real = FsspecStorageReader._apply

        def apply(self, ready, planner):
            real(self, ready, planner)
            if rank == 1:
                raise RuntimeError("rank 1 could not write into its target")

        FsspecStorageReader._apply = apply  # type: ignore[method-assign]
        try:
            mgr.restore(1, {"w": torch.zeros(64), "v": torch.zeros(8)})
        except PartlyWrittenError as exc:
            assert "could not write into its target" in str(exc), exc
            assert [f.rank for f in exc.failures] == [1], exc.failures
        else:
            raise AssertionError(f"rank {rank}: no PartlyWrittenError")
        finally:
            FsspecStorageReader._apply = real  # type: ignore[method-assign]


def mixed_checks(root: str) -> None:
    """restore(None): step 2 is damaged as rank 0 sees it, unreachable as rank 1 sees it (a
    StorageError, not damage): no rank falls back alone to step 1 (waiting there for a rank
    that has raised); every rank raises at once, and the ranks still pair up afterwards."""
    from async_ckpt import CorruptCheckpointError
    from async_ckpt.errors import StorageError
    from async_ckpt.storage.step_dirs import StepDirectories

    rank = dist.get_rank()
    with CheckpointManager(root, collective_timeout_s=TIMEOUT_S) as mgr:
        assert mgr.save(1, {"w": torch.ones(4)})
        assert mgr.save(2, {"w": torch.full((4,), 2.0)})
        real = StepDirectories.read_committed

        def read_committed(self, step):
            if step == 2 and rank == 0:
                raise CorruptCheckpointError("step 2: marker does not match the manifest", step=2)
            if step == 2 and rank == 1:
                raise StorageError("step 2: manifest: 503")
            return real(self, step)

        StepDirectories.read_committed = read_committed  # type: ignore[method-assign]
        t0 = time.monotonic()
        try:
            mgr.restore(None, {"w": torch.zeros(4)})
        except CheckpointError as exc:
            assert not isinstance(exc, CorruptCheckpointError), f"rank {rank} would fall back alone: {exc!r}"
            assert "503" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank} restored alone")
        finally:
            StepDirectories.read_committed = real  # type: ignore[method-assign]
        took = time.monotonic() - t0
        assert took < TIMEOUT_S / 2, f"rank {rank} waited {took:.1f} s (the collective timeout: the ranks hung)"
        t = {"w": torch.zeros(4)}
        assert mgr.restore(None, t) == 2 and torch.equal(t["w"], torch.full((4,), 2.0))


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("DIST_WORKER_TIMEOUT", "150")), exit=True)
    dist.init_process_group("gloo")
    try:
        {"interrupt": checks, "apply": apply_checks, "mixed": mixed_checks}[sys.argv[2] if len(sys.argv) > 2 else "interrupt"](sys.argv[1])
        dist.barrier()
        print(f"RANK {dist.get_rank()} OK", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
