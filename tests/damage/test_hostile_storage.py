"""Hostile checkpoint roots: symbolic links, crafted manifests and metadata, directories where
files should be, control characters in names. Nothing may be deleted or read outside the
root's step directories, and damage must always be damage (restore falls back, verify and ls
say so), never a storage error or a silently unchecked read."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest

from async_ckpt import CheckpointManager
from async_ckpt.cli import main
from async_ckpt.errors import CorruptCheckpointError, StepNotFoundError, StorageError, UnsafeCheckpointError
from async_ckpt.format.crc import crc32c
from async_ckpt.format.dcp_layout import METADATA_NAME
from async_ckpt.format.manifest import MANIFEST_NAME, MARKER_NAME, marker_bytes
from async_ckpt.format.unpickling import load_metadata
from async_ckpt.storage.step_dirs import StepDirectories
from async_ckpt.storage.storage import Storage

from ..conftest import assert_bitwise_equal, clone_tree, data_files, flip_byte, small_state, target_like


def make_root(root: str, steps=(1, 2, 3), **kw):
    saved = {}
    with CheckpointManager(root, **kw) as mgr:
        for s in steps:
            saved[s] = clone_tree(small_state(s))
            mgr.save(s, small_state(s))
    return saved


def data_file(step_dir: str) -> str:
    """The name of the step's first data file."""
    return os.path.basename(data_files(step_dir)[0])


def resign(step_dir: str, step: int, edit) -> None:
    """Edit the raw manifest JSON with ``edit(dict)`` and write a marker that vouches for it:
    a consistent forgery, which only the content checks can catch."""
    d = json.loads(open(os.path.join(step_dir, MANIFEST_NAME), "rb").read())
    edit(d)
    mbytes = json.dumps(d, indent=1, sort_keys=True).encode()
    open(os.path.join(step_dir, MANIFEST_NAME), "wb").write(mbytes)
    open(os.path.join(step_dir, MARKER_NAME), "wb").write(marker_bytes(step, mbytes))


def record(data: bytes):
    return {"size": len(data), "crc32c": crc32c(data)}


def snapshot(top: str):
    """Every entry under ``top`` (links not followed): name -> (kind, size, mtime_ns, target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_size if not os.path.isdir(p) or os.path.islink(p) else 0,
                                            st.st_mtime_ns, os.readlink(p) if os.path.islink(p) else None)
    st = os.lstat(top)
    out["."] = (st.st_mode, 0, st.st_mtime_ns, None)
    return out


def restore_none_falls_back(root: str, saved, bad_step: int, good_step: int):
    mgr = CheckpointManager(root, keep_incomplete=True)
    t = target_like(small_state(0))
    with pytest.warns(RuntimeWarning, match=f"skipping damaged step {bad_step}"):
        assert mgr.restore(None, t) == good_step
    assert_bitwise_equal(t, saved[good_step])
    t = target_like(small_state(0))
    before = clone_tree(t)
    with pytest.raises(CorruptCheckpointError):
        mgr.restore(bad_step, t)
    assert_bitwise_equal(t, before)  # a failed restore leaves the state dict as it was
    mgr.close()


# ---- 7: prune never keeps a damaged newest step in place of an intact one -------------------

@pytest.mark.parametrize("damage", ["missing_file", "flipped_byte"])
def test_prune_keeps_the_newest_intact_step(tmp_path, damage, capsys):
    root = str(tmp_path / "ckpt")
    make_root(root)
    d3 = os.path.join(root, "3")
    p = os.path.join(d3, data_file(d3))
    if damage == "missing_file":
        os.unlink(p)
    else:  # same size: only a checksum finds it
        flip_byte(p, mask=0x40)
    assert main(["prune", root, "--keep-last", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kept"] == [2] and plan["deleted"] == [1], plan
    assert list(plan["skipped_damaged"]) == ["3"]
    assert sorted(n for n in os.listdir(root) if n.isdigit()) == ["2", "3"]  # 3 is left alone, not deleted


def test_prune_deletes_nothing_when_no_step_verifies(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    make_root(root, steps=(1, 2))
    for s in ("1", "2"):
        p = os.path.join(root, s, data_file(os.path.join(root, s)))
        flip_byte(p, at=-10)
    assert main(["prune", root, "--keep-last", "1"]) == 0
    assert "0 kept, 0 deleted, 2 damaged step(s) left alone" in capsys.readouterr().out
    assert sorted(n for n in os.listdir(root) if n.isdigit()) == ["1", "2"]


# ---- 8: a step directory that is a symbolic link is foreign --------------------------------

@pytest.fixture
def linked_root(tmp_path):
    """A root with steps 1..3, plus ``0`` a link to a directory elsewhere that holds a complete
    committed step and an unrelated file."""
    root = str(tmp_path / "ckpt")
    make_root(root)
    elsewhere = str(tmp_path / "elsewhere")
    shutil.copytree(os.path.join(root, "1"), elsewhere)
    with open(os.path.join(elsewhere, "precious.txt"), "w") as f:
        f.write("unrelated data")
    os.symlink(elsewhere, os.path.join(root, "0"))
    return root, elsewhere


def test_linked_step_is_not_committed_restored_or_deleted_by_retention(linked_root):
    root, elsewhere = linked_root
    before = snapshot(elsewhere)
    assert StepDirectories(Storage(root)).committed_steps() == [1, 2, 3]
    with CheckpointManager(root, max_to_keep=1) as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        with pytest.raises(StepNotFoundError):
            mgr.restore(0, target_like(small_state(0)))
        mgr.save(4, small_state(4))  # retention drops 1..3, and must not reach through 0
        mgr.join()
    with CheckpointManager(root) as mgr:  # recovery and cleanup (first save) leave it alone too
        assert mgr.all_steps() == [4]
        mgr.save(5, small_state(5))
    assert os.path.islink(os.path.join(root, "0"))
    assert snapshot(elsewhere) == before


def test_linked_step_survives_prune_and_ls_calls_it_foreign(linked_root, capsys):
    root, elsewhere = linked_root
    before = snapshot(elsewhere)
    assert main(["prune", root, "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert sorted(n for n in os.listdir(root) if not n.startswith(".async_ckpt.")) == ["0", "3"]
    assert snapshot(elsewhere) == before
    assert main(["ls", root, "--json"]) == 0
    st = {e["step"]: e for e in json.loads(capsys.readouterr().out)["steps"]}
    assert st[0]["status"] == "foreign" and "symbolic link" in st[0]["problem"]
    assert main(["verify", root, "0"]) == 2  # not a committed step
    assert "no committed checkpoint for step 0" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["rename", "marker"])
def test_saving_a_step_whose_directory_is_a_link_is_refused(linked_root, mode):
    root, elsewhere = linked_root
    os.symlink(elsewhere, os.path.join(root, "10"))  # above the highest step: a plain next save
    before = snapshot(elsewhere)
    mgr = CheckpointManager(root, commit_mode=mode, keep_incomplete=True)
    with pytest.raises(StorageError, match="symbolic link"):
        mgr.layout.begin(10)
    with pytest.raises(StorageError, match="symbolic link"):
        mgr.layout.delete(10)
    with pytest.raises(Exception, match="symbolic link"):
        mgr.save(10, small_state(10))
    try:
        mgr.close()
    except Exception:
        pass  # the failed save may surface again here
    assert snapshot(elsewhere) == before
    assert os.path.islink(os.path.join(root, "10"))


def test_linked_tmp_and_trash_dirs_are_never_cleaned(tmp_path):
    root = str(tmp_path / "ckpt")
    make_root(root, steps=(1,))
    targets = {}
    for name in (".tmp-5-0123456789ab", ".trash-1-0123456789ab", "7"):
        t = str(tmp_path / f"target{len(targets)}")
        os.makedirs(t)
        open(os.path.join(t, ".async_ckpt_pending"), "wb").close()  # looks like ours inside
        open(os.path.join(t, "keep.me"), "w").write("x")
        os.symlink(t, os.path.join(root, name))
        targets[name] = t
    before = {n: snapshot(t) for n, t in targets.items()}
    layout = StepDirectories(Storage(root))
    assert layout.incomplete() == [] and layout.recover() == []
    CheckpointManager(root).close()  # startup cleanup
    assert {n: snapshot(t) for n, t in targets.items()} == before
    assert all(os.path.islink(os.path.join(root, n)) for n in targets)


def test_storage_rm_never_deletes_through_a_link(linked_root):
    root, elsewhere = linked_root
    st = Storage(root)
    with pytest.raises(StorageError, match="symbolic link"):
        st.rm(os.path.join(root, "0", "precious.txt"))
    st.rm(os.path.join(root, "0"))  # the link itself goes, never what it points to
    assert not os.path.lexists(os.path.join(root, "0"))
    assert open(os.path.join(elsewhere, "precious.txt")).read() == "unrelated data"


# ---- 9: names resolve inside the step directory only -------------------------------------------

@pytest.fixture
def root3(tmp_path):
    root = str(tmp_path / "ckpt")
    return root, make_root(root)


def _outside_copy(tmp_path, step_dir: str) -> str:
    src = os.path.join(step_dir, data_file(step_dir))
    dst = str(tmp_path / "outside.bin")
    shutil.copyfile(src, dst)
    return dst


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "subdir"])
def test_manifest_naming_a_path_outside_the_step_is_damage(root3, tmp_path, kind, capsys):
    root, saved = root3
    d3 = os.path.join(root, "3")
    out = _outside_copy(tmp_path, d3)
    data = open(out, "rb").read()
    name = {"dotdot": "../../outside.bin", "absolute": out, "subdir": "x/y.bin"}[kind]
    resign(d3, 3, lambda d: d["files"].__setitem__(name, record(data)))
    restore_none_falls_back(root, saved, 3, 2)
    assert main(["verify", root, "3"]) == 1
    assert "not a plain file name" in capsys.readouterr().out


@pytest.mark.parametrize("which", ["data", METADATA_NAME, MANIFEST_NAME, MARKER_NAME])
def test_file_linked_out_of_the_step_is_damage(root3, tmp_path, which, capsys):
    root, saved = root3
    d3 = os.path.join(root, "3")
    name = data_file(d3) if which == "data" else which
    out = str(tmp_path / "outside.bin")
    shutil.copyfile(os.path.join(d3, name), out)  # the same bytes: size and checksum still match
    os.unlink(os.path.join(d3, name))
    os.symlink(out, os.path.join(d3, name))
    restore_none_falls_back(root, saved, 3, 2)
    assert main(["verify", root, "3"]) == 1
    assert "outside the step directory" in capsys.readouterr().out
    assert main(["ls", root, "--json"]) == 0
    st = {e["step"]: e for e in json.loads(capsys.readouterr().out)["steps"]}
    assert st[3]["status"] == "damaged" and st[2]["status"] == "listed"


def test_link_inside_the_step_directory_is_fine(root3):
    root, saved = root3
    d3 = os.path.join(root, "3")
    name = data_file(d3)
    os.rename(os.path.join(d3, name), os.path.join(d3, "real.bin"))
    os.symlink("real.bin", os.path.join(d3, name))
    t = target_like(small_state(0))
    with CheckpointManager(root, keep_incomplete=True) as mgr:
        assert mgr.restore(3, t) == 3
    assert_bitwise_equal(t, saved[3])


def rewrite_metadata(step_dir: str, step: int, change) -> None:
    """Unpickle ``.metadata`` (a test may), ``change(md)``, pickle it back and re-sign."""
    p = os.path.join(step_dir, METADATA_NAME)
    md = pickle.loads(open(p, "rb").read())
    change(md)
    data = pickle.dumps(md)
    open(p, "wb").write(data)
    resign(step_dir, step, lambda d: d["files"].__setitem__(METADATA_NAME, record(data)))


def test_metadata_naming_a_path_outside_the_step_is_damage(root3, tmp_path):
    root, saved = root3
    d3 = os.path.join(root, "3")
    _outside_copy(tmp_path, d3)

    def redirect(md):
        for idx, info in md.storage_data.items():
            info.relative_path = "../../outside.bin"

    rewrite_metadata(d3, 3, redirect)
    restore_none_falls_back(root, saved, 3, 2)


def test_data_file_missing_from_the_manifest_is_damage(root3, capsys):
    root, saved = root3
    d3 = os.path.join(root, "3")
    name = data_file(d3)
    resign(d3, 3, lambda d: d["files"].pop(name))  # the file is there, but unlisted: unchecked
    restore_none_falls_back(root, saved, 3, 2)
    assert main(["verify", root, "3"]) == 1
    assert "manifest lacks" in capsys.readouterr().out


def test_every_listed_file_is_checked_on_restore(root3):
    root, saved = root3
    d3 = os.path.join(root, "3")
    open(os.path.join(d3, "extra.bin"), "wb").write(b"abc")
    resign(d3, 3, lambda d: d["files"].__setitem__("extra.bin", {"size": 3, "crc32c": crc32c(b"abd")}))
    restore_none_falls_back(root, saved, 3, 2)


# ---- 10: a directory where a file should be is damage --------------------------------------

@pytest.mark.parametrize("which", [MARKER_NAME, MANIFEST_NAME, "data", METADATA_NAME])
def test_directory_in_place_of_a_file_is_damage(root3, which, capsys):
    root, saved = root3
    d3 = os.path.join(root, "3")
    name = data_file(d3) if which == "data" else which
    os.unlink(os.path.join(d3, name))
    os.makedirs(os.path.join(d3, name, "inner"))
    restore_none_falls_back(root, saved, 3, 2)
    assert main(["verify", root, "3"]) == 1
    assert "step 3: DAMAGED" in capsys.readouterr().out
    assert main(["ls", root, "--json"]) == 0
    st = {e["step"]: e for e in json.loads(capsys.readouterr().out)["steps"]}
    assert st[3]["status"] == "damaged", st[3]


# ---- 11: ls agrees with verify, and the read commands change nothing ----------------------

def test_ls_never_says_ok_for_a_step_verify_rejects(root3, capsys):
    root, _ = root3
    p = os.path.join(root, "2", data_file(os.path.join(root, "2")))
    flip_byte(p, at=5)
    assert main(["verify", root, "--all", "--json"]) == 1
    verified = {r["step"]: r["ok"] for r in json.loads(capsys.readouterr().out)["steps"]}
    assert verified == {1: True, 2: False, 3: True}
    assert main(["ls", root, "--json"]) == 0
    listed = {e["step"]: e["status"] for e in json.loads(capsys.readouterr().out)["steps"]}
    assert "ok" not in listed.values()  # ls reads no contents: it never claims a step is ok
    assert listed == {1: "listed", 2: "listed", 3: "listed"}
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert " ok " not in out and "LISTED" not in out and " listed " in out


def test_read_commands_change_nothing_under_the_root(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    make_root(root, stats_log=True)
    os.makedirs(os.path.join(root, ".tmp-9-0123456789ab"))
    open(os.path.join(root, ".tmp-9-0123456789ab", "__0_0.distcp"), "wb").write(b"partial")
    os.makedirs(os.path.join(root, "8"))  # an unmarked step directory
    open(os.path.join(root, "8", ".async_ckpt_pending"), "wb").close()
    before = snapshot(root)
    out = str(tmp_path / "exported.pt")
    for argv in (["ls", root], ["ls", root, "--json"], ["show", root], ["show", root, "2", "--values"],
                 ["verify", root, "--all", "--no-progress"], ["export", root, "latest", out],
                 ["prune", root, "--keep-last", "1", "--dry-run"], ["stats", root]):
        assert main(argv) == 0, argv
    capsys.readouterr()
    assert snapshot(root) == before
    assert os.path.exists(out)


# ---- 12: names from a checkpoint are escaped in error messages --------------------------------

def _global_pickle(module: str, name: str) -> bytes:
    """A protocol-4 pickle that asks for ``module.name`` (STACK_GLOBAL) and stops."""

    def ustr(s: str) -> bytes:
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b

    return b"\x80\x04" + ustr(module) + ustr(name) + b"\x93."


def test_unsafe_metadata_error_escapes_control_characters(root3, capsys):
    evil = _global_pickle("os\x1b[2J", "system\x1b]0;pwned\x07")
    with pytest.raises(UnsafeCheckpointError) as exc:
        load_metadata(evil)
    text = str(exc.value)
    assert "\x1b" not in text and "\x07" not in text and "\\x1b" in text
    root, _ = root3
    d3 = os.path.join(root, "3")
    open(os.path.join(d3, METADATA_NAME), "wb").write(evil)
    resign(d3, 3, lambda d: d["files"].__setitem__(METADATA_NAME, record(evil)))
    with CheckpointManager(root, keep_incomplete=True) as mgr:
        with pytest.raises(UnsafeCheckpointError) as exc:
            mgr.restore(3, target_like(small_state(0)))
    assert "\x1b" not in str(exc.value) and "\\x1b" in str(exc.value)
    assert main(["show", root, "3"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\\x1b" in err


# ---- 13 -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_write_threads_must_be_positive_int(tmp_path, bad):
    with pytest.raises(ValueError, match="write_threads"):
        CheckpointManager(str(tmp_path / "ckpt"), write_threads=bad)
