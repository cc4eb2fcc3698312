"""Two tiers: a local copy (``local_dir``) often, the persistent root less often; restore from
the nearest intact copy. One process here: where steps go, restores and their fallbacks,
promote, delete, the arguments and the CLI. The bucket away (failed uploads, an unreachable or
unlistable bucket) is in tests/tiers/test_tiers_outages.py; which copies are one save, and whose, in
tests/tiers/test_tiers_copies.py; 2 ranks in tests/tiers/test_tiers_dist.py, the loopback GCS server and
/dev/shm crash trials in tests/tiers/test_tiers_cloud.py and tests/damage/test_crash.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import warnings

import pytest
import torch

from async_ckpt import CheckpointManager, KeepLatest
from async_ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StateDictMismatchError,
    StepNotFoundError,
)
from async_ckpt.io import step_io

from ..conftest import assert_bitwise_equal, clone_tree


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g),
            "i": torch.arange(100, dtype=torch.int64) * seed, "meta": {"seed": seed}}


def zeros(seed: int = 0) -> dict:
    out = clone_tree(state(seed))
    for k in ("w", "b", "i"):
        out[k].zero_()
    out["meta"] = {"seed": -1}
    return out


def data_files(root: str, step: int) -> list:
    d = os.path.join(root, str(step))
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".distcp"))


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def roots(tmp_path):
    return str(tmp_path / "bucket"), str(tmp_path / "local")


def test_each_tier_gets_the_steps_its_policy_selects_and_keeps_its_own_retention(roots):
    path, local = roots
    with CheckpointManager(path, save_interval=3, max_to_keep=2, local_dir=local, local_policy=1,
                           local_retention=3) as mgr:
        for s in range(1, 10):
            if s % 3 == 0:  # the last upload has landed: a busy one would skip s for the bucket (tiers.md)
                mgr.join()
            assert mgr.save_async(s, state(s))
        mgr.join()
        assert mgr.skipped_uploads == []
        tiers = mgr.step_tiers()
        assert tiers == {9: ("local", "persistent"), 8: ("local",), 7: ("local",), 6: ("persistent",)}
        assert mgr.all_steps() == [6, 7, 8, 9]
        assert mgr.steps_in_commit_order() == [6, 7, 8, 9]
        assert mgr.latest_step() == 9
    assert sorted(int(n) for n in os.listdir(path) if n.isdigit()) == [6, 9]
    assert sorted(int(n) for n in os.listdir(local) if n.isdigit()) == [7, 8, 9]
    # each copy is a whole checkpoint: the persistent one alone restores
    with CheckpointManager(path) as plain:
        out = zeros()
        assert plain.restore(None, out) == 9
    assert_bitwise_equal(out, state(9))


def test_a_step_due_for_both_tiers_is_staged_once_and_written_to_both(roots, monkeypatch):
    path, local = roots
    writes = []
    real = step_io.write_step

    def spy(storage, p, sd, **kw):
        writes.append((storage.url, {k: v.data_ptr() for k, v in sd.items() if isinstance(v, torch.Tensor)}))
        return real(storage, p, sd, **kw)

    monkeypatch.setattr(step_io, "write_step", spy)
    with CheckpointManager(path, local_dir=local) as mgr:
        staged = []
        real_stage = mgr.stager.eager.stage
        monkeypatch.setattr(mgr.stager.eager, "stage", lambda *a, **k: staged.append(1) or real_stage(*a, **k))
        assert mgr.save(5, state(5))
        assert staged == [1]
        assert len(writes) == 2 and {w[0] for w in writes} == {mgr.storage.url, mgr.roots[0].url}
        assert writes[0][1] == writes[1][1]  # the same host buffers
        assert mgr.step_tiers() == {5: ("local", "persistent")}
        assert [s.extra["tier"] for s in mgr.stats] in (["local", "persistent"], ["persistent", "local"])
    for root in (path, local):
        with CheckpointManager(root) as m:
            out = zeros()
            assert m.restore(5, out) == 5
        assert_bitwise_equal(out, state(5))


def test_restore_prefers_the_local_copy_and_falls_back_to_the_persistent_one(roots):
    path, local = roots
    bucket = "faulty://" + path
    with CheckpointManager(bucket, local_dir=local) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    with CheckpointManager(bucket, local_dir=local) as mgr:
        # a probe on the bucket's data files: a hold released before it is reached, so every read
        # of them goes through and is recorded in fs.hits
        mgr.storage.fs.inject("read", "*.distcp", "hang").release.set()
        out = zeros()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mgr.restore(None, out) == 2
        assert_bitwise_equal(out, state(2))
        assert mgr.storage.fs.hits == [], "the local copy is read, not the bucket's"
        # a damaged local copy: the persistent copy of the same step, with a warning naming the tier
        flip_byte(data_files(local, 2)[0])
        out = zeros()
        with pytest.warns(RuntimeWarning, match=r"skipping the local copy of step 2"):
            assert mgr.restore(None, out) == 2
        assert_bitwise_equal(out, state(2))
        assert mgr.storage.fs.hits, "the bucket's copy is read (and the probe sees it)"
        # a named step too
        out = zeros()
        with pytest.warns(RuntimeWarning, match="local copy of step 2"):
            assert mgr.restore(2, out) == 2
        assert_bitwise_equal(out, state(2))


def test_a_restore_that_fell_back_logs_a_warning_naming_the_tier_it_used(roots, caplog):
    # as 025a064's restore_from_tiers: after a skipped copy, the copy restored in the end is
    # named at WARNING (an operator's log shows where the state came from), not only at INFO
    path, local = roots
    with CheckpointManager(path, local_dir=local, local_policy=1) as mgr:
        mgr.save(2, state(2))
        flip_byte(data_files(local, 2)[0])
        with caplog.at_level(logging.INFO, logger="async_ckpt"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert mgr.restore(None, zeros()) == 2
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"restored step 2 from the persistent tier ({mgr.storage.url})" in m for m in said), said
        shutil.rmtree(os.path.join(local, "2"))
    with CheckpointManager(path, local_dir=local, local_policy=1) as mgr:  # no fallback: no warning
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="async_ckpt"):
            assert mgr.restore(None, zeros()) == 2
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_step_damaged_in_both_tiers_names_each_copy_s_problem(roots):
    # 025a064 named every copy's error ("step 2 (local tier): ...; step 2 (persistent tier): ...");
    # the persistent copy's problem (another file) must not be left out of the error
    path, local = roots
    with CheckpointManager(path, local_dir=local, local_policy=1) as mgr:
        mgr.save(2, state(2))
        flip_byte(data_files(local, 2)[0])
        flip_byte(data_files(path, 2)[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CorruptCheckpointError) as ei:
                mgr.restore(2, zeros())
    text = str(ei.value)
    assert data_files(local, 2)[0] in text and data_files(path, 2)[0] in text, text


def test_a_skipped_copy_s_warning_names_the_error_type(roots):
    # docs/tiers.md: "skipping the local copy of step 11 (...): CorruptCheckpointError: ..." (as
    # 025a064): a damaged copy and a storage error skipped alike are told apart by the type
    path, local = roots
    with CheckpointManager(path, local_dir=local, local_policy=1) as mgr:
        mgr.save(2, state(2))
        flip_byte(data_files(local, 2)[0])
        with pytest.warns(RuntimeWarning, match=r"skipping the local copy of step 2 \(.*\): CorruptCheckpointError: "):
            assert mgr.restore(None, zeros()) == 2


def test_local_dir_gone_restores_from_the_bucket(roots):
    path, local = roots
    with CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1) as mgr:
        for s in range(1, 6):
            mgr.save(s, state(s))
    shutil.rmtree(local)  # the node was replaced
    with CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1) as mgr:
        assert mgr.step_tiers() == {4: ("persistent",), 2: ("persistent",)}
        out = zeros()
        assert mgr.restore(None, out) == 4
    assert_bitwise_equal(out, state(4))


def test_only_local_step_damaged_falls_back_to_an_older_step_of_either_tier(roots):
    path, local = roots
    with CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1, local_retention=5) as mgr:
        for s in range(1, 4):
            mgr.save(s, state(s))
    flip_byte(data_files(local, 3)[0])  # step 3 is local only
    with CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1) as mgr:
        out = zeros()
        with pytest.warns(RuntimeWarning, match="local copy of step 3"):
            assert mgr.restore(None, out) == 2
        assert_bitwise_equal(out, state(2))
        with pytest.raises(CorruptCheckpointError, match="step 3"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mgr.restore(3, zeros())


def test_a_mismatching_state_dict_is_raised_not_fallen_back_from(roots):
    path, local = roots
    with CheckpointManager(path, local_dir=local) as mgr:
        mgr.save(1, state(1))
        bad = zeros()
        bad["w"] = torch.zeros(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "skipping" warning: the caller's error, at once
            with pytest.raises(StateDictMismatchError, match="w"):
                mgr.restore(None, bad)
        with pytest.raises(StepNotFoundError, match="step 7"):
            mgr.restore(7, zeros())


def test_promote_uploads_a_local_step_and_commits_it(roots):
    path, local = roots
    with CheckpointManager(path, save_interval=10, local_dir=local, local_policy=1) as mgr:
        mgr.save(3, state(3))
        assert mgr.step_tiers() == {3: ("local",)}
        mgr.promote(3)
        assert mgr.step_tiers() == {3: ("local", "persistent")}
        with pytest.raises(StepNotFoundError):
            mgr.promote(4)
        with pytest.raises(CheckpointError, match="already committed"):
            mgr.promote(3)  # the bucket's copy may be a newer save: never replaced
        mgr.save(4, state(4))
        flip_byte(data_files(local, 4)[0])
        with pytest.raises(CorruptCheckpointError):
            mgr.promote(4)  # checked before anything is committed
        assert mgr.step_tiers()[4] == ("local",)
    with CheckpointManager(path) as plain:
        assert plain.all_steps() == [3]
        out = zeros()
        assert plain.restore(3, out) == 3
    assert_bitwise_equal(out, state(3))


def test_delete_removes_every_copy_and_metrics_come_from_either(roots):
    path, local = roots
    with CheckpointManager(path, local_dir=local, retention=KeepLatest(5)) as mgr:
        mgr.save(1, state(1), metrics={"loss": 1.5})
        mgr.save(2, state(2), metrics={"loss": 0.5})
        assert mgr.metrics(1) == {"loss": 1.5}
        assert mgr.best_step("loss") == 2
        mgr.delete(2)
        assert mgr.step_tiers() == {1: ("local", "persistent")}
        with pytest.raises(StepNotFoundError):
            mgr.delete(2)


def test_bad_tier_arguments_are_refused(roots, tmp_path):
    path, local = roots
    with pytest.raises(ValueError, match="must not be the same directory"):
        CheckpointManager(path, local_dir=path)
    with pytest.raises(ValueError, match="inside one another"):
        CheckpointManager(path, local_dir=os.path.join(path, "local"))
    with pytest.raises(ValueError, match="local_policy"):
        CheckpointManager(path, local_dir=local, local_policy=0)
    with pytest.raises(ValueError, match="local_retention"):
        CheckpointManager(path, local_dir=local, local_retention=0)
    with pytest.raises(TypeError, match="local_dir"):
        CheckpointManager(path, local_dir=5)
    with CheckpointManager(path) as mgr:
        with pytest.raises(CheckpointError, match="local_dir"):
            mgr.promote(1)


def test_lazy_saves_to_both_tiers_round_trip(roots):
    path, local = roots
    sd = state(7)
    with CheckpointManager(path, local_dir=local, lazy=True) as mgr:
        assert mgr.save_async(7, sd)
        mgr.wait_for_staging()
        mgr.join()
        assert mgr.step_tiers() == {7: ("local", "persistent")}
    for root in (path, local):
        with CheckpointManager(root) as m:
            out = zeros()
            m.restore(7, out)
        assert_bitwise_equal(out, state(7))


def test_cli_ls_verify_promote_understand_both_tiers(roots, capsys):
    import json

    from async_ckpt.cli import EXIT_DAMAGED, EXIT_OK, main

    path, local = roots
    with CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1, local_retention=3) as mgr:
        for s in range(1, 5):
            mgr.save(s, state(s))
    capsys.readouterr()
    assert main(["ls", path, "--local-dir", local, "--json"]) == EXIT_OK
    listed = json.loads(capsys.readouterr().out)
    assert sorted((e["step"], e["tier"]) for e in listed["steps"]) == [
        (2, "local"), (2, "persistent"), (3, "local"), (4, "local"), (4, "persistent")]
    assert main(["ls", path, "--local-dir", local]) == EXIT_OK
    assert "TIER" in capsys.readouterr().out
    # promote keeps the step's commit time: the bucket's newest commit stays step 4
    assert main(["promote", path, "3", "--local-dir", local]) == EXIT_OK
    capsys.readouterr()
    with CheckpointManager(path) as plain:
        assert plain.steps_in_commit_order() == [2, 3, 4]
        out = zeros()
        assert plain.restore(3, out) == 3
    assert_bitwise_equal(out, state(3))
    assert main(["promote", path, "9", "--local-dir", local]) != EXIT_OK  # no such local step
    flip_byte(data_files(local, 4)[0])
    capsys.readouterr()
    assert main(["verify", path, "--local-dir", local, "--all", "--json"]) == EXIT_DAMAGED
    res = json.loads(capsys.readouterr().out)
    bad = [(r["step"], r["tier"]) for r in res["steps"] if not r["ok"]]
    assert bad == [(4, "local")]
    assert main(["verify", path, "4", "--local-dir", local]) == EXIT_DAMAGED  # both copies, one damaged
    text = capsys.readouterr().out
    assert "step 4 (local): DAMAGED" in text and "step 4 (persistent): ok" in text


def test_a_lagging_upload_does_not_make_its_older_step_the_newest(roots):
    """Step 10 goes to both tiers, its upload finishes after local steps 11 and 12, and local
    retention then drops step 10's local copy: 12 stays the newest (save order), not 10."""
    path, local = roots
    bucket = "faulty://" + path
    with CheckpointManager(bucket, save_interval=10, local_dir=local, local_policy=1, local_retention=2) as mgr:
        upload = mgr.storage.fs.inject("write", "*.distcp", "hang")  # the upload is held here
        for s in (10, 11, 12):
            mgr.save_async(s, state(s))
            mgr.roots[0].writer.join()
        assert upload.reached.wait(30)
        assert "persistent" not in mgr.step_tiers().get(10, ()), "the upload of step 10 lags"
        upload.release.set()
        mgr.join()
        assert mgr.step_tiers() == {12: ("local",), 11: ("local",), 10: ("persistent",)}
        assert mgr.steps_in_commit_order() == [10, 11, 12] and mgr.latest_step() == 12
    with CheckpointManager(bucket, save_interval=10, local_dir=local, local_policy=1, local_retention=2) as mgr:
        out = zeros()
        assert mgr.restore(None, out) == 12
    assert_bitwise_equal(out, state(12))


def test_metrics_come_from_the_newest_save_of_a_step(roots):
    path, local = roots
    with CheckpointManager(path, local_dir=local, local_policy=1) as mgr:
        mgr.save(5, state(5), metrics={"loss": 1.0})
    with CheckpointManager(path, local_dir=local, local_policy=lambda s: False) as mgr:
        mgr.save(5, state(6), metrics={"loss": 2.0})  # the bucket only: a newer save of step 5
        assert mgr.metrics(5) == {"loss": 2.0}


def test_should_save_answers_for_either_tier(roots):
    path, local = roots
    with CheckpointManager(path, save_interval=10, local_dir=local, local_policy=5) as mgr:
        assert [s for s in range(21) if mgr.should_save(s)] == [0, 5, 10, 15, 20]
    with CheckpointManager(path, save_interval=10) as plain:
        assert [s for s in range(21) if plain.should_save(s)] == [0, 10, 20]


def test_a_refused_construction_creates_nothing_and_leaves_no_thread(roots):
    import threading

    path, local = roots

    def writers():
        return sum(t.name.startswith("async-ckpt-") for t in threading.enumerate())

    before = writers()
    for _ in range(3):
        with pytest.raises(ValueError, match="inside one another"):
            CheckpointManager(path, local_dir=os.path.join(path, "sub"))
        with pytest.raises(ValueError, match="local_retention"):
            CheckpointManager(path, local_dir=local, local_retention=0)
    assert writers() <= before
    assert not os.path.exists(os.path.join(path, "sub"))


def test_promote_keeps_the_promoted_step_through_its_retention_pass_and_returns_what_it_dropped(roots, caplog):
    path, local = roots
    with CheckpointManager(path, save_interval=5, local_dir=local, local_policy=1, local_retention=5) as mgr:
        for s in range(1, 11):
            mgr.save(s, state(s))
        assert mgr.layout.committed_steps() == [5, 10]
    with CheckpointManager(path, save_interval=5, max_to_keep=1, local_dir=local, local_policy=1) as mgr:
        with caplog.at_level(logging.WARNING, logger="async_ckpt"):
            assert mgr.promote(7) == [5]  # the request is kept; 10 is the newest commit
        assert "promote(7): the retention" in caplog.text and "[5]" in caplog.text
        assert mgr.layout.committed_steps() == [7, 10]
        assert mgr.step_tiers()[7] == ("local", "persistent")
        mgr.save(15, state(15))  # the next save's retention treats 7 as any other step
        assert mgr.layout.committed_steps() == [15]


def test_cli_ls_numbers_the_two_copies_of_one_save_once(roots, capsys):
    import json

    from async_ckpt.cli import EXIT_OK, main

    path, local = roots
    with CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1) as mgr:
        for s in range(1, 5):
            mgr.save(s, state(s))
    capsys.readouterr()
    assert main(["ls", path, "--local-dir", local, "--json"]) == EXIT_OK
    listed = json.loads(capsys.readouterr().out)
    assert listed["commit_order"] == [2, 3, 4] and listed["latest"] == 4
    assert sorted((e["step"], e["tier"], e["commit_order"]) for e in listed["steps"]) == [
        (2, "persistent", 1), (3, "local", 2), (4, "local", 3), (4, "persistent", 3)]
    assert main(["ls", path, "--local-dir", local]) == EXIT_OK
    text = capsys.readouterr().out
    assert sum(" 3 latest " in line for line in text.splitlines()) == 2  # both copies of step 4
    assert "commit order (oldest first): 2, 3, 4\nnewest intact step (what restore(None) takes): 4 " in text


def test_promote_refuses_one_rank_s_local_copy_of_a_multi_rank_job(roots, monkeypatch, capsys):
    """``<local_dir>/rank<r>`` holds one rank's shards: committed to the bucket as a step it
    would be listed and restored as if it were the whole job's checkpoint."""
    import async_ckpt.manager.submission as submission
    from async_ckpt.cli import EXIT_OK, main
    from async_ckpt.errors import CheckpointError

    path, local = roots
    real = submission.SaveJob

    def rank1_of_2(*a, identity=None, **kw):  # what rank 1 of a 2-rank job records locally
        if identity is not None and identity.tier == "local":
            identity = dataclasses.replace(identity, rank=1, world_size=2)
        return real(*a, **kw) if identity is None else real(*a, identity=identity, **kw)

    monkeypatch.setattr(submission, "SaveJob", rank1_of_2)
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


def test_a_busy_bucket_takes_the_newest_skipped_local_copy_at_its_next_free_slot(tmp_path, caplog):
    """Default max_pending_async=1, a fast loop, a bucket slower than the loop: every save while
    the upload of step 0 runs skips the bucket; once it ends, the same upload slot takes the
    newest local copy (promoted in the background). The bucket is never more than one upload
    behind, and the statistics say how far behind it was."""
    bucket = f"faulty://{tmp_path}/bucket"  # the object stores' code paths, over local files
    local = str(tmp_path / "local")
    mgr = CheckpointManager(bucket, max_to_keep=3, local_dir=local, local_policy=1, local_retention=2)
    stuck = mgr.storage.fs.inject("write", "*.distcp", "hang", times=1)
    try:
        with caplog.at_level(logging.INFO, logger="async_ckpt"):
            assert mgr.save_async(0, state(0))
            assert stuck.reached.wait(30)  # step 0's upload holds the bucket's only slot
            for s in range(1, 10):
                assert mgr.save_async(s, state(s))
            assert mgr.skipped_uploads == list(range(1, 10))
            deadline = time.monotonic() + 30  # the local saves commit meanwhile
            while not any(st.step == 9 for st in list(mgr.stats)) and time.monotonic() < deadline:
                time.sleep(0.01)
            stuck.release.set()
            mgr.join()
        assert mgr.step_tiers()[9] == ("local", "persistent")  # the newest local copy reached the bucket
        bucket_steps = sorted(int(n) for n in os.listdir(tmp_path / "bucket") if n.isdigit())
        assert bucket_steps == [0, 9]
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING and "not uploaded" in r.getMessage()]
        assert len(warned) == 1  # one warning while the upload ran, not one per step
        by_tier = {(st.step, st.extra.get("tier")): st for st in mgr.stats}
        assert by_tier[(0, "persistent")].extra["upload_lag"] == 0
        # saves the bucket did not hold yet (step 0's upload had not landed: all of them)
        assert [by_tier[(s, "local")].extra["upload_lag"] for s in (5, 9)] == [6, 10]
        assert by_tier[(9, "local")].extra["upload_lag_s"] is None  # (seconds behind: none there to compare with)
        up = by_tier[(9, "persistent")]
        assert up.extra["caught_up"] and up.extra["upload_lag"] == 0 and up.durable_s > 0
        # a later upload finds the bucket caught up: nothing skipped, nothing behind
        assert mgr.save(10, state(10))
        assert by_tier[(9, "persistent")] in mgr.stats and mgr.stats[-1].extra["upload_lag"] == 0
    finally:
        stuck.release.set()
        mgr.close()
    with CheckpointManager(bucket) as again:  # the bucket alone restores the newest caught-up step
        assert again.all_steps() == [0, 9, 10]
        out = zeros()
        assert again.restore(9, out) == 9
        assert_bitwise_equal(out, state(9))
