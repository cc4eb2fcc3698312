"""benchmarks/bench_ab.py runs (this checkout against itself, tiny sizes, no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..support.paths import REPO

ROOT = REPO


def test_bench_ab_smoke(tmp_path):
    report_path = tmp_path / "ab.json"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_ab.py"), "--smoke",
                          "--dir", str(tmp_path), "--out", str(report_path)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert set(report["cases"]) == {"256M", "10000x4K"}
    for rows in report["cases"].values():
        assert set(rows) >= {"stall", "durable", "restore warm"}
        for r in rows.values():
            assert r["a"]["median"] > 0 and r["b"]["median"] > 0
    assert "| 10000x4K | durable |" in out.stdout
