"""The lifecycle's parts in isolation: the step catalog, the local coordinator, the commit
protocols."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from async_ckpt import CheckpointError, CorruptCheckpointError
from async_ckpt.format.manifest import MARKER_NAME, Manifest
from async_ckpt.jobs.catalog import StepCatalog
from async_ckpt.policies import KeepLatest, as_retention_policy
from async_ckpt.ranks import phase
from async_ckpt.ranks.exchange import LocalExchange
from async_ckpt.storage import Storage
from async_ckpt.storage.commit import MarkerCommit, RenameCommit
from async_ckpt.storage.step_dirs import StepDirectories


def _layout(tmp_path, mode="rename"):
    st = Storage(str(tmp_path / "root"))
    st.makedirs(st.root)
    return StepDirectories(st, mode)


def _commit(layout, step, t):
    target = layout.begin(step)
    layout.storage.write_bytes(f"{target.path}/data", b"x" * step)
    layout.commit(target, Manifest(step=step, commit_time=t, files={}))
    return target


# ---- StepCatalog ----------------------------------------------------------------------------

def test_catalog_orders_by_commit_time_and_drops_the_oldest_commits(tmp_path):
    layout = _layout(tmp_path)
    for step, t in ((30, 1.0), (10, 2.0), (20, 3.0)):
        _commit(layout, step, t)
    cat = StepCatalog(layout, lambda: 10.0)
    assert [c.step for c in cat.in_commit_order()] == [30, 10, 20]
    assert cat.latest() == 20
    assert cat.drops(KeepLatest(1)) == [30, 10]
    cat.begin_write(30)  # in flight: never dropped
    assert cat.drops(KeepLatest(1)) == [10]
    cat.end_write(30)


def test_catalog_never_drops_the_newest_commit_whatever_the_policy(tmp_path):
    layout = _layout(tmp_path)
    for step, t in ((1, 1.0), (2, 2.0)):
        _commit(layout, step, t)
    cat = StepCatalog(layout, lambda: 10.0)
    assert cat.drops(as_retention_policy(lambda cps: set())) == [1]


def test_catalog_commit_times_never_go_back(tmp_path):
    layout = _layout(tmp_path)
    _commit(layout, 1, 100.0)
    cat = StepCatalog(layout, lambda: 50.0)  # the clock is behind the newest commit
    t = cat.next_commit_time()
    assert t > 100.0
    cat2 = StepCatalog(layout, lambda: 200.0)
    assert cat2.next_commit_time() == 200.0


def test_catalog_condemn_is_immediate_and_remove_waits_for_a_save_of_the_step(tmp_path):
    layout = _layout(tmp_path)
    _commit(layout, 1, 1.0)
    cat = StepCatalog(layout, lambda: 10.0)
    cat.enable_cache()
    paths = cat.condemn(1)
    assert layout.committed_steps() == [] and cat.infos() == {}
    cat.begin_write(1)  # a new save of step 1 starts before the files are removed
    done = threading.Event()
    t = threading.Thread(target=lambda: (cat.remove(1, paths), done.set()))
    t.start()
    assert not done.wait(0.2)  # waits for the save
    _commit(layout, 1, 5.0)  # the new copy is committed (rename mode: into the same name)
    cat.end_write(1)
    t.join(10)
    assert done.is_set()
    assert layout.committed_steps() == [1]  # the committed new copy was left alone


def test_catalog_cache_sees_a_marker_removed_by_hand(tmp_path):
    layout = _layout(tmp_path)
    for s in (1, 2):
        _commit(layout, s, float(s))
    cat = StepCatalog(layout, lambda: 10.0)
    cat.enable_cache()
    assert cat.latest() == 2
    os.remove(os.path.join(layout.step_dir(2), MARKER_NAME))
    assert cat.latest() == 1


# ---- LocalExchange and the error exchange ------------------------------------------------

def test_local_coordinator_answers_with_the_local_value():
    c = LocalExchange()
    assert c.is_primary and c.world_size == 1
    assert c.agree([True, False]) == ([True, False], [])
    assert c.agree([True], ok=False) == ([True], [0])
    assert c.broadcast({"a": 1}) == {"a": 1}
    assert c.all_gather(3) == [3]


def test_one_process_raises_its_own_error_as_raised():
    err = OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space") as ei:
        phase.everyone(LocalExchange(), "writing", 5, error=err)
    assert ei.value is err
    assert phase.everyone(LocalExchange(), "writing", 5, lambda: 3) == [3]  # nothing failed
    assert phase.primary(LocalExchange(), "commit", 5, lambda: "done") == "done"


def test_other_ranks_errors_keep_their_class_and_name_the_rank():
    failures = [None, phase.failure_of(1, CorruptCheckpointError("bad crc"))]
    with pytest.raises(CorruptCheckpointError, match="rank 1: CorruptCheckpointError: bad crc") as ei:
        phase.raise_if_failed(failures, 7, "restore", None)
    assert ei.value.step == 7 and [(f.rank, f.kind) for f in ei.value.failures] == [(1, "CorruptCheckpointError")]
    with pytest.raises(CheckpointError, match="rank 1: ValueError: x"):
        phase.raise_if_failed([None, phase.failure_of(1, ValueError("x"))], 7, "writing", None)
    phase.raise_if_failed([None, None], 7, "writing", None)  # nothing failed


# ---- commit protocols -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["rename", "marker"])
def test_commit_protocol_resave_keeps_the_old_copy_until_the_new_one_commits(tmp_path, mode):
    layout = _layout(tmp_path, mode)
    assert isinstance(layout.protocol, RenameCommit if mode == "rename" else MarkerCommit)
    _commit(layout, 5, 1.0)
    target = layout.begin(5)
    assert target.path != layout.step_dir(5)  # never written over the committed copy
    assert layout.read_manifest(5).commit_time == 1.0
    layout.storage.write_bytes(f"{target.path}/data", b"new")
    layout.commit(target, Manifest(step=5, commit_time=2.0, files={}))
    assert layout.read_manifest(5).commit_time == 2.0
    assert layout.committed_steps() == [5] and len(layout.marked_copies(5)) == 1


class _Killed(BaseException):
    """Stands for the process dying at that point (not an error the code may handle)."""


def test_a_failure_retiring_the_old_copy_never_undoes_the_new_commit(tmp_path):
    """Marker mode: the old copy is unmarked, then removing its files fails. The save must
    not fail (its abort would unmark the new copy too, leaving neither)."""
    from async_ckpt import CheckpointManager

    root = str(tmp_path / "ck")
    mgr = CheckpointManager(root, commit_mode="marker")
    mgr.save(5, {"w": torch.zeros(8)})
    real_remove = mgr.layout.remove

    def failing_remove(path):
        if MARKER_NAME not in os.listdir(path) and not path.endswith(mgr.layout.locate(5).rsplit("/", 1)[-1]):
            raise OSError("transient storage error")
        return real_remove(path)

    mgr.layout.remove = failing_remove  # type: ignore[method-assign]
    assert mgr.save(5, {"w": torch.ones(8)})
    mgr.layout.remove = real_remove  # type: ignore[method-assign]
    out = {"w": torch.zeros(8)}
    assert mgr.restore(5, out) == 5 and torch.equal(out["w"], torch.ones(8))
    mgr.close()


@pytest.mark.parametrize("mode", ["rename", "marker"])
def test_two_committed_copies_the_newer_counts_and_recovery_keeps_it(tmp_path, mode):
    """A crash between the new copy's marker and the old copy's retirement."""
    layout = _layout(tmp_path, mode)
    _commit(layout, 5, 1.0)
    target = layout.begin(5)
    real_rename, real_condemn = layout.storage.rename, layout.condemn_dir
    # the new marker is written; the process then dies before the old copy retires
    layout.storage.rename = lambda *a: (_ for _ in ()).throw(_Killed("killed"))  # type: ignore[method-assign]
    layout.condemn_dir = lambda *a: (_ for _ in ()).throw(_Killed("killed"))  # type: ignore[method-assign]
    with pytest.raises(_Killed, match="killed"):
        layout.commit(target, Manifest(step=5, commit_time=2.0, files={}))
    layout.storage.rename, layout.condemn_dir = real_rename, real_condemn  # type: ignore[method-assign]
    assert len(layout.marked_copies(5)) == 2
    assert layout.read_manifest(5).commit_time == 2.0  # the newer copy is the step
    layout.recover()
    assert layout.read_manifest(5).commit_time == 2.0
    assert len(layout.marked_copies(5)) == 1
    if mode == "rename":
        assert layout.locate(5) == layout.step_dir(5)  # renamed into place


def test_recovery_never_retires_an_older_copy_for_a_newer_one_that_does_not_verify(tmp_path):
    layout = _layout(tmp_path, "marker")
    _commit(layout, 5, 1.0)
    target = _commit_beside = layout.begin(5)
    layout.storage.write_bytes(f"{target.path}/manifest.json", Manifest(step=5, commit_time=2.0, files={}).to_json())
    layout.storage.write_bytes(f"{target.path}/{MARKER_NAME}", b'{"manifest_size": 1, "manifest_crc32c": 0}')
    assert _commit_beside.path != layout.step_dir(5)
    layout.recover()
    assert os.path.exists(os.path.join(layout.step_dir(5), MARKER_NAME))  # the good old copy stays


def test_a_failed_final_rename_puts_the_old_copy_back(tmp_path):
    """Rename mode re-save: the old copy is moved aside, then the new copy's rename fails. The
    save fails and the old copy is the step again (it was never unmarked, only renamed)."""
    layout = _layout(tmp_path, "rename")
    _commit(layout, 5, 1.0)
    target = layout.begin(5)
    layout.storage.write_bytes(f"{target.path}/data", b"new")
    real = layout.storage.rename

    def rename(src, dst):
        if src == target.path:
            raise OSError("EIO")
        return real(src, dst)

    layout.storage.rename = rename  # type: ignore[method-assign]
    with pytest.raises(OSError, match="EIO"):
        layout.commit(target, Manifest(step=5, commit_time=2.0, files={}))
    layout.storage.rename = real  # type: ignore[method-assign]
    layout.abort(target)  # what the save job does next
    assert layout.committed_steps() == [5] and layout.read_manifest(5).commit_time == 1.0
