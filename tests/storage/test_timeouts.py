"""Storage that stops answering or is down: every storage call is bounded in time, a stalled
or failed upload is logged and raised by join()/close(), and with a local tier the training
loop never waits for the bucket (issue 25, items 7 and 8)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from async_ckpt import CheckpointManager
from async_ckpt.errors import CheckpointError, StorageTimeoutError
from async_ckpt.storage import RetryPolicy
from async_ckpt.storage.step_dirs import ABORT_WAIT_S

from ..conftest import assert_bitwise_equal
from ..support.storage_servers import FakeGCSServer
from ..tiers.test_tiers import state, zeros


def finishes_within(seconds: float, fn: Callable[[], Any]) -> tuple:
    """Run ``fn`` on a daemon thread; (finished in time, what it raised or None, elapsed)."""
    out: list = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive()), (out[0] if out else None), time.monotonic() - t0


# ---- a filesystem with no timeouts of its own ------------------------------------------------

class HangingFS(MemoryFileSystem):
    """``hang://``: fsspec's memory filesystem whose uploads of data files never return once
    ``hang`` is set (a generic fsspec backend without a timeout option)."""

    protocol = "hang"
    hang = threading.Event()
    release = threading.Event()

    def pipe_file(self, path: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if self.hang.is_set() and path.endswith(".distcp"):
            self.release.wait()
        return super().pipe_file(path, value, *args, **kwargs)

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if self.hang.is_set() and "w" in mode and path.endswith(".distcp"):
            self.release.wait()
        return super().open(path, mode, *args, **kwargs)


fsspec.register_implementation("hang", HangingFS, clobber=True)


@pytest.fixture
def hanging() -> Iterator[type]:
    HangingFS.hang.clear()
    HangingFS.release.clear()
    HangingFS.store.clear()
    HangingFS.pseudo_dirs.clear()
    HangingFS.pseudo_dirs.append("")
    yield HangingFS
    HangingFS.release.set()  # let abandoned calls end
    HangingFS.hang.clear()


def test_a_filesystem_without_timeouts_that_hangs_fails_the_save_within_the_deadline(hanging):
    mgr = CheckpointManager("hang://run", retry=RetryPolicy(deadline=2.0))
    mgr.save(1, state(1))
    hanging.hang.set()
    assert mgr.save_async(2, state(2))
    done, exc, took = finishes_within(30, mgr.join)
    assert done, "join() did not return: the hung upload was waited for without a bound"
    assert isinstance(exc, CheckpointError) and exc.step == 2, exc
    assert isinstance(exc.__cause__ or exc, StorageTimeoutError) or "did not finish within 2s" in str(exc)
    assert took < 2.0 + ABORT_WAIT_S + 5
    done, exc, _ = finishes_within(30, mgr.close)
    assert done and exc is None
    hanging.hang.clear()
    with CheckpointManager("hang://run") as again:
        assert again.all_steps() == [1]
        out = zeros(1)
        assert again.restore(None, out) == 1
    assert_bitwise_equal(out, state(1))


def test_retry_policy_rejects_bad_timeouts():
    with pytest.raises(ValueError, match="deadline"):
        RetryPolicy(deadline=0)
    with pytest.raises(ValueError, match="request_timeout"):
        RetryPolicy(request_timeout=-1)
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


# ---- a real GCS emulator that stops answering or goes away ------------------------------------

@pytest.fixture
def stoppable(own_gcs_server: FakeGCSServer) -> Iterator[FakeGCSServer]:
    """The server; ``freeze()`` SIGSTOPs it (a black hole: connections are accepted by the
    kernel, nothing is ever answered); it is let go again at the end of the test."""
    server = own_gcs_server

    def freeze() -> None:
        os.kill(server.proc.pid, signal.SIGSTOP)

    server.freeze = freeze  # type: ignore[attr-defined]
    yield server
    if server.proc is not None:
        os.kill(server.proc.pid, signal.SIGCONT)


FAST = RetryPolicy(request_timeout=1.0, deadline=4.0)


def test_a_bucket_that_stops_answering_fails_the_upload_and_join_and_close_return(stoppable, caplog):
    bucket = stoppable.new_bucket()
    mgr = CheckpointManager(bucket.url, storage_options=bucket.storage_options, retry=FAST)
    mgr.save(1, state(1))
    stoppable.freeze()
    with caplog.at_level(logging.ERROR, logger="async_ckpt"):
        assert mgr.save_async(2, state(2))
        done, exc, took = finishes_within(60, mgr.join)
    assert done, "join() did not return while the bucket was not answering"
    assert isinstance(exc, CheckpointError) and exc.step == 2, exc
    assert took < FAST.deadline + ABORT_WAIT_S + 10
    done, _, _ = finishes_within(60, mgr.close)
    assert done, "close() did not return while the bucket was not answering"


def test_with_a_local_tier_a_silent_bucket_never_blocks_the_loop(stoppable, caplog, tmp_path):
    bucket = stoppable.new_bucket()
    local = str(tmp_path / "local")
    mgr = CheckpointManager(bucket.url, storage_options=bucket.storage_options, retry=FAST, save_interval=2,
                            local_dir=local, local_policy=1, local_retention=20)
    mgr.save(2, state(2))
    stoppable.freeze()
    worst = 0.0
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        for s in range(3, 12):
            t0 = time.monotonic()
            assert mgr.save_async(s, state(s))
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.2)
        done, exc, _ = finishes_within(60, mgr.join)
    assert worst < 2.0, f"a save_async call blocked {worst:.1f}s on the silent bucket"
    assert done, "join() did not return while the bucket was not answering"
    assert isinstance(exc, CheckpointError) and exc.step == 4, exc
    assert "save of step 4 failed" in caplog.text
    assert mgr.skipped_uploads and set(mgr.skipped_uploads) <= {6, 8, 10}
    assert sorted(mgr.step_tiers()) == list(range(2, 12))
    assert any(st.extra.get("upload_skipped") for st in mgr.stats)
    assert "is not uploaded" in caplog.text
    for s in (5, 11):  # the local saves went on, and restore bitwise
        out = zeros(s)
        assert mgr.restore(s, out) == s
        assert_bitwise_equal(out, state(s))
    done, _, _ = finishes_within(60, mgr.close)
    assert done, "close() did not return while the bucket was not answering"


def test_with_a_local_tier_a_bucket_that_is_down_fails_each_upload_within_the_deadline(stoppable, caplog, tmp_path):
    bucket = stoppable.new_bucket()
    local = str(tmp_path / "local")
    policy = RetryPolicy(deadline=4.0)
    mgr = CheckpointManager(bucket.url, storage_options=bucket.storage_options, retry=policy, save_interval=3,
                            local_dir=local, local_policy=1, local_retention=20)
    mgr.save(3, state(3))
    stoppable.stop()  # connection refused from now on
    worst = 0.0
    logged_at = None
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        t_up = None
        for s in range(4, 16):
            t0 = time.monotonic()
            assert mgr.save_async(s, state(s))
            if s == 6:
                t_up = t0
            worst = max(worst, time.monotonic() - t0)
            if logged_at is None and "save of step 6 failed" in caplog.text:
                logged_at = time.monotonic()
            time.sleep(0.5)
        deadline = time.monotonic() + 60
        while logged_at is None and time.monotonic() < deadline:
            if "save of step 6 failed" in caplog.text:
                logged_at = time.monotonic()
            time.sleep(0.1)
        done, exc, _ = finishes_within(60, mgr.join)
    assert worst < 2.0, f"a save_async call blocked {worst:.1f}s on the down bucket"
    assert logged_at is not None, "the failed upload of step 6 was not logged"
    assert logged_at - t_up < policy.deadline + ABORT_WAIT_S + 3, logged_at - t_up
    assert done and isinstance(exc, CheckpointError) and exc.step == 6, exc
    assert mgr.skipped_uploads, "no bucket save was skipped while the upload of step 6 ran"
    assert "is not uploaded" in caplog.text
    for s in (7, 15):  # the local saves went on, and restore bitwise
        out = zeros(s)
        assert mgr.restore(s, out) == s
        assert_bitwise_equal(out, state(s))
    done, _, _ = finishes_within(60, mgr.close)
    assert done


def test_with_a_local_tier_a_forced_save_waits_for_a_busy_upload_instead_of_skipping(hanging, tmp_path, caplog):
    """A busy upload makes a plain save_async skip the bucket (saved locally only); a forced
    save (typically a run's last) is never skipped: it waits its turn and reaches the bucket."""
    mgr = CheckpointManager("hang://run", local_dir=str(tmp_path / "local"), local_policy=1, save_interval=1,
                            retry=RetryPolicy(deadline=30.0))
    try:
        mgr.save(1, state(1))
        hanging.hang.set()
        assert mgr.save_async(2, state(2))  # its upload hangs and holds the bucket's slot
        with caplog.at_level(logging.WARNING, logger="async_ckpt"):
            assert mgr.save_async(3, state(3))  # skipped for the bucket
        assert mgr.skipped_uploads == [3]
        skipped = [r.getMessage() for r in caplog.records if "is not uploaded" in r.getMessage()]
        assert skipped and skipped[0].startswith("step 3 is not uploaded to hang://")  # one prefix: the logger's name
        threading.Timer(1.0, hanging.release.set).start()  # the hung upload goes through in 1 s
        done, exc, took = finishes_within(30, lambda: mgr.save_async(4, state(4), force=True))
        assert done and exc is None and took >= 0.5, (done, exc, took)  # it waited for the slot
        mgr.join()
        assert mgr.skipped_uploads == [3]
        assert "persistent" in mgr.step_tiers()[4]
    finally:
        hanging.release.set()
        mgr.close()
    with CheckpointManager("hang://run") as again:
        out = zeros(1)
        assert again.restore(4, out) == 4
    assert_bitwise_equal(out, state(4))
