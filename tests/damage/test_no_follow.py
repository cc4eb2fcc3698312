"""Nothing async_ckpt writes under a root follows a symbolic link planted there.

A shared checkpoint directory, or a local tier under a world-writable ``/dev/shm`` that
another user created first, may hold links named like the files async_ckpt writes: the
writer lock, a step's pending sentinel, the stats log. Each must be refused with a clear
error, and the file the link points to must stay as it was.
"""

from __future__ import annotations

import os

import pytest

from async_ckpt import CheckpointManager, StorageError
from async_ckpt.format.manifest import PENDING_NAME
from async_ckpt.storage.lease import LOCK_NAME

from ..conftest import assert_bitwise_equal, small_state, target_like

VICTIM = b"precious: owned by the user whose job writes checkpoints\n"


@pytest.fixture
def victim(tmp_path):
    p = tmp_path / "victim.txt"
    p.write_bytes(VICTIM)
    return p


def test_the_lock_file_is_never_written_through_a_link(tmp_path, victim):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(victim, root / LOCK_NAME)
    mgr = CheckpointManager(str(root))
    with pytest.raises(StorageError, match="symbolic link"):
        mgr.save(1, small_state(1))
    with pytest.raises(StorageError, match="symbolic link"):
        mgr.delete(1)
    mgr.close()
    assert victim.read_bytes() == VICTIM
    assert os.path.islink(root / LOCK_NAME)


def test_a_hard_linked_lock_file_is_refused(tmp_path, victim):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.link(victim, root / LOCK_NAME)
    mgr = CheckpointManager(str(root))
    with pytest.raises(StorageError, match="hard link"):
        mgr.save(1, small_state(1))
    mgr.close()
    assert victim.read_bytes() == VICTIM


@pytest.mark.parametrize("how", ["retention", "delete"])
def test_the_pending_sentinel_is_never_written_through_a_link(tmp_path, victim, how):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(str(root), max_to_keep=1 if how == "retention" else 0)
    assert mgr.save(1, small_state(1))
    os.symlink(victim, root / "1" / PENDING_NAME)  # planted in a committed step directory
    if how == "retention":
        assert mgr.save(2, small_state(2))  # retention cannot condemn step 1: logged, the save stands
        mgr.join()
    else:
        with pytest.raises(StorageError, match="symbolic link"):
            mgr.delete(1)
    assert victim.read_bytes() == VICTIM
    assert 1 in mgr.all_steps()  # not deleted: still committed and whole
    target = target_like(small_state(0))
    mgr.restore(1, target)
    assert_bitwise_equal(target, small_state(1))
    mgr.close()


@pytest.mark.parametrize("relpath", ["save_stats.jsonl", "logs/stats.jsonl"])
def test_the_stats_log_is_never_appended_through_a_link(tmp_path, victim, relpath, caplog):
    root = tmp_path / "ckpt"
    root.mkdir()
    if "/" in relpath:  # the log's directory is a link to the victim's directory
        os.symlink(victim.parent, root / "logs")
        victim = victim.parent / "stats.jsonl"
        victim.write_bytes(VICTIM)
    else:
        os.symlink(victim, root / relpath)
    mgr = CheckpointManager(str(root), stats_log=relpath)
    with caplog.at_level("WARNING", logger="async_ckpt"):
        assert mgr.save(1, small_state(1))  # the log fails, the save does not
    mgr.close()
    assert victim.read_bytes() == VICTIM
    assert any("stats log" in r.getMessage() and "symbolic link" in r.getMessage() for r in caplog.records)
    assert CheckpointManager(str(root)).all_steps() == [1]


def test_the_stats_log_still_appends_to_a_plain_file(tmp_path):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(str(root), stats_log="logs/stats.jsonl")
    assert mgr.save(1, small_state(1)) and mgr.save(2, small_state(2))
    mgr.close()
    lines = (root / "logs" / "stats.jsonl").read_text().splitlines()
    assert len(lines) == 2


# ---- hard links: a second name of a file outside the root is never written in place -------------

@pytest.mark.parametrize("how", ["retention", "delete", "rm", "prune", "cleanup"])
def test_a_hard_linked_pending_sentinel_is_never_written_through(tmp_path, victim, how):
    from async_ckpt.cli import main

    root = tmp_path / "ckpt"
    mgr = CheckpointManager(str(root), max_to_keep=1 if how == "retention" else 0)
    assert mgr.save(1, small_state(1))
    if how == "cleanup":  # an unmarked step directory async_ckpt left (its sentinel: a hard link)
        (root / "7").mkdir()
        os.link(victim, root / "7" / PENDING_NAME)
        mgr.close()
        mgr = CheckpointManager(str(root))
        assert mgr.save(2, small_state(2))  # the new writer's cleanup refuses that directory
        mgr.join()
        mgr.close()
    else:
        os.link(victim, root / "1" / PENDING_NAME)  # planted in a committed step directory
        if how == "retention":
            assert mgr.save(2, small_state(2))  # retention cannot condemn step 1: logged, the save stands
            mgr.join()
        elif how == "delete":
            with pytest.raises(StorageError, match="hard link"):
                mgr.delete(1)
        mgr.close()
        if how == "prune":
            with CheckpointManager(str(root)) as other:
                assert other.save(2, small_state(2))
        if how in ("rm", "prune"):  # refused (an error exit), the step kept
            args = ["rm", str(root), "1"] if how == "rm" else ["prune", str(root), "--keep-last", "1"]
            assert main(args) != 0
    assert victim.read_bytes() == VICTIM
    assert os.stat(victim).st_nlink == 2  # the planted name is left where it was
    if how != "cleanup":
        assert 1 in CheckpointManager(str(root)).all_steps()  # not deleted: still committed and whole
        target = target_like(small_state(0))
        CheckpointManager(str(root)).restore(1, target)
        assert_bitwise_equal(target, small_state(1))


def test_the_stats_log_is_never_appended_through_a_hard_link(tmp_path, victim, caplog):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.link(victim, root / "save_stats.jsonl")
    mgr = CheckpointManager(str(root), stats_log=True)
    with caplog.at_level("WARNING", logger="async_ckpt"):
        assert mgr.save(1, small_state(1))  # the log fails, the save does not
    mgr.close()
    assert victim.read_bytes() == VICTIM
    assert any("stats log" in r.getMessage() and "hard link" in r.getMessage() for r in caplog.records)


def test_a_file_removed_while_it_is_opened_for_writing_is_not_called_a_hard_link(tmp_path, monkeypatch):
    """A file another program removes between async_ckpt's open and its check (a user's cleanup
    deleting a directory while a save is pending) has no name left: that is said as it is, a
    FileNotFoundError naming the path, not a refusal of a hard link with "0 names"."""
    from async_ckpt.storage.backends.posix import open_own_file

    path = tmp_path / "model.bin"
    real_fstat = os.fstat

    def removed_first(fd, *a, **k):
        if os.path.exists(path):
            os.unlink(path)  # the other program's rm, right after our open
        return real_fstat(fd, *a, **k)

    monkeypatch.setattr(os, "fstat", removed_first)
    with pytest.raises(FileNotFoundError, match="removed by another program") as err:
        open_own_file(str(path), os.O_WRONLY | os.O_CREAT, 0o644)
    assert err.value.filename == str(path)
    monkeypatch.setattr(os, "fstat", real_fstat)
    fd = open_own_file(str(path), os.O_WRONLY | os.O_CREAT, 0o644)  # no race: opens
    os.close(fd)
