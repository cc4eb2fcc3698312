"""Incremental saves that stay restorable (issue 35, items 1-5).

* A file an incremental save takes from the last step is verified first (a file this process
  wrote or verified and that is unchanged since, by its ``stat`` on POSIX paths; the object's
  stored CRC32C on GCS; else read back and checked): a bit flipped in it after its step
  committed makes the next save whole (and warns), so later steps restore and retention never
  leaves ``restore(None)`` with nothing.
* ``full_every`` counts from the manifests, so restarts do not defeat it.
* A declared-frozen tensor left uncopied holds, in the step, its bytes at the call, whatever
  happens to its file before the write (the 50% rule, a failed share, a re-save, a whole save
  due with two saves in flight) and whatever the training loop does to it meanwhile.
* A restore in between does not turn off the frozen check.
* ``promote`` lists every file of the persistent copy as written there.

Helpers and states are tests/incremental/test_incremental.py's (and tests/workers/incremental_worker.py's).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import threading
from typing import Any, Dict, List

import pytest
import torch

from async_ckpt import CheckpointManager, FrozenTensorChangedError
from async_ckpt.cli import main

from ..conftest import clone_tree, flip_byte
from ..workers.incremental_worker import BIG, make_state
from .test_incremental import (  # noqa: F401  (object_bucket: a fixture)
    FROZEN,
    Adapted,
    adapted_state,
    file_of,
    manager,
    object_bucket,
    ref_files,
    restore_bitwise,
    state_at,
    train_step,
)

KiB = 2**10


def steady_state(step: int) -> Dict[str, Any]:
    """The state of tests/workers/incremental_worker.py with only optim.m changing: every other large
    tensor's file is taken by every save."""
    return make_state(step, {**{k: 0 for k in BIG}, ("optim", "m"): step})


def warnings_of(caplog: pytest.LogCaptureFixture) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def cli(*argv: str) -> tuple:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    return rc, buf.getvalue()


# ---- 1. damage to a shared file after its step committed --------------------------------------

@pytest.mark.parametrize("how", ["write", "write, mtime put back"])
def test_a_bit_flipped_in_a_shared_file_makes_the_next_save_whole_and_every_later_step_restores(
        tmp_path, caplog, how):
    state_at = steady_state
    """max_to_keep=3, full_every=None, only optim.m changes: steps 1 and 2 hold step 0's file of
    model.layers.1.w and step 3 would take it again. A byte of it is flipped after step 2
    committed (through a plain write; once with its mtime put back, which only its ctime
    shows). Step 3 must find it and be written whole; steps 3-6 restore, and after retention
    restore(None) finds step 6 (before, every later step took the damaged file, and
    restore(None) found no intact step)."""
    root = str(tmp_path / "ckpt")
    with manager(root, max_to_keep=3) as mgr:
        for s in range(3):
            mgr.save(s, state_at(s))
            if s:  # the files written and taken by this process are vouched for by stat alone
                assert mgr.stats[-1].referred_bytes > 0 and mgr.stats[-1].extra["verify_read_bytes"] == 0
        victim = file_of(os.path.join(root, "2"), "model.layers.1.w")
        assert "_ref" in os.path.basename(victim)
        st = os.stat(victim)
        flip_byte(victim)
        if how != "write":
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
            assert os.stat(victim).st_mtime_ns == st.st_mtime_ns
        with caplog.at_level(logging.WARNING, logger="async_ckpt"):
            mgr.save(3, state_at(3))
        said = [m for m in warnings_of(caplog) if os.path.basename(victim) in m]
        assert said and "step 2" in said[0] and "step 3" in said[0], warnings_of(caplog)
        man = mgr.layout.read_manifest(3)
        assert man.referred_bytes == 0 and ref_files(root, 3) == [], man.files
        for s in range(4, 7):  # incremental again, from step 3 on; retention's unlinks need no read
            mgr.save(s, state_at(s))
            assert mgr.stats[-1].referred_bytes > 0 and mgr.stats[-1].extra["verify_read_bytes"] == 0
        assert mgr.all_steps() == [4, 5, 6]
        for s in (4, 5, 6):
            restore_bitwise(mgr, s, state_at(s))
    with CheckpointManager(root) as fresh:
        assert restore_bitwise(fresh, None, state_at(6)) == 6
    rc, out = cli("verify", root, "--all", "--no-progress")
    assert rc == 0, out


def _flip_object(fs: Any, path: str) -> None:
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(path, bytes(data))


def _damaged_shared_objects_then_save(url: str, fs: Any, base: str, caplog: pytest.LogCaptureFixture,
                                      **kw: Any) -> None:
    """Steps 0-2 saved; every file step 2 took is damaged (rewritten with one bit flipped);
    step 3 must be whole and warn, step 4 incremental again; both restore bitwise."""
    with CheckpointManager(url, incremental=True, **kw) as mgr:
        mgr.storage.max_file_bytes = 64 * KiB
        for s in range(3):
            mgr.save(s, state_at(s))
            if s:  # the files written and taken by this process are vouched for without a read
                assert mgr.stats[-1].referred_bytes > 0 and mgr.stats[-1].extra["verify_read_bytes"] == 0
        man = mgr.layout.read_manifest(2)
        taken = sorted(n for n, r in man.files.items() if r.ref is not None)
        assert taken
        for name in taken:
            _flip_object(fs, f"{base}/2/{name}")
        with caplog.at_level(logging.WARNING, logger="async_ckpt"):
            mgr.save(3, state_at(3))
        assert any("step 2" in m and "step 3" in m and any(n in m for n in taken) for m in warnings_of(caplog)), \
            warnings_of(caplog)
        assert mgr.layout.read_manifest(3).referred_bytes == 0
        mgr.save(4, state_at(4))
        assert mgr.layout.read_manifest(4).referred_bytes > 0
        for s in (3, 4):
            restore_bitwise(mgr, s, state_at(s))
        assert restore_bitwise(mgr, None, state_at(4)) == 4


def test_a_damaged_shared_file_on_memory_fs_makes_the_next_save_whole(memory_root, caplog):
    import fsspec

    fs, base = fsspec.core.url_to_fs(memory_root)
    _damaged_shared_objects_then_save(memory_root, fs, base, caplog)


def test_a_damaged_shared_object_makes_the_next_save_whole(object_bucket, caplog):  # noqa: F811 - the fixture
    """GCS (the object's stored CRC32C) and S3 (moto: the object's ETag, noted after its upload)."""
    fs = object_bucket.fs()
    base = object_bucket.url.split("://", 1)[1]
    _damaged_shared_objects_then_save(object_bucket.url, fs, base, caplog,
                                      storage_options=object_bucket.storage_options)


def test_verify_reads_every_file_of_an_object_store_step(object_bucket):  # noqa: F811 - the fixture
    """What checks a taken file that must be read back (and ``async-ckpt verify``) reads each
    file whole and asks for one byte past its end: GCS and S3 answer that with HTTP 416, which
    must read as the end of the file (it failed the read before)."""
    with CheckpointManager(object_bucket.url, storage_options=object_bucket.storage_options) as mgr:
        mgr.save(0, state_at(0))
    opts = [f"--storage-option={k}={json.dumps(v)}" for k, v in object_bucket.storage_options.items()]
    rc, out = cli("verify", object_bucket.url, "0", "--no-progress", *opts)
    assert rc == 0 and ": ok" in out, out


def test_a_damaged_shared_local_file_makes_the_next_local_save_whole(tmp_path, caplog):
    """The local tier is a root of its own: damage to its shared file makes its next save
    whole; the persistent root, untouched, goes on sharing; both restore bitwise."""
    state_at = steady_state
    path, local = str(tmp_path / "bucket"), str(tmp_path / "local")
    with manager(path, local_dir=local, local_policy=1, local_retention=3) as mgr:
        for s in range(3):
            mgr.save(s, state_at(s))
        victim = os.path.join(local, "2", ref_files(local, 2)[0])  # taken at step 2, so at step 3 too
        flip_byte(victim)
        with caplog.at_level(logging.WARNING, logger="async_ckpt"):
            mgr.save(3, state_at(3))
        assert any(os.path.basename(victim) in m and local in m for m in warnings_of(caplog)), warnings_of(caplog)
        assert ref_files(local, 3) == [] and ref_files(path, 3)
        mgr.save(4, state_at(4))
        assert ref_files(local, 4)
    with manager(path, local_dir=local) as both:
        for s in (3, 4):
            restore_bitwise(both, s, state_at(s))
    with CheckpointManager(path) as persistent:
        restore_bitwise(persistent, 3, state_at(3))


# ---- 2. full_every across restarts ------------------------------------------------------------

def test_full_every_is_kept_by_a_job_restarted_at_every_save(tmp_path):
    """full_every=2, a new manager (restore(None), then one save) per step: steps 0, 2, 4, 6
    are whole, and no step takes a file written more than one save before it (before, the
    count lived in the process and step 6 still took step 0's files)."""
    root = str(tmp_path / "ckpt")
    for step in range(7):
        with manager(root, full_every=2) as mgr:
            if step:
                assert restore_bitwise(mgr, None, state_at(step - 1)) == step - 1
            mgr.save(step, state_at(step))
    with CheckpointManager(root) as mgr:
        mans = {s: mgr.layout.read_manifest(s) for s in mgr.all_steps()}
        for s in mans:
            restore_bitwise(mgr, s, state_at(s))
    whole = [s for s, m in mans.items() if m.referred_bytes == 0]
    assert whole == [0, 2, 4, 6], whole
    for s, m in mans.items():
        for r in m.files.values():
            if r.ref is not None:
                assert int(r.ref.split("/")[0]) == s - 1, (s, r.ref)


# ---- 3. a declared-frozen tensor holds its bytes at the call ----------------------------------

class Gate:
    """``on_saved``: holds the writer thread after the ``after``-th committed save until the
    test releases it, so that later saves are called (and staged) while it waits."""

    def __init__(self, after: int) -> None:
        self.after, self.count = after, 0
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, stats: Any) -> None:
        self.count += 1
        if self.count == self.after:
            self.reached.set()
            assert self.release.wait(60)


class Counter:
    """A ``Stateful`` value: it sends a one-process save through DCP's planner and
    ``FsspecStorageWriter``, the path every multi-rank save takes."""

    def __init__(self, n: int) -> None:
        self.n = torch.tensor([n])

    def state_dict(self) -> Dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.n = sd["n"]


def frozen_state(base: torch.Tensor, step: int, stateful: bool = False) -> Dict[str, Any]:
    """A frozen base (256 KiB) and a trainable head (512 KiB) that changes at every step."""
    g = torch.Generator().manual_seed(step)
    return {"base": base, "head": torch.randn(512, 256, generator=g), "step": step,
            **({"counter": Counter(step)} if stateful else {})}


def _frozen_saves_while_the_base_changes(root: str, *, after: int, steps: List[int], one_file: bool,
                                         stateful: bool = False, **kw: Any) -> Dict[int, Dict[str, Any]]:
    """Save ``steps`` asynchronously with ``base`` declared frozen; the writer is held after the
    ``after``-th commit, the later saves are called meanwhile (their base left uncopied), then
    the base is changed in place (its version counter moves, as an optimizer or a restore
    would), then the writer goes on. Returns what each step held at its call."""
    base = torch.randn(256, 256, generator=torch.Generator().manual_seed(99))
    gate = Gate(after)
    expected: Dict[int, Dict[str, Any]] = {}
    mgr = CheckpointManager(root, incremental=True, frozen=["base"], frozen_check_every=100,
                            max_pending_async=len(steps) + 1, on_saved=gate, **kw)
    if not one_file:
        mgr.storage.max_file_bytes = 64 * KiB  # a file per tensor
    try:
        for i, s in enumerate(steps):
            if i == after:
                assert gate.reached.wait(60)
            expected[s] = clone_tree(frozen_state(base, s, stateful))
            mgr.save_async(s, frozen_state(base, s, stateful))
        with torch.no_grad():
            base.mul_(2)  # after the calls
        gate.release.set()
        mgr.join()  # no FrozenTensorChangedError: the change moved the counter
        copied = {st.step: st.nbytes for st in mgr.stats}
        for s in steps[after:]:  # the base was not copied at the call: the case under test
            assert copied[s] < 768 * KiB, (s, copied)
        for s in sorted(set(steps)):
            restore_bitwise(mgr, s, expected[s])
    finally:
        gate.release.set()
        mgr.close()
    return expected


@pytest.mark.parametrize("path", ["one process", "DCP planner"])
def test_a_frozen_tensor_in_a_file_the_50_percent_rule_keeps_is_saved_as_it_was_at_the_call(tmp_path, path):
    """Base and head in one file: the head changed, so the file is not taken (the base is a
    third of it), and the base is written: as it was at the call, not as the loop left it
    (also through DCP's planner, the multi-rank writer, which wrote the live tensor)."""
    _frozen_saves_while_the_base_changes(str(tmp_path / "ckpt"), after=1, steps=[0, 1], one_file=True,
                                         stateful=path == "DCP planner")


@pytest.mark.parametrize("path", ["one process", "DCP planner"])
def test_a_frozen_tensor_whose_share_fails_is_saved_as_it_was_at_the_call(tmp_path, path):
    """faulty:// has no server-side copy: every share fails, and the base is written."""
    _frozen_saves_while_the_base_changes("faulty://" + str(tmp_path / "ckpt"), after=1, steps=[0, 1],
                                         one_file=False, stateful=path == "DCP planner")


def test_a_frozen_tensor_in_a_resave_of_the_last_step_is_saved_as_it_was_at_the_call(tmp_path):
    """Step 1 saved again: nothing is taken from the copy it replaces, so the base is written."""
    _frozen_saves_while_the_base_changes(str(tmp_path / "ckpt"), after=2, steps=[0, 1, 1], one_file=False)


def test_a_frozen_tensor_in_a_whole_save_due_with_two_saves_in_flight_is_saved_as_it_was_at_the_call(tmp_path):
    """full_every=2: steps 1 and 2 are called while step 0's commit is held; step 1 takes step
    0's base; step 2, due whole once step 1 commits, writes it: as it was at the call, and
    without a false FrozenTensorChangedError."""
    root = str(tmp_path / "ckpt")
    _frozen_saves_while_the_base_changes(root, after=1, steps=[0, 1, 2], one_file=False, full_every=2)
    with CheckpointManager(root) as mgr:
        assert [mgr.layout.read_manifest(s).referred_bytes == 0 for s in (0, 1, 2)] == [True, False, True]


# ---- 4. a restore in between keeps the frozen check --------------------------------------------

def test_a_frozen_tensor_changed_behind_the_counter_is_found_after_a_restore(tmp_path):
    """A restore into other tensors (an evaluation, say) between two saves: the check save
    still finds a change made behind the version counter, and so does close()."""
    root = str(tmp_path / "ckpt")
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with manager(root, frozen=FROZEN, frozen_check_every=2) as mgr:
        train_step(model, opt, 0)
        mgr.save(0, adapted_state(model, opt, 0))  # save 1
        expected0 = clone_tree(adapted_state(model, opt, 0))
        model.emb.weight.data.add_(1.0)  # behind the version counter
        restore_bitwise(mgr, 0, expected0)
        with pytest.raises(FrozenTensorChangedError) as info:
            mgr.save(1, adapted_state(model, opt, 1))  # save 2: the check
        assert list(info.value.keys) == ["model.emb.weight"]
        restore_bitwise(mgr, 1, clone_tree(adapted_state(model, opt, 1)))  # with the new bytes
    mgr = manager(root, frozen=FROZEN)
    mgr.save(2, adapted_state(model, opt, 2))
    expected2 = clone_tree(adapted_state(model, opt, 2))
    model.base.weight.data.mul_(3)  # behind the version counter
    restore_bitwise(mgr, 2, expected2)  # into other tensors
    with pytest.raises(FrozenTensorChangedError) as info:
        mgr.close()
    assert list(info.value.keys) == ["model.base.weight"]


# ---- 5. promote ------------------------------------------------------------------------------

def test_promote_of_an_incremental_local_step_lists_every_file_as_written_there(tmp_path):
    """The persistent copy of a promoted incremental step holds every byte itself: no ref, no
    referred bytes, and ``ls``/``show`` say nothing is shared; it verifies and restores."""
    path, local = str(tmp_path / "bucket"), str(tmp_path / "local")
    with CheckpointManager(path, incremental=True, local_dir=local, local_policy=1, local_retention=3,
                           save_interval=100) as mgr:
        mgr.storage.max_file_bytes = 64 * KiB
        for s in range(4):
            mgr.save(s, state_at(s))
        assert ref_files(local, 3)
        mgr.promote(3)
    with CheckpointManager(path) as persistent:
        man = persistent.layout.read_manifest(3)
        assert all(r.ref is None for r in man.files.values()), man.files
        assert man.referred_bytes == 0 and man.written_bytes == sum(r.size for r in man.files.values())
        restore_bitwise(persistent, 3, state_at(3))
    rc, out = cli("ls", path)
    assert rc == 0 and "stored once" not in out and "SHARED" not in out, out
    rc, out = cli("show", path, "3")
    assert rc == 0 and "incremental" not in out, out
    rc, out = cli("verify", path, "3", "--no-progress")
    assert rc == 0, out
    rc, out = cli("ls", local)  # the local tier's steps do share their files
    assert rc == 0 and "SHARED" in out, out


@pytest.mark.parametrize("entry, word", [({"carried": -1}, "carried"), ({"carried": "2"}, "carried"),
                                         ({"carried": True}, "carried"), ({"unused_records": "yes"}, "unused_records"),
                                         ({"unused_records": 1}, "unused_records")])
def test_a_manifest_with_a_malformed_carried_or_unused_records_is_refused(entry, word):
    """The new file-record fields are checked like the others: a clear CorruptCheckpointError
    naming the file and the field, never a value a reader cannot use."""
    from async_ckpt.errors import CorruptCheckpointError
    from async_ckpt.format.manifest import Manifest

    good = {"step": 1, "commit_time": 1.0, "files": {"__0_ref0.distcp": {"size": 4, "crc32c": 0, "ref": "0/__0_0.distcp",
                                                                         "carried": 2, "unused_records": True}}}
    rec = Manifest.from_json(json.dumps(good).encode()).files["__0_ref0.distcp"]
    assert (rec.carried, rec.unused_records, rec.may_hold_unused) == (2, True, True)
    assert Manifest.from_json(Manifest.from_json(json.dumps(good).encode()).to_json()).files == {"__0_ref0.distcp": rec}
    bad = {"step": 1, "commit_time": 1.0, "files": {"__0_1.distcp": {"size": 4, "crc32c": 0, **entry}}}
    with pytest.raises(CorruptCheckpointError, match=rf"__0_1\.distcp: {word}"):
        Manifest.from_json(json.dumps(bad).encode())
