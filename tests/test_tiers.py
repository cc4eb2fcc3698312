"""Two tiers: a local copy (``local_dir``) often, the persistent root less often; restore from
the nearest intact copy. One process here; 2 ranks in tests/test_tiers_dist.py, the loopback
GCS server and /dev/shm crash trials in tests/test_tiers_cloud.py and tests/test_crash.py."""

from __future__ import annotations

import logging
import os
import shutil
import warnings

import pytest
import torch

from async_ckpt import CheckpointManager, KeepLatest
from async_ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StateDictMismatchError,
    StepNotFoundError,
    StorageError,
)
from async_ckpt.lifecycle import coordinator as coordinator_mod

from .conftest import assert_bitwise_equal, clone_tree


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
            assert mgr.save_async(s, state(s))
        mgr.join()
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
    real = coordinator_mod.save_state_dict

    def spy(storage, p, sd, **kw):
        writes.append((storage.url, {k: v.data_ptr() for k, v in sd.items() if isinstance(v, torch.Tensor)}))
        return real(storage, p, sd, **kw)

    monkeypatch.setattr(coordinator_mod, "save_state_dict", spy)
    with CheckpointManager(path, local_dir=local) as mgr:
        staged = []
        real_stage = mgr.stager.eager.stage
        monkeypatch.setattr(mgr.stager.eager, "stage", lambda *a, **k: staged.append(1) or real_stage(*a, **k))
        assert mgr.save(5, state(5))
        assert staged == [1]
        assert len(writes) == 2 and {w[0] for w in writes} == {mgr.storage.url, mgr._local.url}
        assert writes[0][1] == writes[1][1]  # the same host buffers
        assert mgr.step_tiers() == {5: ("local", "persistent")}
        assert [s.extra["tier"] for s in mgr.stats] in (["local", "persistent"], ["persistent", "local"])
    for root in (path, local):
        with CheckpointManager(root) as m:
            out = zeros()
            assert m.restore(5, out) == 5
        assert_bitwise_equal(out, state(5))


def test_restore_prefers_the_local_copy_and_falls_back_to_the_persistent_one(roots, monkeypatch):
    path, local = roots
    with CheckpointManager(path, local_dir=local) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
    used = []
    real = coordinator_mod.LocalCoordinator.load

    def spy(self, storage, p, sd, **kw):
        used.append(storage.url)
        return real(self, storage, p, sd, **kw)

    monkeypatch.setattr(coordinator_mod.LocalCoordinator, "load", spy)
    with CheckpointManager(path, local_dir=local) as mgr:
        out = zeros()
        assert mgr.restore(None, out) == 2
        assert_bitwise_equal(out, state(2))
        assert used == [mgr._local.url]
        # a damaged local copy: the persistent copy of the same step, with a warning naming the tier
        flip_byte(data_files(local, 2)[0])
        used.clear()
        out = zeros()
        with pytest.warns(RuntimeWarning, match=r"skipping the local copy of step 2"):
            assert mgr.restore(None, out) == 2
        assert_bitwise_equal(out, state(2))
        assert used == [mgr._local.url, mgr.storage.url]
        # a named step too
        out = zeros()
        with pytest.warns(RuntimeWarning, match="local copy of step 2"):
            assert mgr.restore(2, out) == 2
        assert_bitwise_equal(out, state(2))


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


def test_failed_uploads_do_not_stop_local_saves_and_are_raised_at_join(roots, monkeypatch, caplog):
    path, local = roots
    real = coordinator_mod.save_state_dict
    down = {"on": True}

    def flaky(storage, p, sd, **kw):
        if down["on"] and not p.startswith(local):
            raise OSError("bucket unreachable")
        return real(storage, p, sd, **kw)

    monkeypatch.setattr(coordinator_mod, "save_state_dict", flaky)
    mgr = CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1, local_retention=10)
    with caplog.at_level(logging.ERROR, logger="async_ckpt"):
        for s in range(1, 6):
            assert mgr.save_async(s, state(s))  # the failed uploads of 2 and 4 are not raised here
        mgr._local.writer.join()
        mgr._writer.wait_idle()
    assert "save of step 2 failed" in caplog.text
    assert mgr.step_tiers() == {s: ("local",) for s in (5, 4, 3, 2, 1)}
    with pytest.raises(CheckpointError, match="step 2") as ei:
        mgr.join()
    assert ei.value.step == 2
    down["on"] = False
    mgr.save(6, state(6))  # the bucket is back: the next upload goes through
    assert mgr.step_tiers()[6] == ("local", "persistent")
    mgr.close()
    with CheckpointManager(path) as plain:
        assert plain.all_steps() == [6]


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


def test_bucket_that_cannot_be_listed_restores_from_local_with_a_warning(roots, monkeypatch):
    from async_ckpt.errors import StorageError

    path, local = roots
    with CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1) as mgr:
        for s in range(1, 4):
            mgr.save(s, state(s))
    mgr = CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1)

    def down():
        raise StorageError(f"{path}: connection refused")

    monkeypatch.setattr(mgr.layout, "committed_steps", down)  # what listing an unreachable bucket raises
    out = zeros()
    with pytest.warns(RuntimeWarning, match=r"persistent tier .* cannot be listed"):
        assert mgr.restore(None, out) == 3
    assert_bitwise_equal(out, state(3))
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        assert mgr.all_steps() == [2, 3]
    # a named step only the unlistable bucket might hold: the bucket's error, not "not found"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(StorageError, match="connection refused"):
            mgr.restore(1, zeros())
    monkeypatch.undo()
    mgr.close()
    # without a local tier to fall back on, the listing error is raised
    plain = CheckpointManager(path)
    monkeypatch.setattr(plain.layout, "committed_steps", down)
    with pytest.raises(StorageError, match="connection refused"):
        plain.restore(None, zeros())
    monkeypatch.undo()
    plain.close()


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


def test_after_a_failed_upload_restore_and_promote_work_and_join_still_raises(roots, monkeypatch):
    path, local = roots
    real = coordinator_mod.save_state_dict

    def no_bucket(storage, p, sd, **kw):
        if not p.startswith(local):
            raise OSError("bucket unreachable")
        return real(storage, p, sd, **kw)

    monkeypatch.setattr(coordinator_mod, "save_state_dict", no_bucket)
    mgr = CheckpointManager(path, local_dir=local)
    mgr.save_async(1, state(1))
    out = zeros()
    assert mgr.restore(None, out) == 1  # the failed upload is not the restore's error
    assert_bitwise_equal(out, state(1))
    monkeypatch.setattr(coordinator_mod, "save_state_dict", real)
    mgr.promote(1)  # the repair: the local copy goes up
    assert mgr.step_tiers() == {1: ("local", "persistent")}
    with pytest.raises(CheckpointError, match="bucket unreachable"):
        mgr.join()
    mgr.close()


def test_a_lagging_upload_does_not_make_its_older_step_the_newest(roots, monkeypatch):
    """Step 10 goes to both tiers, its upload finishes after local steps 11 and 12, and local
    retention then drops step 10's local copy: 12 stays the newest (save order), not 10."""
    import threading

    path, local = roots
    real = coordinator_mod.save_state_dict
    gate = threading.Event()

    def slow_bucket(storage, p, sd, **kw):
        if not p.startswith(local):
            assert gate.wait(30)
        return real(storage, p, sd, **kw)

    monkeypatch.setattr(coordinator_mod, "save_state_dict", slow_bucket)
    with CheckpointManager(path, save_interval=10, local_dir=local, local_policy=1, local_retention=2) as mgr:
        for s in (10, 11, 12):
            mgr.save_async(s, state(s))
            mgr._local.writer.join()
        gate.set()
        mgr.join()
        assert mgr.step_tiers() == {12: ("local",), 11: ("local",), 10: ("persistent",)}
        assert mgr.steps_in_commit_order() == [10, 11, 12] and mgr.latest_step() == 12
    with CheckpointManager(path, save_interval=10, local_dir=local, local_policy=1, local_retention=2) as mgr:
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


def test_a_long_outage_keeps_a_bounded_number_of_deferred_failures():
    from async_ckpt.writer import MAX_KEPT_ERRORS, AsyncWriter

    w = AsyncWriter(1, defer_errors=True)

    def fail():
        raise OSError("down")

    for s in range(MAX_KEPT_ERRORS + 50):
        w.wait_for_slot()  # a deferred failure is not raised here
        w.submit(fail, step=s)
    w.wait_idle()
    assert len(w._errors) == MAX_KEPT_ERRORS
    with pytest.raises(CheckpointError, match=r"step 0 failed.*more failed save") as ei:
        w.close()
    assert str(MAX_KEPT_ERRORS + 49) in str(ei.value)  # the newest failure is still named


def test_should_save_answers_for_either_tier(roots):
    path, local = roots
    with CheckpointManager(path, save_interval=10, local_dir=local, local_policy=5) as mgr:
        assert [s for s in range(21) if mgr.should_save(s)] == [0, 5, 10, 15, 20]
    with CheckpointManager(path, save_interval=10) as plain:
        assert [s for s in range(21) if plain.should_save(s)] == [0, 10, 20]


def test_a_bucket_unreachable_at_its_first_save_does_not_stop_the_local_save(roots, caplog):
    """The lease of the bucket is taken at its first due save: a vanished bucket (a raw
    FileNotFoundError from the lock file) is deferred like a failed upload, the step goes to
    the local tier, and the lease is tried again at the next step due for the bucket."""
    path, local = roots
    mgr = CheckpointManager(path, save_interval=5, local_dir=local, local_policy=2, local_retention=10)
    shutil.rmtree(path)  # the bucket's mount went away before the first upload
    with caplog.at_level(logging.ERROR, logger="async_ckpt"):
        for s in range(4, 7):
            assert mgr.save_async(s, state(s))  # 5 is due for the bucket only: saved locally
    assert "save of step 5 failed" in caplog.text
    mgr._local.writer.join()
    assert mgr.step_tiers() == {6: ("local",), 5: ("local",), 4: ("local",)}
    with pytest.raises(StorageError, match=r"step 5: the checkpoint path .*bucket cannot be reached") as ei:
        mgr.join()
    assert ei.value.step == 5
    os.makedirs(path)  # the bucket is back: the next step due for it takes the lease and commits
    mgr.save(10, state(10))
    assert mgr.step_tiers()[10] == ("local", "persistent")
    mgr.close()


def test_a_preemption_save_while_the_bucket_is_down_is_taken_locally(roots):
    import signal

    path, local = roots
    mgr = CheckpointManager(path, save_interval=100, local_dir=local, local_policy=1, chkpt_on_preemption=True,
                            preemption_signals=[signal.SIGUSR1], preemption_sync="signal")
    mgr.save(1, state(1))
    shutil.rmtree(path)
    mgr.trigger_preemption()
    assert mgr.save_async(2, state(2))
    assert mgr.reached_preemption(2)
    mgr._local.writer.join()
    assert mgr.step_tiers() == {2: ("local",), 1: ("local",)}
    with pytest.raises(StorageError, match="step 2"):
        mgr.close()
    with CheckpointManager(local) as m:
        out = zeros()
        assert m.restore(None, out) == 2
    assert_bitwise_equal(out, state(2))


def test_without_a_local_tier_an_unreachable_bucket_raises_a_storage_error_naming_it(roots):
    path, _ = roots
    mgr = CheckpointManager(path)
    shutil.rmtree(path)
    with pytest.raises(StorageError, match=f"the checkpoint path {path} cannot be reached") as ei:
        mgr.save_async(1, state(1))
    assert isinstance(ei.value.__cause__, FileNotFoundError)
    mgr.close()


def test_a_re_save_within_a_second_is_a_different_save_and_the_newest_one_wins(roots):
    """Copies of one save are named by a save id in both tiers' manifests, not by how close
    their commit times are: a re-save of step 10 to the bucket 0.x s after a local-only save
    of it is the newer save."""
    from async_ckpt.policies import CheckpointInfo
    from async_ckpt.tiers import same_save

    path, local = roots
    flags = {"local": True, "bucket": False}
    with CheckpointManager(path, save_policy=lambda s: flags["bucket"], local_dir=local,
                           local_policy=lambda s: flags["local"], local_retention=5) as mgr:
        mgr.save(10, state(1))               # local only
        flags.update(local=False, bucket=True)
        mgr.save(10, state(2))               # re-saved at once: the bucket only
        assert mgr.step_tiers() == {10: ("persistent", "local")}
        for step in (None, 10):
            out = zeros()
            assert mgr.restore(step, out) == 10
            assert_bitwise_equal(out, state(2))
        flags.update(local=True)
        mgr.save(11, state(11))              # one save, both tiers: one id, local first
        assert mgr.step_tiers()[11] == ("local", "persistent")
    # manifests from before save ids: copies committed within SAME_SAVE_S are one save
    assert same_save(CheckpointInfo(1, 100.0), CheckpointInfo(1, 100.5))
    assert not same_save(CheckpointInfo(1, 100.0), CheckpointInfo(1, 102.0))
    assert not same_save(CheckpointInfo(1, 100.0, extra={"save_id": "a"}), CheckpointInfo(1, 100.0, extra={"save_id": "b"}))


@pytest.mark.parametrize("blip", [True, False])
def test_a_bucket_manifest_that_does_not_read_while_listing_does_not_pass_over_newer_local_steps(roots, monkeypatch,
                                                                                                blip):
    """Step 5's bucket manifest fails to read while the bucket is listed (``blip``: only
    then): it is read once more, else ordered after every copy whose time is known."""
    path, local = roots
    with CheckpointManager(path, save_interval=5, local_dir=local, local_policy=1) as mgr:
        for s in range(1, 8):
            mgr.save(s, state(s))
    mgr = CheckpointManager(path, save_interval=5, local_dir=local, local_policy=1)
    listing = {"on": False}
    real_read, real_infos = mgr.layout.read_manifest, mgr._store.catalog.infos

    def read(step, *a, **k):
        if step == 5 and (listing["on"] or not blip):
            raise StorageError("read manifest: 503")
        return real_read(step, *a, **k)

    def infos():
        listing["on"] = True
        try:
            return real_infos()
        finally:
            listing["on"] = False

    monkeypatch.setattr(mgr.layout, "read_manifest", read)
    monkeypatch.setattr(mgr._store.catalog, "infos", infos)
    assert list(mgr.step_tiers()) == [7, 6, 5]
    out = zeros()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # step 5 is not tried (and skipped) first
        assert mgr.restore(None, out) == 7
    assert_bitwise_equal(out, state(7))
    monkeypatch.undo()
    mgr.close()


def test_metrics_while_the_bucket_is_down_come_from_the_local_tier(roots, monkeypatch):
    path, local = roots
    with CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1) as mgr:
        for s in range(1, 4):
            mgr.save(s, state(s), metrics={"loss": float(s)})
    mgr = CheckpointManager(path, save_interval=2, local_dir=local, local_policy=1)

    def down(*a, **k):
        raise StorageError(f"{path}: connection refused")

    monkeypatch.setattr(mgr.layout, "committed_steps", down)
    with pytest.warns(RuntimeWarning, match=r"persistent tier .* cannot be read"):
        assert mgr.metrics(3) == {"loss": 3.0}
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        with pytest.raises(StorageError, match="connection refused"):
            mgr.metrics(1)  # only the bucket may hold it: its error, not "not found"
    monkeypatch.undo()
    mgr.close()


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


def test_another_job_s_local_copies_are_never_restored_replaced_deleted_or_promoted(tmp_path, caplog):
    """Job A (bucket A) and then job B (bucket B) use one local_dir: each local manifest
    records the bucket it was saved for, so B neither resumes A's weights nor deletes A's steps."""
    bucket_a, bucket_b, local = (str(tmp_path / n) for n in ("a", "b", "local"))
    with CheckpointManager(bucket_a, save_interval=5, local_dir=local, local_policy=1) as a:
        for s in range(1, 4):
            a.save(s, state(100 + s))
    with CheckpointManager(bucket_b, save_interval=5, local_dir=local, local_policy=1) as b:
        with pytest.warns(RuntimeWarning, match=rf"local copies of steps \[2, 3\].*saved for the checkpoint path "
                                                rf"file://{tmp_path}/a/, not file://{tmp_path}/b/"):
            assert b.step_tiers() == {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(StepNotFoundError):
                b.restore(None, zeros())
            with caplog.at_level(logging.WARNING, logger="async_ckpt"):
                for s in range(3, 7):
                    b.save(s, state(s))  # 3: A's copy stays; B's retention keeps B's 2 newest
            assert "not saving step 3" in caplog.text
            assert b.step_tiers() == {6: ("local",), 5: ("local", "persistent")}
            with pytest.raises(CheckpointError, match="another job's step is not promoted"):
                b.promote(2)
    assert sorted(int(n) for n in os.listdir(local) if n.isdigit()) == [2, 3, 5, 6]
    with CheckpointManager(bucket_a, save_interval=5, local_dir=local, local_policy=1) as a:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = zeros()
            assert a.restore(None, out) == 3
    assert_bitwise_equal(out, state(103))


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
    assert "commit order (oldest first): 2, 3, 4;" in text
