"""storage.dcp: the layout memo is per owner, and DCP's single-process warning is silenced
only around DCP's own calls, without touching the process's warning filters."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import warnings

import torch

from async_ckpt import CheckpointManager
from async_ckpt.io import dcp_call as dcp_common
from async_ckpt.io import load_state_dict, save_state_dict, write
from async_ckpt.storage.storage import Storage

from ..conftest import assert_bitwise_equal, target_like
from ..support.paths import REPO

ROOT = REPO
DCP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _model_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"layer{i}.w": torch.randn(8, 4, generator=g) for i in range(30)}, "step": step}


def _optim_state(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {"optim": {str(i): {"exp_avg": torch.randn(16, generator=g, dtype=torch.float64),
                               "count": torch.tensor([step, i])} for i in range(20)},
            "lr": 0.5 / (step + 1)}


def test_two_managers_alternating_saves_each_keep_their_layout(tmp_path, monkeypatch):
    """Each manager remembers its own last layout: alternating saves of two different state
    dicts reuse each one's file assignment (no re-balancing after the first save of each),
    and every step restores bit for bit."""
    balanced = []
    real = write._balance
    monkeypatch.setattr(write, "_balance", lambda *a, **k: balanced.append(1) or real(*a, **k))
    a = CheckpointManager(str(tmp_path / "a"))
    b = CheckpointManager(str(tmp_path / "b"))
    try:
        for step in range(1, 5):
            a.save(step, _model_state(step))
            b.save(step, _optim_state(step))
        assert len(balanced) == 2, "one layout built per manager; every later save reused its own"
        assert a.roots[-1].store.memo is not b.roots[-1].store.memo
        assert a.roots[-1].store.memo.layout.fqns != b.roots[-1].store.memo.layout.fqns
        for step in range(1, 5):
            for mgr, make, scalar in ((a, _model_state, "step"), (b, _optim_state, "lr")):
                out = target_like(make(step))
                out[scalar] = None
                mgr.restore(step, out)
                assert_bitwise_equal(out, make(step))
    finally:
        a.close()
        b.close()


def test_save_state_dict_without_a_memo_remembers_nothing(tmp_path, monkeypatch):
    """No process-global memo: without ``memo=``, a save neither reuses nor leaves a layout."""
    balanced = []
    real = write._balance
    monkeypatch.setattr(write, "_balance", lambda *a, **k: balanced.append(1) or real(*a, **k))
    storage = Storage(str(tmp_path))
    memo = write.WriteMemo()
    for k in range(2):
        storage.makedirs(str(tmp_path / f"plain{k}"))
        save_state_dict(storage, str(tmp_path / f"plain{k}"), _model_state(1))
    assert len(balanced) == 2
    for k in range(2):
        storage.makedirs(str(tmp_path / f"memo{k}"))
        save_state_dict(storage, str(tmp_path / f"memo{k}"), _model_state(1), memo=memo)
    assert len(balanced) == 3 and memo.layout is not None


def test_importing_async_ckpt_leaves_the_warning_filters_alone():
    script = textwrap.dedent("""
        import warnings
        import torch, torch.distributed.checkpoint  # their own import-time filters are theirs
        before = list(warnings.filters)
        import async_ckpt, async_ckpt.io, async_ckpt.manager, async_ckpt.cli
        assert warnings.filters == before, [f for f in warnings.filters if f not in before]
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_single_process_save_and_restore_emit_no_dcp_warning(tmp_path):
    """Neither the planner-free save, nor ``dcp.save`` (a Stateful value), nor the restore
    (``dcp.load``) shows DCP's single-process warning, even with every warning shown; and the
    filters are as they were afterwards."""
    model = torch.nn.Linear(5, 3)
    w = torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        with CheckpointManager(str(tmp_path / "ck")) as mgr:
            mgr.save(1, {"w": w})
            out = {"w": torch.zeros(4, 4)}
            mgr.restore(1, out)  # through dcp.load
        storage = Storage(str(tmp_path))
        storage.makedirs(str(tmp_path / "stateful"))
        save_state_dict(storage, str(tmp_path / "stateful"), {"model": model})  # through dcp.save
        other = torch.nn.Linear(5, 3)
        load_state_dict(storage, str(tmp_path / "stateful"), {"model": other}, files=None)
        assert warnings.filters == before
    assert_bitwise_equal(out, {"w": w})
    assert_bitwise_equal(other.state_dict(), model.state_dict())
    assert not [m for m in caught if DCP_WARNING in str(m.message)], [str(m.message) for m in caught]


def test_overlapping_quiet_blocks_on_two_threads_leave_other_filters_alone():
    """Two writer threads' DCP calls overlap while the main thread adds a filter: when both end,
    the main thread's filter is still there and none of async_ckpt's is left behind (what
    ``warnings.catch_warnings`` on each thread would get wrong)."""
    first_in, second_in, first_out, main_done = (threading.Event() for _ in range(4))

    def first():
        with dcp_common._single_process_quiet():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with dcp_common._single_process_quiet():
            second_in.set()
            main_done.wait(10)

    with warnings.catch_warnings():
        before = list(warnings.filters)
        t1, t2 = threading.Thread(target=first), threading.Thread(target=second)
        t1.start()
        t2.start()
        assert first_out.wait(10)
        warnings.filterwarnings("ignore", message="added by the training loop")
        mine = warnings.filters[0]
        with warnings.catch_warnings(record=True) as caught:  # still silenced while one block runs
            warnings.warn(DCP_WARNING + ", assuming the intent is to save in a single process.")
        main_done.set()
        t1.join(10)
        t2.join(10)
        assert not caught
        assert warnings.filters == [mine] + before


def test_plain_dcp_checkpoint_of_conjugate_and_negative_views_restores_their_values(tmp_path):
    """torch.save stores a conjugate (negative) view's bytes unresolved, with {'conj': True}
    ({'neg': True}) beside them: async_ckpt's reader gives the values, as dcp.load does."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    sd = {"c": torch.randn(100000, dtype=torch.complex64, generator=g).conj(),
          "n": torch.randn(100000, generator=g)._neg_view(),
          "small": torch.randn(5, dtype=torch.complex64, generator=g).conj()}
    ref = {k: v.resolve_conj().resolve_neg().clone() for k, v in sd.items()}
    p = str(tmp_path / "dcp")
    dcp.save(sd, checkpoint_id=p, no_dist=True)
    target = {k: torch.zeros_like(v) for k, v in ref.items()}
    load_state_dict(Storage(p), p, target, files=None)
    assert_bitwise_equal(target, ref)
