"""Review findings of the two tiers (issue 21): each test fails without its fix."""

from __future__ import annotations

import itertools
import json
import os

import pytest

from async_ckpt import CheckpointManager
from async_ckpt.errors import StorageError
from async_ckpt.lifecycle import coordinator as coordinator_mod

from .conftest import assert_bitwise_equal
from .test_tiers import state, zeros


@pytest.fixture
def roots(tmp_path):
    return str(tmp_path / "bucket"), str(tmp_path / "local")


def test_an_unlistable_bucket_and_an_empty_local_tier_raise_the_listing_error(roots, monkeypatch):
    """A fresh node (empty local_dir) and a bucket that is down: 'no checkpoint' would make the
    job start from scratch (and its saves' retention later drop the bucket's real steps)."""
    path, local = roots
    with CheckpointManager(path) as plain:
        plain.save(1, state(1))
    mgr = CheckpointManager(path, local_dir=local)

    def down():
        raise StorageError(f"{path}: connection refused")

    monkeypatch.setattr(mgr.layout, "committed_steps", down)
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        with pytest.raises(StorageError, match="connection refused"):
            mgr.restore(None, zeros())
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        with pytest.raises(StorageError, match="connection refused"):
            mgr.latest_step()
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        with pytest.raises(StorageError, match="connection refused"):
            mgr.all_steps()
    monkeypatch.undo()
    out = zeros()
    assert mgr.restore(None, out) == 1
    assert_bitwise_equal(out, state(1))
    mgr.close()


def test_promote_refuses_one_rank_s_local_copy_of_a_multi_rank_job(roots, monkeypatch, capsys):
    """``<local_dir>/rank<r>`` holds one rank's shards: committed to the bucket as a step it
    would be listed and restored as if it were the whole job's checkpoint."""
    import async_ckpt.manager.core as core
    from async_ckpt.cli import EXIT_OK, main
    from async_ckpt.errors import CheckpointError

    path, local = roots
    real = core.SaveJob

    def rank1_of_2(*a, manifest_extra=None, **kw):  # what rank 1 of a 2-rank job records locally
        if manifest_extra and manifest_extra.get("tier") == "local":
            manifest_extra = dict(manifest_extra, rank=1, world_size=2)
        return real(*a, manifest_extra=manifest_extra or {}, **kw)

    monkeypatch.setattr(core, "SaveJob", rank1_of_2)
    with CheckpointManager(path, save_interval=10, local_dir=local, local_policy=1) as mgr:
        mgr.save(3, state(3))
        with pytest.raises(CheckpointError, match="rank 1 of 2"):
            mgr.promote(3)
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["promote", path, "3", "--local-dir", local]) != EXIT_OK
    assert "rank 1 of 2" in capsys.readouterr().err
    with CheckpointManager(path) as plain:
        assert plain.all_steps() == []


def test_cli_verify_of_a_named_step_only_the_local_tier_holds(roots, capsys):
    from async_ckpt.cli import EXIT_OK, main

    path, local = roots
    with CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1, local_retention=3) as mgr:
        for s in range(1, 4):
            mgr.save(s, state(s))
        assert mgr.step_tiers()[3] == ("local",)
    capsys.readouterr()
    assert main(["verify", path, "3", "--local-dir", local, "--json"]) == EXIT_OK
    res = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["tier"], r["ok"]) for r in res["steps"]] == [(3, "local", True)]


def _flagged(path, local):
    flags = {"persistent": False, "local": True}
    mgr = CheckpointManager(path, save_policy=lambda s: flags["persistent"], local_dir=local,
                            local_policy=lambda s: flags["local"], local_retention=5)
    clock = itertools.count(1_700_000_000, 10)  # the saves are 10 s apart (re-saves, not one save)
    mgr._clock = lambda: float(next(clock))
    return mgr, flags


def test_a_step_re_saved_to_the_bucket_only_restores_its_newest_save_not_the_older_local_copy(roots):
    """A re-save replaces a step (as on one root): the copies of step 3 are two different
    saves, and the newer one is in the bucket."""
    path, local = roots
    mgr, flags = _flagged(path, local)
    mgr.save(1, state(1))
    mgr.save(3, state(30))               # local only
    flags.update(persistent=True, local=False)
    mgr.save(3, state(31))               # re-saved (after a roll back, say): the bucket only
    assert mgr.latest_step() == 3
    out = zeros()
    assert mgr.restore(None, out) == 3
    assert_bitwise_equal(out, state(31))
    out = zeros()
    assert mgr.restore(3, out) == 3
    assert_bitwise_equal(out, state(31))
    mgr.close()


def test_a_step_re_saved_locally_counts_at_its_newest_save(roots):
    path, local = roots
    mgr, flags = _flagged(path, local)
    flags.update(persistent=True, local=False)
    mgr.save(3, state(30))               # the bucket only
    flags.update(persistent=False, local=True)
    mgr.save(2, state(2))
    mgr.save(3, state(31))               # re-saved: the local tier only, the newest save
    assert mgr.steps_in_commit_order() == [2, 3] and mgr.latest_step() == 3
    assert list(mgr.step_tiers()) == [3, 2]
    out = zeros()
    assert mgr.restore(None, out) == 3
    assert_bitwise_equal(out, state(31))
    mgr.close()


def test_local_dir_that_is_path_spelled_another_way_is_refused(tmp_path, monkeypatch):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    os.symlink(bucket, tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    same = [f"file://{bucket}", f"{tmp_path}/./bucket", f"{tmp_path}//bucket/", str(tmp_path / "link"),
            "bucket", "link/local", "bucket/../bucket/local"]
    for local in same:
        with pytest.raises(ValueError, match="must not be the same directory or inside one another"):
            CheckpointManager(str(bucket), local_dir=local)
    with pytest.raises(ValueError, match="must not be the same directory"):
        CheckpointManager(f"file://{tmp_path}/local/../bucket/x", local_dir=str(bucket))
    CheckpointManager(str(bucket), local_dir=str(tmp_path / "bucket2")).close()  # a sibling is fine


@pytest.mark.parametrize("end", ["join", "close"])
def test_join_and_close_raise_every_tier_s_failure_not_only_the_first(roots, monkeypatch, end):
    """Both tiers' writes of a step fail: the bucket's failure must not be dropped when the
    local one is raised (a second join() would then pass as if the upload had worked)."""
    from async_ckpt.errors import CheckpointError

    path, local = roots

    def broken(storage, p, sd, **kw):
        raise OSError("local disk full" if p.startswith(local) else "bucket unreachable")

    monkeypatch.setattr(coordinator_mod, "save_state_dict", broken)
    mgr = CheckpointManager(path, local_dir=local)
    mgr.save_async(1, state(1))
    with pytest.raises(CheckpointError) as info:
        getattr(mgr, end)()
    assert "local disk full" in str(info.value) and "bucket unreachable" in str(info.value)
    mgr.close()
