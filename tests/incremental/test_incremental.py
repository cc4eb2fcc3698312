"""Incremental saves (``CheckpointManager(..., incremental=True)``, issue 27).

A save hashes every tensor of at least 64 KiB and takes, from the last step the manager
committed to the root, the data files whose unchanged records fill at least half of them: a hard
link on POSIX paths (``__<rank>_ref<k>.distcp``), a server-side copy on other fsspec
filesystems. Every step stays a complete DCP checkpoint of plain files.

The tests check what a user can see: every retained step restores bit for bit (through the
manager, a fresh manager, and plain ``torch.distributed.checkpoint.load``), the files on disk
(hard links: ``st_nlink`` and ``st_ino``; unique-inode storage totals), the manifests'
``written_bytes`` / ``referred_bytes`` / ``FileRecord.ref``, the CLI's ``verify`` and
``export``, and what damage, re-saves, deletions, restarts, promote, two ranks, the local tier,
object stores, declared-frozen tensors (``frozen=``) and SIGKILLs do to that. Slow ones (the
SIGKILL trials, the torchrun job) are marked ``slow``; their states and workers are in
tests/workers/incremental_worker.py.

States use ``mgr.storage.max_file_bytes`` (docs/storage.md) of 64 KiB so that each large
tensor gets a data file of its own: sharing is decided per file, and a 1 MiB state would
otherwise be one file.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from async_ckpt import CheckpointError, CheckpointManager
from async_ckpt.errors import CorruptCheckpointError

from ..conftest import assert_bitwise_equal, clone_tree, flip_byte, target_like
from ..support.fork_trials import fork_server
from ..support.launch import torchrun
from ..workers.incremental_worker import (
    BIG,
    FILE_BYTES,
    WORLD,
    big_tensor,
    crash_manager,
    crash_state,
    dist_state,
    empty_like,
    make_state,
    nbytes,
    states_equal,
)

KiB = 2**10

# ---- the state (tests/workers/incremental_worker.py) --------------------------------------------------

#: which large tensors change at each step (step 0 writes all); emb changes at 3 and changes back
#: (to version 0) at 4
CHANGES = {
    0: {},
    1: {("optim", "m"): 1, ("optim", "v"): 1},
    2: {("model", "layers", 0, "w"): 2, ("optim", "m"): 2},
    3: {("model", "emb"): 3, ("extra", "ids"): 3},
    4: {("model", "emb"): 0, ("optim", "v"): 4},
    5: {("extra", "mask"): 5, ("optim", "m"): 5, ("model", "layers", 1, "w"): 5},
    6: {("extra", "ids"): 6},
}


def versions_at(step: int) -> Dict[tuple, int]:
    v = {k: 0 for k in BIG}
    for s in range(step + 1):
        v.update(CHANGES.get(s, {}))
    return v


def changed_bytes(step: int) -> int:
    """Bytes of the large tensors whose content differs from the step before."""
    if step == 0:
        return sum(nbytes(big_tensor(k, 0)) for k in BIG)
    before, now = versions_at(step - 1), versions_at(step)
    return sum(nbytes(big_tensor(k, 0)) for k in BIG if before[k] != now[k])


def state_at(step: int) -> Dict[str, Any]:
    return make_state(step, versions_at(step))


FULL_BYTES = sum(nbytes(big_tensor(k, 0)) for k in BIG)


# ---- disk helpers ----------------------------------------------------------------------------

def step_files(root: str, step: int) -> Dict[str, os.stat_result]:
    d = os.path.join(root, str(step))
    return {n: os.stat(os.path.join(d, n)) for n in os.listdir(d)}


def ref_files(root: str, step: int) -> List[str]:
    return sorted(n for n in os.listdir(os.path.join(root, str(step))) if "_ref" in n)


def unique_storage(root: str, steps: Optional[List[int]] = None) -> tuple:
    """(unique inodes, their total size) of the regular files under ``root`` (or under its
    ``steps`` only): what ``du`` counts."""
    seen: Dict[tuple, int] = {}
    tops = [root] if steps is None else [os.path.join(root, str(s)) for s in steps]
    for top in tops:
        for dirpath, _, names in os.walk(top):
            for n in names:
                st = os.lstat(os.path.join(dirpath, n))
                seen[(st.st_dev, st.st_ino)] = st.st_size
    return len(seen), sum(seen.values())


def inodes(root: str) -> set:
    out = set()
    for dirpath, _, names in os.walk(root):
        for n in names:
            if n.endswith(".distcp"):
                out.add(os.lstat(os.path.join(dirpath, n)).st_ino)
    return out


def manager(root: str, **kw: Any) -> CheckpointManager:
    mgr = CheckpointManager(root, incremental=True, **kw)
    mgr.storage.max_file_bytes = FILE_BYTES
    return mgr


def restore_bitwise(mgr: CheckpointManager, step: Optional[int], expected: Dict[str, Any]) -> int:
    out = target_like(expected)
    got = mgr.restore(step, out)
    assert_bitwise_equal(out, expected, f"step {got}")
    return got


def dcp_load_bitwise(step_dir: str, expected: Dict[str, Any]) -> None:
    out = target_like(expected)
    dcp.load(out, checkpoint_id=step_dir, no_dist=True)
    assert_bitwise_equal(out, expected, f"dcp.load({step_dir})")


# ---- 1. a sequence of incremental saves with retention ---------------------------------------

@pytest.mark.parametrize("async_save", [False, True])
def test_incremental_sequence_with_retention_restores_bitwise_and_stores_bytes_once(tmp_path, async_save):
    root = str(tmp_path / "ckpt")
    stat_log = {}
    with manager(root, max_to_keep=3) as mgr:
        for step in range(6):
            if async_save:
                mgr.save_async(step, state_at(step))
                mgr.join()
            else:
                mgr.save(step, state_at(step))
            stats = mgr.stats[-1]
            assert stats.step == step
            stat_log[step] = (stats.written_bytes, stats.referred_bytes)
            man = mgr.layout.read_manifest(step)
            assert (man.written_bytes, man.referred_bytes) == stat_log[step]
            assert man.written_bytes + man.referred_bytes == sum(
                os.stat(os.path.join(root, str(step), n)).st_size for n in man.files)
            if step == 0:
                assert man.referred_bytes == 0 and ref_files(root, 0) == []
                assert all(r.ref is None for r in man.files.values())
                continue
            # only what changed (and the small things) was written; the rest was linked
            assert man.written_bytes <= changed_bytes(step) + 64 * KiB, (step, man.written_bytes)
            assert man.written_bytes >= changed_bytes(step)
            assert man.referred_bytes >= FULL_BYTES - changed_bytes(step)
            assert man.referred_bytes > 0
            files = step_files(root, step)
            refs = ref_files(root, step)
            assert refs and all(n.startswith("__0_ref") and n.endswith(".distcp") for n in refs), refs
            for name, rec in man.files.items():
                if name in refs:
                    # the file that first held the bytes: same inode as its first name, if still there
                    assert rec.ref is not None, name
                    src_step, src_name = rec.ref.split("/")
                    assert int(src_step) < step and "_ref" not in src_name
                    assert files[name].st_nlink > 1, name
                    try:  # retention may be deleting that step in the background
                        first = os.stat(os.path.join(root, src_step, src_name))
                    except FileNotFoundError:
                        pass
                    else:
                        assert first.st_ino == files[name].st_ino
                    # and the same inode as one file of the step before
                    assert files[name].st_ino in {st.st_ino for st in step_files(root, step - 1).values()}
                else:
                    assert rec.ref is None, name
                    assert files[name].st_nlink == 1, name
            # storage of the retained steps: one full copy, plus what changed since, plus
            # metadata and small tensors
            retained = mgr.all_steps()
            _, total = unique_storage(root, retained)
            changed_since = sum(changed_bytes(s) for s in retained[1:])
            assert total <= FULL_BYTES + changed_since * 1.1 + len(retained) * 64 * KiB, (total, FULL_BYTES)
        assert mgr.all_steps() == [3, 4, 5]
        # step 4's emb went back to step 0's value, but step 3 (its last step) had another one:
        # written again, not taken from step 0 (gone, and not the last step anyway)
        emb = nbytes(big_tensor(("model", "emb"), 0))
        assert stat_log[4][0] >= emb
        for step in (3, 4, 5):
            restore_bitwise(mgr, step, state_at(step))
            dcp_load_bitwise(os.path.join(root, str(step)), state_at(step))
    # the steps that first wrote the shared bytes are gone: their names only
    assert sorted(n for n in os.listdir(root) if n.isdigit()) == ["3", "4", "5"]
    _, total = unique_storage(root)
    assert total <= FULL_BYTES + (changed_bytes(4) + changed_bytes(5)) * 1.1 + 3 * 64 * KiB
    refs_5 = {r.ref for r in CheckpointManager(root).layout.read_manifest(5).files.values() if r.ref}
    assert any(r.split("/")[0] in ("0", "1", "2") for r in refs_5), refs_5
    with CheckpointManager(root) as fresh:
        assert fresh.all_steps() == [3, 4, 5]
        assert restore_bitwise(fresh, None, state_at(5)) == 5
        for step in (3, 4):
            restore_bitwise(fresh, step, state_at(step))
    # the CLI reads incremental steps as any other: verify, and export of a step whose files were
    # mostly taken from steps that are gone
    from safetensors.torch import load_file

    from async_ckpt.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["verify", root, "--all", "--no-progress"]) == 0, buf.getvalue()
        out = str(tmp_path / "model.safetensors")
        assert main(["export", root, "5", out, "--key", "model", "--no-progress"]) == 0, buf.getvalue()
    assert buf.getvalue().count(": ok") == 3, buf.getvalue()
    model = state_at(5)["model"]
    flat = {"emb": model["emb"], "layers.0.w": model["layers"][0]["w"], "layers.0.b": model["layers"][0]["b"],
            "layers.1.w": model["layers"][1]["w"], "layers.1.b": model["layers"][1]["b"]}
    assert_bitwise_equal(load_file(out), flat)


# ---- 2. full_every ---------------------------------------------------------------------------

def test_full_every_writes_everything_every_nth_save_and_retention_frees_the_oldest_bytes(tmp_path):
    root = str(tmp_path / "ckpt")
    witness = tmp_path / "witness"  # hard links to step 0's files, outside the root
    witness.mkdir()
    with manager(root, full_every=3, max_to_keep=2) as mgr:
        for step in range(7):
            mgr.save(step, state_at(step))
            man = mgr.layout.read_manifest(step)
            if step % 3 == 0:  # saves 1, 4, 7 (steps 0, 3, 6): everything written
                assert ref_files(root, step) == [] and man.referred_bytes == 0, step
                assert all(r.ref is None for r in man.files.values())
                assert man.written_bytes >= FULL_BYTES
                assert all(st.st_nlink == 1 for st in step_files(root, step).values()), step
            else:
                assert ref_files(root, step) and man.referred_bytes > 0, step
                assert man.written_bytes <= changed_bytes(step) + 64 * KiB, (step, man.written_bytes)
                assert all(r.ref.split("/")[0] in {str(s) for s in range(step - step % 3, step)}
                           for r in man.files.values() if r.ref), (step, man.files)
            if step == 0:
                for n in os.listdir(os.path.join(root, "0")):
                    if n.endswith(".distcp"):
                        os.link(os.path.join(root, "0", n), witness / n)
            if step == 2:  # steps 1 and 2 (both kept) still name some of step 0's bytes (and
                # step 0 itself, until retention's background deletion of it has run)
                assert max(os.stat(witness / n).st_nlink for n in os.listdir(witness)) in (3, 4)
        assert mgr.all_steps() == [5, 6]
        for step in (5, 6):
            restore_bitwise(mgr, step, state_at(step))
    # step 0's bytes are freed (only the witness names them), and the root holds one full copy
    # (step 3's, shared by 4 and 5, less what 4 and 5 replaced) and step 6's
    assert {os.stat(witness / n).st_nlink for n in os.listdir(witness)} == {1}
    n, total = unique_storage(root)
    assert total <= 2 * FULL_BYTES + (changed_bytes(4) + changed_bytes(5)) * 1.1 + 2 * 64 * KiB, total
    assert total >= 2 * FULL_BYTES
    for name in os.listdir(witness):
        os.unlink(witness / name)


# ---- 4. damage -------------------------------------------------------------------------------

def file_of(step_dir: str, key: str) -> str:
    """The data file of a step directory that holds ``key`` (from the DCP metadata)."""
    md = dcp.FileSystemReader(step_dir).read_metadata()
    names = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn == key}
    assert len(names) == 1, names
    return os.path.join(step_dir, names.pop())


def test_damage_to_a_shared_file_damages_every_step_that_holds_it(tmp_path):
    """emb changes at step 1 (a new file), steps 2 and 3 share that file: a flipped byte in it,
    through any name, damages steps 1-3; step 0 never held it and is intact."""
    root = str(tmp_path / "ckpt")
    states = {s: make_state(s, {**{k: 0 for k in BIG}, ("model", "emb"): min(s, 1), ("optim", "m"): s})
              for s in range(4)}
    with manager(root) as mgr:
        for s in range(4):
            mgr.save(s, states[s])
    emb = {s: file_of(os.path.join(root, str(s)), "model.emb") for s in range(4)}
    assert "_ref" not in os.path.basename(emb[1]) and "_ref" in os.path.basename(emb[3])
    assert len({os.stat(emb[s]).st_ino for s in (1, 2, 3)}) == 1
    assert os.stat(emb[0]).st_ino != os.stat(emb[1]).st_ino
    flip_byte(emb[3])  # through the newest name: the bytes all three steps hold
    with CheckpointManager(root) as mgr:
        for s in (1, 2, 3):
            with pytest.raises(CorruptCheckpointError):
                mgr.restore(s, target_like(states[s]))
        with pytest.warns(RuntimeWarning, match="skipping damaged"):
            assert restore_bitwise(mgr, None, states[0]) == 0
    from async_ckpt.cli import main

    assert main(["verify", root, "0", "--no-progress"]) == 0
    for s in (1, 2, 3):
        assert main(["verify", root, str(s), "--no-progress"]) == 1


def test_damage_to_a_shared_file_stops_at_a_full_every_save(tmp_path):
    """full_every=2: steps 2 and 3 share step 2's files; steps 0 and 1 other ones. Damage to a
    file of step 3 shared from step 2 leaves step 1 the newest intact step."""
    root = str(tmp_path / "ckpt")
    with manager(root, full_every=2) as mgr:
        for s in range(4):
            mgr.save(s, state_at(s))
        assert ref_files(root, 2) == [] and ref_files(root, 1) and ref_files(root, 3)
    shared = os.path.join(root, "3", ref_files(root, 3)[0])
    assert os.stat(shared).st_ino in inodes(os.path.join(root, "2"))
    assert os.stat(shared).st_ino not in inodes(os.path.join(root, "1")) | inodes(os.path.join(root, "0"))
    flip_byte(shared)
    with CheckpointManager(root) as mgr:
        for s in (2, 3):
            with pytest.raises(CorruptCheckpointError):
                mgr.restore(s, target_like(state_at(s)))
        with pytest.warns(RuntimeWarning, match="skipping damaged"):
            assert restore_bitwise(mgr, None, state_at(1)) == 1
        restore_bitwise(mgr, 0, state_at(0))


def test_damage_to_a_shared_local_copy_falls_back_to_the_persistent_copy(tmp_path):
    path, local = str(tmp_path / "bucket"), str(tmp_path / "local")
    with manager(path, local_dir=local, local_policy=1, local_retention=3) as mgr:
        for s in range(3):
            mgr.save(s, state_at(s))
        assert set(mgr.step_tiers()[2]) == {"local", "persistent"}
    local_refs = ref_files(local, 2)
    assert local_refs, os.listdir(os.path.join(local, "2"))
    flip_byte(os.path.join(local, "2", local_refs[0]))
    with manager(path, local_dir=local) as mgr:
        with pytest.warns(RuntimeWarning, match=r"skipping the local copy of step 2"):
            assert restore_bitwise(mgr, 2, state_at(2)) == 2


# ---- 5. re-save and delete of the last step --------------------------------------------------

def test_resave_and_delete_of_the_last_step_then_incremental_saves_restore_bitwise(tmp_path):
    root = str(tmp_path / "ckpt")
    other = make_state(1, {k: 50 + i for i, k in enumerate(BIG)})  # step 1 again, other values
    with manager(root) as mgr:
        mgr.save(0, state_at(0))
        mgr.save(1, state_at(1))
        assert ref_files(root, 1)
        old_inodes_1 = inodes(os.path.join(root, "1"))
        # re-save of the last step: written whole (nothing taken from the step it replaces)
        mgr.save(1, other)
        assert ref_files(root, 1) == [] and mgr.layout.read_manifest(1).referred_bytes == 0
        assert not old_inodes_1 & inodes(os.path.join(root, "1"))
        restore_bitwise(mgr, 1, other)
        # the next save takes the re-saved step's files (the values of ``other``)
        two = make_state(2, {**{k: 50 + i for i, k in enumerate(BIG)}, ("optim", "m"): 99})
        mgr.save(2, two)
        man = mgr.layout.read_manifest(2)
        assert man.referred_bytes > 0 and all(r.ref.startswith("1/") for r in man.files.values() if r.ref)
        for name in ref_files(root, 2):
            assert os.stat(os.path.join(root, "2", name)).st_ino in inodes(os.path.join(root, "1"))
        restore_bitwise(mgr, 2, two)
        # delete the last step: the next save is whole (takes nothing from the deleted step)
        mgr.delete(2)
        three = make_state(3, {**{k: 50 + i for i, k in enumerate(BIG)}, ("optim", "m"): 99})
        mgr.save(3, three)
        assert ref_files(root, 3) == [] and mgr.layout.read_manifest(3).referred_bytes == 0
        four = make_state(4, {**{k: 50 + i for i, k in enumerate(BIG)}, ("optim", "v"): 98})
        mgr.save_async(4, four)
        mgr.join()
        assert ref_files(root, 4)
        assert mgr.all_steps() == [0, 1, 3, 4]
        expected = {0: state_at(0), 1: other, 3: three, 4: four}
        for s, st in expected.items():
            restore_bitwise(mgr, s, st)
            dcp_load_bitwise(os.path.join(root, str(s)), st)
    with CheckpointManager(root) as fresh:
        assert restore_bitwise(fresh, None, four) == 4


def test_resave_of_the_last_step_async_while_the_next_save_is_queued(tmp_path):
    """Saves queued back to back: step 1, step 1 again (other values), step 2; each save shares
    only from what committed before it."""
    root = str(tmp_path / "ckpt")
    other = make_state(1, {**{k: 0 for k in BIG}, ("model", "emb"): 70, ("extra", "mask"): 71})
    two = make_state(2, {**{k: 0 for k in BIG}, ("model", "emb"): 70, ("extra", "mask"): 71, ("optim", "v"): 72})
    with manager(root, max_pending_async=4) as mgr:
        mgr.save(0, state_at(0))
        mgr.save_async(1, state_at(1))
        mgr.save_async(1, other)
        mgr.save_async(2, two)
        mgr.join()
        for s, st in ((0, state_at(0)), (1, other), (2, two)):
            restore_bitwise(mgr, s, st)
            dcp_load_bitwise(os.path.join(root, str(s)), st)


def test_a_new_manager_that_did_not_restore_writes_its_first_save_whole(tmp_path):
    root = str(tmp_path / "ckpt")
    with manager(root) as mgr:
        mgr.save(0, state_at(0))
        mgr.save(1, state_at(1))
        assert ref_files(root, 1)
    with manager(root) as mgr:
        mgr.save(2, state_at(2))
        assert ref_files(root, 2) == [] and mgr.stats[-1].referred_bytes == 0
        assert mgr.layout.read_manifest(2).referred_bytes == 0
        mgr.save(3, state_at(3))
        assert ref_files(root, 3) and mgr.stats[-1].referred_bytes > 0
        for s in range(4):
            restore_bitwise(mgr, s, state_at(s))


@pytest.mark.parametrize("restored", [None, 0])
def test_after_a_restart_the_first_save_takes_from_the_step_the_restore_read(tmp_path, restored):
    """A resumed run (a new manager that restores, then saves) compares with the step it read:
    the newest (restore(None)) or an older one it rolled back to."""
    root = str(tmp_path / "ckpt")
    with manager(root) as mgr:
        for s in range(3):
            mgr.save(s, state_at(s))
    read = 2 if restored is None else restored
    with manager(root) as mgr:
        assert restore_bitwise(mgr, restored, state_at(read)) == read
        nxt = make_state(3, {**versions_at(read), ("optim", "m"): 33})  # trained on from ``read``
        mgr.save(3, nxt)
        man = mgr.layout.read_manifest(3)
        assert ref_files(root, 3) and mgr.stats[-1].referred_bytes == man.referred_bytes > 0
        assert man.written_bytes <= nbytes(big_tensor(("optim", "m"), 0)) + 64 * KiB
        held = inodes(os.path.join(root, str(read)))
        for name in ref_files(root, 3):
            assert os.stat(os.path.join(root, "3", name)).st_ino in held
        for s in range(3):
            restore_bitwise(mgr, s, state_at(s))
            dcp_load_bitwise(os.path.join(root, str(s)), state_at(s))
        restore_bitwise(mgr, 3, nxt)
        dcp_load_bitwise(os.path.join(root, "3"), nxt)


def test_after_falling_back_past_a_damaged_step_the_next_save_is_intact(tmp_path):
    """full_every=2: step 3 shares step 2's files. A byte of a file of step 2 that step 3 holds
    too is flipped: a new manager's restore(None) falls back to step 1. Training goes on from
    step 1's state (the damaged tensor's value did not change since step 0), and step 4 is saved
    incrementally: it must restore, i.e. not take the damaged file from step 3 (it did before
    main b1c3abb: the first save after a restart compared with the newest committed step)."""
    root = str(tmp_path / "ckpt")
    with manager(root, full_every=2) as mgr:
        for s in range(4):
            mgr.save(s, state_at(s))
    # extra.mask is version 0 in steps 0-3: step 3 holds it in a file shared from step 2
    mask_file = file_of(os.path.join(root, "3"), "extra.mask")
    assert "_ref" in os.path.basename(mask_file)
    flip_byte(mask_file)
    with manager(root, full_every=2) as mgr:
        with pytest.warns(RuntimeWarning, match="skipping damaged"):
            assert restore_bitwise(mgr, None, state_at(1)) == 1
        four = make_state(4, versions_at(1))  # trained on from step 1
        mgr.save(4, four)
        restore_bitwise(mgr, 4, four)
    from async_ckpt.cli import main

    assert main(["verify", root, "4", "--no-progress"]) == 0


# ---- 6. object stores / fsspec ---------------------------------------------------------------

def run_sequence_fsspec(mgr: CheckpointManager, steps: int = 5, storage_options: Optional[dict] = None) -> None:
    for step in range(steps):
        if step % 2:
            mgr.save_async(step, state_at(step))
            mgr.join()
        else:
            mgr.save(step, state_at(step))
        man = mgr.layout.read_manifest(step)
        st = mgr.stats[-1]
        assert (st.written_bytes, st.referred_bytes) == (man.written_bytes, man.referred_bytes)
        if step:
            assert man.referred_bytes > 0 and man.written_bytes <= changed_bytes(step) + 64 * KiB, (step, man)
            names = {n for n, r in man.files.items() if r.ref}
            assert names and all(n.startswith("__0_ref") for n in names)
    for step in mgr.all_steps():
        restore_bitwise(mgr, step, state_at(step))
        # every step is a plain DCP checkpoint: torch's own fsspec reader loads it
        out = target_like(state_at(step))
        opts = storage_options or {}
        dcp.load(out, storage_reader=FsspecReader(f"{mgr.storage.url.rstrip('/')}/{step}", **opts), no_dist=True)
        assert_bitwise_equal(out, state_at(step))


def test_memory_root_incremental_sequence_server_side_copies(memory_root):
    from async_ckpt.cli import main

    with manager(memory_root, max_to_keep=3) as mgr:
        run_sequence_fsspec(mgr)
        assert mgr.all_steps() == [2, 3, 4]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["verify", memory_root, "--all", "--no-progress"]) == 0, buf.getvalue()
    assert buf.getvalue().count(": ok") == 3, buf.getvalue()
    with CheckpointManager(memory_root) as fresh:
        assert restore_bitwise(fresh, None, state_at(4)) == 4


@pytest.fixture(params=["gcs", "s3"])
def object_bucket(request, tmp_path, monkeypatch):
    """A fresh bucket on a loopback fake-gcs-server (this test's own, whose bucket metadata files
    go to tmp_path, not /tmp) or moto S3 server (tests/support/storage_servers.py); the test is skipped
    where the server cannot be started here."""
    if request.param == "s3":
        try:
            yield request.getfixturevalue("s3_bucket")
        except Exception as exc:  # noqa: BLE001 - moto is missing
            pytest.skip(f"s3 server unavailable: {exc}")
        return
    from ..support.storage_servers import FakeGCSServer

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # fake-gcs-server writes bucket metadata there
    try:
        server = FakeGCSServer().start()
    except Exception as exc:  # noqa: BLE001 - the fake-gcs-server binary is missing
        pytest.skip(f"gcs server unavailable: {exc}")
    try:
        yield server.new_bucket()
    finally:
        server.stop()


def test_object_store_incremental_sequence_server_side_copies(object_bucket):
    bucket = object_bucket
    mgr = CheckpointManager(bucket.url, storage_options=bucket.storage_options, incremental=True, max_to_keep=3)
    mgr.storage.max_file_bytes = FILE_BYTES
    with mgr:
        run_sequence_fsspec(mgr, 4, bucket.storage_options)
        assert mgr.all_steps() == [1, 2, 3]
    with CheckpointManager(bucket.url, storage_options=bucket.storage_options) as fresh:
        assert restore_bitwise(fresh, None, state_at(3)) == 3


# ---- 8. the local tier -----------------------------------------------------------------------

def test_local_tier_incremental_each_root_shares_its_own_files(tmp_path):
    path, local = str(tmp_path / "bucket"), str(tmp_path / "local")
    with manager(path, local_dir=local, local_policy=1, local_retention=3, save_interval=2, max_to_keep=2) as mgr:
        for s in range(6):
            mgr.save_async(s, state_at(s))
            mgr.join()  # an upload still running when the next is due would be skipped
        tiers = mgr.step_tiers()
        assert mgr.skipped_uploads == []
    local_steps = sorted(int(n) for n in os.listdir(local) if n.isdigit())
    persistent_steps = sorted(int(n) for n in os.listdir(path) if n.isdigit())
    assert local_steps == [3, 4, 5] and persistent_steps == [2, 4], (local_steps, persistent_steps, tiers)
    local_inodes, persistent_inodes = inodes(local), inodes(path)
    assert not local_inodes & persistent_inodes  # no file is shared across the roots
    for s in local_steps[1:]:
        refs = ref_files(local, s)
        assert refs, s
        earlier = inodes(os.path.join(local, str(s - 1)))
        for n in refs:
            assert os.stat(os.path.join(local, str(s), n)).st_ino in earlier
        dcp_load_bitwise(os.path.join(local, str(s)), state_at(s))
    # the persistent root's saves (every 2nd step) share with its own last step (4 from 2)
    assert ref_files(path, 4)
    for n in ref_files(path, 4):
        assert os.stat(os.path.join(path, "4", n)).st_ino in inodes(os.path.join(path, "2"))
    for s in persistent_steps:
        dcp_load_bitwise(os.path.join(path, str(s)), state_at(s))
    with CheckpointManager(path) as only_persistent:
        for s in persistent_steps:
            restore_bitwise(only_persistent, s, state_at(s))
    with CheckpointManager(path, local_dir=local) as both:
        for s in sorted(set(local_steps) | set(persistent_steps)):
            restore_bitwise(both, s, state_at(s))
        assert restore_bitwise(both, None, state_at(5)) == 5


# ---- 3. SIGKILL trials -----------------------------------------------------------------------



@pytest.fixture
def crash_server(tmp_path):
    with fork_server(tmp_path, "incremental_worker.py", "crash", TMPDIR=str(tmp_path)) as ask:
        yield ask


def check_after_kill(root: str, what: str) -> List[int]:
    """Every committed step names only files that exist, verifies (CLI) and restores bitwise."""
    from async_ckpt.cli import main

    with crash_manager(root) as mgr:
        steps = mgr.all_steps()
        for s in steps:
            # a kill between the commit marker and the rename leaves the committed copy in its
            # .tmp-<step>-<token> directory (the next writer's startup recovery renames it)
            step_dir = mgr.layout.locate(s)
            man = mgr.layout.read_manifest(s)
            for name in man.files:
                assert os.path.isfile(os.path.join(step_dir, name)), (
                    f"{what}: step {s} names missing {name}; {sorted(os.listdir(root))}")
            md = dcp.FileSystemReader(step_dir).read_metadata()
            for info in md.storage_data.values():
                assert info.relative_path in man.files, f"{what}: step {s}: {info.relative_path} not in manifest"
            out = empty_like(crash_state(s))
            assert mgr.restore(s, out) == s
            assert states_equal(out, crash_state(s)), f"{what}: step {s} restored with wrong contents"
    if steps:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["verify", root, "--all", "--no-progress"])
        assert rc == 0, f"{what}: verify --all:\n{buf.getvalue()}"
        assert buf.getvalue().count(": ok") == len(steps), buf.getvalue()
    return steps


@pytest.mark.slow
def test_sigkill_during_incremental_saves_and_retention_loses_nothing(crash_server, tmp_path):
    master = int(os.environ.get("ASYNC_CKPT_CRASH_SEED", random.SystemRandom().randrange(2**31)))
    print(f"incremental crash trials: ASYNC_CKPT_CRASH_SEED={master}")
    root = str(tmp_path / "ckpt")
    newest = None
    commits = 0
    for i in range(8):
        rng = random.Random(master * 1000 + i)
        delay = round(rng.uniform(0.02, 0.15) if i % 4 == 0 else rng.uniform(0.15, 1.2), 4)
        spec = {"dir": root, "delay": delay, "full_every": (None, 3)[i % 2], "sync": i % 3 == 2}
        out = crash_server(spec)
        what = f"trial {i} (seed {master * 1000 + i}, {spec})"
        print(f"{what}: committed {out['committed'][:1]}..{out['committed'][-1:]} resumed {out['resumed']}")
        assert out["status"] == "killed", f"{what}: {out['error']}"
        assert out["resume_ok"] in (None, True), f"{what}: resumed step {out['resumed']} with wrong contents"
        commits += len(out["committed"])
        steps = check_after_kill(root, what)
        if out["committed"]:
            assert steps and steps[-1] >= out["committed"][-1], f"{what}: committed steps lost: {steps}"
        if newest is not None:
            assert steps and steps[-1] >= newest, f"{what}: {steps} lost step {newest}"
        newest = steps[-1] if steps else newest
    assert commits > 0, "no trial committed a step"
    # the root takes further incremental saves (after a restore, as a resumed run), which
    # restore bitwise
    with crash_manager(root) as mgr:
        got = mgr.restore(None, empty_like(crash_state(0)))
        nxt = got + 1
        mgr.save(nxt, crash_state(nxt))
        assert mgr.stats[-1].referred_bytes > 0
        mgr.save_async(nxt + 1, crash_state(nxt + 1))
        mgr.join()
        for s in (nxt, nxt + 1):
            out = empty_like(crash_state(s))
            assert mgr.restore(s, out) == s and states_equal(out, crash_state(s))
    assert check_after_kill(root, "after the last saves")[-1] == nxt + 1
    # the local files of the root are the steps' (no debris left for long: startup cleans)


# ---- 7. two ranks ----------------------------------------------------------------------------

@pytest.mark.slow
def test_two_ranks_incremental_saves_restore_at_two_ranks_and_in_one_process(tmp_path):
    root = str(tmp_path / "ckpt")
    proc = torchrun(WORLD, "incremental_worker.py", "dist", root, env={"TMPDIR": str(tmp_path)},  # torchelastic_*
                    timeout=240)
    assert proc.returncode == 0, proc.stdout[-5000:]
    for r in range(WORLD):
        assert f"RANK {r} OK" in proc.stdout, proc.stdout[-5000:]
    # on disk: each rank's shared files are hard links of its own earlier files
    for s in (4, 5):
        refs = ref_files(root, s)
        assert {n[:4] for n in refs} == {"__0_", "__1_"}, refs
        earlier = {}
        for n in os.listdir(os.path.join(root, str(s - 1))):
            earlier[os.stat(os.path.join(root, str(s - 1), n)).st_ino] = n
        for n in refs:
            st = os.stat(os.path.join(root, str(s), n))
            assert st.st_nlink > 1 and st.st_ino in earlier, (s, n)
            assert earlier[st.st_ino].startswith(n[:4]), (s, n, earlier[st.st_ino])
    # one process, no process group: plain dcp.load and a manager
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [3, 4, 5]
        for s in (3, 4, 5):
            dcp_load_bitwise(os.path.join(root, str(s)), dist_state(s, None))
            restore_bitwise(mgr, s, dist_state(s, None))
        assert restore_bitwise(mgr, None, dist_state(5, None)) == 5
    # the damaged root (incremental_worker.dist_damage): step 2 restores whole in one process
    with CheckpointManager(root + "-damage") as mgr:
        assert restore_bitwise(mgr, None, dist_state(2, None)) == 2


# ---- 9. declared-frozen tensors --------------------------------------------------------------

class Adapted(torch.nn.Module):
    """A LoRA-like model: a frozen base (large) and trainable parts (one large, two tiny)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.base = torch.nn.Linear(256, 256)  # weight 256 KiB, frozen
        self.emb = torch.nn.Embedding(512, 64)  # 128 KiB, frozen
        self.head = torch.nn.Linear(128, 128)  # 64 KiB, trained
        self.lora_a = torch.nn.Parameter(torch.randn(256, 4) * 0.01)
        self.lora_b = torch.nn.Parameter(torch.zeros(4, 256))
        for p in (*self.base.parameters(), *self.emb.parameters()):
            p.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).repeat(1, 1, 4)  # (b, n, 256)
        y = self.base(x) + x @ self.lora_a @ self.lora_b
        return self.head(y[..., :128])


def train_step(model: Adapted, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randint(0, 512, (2, 8), generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def adapted_state(model: Adapted, opt: torch.optim.Optimizer, step: int) -> Dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


FROZEN = ["model.base.weight", "model.base.bias", "model.emb.weight"]


def test_frozen_keys_lists_the_requires_grad_false_parameters():
    from async_ckpt import frozen_keys

    assert sorted(frozen_keys(Adapted(), prefix="model.")) == sorted(FROZEN)
    assert sorted(frozen_keys(Adapted())) == sorted(k[len("model."):] for k in FROZEN)


def test_frozen_requires_incremental(tmp_path):
    from async_ckpt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        CheckpointManager(str(tmp_path / "ckpt"), frozen=FROZEN)


@pytest.mark.parametrize("declared", ["keys", "callable"])
def test_frozen_base_is_taken_from_the_last_step_and_every_step_restores_bitwise(tmp_path, declared):
    from async_ckpt import frozen_keys

    root = str(tmp_path / "ckpt")
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    frozen = (lambda k: k in FROZEN) if declared == "callable" else frozen_keys(model, prefix="model.")
    expected = {}
    with manager(root, frozen=frozen, frozen_check_every=3, max_to_keep=4) as mgr:
        for step in range(7):
            train_step(model, opt, step)
            state = adapted_state(model, opt, step)
            expected[step] = clone_tree(state)
            if step % 2:
                mgr.save_async(step, state)
                mgr.join()
            else:
                mgr.save(step, state)
            base_bytes = model.base.weight.nbytes
            # not even copied to host memory, except at the first save and every 3rd (the check)
            copied = mgr.stats[-1].nbytes
            if step and (step + 1) % 3:
                assert copied <= sum(t.nbytes for t in _tensors(state)) - base_bytes, (step, copied)
            else:
                assert copied >= base_bytes, (step, copied)
            if step:
                # the frozen base: a hard link of the last step's file, not written again
                assert mgr.stats[-1].referred_bytes >= 256 * KiB, (step, mgr.stats[-1])
                base = file_of(os.path.join(root, str(step)), "model.base.weight")
                before = file_of(os.path.join(root, str(step - 1)), "model.base.weight")
                assert "_ref" in os.path.basename(base), (step, base)
                assert os.stat(base).st_ino == os.stat(before).st_ino
        mgr.join()
        assert mgr.all_steps() == [3, 4, 5, 6]
        for step in mgr.all_steps():
            restore_bitwise(mgr, step, expected[step])
            dcp_load_bitwise(os.path.join(root, str(step)), expected[step])
    # the frozen base's bytes are stored once for the retained steps
    ino = {os.stat(file_of(os.path.join(root, str(s)), "model.base.weight")).st_ino for s in (3, 4, 5, 6)}
    assert len(ino) == 1


def test_frozen_with_lazy_saves_while_training_goes_on(tmp_path):
    """lazy=True: save_async returns once the host copies are issued and training goes on at
    once (the guard waits for the copies before the optimizer changes the tensors); no join
    between saves. Every step restores bitwise; the frozen base is taken, not written."""
    root = str(tmp_path / "ckpt")
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    expected = {}
    with manager(root, frozen=FROZEN, frozen_check_every=3, lazy=True, max_pending_async=2) as mgr:
        for step in range(6):
            train_step(model, opt, step)
            expected[step] = clone_tree(adapted_state(model, opt, step))
            mgr.save_async(step, adapted_state(model, opt, step))
        mgr.join()
        assert mgr.all_steps() == list(range(6))
        for step in range(6):
            restore_bitwise(mgr, step, expected[step])
            if step:
                assert "_ref" in os.path.basename(file_of(os.path.join(root, str(step)), "model.base.weight"))


def test_frozen_base_with_a_local_tier_every_root_restores_bitwise(tmp_path):
    """Two roots on different schedules (local every step, persistent every 2nd): a frozen
    tensor is left uncopied only when every root due for the save holds it; both roots' steps
    restore bitwise, each sharing only its own files."""
    path, local = str(tmp_path / "bucket"), str(tmp_path / "local")
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    expected = {}
    with manager(path, frozen=FROZEN, frozen_check_every=4, local_dir=local, local_policy=1, local_retention=3,
                 save_interval=2, max_to_keep=3) as mgr:
        for step in range(7):
            train_step(model, opt, step)
            expected[step] = clone_tree(adapted_state(model, opt, step))
            mgr.save_async(step, adapted_state(model, opt, step))
            mgr.join()
        assert mgr.skipped_uploads == []
        tiers = mgr.step_tiers()
    local_steps = sorted(int(n) for n in os.listdir(local) if n.isdigit())
    persistent_steps = sorted(int(n) for n in os.listdir(path) if n.isdigit())
    assert local_steps == [4, 5, 6] and persistent_steps == [2, 4, 6], tiers
    assert not inodes(local) & inodes(path)
    for root, steps in ((local, local_steps), (path, persistent_steps)):
        base = {os.stat(file_of(os.path.join(root, str(s)), "model.base.weight")).st_ino for s in steps}
        assert len(base) == 1, (root, base)  # the frozen base: one file, named by every step there
        for s in steps:
            dcp_load_bitwise(os.path.join(root, str(s)), expected[s])
    with CheckpointManager(path) as only_persistent:
        for s in persistent_steps:
            restore_bitwise(only_persistent, s, expected[s])
    with CheckpointManager(path, local_dir=local) as both:
        for s in sorted(set(local_steps) | set(persistent_steps)):
            restore_bitwise(both, s, expected[s])


def test_a_frozen_tensor_changed_in_place_is_written_without_an_error(tmp_path):
    """An in-place change moves the version counter (as a restore or load_state_dict does): the
    next save copies and hashes the tensor and writes its new bytes; no error (only a change the
    counter did not show raises FrozenTensorChangedError, main 7b4b27f)."""
    root = str(tmp_path / "ckpt")
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    expected = {}
    with manager(root, frozen=FROZEN, frozen_check_every=100) as mgr:
        for step in range(2):
            train_step(model, opt, step)
            expected[step] = clone_tree(adapted_state(model, opt, step))
            mgr.save(step, adapted_state(model, opt, step))
        assert "_ref" in os.path.basename(file_of(os.path.join(root, "1"), "model.base.weight"))
        with torch.no_grad():
            model.base.weight.mul_(2)
        expected[2] = clone_tree(adapted_state(model, opt, 2))
        mgr.save_async(2, adapted_state(model, opt, 2))
        mgr.join()
        base = file_of(os.path.join(root, "2"), "model.base.weight")
        assert "_ref" not in os.path.basename(base)  # written, not taken
        # the next save takes the new bytes from step 2
        expected[3] = clone_tree(adapted_state(model, opt, 3))
        mgr.save(3, adapted_state(model, opt, 3))
        assert os.stat(file_of(os.path.join(root, "3"), "model.base.weight")).st_ino == os.stat(base).st_ino
        for step in range(4):
            restore_bitwise(mgr, step, expected[step])


def test_restoring_into_a_frozen_tensor_is_saved_without_an_error(tmp_path):
    """A restore writes into the target's tensors and moves their version counters: a later
    save of a declared-frozen tensor restored into copies and hashes it (it never takes stale
    bytes), and raises nothing."""
    root = str(tmp_path / "ckpt")
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with manager(root, frozen=FROZEN) as mgr:
        mgr.save(0, adapted_state(model, opt, 0))
        step0 = clone_tree(adapted_state(model, opt, 0))
        with torch.no_grad():
            model.emb.weight.add_(1.0)
        mgr.save(1, adapted_state(model, opt, 1))
        step1 = clone_tree(adapted_state(model, opt, 1))
        # roll back to step 0: emb goes back to its old values, through the restore
        state = adapted_state(model, opt, 0)
        assert mgr.restore(0, state) == 0
        assert torch.equal(model.emb.weight, step0["model"]["emb.weight"])
        mgr.save(2, adapted_state(model, opt, 2))
        step2 = clone_tree(adapted_state(model, opt, 2))
        assert torch.equal(step2["model"]["emb.weight"], step0["model"]["emb.weight"])
        for s, st in ((0, step0), (1, step1), (2, step2)):
            restore_bitwise(mgr, s, st)


def test_a_frozen_tensor_changed_behind_the_version_counter_is_found_by_the_check(tmp_path):
    """A change through ``.data`` does not move the version counter: the check every
    ``frozen_check_every`` saves finds it, writes the new bytes in full, and raises."""
    from async_ckpt import FrozenTensorChangedError

    root = str(tmp_path / "ckpt")
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    expected = {}
    old_base = model.emb.weight.detach().clone()
    with manager(root, frozen=FROZEN, frozen_check_every=3) as mgr:
        mgr.save(0, adapted_state(model, opt, 0))  # save 1
        expected[0] = clone_tree(adapted_state(model, opt, 0))
        model.emb.weight.data.add_(1.0)  # the version counter of model.emb.weight stays
        mgr.save(1, adapted_state(model, opt, 1))  # save 2: not copied (the counter stands)
        expected[1] = clone_tree(adapted_state(model, opt, 1))
        mgr.save_async(2, adapted_state(model, opt, 2))  # save 3: the check
        expected[2] = clone_tree(adapted_state(model, opt, 2))
        with pytest.raises(FrozenTensorChangedError) as info:
            mgr.join()
        assert list(info.value.keys) == ["model.emb.weight"]
        restore_bitwise(mgr, 0, expected[0])
        restore_bitwise(mgr, 2, expected[2])  # the check's save holds the new bytes
        # step 1 was saved between checks: the new bytes, or (documented) the last step's
        out = target_like(expected[1])
        mgr.restore(1, out)
        emb = out["model"]["emb.weight"]
        assert torch.equal(emb, expected[1]["model"]["emb.weight"]) or torch.equal(emb, old_base)
        out["model"]["emb.weight"] = expected[1]["model"]["emb.weight"]
        assert_bitwise_equal(out, expected[1])


def test_a_frozen_tensor_changed_after_the_last_save_raises_at_close(tmp_path):
    from async_ckpt import FrozenTensorChangedError

    root = str(tmp_path / "ckpt")
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mgr = manager(root, frozen=FROZEN)
    mgr.save(0, adapted_state(model, opt, 0))
    expected = clone_tree(adapted_state(model, opt, 0))
    model.base.weight.data.mul_(3)
    with pytest.raises(FrozenTensorChangedError) as info:
        mgr.close()
    assert list(info.value.keys) == ["model.base.weight"]
    with CheckpointManager(root) as fresh:
        restore_bitwise(fresh, 0, expected)  # the last step holds the bytes as they were


# ---- 10. promote -----------------------------------------------------------------------------

def test_promote_of_an_incremental_local_step_restores_from_the_persistent_root(tmp_path):
    """The local tier saves every step incrementally (one data file per save: a taken file
    carries the records of the tensors that changed since, unused); promote() copies step 3 to
    the persistent root, where it must verify and restore bitwise (it did not before main
    7b4b27f: promote dropped the taken files' ``ref``)."""
    from async_ckpt.cli import main

    path, local = str(tmp_path / "bucket"), str(tmp_path / "local")
    with CheckpointManager(path, incremental=True, local_dir=local, local_policy=1, local_retention=3,
                           save_interval=100) as mgr:
        for s in range(4):
            mgr.save(s, state_at(s))
        assert ref_files(local, 3), os.listdir(os.path.join(local, "3"))
        assert mgr.step_tiers()[3] == ("local",)
        mgr.promote(3)
        assert set(mgr.step_tiers()[3]) == {"local", "persistent"}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["verify", path, "3", "--no-progress"])
    assert rc == 0, buf.getvalue()
    with CheckpointManager(path) as persistent:
        restore_bitwise(persistent, 3, state_at(3))
    dcp_load_bitwise(os.path.join(path, "3"), state_at(3))


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


# ---- promoted steps, and declared-frozen tensors replaced under the manager -----------------------

N = 64 * 1024  # floats: 256 KiB, above the 64 KiB sharing threshold


def test_a_promoted_incremental_step_restores_from_the_persistent_root(tmp_path):
    # step 2 takes step 1's file whole (its first half, "a", is unchanged; "b" behind it is
    # stale); promote copies that file, so the persistent copy must still restore bitwise
    path, local = str(tmp_path / "p"), str(tmp_path / "l")
    sd = {"a": torch.arange(N, dtype=torch.float32), "b": torch.ones(N)}
    with CheckpointManager(path, save_interval=10, local_dir=local, local_policy=1, incremental=True) as mgr:
        mgr.save(1, sd)
        sd["b"] = sd["b"] + 1
        mgr.save(2, sd)
        mgr.promote(2)
    with CheckpointManager(path) as mgr:
        got = {"a": torch.zeros(N), "b": torch.zeros(N)}
        assert mgr.restore(2, got) == 2
    assert_bitwise_equal(got, clone_tree(sd))


def test_a_declared_frozen_tensor_restored_by_another_manager_is_saved_with_its_new_bytes(tmp_path):
    # restore() writes the file bytes into the target tensors without moving their version
    # counter, so a manager that declared the tensor frozen takes its old bytes from its last
    # step: the new step restores the bytes w had before the restore
    sd = {"w": torch.full((N,), 1.0), "x": torch.full((N,), 2.0)}
    with CheckpointManager(str(tmp_path / "other")) as other:
        other.save(0, {"w": torch.full((N,), 3.0), "x": torch.full((N,), 2.0)})
    with CheckpointManager(str(tmp_path / "run"), incremental=True, frozen=["w"]) as mgr:
        mgr.save(0, sd)
        mgr.save(1, sd)
        with CheckpointManager(str(tmp_path / "other")) as other:
            other.restore(0, sd)
        mgr.save(2, sd)
        got = {"w": torch.zeros(N), "x": torch.zeros(N)}
        mgr.restore(2, got)
    assert_bitwise_equal(got, clone_tree(sd))


def test_a_declared_frozen_xla_tensor_replaced_by_another_is_saved_with_the_new_bytes(tmp_path, xla_device):
    # an XLA tensor has no data pointer (version_of gives 0) and a new tensor's version counter
    # starts at 0 again, so the new tensor under the frozen key passes for the old one: the step
    # refers to the old tensor's bytes
    sd = {"w": torch.full((N,), 1.0, device=xla_device), "x": torch.full((N,), 2.0)}
    with CheckpointManager(str(tmp_path / "run"), incremental=True, frozen=["w"]) as mgr:
        mgr.save(0, sd)
        mgr.save(1, sd)
        sd["w"] = torch.full((N,), 5.0, device=xla_device)  # e.g. load_state_dict(assign=True)
        try:
            mgr.save(2, sd)
        except CheckpointError:
            pass  # FrozenTensorChangedError is a fine answer: step 2 must still hold the new bytes
        got = {"w": torch.zeros(N), "x": torch.zeros(N)}
        mgr.restore(2, got)
    assert_bitwise_equal(got, {"w": torch.full((N,), 5.0), "x": torch.full((N,), 2.0)})
