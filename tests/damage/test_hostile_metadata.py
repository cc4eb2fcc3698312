"""Consistent forgeries of a step's metadata and manifest (re-signed, so that sizes, CRCs and
the commit marker all match): restore, verify, export, show, ls and prune must treat them as
damage (a :class:`CorruptCheckpointError`, ``restore(None)`` falling back to the older step,
``verify`` not ok, one line on stderr from the command line), never succeed without writing
a tensor or die with a stray ``RuntimeError``/``IndexError``/``OverflowError``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from async_ckpt import CheckpointManager
from async_ckpt.cli import main
from async_ckpt.errors import CorruptCheckpointError
from async_ckpt.format.dcp_layout import METADATA_NAME

from ..cli.test_cli import run_cli
from ..conftest import assert_bitwise_equal, small_state, target_like
from .test_hostile_storage import (
    data_file,
    make_root,
    resign,
    restore_none_falls_back,
    rewrite_metadata,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hostile_md") / "ckpt")
    return root, make_root(root)


@pytest.fixture
def root3(pristine, tmp_path):
    """A fresh copy of a root with steps 1..3: (root, {step: saved state})."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(pristine[0], root)
    return root, pristine[1]


def move_chunk(md, fqn: str, offsets, sizes=None) -> None:
    """Place ``fqn``'s only chunk at ``offsets`` (and ``sizes``), its stored record following it."""
    m = md.state_dict_metadata[fqn]
    old = m.chunks[0]
    info = md.storage_data.pop(MetadataIndex(fqn, old.offsets))
    m.chunks[0] = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes if sizes is not None else old.sizes))
    md.storage_data[MetadataIndex(fqn, torch.Size(offsets))] = info


def _set(obj, attr, value):
    setattr(obj, attr, value)


METADATA_FORGERIES = {
    # (a) the tensor's only chunk lies outside it: nothing would be written into "w"
    "chunk_outside_tensor": lambda md: move_chunk(md, "w", [64, 0]),
    "chunk_partly_outside": lambda md: move_chunk(md, "w", [32, 0]),
    "chunk_covers_half": lambda md: move_chunk(md, "w", [0, 0], [32, 8]),
    # (b) a negative size
    "negative_tensor_size": lambda md: _set(md.state_dict_metadata["w"], "size", torch.Size([-64, 8])),
    "negative_chunk_size": lambda md: move_chunk(md, "w", [0, 0], [-64, 8]),
    # (d) an empty key path, no entries, extra chunks
    "empty_key_path": lambda md: md.planner_data.__setitem__("opt.lr", ()),
    "entries_none": lambda md: _set(md, "state_dict_metadata", None),
    "storage_data_none": lambda md: _set(md, "storage_data", None),
    "extra_chunk_without_data": lambda md: md.state_dict_metadata["w"].chunks.append(
        ChunkStorageMetadata(torch.Size([32, 0]), torch.Size([32, 8]))),
    "overlapping_chunks": lambda md: md.state_dict_metadata["w"].chunks.append(
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([32, 8]))),
    "bytes_entry_without_data": lambda md: md.storage_data.pop(MetadataIndex("opt.lr")),
    "tensor_larger_than_its_record": lambda md: (
        _set(md.state_dict_metadata["w"], "size", torch.Size([64, 8000])),
        move_chunk(md, "w", [0, 0], [64, 8000])),
    "chunk_record_without_sizes": lambda md: delattr(md.state_dict_metadata["w"].chunks[0], "sizes"),
    "items_overlap_in_file": lambda md: _set(md.storage_data[MetadataIndex("opt.lr")], "offset", 0),
}


def _huge_file(d):
    f = d["files"][next(n for n in d["files"] if n.endswith(".distcp"))]
    f.pop("records", None)
    f.pop("data_at", None)
    f["size"] = 2**62


MANIFEST_FORGERIES = {
    # (c) a data file far larger than the items in it
    "data_file_size_2**62": _huge_file,
    # (d) commit times that no clock gives
    "infinite_commit_time": lambda d: d.__setitem__("commit_time", float("inf")),
    "nan_commit_time": lambda d: d.__setitem__("commit_time", float("nan")),
    "negative_file_size": lambda d: d["files"][next(n for n in d["files"] if n.endswith(".distcp"))].__setitem__(
        "size", -1),
    "negative_nbytes": lambda d: d.__setitem__("nbytes", -1),
    "zero_world_size": lambda d: d.__setitem__("world_size", 0),
    "num_tensors_as_text": lambda d: d.__setitem__("num_tensors", "2"),
    "step_as_text": lambda d: d.__setitem__("step", "3"),
    "crc_out_of_range": lambda d: d["files"][METADATA_NAME].__setitem__(
        "crc32c", d["files"][METADATA_NAME]["crc32c"] + 2**32),
    "extra_not_a_dict": lambda d: d.__setitem__("extra", ["x"]),
    "int_keys_not_names": lambda d: d.__setitem__("extra", {"int_keys": [3]}),
}


def _forge(root: str, kind: str, name: str) -> None:
    d3 = os.path.join(root, "3")
    if kind == "metadata":
        rewrite_metadata(d3, 3, METADATA_FORGERIES[name])
    else:
        resign(d3, 3, MANIFEST_FORGERIES[name])


CASES = [("metadata", n) for n in METADATA_FORGERIES] + [("manifest", n) for n in MANIFEST_FORGERIES]


@pytest.mark.parametrize("kind,name", CASES, ids=[n for _, n in CASES])
def test_forged_step_is_damage_for_restore(root3, kind, name):
    root, saved = root3
    _forge(root, kind, name)
    restore_none_falls_back(root, saved, 3, 2)
    with CheckpointManager(root, keep_incomplete=True) as mgr:
        t = target_like(small_state(0))
        with pytest.warns(RuntimeWarning, match="skipping damaged step 3"):
            assert mgr.restore(None, t, atomic=True) == 2
        assert_bitwise_equal(t, saved[2])
        fresh: dict = {}
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(3, fresh)  # into {}: never a success with uninitialised tensors
        assert fresh == {}
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(3, target_like(small_state(0)), atomic=True)


def _one_line_error(capsys) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert "Traceback" not in cap.err and len(err.splitlines()) == 1 and err.startswith("async-ckpt: error:"), cap
    return err


@pytest.mark.parametrize("kind,name", CASES, ids=[n for _, n in CASES])
def test_forged_step_is_damage_for_the_cli(root3, kind, name, tmp_path, capsys):
    root, _ = root3
    _forge(root, kind, name)
    assert main(["verify", root, "3", "--json", "--no-progress"]) == 1
    res = json.loads(capsys.readouterr().out)
    assert not res["ok"] and res["steps"][0]["problems"], res
    assert main(["verify", root, "--all", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "step 3: DAMAGED" in out and "step 2: ok" in out, out
    for argv in (["show", root, "3"], ["show", root, "3", "--json", "--values"],
                 ["export", root, "3", str(tmp_path / "out.pt")]):
        assert main(argv) == 1, argv
        if "--json" in argv:  # with --json the error is one JSON object on stdout
            cap = capsys.readouterr()
            err = json.loads(cap.out)["error"]
            assert err["type"] == "CorruptCheckpointError" and err["exit_code"] == 1 and not cap.err, cap
        else:
            _one_line_error(capsys)
    assert not os.path.exists(tmp_path / "out.pt")
    assert main(["ls", root]) == 0
    capsys.readouterr()
    assert main(["ls", root, "--json"]) == 0
    steps = {e["step"]: e["status"] for e in json.loads(capsys.readouterr().out)["steps"]}
    assert steps[3] == ("damaged" if kind == "manifest" else "listed") and steps[2] == "listed", steps
    assert main(["prune", root, "--keep-last", "1", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kept"] == [2] and "3" in plan["skipped_damaged"], plan
    assert main(["prune", root, "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert sorted(n for n in os.listdir(root) if n.isdigit()) == ["2", "3"]  # 1 pruned; 3 left alone


def test_forged_steps_give_no_traceback_from_the_command(root3, tmp_path):
    """The installed command itself (a subprocess): one line on stderr, exit 1."""
    root, _ = root3
    rewrite_metadata(os.path.join(root, "3"), 3, METADATA_FORGERIES["negative_tensor_size"])
    resign(os.path.join(root, "2"), 2, MANIFEST_FORGERIES["infinite_commit_time"])
    for args in (["export", root, "3", str(tmp_path / "o.pt")], ["show", root, "3"], ["show", root, "2"]):
        proc = run_cli(*args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for args in (["ls", root], ["prune", root, "--keep-last", "1", "--dry-run"]):
        proc = run_cli(*args)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.stderr)


def test_untouched_step_still_restores_bitwise(root3):
    """The checks pass every step async_ckpt writes (the control for the forgeries above)."""
    root, saved = root3
    with CheckpointManager(root, keep_incomplete=True) as mgr:
        for atomic in (False, True):
            out: dict = {}
            assert mgr.restore(3, out, atomic=atomic) == 3
            assert_bitwise_equal(out, saved[3])
    assert main(["verify", root, "--all", "--no-progress"]) == 0
    assert data_file(os.path.join(root, "3")).endswith(".distcp")


def test_a_share_claimed_by_a_forged_world_size_is_still_damage_in_one_process(root3):
    """A local tier copy of a several-rank save holds only its rank's chunks (restore and
    ``verify`` accept it as that rank's share). A forged manifest that claims to be such a share
    (``extra.world_size`` 2) with a half-covered tensor is still damage for a single process:
    nothing restores a tensor that its chunks leave partly unwritten."""
    root, saved = root3
    d3 = os.path.join(root, "3")
    rewrite_metadata(d3, 3, METADATA_FORGERIES["chunk_covers_half"])
    resign(d3, 3, lambda d: d.__setitem__("extra", {**d["extra"], "world_size": 2, "rank": 0}))
    restore_none_falls_back(root, saved, 3, 2)
    with CheckpointManager(root, keep_incomplete=True) as mgr:
        fresh: dict = {}
        with pytest.raises(CorruptCheckpointError, match="chunks hold"):
            mgr.restore(3, fresh)
        assert fresh == {}


@pytest.mark.parametrize("name", ["manifest.json", "COMMITTED", ".async_ckpt_pending"])
def test_a_manifest_listing_a_name_async_ckpt_writes_itself_is_refused(name):
    """A manifest (a peer's copy, a damaged step) that lists the manifest, the commit marker or
    the pending mark as one of its data files is refused as it is read: its copy would be
    committed with our own files overwritten by its data."""
    from async_ckpt.format.manifest import Manifest

    good = {"format_version": 1, "step": 3, "commit_time": 1.0, "nbytes": 4, "num_tensors": 1, "world_size": 1,
            "metrics": {}, "extra": {}, "files": {"__0_0.distcp": {"size": 4, "crc32c": 0}}}
    assert Manifest.from_json(json.dumps(good).encode()).step == 3
    bad = dict(good, files={**good["files"], name: {"size": 4, "crc32c": 0}})
    with pytest.raises(CorruptCheckpointError, match=name.replace(".", r"\.")):
        Manifest.from_json(json.dumps(bad).encode(), where="rank 1's manifest")
