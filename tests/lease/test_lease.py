"""One live writer per root, and managers that only read never get in its way.

Also: a manager used in a forked child fails clearly, a raising ``on_saved`` never fails a
committed save, and a garbage-collected manager stops its threads.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from async_ckpt import CheckpointManager, LeaseHeldError
from async_ckpt.storage import Storage
from async_ckpt.storage.lease import LEASE_NAME, ObjectStoreLease

from ..conftest import assert_bitwise_equal, small_state, target_like
from ..support.paths import REPO


def test_a_second_writer_is_refused_naming_the_holder(root):
    # the holder is busy (a save in flight): an idle manager of this process would be taken over
    committed, gate = threading.Event(), threading.Event()
    a = CheckpointManager(root, on_saved=lambda s: (committed.set(), gate.wait(30)))
    a.save_async(1, small_state(1))
    assert committed.wait(30)
    b = CheckpointManager(root)  # constructing, listing and restoring need no lease
    assert b.all_steps() == [1]
    b.restore(1, target_like(small_state(0)))
    with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()}") as ei:
        b.save(2, small_state(2))
    assert ei.value.holder and str(os.getpid()) in ei.value.holder
    with pytest.raises(LeaseHeldError):
        b.delete(1)
    assert b.all_steps() == [1]
    gate.set()
    a.close()  # releases the lease
    assert b.save(2, small_state(2))
    assert b.all_steps() == [1, 2]
    b.close()


def test_lease_timeout_waits_for_the_holder(root):
    a = CheckpointManager(root)
    a.save(1, small_state(1))
    threading.Timer(0.3, a.close).start()
    b = CheckpointManager(root, lease_timeout=20)
    assert b.save(2, small_state(2))
    b.close()


def test_a_reader_never_touches_a_live_writers_files(root, tmp_path):
    writer = CheckpointManager(root, max_to_keep=2)
    writer.save(1, small_state(1))
    st = Storage(root)
    # what looks like debris to a reader: a writer's step in flight (temp and unmarked dirs)
    for name in (".tmp-2-0123456789ab", "3"):
        st.makedirs(st.join(name))
        st.write_bytes(st.join(name, "__0_0.distcp"), b"being written")
        st.write_bytes(st.join(name, ".async_ckpt_pending"), b"")
    before = sorted(e["name"] for e in st.listdir(st.root))
    for _ in range(3):
        r = CheckpointManager(root)
        r.restore(None, target_like(small_state(0)))
        r.close()
    assert sorted(e["name"] for e in st.listdir(st.root)) == before
    writer.close()


def test_an_expired_object_store_lease_is_taken_over(memory_root):
    st = Storage(memory_root)
    st.makedirs(st.root)
    st.write_bytes(st.join(LEASE_NAME), json.dumps(
        {"host": "elsewhere", "pid": 1, "token": "t", "expires": time.time() - 1}).encode())
    mgr = CheckpointManager(memory_root)
    assert mgr.save(1, small_state(1))  # the dead writer's lease expired
    mgr.close()
    assert not st.exists(st.join(LEASE_NAME))  # released at close


def test_a_live_object_store_lease_is_refused_with_its_expiry(memory_root):
    st = Storage(memory_root)
    st.makedirs(st.root)
    st.write_bytes(st.join(LEASE_NAME), json.dumps(
        {"host": "elsewhere", "pid": 1, "token": "t", "expires": time.time() + 600}).encode())
    mgr = CheckpointManager(memory_root)
    with pytest.raises(LeaseHeldError, match="pid 1 on elsewhere.*expires in"):
        mgr.save(1, small_state(1))
    assert mgr.all_steps() == []
    mgr.close()


def test_a_dead_local_holder_of_an_object_store_lease_is_taken_over(memory_root):
    st = Storage(memory_root)
    st.makedirs(st.root)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    import socket

    st.write_bytes(st.join(LEASE_NAME), json.dumps(
        {"host": socket.gethostname(), "pid": int(dead), "token": "t", "expires": time.time() + 600}).encode())
    mgr = CheckpointManager(memory_root)
    assert mgr.save(1, small_state(1))
    mgr.close()


def test_the_object_store_lease_heartbeat_renews_and_detects_a_takeover(memory_root):
    st = Storage(memory_root)
    st.makedirs(st.root)
    now = [0.0]  # the lease's monotonic clock; its heartbeat thread beats every 10 s of real time
    lease = ObjectStoreLease(st, ttl_s=30, clock=lambda: now[0])
    lease.acquire()
    first = json.loads(st.read_bytes(lease.path))["expires"]
    now[0] = 10.0  # one heartbeat period later
    assert lease.beat()
    assert json.loads(st.read_bytes(lease.path))["expires"] > first  # renewed
    now[0] = 30.0  # the TTL after acquiring, 20 s after the renewal: only the renewal keeps it
    lease.check()
    st.write_bytes(lease.path, json.dumps({"host": "h", "pid": 2, "token": "other",
                                           "expires": time.time() + 60}).encode())
    assert not lease.beat()
    with pytest.raises(LeaseHeldError, match="taken over"):
        lease.check()
    lease.release()
    assert json.loads(st.read_bytes(lease.path))["token"] == "other"  # not ours: left alone


_READER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[3])
    from async_ckpt import CheckpointManager
    root, stop = sys.argv[1], sys.argv[2]
    n = 0
    open(stop + ".ready", "w").close()
    while not os.path.exists(stop):
        m = CheckpointManager(root, commit_mode=sys.argv[4])
        m.all_steps()
        m.close()
        n += 1
    print(n)
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rename", "marker"])
def test_readers_opening_a_live_root_never_fail_its_writer(tmp_path, mode):
    """Issue 17's first case: process B opens and closes managers on A's root while A saves
    (max_to_keep=2): no save of A fails and every committed step restores."""
    root, stop = str(tmp_path / "ckpt"), str(tmp_path / "stop")
    os.makedirs(root)
    reader = subprocess.Popen([sys.executable, "-c", _READER, root, stop, REPO, mode],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PJRT_DEVICE": "CPU"})
    try:
        deadline = time.time() + 120
        while not os.path.exists(stop + ".ready") and time.time() < deadline:
            time.sleep(0.05)  # the reader has imported torch and starts looping
        mgr = CheckpointManager(root, max_to_keep=2, commit_mode=mode)
        failed = 0
        for step in range(200):
            try:
                mgr.save(step, small_state(step))
            except Exception:
                failed += 1
        mgr.close()
    finally:
        open(stop, "w").close()
        out, _ = reader.communicate(timeout=60)
    assert int(out.strip()) > 0  # the reader really ran alongside
    assert failed == 0
    check = CheckpointManager(root)
    assert check.all_steps() == [198, 199]
    for s in check.all_steps():
        t = target_like(small_state(0))
        check.restore(s, t)
        assert_bitwise_equal(t, small_state(s))
    check.close()


# ---- fork, on_saved, garbage collection -----------------------------------------------------

_FORK = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    import torch
    from async_ckpt import CheckpointError, CheckpointManager
    mgr = CheckpointManager(sys.argv[1])
    mgr.save(1, {"w": torch.ones(4)})
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a hang is a failure
        codes = []
        for call in (lambda: mgr.save_async(2, {"w": torch.ones(4)}), lambda: mgr.save(3, {"w": torch.ones(4)}),
                     lambda: mgr.restore(1, {"w": torch.zeros(4)}), mgr.join, mgr.close):
            try:
                call()
                codes.append("ok")
            except CheckpointError as exc:
                codes.append("forked" if "forked child" in str(exc) else "other")
        print(",".join(codes), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    mgr.save(4, {"w": torch.ones(4)})  # the parent goes on
    print(mgr.all_steps(), flush=True)
    mgr.close()
""")


def test_a_manager_used_in_a_forked_child_raises(tmp_path):
    out = subprocess.run([sys.executable, "-c", _FORK, str(tmp_path / "ckpt"), REPO],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split()
    assert lines[0] == "forked,forked,forked,forked,forked", out.stdout
    assert "[1," in out.stdout and "4]" in out.stdout


def test_a_raising_on_saved_does_not_fail_the_save_or_stop_retention(root, caplog):
    def boom(stats):
        raise RuntimeError("callback bug")

    mgr = CheckpointManager(root, max_to_keep=1, on_saved=boom)
    with caplog.at_level(logging.ERROR, logger="async_ckpt"):
        assert mgr.save(1, small_state(1))
        assert mgr.save(2, small_state(2))
        mgr.join()
    assert mgr.all_steps() == [2]  # committed, and retention ran
    assert [r for r in caplog.records if "on_saved" in r.getMessage() and r.levelno == logging.ERROR]
    mgr.close()


def test_an_unclosed_manager_stops_its_threads_when_collected(tmp_path):
    gc.collect()
    before = {t.ident for t in threading.enumerate()}
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    mgr.save(1, small_state(1))
    del mgr
    gc.collect()
    deadline = time.time() + 10
    while time.time() < deadline:
        extra = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("async-ckpt")]
        if not extra:
            break
        time.sleep(0.05)
    assert not extra, [t.name for t in extra]


# ---- an object-store lease that lapsed (issue 25, item 2) -----------------------------------

def _expire_lease_object(st: Storage) -> None:
    """What the others see once the holder's heartbeat stopped renewing for the TTL."""
    cur = json.loads(st.read_bytes(st.join(LEASE_NAME)))
    st.write_bytes(st.join(LEASE_NAME), json.dumps({**cur, "expires": time.time() - 1}).encode())


def test_a_writer_whose_lease_lapsed_neither_commits_nor_deletes(memory_root):
    """A saves 1; A's lease is not renewed for the TTL; B takes it over and saves 2
    (max_to_keep=1); A's save of 3 raises LeaseHeldError and deletes nothing of B's."""
    st = Storage(memory_root)
    now = [1000.0]
    a = CheckpointManager(memory_root, max_to_keep=1)
    a.roots[-1].store.lease.clock = lambda: now[0]  # A's monotonic clock: no real sleeping
    assert a.save(1, small_state(1))
    now[0] += a.roots[-1].store.lease.ttl_s + 1  # A's heartbeat could not renew (a partition, a suspended process)
    _expire_lease_object(st)
    b = CheckpointManager(memory_root, max_to_keep=1)
    assert b.save(2, small_state(2))
    assert b.all_steps() == [2]
    with pytest.raises(LeaseHeldError):
        a.save(3, small_state(3))
    with pytest.raises(LeaseHeldError):
        a.delete(2)
    assert Storage(memory_root).exists(st.join("2"))
    r = CheckpointManager(memory_root)
    assert r.all_steps() == [2]
    t = target_like(small_state(0))
    r.restore(2, t)
    assert_bitwise_equal(t, small_state(2))
    b.close()
    a.close()


def test_a_queued_save_whose_lease_lapsed_before_its_commit_is_not_committed(memory_root):
    """The lease was valid when the save was queued and lapsed before its commit: the commit
    itself proves the lease (LeaseHeldError of that step) and the successor's steps stay."""
    st = Storage(memory_root)
    now = [1000.0]
    committed, gate = threading.Event(), threading.Event()

    def hold(stats):
        if stats.step == 1:
            committed.set()
            gate.wait(30)

    a = CheckpointManager(memory_root, max_to_keep=1, max_pending_async=2, on_saved=hold)
    a.roots[-1].store.lease.clock = lambda: now[0]
    assert a.save_async(1, small_state(1))  # committed, then its on_saved holds A's writer thread
    assert a.save_async(2, small_state(2))  # queued under a valid lease
    assert committed.wait(30)
    now[0] += a.roots[-1].store.lease.ttl_s + 1
    _expire_lease_object(st)
    b = CheckpointManager(memory_root, max_to_keep=1)
    assert b.save(5, small_state(5))
    gate.set()
    with pytest.raises(LeaseHeldError) as ei:
        a.join()
    assert ei.value.step == 2
    assert b.all_steps() == [5]
    t = target_like(small_state(0))
    b.restore(5, t)
    assert_bitwise_equal(t, small_state(5))
    b.close()
    a.close()


def test_a_writer_that_takes_its_lapsed_lease_again_forgets_its_last_step(memory_root):
    """A (incremental, an object-store lease) saves 1; its lease lapses; another writer takes
    the root, saves step 1 again with other values and leaves; A's next save takes the lease
    again: it must not take the files now under step 1's name for its own unchanged tensors."""
    import torch

    mine = {"w": torch.full((1 << 16,), 1.0), "b": torch.arange(1 << 16, dtype=torch.float32)}
    theirs = {"w": torch.full((1 << 16,), 2.0), "b": torch.zeros(1 << 16)}
    now = [1000.0]
    a = CheckpointManager(memory_root, incremental=True)
    lease = a.roots[-1].store.lease
    lease.clock = lambda: now[0]  # A's monotonic clock: no real sleeping
    assert a.save(1, mine)
    now[0] += lease.ttl_s + 1  # A's heartbeat could not renew (a partition, a suspended process)
    _expire_lease_object(Storage(memory_root))
    # another process's writer (the same root spelled otherwise: not a manager of this process to take over)
    other = CheckpointManager(memory_root.replace("memory://", "memory:///"))
    other.delete(1)  # e.g. a run that rolled back: step 1 is gone, then saved anew under its name
    assert other.save(1, theirs)
    other.close()
    assert a.save(2, mine)  # takes the lease again: step 1 is not what A saved any more
    a.close()
    r = CheckpointManager(memory_root)
    t = target_like(mine)
    assert r.restore(2, t) == 2
    assert_bitwise_equal(t, mine)
    t = target_like(theirs)
    assert r.restore(1, t) == 1
    assert_bitwise_equal(t, theirs)
    r.close()


def test_the_lease_check_tolerates_one_missed_beat_but_not_the_ttl(memory_root):
    st = Storage(memory_root)
    st.makedirs(st.root)
    now = [0.0]
    lease = ObjectStoreLease(st, ttl_s=30, clock=lambda: now[0])
    lease.acquire()
    now[0] += 20  # the heartbeat renews every 10 s: one failed beat
    lease.check()
    now[0] += 3  # 23 s >= 3/4 of the TTL: another host's clock may already see it expired
    with pytest.raises(LeaseHeldError, match="last renewed 23.0 s ago"):
        lease.check()
    lease.release()


# ---- a dropped manager releases its lease at once (issue 25, item 10) ----------------------

def test_dropping_the_last_reference_releases_the_lease_without_a_cyclic_gc(root, tmp_path):
    import weakref

    gc.collect()
    gc.disable()
    try:
        mgr = CheckpointManager(root, 10, max_to_keep=3, stats_log=True, local_dir=str(tmp_path / "local"))
        mgr.save(0, small_state(0))
        ref = weakref.ref(mgr)
        del mgr
        assert ref() is None  # no reference cycle through the manager
        other = CheckpointManager(root, 10, max_to_keep=3)
        assert other.save(10, small_state(10))  # the lease was released by the finalizer
        assert other.all_steps() == [0, 10]
        other.close()
    finally:
        gc.enable()


def test_a_busy_manager_of_this_process_keeps_its_lease(root):
    gate = threading.Event()
    first = CheckpointManager(root, on_saved=lambda s: gate.wait(30))
    first.save_async(1, small_state(1))  # still in flight: its on_saved holds the writer
    second = CheckpointManager(root)
    with pytest.raises(LeaseHeldError, match="in flight: close"):
        second.save(2, small_state(2))
    gate.set()
    first.close()
    assert second.save(2, small_state(2))
    assert second.all_steps() == [1, 2]
    second.close()


def test_a_renewal_that_lands_after_the_lease_could_be_taken_over_proves_nothing(tmp_path):
    """A heartbeat write that hung until after the TTL (then landed) must not count as a
    renewal: a successor may have taken the lease meanwhile, and the late write just
    overwrote its lease object. Crediting it left both writers passing check() (both
    committing and deleting) for up to a twelfth of the TTL."""
    url = "faulty://" + str(tmp_path / "ckpt")  # one root, seen by two storages: A's hangs on request
    st_a, st_b = Storage(url), Storage(url)
    st_a.makedirs(st_a.root)
    now = [0.0]  # A's monotonic clock; its heartbeat thread beats every 10 s of real time
    a = ObjectStoreLease(st_a, ttl_s=30.0, clock=lambda: now[0])
    a.acquire()  # renewed at 0 (A's clock)
    stuck = st_a.fs.inject("write", LEASE_NAME, "hang", times=1)  # the network hangs on A's renewal
    now[0] = 10.0
    beats = []
    beat = threading.Thread(target=lambda: beats.append(a.beat()))
    beat.start()
    assert stuck.reached.wait(30)  # that beat's write (issued at 10.0) hangs
    now[0] = 30.1  # past the TTL of A's last landed renewal: the others may take the lease
    _expire_lease_object(st_b)
    b = ObjectStoreLease(st_b, ttl_s=30.0)
    b.acquire()
    b.check()
    stuck.release.set()  # A's renewal lands now, 20.1 s after it was issued (over B's lease object)
    beat.join(30)
    assert beats == [False]  # the late renewal proves nothing: the lease is lost
    with pytest.raises(LeaseHeldError):
        a.check()  # it may not commit or delete: B holds the root
    a.release()
    b.release()


def test_cli_prune_proves_the_lease_before_every_delete(monkeypatch, capsys, memory_root):
    """``async-ckpt prune`` took the lease once and then deleted step after step: a prune
    whose lease lapsed meanwhile (slow deletions, a suspended process) went on deleting
    under a writer that took the root over. Each deletion must prove the lease first."""
    from async_ckpt.cli import main
    from async_ckpt.cli import verify as cli_verify
    from async_ckpt.storage.step_dirs import StepDirectories

    m = CheckpointManager(memory_root)
    for s in range(1, 5):
        assert m.save(s, small_state(s))
    m.close()
    now = [0.0]
    monkeypatch.setattr(cli_verify, "writer_lease",
                        lambda storage: ObjectStoreLease(storage, clock=lambda: now[0]))
    real_delete = StepDirectories.delete

    def slow_delete(self, step):
        real_delete(self, step)
        now[0] += 100.0  # this deletion outlasted the TTL: the lease can no longer be proven

    monkeypatch.setattr(StepDirectories, "delete", slow_delete)
    assert main(["prune", memory_root, "--keep-last", "1"]) == 2  # an error (LeaseHeldError), one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lease" in err, err
    assert CheckpointManager(memory_root).all_steps() == [2, 3, 4]  # the first deletion only
