"""The GPU check of issue 29 must not rot while no GPU is lent: CPU dry runs of
benchmarks/bench_cuda.py and benchmarks/gpu_check.sh, as subprocesses.

No timing assertions (CPU numbers mean nothing here): only that every section runs, every field
of the JSON is there with sane numbers, the restored values are bitwise equal, nothing is left
behind, and gpu_check.sh degrades (exit 0, says why) when async_ckpt's crc32c is missing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from ..support.paths import REPO

ROOT = REPO
BENCH = os.path.join(ROOT, "benchmarks", "bench_cuda.py")
CHECK = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
RATIOS = {
    "stall: save_async / floor",
    "stall: dcp.async_save (pinned DefaultStager) / floor",
    "stall: save_async / dcp.async_save",
    "durable: save_async+join / dcp.async_save+result",
    "step time: with lazy save_async / without",
    "step time: with eager save_async / without",
    "restore into device tensors / raw readinto pinned + non_blocking H2D",
}
FILES = {"env.log", "cuda_tests.log", "bench_cuda.json", "bench_cuda.log", "gpu_check.json"}

needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _check_stats(s, n_min: int, where: str) -> None:
    assert set(s) >= {"median_s", "min_s", "max_s", "samples_s", "n"}, where
    assert s["n"] == len(s["samples_s"]) >= n_min, where
    assert all(_positive(v) for v in s["samples_s"]), where
    assert s["min_s"] <= s["median_s"] <= s["max_s"], where
    assert s["min_s"] == min(s["samples_s"]) and s["max_s"] == max(s["samples_s"]), where


def _check_report(report, samples: int) -> None:
    assert report["complete"] is True and report["skipped"] == {} and report["errors"] == {}
    assert report["config"]["device"] == "cpu" and report["machine"]["device"] == "cpu"
    for key in ("torch", "cuda", "cuda_available", "python", "async_ckpt"):
        assert key in report["machine"], key
    assert report["state"]["bytes"] > 7 * 2**20 and report["state"]["tensors"] > 10
    res = report["results"]
    assert set(res) == {"stall", "dcp_stall", "durable", "lazy", "restore"}
    for k in ("floor", "save_async", "durable", "stage_s"):
        _check_stats(res["stall"][k], samples, f"stall.{k}")
    for k in ("floor", "async_save", "durable"):
        _check_stats(res["dcp_stall"][k], samples, f"dcp_stall.{k}")
    assert "DefaultStager" in res["dcp_stall"]["stager"]
    assert res["durable"]["save_async_join"] == res["stall"]["durable"]
    assert res["durable"]["dcp_async_save_result"] == res["dcp_stall"]["durable"]
    for k in ("stall", "dcp_stall"):
        for (stall, _floor), durable in zip(res[k]["pairs"], res[k]["durables"]):
            assert durable >= stall, k
    for mode in ("lazy", "eager"):
        for k in ("step_without_save", "step_with_save"):
            _check_stats(res["lazy"][mode][k], samples, f"lazy.{mode}.{k}")
    assert res["lazy"]["lazy_snapshot_bitwise_equal"] is True
    assert _positive(res["lazy"]["state_bytes"]) and _positive(res["lazy"]["params"])
    for k in ("restore", "raw_read_h2d"):
        _check_stats(res["restore"][k], samples, f"restore.{k}")
    assert res["restore"]["bitwise_equal"] is True and res["restore"]["targets_on_device"] is True
    assert {r["name"] for r in report["ratios"]} == RATIOS
    for r in report["ratios"]:
        assert _positive(r["median"]) and r["min"] <= r["median"] <= r["max"], r["name"]
        assert len(r["samples"]) >= samples, r["name"]


def test_bench_cuda_dry_run_writes_every_field(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, BENCH, "--dry-run", "--out", str(out), "--dir", str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_cuda.json").read_text())
    _check_report(report, samples=2)
    assert report["config"]["size_mb"] == 8 and report["config"]["dry_run"] is True
    assert not list(work.iterdir()), "the benchmark left files behind"
    assert "| ratio (median of paired samples) |" in proc.stdout


def test_bench_cuda_refuses_cuda_without_a_gpu(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    proc = subprocess.run([sys.executable, BENCH, "--device", "cuda", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr
    assert not list(tmp_path.iterdir())


def _run_check(tmp_path, extra_env=None):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", OUT=str(out), PYTHON=sys.executable, TMPDIR=str(tmp_path),
               PJRT_DEVICE="CPU")
    env.pop("PYTHONPATH", None)
    env.update(extra_env or {})
    proc = subprocess.run(["bash", CHECK], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=500)
    return proc, out


@needs_bash
def test_gpu_check_dry_run(tmp_path):
    proc, out = _run_check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == FILES  # at most 8 files come back from $OUT
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary == {**summary, "tests_rc": 0, "bench_rc": 0, "dry_run": True, "async_ckpt_importable": True,
                       "rc": 0}
    tests = (out / "cuda_tests.log").read_text()
    assert "skipped" in tests and "failed" not in tests and "error" not in tests.lower()
    assert tests.count("SKIPPED") >= 4  # test_cuda.py's and the cuda tests of the other files
    env_log = (out / "env.log").read_text()
    assert "torch " in env_log and f"async_ckpt 0.1.0 {ROOT}" in env_log
    _check_report(json.loads((out / "bench_cuda.json").read_text()), samples=2)
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "temporary files left behind"


@needs_bash
def test_gpu_check_degrades_without_crc32c(tmp_path):
    """The image lacks crc32c; without a carried wheel async_ckpt cannot be imported: the tests
    are skipped, the references are still measured, and the summary says why (exit 0)."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "crc32c.py").write_text("raise ImportError('No module named crc32c (simulated)')\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    proc, out = _run_check(tmp_path, {"PYTHONPATH": str(fake), "GPU_CHECK_WHEELS": str(wheels)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["async_ckpt_importable"] is False and summary["tests_rc"] == "skipped"
    assert any("gpu_prepare.sh" in n for n in summary["notes"]), summary["notes"]
    report = json.loads((out / "bench_cuda.json").read_text())
    assert report["complete"] is True and set(report["skipped"]) == {"stall", "lazy", "restore"}
    assert all("crc32c" in why for why in report["skipped"].values())
    _check_stats(report["results"]["dcp_stall"]["async_save"], 2, "dcp_stall")
    assert "skipped" in (out / "cuda_tests.log").read_text()


@needs_bash
def test_gpu_check_installs_crc32c_from_the_carried_wheels(tmp_path):
    """The path a lent machine takes: crc32c missing, its wheel carried in .device/wheels
    (benchmarks/gpu_prepare.sh): installed with pip --no-index into a temporary --target."""
    wheels = os.path.join(ROOT, ".device", "wheels")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if not os.path.isdir(wheels) or not any(n.startswith("crc32c-") and tag in n for n in os.listdir(wheels)):
        pytest.skip("no crc32c wheel for this python in .device/wheels (run benchmarks/gpu_prepare.sh)")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "crc32c.py").write_text("raise ImportError('No module named crc32c (simulated)')\n")
    proc, out = _run_check(tmp_path, {"PYTHONPATH": str(fake), "GPU_CHECK_WHEELS": wheels,
                                      "GPU_CHECK_BENCH_ARGS": "--sections stall"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["async_ckpt_importable"] is True and summary["tests_rc"] == 0
    assert any(n.startswith("crc32c installed from") for n in summary["notes"]), summary["notes"]
    report = json.loads((out / "bench_cuda.json").read_text())
    assert report["errors"] == {} and set(report["results"]) == {"stall", "durable"}
    assert [p.name for p in tmp_path.iterdir() if p.name != "fake"] == ["out"], "temporary files left behind"
