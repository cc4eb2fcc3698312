"""benchmarks/bench_training_speed.py runs (seconds of work, no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..support.paths import REPO

ROOT = REPO


@pytest.mark.slow
def test_bench_training_speed_smoke(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_training_speed.py"), "--smoke",
                          "--methods-launch", "floor,ours,ours-thread,dcp-thread", "--methods-cpu", "ours,torch-save",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "bench_training_speed.json") as f:
        report = json.load(f)
    assert set(report["launch"]["methods"]) == {"floor", "ours", "ours-thread", "dcp-thread"}
    assert set(report["cpu"]["methods"]) == {"ours", "torch-save"}
    for res in report["launch"]["methods"].values():
        assert res["window_s"]["n"] == 1 and res["window_s"]["median"] > 0
    assert (tmp_path / "bench_training_speed.png").stat().st_size > 1000


@pytest.mark.slow
def test_bench_training_speed_smoke_with_many_small_tensors(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_training_speed.py"), "--smoke",
                          "--loop", "launch", "--tensors", "300x4K", "--methods-launch", "floor,ours",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "bench_training_speed.json") as f:
        report = json.load(f)
    assert report["launch"]["tensors"] == 300
    assert set(report["launch"]["methods"]) == {"floor", "ours"}
