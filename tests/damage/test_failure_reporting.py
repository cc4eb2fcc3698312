"""How failures are reported: a restore that failed after writing (PartlyWrittenError and its
kinds), and failures across ranks (every rank raises the same failures, named by rank)."""

from __future__ import annotations

import threading

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.errors import PartlyWrittenError, StorageError

from ..conftest import assert_bitwise_equal
from ..support.launch import torchrun


def big(v: float) -> dict:
    return {"w": torch.full((512, 1024), v), "v": torch.full((512, 1024), v + 0.5)}


def _eio_after_first_write(monkeypatch, where: str):
    """Reads of files under ``where`` raise StorageError from their second large read on (the
    first one has landed in the target)."""
    from async_ckpt.io import read_exec

    real = read_exec.open_step_file
    lock = threading.Lock()
    count = {"n": 0}

    class Flaky:
        def __init__(self, r):
            self._r = r

        def __getattr__(self, name):
            return getattr(self._r, name)

        def read_into(self, start, dest):
            if len(dest) >= 2**20:
                with lock:
                    count["n"] += 1
                    n = count["n"]
                if n > 1:
                    raise StorageError(f"{where}: read failed: EIO")
            return self._r.read_into(start, dest)

    def opened(storage, path, name, size):
        r = real(storage, path, name, size)
        return Flaky(r) if path.startswith(where) or where in path else r

    monkeypatch.setattr(read_exec, "open_step_file", opened)
    return count


def test_storage_error_after_a_partial_write_of_the_local_copy_falls_back_to_the_persistent_copy(tmp_path,
                                                                                                monkeypatch):
    """A StorageError (one of the tiers' fallback errors) reading the local copy after it wrote
    into the target: the persistent copy is restored instead (it overwrites every key), as
    before PartlyWrittenError; it was raised instead."""
    path, local = str(tmp_path / "bucket"), str(tmp_path / "local")
    with CheckpointManager(path, save_interval=1, local_dir=local, local_policy=1) as mgr:
        mgr.save(4, big(4.0))
    _eio_after_first_write(monkeypatch, local)
    target = big(0.0)
    with CheckpointManager(path, save_interval=1, local_dir=local, local_policy=1) as mgr:
        with pytest.warns(RuntimeWarning, match="skipping the local copy of step 4"):
            assert mgr.restore(4, target) == 4
    assert_bitwise_equal(target, big(4.0))


def test_storage_error_after_a_partial_write_is_partly_written_and_still_a_storage_error(tmp_path, monkeypatch):
    """One tier: the error says the target was partly written and keeps its type (StorageError,
    OSError), as it was raised before."""
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(4, big(4.0))
    _eio_after_first_write(monkeypatch, root)
    with pytest.raises(PartlyWrittenError, match="EIO.*partly written") as ei:
        CheckpointManager(root).restore(4, big(0.0))
    assert isinstance(ei.value, StorageError) and isinstance(ei.value, OSError), type(ei.value).__mro__


def test_one_process_restore_error_without_a_step_gets_the_step_as_before(tmp_path, monkeypatch):
    """One process: a CheckpointError raised without a step while checking a step (here a
    StorageError reading its manifest) is raised with ``step`` set, as the exchange did before
    the one rank protocol (it now raised it with step None)."""
    from async_ckpt.storage.step_dirs import StepDirectories

    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(4, {"w": torch.ones(4)})

    def refuse(self, step):
        raise StorageError("manifest: 503")

    monkeypatch.setattr(StepDirectories, "read_committed", refuse)
    with pytest.raises(StorageError, match="503") as ei:
        CheckpointManager(root).restore(4, {"w": torch.zeros(4)})
    assert ei.value.step == 4


@pytest.mark.slow
def test_a_keyboard_interrupt_on_one_rank_in_a_restore_is_reported_to_the_others(tmp_path):
    """2 ranks: Ctrl-C on rank 1 while it checks a step or in a Stateful value's
    load_state_dict: rank 1 raises KeyboardInterrupt, rank 0 a CheckpointError naming it at
    once (the phase exchanges it), instead of waiting out the collective timeout."""
    _two_ranks(str(tmp_path / "c"), "interrupt")


def _two_ranks(root: str, scenario: str) -> None:
    proc = torchrun(2, "failure_worker.py", root, scenario, env={"DIST_WORKER_TIMEOUT": "150"}, timeout=240)
    assert proc.returncode == 0 and "RANK 0 OK" in proc.stdout and "RANK 1 OK" in proc.stdout, proc.stdout[-4000:]


@pytest.mark.slow
def test_failures_of_a_partly_written_multi_rank_restore_name_the_rank_that_failed(tmp_path):
    """2 ranks, rank 1 fails while writing into its target after both wrote: ``failures`` names
    rank 1 only on every rank (it named every rank that had written, as if each had failed)."""
    _two_ranks(str(tmp_path / "c"), "apply")


def test_a_partly_written_error_after_a_damaged_step_names_both_steps_once(tmp_path, monkeypatch):
    """restore(None): damaged step 2 partly wrote the target, then step 1's read failed after
    it wrote too: damaged_steps names both (newest first), keys_left the keys they wrote, and
    the message says "must not be used as is" once (it was said twice, naming step 2 only)."""
    import os

    from ..restore_paths.test_restore_fast import _flip_near_end

    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, big(1.0))
        mgr.save(2, big(2.0))
    _flip_near_end(os.path.join(root, "2"))
    _eio_after_first_write(monkeypatch, os.path.join(root, "1"))
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2"):
        with pytest.raises(PartlyWrittenError, match="EIO") as ei:
            CheckpointManager(root).restore(None, big(0.0))
    err = ei.value
    assert err.damaged_steps == (2, 1) and err.keys_left == ("v", "w") and err.step == 1, err
    assert str(err).count("must not be used as is") == 1 and "damaged step 2" in str(err), str(err)
    assert isinstance(err, StorageError)


@pytest.mark.slow
def test_ranks_that_fail_a_step_differently_fall_back_together_or_not_at_all(tmp_path):
    """2 ranks, restore(None): step 2 is damaged on rank 0 and unreachable (StorageError) on
    rank 1: both raise at once (rank 0 fell back to step 1 alone and waited there for rank 1)."""
    _two_ranks(str(tmp_path / "c"), "mixed")
