"""Two tiers: which copies of a step are one save (a save id in both tiers' manifests; a
re-save is another save, the newest wins), and whose (a local copy saved for another bucket is
another job's)."""

from __future__ import annotations

import itertools
import os
import warnings

import pytest

from async_ckpt import CheckpointManager
from async_ckpt.errors import CheckpointError, StepNotFoundError
from async_ckpt.jobs.roots import ForeignCopyError

from ..conftest import assert_bitwise_equal
from .test_tiers import state, zeros


@pytest.fixture
def roots(tmp_path):
    return str(tmp_path / "bucket"), str(tmp_path / "local")


def test_a_re_save_within_a_second_is_a_different_save_and_the_newest_one_wins(roots):
    """Copies of one save are named by a save id in both tiers' manifests, not by how close
    their commit times are: a re-save of step 10 to the bucket 0.x s after a local-only save
    of it is the newer save."""
    from async_ckpt.jobs.roots import same_save
    from async_ckpt.policies import CheckpointInfo

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
    # copies without a save id are never taken for one save, however close their commits
    assert not same_save(CheckpointInfo(1, 100.0), CheckpointInfo(1, 100.5))
    assert not same_save(CheckpointInfo(1, 100.0), CheckpointInfo(1, 102.0))
    assert not same_save(CheckpointInfo(1, 100.0, extra={"save_id": "a"}), CheckpointInfo(1, 100.0, extra={"save_id": "b"}))


def _flagged(path, local):
    flags = {"persistent": False, "local": True}
    clock = itertools.count(1_700_000_000, 10)  # the saves are 10 s apart (re-saves, not one save)
    mgr = CheckpointManager(path, save_policy=lambda s: flags["persistent"], local_dir=local,
                            local_policy=lambda s: flags["local"], local_retention=5,
                            wall_clock=lambda: float(next(clock)))
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


def test_another_job_s_local_copies_are_never_restored_replaced_deleted_or_promoted(tmp_path):
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
            with pytest.raises(ForeignCopyError, match="step 3"):
                b.save(3, state(3))  # A's copy stays
            for s in range(4, 7):
                b.save(s, state(s))  # B's retention keeps B's 2 newest
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


def test_a_save_that_meets_another_job_s_local_copy_fails_instead_of_reporting_success(tmp_path):
    """B's save of a step A's copy holds writes nothing: save() raises ForeignCopyError (naming
    the step, local_dir and both buckets), on_saved is not called; save_async's failure is
    raised by the next call."""
    bucket_a, bucket_b, local = (str(tmp_path / n) for n in ("a", "b", "local"))
    with CheckpointManager(bucket_a, save_interval=100, local_dir=local, local_policy=1, local_retention=5) as a:
        for s in (1, 2, 3):
            a.save(s, state(s))
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = CheckpointManager(bucket_b, save_interval=100, local_dir=local, local_policy=1,
                              on_saved=lambda st: seen.append(st.step))
        with pytest.raises(ForeignCopyError, match=rf"step 3 .*{local}.*file://{tmp_path}/a/, not file://{tmp_path}/b/"):
            b.save(3, state(30))
        assert seen == [] and b.step_tiers() == {}
        b.save_async(2, state(20))
        with pytest.raises(ForeignCopyError, match="step 2"):
            b.save_async(4, state(40))
        b.save(5, state(50))
        assert seen == [5] and b.step_tiers() == {5: ("local",)}
        b.close()


def test_metrics_never_reads_another_job_s_local_copy(tmp_path):
    bucket_a, bucket_b, local = (str(tmp_path / n) for n in ("a", "b", "local"))
    with CheckpointManager(bucket_a, save_interval=100, local_dir=local, local_policy=1, local_retention=5) as a:
        a.save(1, state(1), force=True, metrics={"loss": 111.0})  # both tiers of A
        a.save(9, state(9), metrics={"loss": 999.0})              # A's local tier only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with CheckpointManager(bucket_b, save_interval=1, local_dir=local, local_policy=1, local_retention=5) as b:
            b.save(2, state(2), metrics={"loss": 2.0})
            assert b.metrics(2) == {"loss": 2.0}
            for s in (1, 9):
                with pytest.raises(StepNotFoundError, match=rf"step {s} .*another job's"):
                    b.metrics(s)


def test_a_damaged_local_copy_that_partly_wrote_keys_the_fallback_lacks_is_named(roots):
    """restore(None, strict=False) over both tiers: the local-only step 5 (with a key ``x`` the
    older step 4 lacks) is found damaged after it wrote into the target, step 4 is restored
    from either tier, and a warning says that keys step 4 lacks may hold step 5's data."""
    import torch

    from .test_tiers import data_files, flip_byte

    path, local = roots
    four = {"w": torch.randn(256, 256), "b": torch.randn(64)}
    five = {"w": torch.randn(256, 256), "b": torch.randn(64), "x": torch.randn(256, 256)}
    with CheckpointManager(path, save_interval=4, local_dir=local, local_policy=1) as mgr:
        mgr.save(4, four)
        mgr.save(5, five)
    for f in data_files(local, 5):
        flip_byte(f)
    target = {k: torch.zeros_like(v) for k, v in five.items()}
    with CheckpointManager(path, save_interval=4, local_dir=local, local_policy=1) as mgr:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert mgr.restore(None, target, strict=False) == 4
    assert_bitwise_equal({k: target[k] for k in four}, four)
    said = [str(w.message) for w in caught if "partly written" in str(w.message) and "may hold" in str(w.message)]
    assert len(said) == 1 and "step 5 (local copy)" in said[0], [str(w.message) for w in caught]


def test_a_copys_identity_is_typed_and_stored_where_it_always_was():
    """Which save wrote a copy and whose it is (save id, tier, rank, the job's world size, the
    persistent root it was saved for) are typed fields of the manifest, stored in its ``"extra"``
    object under the keys every async_ckpt wrote: an older manifest reads, a new one is written
    the same, and a value of another type is damage, named."""
    import json

    from async_ckpt.errors import CorruptCheckpointError
    from async_ckpt.format.manifest import CopyIdentity, Manifest

    stored = {"step": 3, "commit_time": 1.5, "files": {}, "world_size": 1,
              "extra": {"save_id": "ab.2", "tier": "local", "rank": 1, "world_size": 2,
                        "persistent_root": "file:///ck/", "int_keys": ["s.0"]}}
    m = Manifest.from_json(json.dumps(stored).encode())
    assert m.identity == CopyIdentity("ab.2", "local", 1, 2, "file:///ck/")
    assert m.extra == {"int_keys": ["s.0"]} and m.int_keys == ["s.0"] and not m.whole
    assert json.loads(m.to_json())["extra"] == stored["extra"]  # written where it was read from
    assert m.identity.saved_for_another("file:///ck/") is None
    assert m.identity.saved_for_another("file:///other/") == "file:///ck/"
    assert m.identity.is_rank(1, 2) and not m.identity.is_rank(0, 2)
    plain = Manifest.from_json(json.dumps({"step": 1, "commit_time": 1.0, "files": {}}).encode())
    assert plain.identity == CopyIdentity() and plain.whole and plain.identity.is_rank(0, 1)
    assert "extra" in json.loads(plain.to_json()) and json.loads(plain.to_json())["extra"] == {}
    for key, bad in (("rank", "1"), ("world_size", 0), ("save_id", 5), ("persistent_root", [])):
        broken = json.dumps({**stored, "extra": {**stored["extra"], key: bad}}).encode()
        with pytest.raises(CorruptCheckpointError, match=key):
            Manifest.from_json(broken, where="m.json")
