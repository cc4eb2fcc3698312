"""benchmarks/bench_incremental.py must keep working: a tiny --smoke run as a subprocess.

No timing assertions (speed is the benchmark's business, not the tests'): only that the script
runs, measures every metric it promises, and writes a well-formed JSON report whose byte counts
agree with the state it saved.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from ..support.paths import REPO

ROOT = REPO
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_incremental.py")

METRICS = {"written_vs_changed", "durable_vs_raw_write", "storage_vs_bound", "stall_vs_floor",
           "stall_frozen_vs_changing_floor", "durable_frozen_vs_raw_write", "pretrain_durable_inc_vs_full", "pretrain_stall_inc_vs_full",
           "restore_vs_raw_read", "verify_vs_durable", "verify_after_restart_vs_raw_read"}
PAIRED = {"durable_vs_raw_write", "stall_vs_floor", "pretrain_durable_inc_vs_full", "pretrain_stall_inc_vs_full",
          "restore_vs_raw_read", "verify_vs_durable", "verify_after_restart_vs_raw_read"}


def test_bench_incremental_smoke(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--quiet", "--out", str(out), "--dir", str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_incremental.json").read_text())
    assert os.listdir(work) == []  # its checkpoints removed

    metrics = report["metrics"]
    assert set(metrics) == METRICS
    frozen = report["frozen_option"]
    for key in PAIRED | ({"stall_frozen_vs_changing_floor"} if frozen else set()):
        m = metrics[key]
        assert m["n"] == len(m["samples_s"]) == len(m["references_s"]) >= 1, key
        assert all(s > 0 for s in m["samples_s"] + m["references_s"]), key
        assert m["min"] <= m["median"] <= m["max"] and math.isfinite(m["median"]), key
        assert m["verdict"] in ("pass", "FAIL"), key
    if not frozen:
        assert metrics["stall_frozen_vs_changing_floor"]["verdict"] == "skipped"

    # The bytes: the LoRA-like state's changed part is its trainable + optimizer tensors; every
    # save after the first wrote them (and metadata), and took the frozen base.
    state = report["state"]
    assert state["changed_bytes"] + state["base_bytes"] == state["total_bytes"] and state["base_bytes"] > 0
    saves = report["lora_saves"]
    assert [s["step"] for s in saves] == list(range(1, report["config"]["saves"] + 1))
    assert saves[0]["referred_bytes"] == 0 and saves[0]["written_bytes"] >= state["total_bytes"]
    for s in saves[1:]:
        assert state["changed_bytes"] <= s["written_bytes"] <= 1.1 * state["changed_bytes"] + 2**20, s
        assert s["referred_bytes"] >= state["base_bytes"], s
    w = metrics["written_vs_changed"]
    assert w["samples"] == [s["written_bytes"] for s in saves[1:]] and w["verdict"] == "pass"
    st = metrics["storage_vs_bound"]
    assert st["bound_bytes"] == state["total_bytes"] + report["config"]["saves"] * state["changed_bytes"]
    assert st["unique_bytes"] > state["total_bytes"] and st["verdict"] == "pass"
    assert metrics["restore_vs_raw_read"]["cold"] is False  # --smoke never drops the page cache
    # verifying the taken files: stat only while this process wrote them; after a restart, the
    # first save reads back (once) every file it takes
    assert metrics["verify_vs_durable"]["read_bytes"] == [0] * (report["config"]["saves"] - 1)
    assert all(n >= state["base_bytes"] for n in metrics["verify_after_restart_vs_raw_read"]["read_bytes"])

    table = report["table_markdown"]
    assert table.splitlines()[0] == "| metric | measured (median [min, max] of paired ratios) | target | verdict |"
    assert len([ln for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln]) == 1 + len(METRICS)
    assert table.splitlines()[0] in proc.stdout
