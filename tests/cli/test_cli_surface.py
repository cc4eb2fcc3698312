"""The ``async-ckpt`` command's user surface: one-line (or JSON) errors without tracebacks, a
bounded wait on an unreachable bucket, ``rm``, ``--lease-timeout``, ``export``'s ``--force``,
``-o`` and progress bar, what ``ls`` calls latest, and the checkpoints of other kinds it names."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.cli import main

from ..conftest import assert_bitwise_equal, clone_tree, data_files, flip_data_byte, small_state, target_like
from ..support.paths import REPO

ROOT_DIR = REPO


def _root(tmp_path, steps=(1, 2, 3), name="ckpt"):
    root = str(tmp_path / name)
    saved = {}
    with CheckpointManager(root) as mgr:
        for s in steps:
            saved[s] = clone_tree(small_state(s))
            mgr.save(s, small_state(s))
    return root, saved


def cli(*args: str, env=None, timeout: float = 300, **kw):
    full_env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": ROOT_DIR, **(env or {})}
    return subprocess.run([sys.executable, "-m", "async_ckpt", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, **kw)


def _one_line(proc, code=2):
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("async-ckpt: error: "), proc.stderr
    return lines[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the socket is: connections are refused


# ---- errors: one line, JSON with --json, no traceback, the subcommand's usage ------------------

def test_unreachable_bucket_is_one_line_within_the_connect_timeout():
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{_closed_port()}", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    t0 = time.monotonic()
    proc = cli("ls", "gs://no-such-bucket/run", "--connect-timeout", "2", env=env, timeout=120)
    elapsed = time.monotonic() - t0
    line = _one_line(proc)
    assert "checkpoint path gs://no-such-bucket/run cannot be reached: the endpoint " in line
    assert "refuses connections" in line
    assert "pass --connect-timeout SECONDS (now 2 s)" in line and "RetryPolicy" not in line
    assert elapsed < 60, elapsed  # gcsfs alone retries a refused connection for minutes
    # the same endpoint given as a storage option, --json: one JSON object on stdout
    proc = cli("verify", "gs://no-such-bucket/run", "--json", "--connect-timeout", "2",
               "-o", f"endpoint_url=http://127.0.0.1:{_closed_port()}", "-o", "token=anon",
               env={"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}, timeout=120)
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr
    err = json.loads(proc.stdout)["error"]
    assert err["type"] == "StorageUnreachableError" and err["exit_code"] == 2


def test_a_storage_client_error_is_one_line_not_unexpected(tmp_path):
    """botocore's errors are async_ckpt's StorageError: one line, never "please report it"."""
    for path in ("s3://bucket/run", "gs://bucket/run"):
        proc = cli("ls", path, "-o", "endpoint_url=http://nonexistent.invalid", "-o", "key=k", "-o", "secret=s",
                   *(["-o", "token=anon"] if path.startswith("gs") else []),
                   env={"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}, timeout=120)
        line = _one_line(proc)
        assert "unexpected" not in line and "please report" not in line, line
        assert "host nonexistent.invalid does not resolve" in line, line


def test_a_url_with_one_slash_is_refused(tmp_path):
    proc = cli("ls", "gs:/bucket/run", cwd=str(tmp_path))
    line = _one_line(proc)
    assert "did you mean 'gs://bucket/run'?" in line


def test_json_errors_are_json_objects(tmp_path):
    root, _ = _root(tmp_path, steps=(1,))
    for args, kind in ((["ls", str(tmp_path / "missing")], "FileNotFoundError"),
                       (["show", root, "7"], "StepNotFoundError"),
                       (["prune", root, "--keep-last", "0"], "ValueError"),
                       (["ls", root, "--bogus"], "UsageError")):
        proc = cli(*args, "--json")
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr == "", (args, proc.stderr)
        err = json.loads(proc.stdout)["error"]
        assert err["type"] == kind and err["exit_code"] == 2 and err["message"], (args, err)
    assert "usage: async-ckpt ls" in err["usage"]


def test_a_mistyped_option_prints_the_subcommand_usage(tmp_path):
    root, _ = _root(tmp_path, steps=(1,))
    proc = cli("prune", root, "--keep-last", "1", "--dry-rnu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("usage: async-ckpt prune "), proc.stderr
    assert "async-ckpt prune: error: unrecognized arguments: --dry-rnu" in proc.stderr
    assert os.listdir(root).count("1") == 1  # nothing deleted


def test_bad_input_never_prints_a_traceback(tmp_path):
    root, _ = _root(tmp_path, steps=(1, 2))
    missing = str(tmp_path / "nope")
    cases = [("show", missing), ("verify", root, "x"), ("export", root, "99", str(tmp_path / "o.pt")),
             ("stats", missing), ("rm", root, "-3"), ("ls", "nosuchproto://x/y"),
             ("show", root, "latest", "-o", "nonsense"), ("ls", str(tmp_path / "ckpt" / "1" / "manifest.json"))]
    for args in cases:
        _one_line(cli(*args))
    # denied writes (a read-only filesystem: root passes every permission check): rm, prune, export
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(ro)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        shutil.copytree(root, str(ro / "ckpt"))
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        for args in (("rm", str(ro / "ckpt"), "1"), ("prune", str(ro / "ckpt"), "--keep-last", "1"),
                     ("export", root, "1", str(ro / "out.pt"))):
            line = _one_line(cli(*args))
            assert "Read-only file system" in line or "not writable" in line, line
        assert sorted(n for n in os.listdir(ro / "ckpt") if n.isdigit()) == ["1", "2"]
    finally:
        subprocess.run(["umount", str(ro)], check=True)


# ---- ls: latest, plain DCP, other kinds of checkpoint ----------------------------------------

def test_ls_latest_is_the_step_restore_none_takes(tmp_path, capsys):
    root, saved = _root(tmp_path)
    with open(data_files(f"{root}/3")[0], "r+b") as f:  # the newest commit: a data file cut short
        f.truncate(10)
    assert main(["ls", root, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["commit_order"] == [1, 2, 3] and out["latest"] == 2 and out["newer_damaged"] == [3]
    assert main(["ls", root]) == 0
    text = capsys.readouterr().out
    row3 = next(line for line in text.splitlines() if line.strip().startswith("3 "))
    assert "latest" not in row3 and "DAMAGED" in row3
    assert any(line.strip().startswith("2  2 latest") for line in text.splitlines()), text
    assert "newest intact step (what restore(None) takes): 2 (by ls's checks, contents not read: ls --verify or " \
           "verify checksums it); newer, damaged, skipped: 3" in text
    for args in (["show", root], ["show", root, "latest"]):  # latest: what restore(None) takes, as ls says
        assert main(args) == 0
        text = capsys.readouterr().out
        assert text.startswith("step 2 "), text
        assert "newest intact step (what restore(None) takes): 2 (by its files' sizes, contents not read: ls " \
               "--verify or verify checksums it); newer, damaged, skipped: 3" in text
    assert main(["show", root, "latest", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 2 and out["newer_damaged"] == [3]
    target = target_like(small_state(0))
    with CheckpointManager(root) as mgr:
        assert mgr.restore(None, target) == 2
    assert_bitwise_equal(target, saved[2])


def test_which_step_is_safe_ls_verify_export_name_the_newest_intact_step(tmp_path):
    """A job died; its newest step (800) has a flipped byte (sizes intact: only a checksum
    tells). Every command names the step restore(None) takes, 700, and marks 800."""
    root, saved = _root(tmp_path, steps=(600, 700, 800))
    flip_data_byte(f"{root}/800")
    proc = cli("ls", root)  # reads no data: names 800, and says its contents were not read
    assert proc.returncode == 0, proc.stderr
    assert ("newest intact step (what restore(None) takes): 800 (by ls's checks, contents not read: ls --verify or "
            "verify checksums it)") in proc.stdout
    proc = cli("ls", root, "--verify")
    assert proc.returncode == 1, proc.stderr  # verify's exit rule: a step it read on the way is damaged
    rows = {line.split()[0]: line for line in proc.stdout.split("\n\n")[0].splitlines()[1:]}
    assert "DAMAGED" in rows["800"] and " verified " in rows["700"] and "latest" in rows["700"]
    assert " listed " in rows["600"]  # older: not read (restore(None) stops at 700)
    assert "newest intact step (what restore(None) takes): 700; newer, damaged, skipped: 800" in proc.stdout
    assert "step 800 (800): damaged: __0_0.distcp: checksum mismatch" in proc.stdout
    proc = cli("verify", root)  # as restore(None) reads: 800 fails, 700 verifies, 600 is not needed
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("step 800: DAMAGED")
    assert "step 700: ok" in proc.stdout and "step 600" not in proc.stdout
    assert proc.stdout.splitlines()[-1] == "newest intact step (what restore(None) takes): 700; newer, damaged, skipped: 800"
    proc = cli("verify", root, "--all", "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["newest_intact"] == 700 and out["newer_damaged"] == [800]
    out_file = str(tmp_path / "latest.pt")
    proc = cli("export", root, "latest", out_file)  # the step restore(None) takes, and it says which
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("exported step 700 ") and "newer, damaged, skipped: 800" in proc.stdout
    assert "async-ckpt: warning: skipping damaged step 800" in proc.stderr and "checksum mismatch" in proc.stderr
    assert_bitwise_equal(torch.load(out_file, weights_only=True), saved[700])
    proc = cli("export", root, "latest", str(tmp_path / "nope.pt"), "--key", "nope")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "warning: skipping damaged step 800" in proc.stderr  # the step it read is named, not 800
    assert proc.stderr.strip().splitlines()[-1] == ("async-ckpt: error: step 700 has no entry 'nope' (top-level "
                                                    "keys: w, b, opt)"), proc.stderr
    target = target_like(small_state(0))
    with CheckpointManager(root) as mgr:
        assert mgr.restore(None, target) == 700  # what every command named
    proc = cli("export", root, "800", str(tmp_path / "800.pt"))  # named: an error naming the step
    line = _one_line(proc, code=1)
    assert line.startswith("async-ckpt: error: step 800: ") and "checksum mismatch" in line
    assert f"`async-ckpt verify {root}` names the newest intact step" in line
    proc = cli("show", root, "800", "--json")
    assert proc.returncode == 0  # show reads only the metadata, which is intact


def test_ls_of_a_step_directory_or_a_parent_of_roots_says_what_to_pass(tmp_path):
    """The manager's diagnosis of a path, in the command: a step directory is not a DCP
    checkpoint of another kind, and the parent of roots names one of them."""
    root, _ = _root(tmp_path / "runs", steps=(700,), name="run1")
    proc = cli("ls", f"{root}/700")
    assert proc.returncode == 0, proc.stderr
    assert "not written by async_ckpt" not in proc.stdout
    assert (f"{root}/700 looks like one step's directory (it holds manifest.json and COMMITTED): pass the "
            f"checkpoint root, its parent {root}, instead") in proc.stdout
    proc = cli("ls", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    assert f"looks like the parent of checkpoint roots; pass one of them (e.g. {root})" in proc.stdout
    proc = cli("verify", f"{root}/700")
    line = _one_line(proc)
    assert "no committed checkpoint under" in line and f"pass the checkpoint root, its parent {root}, instead" in line
    with pytest.warns(UserWarning, match="looks like one step's directory"):  # the manager: the same words
        CheckpointManager(f"{root}/700")


def test_ls_points_a_plain_dcp_checkpoint_at_the_migration_guide(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    root, _ = _root(tmp_path, steps=(1,))
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(3)}, checkpoint_id=f"{root}/7")
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "step 7 (7): foreign: a torch.distributed.checkpoint (DCP) checkpoint not written by async_ckpt" in out
    assert "see docs/migration.md" in out
    assert os.path.isdir(f"{root}/7")  # left alone


def test_ls_and_verify_name_lightning_and_hf_checkpoints(tmp_path, capsys):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    try:  # what async_ckpt.integrations.lightning writes: a torch.save file, renamed into place
        from async_ckpt.integrations.lightning import AsyncCkptIO

        io = AsyncCkptIO()
        io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 4}, str(out_dir / "last.ckpt"))
        io.teardown()
    except ImportError:
        torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 4}, str(out_dir / "last.ckpt"))
    for n in (10, 20):  # HF Trainer's layout (what the AsyncCkptCallback writes, renamed into place)
        (out_dir / f"checkpoint-{n}").mkdir()
        (out_dir / f"checkpoint-{n}" / "trainer_state.json").write_text(json.dumps({"global_step": n}))
    (out_dir / ".checkpoint-30.async-ckpt-tmp").mkdir()  # in flight: not a checkpoint
    assert main(["ls", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert f"no checkpoints under {out_dir}" in out
    assert "found last.ckpt: Lightning checkpoint files" in out and "torch.load(FILE, weights_only=False)" in out
    assert "found checkpoint-10, checkpoint-20: Hugging Face Trainer checkpoint directories" in out
    assert "checkpoint-30" not in out
    assert main(["ls", str(out_dir), "--json"]) == 0
    kinds = {r["kind"]: r["names"] for r in json.loads(capsys.readouterr().out)["other_checkpoints"]}
    assert kinds == {"lightning": ["last.ckpt"], "huggingface": ["checkpoint-10", "checkpoint-20"]}
    assert main(["verify", str(out_dir)]) == 2
    err = capsys.readouterr().err
    assert "no committed checkpoint under" in err and "found last.ckpt" in err and "found checkpoint-10" in err
    assert main(["ls", str(out_dir / "last.ckpt")]) == 2
    assert "last.ckpt is a Lightning checkpoint file" in capsys.readouterr().err


# ---- prune: metrics, --keep-best, the job's own retention ------------------------------------

def _steps(root):
    return sorted(int(n) for n in os.listdir(root) if n.isdigit())


def test_prune_keeps_what_the_job_s_own_retention_keeps_unless_forced(tmp_path):
    """A KeepBest(3, "val_loss") job: `prune --keep-last 1` used to delete its best step."""
    from async_ckpt import KeepBest

    root = str(tmp_path / "ckpt")
    losses = {100: 0.9, 200: 0.1, 300: 0.5, 400: 0.3, 500: 0.7}
    with CheckpointManager(root, retention=KeepBest(3, "val_loss")) as mgr:
        for s, v in losses.items():
            mgr.save(s, small_state(s), metrics={"val_loss": v})
    assert _steps(root) == [200, 300, 400, 500]  # the 3 best, and the newest (always kept)
    proc = cli("prune", root, "--keep-last", "1", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.splitlines()
    assert table[0].split() == ["STEP", "COMMITTED", "DATA", "METRICS", "ACTION"]
    rows = {line.split()[0]: line for line in table[1:5]}
    assert "val_loss=0.1" in rows["200"] and rows["200"].endswith("keep (job's retention)")
    assert rows["500"].endswith("keep") and "would delete" not in proc.stdout
    assert ("kept 3 step(s) the job's own retention (KeepBest(n=3, metric='val_loss', mode='min', missing='keep')) "
            "keeps: 200, 300, 400; pass --force to delete them too") in proc.stdout
    assert cli("prune", root, "--keep-last", "1").returncode == 0
    assert _steps(root) == [200, 300, 400, 500]  # nothing the job keeps was deleted
    proc = cli("prune", root, "--keep-best", "1", "--metric", "val_loss", "--force")
    assert proc.returncode == 0, proc.stderr
    assert "--force: deleted 2 step(s) the job's own retention" in proc.stdout
    assert _steps(root) == [200, 500]  # the best, and the newest intact commit
    line = _one_line(cli("prune", root, "--keep-best", "1", "--metric", "val_los"))
    assert "no committed step recorded the metric 'val_los' (the steps' metrics: val_loss)" in line
    line = _one_line(cli("prune", root, "--keep-best", "1"))
    assert "--keep-best needs --metric NAME" in line
    proc = cli("prune", root, "--keep-best", "1", "--metric", "val_loss", "--mode", "max", "--dry-run", "--json")
    out = json.loads(proc.stdout)
    assert out["deleted"] == [] and out["kept_for_job_retention"] == [200]  # max: 500 is the best; 200 the job's
    assert out["job_retention"] == {"policy": "KeepBest", "n": 3, "metric": "val_loss", "mode": "min",
                                    "missing": "keep"}


def test_prune_under_a_custom_retention_deletes_nothing_without_force(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root, retention=lambda cks: {c.step for c in cks if c.step % 2}) as mgr:
        for s in (1, 3, 5):
            mgr.save(s, small_state(s))
    assert main(["prune", root, "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "a custom policy, retention(<lambda>), whose choices cannot be known here" in out
    assert _steps(root) == [1, 3, 5]
    assert main(["prune", root, "--keep-last", "1", "--force"]) == 0
    assert _steps(root) == [5]
    with CheckpointManager(root) as mgr:  # the default (keep all) records no retention: prune decides
        mgr.save(7, small_state(7))
    assert main(["prune", root, "--keep-last", "1"]) == 0
    assert _steps(root) == [7]


# ---- verify / export: progress, --force, -o for OUT ------------------------------------------

def test_verify_progress_without_tqdm_says_how_to_get_it(tmp_path):
    root, _ = _root(tmp_path, steps=(1,))
    blocker = tmp_path / "no_tqdm" / "tqdm"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('tqdm is not installed (test)')\n")
    proc = cli("verify", root, "--progress", env={"PYTHONPATH": f"{blocker.parent}{os.pathsep}{ROOT_DIR}"})
    assert proc.returncode == 0, proc.stderr
    assert "step 1: ok" in proc.stdout
    assert "--progress needs tqdm" in proc.stderr and "pip install tqdm" in proc.stderr
    proc = cli("verify", root, "--no-progress", env={"PYTHONPATH": f"{blocker.parent}{os.pathsep}{ROOT_DIR}"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_export_refuses_an_existing_out_without_force(tmp_path, capsys):
    root, saved = _root(tmp_path, steps=(1, 2))
    out = tmp_path / "model.pt"
    out.write_bytes(b"precious")
    assert main(["export", root, "2", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"async-ckpt: error: OUT {out} already exists: pass --force to overwrite it"
    assert out.read_bytes() == b"precious"
    assert main(["export", root, "2", str(out), "--force"]) == 0
    assert_bitwise_equal(torch.load(str(out), weights_only=True), saved[2])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("model.pt")] == ["model.pt"]


def test_export_shows_a_progress_bar(tmp_path):
    pytest.importorskip("tqdm")
    root, saved = _root(tmp_path, steps=(1,))
    proc = cli("export", root, "1", str(tmp_path / "o.pt"), "--progress")
    assert proc.returncode == 0, proc.stderr
    assert "export step 1" in proc.stderr and "Traceback" not in proc.stderr
    assert_bitwise_equal(torch.load(str(tmp_path / "o.pt"), weights_only=True), saved[1])


def test_export_to_a_bucket_uses_the_storage_options(s3_bucket, capsys):
    opts = s3_bucket.storage_options
    with CheckpointManager(s3_bucket.url, storage_options=opts) as mgr:
        mgr.save(5, small_state(5))
    out = f"{s3_bucket.url}-export/model.pt"
    args = ["export", s3_bucket.url, "latest", out] + [a for k, v in opts.items() for a in ("-o", f"{k}={json.dumps(v)}")]
    assert main(args) == 0, capsys.readouterr().err
    fs = s3_bucket.fs()
    with fs.open(out, "rb") as f:
        got = torch.load(f, weights_only=True)
    assert_bitwise_equal(got, small_state(5))
    assert main(args) == 2  # the bucket's OUT exists too: refused without --force
    assert "already exists: pass --force" in capsys.readouterr().err


# ---- promote, rm, --lease-timeout --------------------------------------------------------------

def test_promote_that_fails_its_checks_has_no_side_effects(tmp_path, capsys):
    root, _ = _root(tmp_path, steps=(1,))
    stale = f"{root}/.tmp-9-0123456789ab"  # an incomplete save a writer's first write would clean up
    os.makedirs(stale)
    missing = tmp_path / "local"
    assert main(["promote", root, "1", "--local-dir", str(missing)]) == 2
    assert "no such local checkpoint directory" in capsys.readouterr().err
    assert not missing.exists() and os.path.isdir(stale)
    lroot, _ = _root(tmp_path, steps=(4,), name="tier")
    assert main(["promote", root, "5", "--local-dir", lroot]) == 2
    assert "holds no committed step 5 (committed there: 4)" in capsys.readouterr().err
    assert main(["promote", root, "1", "--local-dir", lroot]) == 2
    assert "holds no committed step 1" in capsys.readouterr().err
    assert os.path.isdir(stale) and sorted(os.listdir(root)).count("1") == 1


def test_rm_deletes_steps_through_the_manager(tmp_path, capsys):
    root, saved = _root(tmp_path, steps=(1, 2, 3, 4))
    assert main(["rm", root, "2", "9"]) == 2  # one is not committed: nothing is deleted
    assert "no committed checkpoint for step 9" in capsys.readouterr().err
    assert main(["rm", root, "2", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == [2, 3]
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1, 4]
        for s in (1, 4):
            target = target_like(small_state(0))
            mgr.restore(s, target)
            assert_bitwise_equal(target, saved[s])
    assert main(["rm", root, "x"]) == 2
    assert "STEP must be a non-negative integer" in capsys.readouterr().err


WRITER = """
import sys, time, torch
from async_ckpt import CheckpointManager
mgr = CheckpointManager(sys.argv[1])
mgr.save(7, {"w": torch.ones(4)})  # takes the writer lease, held until the process exits
print("ready", flush=True)
sys.stdin.readline()
"""


def test_rm_and_prune_wait_lease_timeout_then_refuse(tmp_path):
    root, _ = _root(tmp_path, steps=(1, 2))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": ROOT_DIR, "PJRT_DEVICE": "CPU"})
    try:
        assert writer.stdout.readline().strip() == "ready"
        for args in (["rm", root, "1"], ["prune", root, "--keep-last", "1"]):
            t0 = time.monotonic()
            proc = cli(*args, "--lease-timeout", "1.5", "--json")
            assert proc.returncode == 2, proc.stderr
            err = json.loads(proc.stdout)["error"]
            assert err["type"] == "LeaseHeldError" and "pass --lease-timeout SECONDS to wait" in err["message"]
            assert time.monotonic() - t0 >= 1.5
        assert sorted(n for n in os.listdir(root) if n.isdigit()) == ["1", "2", "7"]  # nothing deleted
    finally:
        writer.communicate("\n", timeout=60)
    proc = cli("rm", root, "1", "--lease-timeout", "5")
    assert proc.returncode == 0, proc.stderr
    assert sorted(n for n in os.listdir(root) if n.isdigit()) == ["2", "7"]


def test_incomplete_steps_are_removed_by_rm_incomplete_only_while_no_writer_holds_the_lease(tmp_path):
    root, saved = _root(tmp_path, steps=(1, 2))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": ROOT_DIR, "PJRT_DEVICE": "CPU"})
    stale = f"{root}/.tmp-6-0123456789ab"  # a killed save's directory (made after the writer's clean-up)
    try:
        assert writer.stdout.readline().strip() == "ready"
        os.makedirs(stale)
        open(f"{stale}/__0_0.distcp", "wb").write(b"x" * 10)
        proc = cli("ls", root)
        assert proc.returncode == 0, proc.stderr
        host = socket.gethostname()
        assert (f"incomplete: the writer lease is held by pid {writer.pid} on {host}, which is running: a save may "
                f"be in progress; `async-ckpt rm {root} --incomplete` deletes the steps that never committed "
                f"(refused while a writer holds the lease)") in proc.stdout
        assert json.loads(cli("ls", root, "--json").stdout)["writer_lease"]["live"] is True
        proc = cli("rm", root, "--incomplete")
        assert "has a live writer" in _one_line(proc)
        assert os.path.isdir(stale)
    finally:
        writer.communicate("\n", timeout=60)
    proc = cli("ls", root)
    assert (f"incomplete: the writer lease is free (last held by pid {writer.pid} on {socket.gethostname()}, "
            f"no longer running): no save is in progress") in proc.stdout
    # by name: refused, naming the command that removes it
    line = _one_line(cli("rm", root, "6"))
    assert (f"step(s) 6 never committed (incomplete): `async-ckpt rm {root} --incomplete` deletes the steps that "
            f"never committed; nothing deleted") in line
    # rm of another step deletes that step only
    proc = cli("rm", root, "7")
    assert proc.returncode == 0, proc.stderr
    assert os.path.isdir(stale)
    proc = cli("rm", root, "--incomplete")
    assert proc.returncode == 0, proc.stderr
    assert f"deleted 1 incomplete step directory from {root}: .tmp-6-0123456789ab" in proc.stdout
    assert not os.path.exists(stale)
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1, 2]
        target = target_like(small_state(0))
        mgr.restore(2, target)
        assert_bitwise_equal(target, saved[2])
    assert "give the STEPs to delete, or --incomplete" in cli("rm", root).stderr


def test_the_safetensors_refusal_suggests_keys_the_step_has(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"net": {"w": torch.ones(2)}, "optim": {"lr": 0.1, "m": torch.zeros(2)}, "step": 1})
    assert main(["export", root, "1", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert ("safetensors holds tensors only, but step 1 also has 2 other entries (optim.lr, step); export to "
            ".pt, or pick a tensors-only subtree with --key (--key net)") in err, err
    assert "--key model" not in err
    assert main(["export", root, "1", str(tmp_path / "n.safetensors"), "--key", "net"]) == 0
    assert "exported step 1 (1 tensor, " in capsys.readouterr().out
