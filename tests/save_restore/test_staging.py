"""Staging: buffer reuse, the memory budget, storage dedup, and snapshot isolation."""

from __future__ import annotations

import enum
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_ckpt import InvalidStateDictError, StagingBudgetError
from async_ckpt.staging import HostBufferPool, Stager, make_plan

from ..conftest import assert_bitwise_equal


def test_steady_state_saves_allocate_nothing():
    sd = {"a": torch.randn(100_000), "b": {"c": torch.randn(20, 3000)}, "n": 3, "small": torch.ones(3)}
    st = Stager()
    for i in range(5):
        snap = st.stage(sd)
        assert_bitwise_equal(snap.state_dict, sd)
        snap.release()
        if i == 0:
            allocs, nbytes = st.pool.allocations, st.pool.allocated_bytes
    assert st.pool.allocations == allocs == 3  # two big buffers + one slab for the small tensor
    assert st.pool.allocated_bytes == nbytes == (100_000 + 60_000) * 4 + 64


def test_snapshot_is_isolated_from_later_mutation():
    t = torch.arange(100, dtype=torch.float64)
    groups = [{"lr": 0.1, "params": [0]}]
    snap = Stager().stage({"t": t, "groups": groups})
    t.mul_(-1)
    groups[0]["lr"] = 99.0
    assert torch.equal(snap.state_dict["t"], torch.arange(100, dtype=torch.float64))
    assert snap.state_dict["groups"][0]["lr"] == 0.1


def test_tied_weights_and_views_share_one_host_storage():
    base = torch.randn(10, 4)
    sd = {"w": base, "tied": base, "row": base[3], "col": base[:, 2], "t": base.t()}
    st = Stager()
    snap = st.stage(sd)
    host = snap.state_dict
    assert st.pool.allocations == 1, "one storage -> one host buffer"
    ptrs = {v.untyped_storage().data_ptr() for v in host.values()}
    assert len(ptrs) == 1
    for k in sd:
        assert_bitwise_equal(host[k], sd[k], k)
        assert host[k].stride() == sd[k].stride()
    snap.release()


def test_budget_refuses_oversized_state_dict():
    st = Stager(HostBufferPool(budget_bytes=1000))
    with pytest.raises(StagingBudgetError, match="budget"):
        st.stage({"x": torch.zeros(1000)})  # 4000 bytes


def test_budget_waits_for_release_then_reuses():
    pool = HostBufferPool(budget_bytes=4096)
    st = Stager(pool)
    sd = {"x": torch.ones(1024)}  # exactly the budget
    first = st.stage(sd)
    done = threading.Event()
    result = {}

    def second():
        result["snap"] = st.stage({"x": torch.full((1024,), 2.0)})
        done.set()

    th = threading.Thread(target=second)
    th.start()
    assert not done.wait(0.3), "second save must wait until the first releases its buffers"
    first.release()
    assert done.wait(10)
    assert torch.equal(result["snap"].state_dict["x"], torch.full((1024,), 2.0))
    assert pool.allocated_bytes <= 4096 and pool.allocations == 1
    result["snap"].release()


def test_budget_evicts_unneeded_sizes():
    pool = HostBufferPool(budget_bytes=800_000)
    st = Stager(pool)
    st.stage({"x": torch.ones(150_000)}).release()  # 600 kB, now free
    snap = st.stage({"y": torch.ones(100_000)})  # needs 400 kB fresh: evicts the unused 600 kB
    assert pool.allocated_bytes == 400_000
    snap.release()


def test_plan_rejects_bad_keys_and_leaves():
    from async_ckpt import InvalidStateDictError

    with pytest.raises(InvalidStateDictError, match="top-level"):
        make_plan({1: torch.ones(1)})
    with pytest.raises(InvalidStateDictError, match=r"a\.\(1, 2\)|nested keys"):
        make_plan({"a": {(1, 2): 3}})
    with pytest.raises(InvalidStateDictError, match="strided"):
        make_plan({"s": torch.ones(2, 2).to_sparse()})


def test_many_small_tensors_round_trip():
    sd = {f"p{i}": torch.full((8,), float(i)) for i in range(2000)}
    st = Stager()
    snap = st.stage(sd)
    assert_bitwise_equal(snap.state_dict, sd)
    snap.release()
    snap = st.stage(sd)
    assert st.pool.allocations == 1, "small tensors share one pooled slab"
    snap.release()


def _mixed_state(seed: int, small_shape=(32, 8), n_small: int = 50):
    g = torch.Generator().manual_seed(seed)
    sd = {"small": {f"p{i}": torch.randn(*small_shape, generator=g) for i in range(n_small)},
          "big": torch.randn(300, 300, generator=g), "ints": torch.randint(0, 100, (70_000,), generator=g),
          "half": torch.randn(9, generator=g).half(), "step": seed}
    return sd


def test_remembered_layout_is_reused_and_stays_exact(monkeypatch):
    """The second save of a layout skips lay_out; every save, including ones whose layout changed
    or whose first snapshot is still held (the other slab of a pair), restores bit for bit."""
    from async_ckpt.staging import buffer_layout as stager_mod

    calls = []
    real = stager_mod.lay_out
    monkeypatch.setattr(stager_mod, "lay_out", lambda *a, **k: calls.append(1) or real(*a, **k))
    st = Stager()
    sd = _mixed_state(0)
    st.stage(sd).release()
    assert len(calls) == 1
    s1 = st.stage(sd)
    assert len(calls) == 1, "an unchanged layout is redone from memory"
    expected1 = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    expected1["small"] = {k: v.clone() for k, v in sd["small"].items()}
    assert_bitwise_equal(s1.state_dict, expected1)
    for v in sd["small"].values():  # s1 is still held: the next save must use other buffers
        v.add_(1.0)
    sd["big"].mul_(-1.0)
    s2 = st.stage(sd)
    assert len(calls) == 1
    assert_bitwise_equal(s1.state_dict, expected1)
    assert_bitwise_equal(s2.state_dict, sd)
    assert s2.state_dict["small"]["p0"].data_ptr() != s1.state_dict["small"]["p0"].data_ptr()
    s1.release(), s2.release()
    s3 = st.stage(sd)  # back to the first pair of buffers: their views are cached
    assert_bitwise_equal(s3.state_dict, sd)
    s3.release()
    # A changed shape, a tie, a non-contiguous view: lay_out decides again, and all stay exact.
    for change in ("shape", "tie", "view"):
        sd2 = _mixed_state(1, small_shape=(16, 16) if change == "shape" else (32, 8))
        if change == "tie":
            sd2["small"]["p1"] = sd2["small"]["p0"]
        if change == "view":
            sd2["small"]["p2"] = sd2["big"][:, :8]
        before = len(calls)
        snap = st.stage(sd2)
        assert len(calls) == before + 1
        assert_bitwise_equal(snap.state_dict, sd2)
        if change == "tie":
            assert snap.state_dict["small"]["p1"] is snap.state_dict["small"]["p0"]
        snap.release()


def _same_plan(a, b):
    """Two plans that stage the same tensors under the same names into the same structure."""
    assert a.keys == b.keys and a.int_keys == b.int_keys
    assert [type(k) for k in a.keys] == [type(k) for k in b.keys]
    assert len(a.tensors) == len(b.tensors)
    for x, y in zip(a.tensors, b.tensors):
        assert x is y or (x.data_ptr() == y.data_ptr() and not x.requires_grad and not y.requires_grad)
    idx = list(range(len(a.tensors)))
    assert a.build(idx) == b.build(idx)  # slots by position: same structure, same slot indices


def _rebuilds(sd, plan):
    """The plan, filled with its own tensors, is ``sd`` again: plain dicts and lists, the same
    tensors (or their detached aliases) in the same places, the same other leaves."""

    def same(a, b):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and (a is b or (a.data_ptr() == b.data_ptr() and not b.requires_grad))
        elif isinstance(a, dict):
            assert type(b) is dict and list(a) == list(b)
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, (list, tuple)):
            assert type(b) is type(a) and len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b

    same(sd, plan.build(plan.tensors))


def test_plan_memo_reuses_a_tensor_mapping_and_gives_the_same_plan():
    from async_ckpt.staging.plan import PlanMemo

    memo = PlanMemo()
    model = {f"layer{i}.w": torch.randn(3) for i in range(40)}
    sd = {"model": model, "step": 1}
    first = make_plan(sd, memo)
    second = make_plan({"model": dict(model), "step": 2}, memo)
    assert second.template["model"] is first.template["model"], "the memo was not used"
    _same_plan(second, make_plan({"model": model, "step": 2}))
    assert second.build(list(range(40)))["step"] == 2

    # Each change below must be seen: the plan equals a plan made without the memo.
    grads = {k: v.clone().requires_grad_() for k, v in model.items()}
    changed = [
        {"model": {**model, "layer3.w": 7}, "step": 3},  # a value is no longer a tensor
        {"model": {**model, "extra": torch.ones(2)}, "step": 3},  # a key more
        {"model": dict(reversed(list(model.items()))), "step": 3},  # same keys, other order
        {"first": torch.ones(1), "model": model, "step": 3},  # its tensors start later
        {"model": grads, "step": 3},  # tensors that require grad are staged detached
        {"model": {**model, "layer3.w": torch.nn.Parameter(torch.ones(3))}, "step": 3},  # a subclass
        model,  # the same tensors at the top level
    ]
    _rebuilds({"model": model, "step": 2}, second)
    for sd2 in changed:
        make_plan(sd, memo)
        _same_plan(make_plan(sd2, memo), make_plan(sd2))
        again = make_plan(sd2, memo)  # and again, from the memo of sd2
        _same_plan(again, make_plan(sd2))
        _rebuilds(sd2, again)
    make_plan(sd, memo)
    with pytest.raises(InvalidStateDictError, match="strided"):
        make_plan({"model": {**model, "layer3.w": torch.ones(2, 2).to_sparse()}, "step": 4}, memo)
    make_plan(model, memo)  # the top level itself remembered
    with pytest.raises(InvalidStateDictError, match="top-level"):
        make_plan({**model, 5: torch.ones(1)}, memo)


class _Key(str, enum.Enum):
    """A str subclass: equal to its value, named differently (``K.A``) by the plan."""

    A = "a"


def test_plan_memo_tells_a_str_subclass_key_from_a_plain_one():
    from async_ckpt.staging.plan import PlanMemo

    t = torch.ones(2)
    for sd, sd2 in (({"m": {"a": t}}, {"m": {_Key.A: t}}), ({"a": t}, {_Key.A: t})):
        memo = PlanMemo()
        make_plan(sd, memo)
        _same_plan(make_plan(sd2, memo), make_plan(sd2))
        _same_plan(make_plan(sd, memo), make_plan(sd))  # and back


def test_an_empty_key_below_the_top_is_an_ordinary_key():
    t, u = torch.ones(1), torch.zeros(1)
    plan = make_plan({"": {"x": {0: t}}, "x": {"0": u}})
    assert plan.keys == [".x.0", "x.0"] and plan.int_keys == [".x.0"]
    plan = make_plan({"": {0: t}})  # int keys are allowed below the top, also under ""
    assert plan.keys == [".0"] and plan.int_keys == [".0"]


_keys = st.sampled_from(["a", "b", "", _Key.A, 0, 1])


def _leaves():
    return st.one_of(
        st.tuples(st.integers(1, 3), st.booleans()).map(lambda nr: torch.randn(nr[0]).requires_grad_(nr[1])),
        st.integers(0, 2),
        st.just(None),
    )


_trees = st.recursive(
    _leaves(),
    lambda inner: st.one_of(st.dictionaries(_keys, inner, max_size=4), st.lists(inner, max_size=3)),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.dictionaries(st.sampled_from(["a", "b", "", _Key.A]), _trees, max_size=3), min_size=2, max_size=5))
def test_plan_memo_never_changes_a_plan(state_dicts):
    """Whatever came before, a plan made with the memo equals one made without it."""
    from async_ckpt.staging.plan import PlanMemo

    memo = PlanMemo()
    for sd in state_dicts + state_dicts[:1]:  # the first again: some mappings hit the memo
        try:
            expected = make_plan(sd)
        except InvalidStateDictError:
            with pytest.raises(InvalidStateDictError):
                make_plan(sd, memo)
            continue
        got = make_plan(sd, memo)
        _same_plan(got, expected)
        _rebuilds(sd, got)


def test_pool_with_hold_peak_reuses_the_overlap_buffers_across_upload_cycles():
    """A local tier's cycle: an upload holds one snapshot while a local save takes another, then
    local saves run alone for a while. With ``hold_peak`` the second set of buffers survives
    the quiet stretch, so each later overlap allocates nothing; without it, every cycle
    allocates a whole snapshot again."""
    from async_ckpt.staging.pool import HostBufferPool

    n = 1 << 20

    def cycles(pool):
        per_cycle = []
        for _ in range(4):
            before = pool.allocations
            up = pool.acquire([n, n // 2])
            loc = pool.acquire([n, n // 2])
            loc.release()
            up.release()
            for _ in range(3):
                pool.acquire([n, n // 2]).release()
            per_cycle.append(pool.allocations - before)
        return per_cycle

    held = HostBufferPool(hold_peak=True)
    assert cycles(held) == [4, 0, 0, 0]
    assert held.allocated_bytes == 2 * (n + n // 2)
    assert cycles(HostBufferPool()) == [4, 2, 2, 2]  # the plain pool keeps only the last cycle's
