"""Crash consistency: training processes SIGKILLed at random moments never lose or corrupt a
committed step.

One fork server (tests/crash_worker.py) imports torch once; each trial forks a real process
that resumes from the newest committed step and saves every step with ``save_async`` (with
retention, so deletions get interrupted too) until it is SIGKILLed after a random delay.
After every kill a fresh manager in this process must:

* list only committed steps (each one restores and equals, bit for bit, the state of that step);
* restore the newest committed step with no damaged step skipped, and that step must be at
  least the newest one the killed process reported committed (nothing committed is lost);
* after its background cleanup, leave no incomplete directory behind.

A third of the trials use the POSIX rename commit, a third the object-store marker commit on
local files, and a third the marker commit through fsspec (``faulty://`` from
tests/faulty_fs.py with no fault injected: the code path of gs:// and s3://, over local files).
Some trials roll back to an older step first (re-saving steps that exist), and half of them
leave the debris for the next process's startup cleanup, which then runs while that process
saves. Seeds are printed (``-s`` or on failure); set ASYNC_CKPT_CRASH_SEED to
replay a sequence of delays.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings

import pytest

from async_ckpt import CheckpointManager

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from crash_worker import MAX_TO_KEEP, empty_like_state, make_state, states_equal  # noqa: E402
import faulty_fs  # noqa: E402,F401  (registers faulty://)

TRIALS = 36


def _disk_view(root: str):
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    marked = sorted(int(n) for n in names if n.isdigit() and os.path.exists(os.path.join(root, n, "COMMITTED")))
    return names, marked


def _local(root: str) -> str:
    return root[len("faulty://"):] if root.startswith("faulty://") else root


def _verify(root: str, mode: str, floor: int, what: str, rng: random.Random) -> int:
    """Checks after a kill; returns the newest committed step."""
    mgr = CheckpointManager(root, commit_mode=mode, keep_incomplete=True)
    try:
        steps = mgr.all_steps()
        names, marked = _disk_view(_local(root))
        assert steps == marked, f"{what}: listed {steps}, but committed on disk: {marked} ({names})"
        assert steps, f"{what}: nothing committed"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            target = empty_like_state()
            got = mgr.restore(None, target)
        skipped = [str(w.message) for w in caught if "skipping damaged" in str(w.message)]
        assert not skipped, f"{what}: restore(None) skipped damaged steps: {skipped}"
        assert got == steps[-1], f"{what}: restore(None) gave {got}, newest committed is {steps[-1]}"
        assert got >= floor, f"{what}: newest committed step {got} < {floor}, which had committed: a step was lost"
        assert states_equal(target, make_state(got)), f"{what}: step {got} restored with wrong contents"
        for s in steps[:-1]:  # every listed step verifies; one of them (at random) is restored
            mgr.layout.read_manifest(s)
        if len(steps) > 1:
            s = rng.choice(steps[:-1])
            t = empty_like_state()
            assert mgr.restore(s, t) == s
            assert states_equal(t, make_state(s)), f"{what}: step {s} restored with wrong contents"
    finally:
        mgr.close()
    return got


@pytest.fixture
def fork_server(tmp_path):
    err = open(tmp_path / "worker.stderr", "w")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "crash_worker.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err, text=True, cwd=HERE)

    def ask(spec):
        proc.stdin.write(json.dumps(spec) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"crash worker died; stderr:\n{open(tmp_path / 'worker.stderr').read()[-4000:]}"
        return json.loads(line)

    ready = proc.stdout.readline()
    assert ready.startswith('{"ready"'), f"crash worker failed to start:\n{open(tmp_path / 'worker.stderr').read()[-4000:]}"
    yield ask
    proc.stdin.close()
    proc.wait(timeout=60)
    err.close()


def test_sigkill_at_random_moments_never_loses_a_committed_step(fork_server, tmp_path):
    master = int(os.environ.get("ASYNC_CKPT_CRASH_SEED", random.SystemRandom().randrange(2**31)))
    print(f"crash trials: ASYNC_CKPT_CRASH_SEED={master}")
    roots = {"rename": str(tmp_path / "rename"), "marker": str(tmp_path / "marker"),
             "fsspec": "faulty://" + str(tmp_path / "fsspec")}
    latest = {name: None for name in roots}
    log, commits = [], []
    for i in range(TRIALS):
        seed = master * 1000 + i
        rng = random.Random(seed)
        kind = ("rename", "marker", "fsspec")[i % 3]
        mode = "rename" if kind == "rename" else "marker"
        root = roots[kind]
        # A quarter of the kills land early (startup, resume, cleanup, first commit).
        delay = rng.uniform(0.0, 0.12) if rng.random() < 0.25 else rng.uniform(0.12, 0.9)
        replay = latest[kind] is not None and rng.random() < 0.3
        spec = {"dir": root, "mode": mode, "delay": round(delay, 4), "replay": replay}
        out = fork_server(spec)
        what = f"trial {i} (seed {seed}, {kind}, delay {delay:.3f}s, replay {replay})"
        log.append(f"{what}: committed {out['committed'][:1]}..{out['committed'][-1:]} resumed {out['resumed']}")
        print(log[-1])
        commits.append(len(out["committed"]))
        assert out["status"] == "killed", f"{what}: the training process did not survive to be killed: {out['error']}"
        assert out["resume_ok"] in (None, True), f"{what}: the process resumed step {out['resumed']} with wrong contents"
        floor = max(out["committed"], default=-1)
        if out["resumed"] is not None:
            floor = max(floor, out["resumed"])
        if not replay and latest[kind] is not None:
            floor = max(floor, latest[kind])  # a plain resume never goes below the previous newest
        if latest[kind] is None and not out["committed"]:
            names, marked = _disk_view(_local(root))
            assert not marked, f"{what}: {marked} committed but the process never reported a commit"
            continue  # killed before the first commit: nothing to restore yet
        latest[kind] = _verify(root, mode, floor, what, rng)
        if (i // 3) % 2 == 0:  # clean up now; otherwise the next process's startup cleanup does it
            mgr = CheckpointManager(root, commit_mode=mode, max_to_keep=MAX_TO_KEEP)
            mgr.close()  # waits for the background cleanup
            names, marked = _disk_view(_local(root))
            assert names == sorted(str(s) for s in marked), f"{what}: debris left after cleanup: {names}"
            assert mgr.layout.incomplete() == []
            assert mgr.all_steps() == marked and marked[-1] == latest[kind], f"{what}: cleanup changed {marked}"
    print("\n".join(log))
    print(f"crash trials: {len(log)} kills; {sum(commits)} steps committed by the killed processes, "
          f"{sum(1 for c in commits if c)} trials with at least one commit; newest steps {latest}")
    assert len(log) == TRIALS
