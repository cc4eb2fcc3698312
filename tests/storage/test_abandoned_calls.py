"""A storage call that outlives its deadline is abandoned, not stopped: the caller raises
``StorageTimeoutError`` and goes on while the call's thread may still finish later (a trickling
bucket). What that thread may still do must never reach memory the caller has given back:
a timed-out read must not write into the caller's tensors or into host buffers the pool hands to
the next save, and a timed-out write must not read buffers the next save staged into.

Faults through ``faulty://`` (tests/support/faulty_fs.py): a read or write held (``hang``) past the
retry deadline, then let go.
"""

from __future__ import annotations

import os
import struct
import threading
import time

import pytest
import torch

from async_ckpt import CheckpointError, CheckpointManager
from async_ckpt.storage import RetryPolicy

from ..conftest import assert_bitwise_equal

N = 1 << 20  # 4 MiB of float32: read into and written from the tensors themselves (no record template)


def state(v: float) -> dict:
    return {"w": torch.full((N,), v)}


def _storage_calls() -> int:
    return sum(t.name == "async-ckpt-storage-call" and t.is_alive() for t in threading.enumerate())


def _abandoned_calls_end(leave: int = 0, timeout: float = 30.0) -> None:
    """Wait until at most ``leave`` storage calls of this process run on their helper threads
    (those the test still holds)."""
    deadline = time.monotonic() + timeout
    while _storage_calls() > leave:
        assert time.monotonic() < deadline, "an abandoned storage call never ended"
        time.sleep(0.02)


@pytest.fixture
def saved(tmp_path):
    """A faulty:// root holding step 1 (all ones)."""
    url = f"faulty://{tmp_path}/ckpt"
    with CheckpointManager(url) as mgr:
        assert mgr.save(1, state(1.0))
    return url


def test_a_timed_out_restore_writes_nothing_into_the_state_dict_after_it_raised(saved):
    mgr = CheckpointManager(saved, retry=RetryPolicy(deadline=1.0))
    stuck = mgr.storage.fs.inject("read", "*.distcp", "hang", times=1)
    target = state(0.0)
    with pytest.raises(CheckpointError, match="did not finish within"):
        mgr.restore(1, target)
    target["w"].fill_(7.0)  # the caller's tensor again, once restore raised
    stuck.release.set()  # the bucket answers at last: the abandoned read completes
    _abandoned_calls_end()
    assert_bitwise_equal(target, state(7.0))
    t = state(0.0)
    assert mgr.restore(1, t) == 1  # and the next restore reads it whole
    assert_bitwise_equal(t, state(1.0))
    mgr.close()


def test_a_timed_out_atomic_restore_never_writes_into_the_next_saves_buffers(saved):
    mgr = CheckpointManager(saved, retry=RetryPolicy(deadline=2.0))
    fs = mgr.storage.fs
    read = fs.inject("read", "*.distcp", "hang", times=1)
    with pytest.raises(CheckpointError, match="did not finish within"):
        mgr.restore(1, state(0.0), atomic=True)  # read into pooled host buffers, given back on failure
    write = fs.inject("mkdir", "2", "hang", times=1)
    try:
        assert mgr.save_async(2, state(2.0))  # staged into the pool's buffers; its write waits
        assert write.reached.wait(30)
        read.release.set()  # the abandoned read of step 1 completes now
        _abandoned_calls_end(leave=1)  # (the held write's call still runs)
    finally:
        write.release.set()
        read.release.set()
    mgr.join()
    t = state(0.0)
    assert mgr.restore(2, t) == 2
    assert_bitwise_equal(t, state(2.0))
    mgr.close()


def test_a_timed_out_write_never_reads_the_buffers_of_the_next_save(tmp_path):
    url = f"faulty://{tmp_path}/ckpt"
    mgr = CheckpointManager(url, retry=RetryPolicy(deadline=1.0))
    fs = mgr.storage.fs
    stuck = fs.inject("write", "*.distcp", "hang", times=1)
    fs.inject("rm", "*.distcp", "eacces")  # the failed step's files stay where they are, to be looked at
    try:
        assert mgr.save_async(1, state(1.0))
        with pytest.raises(CheckpointError, match="did not finish within"):
            mgr.join()
        assert mgr.save(2, state(2.0))  # staged while step 1's write still holds its buffers
        stuck.release.set()  # step 1's abandoned write goes on
        _abandoned_calls_end()
    finally:
        stuck.release.set()
    fs.clear()
    left = os.path.join(tmp_path, "ckpt", "1", "__0_0.distcp")
    data = open(left, "rb").read() if os.path.exists(left) else b""
    assert struct.pack("<f", 2.0) * 64 not in data, "the abandoned write of step 1 wrote step 2's bytes"
    t = state(0.0)
    assert mgr.restore(2, t) == 2
    assert_bitwise_equal(t, state(2.0))
    mgr.close()
