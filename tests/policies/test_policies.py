"""Save-decision and retention policies, on their own and through CheckpointManager."""

from __future__ import annotations

import tempfile
import threading
import time
import uuid

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from async_ckpt import (
    AnyOf,
    AtSteps,
    CheckpointInfo,
    CheckpointManager,
    Continuous,
    EveryNSteps,
    EveryTSeconds,
    KeepAll,
    KeepBest,
    KeepEveryNSteps,
    KeepLatest,
    KeepTimeInterval,
    OnPreemption,
    SaveContext,
)
from async_ckpt.policies import apply_retention, as_retention_policy, as_save_policy, decide_save

from ..conftest import assert_bitwise_equal, small_state, target_like


class FakeClock:
    """A wall clock the test moves by hand (manifests' commit_time and save decisions use it)."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.t

    def advance(self, dt: float) -> None:
        with self._lock:
            self.t += dt


def ctx(now=100.0, start=0.0, last=None, last_step=None, in_flight=False, preempted=False):
    return SaveContext(now=now, start_time=start, last_save_time=last, last_save_step=last_step,
                       save_in_flight=in_flight, preempted=preempted)


def infos(*rows):
    """rows: (step, commit_time) or (step, commit_time, metrics)."""
    return [CheckpointInfo(r[0], float(r[1]), dict(r[2]) if len(r) > 2 else {}) for r in rows]


def drain(mgr: CheckpointManager) -> None:
    """Wait until every retention pass queued so far has run (the deleter runs tasks in order)."""
    mgr.join()
    mgr.roots[-1].store.deleter.submit(lambda: None).result()


# ---- save policies --------------------------------------------------------------------------------
def test_every_n_steps_and_at_steps():
    p = EveryNSteps(5)
    assert [s for s in range(12) if p.should_save(s)] == [0, 5, 10]
    a = AtSteps([3, 7, 7, 100])
    assert [s for s in range(12) if a.should_save(s)] == [3, 7]
    with pytest.raises(ValueError, match="int >= 1"):
        EveryNSteps(0)
    with pytest.raises(ValueError, match="AtSteps step"):
        AtSteps([1, -2])
    with pytest.raises(ValueError, match="AtSteps step"):
        AtSteps([1.5])
    with pytest.raises(TypeError, match="iterable"):
        AtSteps(5)


def test_every_t_seconds_measures_from_the_last_save_or_the_start():
    p = EveryTSeconds(60)
    assert not p.should_save(1, ctx(now=59, start=0))
    assert p.should_save(1, ctx(now=60, start=0))  # first save: T after the manager started
    assert not p.should_save(9, ctx(now=1000, start=0, last=990, last_step=8))
    assert p.should_save(9, ctx(now=1050, start=0, last=990, last_step=8))
    with pytest.raises(ValueError, match="seconds"):
        EveryTSeconds(0)
    with pytest.raises(TypeError, match="seconds"):
        EveryTSeconds("60")


def test_every_t_seconds_on_its_own_measures_with_a_monotonic_clock():
    """Outside a manager the policy measures with its own clock: time.monotonic by default (a
    wall clock that steps back never delays it), or the one given."""
    assert EveryTSeconds(1).clock is time.monotonic
    mono = FakeClock(50.0)
    p = EveryTSeconds(1, clock=mono)
    took = []
    for step in range(6):
        mono.advance(0.5)
        if p.should_save(step):
            took.append(step)
    assert took == [1, 3, 5]
    with pytest.raises(TypeError, match="clock"):
        EveryTSeconds(1, clock=5)


def test_continuous_saves_only_when_nothing_is_in_flight():
    p = Continuous()
    assert p.should_save(3, ctx(in_flight=False))
    assert not p.should_save(3, ctx(in_flight=True))
    q = Continuous(min_interval_s=10)
    assert not q.should_save(3, ctx(now=105, last=100))
    assert q.should_save(3, ctx(now=110, last=100))
    assert q.should_save(3, ctx(now=1, last=None))


def test_on_preemption_any_of_and_callables():
    assert not OnPreemption().should_save(4, ctx())
    assert OnPreemption().should_save(4, ctx(preempted=True))
    assert not OnPreemption().should_save(4)  # outside a manager: never
    p = AnyOf([EveryNSteps(10), AtSteps([3]), lambda s: s == 7, OnPreemption()])
    assert [s for s in range(12) if decide_save(p, s, ctx())] == [0, 3, 7, 10]
    assert decide_save(p, 5, ctx(preempted=True))
    with pytest.raises(ValueError, match="at least one"):
        AnyOf([])
    with pytest.raises(TypeError, match="neither"):
        AnyOf([3])
    with pytest.raises(TypeError, match="retention policy"):
        AnyOf([EveryNSteps(2), KeepLatest(1)]).should_save(2, ctx())
    with pytest.raises(TypeError, match="save policy"):
        AnyOf([EveryNSteps(2), KeepLatest(1)]).keep(infos((1, 1)))


# ---- retention policies ---------------------------------------------------------------------------
def test_keep_latest_is_by_commit_order_not_step():
    cps = infos((30, 1), (10, 2), (20, 3))
    assert KeepLatest(2).keep(cps) == {10, 20}
    assert KeepAll().keep(cps) == {10, 20, 30}
    with pytest.raises(ValueError):
        KeepLatest(0)


def test_keep_every_n_steps():
    cps = infos(*[(s, s) for s in (0, 250, 500, 999, 1000, 1500, 2000)])
    assert KeepEveryNSteps(1000).keep(cps) == {0, 1000, 2000}
    with pytest.raises(ValueError):
        KeepEveryNSteps(0)


def test_keep_time_interval_walk():
    times = [0, 30, 59, 61, 100, 125, 200, 201]
    cps = infos(*[(i, t) for i, t in enumerate(times)])
    kept = KeepTimeInterval(60).keep(cps)
    assert kept == {0, 3, 5, 6}  # t = 0, 61, 125 (>= 61+60), 200 (>= 125+60)
    # deleting what it did not keep never changes what it keeps
    survivors = [c for c in cps if c.step in kept]
    assert KeepTimeInterval(60).keep(survivors) == kept


def test_keep_best_min_max_missing_and_ties():
    cps = infos((1, 1, {"loss": 0.5}), (2, 2, {"loss": 0.3}), (3, 3, {}), (4, 4, {"loss": 0.3}),
                (5, 5, {"loss": 0.9, "acc": 0.7}), (6, 6, {"acc": 0.9}))
    assert KeepBest(2, "loss").keep(cps) == {2, 4, 3, 6}  # ties: earlier commit first; missing kept
    assert KeepBest(1, "loss").keep(cps) == {2, 3, 6}  # step 4 ties step 2 but came later
    assert KeepBest(1, "loss", missing="drop").keep(cps) == {2}
    assert KeepBest(1, "acc", mode="max", missing="drop").keep(cps) == {6}
    assert KeepBest(5, "loss", mode="max", missing="drop").keep(cps) == {1, 2, 4, 5}
    with pytest.raises(ValueError, match="mode"):
        KeepBest(1, "loss", mode="best")
    with pytest.raises(ValueError, match="missing"):
        KeepBest(1, "loss", missing="maybe")
    with pytest.raises(TypeError, match="metric"):
        KeepBest(1, "")


def test_any_of_union_and_callable_retention():
    cps = infos(*[(s, s, {"loss": 10.0 - s % 7}) for s in range(1, 15)])
    best3_latest2 = AnyOf([KeepBest(3, "loss"), KeepLatest(2)])
    # loss = 10 - s % 7: smallest at s % 7 == 6 -> steps 6, 13 (4.0), then s % 7 == 5 -> step 5 (5.0)
    assert best3_latest2.keep(cps) == {6, 13, 5, 14}
    even = as_retention_policy(lambda checkpoints: [c.step for c in checkpoints if c.step % 2 == 0])
    assert apply_retention(even, cps) == set(range(2, 15, 2))
    assert AnyOf([lambda c: {1}, KeepLatest(1)]).keep(cps) == {1, 14}
    with pytest.raises(TypeError, match="non-integer"):
        apply_retention(as_retention_policy(lambda c: ["3"]), cps)
    with pytest.raises(TypeError, match="iterable"):
        apply_retention(as_retention_policy(lambda c: 3), cps)
    with pytest.raises(TypeError, match="keep"):
        as_retention_policy(42)


# ---- through the manager --------------------------------------------------------------------------
def test_manager_rejects_bad_policies(ckpt_dir):
    with pytest.raises(TypeError, match="save policy"):
        CheckpointManager(ckpt_dir, save_policy=5)
    with pytest.raises(TypeError, match="retention policy"):
        CheckpointManager(ckpt_dir, retention="latest")


def test_force_always_saves_and_callable_save_policy(ckpt_dir):
    with CheckpointManager(ckpt_dir, save_policy=lambda s: s in (2, 5)) as mgr:
        took = [s for s in range(7) if mgr.save_async(s, small_state(s))]
        assert took == [2, 5]
        assert mgr.save(6, small_state(6), force=True)
        assert mgr.all_steps() == [2, 5, 6]
    with CheckpointManager(ckpt_dir, save_policy=OnPreemption()) as mgr:
        assert not mgr.should_save(7)  # preemption is off: OnPreemption never fires
        assert not mgr.save(7, small_state(7))
        assert mgr.save(7, small_state(7), force=True)


def test_every_t_seconds_through_the_manager(ckpt_dir):
    clock = FakeClock()
    mgr = CheckpointManager(ckpt_dir, save_policy=EveryTSeconds(60), interval_clock=clock)
    took = []
    for step in range(12):
        clock.advance(25)  # a step takes 25 s
        if mgr.save_async(step, small_state(step)):
            took.append(step)
    mgr.close()
    # saves at 75 s (step 2: first one >= 60 after start), then 150 s (step 5), 225 s (step 8), 300 s (step 11)
    assert took == [2, 5, 8, 11]


@pytest.mark.parametrize("policy", [EveryTSeconds(1), Continuous(min_interval_s=1)], ids=repr)
def test_time_based_saves_go_on_when_the_wall_clock_steps_back_an_hour(tmp_path, policy):
    """The wall clock steps back one hour after two saves (NTP, a VM restored from a
    snapshot) while each step takes 2 s: every step is still saved, to the root and to the
    local tier (same policy), commit order holds, and the newest save restores bitwise."""
    wall, mono = FakeClock(), FakeClock(10.0)
    mgr = CheckpointManager(str(tmp_path / "ckpt"), save_policy=policy, local_dir=str(tmp_path / "local"),
                            local_policy=policy, local_retention=10, wall_clock=wall, interval_clock=mono)
    took = []
    for step in range(6):
        mono.advance(2.0)
        wall.advance(-3600.0 if step == 2 else 2.0)
        if mgr.save(step, small_state(step)):
            took.append(step)
    assert took == [0, 1, 2, 3, 4, 5]
    assert mgr.all_steps() == took and mgr.steps_in_commit_order() == took and mgr.latest_step() == 5
    target = target_like(small_state(0))
    assert mgr.restore(None, target) == 5
    assert_bitwise_equal(small_state(5), target)
    mgr.close()
    with CheckpointManager(str(tmp_path / "local")) as local:  # the local tier saved every step too
        assert local.all_steps() == took


def test_manager_rejects_clocks_that_are_not_callable(ckpt_dir):
    with pytest.raises(TypeError, match="interval_clock"):
        CheckpointManager(ckpt_dir, interval_clock=1.0)
    with pytest.raises(TypeError, match="wall_clock"):
        CheckpointManager(ckpt_dir, wall_clock="now")


def test_continuous_saves_when_the_previous_one_committed(ckpt_dir):
    root = "faulty://" + ckpt_dir  # the first save's data write hangs until released
    mgr = CheckpointManager(root, save_policy=Continuous(), max_pending_async=2)
    stuck = mgr.storage.fs.inject("write", "*.distcp", "hang", times=1)
    assert mgr.save_async(0, small_state(0))
    assert stuck.reached.wait(30)
    assert not mgr.save_async(1, small_state(1))  # step 0 still in flight: no second save queued
    assert not mgr.should_save(2)
    stuck.release.set()
    mgr.join()
    assert mgr.save_async(3, small_state(3))
    mgr.close()
    assert CheckpointManager(root).all_steps() == [0, 3]


def test_keep_best_with_metrics_best_step_and_metrics(ckpt_dir):
    losses = {1: 0.9, 2: 0.4, 3: 0.6, 4: 0.2, 5: 0.8, 6: 0.7}
    with CheckpointManager(ckpt_dir, retention=AnyOf([KeepBest(2, "loss"), KeepLatest(1)])) as mgr:
        for s, loss in losses.items():
            mgr.save(s, small_state(s), metrics={"loss": loss, "acc": 1 - loss})
        drain(mgr)
        assert mgr.all_steps() == [2, 4, 6]
        assert mgr.best_step() == 4
        assert mgr.best_step("acc", "max") == 4
        assert mgr.best_step("acc") == 6  # another metric: mode "min" unless given
        assert mgr.best_step("nope") is None
        assert mgr.metrics(4) == {"loss": 0.2, "acc": pytest.approx(0.8)}
    target = target_like(small_state(0))
    CheckpointManager(ckpt_dir).restore(4, target)
    assert_bitwise_equal(small_state(4), target)
    with pytest.raises(ValueError, match="metric"):
        CheckpointManager(ckpt_dir).best_step()


def test_recipe_keep_every_1000_plus_latest(ckpt_dir):
    with CheckpointManager(ckpt_dir, save_interval=250,
                           retention=AnyOf([KeepEveryNSteps(1000), KeepLatest(2)])) as mgr:
        for s in range(0, 3001, 50):
            mgr.save(s, small_state(s))
        drain(mgr)
        assert mgr.all_steps() == [0, 1000, 2000, 2750, 3000]


def test_keep_time_interval_through_the_manager_and_after_restart(ckpt_dir):
    clock = FakeClock()
    policy = AnyOf([KeepTimeInterval(3600), KeepLatest(1)])
    mgr = CheckpointManager(ckpt_dir, retention=policy, wall_clock=clock)
    for s in range(6):
        clock.advance(1500)  # commits at 1500, 3000, 4500, 6000, 7500, 9000 s
        mgr.save(s, small_state(s))
    drain(mgr)
    assert mgr.all_steps() == [0, 3, 5]  # 1500, 6000 (>= 1500 + 3600), latest
    mgr.close()
    mgr = CheckpointManager(ckpt_dir, retention=policy, wall_clock=clock)  # decisions come from the manifests
    clock.advance(1500)
    mgr.save(6, small_state(6))  # 10500: 5 (9000) is not 3600 after 6000, so it goes
    drain(mgr)
    assert mgr.all_steps() == [0, 3, 6]
    mgr.close()


def _run(root, clock, policy, plan):
    """Save ``plan`` ((step, dt, metrics) or "restart") into ``root``; return all_steps after each."""
    seen = []
    mgr = CheckpointManager(root, retention=policy, wall_clock=clock)
    for item in plan:
        if item == "restart":
            mgr.close()
            mgr = CheckpointManager(root, retention=policy, wall_clock=clock)
            continue
        step, dt, metrics = item
        clock.advance(dt)
        mgr.save(step, small_state(step), metrics=metrics)
        drain(mgr)
        seen.append(mgr.all_steps())
    mgr.close()
    return seen


def test_restart_makes_the_same_decisions(tmp_path):
    policy = AnyOf([KeepBest(2, "loss"), KeepLatest(2), KeepTimeInterval(100)])
    saves = [(s, 40, {"loss": float((s * 37) % 11)} if s % 3 else None) for s in range(1, 16)]
    plain = _run(str(tmp_path / "a"), FakeClock(), policy, saves)
    with_restarts = _run(str(tmp_path / "b"), FakeClock(), policy,
                         saves[:4] + ["restart"] + saves[4:9] + ["restart", "restart"] + saves[9:])
    assert plain == with_restarts


def test_retention_is_decided_before_save_returns_and_keeps_the_newest(ckpt_dir):
    threads = []

    def keep_nothing(checkpoints):
        threads.append(threading.current_thread().name)
        return set()

    with CheckpointManager(ckpt_dir, retention=keep_nothing) as mgr:
        for s in range(4):
            mgr.save(s, small_state(s))
            assert mgr.all_steps() == [s]  # visible at once; the newest commit is never deleted
    # decided on the writer thread (never the training thread), right after the commit
    assert threads and all(t.startswith("async-ckpt-writer") for t in threads)


def test_retention_never_deletes_a_step_being_written(ckpt_dir):
    mgr = CheckpointManager(ckpt_dir)
    for s in (1, 2):
        mgr.save(s, small_state(s))
    drain(mgr)
    mgr.retention = as_retention_policy(lambda c: set())
    mgr.catalog.begin_write(1)  # a re-save of step 1 in progress
    mgr.roots[-1].store.apply_retention(mgr.retention)
    assert mgr.all_steps() == [1, 2]
    mgr.catalog.end_write(1)
    mgr.roots[-1].store.apply_retention(mgr.retention)
    assert mgr.all_steps() == [2]
    mgr.close()


# ---- property test --------------------------------------------------------------------------------
POLICIES = [
    ("latest2", lambda: KeepLatest(2)),
    ("best2", lambda: KeepBest(2, "loss")),
    ("best1max-drop", lambda: KeepBest(1, "acc", mode="max", missing="drop")),
    ("every3", lambda: KeepEveryNSteps(3)),
    ("time10", lambda: KeepTimeInterval(10)),
    ("best2+latest1", lambda: AnyOf([KeepBest(2, "loss"), KeepLatest(1)])),
    ("all", lambda: KeepAll()),
    ("even", lambda: (lambda cps: {c.step for c in cps if c.step % 2 == 0})),
]

op = st.one_of(
    st.tuples(st.just("save"), st.integers(1, 3), st.integers(0, 8),
              st.one_of(st.none(), st.fixed_dictionaries({"loss": st.integers(0, 5)}),
                        st.fixed_dictionaries({"acc": st.integers(0, 5)}))),
    st.tuples(st.just("restart"), st.integers(0, len(POLICIES) - 1)),
    st.tuples(st.just("rollback"), st.integers(0, 100), st.integers(1, 3)),
    st.tuples(st.just("lower"), st.integers(0, 100)),
)


def _model_retention(policy, model):
    """What the manager must keep: the policy, plus the newest commit."""
    ordered = sorted(model.values(), key=lambda c: (c.commit_time, c.step))
    keep = apply_retention(as_retention_policy(policy), ordered)
    keep.add(ordered[-1].step)
    return {s: c for s, c in model.items() if s in keep}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scheme=st.sampled_from(["file", "memory"]), first=st.integers(0, len(POLICIES) - 1),
       ops=st.lists(op, min_size=1, max_size=10))
def test_property_random_saves_restarts_and_policies(scheme, first, ops):
    clock = FakeClock()
    with tempfile.TemporaryDirectory() as tmp:
        root = f"{tmp}/ckpt" if scheme == "file" else f"memory://prop-{uuid.uuid4().hex}"
        policy = POLICIES[first][1]()
        mgr = CheckpointManager(root, retention=policy, wall_clock=clock)
        model = {}  # step -> CheckpointInfo, what must be on storage
        data = {}  # step -> the value its tensors hold
        next_step = 0
        try:
            for o in ops:
                if o[0] == "restart":
                    mgr.close()
                    policy = POLICIES[o[1]][1]()
                    mgr = CheckpointManager(root, retention=policy, wall_clock=clock)
                    assert mgr.all_steps() == sorted(model)
                    event("restart")
                    continue
                if o[0] == "rollback":
                    older = sorted(model)[:-1]
                    if not older:
                        continue
                    r = older[o[1] % len(older)]
                    target = target_like(small_state(0))
                    assert mgr.restore(r, target) == r
                    assert torch.equal(target["w"], small_state(data[r])["w"])
                    step = r + o[2]
                    event("rollback" if step < max(model) else "restore older, save above the top")
                    # nothing is deleted because of it: commit order decides what retention drops
                elif o[0] == "lower":
                    step = o[1] % (max(model) + 1) if model else o[1]  # any step, without a restore
                    event("save below the top" if model and step < max(model) else "lower: not below")
                else:
                    step = next_step + o[1]
                dt, metrics = (o[2], o[3]) if o[0] == "save" else (1, None)
                clock.advance(dt)
                value = len(data) + 1000 * step
                mgr.save(step, small_state(value), metrics=None if metrics is None else {k: float(v) for k, v in metrics.items()})
                drain(mgr)
                data[step] = value
                newest = max((c.commit_time for c in model.values()), default=float("-inf"))
                t = clock() if clock() > newest else newest + 1e-6  # commit times never go back
                model[step] = CheckpointInfo(step, t, {k: float(v) for k, v in (metrics or {}).items()})
                model = _model_retention(policy, model)
                next_step = step
                steps = mgr.all_steps()
                assert steps == sorted(model), (POLICIES, ops)
                assert step in steps  # the newest commit survives
                assert mgr.latest_step() == step
                assert mgr.steps_in_commit_order() == [c.step for c in sorted(
                    model.values(), key=lambda c: (c.commit_time, c.step))]
            # whatever survived holds what was saved at that step
            for s in mgr.all_steps()[-2:]:
                target = target_like(small_state(0))
                mgr.restore(s, target)
                assert_bitwise_equal(small_state(data[s]), target)
        finally:
            mgr.close()


def test_save_policies_are_asked_with_the_context_or_adapted_once(ckpt_dir):
    seen = []

    class WithContext:  # no uses_context attribute needed
        def should_save(self, step, context):
            seen.append(context)
            return step == 2

    class StepOnly:
        def should_save(self, step):
            return step == 3

    with CheckpointManager(ckpt_dir, save_policy=AnyOf([WithContext(), StepOnly(), lambda s: s == 5])) as mgr:
        assert [s for s in range(7) if mgr.save(s, small_state(s))] == [2, 3, 5]
        assert all(isinstance(c, SaveContext) for c in seen) and seen[-1].last_save_step == 5
        mgr.save_policy = lambda s: s == 6  # assignable, adapted on assignment
        assert mgr.should_save(6) and not mgr.should_save(5)


def test_the_save_schedule_is_pure_and_the_local_tier_follows_the_persistent_decision():
    """manager.schedule decides from its arguments only: the same inputs, the same answer; a
    local tier without its own policy is due exactly when the persistent root is."""
    from async_ckpt.manager.schedule import RootState, due_at

    every3 = RootState(as_save_policy(lambda s: s % 3 == 0))
    follows = RootState(None)
    own = RootState(as_save_policy(lambda s: True))
    for step in range(7):
        due = due_at(step, force=False, preempt=False, now=10.0, start_time=0.0, persistent=every3, local=follows)
        again = due_at(step, force=False, preempt=False, now=10.0, start_time=0.0, persistent=every3, local=follows)
        assert due == again and due.persistent == due.local == (step % 3 == 0)
        assert due_at(step, force=False, preempt=False, now=10.0, start_time=0.0, persistent=every3,
                      local=own).local
    forced = due_at(1, force=True, preempt=False, now=0.0, start_time=0.0, persistent=every3, local=None)
    assert forced.persistent and not forced.local and forced.any


def test_manager_options_resolve_each_option_once():
    from async_ckpt.options import ManagerOptions

    opts = ManagerOptions("/x", 5, 2, num_of_threads=3, local_dir="/y", local_policy=4, local_retention=3,
                          collective_timeout_s=10)
    assert opts.write_threads == 3 and isinstance(opts.retention, KeepLatest)
    assert opts.save_policy.should_save(10) and not opts.save_policy.should_save(11)
    assert opts.local_policy.should_save(8) and opts.local_retention.keep
    with pytest.raises(ValueError, match="local_retention"):
        ManagerOptions("/x", local_dir="/y", local_retention=0, collective_timeout_s=10)
