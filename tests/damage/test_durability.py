"""Durability and integrity: nothing committed is lost, nothing damaged or unsafe is loaded.

Everything here runs on real files: local paths (both commit protocols), and ``faulty://``
(tests/support/faulty_fs.py), a wrapping fsspec filesystem over a local directory that injects
transient errors, permanent errors (ENOSPC, EACCES) and silently truncated writes on the
object-store code path (marker commit, fsspec I/O, no rename).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pickle
import time
import warnings

import pytest
import torch

from async_ckpt import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    InvalidStateDictError,
    InvalidStepError,
    StateDictMismatchError,
    StepNotFoundError,
    StorageError,
    UnsafeCheckpointError,
)
from async_ckpt.format.crc import crc32c
from async_ckpt.format.dcp_layout import METADATA_NAME
from async_ckpt.format.manifest import MANIFEST_NAME, MARKER_NAME, PENDING_NAME, Manifest, marker_bytes
from async_ckpt.io import save_state_dict
from async_ckpt.storage import RetryPolicy
from async_ckpt.storage.lease import LOCK_NAME

from ..conftest import assert_bitwise_equal, clone_tree, data_files, flip_byte, medium_state, target_like

FAST = RetryPolicy(attempts=3, initial_delay=0.001, max_delay=0.005)


# ---- helpers -------------------------------------------------------------------------------

def template() -> dict:
    """A restore target: same structure and dtypes as ``medium_state``, different contents."""
    return target_like(medium_state(0))


def restored(mgr: CheckpointManager, step) -> dict:
    t = template()
    got = mgr.restore(step, t)
    return got, t


def tree_digest(root: str) -> dict:
    """Every file under ``root`` with the hash of its bytes."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def rewrite_manifest(step_dir: str, edit) -> None:
    """Edit a step's manifest and re-sign it with a matching marker (a consistent forgery)."""
    m = Manifest.from_json(open(os.path.join(step_dir, MANIFEST_NAME), "rb").read())
    edit(m)
    mbytes = m.to_json()
    open(os.path.join(step_dir, MANIFEST_NAME), "wb").write(mbytes)
    open(os.path.join(step_dir, MARKER_NAME), "wb").write(marker_bytes(m.step, mbytes))


@pytest.fixture
def faulty(tmp_path):
    """A manager on faulty:// over a local directory, with steps 1 committed; yields (mgr, fs, dir)."""
    root = str(tmp_path / "faulty")
    mgr = CheckpointManager("faulty://" + root, retry=FAST)
    assert mgr.layout.mode == "marker"
    mgr.save(1, medium_state(1))
    yield mgr, mgr.storage.fs, root
    try:
        mgr.close()
    except CheckpointError:
        pass


def _error_chain(exc: BaseException) -> str:
    parts = []
    while exc is not None:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


# ---- fault injection -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["reset", "timeout", "eio", "http503"])
@pytest.mark.parametrize("name", ["*.distcp", METADATA_NAME, MANIFEST_NAME, MARKER_NAME])
def test_transient_write_failure_is_retried_and_committed(faulty, kind, name):
    mgr, fs, root = faulty
    # Data files are streamed: fail after some bytes went out, so the retry must redo the whole file.
    fs.inject("write", name, kind, times=1, after_bytes=1000 if name == "*.distcp" else 0)
    assert mgr.save_async(2, medium_state(2))
    mgr.join()
    assert [h[2] for h in fs.hits] == [kind], fs.hits
    assert mgr.all_steps() == [1, 2]
    got, t = restored(mgr, 2)
    assert got == 2
    assert_bitwise_equal(t, medium_state(2))


def test_transient_read_failure_is_retried(faulty):
    mgr, fs, _ = faulty
    fs.inject("read", "*.distcp", "reset", times=1)
    fs.inject("read", MANIFEST_NAME, "timeout", times=1)
    got, t = restored(mgr, 1)
    assert got == 1 and len(fs.hits) == 2
    assert_bitwise_equal(t, medium_state(1))


def test_write_failing_always_surfaces_at_next_call_and_commits_nothing(faulty):
    mgr, fs, root = faulty
    before = tree_digest(os.path.join(root, "1"))
    fs.inject("write", "*.distcp", "reset")
    assert mgr.save_async(2, medium_state(2))  # staging succeeds; the write fails in the background
    with pytest.raises(CheckpointError) as ei:
        mgr.save_async(3, medium_state(3))  # the next call raises step 2's failure
    assert ei.value.step == 2
    assert "connection reset" in _error_chain(ei.value)
    assert len(fs.hits) == FAST.attempts  # bounded retries, then give up
    assert mgr.all_steps() == [1]
    assert not os.path.exists(os.path.join(root, "2")), "the failed step was not removed"
    assert tree_digest(os.path.join(root, "1")) == before
    got, t = restored(mgr, None)
    assert got == 1
    assert_bitwise_equal(t, medium_state(1))
    # The error is raised once; once storage recovers, saving works again.
    fs.clear()
    mgr.save(4, medium_state(4))
    assert mgr.all_steps() == [1, 4]


@pytest.mark.parametrize("kind,text", [("enospc", "No space left on device"), ("eacces", "Permission denied"),
                                       ("http403", "403 injected: Forbidden")])
def test_permanent_error_fails_at_once(faulty, kind, text):
    mgr, fs, root = faulty
    fs.inject("write", "*.distcp", kind)
    mgr.save_async(2, medium_state(2))
    with pytest.raises(CheckpointError) as ei:
        mgr.join()
    chain = _error_chain(ei.value)
    assert ei.value.step == 2 and text in chain, chain
    if kind != "http403":  # OS errors become a StorageError; a client's HTTP error is kept as is
        assert "StorageError" in chain, chain
    assert "__0_0.distcp" in chain  # names the file
    assert len(fs.hits) == 1, "a permanent error must not be retried"
    assert mgr.all_steps() == [1]
    assert not os.path.exists(os.path.join(root, "2"))
    assert_bitwise_equal(restored(mgr, 1)[1], medium_state(1))


def test_permanent_error_on_commit_marker_leaves_step_uncommitted(faulty):
    mgr, fs, root = faulty
    fs.inject("write", MARKER_NAME, "enospc")
    with pytest.raises(CheckpointError, match="No space left"):
        mgr.save(2, medium_state(2))
    assert mgr.all_steps() == [1]
    assert not os.path.exists(os.path.join(root, "2"))


def test_truncated_data_write_is_detected_and_redone(faulty):
    mgr, fs, root = faulty
    fs.inject("write", "*.distcp", "truncate", times=1)
    mgr.save(2, medium_state(2))
    assert [h[2] for h in fs.hits] == ["truncate"]
    assert_bitwise_equal(restored(mgr, 2)[1], medium_state(2))


def test_truncated_data_write_always_fails_the_step(faulty):
    mgr, fs, root = faulty
    fs.inject("write", "*.distcp", "truncate")
    with pytest.raises(CheckpointError) as ei:
        mgr.save(2, medium_state(2))
    assert "short write" in _error_chain(ei.value)
    assert mgr.all_steps() == [1]
    assert not os.path.exists(os.path.join(root, "2"))


@pytest.mark.parametrize("name,problem", [(METADATA_NAME, "size is"), (MANIFEST_NAME, "does not match its commit marker"),
                                          (MARKER_NAME, "commit marker is unreadable")])
def test_truncated_small_file_is_detected_on_restore(faulty, name, problem):
    """Small files are written in one request and not re-read at save time: a short write of
    one of them is caught by the manifest/marker checks on restore, and restore(None) falls back."""
    mgr, fs, root = faulty
    fs.inject("write", name, "truncate", times=1)
    mgr.save(2, medium_state(2))
    assert mgr.all_steps() == [1, 2]
    t = template()
    before = clone_tree(t)
    with pytest.raises(CorruptCheckpointError, match=problem) as ei:
        mgr.restore(2, t)
    assert ei.value.step == 2 and ei.value.path.endswith(name), (ei.value.path, name)
    assert_bitwise_equal(t, before)
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2"):
        got, t = restored(mgr, None)
    assert got == 1
    assert_bitwise_equal(t, medium_state(1))


def _names(root):
    """The root's entries, without the writer lease's lock file."""
    return sorted(n for n in os.listdir(root) if n != LOCK_NAME)


def test_half_finished_deletion_never_looks_committed(tmp_path):
    """Retention removes the marker first: when removing the data then fails, the step is gone
    from the listing, and the next startup cleans up what is left."""
    root = str(tmp_path / "faulty")
    mgr = CheckpointManager("faulty://" + root, max_to_keep=1, retry=FAST)
    fs = mgr.storage.fs
    mgr.save(1, medium_state(1))
    fs.inject("rm", "*.distcp", "eacces")
    mgr.save(2, medium_state(2))
    mgr.close()  # waits for retention
    assert any(h[0] == "rm" for h in fs.hits)
    assert os.path.isdir(os.path.join(root, "1")) and not os.path.exists(os.path.join(root, "1", MARKER_NAME))
    assert mgr.all_steps() == [2]
    mgr2 = CheckpointManager("faulty://" + root, retry=FAST)
    assert mgr2.all_steps() == [2]
    got, t = restored(mgr2, None)
    assert got == 2
    assert os.path.isdir(os.path.join(root, "1"))  # a manager that only restores deletes nothing
    mgr2.save(3, medium_state(3))  # the first save takes the writer lease and cleans up
    mgr2.close()  # waits for the cleanup
    assert sorted(os.listdir(root)) == ["2", "3"]


# ---- damage on disk ------------------------------------------------------------------------

def _truncate(path):
    b = open(path, "rb").read()
    open(path, "wb").write(b[: len(b) - 7])


def _garbage(path):
    open(path, "wb").write(os.urandom(200))


def _data_file(d):
    return data_files(d)[0]


DAMAGE = {
    # name: (damage(step_dir) -> file it names, expected message)
    "flipped byte in data file": (lambda d: (flip_byte(_data_file(d)), _data_file(d))[1], "checksum mismatch"),
    "flipped byte in .metadata": (lambda d: (flip_byte(os.path.join(d, METADATA_NAME)), os.path.join(d, METADATA_NAME))[1],
                                  "checksum mismatch"),
    "truncated data file": (lambda d: (_truncate(_data_file(d)), _data_file(d))[1], "size is"),
    "missing data file": (lambda d: (lambda f: (os.remove(f), f)[1])(_data_file(d)), "file is missing"),
    "missing .metadata": (lambda d: (os.remove(os.path.join(d, METADATA_NAME)), os.path.join(d, METADATA_NAME))[1],
                          "file is missing"),
    "missing manifest": (lambda d: (os.remove(os.path.join(d, MANIFEST_NAME)), os.path.join(d, MANIFEST_NAME))[1],
                         "manifest is missing"),
    "garbage manifest": (lambda d: (_garbage(os.path.join(d, MANIFEST_NAME)), os.path.join(d, MANIFEST_NAME))[1],
                         "does not match its commit marker"),
    "flipped byte in manifest": (lambda d: (flip_byte(os.path.join(d, MANIFEST_NAME)), os.path.join(d, MANIFEST_NAME))[1],
                                 "does not match its commit marker"),
    "garbage manifest, re-signed marker": (
        lambda d: (open(os.path.join(d, MANIFEST_NAME), "wb").write(b"{not json"),
                   open(os.path.join(d, MARKER_NAME), "wb").write(marker_bytes(2, b"{not json")),
                   os.path.join(d, MANIFEST_NAME))[2], "not a valid async_ckpt manifest"),
    "garbage marker": (lambda d: (_garbage(os.path.join(d, MARKER_NAME)), os.path.join(d, MARKER_NAME))[1],
                       "commit marker is unreadable"),
    "marker of another manifest": (
        lambda d: (open(os.path.join(d, MARKER_NAME), "wb").write(marker_bytes(2, b'{"other": 1}')),
                   os.path.join(d, MANIFEST_NAME))[1], "does not match its commit marker"),
    "marker copied from another step": (
        lambda d: (open(os.path.join(d, MARKER_NAME), "wb").write(
            open(os.path.join(os.path.dirname(d), "1", MARKER_NAME), "rb").read()), os.path.join(d, MARKER_NAME))[1],
        "commit marker is for step 1"),
    "manifest lies about a size (re-signed)": (
        lambda d: (rewrite_manifest(d, lambda m: setattr(m.files[os.path.basename(_data_file(d))], "size", 12)),
                   _data_file(d))[1], "manifest says 12"),
    "manifest lies about a checksum (re-signed)": (
        lambda d: (rewrite_manifest(d, lambda m: setattr(m.files[os.path.basename(_data_file(d))], "crc32c", 5)),
                   _data_file(d))[1], "checksum mismatch"),
}


@pytest.mark.parametrize("mode", ["rename", "marker", "fsspec"])
@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_detected_and_restore_none_falls_back(tmp_path, mode, case):
    root = str(tmp_path / "ckpt")
    # fsspec: the object stores' code paths (marker commits, ranged reads through fsspec) over these files
    mgr = (CheckpointManager(f"faulty://{root}") if mode == "fsspec" else CheckpointManager(root, commit_mode=mode))
    mgr.save(1, medium_state(1))
    mgr.save(2, medium_state(2))
    damage, problem = DAMAGE[case]
    named = damage(os.path.join(root, "2"))
    assert mgr.all_steps() == [1, 2]

    t = template()
    del t["optim"]["betas"]  # an entry restore would add: it must be taken out again on failure
    before = clone_tree(t)
    with pytest.raises(CorruptCheckpointError, match=problem) as ei:
        mgr.restore(2, t)
    assert ei.value.step == 2
    assert os.path.basename(named) in str(ei.value) and ei.value.path == named, (str(ei.value), ei.value.path)
    assert "betas" not in t["optim"], "an entry the failed restore added is taken out again"
    if "partly written" in str(ei.value):
        # Documented contract: the default restore reads straight into the target, so damage
        # found mid-read leaves it partly written (and says so); atomic=True does not.
        t = clone_tree(before)
        with pytest.raises(CorruptCheckpointError, match=problem) as ei:
            mgr.restore(2, t, atomic=True)
        assert ei.value.step == 2 and "partly written" not in str(ei.value)
        assert os.path.basename(named) in str(ei.value) and ei.value.path == named, (str(ei.value), ei.value.path)
    assert_bitwise_equal(t, before)  # the state dict passed in is untouched

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, t = restored(mgr, None)
    skipped = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "skipping" in str(w.message)]
    assert got == 1
    assert len(skipped) == 1 and "skipping damaged step 2" in skipped[0] and os.path.basename(named) in skipped[0]
    assert_bitwise_equal(t, medium_state(1))
    mgr.close()


@pytest.mark.parametrize("mode", ["rename", "marker"])
def test_every_step_damaged_raises(tmp_path, mode):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root, commit_mode=mode)
    mgr.save(1, medium_state(1))
    mgr.save(2, medium_state(2))
    for s in (1, 2):
        flip_byte(_data_file(os.path.join(root, str(s))))
    t = template()
    before = clone_tree(t)
    with pytest.warns(RuntimeWarning, match="skipping damaged step"):
        with pytest.raises(CorruptCheckpointError, match="no committed step .* passed verification.*partly written"):
            mgr.restore(None, t)  # the default restore writes as it reads, and says so
    t = clone_tree(before)
    with pytest.warns(RuntimeWarning, match="skipping damaged step"):
        with pytest.raises(CorruptCheckpointError, match="no committed step .* passed verification"):
            mgr.restore(None, t, atomic=True)
    assert_bitwise_equal(t, before)
    mgr.close()


def test_verify_false_skips_checksums_but_not_sizes(tmp_path):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root, verify=False)
    mgr.save(1, medium_state(1))
    mgr.save(2, medium_state(2))
    _truncate(_data_file(os.path.join(root, "2")))
    with pytest.raises(CorruptCheckpointError, match="size is"):
        mgr.restore(2, template())
    # Checksums are skipped with verify=False: a flipped byte in tensor data is not caught.
    flip_byte(_data_file(os.path.join(root, "1")), at=-10)
    got, _ = restored(mgr, 1)
    assert got == 1
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        mgr.restore(1, template(), verify=True)
    mgr.close()


@pytest.mark.parametrize("mode", ["rename", "marker"])
def test_missing_marker_means_not_committed(tmp_path, mode):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root, commit_mode=mode)
    mgr.save(1, medium_state(1))
    mgr.save(2, medium_state(2))
    os.remove(os.path.join(root, "2", MARKER_NAME))
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    t = template()
    before = clone_tree(t)
    with pytest.raises(StepNotFoundError, match="step 2"):
        mgr.restore(2, t)
    assert_bitwise_equal(t, before)
    got, t = restored(mgr, None)
    assert got == 1
    assert_bitwise_equal(t, medium_state(1))
    mgr.close()
    # Kept with keep_incomplete=True; otherwise removed by the startup cleanup.
    kept = CheckpointManager(root, commit_mode=mode, keep_incomplete=True)
    kept.save(3, medium_state(3))
    kept.close()
    assert os.path.isdir(os.path.join(root, "2"))
    CheckpointManager(root, commit_mode=mode).close()
    assert os.path.isdir(os.path.join(root, "2"))  # a manager that never saved deletes nothing
    mgr = CheckpointManager(root, commit_mode=mode)
    mgr.save(4, medium_state(4))  # the first save takes the writer lease and cleans up
    mgr.close()
    assert _names(root) == ["1", "3", "4"]


# ---- metadata safety -----------------------------------------------------------------------

class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _EvalEvil:
    def __reduce__(self):
        return (eval, ("__import__('os').system('true')",))


@pytest.mark.parametrize("resign", [True, False])
def test_malicious_metadata_does_not_run(tmp_path, resign):
    root = str(tmp_path / "ckpt")
    pwned = tmp_path / "pwned"
    mgr = CheckpointManager(root)
    mgr.save(1, medium_state(1))
    mgr.save(2, medium_state(2))
    d = os.path.join(root, "2")
    payload = pickle.dumps(_Evil(str(pwned)))
    open(os.path.join(d, METADATA_NAME), "wb").write(payload)
    if resign:  # a consistent forgery: manifest and marker vouch for the payload
        rewrite_manifest(d, lambda m: m.files.__setitem__(METADATA_NAME, type(m.files[METADATA_NAME])(
            len(payload), crc32c(payload))))
    t = template()
    before = clone_tree(t)
    expected = UnsafeCheckpointError if resign else CorruptCheckpointError
    with pytest.raises(expected, match="system|checksum|size"):
        mgr.restore(2, t)
    assert not pwned.exists(), "unpickling the metadata ran code"
    assert_bitwise_equal(t, before)
    if resign:
        # A tampered checkpoint is a security problem, not damage: restore(None) does not
        # quietly fall back over it either.
        with pytest.raises(UnsafeCheckpointError):
            mgr.restore(None, template())
    assert not pwned.exists()
    mgr.close()


def test_metadata_unpickler_refuses_builtins_eval():
    from async_ckpt.format.unpickling import load_metadata

    with pytest.raises(UnsafeCheckpointError, match="eval"):
        load_metadata(pickle.dumps(_EvalEvil()))
    # DCP classes that are not plain records (a reader/writer) are refused too.
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class Gadget:
        def __reduce__(self):
            return (FileSystemWriter, (str("/nonexistent/x"),))

    with pytest.raises(UnsafeCheckpointError, match="FileSystemWriter"):
        load_metadata(pickle.dumps(Gadget()))


def test_malicious_object_in_data_is_not_unpickled_and_state_untouched(tmp_path):
    """A non-tensor item whose unpickling would run code: refused (weights_only) before any
    tensor of the state dict is touched."""
    root = str(tmp_path / "ckpt")
    pwned = tmp_path / "pwned"
    forger = CheckpointManager(root)
    forger.close()  # its startup cleanup is done: the forged step's temp directory stays
    target = forger.layout.begin(5)
    sd = {"w": torch.arange(10.0), "z": torch.ones(4), "evil": _Evil(str(pwned))}
    files = save_state_dict(forger.storage, target.path, sd, threads=1)
    forger.layout.commit(target, Manifest(step=5, commit_time=time.time(), files=files))
    assert not pwned.exists()
    mgr = CheckpointManager(root)
    t = {"w": torch.zeros(10), "z": torch.zeros(4), "evil": None}
    before = clone_tree(t)
    with pytest.raises(UnsafeCheckpointError, match="evil"):
        mgr.restore(5, t)
    assert not pwned.exists(), "restoring ran code"
    assert_bitwise_equal(t, before)
    mgr.close()


# ---- startup: recovery and cleanup ---------------------------------------------------------

def test_startup_cleans_incomplete_steps_unless_kept(tmp_path):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root)
    mgr.save(1, medium_state(1))
    mgr.save(2, medium_state(2))
    mgr.close()
    debris = [".tmp-3-0123456789ab", ".trash-1-aaaaaaaaaaaa", "4"]  # half-written temp, trash, unmarked step
    for name in debris:
        os.makedirs(os.path.join(root, name))
        open(os.path.join(root, name, "__0_0.distcp"), "wb").write(b"partial")
    open(os.path.join(root, ".tmp-3-0123456789ab", MANIFEST_NAME), "wb").write(b"{}")  # no marker: incomplete
    open(os.path.join(root, "4", PENDING_NAME), "wb").write(b"")  # a marker-mode save that died midway
    os.makedirs(os.path.join(root, "5"))  # not ours (e.g. torch_xla's manager): never touched
    open(os.path.join(root, "5", ".metadata"), "wb").write(b"foreign")
    digest = tree_digest(root)

    kept = CheckpointManager(root, keep_incomplete=True)
    assert kept.all_steps() == [1, 2]
    kept.close()
    assert tree_digest(root) == digest

    mgr = CheckpointManager(root)
    assert mgr.all_steps() == [1, 2]  # never listed, even before the cleanup ran
    assert tree_digest(root) == digest  # a manager that has not saved yet touches nothing
    mgr.save(6, medium_state(6))  # the first save takes the writer lease, then cleans up
    mgr.close()  # waits for the background cleanup
    assert _names(root) == ["1", "2", "5", "6"]
    assert_bitwise_equal(restored(CheckpointManager(root), 2)[1], medium_state(2))


@pytest.mark.parametrize("old_copy", [False, True])
def test_startup_completes_an_interrupted_rename_commit(tmp_path, old_copy):
    """A crash after the marker was written in the temp directory but before the rename: the
    step is complete, and the next manager puts it in place (instead of deleting it)."""
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root)
    mgr.save(1, medium_state(1))
    mgr.save(3, medium_state(3))
    mgr.close()
    os.rename(os.path.join(root, "3"), os.path.join(root, ".tmp-3-abcdef012345"))
    if old_copy:  # re-save of step 3 interrupted after the old copy lost its marker
        os.makedirs(os.path.join(root, "3"))
        open(os.path.join(root, "3", "__0_0.distcp"), "wb").write(b"old")
        open(os.path.join(root, "3", PENDING_NAME), "wb").write(b"")  # unmarking leaves the sentinel
    mgr = CheckpointManager(root)
    assert mgr.all_steps() == [1, 3]  # the finished copy counts before anything is moved
    got, t = restored(mgr, None)
    assert got == 3
    assert_bitwise_equal(t, medium_state(3))
    mgr.save(4, medium_state(4))  # the first save takes the writer lease and completes the commit
    mgr.close()
    assert _names(root) == ["1", "3", "4"]
    assert_bitwise_equal(restored(CheckpointManager(root), 3)[1], medium_state(3))


def test_failed_save_does_not_block_later_saves_or_touch_committed(tmp_path):
    """A save failing for a bad leaf raises at the call, before anything is written."""
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root)
    mgr.save(1, medium_state(1))
    digest = tree_digest(root)
    with pytest.raises(InvalidStateDictError):
        mgr.save_async(2, {"f": lambda x: x})
    assert tree_digest(root) == digest
    mgr.save(2, medium_state(2))
    assert mgr.all_steps() == [1, 2]
    mgr.close()


# ---- bad input never damages a committed checkpoint ----------------------------------------

def test_bad_input_raises_typed_errors_and_never_damages_committed(tmp_path):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root)
    mgr.save(1, medium_state(1))
    digest = tree_digest(root)

    def raises(exc_type, fn, *must_name):
        with pytest.raises(exc_type) as ei:
            fn()
        for word in must_name:
            assert word in str(ei.value), f"{word!r} not named in: {ei.value}"
        return ei.value

    for bad in (-1, 1.5, "2", True, None):
        raises(InvalidStepError, lambda: mgr.save(bad, medium_state(1)), "step")
        raises(InvalidStepError, lambda: mgr.save_async(bad, medium_state(1)), "step")
    raises(InvalidStepError, lambda: mgr.restore(-3, template()), "step")
    for bad in ([1, 2], None, torch.zeros(3), "state"):
        raises(InvalidStateDictError, lambda: mgr.save(2, bad), "mapping")
        raises(InvalidStateDictError, lambda: mgr.restore(1, bad), "mapping")
    with open(os.devnull, "rb") as fh:
        for leaf, name in ((lambda x: x, "fn"), (fh, "handle")):
            raises(InvalidStateDictError, lambda: mgr.save(2, {"ok": torch.ones(2), "nested": {name: leaf}}),
                   f"nested.{name}")
    raises(StepNotFoundError, lambda: mgr.restore(7, template()), "7")

    # Mismatches name the keys, shapes and dtypes involved; the target is left untouched.
    t = template()
    t["model"]["extra"] = torch.zeros(3)
    before = clone_tree(t)
    raises(StateDictMismatchError, lambda: mgr.restore(1, t), "model.extra")
    assert_bitwise_equal(t, before)
    t = template()
    t["model"]["w"] = torch.zeros(64, 47)
    before = clone_tree(t)
    raises(StateDictMismatchError, lambda: mgr.restore(1, t), "model.w", "(64, 47)", "(64, 48)")
    assert_bitwise_equal(t, before)
    t = template()
    t["optim"]["m"] = t["optim"]["m"].to(torch.int32)
    before = clone_tree(t)
    raises(StateDictMismatchError, lambda: mgr.restore(1, t), "optim.m", "int32", "int64")
    assert_bitwise_equal(t, before)

    # An unwritable location fails at construction with a typed error.
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"x")
    raises(StorageError, lambda: CheckpointManager(str(blocker / "ckpt")), "cannot be written")

    assert tree_digest(root) == digest, "a bad call changed a committed checkpoint"
    assert mgr.all_steps() == [1]
    assert_bitwise_equal(restored(mgr, 1)[1], medium_state(1))
    mgr.save(2, medium_state(2))  # the manager still works
    mgr.close()


@pytest.mark.parametrize("available", [True, False])
def test_local_files_start_writeback_early_and_cover_every_byte(tmp_path, monkeypatch, available):
    """Local data files hand every full chunk to the disk as it is written (``sync_file_range``),
    so the closing fsync does not wait for the whole file; without the call, files are the same."""
    from async_ckpt.storage.backends import posix
    from async_ckpt.storage.storage import Storage

    calls = []
    monkeypatch.setattr(posix, "WRITEBACK_BYTES", 1 << 20)
    monkeypatch.setattr(posix, "_sync_file_range",
                        (lambda fd, off, n: calls.append((off, n))) if available else None)
    storage = Storage(str(tmp_path))
    chunks = [os.urandom(n) for n in (300_000, 900_000, 2_500_000, 10, 1_200_000)]
    path = storage.join("f.bin")
    with storage.open_write(path) as f:
        for c in chunks:
            f.write(c)
    with open(path, "rb") as fh:
        assert fh.read() == b"".join(chunks)
    if available:
        total = sum(map(len, chunks))
        assert [off for off, _ in calls] == list(itertools.accumulate([0] + [n for _, n in calls[:-1]]))
        assert sum(n for _, n in calls) == total, "every byte's writeback is started before the fsync"
        assert len(calls) >= 3 and all(n >= 1 << 20 for _, n in calls[:-1])
    else:
        assert calls == []
