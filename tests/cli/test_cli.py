"""The ``async-ckpt`` command, run as a subprocess on real checkpoint directories (one of them
damaged), plus in-process runs on ``memory://`` and the save statistics log."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import fsspec
import pytest
import torch

from async_ckpt import CheckpointError, CheckpointManager, SaveStats
from async_ckpt.cli import main
from async_ckpt.cli.common import human_bytes
from async_ckpt.stats import read_stats_log
from async_ckpt.storage.stats_log import StatsLog

from ..conftest import assert_bitwise_equal, clone_tree, flip_data_byte, make_state

STEPS = (10, 20, 30)


def _state(step: int):
    model, opt = make_state(seed=step)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "extra": {"table": torch.arange(12, dtype=torch.int16).reshape(3, 4)}}


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    """A checkpoint root with three committed steps; returns (root, {step: saved state})."""
    root = str(tmp_path_factory.mktemp("cli") / "ckpt")
    saved = {}
    with CheckpointManager(root, stats_log=True) as mgr:
        for s in STEPS:
            sd = _state(s)
            saved[s] = clone_tree(sd)
            mgr.save(s, sd, metrics={"loss": 1.0 / s})
    return root, saved


@pytest.fixture
def damaged_dir(good_dir, tmp_path):
    """A copy of ``good_dir`` with step 20's data flipped by one byte, step 30's manifest removed,
    an unfinished ``.tmp-`` save and an unmarked step directory."""
    root = str(tmp_path / "damaged")
    shutil.copytree(good_dir[0], root)
    distcp = os.path.basename(flip_data_byte(f"{root}/20"))
    os.unlink(f"{root}/30/manifest.json")
    os.makedirs(f"{root}/.tmp-40-0123456789ab")
    os.makedirs(f"{root}/50")
    open(f"{root}/50/__0_0.distcp", "wb").write(b"x" * 10)
    return root, distcp


def run_cli(*args: str, console_script: bool = False):
    exe = os.path.join(os.path.dirname(sys.executable), "async-ckpt")
    cmd = [exe, *args] if console_script and os.path.exists(exe) else [sys.executable, "-m", "async_ckpt", *args]
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _no_traceback(proc):
    assert "Traceback" not in proc.stderr, proc.stderr


# ---- subprocess: the real command on real directories ------------------------------------------

def test_ls_marks_damaged_and_incomplete_steps(damaged_dir):
    root, _ = damaged_dir
    proc = run_cli("ls", root, console_script=True)
    assert proc.returncode == 0, proc.stderr
    _no_traceback(proc)
    table = proc.stdout.split("\n\n")[0].splitlines()
    assert table[0].split() == ["STEP", "ORDER", "COMMITTED", "SIZE", "FILES", "STATUS", "METRICS"]
    lines = {ln.split()[0]: ln for ln in table[1:]}
    assert lines["10"].split()[1] == "1" and lines["40"].split()[1] == "-"  # commit order, oldest first
    assert set(lines) == {"10", "20", "30", "40", "50"}
    assert " listed " in lines["10"] and "loss=0.1" in lines["10"]
    # A flipped byte keeps the size: only `verify` (checksums) can tell step 20 is damaged, so
    # ls says "listed" (its cheap checks pass), never "ok".
    assert " listed " in lines["20"] and " ok " not in proc.stdout
    assert "DAMAGED" in lines["30"]
    # 40: empty (ours: cleaned up); 50: data without our sentinel, another program's (never touched)
    assert "INCOMPLETE" in lines["40"] and "FOREIGN" in lines["50"]
    assert "manifest is missing" in proc.stdout or "manifest.json" in proc.stdout
    assert "3 committed (1 damaged), 1 incomplete, 1 foreign" in proc.stdout


def test_verify_all_finds_the_flipped_byte_and_exits_1(damaged_dir):
    root, distcp = damaged_dir
    proc = run_cli("verify", root, "--all")
    _no_traceback(proc)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.startswith("step 10: ok (")
    assert "step 20: DAMAGED" in out and f"{distcp}: checksum mismatch" in out
    assert "step 30: DAMAGED" in out and "manifest" in out.split("step 30: DAMAGED", 1)[1]
    assert proc.stderr.strip().splitlines()[-1] == "2 of 3 step(s) damaged: 20, 30"


def test_missing_step_is_one_line_error_exit_2(good_dir):
    root, _ = good_dir
    proc = run_cli("show", root, "7")
    assert proc.returncode == 2
    _no_traceback(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "step 7" in lines[0] and "10, 20, 30" in lines[0], proc.stderr


def test_export_pt_is_bitwise_equal(good_dir, tmp_path):
    root, saved = good_dir
    out = str(tmp_path / "step20.pt")
    proc = run_cli("export", root, "20", out)
    assert proc.returncode == 0, proc.stderr
    assert "exported step 20" in proc.stdout
    got = torch.load(out, weights_only=True)
    assert_bitwise_equal(saved[20], got)  # optimizer state keyed by int, lists stay lists


# ---- in process (the same entry point, without the interpreter start-up) ----------------------

def test_verify_json_and_good_step(damaged_dir, capsys):
    root, distcp = damaged_dir
    assert main(["verify", root, "--all", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    by_step = {r["step"]: r for r in report["steps"]}
    assert report["ok"] is False and set(by_step) == {10, 20, 30}
    assert by_step[10]["ok"] is True and by_step[10]["problems"] == []
    assert any(distcp in p and "checksum mismatch" in p for p in by_step[20]["problems"]), by_step[20]
    assert main(["verify", root, "10"]) == 0
    assert capsys.readouterr().out.startswith("step 10: ok (")


def test_verify_names_a_damaged_file_by_its_name_in_the_step(damaged_dir, capsys):
    # as every other problem verify lists (and as 025a064 did): the file's name inside the
    # step, not the step directory's path again before it
    root, distcp = damaged_dir
    assert main(["verify", root, "20", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["steps"][0]["problems"]
    assert len(problems) == 1 and problems[0].startswith(f"{distcp}: checksum mismatch"), problems
    assert main(["verify", root, "20"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"  {problems[0]}", lines


def test_show_prints_keys_shapes_dtypes(good_dir, capsys):
    root, saved = good_dir
    assert main(["show", root]) == 0  # the newest step
    out = capsys.readouterr().out
    assert out.startswith("step 30 ")
    assert "loss=0.03333" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[2:] if ln.strip()}
    w = saved[30]["model"]["0.weight"]
    assert rows["0.weight"][1:3] == ["float32", f"[{w.shape[0]},"]
    assert rows["table"][1] == "int16" and "[3, 4]" in " ".join(rows["table"])
    assert "model/" in rows and "optim/" in rows and "exp_avg_sq" in rows
    assert rows["lr"][-2:] == ["pickled", "value"]  # values are read only with --values
    assert main(["show", root, "20", "--values", "--json"]) == 0
    entries = {e["key"]: e for e in json.loads(capsys.readouterr().out)["entries"]}
    assert entries["step"]["value"] == "20" and entries["optim.param_groups.0.lr"]["value"] == "0.001"
    assert entries["optim.param_groups.0.betas"]["value"] == "(0.9, 0.999)"
    assert "value" not in entries["model.0.weight"]
    assert main(["ls", os.path.join(root, "does-not-exist")]) == 2
    assert capsys.readouterr().err.startswith("async-ckpt: error: no such checkpoint directory")


def test_export_safetensors_of_the_model(good_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    root, saved = good_dir
    out = str(tmp_path / "model.safetensors")
    assert main(["export", root, "latest", out, "--key", "model"]) == 0
    assert_bitwise_equal(dict(saved[30]["model"]), load_file(out))


def test_prune_local(good_dir, tmp_path, capsys):
    root = str(tmp_path / "prune")
    shutil.copytree(good_dir[0], root)
    assert main(["prune", root, "--keep-last", "1"]) == 0
    assert "1 kept, 2 deleted" in capsys.readouterr().out
    assert sorted(int(n) for n in os.listdir(root) if n.isdigit()) == [30]



@pytest.fixture
def mem_root(memory_root):
    url = memory_root + "/run"  # exports go next to it
    saved = {}
    with CheckpointManager(url) as mgr:
        for s in range(0, 60, 10):
            sd = {"w": torch.randn(8, 3, dtype=torch.float64), "nested": {"b": torch.arange(5)}, "lr": 0.5 + s}
            saved[s] = clone_tree(sd)
            mgr.save(s, sd, metrics={"acc": s / 100})
    return url, saved


def test_memory_url_ls_show_verify_json(mem_root, capsys):
    url, _ = mem_root
    assert main(["ls", url, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [e["step"] for e in listing["steps"]] == [0, 10, 20, 30, 40, 50]
    assert all(e["status"] == "listed" for e in listing["steps"])
    assert listing["steps"][2]["metrics"] == {"acc": 0.2}
    assert main(["show", url, "40", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    entries = {e["key"]: e for e in shown["entries"]}
    assert entries["w"]["dtype"] == "float64" and entries["w"]["shape"] == [8, 3] and entries["w"]["bytes"] == 192
    assert entries["nested.b"]["path"] == ["nested", "b"] and entries["nested.b"]["dtype"] == "int64"
    assert entries["lr"]["kind"] == "object"
    assert main(["verify", url, "--all"]) == 0
    assert capsys.readouterr().out.count(": ok (") == 6


def test_memory_url_damage_export_prune(mem_root, capsys, tmp_path):
    url, saved = mem_root
    flip_data_byte(f"{url}/30", at=-100, mask=0xFF)
    assert main(["verify", url, "30", "--progress"]) == 1
    out, err = capsys.readouterr()
    assert "DAMAGED" in out and "checksum mismatch" in out
    assert "1 of 1 step(s) damaged: 30" in err
    # export reads through the same verification: a damaged step is an error, exit 1, one line
    assert main(["export", url, "30", str(tmp_path / "x.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checksum mismatch" in err
    assert not (tmp_path / "x.pt").exists()
    # a good step exports to another fsspec URL
    out_url = url.rsplit("/", 1)[0] + "/export/s40.pt"
    assert main(["export", url, "40", out_url]) == 0
    capsys.readouterr()
    with fsspec.open(out_url, "rb") as f:
        assert_bitwise_equal(saved[40], torch.load(f, weights_only=True))
    # prune: dry run deletes nothing; the real run keeps the newest and every 20th step
    assert main(["prune", url, "--keep-last", "1", "--keep-every", "20", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan == {"path": url, "dry_run": True, "kept": [0, 20, 40, 50], "deleted": [10, 30],
                    "skipped_damaged": {}, "job_retention": None, "kept_for_job_retention": [], "forced": []}
    assert main(["ls", url, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["steps"]) == 6
    assert main(["prune", url, "--keep-last", "1", "--keep-every", "20"]) == 0
    capsys.readouterr()
    assert CheckpointManager(url, keep_incomplete=True).all_steps() == [0, 20, 40, 50]


def test_export_errors_are_one_line(mem_root, capsys, tmp_path):
    url, _ = mem_root
    cases = [
        (["export", url, "10", str(tmp_path / "a.safetensors")], "safetensors holds tensors only"),
        (["export", url, "10", str(tmp_path / "a.bin")], "OUT must end in .pt"),
        (["export", url, "10", str(tmp_path / "a.pt"), "--key", "nope"], "no entry 'nope'"),
        (["export", url, "x", str(tmp_path / "a.pt")], "STEP must be a non-negative integer"),
        (["verify", url, "10", "--all"], "not both"),
        (["prune", url, "--keep-last", "0"], "--keep-last must be >= 1"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("async-ckpt: error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert main(["export", url, "10", str(tmp_path / "b.safetensors"), "--key", "nested"]) == 0
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "b.safetensors"))["b"].tolist() == [0, 1, 2, 3, 4]


def test_empty_root_and_bad_usage(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    assert main(["ls", str(tmp_path / "empty")]) == 0
    assert "no checkpoints under" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "empty")]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    assert main(["prune", str(tmp_path)]) == 2  # --keep-last or --keep-best: the subcommand's usage error
    err = capsys.readouterr().err
    assert err.startswith("usage: async-ckpt prune ") and "one of the arguments --keep-last --keep-best is required" in err


def test_damaged_marker_shows_in_ls_and_prune_leaves_it(tmp_path, capsys):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"x": torch.full((4,), float(s))})
    with open(f"{root}/2/manifest.json", "ab") as f:
        f.write(b" ")  # no longer what the marker vouches for
    assert main(["ls", root, "--json"]) == 0
    st = {e["step"]: e for e in json.loads(capsys.readouterr().out)["steps"]}
    assert st[2]["status"] == "damaged" and "marker" in st[2]["problem"]
    assert main(["prune", root, "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "skip (damaged)" in out
    assert sorted(n for n in os.listdir(root) if n.isdigit()) == ["2", "3"]


# ---- save statistics ---------------------------------------------------------------------------

def test_stats_log_local_appends_across_managers(good_dir, tmp_path):
    root, _ = good_dir
    records = read_stats_log(os.path.join(root, "save_stats.jsonl"))
    assert [r.step for r in records] == list(STEPS)
    for r in records:
        assert r.nbytes > 0 and r.files >= 2 and r.num_tensors > 0
        assert r.blocking_s >= r.stage_s >= 0 and r.write_s > 0 and r.durable_s is not None
        assert r.commit_time is not None
    # a second manager on the same root appends; a custom relative path works too
    root2 = str(tmp_path / "r2")
    for k in range(2):
        with CheckpointManager(root2, stats_log="logs/stats.jsonl") as mgr:
            mgr.save(k, {"x": torch.ones(3)})
            assert mgr.last_stats.step == k
    assert [r.step for r in read_stats_log(f"{root2}/logs/stats.jsonl")] == [0, 1]
    assert CheckpointManager(root2).all_steps() == [0, 1]  # the log's folder is not a step


def test_stats_log_object_store_rewrites_whole_file(memory_root):
    url = memory_root + "/run"
    seen = []
    for k in range(2):
        with CheckpointManager(url, stats_log=True, on_saved=seen.append) as mgr:
            mgr.save(2 * k, {"x": torch.ones(3)})
            mgr.save(2 * k + 1, {"x": torch.ones(3)})
    records = read_stats_log(url + "/save_stats.jsonl")
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert [r.to_dict() for r in records] == [s.to_dict() for s in seen]


def test_stats_log_rejects_bad_paths(tmp_path):
    for bad in ("/abs/path.jsonl", "../up.jsonl", "12/stats.jsonl", ".tmp-1-ab/x", "", "s3://b/x"):
        with pytest.raises(ValueError):
            CheckpointManager(str(tmp_path / "r"), stats_log=bad)
    with pytest.raises(TypeError):
        CheckpointManager(str(tmp_path / "r"), stats_log=3)


def test_save_stats_roundtrip_and_truncated_log(tmp_path):
    s = SaveStats(step=7, nbytes=2_000_000, num_tensors=3, files=2, blocking_s=0.01, stage_s=0.004,
                  write_s=0.5, durable_s=0.6, commit_time=1.5, extra={"k": 1})
    d = s.to_dict()
    assert d["host_copy_gbps"] == pytest.approx(0.5) and d["write_gbps"] == pytest.approx(0.004)
    assert SaveStats.from_dict(json.loads(s.to_json())) == s
    assert "write 500.0 ms (3.81 MiB/s)" in s.summary() and "1.9 MiB in 3 tensors" in s.summary()
    p = tmp_path / "log.jsonl"
    p.write_text(s.to_json() + "\n" + s.to_json()[:20])  # a crash mid-write leaves half a line
    assert [r.step for r in read_stats_log(str(p))] == [7]
    p.write_text("{}\n" + s.to_json() + "\n")
    with pytest.raises(ValueError, match="log.jsonl:1"):
        read_stats_log(str(p))


def test_stats_log_failure_never_fails_the_save(tmp_path):
    import logging

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("async_ckpt")
    logger.addHandler(handler)
    root = str(tmp_path / "r")
    try:
        with CheckpointManager(root, stats_log="stats.jsonl") as mgr:
            os.makedirs(f"{root}/stats.jsonl")  # now the log cannot be opened as a file
            mgr.save(1, {"x": torch.ones(2)})
    finally:
        logger.removeHandler(handler)
    assert mgr.all_steps() == [1]
    assert any("could not write the stats log" in r.getMessage() for r in records)
    assert isinstance(StatsLog.from_option(mgr.storage, None), type(None))


def test_storage_options_reach_fsspec(mem_root, capsys):
    from async_ckpt.cli.common import parse_options

    assert parse_options(["a=1", "b=x", 'c={"k": [2]}', "d=a=b"]) == {"a": 1, "b": "x", "c": {"k": [2]}, "d": "a=b"}
    url, _ = mem_root
    # a URL fsspec cannot open is a one-line error, not a traceback
    code = main(["ls", "nosuchprotocol://bucket/run"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("async-ckpt: error: ") and err.count("\n") == 1, err
    assert main(["ls", url, "-o", "bad"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_stats_command(good_dir, tmp_path, capsys):
    root, _ = good_dir
    assert main(["stats", root]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[0].splitlines()
    assert table[0].split()[:5] == ["STEP", "COMMITTED", "DATA", "FILES", "BLOCKED_MS"]
    assert [ln.split()[0] for ln in table[1:]] == [str(s) for s in STEPS]
    assert "3 saves; blocked median" in out and "; durable median " in out
    assert main(["stats", root, "--last", "1", "--json"]) == 0
    saves = json.loads(capsys.readouterr().out)["saves"]
    assert len(saves) == 1 and saves[0]["step"] == STEPS[-1] and saves[0]["nbytes"] > 0
    os.makedirs(tmp_path / "nolog")
    assert main(["stats", str(tmp_path / "nolog")]) == 2
    assert "stats_log=True" in capsys.readouterr().err


def test_ls_shows_commit_order_and_prune_refuses_under_a_live_writer(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    mgr = CheckpointManager(root)
    for s in (30, 10, 20):  # any order: commit order decides
        mgr.save(s, {"w": torch.full((4,), float(s))})
    assert main(["ls", root, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["commit_order"] == [30, 10, 20] and out["latest"] == 20
    assert main(["ls", root]) == 0
    text = capsys.readouterr().out
    assert "commit order (oldest first): 30, 10, 20\nnewest intact step (what restore(None) takes): 20 " in text
    assert main(["prune", root, "--keep-last", "1"]) == 2  # the training job holds the lease
    err = capsys.readouterr().err
    assert "live writer" in err and "pass --lease-timeout SECONDS to wait" in err and "lease_timeout=" not in err
    assert mgr.all_steps() == [10, 20, 30]
    mgr.close()
    assert main(["prune", root, "--keep-last", "1"]) == 0
    assert CheckpointManager(root).all_steps() == [20]  # the newest commit, not the highest step


def test_ls_and_verify_with_local_dir_show_another_job_s_copies_as_foreign(tmp_path, capsys):
    """Job B's bucket and a local_dir job A also used (A saved step 9 there later): ls marks
    A's copy FOREIGN, out of the commit order and latest; verify skips it."""
    import warnings

    bucket_a, bucket_b, local = (str(tmp_path / n) for n in ("a", "b", "local"))
    with CheckpointManager(bucket_b, save_interval=1, local_dir=local, local_policy=1, local_retention=5) as b:
        b.save(2, {"x": torch.ones(3) * 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with CheckpointManager(bucket_a, save_interval=100, local_dir=local, local_policy=1, local_retention=5) as a:
            a.save(9, {"x": torch.ones(3) * 9})
    assert main(["ls", bucket_b, "--local-dir", local, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["latest"] == 2 and report["commit_order"] == [2]
    assert {(e["step"], e["tier"]): e["status"] for e in report["steps"]} == {
        (2, "local"): "listed", (2, "persistent"): "listed", (9, "local"): "foreign"}
    assert main(["ls", bucket_b, "--local-dir", local]) == 0
    out = capsys.readouterr().out
    assert "FOREIGN" in out and "restore(None) takes): 2" in out
    assert f"note: 1 local copy saved for another checkpoint path than file://{tmp_path}/b/" in out
    assert main(["verify", bucket_b, "--local-dir", local, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["tier"]) for r in report["steps"]] == [(2, "local"), (2, "persistent")]
    assert report["skipped_foreign"] == [{"step": 9, "tier": "local", "saved_for": f"file://{tmp_path}/a/"}]
    assert main(["verify", bucket_b, "--all", "--local-dir", local]) == 0
    out = capsys.readouterr().out
    assert "step 9 (local): skipped" in out and "step 9 (local): ok" not in out


# ---- incremental saves: bytes written vs bytes taken from earlier steps -------------------------

def _incremental_root(root: str):
    """Steps 1, 2, 3 of an incremental manager: a large base that never changes (256 KiB, in a
    file of its own... shared from step 1 on) and a small part that changes at every save."""
    torch.manual_seed(0)
    base = torch.randn(256, 256)
    saved = {}
    with CheckpointManager(root, incremental=True) as mgr:
        for s in (1, 2, 3):
            sd = {"base": base, "head": torch.full((8, 8), float(s)), "step": s}
            saved[s] = clone_tree(sd)
            mgr.save(s, sd)
    return saved


def test_ls_show_verify_report_written_and_shared_bytes(tmp_path, capsys):
    root = str(tmp_path / "inc")
    saved = _incremental_root(root)
    layout = CheckpointManager(root).layout
    mans = {s: layout.read_manifest(s) for s in (1, 2, 3)}
    assert mans[1].referred_bytes == 0 and mans[2].referred_bytes > 256 * 256 * 4 > mans[2].written_bytes

    assert main(["ls", root, "--json"]) == 0
    steps = {e["step"]: e for e in json.loads(capsys.readouterr().out)["steps"]}
    for s, man in mans.items():
        assert (steps[s]["written_bytes"], steps[s]["referred_bytes"]) == (man.written_bytes, man.referred_bytes)
        assert steps[s]["bytes"] == man.written_bytes + man.referred_bytes
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[0].splitlines()
    assert table[0].split() == ["STEP", "ORDER", "COMMITTED", "SIZE", "WRITTEN", "SHARED", "FILES", "STATUS", "METRICS"]
    rows = {ln.split()[0]: re.split(r"\s{2,}", ln.strip()) for ln in table[1:]}  # cells: 2+ spaces apart
    for s, man in mans.items():  # SIZE, WRITTEN, SHARED
        assert rows[str(s)][3:6] == [human_bytes(v) for v in (man.written_bytes + man.referred_bytes,
                                                             man.written_bytes, man.referred_bytes)]
    assert rows["1"][5] == "0 B"
    assert "taken from earlier steps: on local paths hard links, stored once" in out

    assert main(["show", root, "3", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    refs = {n: r.ref for n, r in mans[3].files.items() if r.ref is not None}
    assert refs and all(r.startswith("1/") for r in refs.values())  # the bytes step 1 wrote, no chains
    assert shown["shared_files"] == {n: {"size": mans[3].files[n].size, "ref": r} for n, r in refs.items()}
    assert (shown["written_bytes"], shown["referred_bytes"]) == (mans[3].written_bytes, mans[3].referred_bytes)
    assert main(["show", root, "3"]) == 0
    out = capsys.readouterr().out
    assert f"incremental: {human_bytes(mans[3].written_bytes)} written" in out
    for n, r in refs.items():
        assert f"  {n}  {human_bytes(mans[3].files[n].size)}  first written as {r}" in out
    assert main(["show", root, "1"]) == 0
    assert "incremental:" not in capsys.readouterr().out  # step 1 wrote everything

    assert main(["verify", root, "--all", "--json"]) == 0
    results = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
    assert all(results[s]["ok"] and results[s]["referred_bytes"] == mans[s].referred_bytes for s in mans)
    assert main(["verify", root, "3"]) == 0
    assert capsys.readouterr().out.startswith(
        f"step 3: ok ({len(mans[3].files)} files, {human_bytes(sum(r.size for r in mans[3].files.values()))} read; "
        f"{human_bytes(mans[3].written_bytes)} written, {human_bytes(mans[3].referred_bytes)} taken from earlier steps)")

    # Deleting the step that first wrote the shared bytes removes a name only: the later steps
    # still verify, export and restore bitwise.
    assert main(["rm", root, "1"]) == 0
    capsys.readouterr()
    assert main(["verify", root, "--all"]) == 0
    assert capsys.readouterr().out.count(": ok (") == 2
    out_pt = str(tmp_path / "s3.pt")
    assert main(["export", root, "3", out_pt]) == 0
    assert_bitwise_equal(saved[3], torch.load(out_pt, weights_only=True))
    for s in (2, 3):
        target = {"base": torch.zeros(256, 256), "head": torch.zeros(8, 8), "step": 0}
        CheckpointManager(root).restore(s, target)
        assert_bitwise_equal(saved[s], target)


@pytest.mark.skipif("written_bytes" not in {f.name for f in dataclasses.fields(SaveStats)},
                    reason="SaveStats has no written_bytes/referred_bytes in this library version")
def test_stats_command_shows_written_and_shared_bytes(tmp_path, capsys):
    root = str(tmp_path / "inc")
    base = torch.randn(256, 256)
    with CheckpointManager(root, incremental=True, stats_log=True) as mgr:
        for s in (1, 2):
            mgr.save(s, {"base": base, "head": torch.full((8,), float(s))})
        stats = {st.step: st for st in mgr.stats}
    assert stats[2].referred_bytes > 256 * 256 * 4 > stats[2].written_bytes > 0
    assert main(["stats", root]) == 0
    table = capsys.readouterr().out.split("\n\n")[0].splitlines()
    assert table[0].split()[:6] == ["STEP", "COMMITTED", "DATA", "WRITTEN", "SHARED", "FILES"]
    rows = {ln.split()[0]: re.split(r"\s{2,}", ln.strip()) for ln in table[1:]}
    for s, st in stats.items():
        assert rows[str(s)][3:5] == [human_bytes(st.written_bytes), human_bytes(st.referred_bytes)]
    assert main(["stats", root, "--json"]) == 0
    logged = {r["step"]: r for r in json.loads(capsys.readouterr().out)["saves"]}
    assert {s: (r["written_bytes"], r["referred_bytes"]) for s, r in logged.items()} == {
        s: (st.written_bytes, st.referred_bytes) for s, st in stats.items()}


# ---- stats: tiers, rates, durable time, sparklines, --watch, --plot ------------------------------

def _tiered_run(tmp_path, steps=range(1, 7)):
    """A run with a local tier (every step) and the bucket (every 2nd), incremental (shared bytes),
    logged under the bucket (a local path: both tiers' saves are logged)."""
    bucket, local = str(tmp_path / "bucket"), str(tmp_path / "local")
    base = torch.randn(256, 256)
    with CheckpointManager(bucket, local_dir=local, local_policy=1, save_interval=2, stats_log=True,
                           incremental=True) as mgr:
        for s in steps:
            mgr.save(s, {"base": base, "head": torch.full((8,), float(s))})
    return bucket, local


def test_stats_table_names_the_tier_with_rates_in_units_and_durable_time(tmp_path, capsys, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="async_ckpt")
    bucket, _ = _tiered_run(tmp_path)
    msgs = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("saved step 2 to the local tier: ") for m in msgs), msgs
    assert any(m.startswith("saved step 2 to the persistent root: ") for m in msgs), msgs
    assert "deleted step 1 from the local tier (retention)" in msgs  # local_retention=2 by default
    assert not [m for m in msgs if m.startswith("async_ckpt")]  # the logger's name is the one prefix
    assert main(["stats", bucket]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[0].splitlines()
    assert table[0].split()[:3] == ["STEP", "TIER", "COMMITTED"] and "WRITE_RATE" in table[0]
    tiers = [(ln.split()[0], ln.split()[1]) for ln in table[1:]]
    assert sorted(tiers) == sorted([(str(s), "local") for s in range(1, 7)] + [(str(s), "persistent") for s in (2, 4, 6)])
    col = table[0].split().index("WRITE_RATE")
    rates = [re.split(r"\s{2,}", ln.strip())[col] for ln in table[1:]]  # in a unit that fits
    assert all(re.fullmatch(r"[1-9]\d*(\.\d\d)? (B|KiB|MiB|GiB|TiB)/s", r) for r in rates), rates
    summary = out.split("\n\n")[1]
    assert summary.startswith("6 saves (9 records: one per tier); blocked median ")
    assert "durable (local) median " in summary and "durable (persistent) median " in summary
    spark = [ln for ln in summary.splitlines() if ln.startswith(("blocked  ", "durable  "))]
    assert len(spark) == 3 and len(spark[0].split()[1]) == 6  # one character per save


def test_a_failed_save_is_logged_and_marked(tmp_path, capsys):
    """A local-tier save that fails (a full disk) goes to the stats log as failed, with its error."""
    bucket, local = str(tmp_path / "bucket"), f"faulty://{tmp_path}/local"
    mgr = CheckpointManager(bucket, local_dir=local, local_policy=1, save_interval=2, stats_log=True)
    try:
        mgr.save(1, {"w": torch.ones(64)})
        mgr.roots[0].store.storage.fs.inject("write", "*.distcp", "enospc", times=1)
        mgr.save_async(3, {"w": torch.ones(64)})
        with pytest.raises(CheckpointError, match="No space left"):
            mgr.join()
        mgr.save(4, {"w": torch.ones(64)})
    finally:
        mgr.close()
    logged = read_stats_log(f"{bucket}/save_stats.jsonl")
    failed = [r for r in logged if r.extra.get("failed")]
    assert [(r.step, r.extra["tier"]) for r in failed] == [(3, "local")] and "No space left" in failed[0].extra["failed"]
    assert failed[0].durable_s is None and failed[0].blocking_s > 0
    assert main(["stats", bucket]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("   3  local"))
    assert "FAILED: OSError" in row or "FAILED: " in row
    assert ", 1 failed" in out and "failed: 3" in out


def _png_size(path):
    import struct

    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def _has_color(img, hex_color, tol=0.02):
    import numpy as np

    want = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img[..., :3] - want).max(axis=-1) < tol).sum())


def test_stats_plot_of_a_real_run_is_a_picture_with_its_marks(tmp_path):
    import numpy as np

    mpimg = pytest.importorskip("matplotlib.image")
    from async_ckpt.cli.plot import DPI, FAILED_COLOR, FALLBACK_COLOR, FIGSIZE, SKIPPED_COLOR

    bucket, _ = _tiered_run(tmp_path)
    out = str(tmp_path / "run.png")
    proc = run_cli("stats", bucket, "--plot", out)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (1000 x 640 px)" in proc.stdout
    assert _png_size(out) == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI)) == (1000, 640)
    img = mpimg.imread(out)
    ink = (img[..., :3].min(axis=-1) < 0.9).mean()
    assert 0.05 < ink < 0.9, ink  # not blank, not a solid block
    assert len(np.unique((img[..., :3] * 15).round().reshape(-1, 3), axis=0)) > 8  # lines, bars, text in colours
    assert not any(_has_color(img, c) for c in (SKIPPED_COLOR, FALLBACK_COLOR, FAILED_COLOR))  # nothing to mark
    # the same run with a skipped upload, a fallback and a failed save: each drawn as a mark
    log = f"{bucket}/save_stats.jsonl"
    records = read_stats_log(log)
    marked = {5: {"upload_skipped": True}, 3: {"fallback": True}}
    with open(log, "w") as f:
        for r in records:
            extra = {**r.extra, **marked.get(r.step, {})} if r.extra.get("tier") == "local" else r.extra
            f.write(dataclasses.replace(r, extra=extra).to_json() + "\n")
        f.write(dataclasses.replace(records[-1], step=7, durable_s=None, commit_time=None,
                                    extra={"tier": "local", "failed": "OSError: [Errno 28] No space left"}).to_json() + "\n")
    proc = run_cli("stats", bucket, "--plot", out)
    assert proc.returncode == 0, proc.stderr
    assert "uploads skipped: 5; fell back to the local tier: 3; failed: 7" in proc.stdout
    img = mpimg.imread(out)
    for c in (SKIPPED_COLOR, FALLBACK_COLOR, FAILED_COLOR):
        assert _has_color(img, c) > 100, c


def test_stats_watch_reprints_as_saves_come_until_ctrl_c(tmp_path):
    import signal
    import time

    root = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "-m", "async_ckpt", "stats", root, "--watch", "0.3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PJRT_DEVICE": "CPU"})
    import threading

    chunks = []
    threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        step = 0
        with CheckpointManager(root, stats_log=True) as mgr:
            while time.monotonic() < deadline and "\n   2  " not in "".join(chunks):
                seen = "".join(chunks)
                if ("waiting for the stats log" in seen and step == 0) or ("\n   1  " in seen and step == 1):
                    step += 1
                    mgr.save(step, {"w": torch.full((4,), float(step))})
                time.sleep(0.1)
        seen = "".join(chunks)
        assert "waiting for the stats log" in seen and "\n   1  " in seen and "\n   2  " in seen, seen
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_stats_plot_legend_covers_no_bar(tmp_path):
    """Equal bars: each is drawn whole (the legend used to lie over the newest ones)."""
    np = pytest.importorskip("numpy")
    mpimg = pytest.importorskip("matplotlib.image")
    from async_ckpt.cli.plot import plot_run

    recs = [SaveStats(step=s, nbytes=2**20, written_bytes=2**20, blocking_s=0.01, stage_s=0.001, write_s=0.1,
                      durable_s=0.2, commit_time=float(s)) for s in range(10, 110, 10)]
    out = str(tmp_path / "p.png")
    plot_run(recs, out, "run")
    img = mpimg.imread(out)[..., :3]
    blue = np.all(np.abs(img - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.02, axis=-1)[int(img.shape[0] * 0.55):]
    cols = blue.sum(axis=0)
    heights, start = [], None
    for x, on in enumerate(list(cols > 5) + [False]):
        if on and start is None:
            start = x
        elif not on and start is not None:
            if x - start > 3 and cols[(start + x) // 2] > 50:  # a bar, not the legend's handle
                heights.append(int(cols[(start + x) // 2]))
            start = None
    assert len(heights) >= 10 and len(set(heights)) == 1, heights
