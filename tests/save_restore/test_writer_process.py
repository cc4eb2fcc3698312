"""The writer process (``writer="process"``): a save's local files written by a process of its
own from shared-memory staging buffers.

What must hold: the files are byte for byte those the writer thread writes; a save restores
bitwise; the process's death fails the save in flight with a typed error, commits nothing,
loses nothing committed, and the next save starts a new process; the process ends with its
training process (even a ``SIGKILL``-ed one) and ignores a Ctrl-C meant for the job; a forked
child writes through a process of its own; items outside shared memory are written by the
thread in the same save; shared buffers are freed with the pool.
"""

from __future__ import annotations

import ast
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from async_ckpt import CheckpointError, CheckpointManager, WriterProcessError
from async_ckpt.staging.pool import HostBufferPool

from ..conftest import assert_bitwise_equal
from ..support.paths import REPO

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the writer process needs Linux")

FILES_KEY = "writer_process_files"


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layer{i}.w": torch.randn(300, 200, generator=g) for i in range(6)},
        "small": {f"b{i}": torch.randn(17, generator=g).to(torch.bfloat16) for i in range(40)},
        "ints": torch.arange(1000, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "view": torch.arange(100.0)[10:20],
        "transposed": torch.randn(40, 30, generator=g).t(),
        # views of more or less than a storage's bytes, without a record template (torch.save renders them)
        "expanded": torch.randn(1, 50, generator=g, dtype=torch.float64).to(torch.complex128).expand(3, 50),
        "every_other": torch.arange(100.0)[::2],
        "nested": [torch.ones(3), {"k": torch.zeros(2, dtype=torch.int32)}],
        "step": 7, "name": "run", "cfg": {"lr": 0.1, "betas": (0.9, 0.99)},
    }


def _zeros(x):
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    if isinstance(x, dict):
        return {k: _zeros(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_zeros(v) for v in x]
    return x


def _files(step_dir: str):
    out = {}
    for name in sorted(os.listdir(step_dir)):
        if name.endswith(".distcp") or name == ".metadata":
            with open(os.path.join(step_dir, name), "rb") as f:
                out[name] = f.read()
    return out


def test_the_writer_process_writes_the_files_the_thread_writes_and_they_restore_bitwise(tmp_path):
    sd = _state()
    for writer in ("process", "thread"):
        with CheckpointManager(str(tmp_path / writer), writer=writer) as mgr:
            mgr.save(1, sd)
            mgr.save_async(2, sd)
            mgr.join()
            written = mgr.stats[-1].extra.get(FILES_KEY, 0)
            data_files = [n for n in os.listdir(str(tmp_path / writer / "2")) if n.endswith(".distcp")]
            assert written == (len(data_files) if writer == "process" else 0) and data_files
            for step in (1, 2):
                target = _zeros(sd)
                target["name"], target["cfg"], target["step"] = "", {}, 0
                assert mgr.restore(step, target) == step
                assert_bitwise_equal(target, sd)
    assert _files(str(tmp_path / "process" / "2")) == _files(str(tmp_path / "thread" / "2"))


def test_the_writer_process_s_death_fails_the_save_in_flight_and_the_next_save_starts_a_new_one(tmp_path):
    sd = _state()
    root = str(tmp_path / "c")
    with CheckpointManager(root, writer="process") as mgr:
        mgr.save(1, sd)
        proc = mgr.writer_process
        pid, started = proc.pid, proc.started
        os.kill(pid, signal.SIGSTOP)  # the next save's job waits in the process, then it dies
        try:
            mgr.save_async(2, sd)
            time.sleep(0.5)
        finally:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(CheckpointError, match="step 2 failed: WriterProcessError: .*signal SIGKILL") as ei:
            mgr.join()
        assert isinstance(ei.value.__cause__, WriterProcessError) and ei.value.step == 2
        assert mgr.all_steps() == [1]
        mgr.save(3, _state(3))  # a new process
        assert proc.started == started + 1 and proc.pid not in (None, pid)
        for step, want in ((1, sd), (3, _state(3))):
            target = _zeros(want)
            target["name"], target["cfg"], target["step"] = "", {}, 0
            mgr.restore(step, target)
            assert_bitwise_equal(target, want)


_ORPHAN = textwrap.dedent("""
    import os, signal, sys, torch
    from async_ckpt import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], writer="process")
    mgr.save(1, {"w": torch.ones(10)})
    print(mgr.writer_process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_the_writer_process_ends_with_a_sigkilled_training_process(tmp_path):
    out = subprocess.run([sys.executable, "-c", _ORPHAN, str(tmp_path / "c")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the writer process outlived its training process"


def test_a_ctrl_c_for_the_job_does_not_stop_the_writer_process(tmp_path):
    with CheckpointManager(str(tmp_path / "c"), writer="process") as mgr:
        mgr.save(1, {"w": torch.ones(10)})
        pid = mgr.writer_process.pid
        os.kill(pid, signal.SIGINT)
        time.sleep(0.3)
        assert _alive(pid)
        mgr.save(2, {"w": torch.full((10,), 2.0)})
        assert mgr.writer_process.pid == pid


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_through_a_writer_process_of_its_own(tmp_path):
    with CheckpointManager(str(tmp_path / "parent"), writer="process") as mgr:
        mgr.save(1, {"w": torch.ones(10)})
        parent_writer = mgr.writer_process.pid
        r, w = os.pipe()
        child = os.fork()
        if child == 0:  # the child: its own manager, its own writer process
            code = 1
            try:
                with CheckpointManager(str(tmp_path / "child"), writer="process") as cm:
                    cm.save(1, {"w": torch.full((10,), 3.0)})
                    os.write(w, str(cm.writer_process.pid).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        _, status = os.waitpid(child, 0)
        child_writer = int(os.read(r, 64) or b"0")
        os.close(r)
        assert os.waitstatus_to_exitcode(status) == 0
        assert child_writer not in (0, parent_writer)
        mgr.save(2, {"w": torch.full((10,), 2.0)})  # the parent's process still serves it
        assert mgr.writer_process.pid == parent_writer
    got = {"w": torch.zeros(10)}
    CheckpointManager(str(tmp_path / "child")).restore(1, got)
    assert torch.equal(got["w"], torch.full((10,), 3.0))


def test_items_outside_shared_memory_are_written_by_the_thread_in_the_same_save(tmp_path):
    """Declared-frozen tensors left uncopied are the user's own memory: their file is written
    by the thread writer, the others by the process, and the step restores bitwise."""
    g = torch.Generator().manual_seed(1)
    base = {f"base{i}": torch.randn(256, 256, generator=g) for i in range(4)}
    sd = {"model": {**base, "head": torch.randn(64, generator=g)}}
    frozen = [f"model.base{i}" for i in range(4)]
    with CheckpointManager(str(tmp_path / "c"), writer="process", incremental=True, frozen=frozen) as mgr:
        mgr.save(1, sd)
        sd["model"]["head"].add_(1.0)
        mgr.save(2, sd)
        st = mgr.stats[-1]
        assert st.extra.get(FILES_KEY, 0) >= 1
        target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}
        mgr.restore(2, target)
        assert_bitwise_equal(target, sd)


def test_shared_staging_buffers_are_freed_with_the_pool():
    pool = HostBufferPool(shared=True)
    lease = pool.acquire([1000, 3 << 20])
    blocks = lease.shared_blocks()
    assert len(blocks) == 2
    fds = [b.segment.fd for b in blocks]
    assert len(set(fds)) == 1  # both in one segment
    lease.buffers[1][:10] = 7
    del blocks
    lease.release()
    pool.clear()
    del lease
    gc.collect()
    assert not any(os.path.exists(f"/proc/self/fd/{fd}") and "memfd:async_ckpt_staging" in os.readlink(f"/proc/self/fd/{fd}")
                   for fd in fds)
    with open("/proc/self/maps") as f:
        assert "async_ckpt_staging" not in f.read()


def test_writer_option_is_checked():
    from async_ckpt import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="writer must be one of"):
        CheckpointManager("unused", writer="fork")


def test_incremental_saves_share_the_same_files_whichever_process_hashes(tmp_path):
    """Incremental saves: the writer process hashes the staged tensors (XXH3-128, off the
    training process's GIL); the shares, the bytes written and the files are those of the
    thread writer, which hashes them itself."""
    g = torch.Generator().manual_seed(2)
    base = {f"p{i}": torch.randn(128, 256, generator=g) for i in range(6)}
    steps = {}
    for writer in ("process", "thread"):
        sd = {"model": {k: v.clone() for k, v in base.items()}}
        with CheckpointManager(str(tmp_path / writer), writer=writer, incremental=True) as mgr:
            for step in range(4):
                sd["model"][f"p{step}"].add_(1.0)
                mgr.save(step, sd)
            steps[writer] = [(s.written_bytes, s.referred_bytes) for s in list(mgr.stats)[-4:]]
            assert steps[writer][-1][1] > 0  # later steps share what did not change
            assert (mgr.stats[-1].extra.get(FILES_KEY, 0) > 0) == (writer == "process")
    assert steps["process"] == steps["thread"]
    assert _files(str(tmp_path / "process" / "3")) == _files(str(tmp_path / "thread" / "3"))


_IN_HOSTILE_CWD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])  # this checkout (python -I: no PYTHONPATH, no working directory)
    import torch
    from async_ckpt import CheckpointManager
    sd = {"w": torch.arange(50000, dtype=torch.float32), "n": 3}
    with CheckpointManager(sys.argv[2], writer="process") as mgr:
        mgr.save(1, sd)
        written = mgr.stats[-1].extra.get("writer_process_files", 0)
        target = {"w": torch.zeros(50000), "n": 0}
        mgr.restore(1, target)
    assert torch.equal(target["w"], sd["w"]) and target["n"] == 3 and written >= 1, written
    print("ok")
""")


def test_the_writer_process_imports_nothing_from_the_job_s_working_directory(tmp_path):
    """A ``random.py``, ``queue.py`` ... beside the job (run with ``python -I``) is never
    executed by the writer process: the save is written there and restores."""
    cwd = tmp_path / "job"
    cwd.mkdir()
    marker = tmp_path / "imported"
    for name in ("random", "queue", "signal", "copy", "uuid", "platform", "struct", "threading", "mmap"):
        (cwd / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write('{name} ')\n"
                                        f"raise ImportError('the job directory\\'s {name}.py was imported')\n")
    checkout = REPO
    out = subprocess.run([sys.executable, "-I", "-c", _IN_HOSTILE_CWD, checkout, str(tmp_path / "c")], cwd=str(cwd),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert not marker.exists(), marker.read_text()


def test_a_job_wide_preemption_signal_leaves_the_writer_process_writing(tmp_path):
    """Slurm and systemd signal every process of a job: the writer process (a process group of
    its own) ignores SIGTERM, SIGUSR1, SIGUSR2, SIGHUP and SIGINT, sent while it writes; the save
    in flight and the next (the preemption checkpoint) both commit, by the same process."""
    g = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(16)}  # 32 MiB: a while to write
    with CheckpointManager(str(tmp_path / "c"), writer="process") as mgr:
        mgr.save(1, {"w": torch.ones(10)})
        pid = mgr.writer_process.pid
        mgr.save_async(2, sd)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT):
            os.killpg(pid, sig)  # its whole process group, as a scheduler does
        mgr.save_async(3, sd)
        mgr.join()
        assert _alive(pid) and mgr.writer_process.pid == pid
        assert mgr.all_steps() == [1, 2, 3]
        for step in (2, 3):
            target = {k: torch.zeros_like(v) for k, v in sd.items()}
            mgr.restore(step, target)
            assert_bitwise_equal(target, sd)


def test_a_writer_process_that_died_between_saves_costs_no_save(tmp_path):
    """A writer process killed after a save, before anyone noticed: the next save is sent to a
    new process and commits (none of it had reached the dead one)."""
    sd = {"w": torch.randn(300, 300)}
    with CheckpointManager(str(tmp_path / "c"), writer="process") as mgr:
        for step in range(1, 6):
            mgr.save(step, sd)
            os.kill(mgr.writer_process.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while mgr.writer_process.pid is not None and time.monotonic() < deadline:
                time.sleep(0.01)  # dead before the next save (a kill as the job is sent costs that save)
        assert mgr.all_steps() == [1, 2, 3, 4, 5]
        target = {"w": torch.zeros(300, 300)}
        mgr.restore(5, target)
        assert_bitwise_equal(target, sd)


_PYTHON_GONE = textwrap.dedent("""
    import logging, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from async_ckpt import CheckpointManager
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("async_ckpt").addHandler(handler)
    sys.executable = sys.argv[3]  # the virtualenv rebuilt under a long run: its python is gone
    sd = {"w": torch.arange(50000, dtype=torch.float32)}
    with CheckpointManager(sys.argv[2], writer="process") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, sd)
        target = {"w": torch.zeros(50000)}
        mgr.restore(3, target)
        assert torch.equal(target["w"], sd["w"]) and mgr.all_steps() == [1, 2, 3]
        assert mgr.writer_process.pid is None
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    print(repr(warned))
""")


def test_a_writer_process_that_cannot_start_leaves_saves_to_the_thread_writer_with_one_warning(tmp_path):
    checkout = REPO
    gone = str(tmp_path / "venv" / "bin" / "python")
    out = subprocess.run([sys.executable, "-c", _PYTHON_GONE, checkout, str(tmp_path / "c"), gone],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    warned = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert len(warned) == 1, warned
    assert "the writer process cannot be started" in warned[0] and gone in warned[0]
    assert "writer thread" in warned[0]


_MANY_TENSORS = textwrap.dedent("""
    import os, resource, sys
    sys.path.insert(0, sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    import torch
    from async_ckpt import CheckpointManager, shared_memory
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(32768, generator=g) for i in range(5000)}  # 5,000 tensors of 128 KiB
    with CheckpointManager(sys.argv[2], writer="process") as mgr:
        for step in (1, 2):
            mgr.save(step, sd)
        assert mgr.stats[-1].extra.get("writer_process_files", 0) >= 1
        open_fds = len(os.listdir("/proc/self/fd"))
        files = [open(os.devnull) for _ in range(200)]  # the user can still open files
        for f in files:
            f.close()
        target = {k: torch.zeros(32768) for k in sd}
        mgr.restore(2, target)
        assert all(torch.equal(target[k], sd[k]) for k in sd)
        print(open_fds, shared_memory.segments())
""")


def test_thousands_of_staged_tensors_take_a_few_descriptors(tmp_path):
    """5,000 tensors of 128 KiB under ``ulimit -n 1024``: the saves go through the writer
    process, and the process keeps descriptors to open files (staging memory is a few shared
    segments, not one memfd per buffer)."""
    checkout = REPO
    out = subprocess.run([sys.executable, "-c", _MANY_TENSORS, checkout, str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    open_fds, segments = map(int, out.stdout.split()[-2:])
    assert segments <= 16 and open_fds < 200, (open_fds, segments)
