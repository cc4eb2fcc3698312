"""Crash consistency: training processes SIGKILLed at random moments never lose or corrupt a
committed step.

One fork server (tests/workers/crash_worker.py) imports torch once; each trial forks a real process
that resumes from the newest committed step and saves every step with ``save_async`` (with
retention, so deletions get interrupted too) until it is SIGKILLed after a random delay.
After every kill a fresh manager in this process must:

* list only committed steps (each one restores and equals, bit for bit, the state of that step);
* restore the newest committed step with no damaged step skipped, and that step must be at
  least the newest one the killed process reported committed (nothing committed is lost);
* after its background cleanup, leave no incomplete directory behind.

A third of the trials use the POSIX rename commit, a third the object-store marker commit on
local files, and a third the marker commit through fsspec (``faulty://`` from
tests/support/faulty_fs.py with no fault injected: the code path of gs:// and s3://, over local files).
Some trials roll back to an older step first (re-saving steps that exist), and half of them
leave the debris for the next process's startup cleanup, which then runs while that process
saves. Seeds are printed (``-s`` or on failure); set ASYNC_CKPT_CRASH_SEED to
replay a sequence of delays.
"""

from __future__ import annotations

import os
import random
import re
import warnings

import pytest

from async_ckpt import CheckpointManager

from ..support import faulty_fs, fork_trials  # noqa: F401  (faulty_fs registers faulty://)
from ..workers.crash_worker import MAX_TO_KEEP, empty_like_state, make_state, resave_value, states_equal

TRIALS = 36


_COPY = re.compile(r"^(\d+)$|^(\d+)\.[0-9a-f]{12}$|^\.tmp-(\d+)-[0-9a-f]+$")  # dirs that can hold a commit


def _disk_view(root: str):
    """(entries but the lease files, committed steps, names of the directories holding them)."""
    names = sorted(n for n in os.listdir(root) if not n.startswith(".async_ckpt.")) if os.path.isdir(root) else []
    copies = [n for n in names if _COPY.match(n) and os.path.exists(os.path.join(root, n, "COMMITTED"))]
    marked = sorted({int(next(g for g in _COPY.match(n).groups() if g)) for n in copies})
    return names, marked, copies


def _local(root: str) -> str:
    return root[len("faulty://"):] if root.startswith("faulty://") else root


def _verify(root: str, mode: str, newest: "set[int]", floor: int, what: str, rng: random.Random) -> int:
    """Checks after a kill; returns the newest committed step, which must be one of ``newest``
    (the last commit the killed process reported, or a step it started after that) and >= floor."""
    mgr = CheckpointManager(root, commit_mode=mode, keep_incomplete=True)
    try:
        steps = mgr.all_steps()
        names, marked, _ = _disk_view(_local(root))
        assert steps == marked, f"{what}: listed {steps}, but committed on disk: {marked} ({names})"
        assert steps, f"{what}: nothing committed"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            target = empty_like_state()
            got = mgr.restore(None, target)
        skipped = [str(w.message) for w in caught if "skipping damaged" in str(w.message)]
        assert not skipped, f"{what}: restore(None) skipped damaged steps: {skipped}"
        assert got == mgr.latest_step(), f"{what}: restore(None) gave {got}, latest is {mgr.latest_step()}"
        assert got in newest, (f"{what}: the newest commit is {got}, expected one of {sorted(newest)[:5]}...; "
                               f"commit order {mgr.steps_in_commit_order()}, on disk {names}")
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
    with fork_trials.fork_server(tmp_path, "crash_worker.py") as ask:
        yield ask


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
        # The newest commit after the kill: the last one reported, or a step started after it
        # (committed, killed before it was reported); with no commit reported in this trial, the
        # previous newest or a step this trial started. A replay re-saves existing steps.
        if out["committed"]:
            last = out["committed"][-1]
            newest = {last} | set(out["started"][out["started"].index(last):])
        else:  # any step this trial started (a replay re-saves existing steps) or the previous newest
            newest = set(out["started"]) | ({latest[kind]} if latest[kind] is not None else set())
        floor = -1 if replay else max(out["committed"] + [latest[kind] if latest[kind] is not None else -1])
        if latest[kind] is None and not out["committed"]:
            names, marked, _ = _disk_view(_local(root))
            assert not marked or set(marked) <= set(out["started"]), f"{what}: {marked} committed, never started"
            if not marked:
                continue  # killed before the first commit: nothing to restore yet
        latest[kind] = _verify(root, mode, newest, floor,
                               f"{what} (started {out['started'][:3]}..{out['started'][-3:]}, resumed {out['resumed']})", rng)
        if (i // 3) % 2 == 0:  # clean up now; otherwise the next process's startup cleanup does it
            mgr = CheckpointManager(root, commit_mode=mode, max_to_keep=MAX_TO_KEEP)
            mgr.roots[-1].store.become_writer()  # what a first save does: take the lease, recover, clean up
            mgr.close()  # waits for the background cleanup
            names, marked, copies = _disk_view(_local(root))
            assert names == sorted(copies) and len(copies) == len(marked), f"{what}: debris after cleanup: {names}"
            assert mgr.layout.incomplete() == []
            assert mgr.all_steps() == marked and mgr.latest_step() == latest[kind], f"{what}: cleanup changed {marked}"
    print("\n".join(log))
    print(f"crash trials: {len(log)} kills; {sum(commits)} steps committed by the killed processes, "
          f"{sum(1 for c in commits if c)} trials with at least one commit; newest steps {latest}")
    assert len(log) == TRIALS


@pytest.mark.parametrize("kind", ["rename", "marker", "fsspec"])
def test_sigkill_during_resaves_of_a_step_never_loses_it(fork_server, tmp_path, kind):
    """A process re-saves an existing step over and over (two states, alternating) and is
    SIGKILLed at a random moment: the step is still committed and holds the state of the last
    re-save it reported, or of the one after it; the other steps are untouched."""
    master = int(os.environ.get("ASYNC_CKPT_CRASH_SEED", random.SystemRandom().randrange(2**31)))
    print(f"re-save trials: ASYNC_CKPT_CRASH_SEED={master}")
    mode = "rename" if kind == "rename" else "marker"
    root = "faulty://" + str(tmp_path / "fsspec") if kind == "fsspec" else str(tmp_path / kind)
    with CheckpointManager(root, commit_mode=mode) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
    allowed = {2}
    commits = 0
    for i in range(10):
        rng = random.Random(master * 1000 + i)
        delay = round(rng.uniform(0.05, 0.7), 4)
        out = fork_server({"dir": root, "mode": mode, "delay": delay, "resave": 2})
        what = f"re-save trial {i} (seed {master * 1000 + i}, {kind}, delay {delay}s)"
        assert out["status"] == "killed", f"{what}: {out['error']}"
        if out["committed"]:
            last = out["committed"][-1]
            allowed = {resave_value(2, last), resave_value(2, last + 1)}
            commits += len(out["committed"])
        else:
            allowed = allowed | {resave_value(2, 0)}
        mgr = CheckpointManager(root, commit_mode=mode, keep_incomplete=True)
        try:
            assert mgr.all_steps() == [1, 2], f"{what}: listed {mgr.all_steps()}"
            t = empty_like_state()
            assert mgr.restore(2, t) == 2
            got = [v for v in sorted(allowed) if states_equal(t, make_state(v))]
            assert got, f"{what}: step 2 holds none of the states {sorted(allowed)}"
            allowed = set(got)
            t = empty_like_state()
            mgr.restore(1, t)
            assert states_equal(t, make_state(1)), f"{what}: step 1 changed"
        finally:
            mgr.close()
    print(f"re-save trials ({kind}): 10 kills, {commits} re-saves committed")


TIERED_TRIALS = 30


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (tmpfs)")
def test_sigkill_with_a_local_tier_on_dev_shm_restores_from_ram(fork_server, tmp_path):
    """A local tier on /dev/shm saving every step and a persistent root every 4th, the process
    SIGKILLed at random moments: the next process restores from RAM, never a damaged copy, never
    older than the newest step the killed process reported committed (in either tier), and
    every step either tier lists restores bitwise."""
    import shutil
    import tempfile

    master = int(os.environ.get("ASYNC_CKPT_CRASH_SEED", random.SystemRandom().randrange(2**31)))
    print(f"tiered crash trials: ASYNC_CKPT_CRASH_SEED={master}")
    shm = tempfile.mkdtemp(prefix="async-ckpt-crash-", dir="/dev/shm")
    root = str(tmp_path / "bucket")
    opts = dict(save_interval=4, local_dir=shm, local_policy=1, local_retention=2, max_to_keep=MAX_TO_KEEP)
    newest_seen = -1
    from_local = 0
    try:
        for i in range(TIERED_TRIALS):
            rng = random.Random(master * 1000 + i)
            delay = rng.uniform(0.0, 0.12) if rng.random() < 0.25 else rng.uniform(0.12, 0.9)
            out = fork_server({"dir": root, "mode": "rename", "delay": round(delay, 4), "replay": False,
                               "local_dir": shm, "save_interval": 4})
            what = f"trial {i} (seed {master * 1000 + i}, delay {delay:.3f}s)"
            assert out["status"] == "killed", f"{what}: the training process did not survive: {out['error']}"
            assert out["resume_ok"] in (None, True), f"{what}: resumed step {out['resumed']} with wrong contents"
            newest_seen = max([newest_seen] + out["committed"])
            if newest_seen < 0:
                continue  # nothing committed yet
            loads = []
            with CheckpointManager(root, keep_incomplete=True, **opts) as mgr:
                real = mgr.roots[0].store.layout.read_committed
                mgr.roots[0].store.layout.read_committed = lambda s, loads=loads, real=real: (loads.append(s), real(s))[1]
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    target = empty_like_state()
                    got = mgr.restore(None, target)
                skipped = [str(w.message) for w in caught if "skipping" in str(w.message)]
                assert not skipped, f"{what}: restore(None) skipped damaged copies: {skipped}"
                assert got >= newest_seen, (f"{what}: restored {got} < {newest_seen}, which had committed; "
                                            f"tiers {mgr.step_tiers()}, local dir {sorted(os.listdir(shm))}, "
                                            f"reported {out['committed'][-6:]}")
                assert states_equal(target, make_state(got)), f"{what}: step {got} restored with wrong contents"
                from_local += bool(loads)
                tiers = mgr.step_tiers()
                for s, held in tiers.items():  # every copy of every listed step restores bitwise
                    for tier in held:
                        held_root = mgr.roots[0] if tier == "local" else mgr.roots[-1]
                        from async_ckpt.jobs.restore_job import restore as restore_from
                        from async_ckpt.jobs.roots import Roots
                        from async_ckpt.options import RestoreOptions
                        t = empty_like_state()
                        exchange = held_root.store.exchange
                        restore_from(lambda: Roots(held_root).candidates(exchange, s), t, exchange=exchange, step=s,
                                     opts=RestoreOptions(verify=True, allow_pickle=False, threads=2))
                        assert states_equal(t, make_state(s)), f"{what}: {tier} copy of {s} restored wrong"
            newest_seen = max(newest_seen, got)
            print(f"{what}: committed ..{out['committed'][-1:]} resumed {out['resumed']} restored {got} "
                  f"tiers {tiers}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    print(f"tiered crash trials: {TIERED_TRIALS} kills, {from_local} restores from /dev/shm")
    assert from_local >= TIERED_TRIALS // 2  # the RAM tier is what restores (it holds every step)
