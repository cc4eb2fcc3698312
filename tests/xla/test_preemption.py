"""Preemption: opt-in signal handler (chained), reached_preemption, torch_xla's sync point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from async_ckpt import CheckpointError, CheckpointManager

from ..conftest import assert_bitwise_equal
from ..support.paths import REPO


def sd(step: int):
    return {"w": torch.arange(256, dtype=torch.float32) * step, "step": torch.tensor(step)}


def wait_for(cond, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.005)


def test_no_handler_unless_asked(ckpt_dir):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    with CheckpointManager(ckpt_dir) as mgr:
        assert {s: signal.getsignal(s) for s in before} == before
        assert not mgr.reached_preemption(3)
        with pytest.raises(CheckpointError, match="chkpt_on_preemption"):
            mgr.trigger_preemption()
    with pytest.raises(ValueError, match="needs chkpt_on_preemption"):
        CheckpointManager(ckpt_dir, preemption_signals=(signal.SIGUSR1,))


def test_bad_preemption_arguments(ckpt_dir):
    with pytest.raises(ValueError, match="cannot be caught"):
        CheckpointManager(ckpt_dir, chkpt_on_preemption=True, preemption_signals=(signal.SIGKILL,))
    with pytest.raises(TypeError, match="signal numbers"):
        CheckpointManager(ckpt_dir, chkpt_on_preemption=True, preemption_signals=("TERM",))
    with pytest.raises(ValueError, match="empty"):
        CheckpointManager(ckpt_dir, chkpt_on_preemption=True, preemption_signals=(), preemption_sync="signal")
    with pytest.raises(ValueError, match="preemption_sync"):
        CheckpointManager(ckpt_dir, chkpt_on_preemption=True, preemption_sync="tpu")
    with pytest.raises(ValueError, match="sync point"):
        CheckpointManager(ckpt_dir, chkpt_on_preemption=True, preemption_signals=(signal.SIGUSR1,),
                          preemption_sync="xla")


def test_handler_only_from_the_main_thread(ckpt_dir):
    before = signal.getsignal(signal.SIGUSR1)
    errors = []

    def make():
        try:
            CheckpointManager(ckpt_dir, chkpt_on_preemption=True, preemption_signals=(signal.SIGUSR1,),
                              preemption_sync="signal")
        except CheckpointError as exc:
            errors.append(exc)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0])
    assert signal.getsignal(signal.SIGUSR1) == before


def test_signal_is_chained_and_triggers_one_save(ckpt_dir):
    calls = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: calls.append(s))
    try:
        mgr = CheckpointManager(ckpt_dir, 1000, chkpt_on_preemption=True, preemption_signals=(signal.SIGUSR1,),
                                preemption_sync="signal")
        other = CheckpointManager(ckpt_dir + "-other", 1000, chkpt_on_preemption=True,
                                  preemption_signals=(signal.SIGUSR1,), preemption_sync="signal")
        assert not mgr.save_async(5, sd(5))
        assert not mgr.reached_preemption(5)
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: calls)
        assert calls == [signal.SIGUSR1]  # the handler that was there before still ran, once
        assert mgr.should_save(6)  # torch_xla's loop shape asks first
        assert mgr.save_async(6, sd(6))  # not on the interval: taken because of the preemption
        assert mgr.reached_preemption(6)
        assert not mgr.save_async(7, sd(7))  # one preemption checkpoint, then the policy again
        assert mgr.reached_preemption(7)
        assert other.save_async(40, sd(40)) and other.reached_preemption(40)
        other.close()
        mgr.close()
        assert signal.getsignal(signal.SIGUSR1) is not None
        assert CheckpointManager(ckpt_dir).all_steps() == [6]
        target = {"w": torch.zeros(256), "step": torch.tensor(0)}
        CheckpointManager(ckpt_dir).restore(6, target)
        assert_bitwise_equal(sd(6), target)
    finally:
        restored = signal.signal(signal.SIGUSR1, previous)
    assert restored is not None and restored.__name__ == "<lambda>"  # close() put ours back in place


def test_signal_between_save_and_reached_preemption_saves_on_the_next_step(ckpt_dir):
    with CheckpointManager(ckpt_dir, 1000, chkpt_on_preemption=True, preemption_signals=(signal.SIGUSR2,),
                           preemption_sync="signal") as mgr:
        assert not mgr.save_async(5, sd(5))
        mgr.trigger_preemption()  # arrives after step 5's save decision
        assert not mgr.reached_preemption(5)  # exiting now would lose steps 1-5
        assert mgr.save_async(6, sd(6))
        assert mgr.reached_preemption(6)
    assert CheckpointManager(ckpt_dir).all_steps() == [6]


def test_reached_preemption_first_then_forced_save(ckpt_dir):
    """Orbax's loop shape: ask first, then save with force=True and exit."""
    with CheckpointManager(ckpt_dir, 1000, chkpt_on_preemption=True, preemption_signals=(signal.SIGUSR2,),
                           preemption_sync="signal") as mgr:
        for step in range(1, 4):
            assert not mgr.reached_preemption(step)
        mgr.trigger_preemption()
        assert mgr.reached_preemption(4)
        assert mgr.save(4, sd(4), force=True)
        assert not mgr.save_async(5, sd(5))
    assert CheckpointManager(ckpt_dir).all_steps() == [4]


CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch
    from async_ckpt import CheckpointManager

    root, mode = sys.argv[1], sys.argv[2]
    chained = []
    if mode == "signal":
        signal.signal(signal.SIGTERM, lambda s, f: chained.append(s))  # the job's own handler
    mgr = CheckpointManager(root, save_interval=10**9, chkpt_on_preemption=True, preemption_sync=mode)
    for step in range(1, 10**7):
        state = {"w": torch.arange(256, dtype=torch.float32) * step, "step": torch.tensor(step)}
        took = mgr.save_async(step, state)
        if step == 3:
            print("READY", flush=True)
        if mgr.reached_preemption(step):
            mgr.join()
            print(f"PREEMPTED {step} {took} {chained}", flush=True)
            mgr.close()
            sys.exit(0)
        time.sleep(0.002)
    sys.exit(3)
    """
)


def _preempt_child(tmp_path, mode):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = str(tmp_path / "ckpt")
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script), root, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "READY", (line, proc.stderr.read() if proc.poll() is not None else "")
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    words = out.split()
    assert words[0] == "PREEMPTED", out
    step = int(words[1])
    assert words[2] == "True", out  # the preemption step itself was saved
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [step]  # nothing on the interval: only the preemption checkpoint
        target = {"w": torch.zeros(256), "step": torch.tensor(0)}
        assert mgr.restore(None, target) == step
    assert_bitwise_equal(sd(step), target)
    return step, out


def test_sigterm_to_a_training_process_saves_and_exits(tmp_path):
    step, out = _preempt_child(tmp_path, "signal")
    assert step >= 3
    assert f"[{int(signal.SIGTERM)}]" in out  # the job's own SIGTERM handler was chained


@pytest.mark.xla
def test_sigterm_with_torch_xla_sync_point(tmp_path):
    pytest.importorskip("torch_xla")
    step, _ = _preempt_child(tmp_path, "xla")
    assert step >= 3
