"""Two tiers while the bucket is away: failed uploads are logged and raised at join()/close(),
local saves go on, an unreachable or unlistable bucket falls back to the local tier (and its
error is raised where nothing else answers)."""

from __future__ import annotations

import logging
import os
import shutil
import warnings

import pytest

from async_ckpt import CheckpointManager
from async_ckpt.errors import CheckpointError, StorageError

from ..conftest import assert_bitwise_equal
from .test_tiers import state, zeros


@pytest.fixture
def roots(tmp_path):
    return str(tmp_path / "bucket"), str(tmp_path / "local")


def test_failed_uploads_do_not_stop_local_saves_and_are_raised_at_join(roots, caplog):
    path, local = roots
    path = "faulty://" + path  # the bucket: every data file upload refused while it is "down"
    mgr = CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1, local_retention=10)
    mgr.storage.fs.inject("write", "*.distcp", "http403")
    with caplog.at_level(logging.ERROR, logger="async_ckpt"):
        for s in range(1, 6):
            assert mgr.save_async(s, state(s))  # the failed uploads of 2 and 4 are not raised here
        mgr.roots[0].writer.join()
        mgr.roots[-1].writer.wait_idle()
    assert "save of step 2 failed" in caplog.text
    assert mgr.step_tiers() == {s: ("local",) for s in (5, 4, 3, 2, 1)}
    with pytest.raises(CheckpointError, match="step 2") as ei:
        mgr.join()
    assert ei.value.step == 2
    mgr.storage.fs.clear()
    mgr.save(6, state(6))  # the bucket is back: the next upload goes through
    assert mgr.step_tiers()[6] == ("local", "persistent")
    mgr.close()
    with CheckpointManager(path) as plain:
        assert plain.all_steps() == [6]


def test_a_long_outage_keeps_a_bounded_number_of_deferred_failures():
    from async_ckpt.jobs.write_queue import MAX_KEPT_ERRORS, WriteQueue

    w = WriteQueue(1, defer_errors=True)

    def fail():
        raise OSError("down")

    for s in range(MAX_KEPT_ERRORS + 50):
        w.wait_for_slot()  # a deferred failure is not raised here
        w.submit(fail, step=s)
    w.wait_idle()
    assert len(w._errors) == MAX_KEPT_ERRORS
    with pytest.raises(CheckpointError, match=r"step 0 failed.*more failed save") as ei:
        w.close()
    assert str(MAX_KEPT_ERRORS + 49) in str(ei.value)  # the newest failure is still named


@pytest.mark.parametrize("end", ["join", "close"])
def test_join_and_close_raise_every_tier_s_failure_not_only_the_first(roots, end):
    """Both tiers' writes of a step fail: the bucket's failure must not be dropped when the
    local one is raised (a second join() would then pass as if the upload had worked)."""
    from async_ckpt.errors import CheckpointError

    path, local = roots
    mgr = CheckpointManager("faulty://" + path, local_dir="faulty://" + local)
    mgr.roots[0].store.storage.fs.inject("write", "*.distcp", "enospc")  # the local disk is full
    mgr.storage.fs.inject("write", "*.distcp", "http403")  # the bucket refuses the upload
    mgr.save_async(1, state(1))
    with pytest.raises(CheckpointError) as info:
        getattr(mgr, end)()
    assert "No space left on device" in str(info.value) and "403 injected: Forbidden" in str(info.value)
    mgr.close()


def test_after_a_failed_upload_restore_and_promote_work_and_join_still_raises(roots):
    path, local = roots
    mgr = CheckpointManager("faulty://" + path, local_dir=local)
    mgr.storage.fs.inject("write", "*.distcp", "http403")  # the bucket refuses the upload
    mgr.save_async(1, state(1))
    out = zeros()
    assert mgr.restore(None, out) == 1  # the failed upload is not the restore's error
    assert_bitwise_equal(out, state(1))
    mgr.storage.fs.clear()
    mgr.promote(1)  # the repair: the local copy goes up
    assert mgr.step_tiers() == {1: ("local", "persistent")}
    with pytest.raises(CheckpointError, match="Forbidden"):
        mgr.join()
    mgr.close()


def test_a_bucket_unreachable_at_its_first_save_does_not_stop_the_local_save(roots, caplog):
    """The lease of the bucket is taken at its first due save: a vanished bucket (a raw
    FileNotFoundError from the lock file) is deferred like a failed upload, the step goes to
    the local tier, and the lease is tried again at the next step due for the bucket."""
    path, local = roots
    mgr = CheckpointManager(path, save_interval=5, local_dir=local, local_policy=2, local_retention=10)
    shutil.rmtree(path)  # the bucket's mount went away before the first upload
    with caplog.at_level(logging.ERROR, logger="async_ckpt"):
        for s in range(4, 7):
            assert mgr.save_async(s, state(s))  # 5 is due for the bucket only: saved locally
    assert "save of step 5 failed" in caplog.text
    mgr.roots[0].writer.join()
    assert mgr.step_tiers() == {6: ("local",), 5: ("local",), 4: ("local",)}
    with pytest.raises(StorageError, match=r"step 5: the checkpoint path .*bucket cannot be reached") as ei:
        mgr.join()
    assert ei.value.step == 5
    os.makedirs(path)  # the bucket is back: the next step due for it takes the lease and commits
    mgr.save(10, state(10))
    assert mgr.step_tiers()[10] == ("local", "persistent")
    mgr.close()


def test_a_preemption_save_while_the_bucket_is_down_is_taken_locally(roots):
    import signal

    path, local = roots
    mgr = CheckpointManager(path, save_interval=100, local_dir=local, local_policy=1, chkpt_on_preemption=True,
                            preemption_signals=[signal.SIGUSR1], preemption_sync="signal")
    mgr.save(1, state(1))
    shutil.rmtree(path)
    mgr.trigger_preemption()
    assert mgr.save_async(2, state(2))
    assert mgr.reached_preemption(2)
    mgr.roots[0].writer.join()
    assert mgr.step_tiers() == {2: ("local",), 1: ("local",)}
    with pytest.raises(StorageError, match="step 2"):
        mgr.close()
    with CheckpointManager(local) as m:
        out = zeros()
        assert m.restore(None, out) == 2
    assert_bitwise_equal(out, state(2))


def test_without_a_local_tier_an_unreachable_bucket_raises_a_storage_error_naming_it(roots):
    path, _ = roots
    mgr = CheckpointManager(path)
    shutil.rmtree(path)
    with pytest.raises(StorageError, match=f"the checkpoint path {path} cannot be reached") as ei:
        mgr.save_async(1, state(1))
    assert isinstance(ei.value.__cause__, FileNotFoundError)
    mgr.close()


def test_bucket_that_cannot_be_listed_restores_from_local_with_a_warning(roots):
    from async_ckpt.errors import StorageError

    path, local = roots
    path = "faulty://" + path
    with CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1) as mgr:
        for s in range(1, 4):
            mgr.save(s, state(s))
    mgr = CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1)
    mgr.storage.fs.inject("ls", "*", "http403")  # listing the bucket is refused
    out = zeros()
    with pytest.warns(RuntimeWarning, match=r"persistent tier .* cannot be listed"):
        assert mgr.restore(None, out) == 3
    assert_bitwise_equal(out, state(3))
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        assert mgr.all_steps() == [2, 3]
    # a named step only the unlistable bucket might hold: the bucket's error, not "not found"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(StorageError, match="Forbidden"):
            mgr.restore(1, zeros())
    mgr.storage.fs.clear()
    mgr.close()
    # without a local tier to fall back on, the listing error is raised
    plain = CheckpointManager(path)
    plain.storage.fs.inject("ls", "*", "http403")
    with pytest.raises(StorageError, match="Forbidden"):
        plain.restore(None, zeros())
    plain.storage.fs.clear()
    plain.close()


def test_an_unlistable_bucket_and_an_empty_local_tier_raise_the_listing_error(roots):
    """A fresh node (empty local_dir) and a bucket that is down: 'no checkpoint' would make the
    job start from scratch (and its saves' retention later drop the bucket's real steps)."""
    path, local = roots
    path = "faulty://" + path
    with CheckpointManager(path) as plain:
        plain.save(1, state(1))
    mgr = CheckpointManager(path, local_dir=local)
    mgr.storage.fs.inject("ls", "*", "http403")  # the client's HTTP error, as gcsfs raises one
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        with pytest.raises(StorageError, match="Forbidden"):
            mgr.restore(None, zeros())
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        with pytest.raises(StorageError, match="Forbidden"):
            mgr.latest_step()
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        with pytest.raises(StorageError, match="Forbidden"):
            mgr.all_steps()
    mgr.storage.fs.clear()
    out = zeros()
    assert mgr.restore(None, out) == 1
    assert_bitwise_equal(out, state(1))
    mgr.close()


def test_metrics_while_the_bucket_is_down_come_from_the_local_tier(roots):
    path, local = roots
    bucket = "faulty://" + path
    with CheckpointManager(bucket, save_interval=2, local_dir=local, local_policy=1) as mgr:
        for s in range(1, 4):
            mgr.save(s, state(s), metrics={"loss": float(s)})
    mgr = CheckpointManager(bucket, save_interval=2, local_dir=local, local_policy=1)
    for op in ("ls", "read"):  # the bucket is down
        mgr.storage.fs.inject(op, "*", "reset")
    with pytest.warns(RuntimeWarning, match=r"persistent tier .* cannot be read"):
        assert mgr.metrics(3) == {"loss": 3.0}
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        with pytest.raises(StorageError, match="connection reset"):
            mgr.metrics(1)  # only the bucket may hold it: its error, not "not found"
    mgr.storage.fs.clear()
    mgr.close()


@pytest.mark.parametrize("blip", [True, False])
def test_a_bucket_manifest_that_does_not_read_while_listing_does_not_pass_over_newer_local_steps(roots, monkeypatch,
                                                                                                blip):
    """Step 5's bucket manifest fails to read while the bucket is listed (``blip``: only
    then): it is read once more, else ordered after every copy whose time is known."""
    path, local = roots
    with CheckpointManager(path, save_interval=5, local_dir=local, local_policy=1) as mgr:
        for s in range(1, 8):
            mgr.save(s, state(s))
    mgr = CheckpointManager(path, save_interval=5, local_dir=local, local_policy=1)
    listing = {"on": False}
    real_read, real_infos = mgr.layout.read_manifest, mgr.roots[-1].store.catalog.infos

    def read(step, *a, **k):
        if step == 5 and (listing["on"] or not blip):
            raise StorageError("read manifest: 503")
        return real_read(step, *a, **k)

    def infos():
        listing["on"] = True
        try:
            return real_infos()
        finally:
            listing["on"] = False

    monkeypatch.setattr(mgr.layout, "read_manifest", read)
    monkeypatch.setattr(mgr.roots[-1].store.catalog, "infos", infos)
    assert list(mgr.step_tiers()) == [7, 6, 5]
    out = zeros()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # step 5 is not tried (and skipped) first
        assert mgr.restore(None, out) == 7
    assert_bitwise_equal(out, state(7))
    monkeypatch.undo()
    mgr.close()


def test_a_long_outage_raises_every_failed_upload_not_only_the_first(roots):
    """Three due saves while the bucket is gone: join() raises the first failure's type and
    step, and its message names the other failed steps (they are raised once, here)."""
    path, local = roots
    mgr = CheckpointManager(path, save_interval=5, local_dir=local, local_policy=1, local_retention=10)
    shutil.rmtree(path)
    for s in (5, 10, 15):
        mgr.save_async(s, state(s))
    with pytest.raises(StorageError, match=r"step 5: .*cannot be reached.*and 2 more failed save\(s\): steps \[10, 15\]"
                       ) as ei:
        mgr.join()
    assert ei.value.step == 5 and isinstance(ei.value.__cause__, StorageError)
    mgr.join()  # each failure is raised once
    mgr.close()


def test_the_stats_log_of_local_saves_does_not_re_create_a_vanished_bucket(roots):
    """Logging the local saves' statistics must not make the bucket's directory again: the
    uploads of 5 and 10 would then go into that new directory as if nothing happened."""
    path, local = roots
    mgr = CheckpointManager(path, save_interval=5, local_dir=local, local_policy=1, stats_log=True)
    shutil.rmtree(path)  # the bucket's mount went away
    for s in range(1, 11):
        mgr.save_async(s, state(s))
    mgr.roots[0].writer.join()
    assert not os.path.exists(path)
    with pytest.raises(StorageError, match=r"step 5: .*cannot be reached.*steps \[10\]"):
        mgr.join()
    assert not os.path.exists(path)
    mgr.close()
