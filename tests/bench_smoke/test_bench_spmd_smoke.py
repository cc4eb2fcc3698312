"""benchmarks/bench_spmd.py must keep working: a tiny --smoke run as a subprocess (no timing
assertions: only that every method and paired ratio is measured and the JSON is well formed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from ..support.paths import REPO

pytestmark = [pytest.mark.xla,
              pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")]

ROOT = REPO


def test_bench_spmd_smoke(tmp_path):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_spmd.py"), "--smoke", "--quiet",
                           "--out", str(tmp_path / "out"), "--dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "bench_spmd.json").read_text())
    assert report["config"]["devices"] == 4 and len(report["samples"]) == 1
    assert set(report["blocking"]) == {"async_ckpt save_async", "torch_xla CheckpointManager save_async",
                                       "batched _xla_get_cpu_tensors"}
    assert all(v["median"] > 0 for v in report["blocking"].values())
    assert len(report["ratios"]) == 2 and all(r["median"] > 0 for r in report["ratios"])
    assert [p for p in os.listdir(tmp_path) if p.startswith("bench_spmd_")] == []  # its files are removed
