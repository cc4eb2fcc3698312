"""Readers of a live run: an evaluation job lists and restores while the training job saves.

A writer moves steps (a rename commit puts ``.tmp-<step>-<token>/`` in place) and deletes them
(retention) while a reader reads them: the reader must never call such a step damaged, never
raise for a step it chose itself, and ``restore(None)`` must take the newest step that exists
when it reads. The state saved at each step encodes the step, so every restore is checked bit
for bit against the commit it returned.

The races are forced one by one with ``faulty://`` (a read of the reader held while the writer
deletes; the object-store code paths over local files), and run freely with a writer and a
reader in two processes (POSIX rename commits and object-store marker commits).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

from async_ckpt import CheckpointError, CheckpointManager, InvalidArgumentError, InvalidStepError, StepNotFoundError

from ..conftest import assert_bitwise_equal
from ..support.paths import REPO


def state(step: int) -> dict:
    """What the writer saves at ``step``: every value says which step it is."""
    return {"w": torch.full((4096,), float(step)), "b": torch.arange(64, dtype=torch.int64) + step, "step": step}


def target() -> dict:
    return {"w": torch.zeros(4096), "b": torch.zeros(64, dtype=torch.int64), "step": -1}


def _ours(caught, records):
    """The warnings and log records (WARNING and up) async_ckpt issued."""
    return ([str(w.message) for w in caught if "async_ckpt" in str(w.message)]
            + [r.getMessage() for r in records if r.name.startswith("async_ckpt") and r.levelno >= logging.WARNING])


def _in_thread(fn):
    """Run ``fn`` on a thread; returns (thread, outcome dict with "value" or "error")."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# ---- each race, forced -------------------------------------------------------------------------

@pytest.fixture
def live(tmp_path):
    """A writer (max_to_keep=2) that committed steps 1 and 2 under a ``faulty://`` root, and a
    plain manager on the same root as the reader (its own filesystem: faults hit it alone)."""
    url = f"faulty://{tmp_path}/ckpt"
    writer = CheckpointManager(url, max_to_keep=2)
    assert writer.save(1, state(1)) and writer.save(2, state(2))
    reader = CheckpointManager(url)
    yield writer, reader
    reader.close()
    writer.close()


def _delete_while_read(writer, reader, pattern, call):
    """Hold the reader's first read of a file named ``pattern`` inside ``call``; meanwhile the
    writer saves steps 3 and 4, whose retention deletes steps 1 and 2; then let it go on."""
    stuck = reader.storage.fs.inject("read", pattern, "hang", times=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t, out = _in_thread(call)
        assert stuck.reached.wait(30)
        assert writer.save(3, state(3)) and writer.save(4, state(4))
        writer.join()
        assert writer.roots[-1].store.wait_idle(30)  # the dropped steps' files are gone
        assert writer.all_steps() == [3, 4]
        stuck.release.set()
        t.join(60)
    assert not t.is_alive()
    return out, caught


def test_restore_none_takes_the_newest_step_when_the_one_it_reads_is_deleted(live, caplog):
    writer, reader = live
    t = target()
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        out, caught = _delete_while_read(writer, reader, ".metadata", lambda: reader.restore(None, t))
    assert "error" not in out, out.get("error")
    assert out["value"] == 4  # not a warning about step 2, not StepNotFoundError for step 1
    assert_bitwise_equal(t, state(4))
    assert _ours(caught, caplog.records) == []


def test_restore_none_after_its_choice_was_deleted_before_it_opened_it(live, caplog):
    writer, reader = live
    t = target()
    # held at the first manifest the restore reads after listing (the listing reads them too)
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        out, caught = _delete_while_read(writer, reader, "COMMITTED", lambda: reader.restore(None, t))
    assert "error" not in out, out.get("error")
    assert out["value"] == 4
    assert_bitwise_equal(t, state(4))
    assert _ours(caught, caplog.records) == []


def test_a_named_step_deleted_while_it_is_read_is_not_found_not_damaged(live, caplog):
    writer, reader = live
    t = target()
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        out, caught = _delete_while_read(writer, reader, "*.distcp", lambda: reader.restore(2, t))
    assert isinstance(out.get("error"), StepNotFoundError), out
    assert "while it was being restored" in str(out["error"])
    assert _ours(caught, caplog.records) == []


def test_a_listing_skips_a_step_deleted_meanwhile_without_a_word(live, caplog):
    writer, reader = live
    with caplog.at_level(logging.WARNING, logger="async_ckpt"):
        out, caught = _delete_while_read(writer, reader, "COMMITTED", reader.latest_step)
    assert out.get("value") == 4, out
    assert _ours(caught, caplog.records) == []  # no "ignoring step 1"


def test_real_damage_is_still_damage(live, caplog):
    """The re-check does not excuse damage: a file gone from a step nobody moved is reported."""
    writer, reader = live
    root = writer.storage.root
    os.remove(os.path.join(root, "2", ".metadata"))
    t = target()
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2"):
        assert reader.restore(None, t) == 1
    assert_bitwise_equal(t, state(1))


# ---- a writer and a reader in two processes ------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import torch
    import tests.support.faulty_fs  # noqa: F401  (registers faulty://)
    from async_ckpt import CheckpointManager

    url, steps = sys.argv[1], int(sys.argv[2])
    with CheckpointManager(url, max_to_keep=2) as mgr:
        for s in range(steps):
            mgr.save_async(s, {{"w": torch.full((4096,), float(s)), "b": torch.arange(64, dtype=torch.int64) + s,
                               "step": s}})
    print("done", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("kind,steps", [("file", 300), ("faulty", 150)])
def test_a_reader_follows_a_live_writer(tmp_path, caplog, kind, steps):
    """The recipe of docs/reliability.md against a writer saving every step with max_to_keep=2:
    no warning, no error, every restore bit for bit the commit of the step it returned."""
    root = str(tmp_path / "ckpt")
    url = root if kind == "file" else f"faulty://{root}"
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(repo=REPO), url, str(steps)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader = CheckpointManager(url, read_only=True)
    restored = []
    deadline = time.monotonic() + 120
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="async_ckpt"):
            warnings.simplefilter("always")
            seen = None
            while time.monotonic() < deadline:
                new = reader.wait_for_step(after=seen, timeout=0.5, poll_s=0.005)
                if new is None:
                    if writer.poll() is not None:
                        break
                    continue
                t = target()
                seen = reader.restore(None, t)
                assert seen >= new
                assert_bitwise_equal(t, state(seen))
                restored.append(seen)
    finally:
        out, err = writer.communicate(timeout=120)
        reader.close()
    assert writer.returncode == 0 and out.strip() == "done", err
    assert "WARNING" not in err and "ignoring" not in err and "Traceback" not in err, err
    assert _ours(caught, caplog.records) == []
    assert restored == sorted(set(restored)) and restored[-1] == steps - 1
    assert len(restored) >= 10  # the reader ran alongside the writer


# ---- the read-only manager and wait_for_step -------------------------------------------------

def test_a_read_only_manager_creates_writes_and_deletes_nothing(tmp_path):
    root = tmp_path / "not_yet"
    reader = CheckpointManager(str(root), read_only=True)
    assert not root.exists()  # a reader started before the writer does not create the root
    assert reader.all_steps() == [] and reader.latest_step() is None
    assert reader.wait_for_step(timeout=0) is None
    with pytest.raises(StepNotFoundError):
        reader.restore(None, target())
    for call in (lambda: reader.save(1, state(1)), lambda: reader.save_async(1, state(1), force=True),
                 lambda: reader.delete(1), lambda: reader.promote(1)):
        with pytest.raises(CheckpointError, match="read_only=True"):
            call()
    assert not root.exists()
    with CheckpointManager(str(root)) as writer:
        writer.save(1, state(1))
    written = sorted(os.listdir(root))
    assert reader.wait_for_step(timeout=0) == 1
    with pytest.raises(CheckpointError, match="read_only=True"):
        reader.delete(1)
    t = target()
    assert reader.restore(None, t) == 1
    assert_bitwise_equal(t, state(1))
    reader.close()
    assert sorted(os.listdir(root)) == written  # nothing of the reader's


@pytest.mark.parametrize("kwargs", [{"local_dir": "local"}, {"stats_log": True}, {"chkpt_on_preemption": True},
                                    {"read_only": 1}])
def test_read_only_refuses_what_only_a_writer_uses(tmp_path, kwargs):
    opts = {"read_only": True, **kwargs}
    if "local_dir" in opts:
        opts["local_dir"] = str(tmp_path / "local")
    with pytest.raises(InvalidArgumentError, match="read_only"):
        CheckpointManager(str(tmp_path / "ckpt"), **opts)


@pytest.mark.parametrize("bad", [{"after": -1}, {"timeout": -1}, {"timeout": "1"}, {"poll_s": 0},
                                 {"poll_s": float("inf")}])
def test_wait_for_step_refuses_bad_arguments(tmp_path, bad):
    reader = CheckpointManager(str(tmp_path / "ckpt"), read_only=True)
    with pytest.raises(InvalidStepError if "after" in bad else InvalidArgumentError):
        reader.wait_for_step(**{"timeout": 0, **bad})
    reader.close()


def test_wait_for_step_waits_for_the_next_commit(tmp_path):
    root = str(tmp_path / "ckpt")
    writer = CheckpointManager(root)
    writer.save(5, state(5))
    reader = CheckpointManager(root, read_only=True)
    assert reader.wait_for_step(timeout=0) == 5  # something committed: at once
    assert reader.wait_for_step(after=4, timeout=0) == 5
    t0 = time.monotonic()
    assert reader.wait_for_step(after=5, timeout=0.3, poll_s=0.05) is None  # nothing newer
    assert time.monotonic() - t0 >= 0.3
    timer = threading.Timer(0.3, lambda: writer.save(6, state(6)))
    timer.start()
    assert reader.wait_for_step(after=5, timeout=30, poll_s=0.02) == 6
    timer.join()
    # a run that rolled back saves a lower step: committed while waiting, it counts
    timer = threading.Timer(0.3, lambda: writer.save(2, state(2)))
    timer.start()
    assert reader.wait_for_step(after=6, timeout=30, poll_s=0.02) == 2
    timer.join()
    writer.close()
    reader.close()
