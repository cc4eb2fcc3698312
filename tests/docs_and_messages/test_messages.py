"""What users see: error types, warnings, log lines, key mismatches, Ctrl-C, read-only roots."""

from __future__ import annotations

import math

import pytest
import torch

import async_ckpt
from async_ckpt import CheckpointError, CheckpointManager, InvalidArgumentError

from ..conftest import assert_bitwise_equal, clone_tree, data_files, flip_byte
from ..support.paths import REPO


# ---- invalid arguments are CheckpointErrors ------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(save_interval=0), dict(max_to_keep=-1), dict(write_threads=0),
                                    dict(commit_mode="bogus"), dict(lazy="yes"), dict(stats_log=3),
                                    dict(max_pending_async=0), dict(local_dir=".", local_policy=0)])
def test_invalid_constructor_arguments_are_checkpoint_errors(tmp_path, kwargs):
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(str(tmp_path / "ckpt"), **kwargs)
    assert isinstance(info.value, InvalidArgumentError)
    assert isinstance(info.value, (ValueError, TypeError))


@pytest.mark.parametrize("metrics,kind", [({"loss": math.nan}, ValueError), ({"loss": "low"}, TypeError),
                                          ({1: 0.5}, TypeError), ([0.5], TypeError)])
def test_bad_metrics_at_a_save_step_raise_a_checkpoint_error(tmp_path, metrics, kind):
    sd = {"w": torch.arange(4.0)}
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        caught = None
        try:  # the documented loop: catch CheckpointError and go on training
            mgr.save(1, sd, metrics=metrics)
        except CheckpointError as exc:
            caught = exc
        assert isinstance(caught, InvalidArgumentError) and isinstance(caught, kind)
        assert mgr.save(2, sd, metrics={"loss": 1.0})
        assert mgr.all_steps() == [2]


def test_invalid_policy_arguments_are_checkpoint_errors():
    for make in (lambda: async_ckpt.EveryNSteps(0), lambda: async_ckpt.KeepLatest(0),
                 lambda: async_ckpt.EveryTSeconds(-1), lambda: async_ckpt.KeepBest(1, "loss", mode="up"),
                 lambda: async_ckpt.AnyOf([])):
        with pytest.raises(InvalidArgumentError):
            make()


# ---- key mismatches, key_map, keys the target lacks ------------------------------------------------
def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _prefixed(sd, prefix):
    return {prefix + k: v for k, v in sd.items()}


def test_a_prefix_mismatch_names_both_sides_and_the_key_map_that_fixes_it(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = _prefixed(_model(0).state_dict(), "module.")  # saved from a DDP-wrapped model
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": saved})
    target = {"model": _model(1).state_dict()}
    before = clone_tree(target)
    mgr = CheckpointManager(root)
    with pytest.raises(async_ckpt.StateDictMismatchError) as info:
        mgr.restore(1, target)
    msg = str(info.value)
    assert "missing from checkpoint: model.0.weight" in msg, msg
    assert "match no key of state_dict: model.module.0.weight" in msg, msg
    assert "key_map={'model.module.': 'model.'}" in msg, msg
    assert "strict=False" in msg and "async-ckpt show" in msg, msg
    assert_bitwise_equal(target, before)
    # the suggested key_map restores it, bitwise
    assert mgr.restore(1, target, key_map={"model.module.": "model."}) == 1
    assert_bitwise_equal(target["model"], {k[len("module."):]: v for k, v in saved.items()})


@pytest.mark.parametrize("wrap", ["_orig_mod.", "module."])
def test_key_map_adds_and_strips_prefixes_both_ways(tmp_path, wrap):
    root = str(tmp_path / "ckpt")
    plain = _model(0).state_dict()
    with CheckpointManager(root) as mgr:
        mgr.save(1, dict(plain), metrics={"loss": 1.0})  # a flat model state dict
        mgr.save(2, _prefixed(plain, wrap))
    mgr = CheckpointManager(root)
    # a plain checkpoint into a wrapped (compiled / DDP) model
    target = _prefixed(_model(1).state_dict(), wrap)
    with pytest.raises(async_ckpt.StateDictMismatchError, match=f"key_map={{'': '{wrap}'}}"):
        mgr.restore(1, target)
    assert mgr.restore(1, target, key_map={"": wrap}) == 1
    assert_bitwise_equal(target, _prefixed(plain, wrap))
    # a wrapped checkpoint into a plain model
    target = _model(2).state_dict()
    assert mgr.restore(2, target, key_map={wrap: ""}) == 2
    assert_bitwise_equal(target, plain)


def test_key_map_with_an_optimizer_and_non_tensor_values(tmp_path):
    root = str(tmp_path / "ckpt")
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    sd = {"model": _prefixed(model.state_dict(), "_orig_mod."), "optim": opt.state_dict(), "epoch": 7}
    saved = clone_tree(sd)
    with CheckpointManager(root) as mgr:
        mgr.save(3, sd)
    model2 = _model(1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    model2(torch.ones(2, 3)).sum().backward()
    opt2.step()
    target = {"model": model2.state_dict(), "optim": opt2.state_dict(), "epoch": 0}
    assert CheckpointManager(root).restore(3, target, key_map={"model._orig_mod.": "model."}) == 3
    assert target["epoch"] == 7 and target["optim"]["param_groups"][0]["lr"] == 0.01
    assert_bitwise_equal(target["optim"], saved["optim"])
    assert_bitwise_equal(target["model"], {k[len("_orig_mod."):]: v for k, v in saved["model"].items()})


def test_bad_key_maps_are_invalid_arguments(tmp_path):
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"a": torch.ones(2), "b": torch.ones(2)})
        for bad in ({"a": 1}, ["a"], {"x.": "", "y.": ""}):
            with pytest.raises(InvalidArgumentError):
                mgr.restore(1, {"a": torch.zeros(2)}, key_map=bad)
        with pytest.raises(InvalidArgumentError, match="same checkpoint key"):
            mgr.restore(1, {"a": torch.zeros(2), "x.a": torch.zeros(2)}, key_map={"": "x."})


def test_a_target_lacking_a_layer_is_not_extended_and_the_keys_are_named(tmp_path):
    root = str(tmp_path / "ckpt")
    big = _model(0).state_dict()
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": big})
    small = {"model": {k: torch.zeros_like(v) for k, v in big.items() if not k.startswith("2.")}}
    with pytest.warns(UserWarning, match=r"has keys the state_dict lacks.*not restored \(nor added.*model\.2\.weight") \
            as rec:
        CheckpointManager(root).restore(1, small)
    assert sorted(small["model"]) == ["0.bias", "0.weight"], "nothing added to the caller's dict"
    assert_bitwise_equal(small["model"], {k: big[k] for k in ("0.weight", "0.bias")})
    assert rec[0].filename == __file__, "the warning points at the caller's line"
    # a fresh optimizer's empty state, and an empty target, are still filled
    empty: dict = {}
    CheckpointManager(root).restore(1, empty)
    assert_bitwise_equal(empty, {"model": big})


def test_restore_latest_and_a_module_passed_instead_of_its_state_dict(tmp_path):
    root = str(tmp_path / "ckpt")
    model = _model(0)
    with CheckpointManager(root) as mgr:
        mgr.save(4, {"model": model.state_dict()})
        mgr.save(6, {"model": model.state_dict()})
        with pytest.raises(async_ckpt.InvalidStateDictError, match=r"pass its state_dict\(\)"):
            mgr.save(8, model)
        with pytest.raises(async_ckpt.InvalidStateDictError, match=r"pass its state_dict\(\)"):
            mgr.restore(None, model)
        target = {"model": _model(1).state_dict()}
        assert mgr.restore("latest", target) == 6
        assert_bitwise_equal(target["model"], model.state_dict())
        with pytest.raises(async_ckpt.InvalidStepError):
            mgr.restore("newest", target)


# ---- logging ---------------------------------------------------------------------------------------
def test_log_lines_have_one_prefix_fitting_units_and_a_restore_line(tmp_path, caplog):
    import logging

    root = str(tmp_path / "ckpt")
    sd = {"w": torch.arange(1000, dtype=torch.float32)}  # 3.9 KiB: "0.0 MiB, 0.00 GB/s" before
    caplog.set_level(logging.INFO, logger="async_ckpt")
    with CheckpointManager(root) as mgr:
        mgr.save(3, sd)
    target = {"w": torch.zeros(1000)}
    CheckpointManager(root).restore(None, target)
    assert_bitwise_equal(target, sd)
    fmt = logging.Formatter(logging.BASIC_FORMAT)
    lines = [fmt.format(r) for r in caplog.records if r.name.startswith("async_ckpt")]
    assert lines and not any("async_ckpt:async_ckpt" in ln for ln in lines), lines
    saved = [ln for ln in lines if "saved step 3" in ln]
    assert saved and saved[0].startswith("INFO:async_ckpt:saved step 3: 3.9 KiB in 1 tensor, "), saved
    assert "iB/s" in saved[0], saved
    assert not any(u in saved[0] for u in (" kB/s", " MB/s", " GB/s")), saved  # binary units, as the sizes
    assert "0.0 MiB" not in saved[0] and "0.00 GB/s" not in saved[0], saved
    restored = [ln for ln in lines if "restored step 3" in ln]
    assert len(restored) == 1 and "3.9 KiB in 1 tensor in " in restored[0] and root in restored[0], lines


def test_format_helpers_pick_units():
    from async_ckpt.stats import format_bytes, format_rate, format_seconds

    assert format_bytes(512) == "512 B" and format_bytes(4000) == "3.9 KiB" and format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_seconds(35e-6) == "35 us" and format_seconds(0.0012) == "1.2 ms" and format_seconds(3.4) == "3.40 s"
    assert format_rate(4000, 0.001) == "3.81 MiB/s" and format_rate(10, 0) == "-" and format_rate(5, 1) == "5 B/s"
    # binary units throughout, as sizes are: no "kB/s" beside "25.5 KiB"
    assert format_rate(26_240, 1) == "25.62 KiB/s" and format_rate(3 * 2**30, 2) == "1.50 GiB/s"


def test_a_fallback_that_succeeded_does_not_say_the_target_must_not_be_used(tmp_path):
    import os

    root = str(tmp_path / "ckpt")
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.full((4096,), 1.0)})
        mgr.save(2, {"w": torch.full((4096,), 2.0)})
    (data,) = data_files(os.path.join(root, "2"))
    flip_byte(data, mask=0xFF)  # a byte in the middle of the tensor data
    target = {"w": torch.zeros(4096)}
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2") as rec:
        assert CheckpointManager(root).restore(None, target) == 1
    msgs = [str(w.message) for w in rec if "skipping" in str(w.message)]
    assert msgs and not any("must not be used" in m for m in msgs), msgs
    assert all(w.filename == __file__ for w in rec if "skipping" in str(w.message))
    assert_bitwise_equal(target, {"w": torch.full((4096,), 1.0)})


# ---- the root: typos, step directories, read-only use ------------------------------------------------
def test_a_new_root_is_reported_and_a_step_dir_or_a_parent_of_roots_warns(tmp_path, caplog):
    import logging
    import os

    caplog.set_level(logging.INFO, logger="async_ckpt")
    real = str(tmp_path / "checkpoints" / "run1")
    with CheckpointManager(real) as mgr:
        mgr.save(5, {"w": torch.ones(3)})
    caplog.clear()
    typo = str(tmp_path / "chekpoints" / "run1")
    mgr = CheckpointManager(typo)
    assert any("is new and empty" in r.getMessage() and typo in r.getMessage() for r in caplog.records)
    assert mgr.latest_step() is None
    caplog.clear()
    CheckpointManager(real)
    assert not any("new and empty" in r.getMessage() for r in caplog.records)
    with pytest.warns(UserWarning, match="looks like one step's directory.*pass the checkpoint root") as rec:
        CheckpointManager(os.path.join(real, "5"))
    assert rec[0].filename == __file__
    with pytest.warns(UserWarning, match="looks like the parent of checkpoint roots.*run1"):
        CheckpointManager(str(tmp_path / "checkpoints"))


def test_a_root_that_is_a_file_is_a_typed_error_naming_it(tmp_path):
    from async_ckpt import NotACheckpointRootError

    f = tmp_path / "ckpt"
    f.write_text("not a directory")
    with pytest.raises(NotACheckpointRootError, match=r"ckpt is a file, not a directory: pass a directory") as e:
        CheckpointManager(str(f))
    assert "File exists" not in str(e.value)
    with pytest.raises(NotACheckpointRootError, match=r"sub cannot be written: .*ckpt is a file, not a directory"):
        CheckpointManager(str(f / "sub"))
    with pytest.raises(NotACheckpointRootError, match=r"local_dir .* is a file"):
        CheckpointManager(str(tmp_path / "bucket"), local_dir=str(f))
    assert f.read_text() == "not a directory"


def test_metrics_reduce_names_its_choices(tmp_path):
    with pytest.raises(async_ckpt.InvalidArgumentError, match=r"metrics_reduce must be one of \('rank0', 'mean', "
                                                            r"'min', 'max'\).*got 'avg'"):
        CheckpointManager(str(tmp_path / "c"), metrics_reduce="avg")
    with CheckpointManager(str(tmp_path / "c"), metrics_reduce="mean") as mgr:  # one process: as given
        mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": 0.5})
        assert mgr.metrics(1) == {"loss": 0.5}


def test_save_interval_with_a_save_policy_warns(tmp_path):
    with pytest.warns(UserWarning, match="save_interval=5 is ignored") as rec:
        CheckpointManager(str(tmp_path / "c"), save_interval=5, save_policy=async_ckpt.EveryNSteps(2))
    # the caller's line, as every warn_user warning (not ManagerOptions' generated __init__: '<string>')
    assert rec[0].filename == __file__, rec[0].filename
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CheckpointManager(str(tmp_path / "c"), save_policy=async_ckpt.EveryNSteps(2))
        CheckpointManager(str(tmp_path / "c"), save_interval=5)


def test_a_read_only_root_lists_and_restores(tmp_path):
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs read-only (root ignores chmod)")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        root = str(mnt / "ckpt")
        sd = {"w": torch.randn(64), "step": 3}
        with CheckpointManager(root) as mgr:
            mgr.save(3, sd, metrics={"loss": 0.5})
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)]).returncode == 0
        reader = CheckpointManager(root)  # needed write access before
        assert reader.all_steps() == [3] and reader.latest_step() == 3 and reader.metrics(3) == {"loss": 0.5}
        target = {"w": torch.zeros(64), "step": 0}
        assert reader.restore(None, target) == 3
        assert_bitwise_equal(target, sd)
        with pytest.raises(async_ckpt.StorageError, match="cannot be written|not writable|read-only"):
            reader.save(4, sd)  # the first save checks writability
        reader.close()
        assert "3" in os.listdir(root)
    finally:
        subprocess.run(["umount", str(mnt)])


# ---- values that need allow_pickle ----------------------------------------------------------------
def test_values_needing_allow_pickle_warn_once_at_save_and_fail_restore_briefly(tmp_path):
    import collections
    import fractions
    import warnings

    root = str(tmp_path / "ckpt")
    sd = {"w": torch.arange(6.0), "frac": fractions.Fraction(1, 3), "cfg": {"a": 1, "b": [1.5, "x"]},
          "od": collections.OrderedDict(a=1), "s": {1, 2}}
    with CheckpointManager(root) as mgr:
        with pytest.warns(UserWarning, match=r"allow_pickle=True.*frac \(fractions\.Fraction\)") as rec:
            mgr.save(1, sd)
        msgs = [str(w.message) for w in rec if "allow_pickle" in str(w.message)]
        import re

        assert len(msgs) == 1 and re.search(r"safe set\): ([^;]*);", msgs[0]).group(1) == "frac (fractions.Fraction)"
        assert rec[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.save(2, sd)  # once per key
    target = {"w": torch.zeros(6), "frac": None, "cfg": {"a": 0, "b": [0.0, ""]}, "od": {"a": 0}, "s": None}
    reader = CheckpointManager(root)
    for atomic in (False, True):
        with pytest.raises(async_ckpt.UnsafeCheckpointError) as info:
            reader.restore(2, target, atomic=atomic)
        msg = str(info.value)
        assert "\x1b" not in msg and len(msg) < 400, msg
        assert "frac" in msg and "fractions.Fraction" in msg and "allow_pickle=True" in msg, msg
    assert reader.restore(2, target, allow_pickle=True) == 2
    assert target["frac"] == fractions.Fraction(1, 3) and target["s"] == {1, 2}
    assert_bitwise_equal(target["w"], sd["w"])


# ---- Ctrl-C during a save ------------------------------------------------------------------------
def test_ctrl_c_twice_during_a_save_says_so_and_leaves_no_partial_step(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    root = str(tmp_path / "ckpt")  # the worker saves to <tmp_path>/ckpt through a slow filesystem
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "tests.workers.sigint_worker", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "SAVING"
        proc.send_signal(signal.SIGINT)
        # the notice goes to stderr (logging's last resort handler: no logging configured)
        line = proc.stderr.readline()
        assert "finishing the save of step 2; Ctrl-C again to abandon it" in line, line
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "abandoned the save of step 2" in err, err
    assert "threading" not in err and "Exception ignored" not in err, err
    assert err.count("Traceback") <= 1, err  # the loop's own KeyboardInterrupt, nothing else
    names = os.listdir(root)
    assert not [n for n in names if n.startswith((".tmp-", ".trash-")) or n.startswith("2")], names
    target = {"w": torch.zeros(1000)}
    mgr = CheckpointManager(root)
    assert mgr.all_steps() == [1] and mgr.restore(None, target) == 1
    assert_bitwise_equal(target, {"w": torch.arange(1000, dtype=torch.float32)})


def test_the_example_loop_saves_its_last_steps(tmp_path):
    import os
    import subprocess
    import sys

    repo = REPO
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo] + sys.path), PJRT_DEVICE="CPU")
    out = subprocess.run([sys.executable, os.path.join(repo, "examples", "train.py"), "--steps", "7",
                          "--save-interval", "5", "--ckpt-dir", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert CheckpointManager(str(tmp_path / "ckpt")).all_steps() == [0, 5, 6], out.stdout


# ---- no false alarms when a script ends ----------------------------------------------------------
_DROPPED_AND_EXIT = """
import sys, threading, weakref
import torch
from async_ckpt import CheckpointManager
from tests.support import faulty_fs  # noqa: F401  (faulty://)

# A manager dropped without close() while two saves are pending: collected on its writer thread.
mgr = CheckpointManager(sys.argv[1])
mgr.save_async(1, {"w": torch.ones(100_000)})
mgr.save_async(2, {"w": torch.full((100_000,), 2.0)})
gone = weakref.ref(mgr)
del mgr
while gone() is not None:
    threading.Event().wait(0.01)
for t in threading.enumerate():
    if t is not threading.current_thread() and t.name.startswith("async-ckpt"):
        t.join(30)
# A plain exit while a save is pending (its first data file held for a moment): no Ctrl-C anywhere.
late = CheckpointManager("faulty://" + sys.argv[2])
stuck = late.storage.fs.inject("write", "*.distcp", "hang", times=1)
late.save_async(1, {"w": torch.ones(10)})
assert stuck.reached.wait(30)
threading.Timer(float(sys.argv[3]), stuck.release.set).start()
print("EXITING", flush=True)
"""


@pytest.mark.parametrize("hold_s", [0.3, 6.0], ids=["quick", "slow"])
def test_a_dropped_manager_and_a_plain_exit_raise_no_false_alarm(tmp_path, hold_s):
    """A manager dropped without ``close()`` while saves were pending logged "had a failed save:
    cannot join current thread" (its finalizer ran on its own writer thread), though both steps
    committed; a plain script exit with a pending save printed "Ctrl-C again to abandon it" with
    no Ctrl-C. Now stderr says nothing, or, for a save still running after a few seconds, that it
    is finishing before the exit (and that Ctrl-C abandons it); every step commits."""
    import os
    import subprocess
    import sys

    repo = REPO
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    out = subprocess.run([sys.executable, "-c", _DROPPED_AND_EXIT, a, b, str(hold_s)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=repo, PJRT_DEVICE="CPU"), cwd=repo, timeout=300)
    assert out.returncode == 0 and "EXITING" in out.stdout, out.stderr[-3000:]
    assert "failed" not in out.stderr and "Ctrl-C again" not in out.stderr, out.stderr[-3000:]
    notice = "still finishing the save of step 1 before exiting; Ctrl-C to abandon it"
    assert out.stderr.count("finishing") == out.stderr.count(notice) == (0 if hold_s < 1 else 1), out.stderr[-3000:]
    assert CheckpointManager(a).all_steps() == [1, 2] and CheckpointManager(b).all_steps() == [1]


def test_ctrl_c_while_closing_with_no_save_pending_says_no_save_was_lost(tmp_path, caplog):
    """Close waits for a retention deletion (held by the storage); a Ctrl-C then abandons no
    save: the message must not say a save was abandoned."""
    import _thread
    import logging
    import threading

    from ..support.faulty_fs import FaultyFileSystem  # noqa: F401 - registers faulty://

    root = str(tmp_path / "faulty")
    mgr = CheckpointManager("faulty://" + root, max_to_keep=1)
    fs = mgr.storage.fs
    mgr.save(1, {"w": torch.ones(8)})
    stuck = fs.inject("rm", "*.distcp", "hang", times=1)
    mgr.save(2, {"w": torch.ones(8) * 2})  # retention deletes step 1 in the background: held
    assert stuck.reached.wait(30)
    threading.Timer(0.5, _thread.interrupt_main).start()
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        try:
            mgr.close()
        except KeyboardInterrupt:
            pass
        finally:
            stuck.release.set()
    text = caplog.text
    assert "abandoned the save" not in text, text
    assert "closing interrupted (Ctrl-C): no save was being written; committed steps are kept" in text, text
    assert CheckpointManager(root).all_steps() == [2]


def test_a_negative_max_to_keep_says_none_keeps_every_step(tmp_path):
    with pytest.raises(InvalidArgumentError) as ei:  # Lightning's save_top_k=-1 habit
        CheckpointManager(str(tmp_path / "ckpt"), max_to_keep=-1)
    assert str(ei.value) == ("max_to_keep must be an int >= 0 or None, got -1: pass None (or 0) to keep every "
                             "step, N > 0 to keep the N newest")
