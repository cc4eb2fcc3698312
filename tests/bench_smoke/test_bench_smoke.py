"""benchmarks/bench_save.py must keep working: a tiny --smoke run as a subprocess.

No timing assertions (speed is the benchmark's business, not the tests'): only that the script
runs, measures every method it promises, and writes a well-formed JSON report and a PNG.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..support.paths import REPO

ROOT = REPO
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_save.py")

CPU_METHODS = {
    "floor (copy_ into allocated)", "raw write+fsync", "async_ckpt save_async", "dcp.async_save (default)",
    "dcp.async_save (cached stager)", "torch.save (sync, fsync)",
}
XLA_METHODS = {
    "xla: .cpu() one by one", "xla: batched _xla_get_cpu_tensors",
    "xla: async_ckpt save_async", "xla: torch_xla CheckpointManager",
}


def _has_xla() -> bool:
    try:
        import torch_xla  # noqa: F401
    except Exception:
        return False
    return True


def test_bench_save_smoke(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--quiet", "--out", str(out), "--dir", str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench_save.json").read_text())
    assert (out / "bench_save.png").stat().st_size > 1000

    assert set(report["results"]) == set(report["config"]["sizes"]) and len(report["results"]) == 2
    small = [lb for lb, s in report["sizes"].items() if s["small_tensors"]]
    assert len(small) == 1 and report["sizes"][small[0]]["tensors"] == report["sizes"][small[0]]["small_tensors"]
    expected = CPU_METHODS | (XLA_METHODS if _has_xla() else set())
    assert report["config"]["xla"] == _has_xla()
    for label, res in report["results"].items():
        assert expected <= set(res), f"{label}: missing {sorted(expected - set(res))}"
        for name, r in res.items():
            assert r["blocking_s"] > 0 and len(r["samples"]) == r["n"] >= report["config"]["reps"], (label, name)
        for name in ("raw write+fsync", "async_ckpt save_async", "dcp.async_save (default)", "torch.save (sync, fsync)"):
            assert res[name]["durable_s"] >= res[name]["blocking_s"], (label, name)
        assert res["async_ckpt save_async"]["stage_s"] > 0

    names = {r["name"] for r in report["ratios"]}
    assert "durable / raw write+fsync" in names
    assert "per-tensor overhead (blocking - floor) / tensors" in names
    assert any(n.startswith("RSS growth") for n in names)
    if _has_xla():
        assert "XLA blocking / batched _xla_get_cpu_tensors" in names
    for r in report["ratios"]:
        assert isinstance(r["pass"], bool) and r["target"] > 0
    assert report["rss"]["rss_after_2nd"] > 0 and report["rss"]["rss_after_last"] > 0
    assert not list(work.iterdir()), "the benchmark left files behind"
    assert "| method |" in proc.stdout
    assert report["complete"] is True and not report["skipped"]


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_save", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_save_size_parsing():
    bench = _bench_module()
    assert bench.parse_size("256M") == ("256 MiB", 256 * 2**20, 0)
    assert bench.parse_size("1G") == ("1 GiB", 2**30, 0)
    assert bench.parse_size("10000x4K") == ("10000x4 KiB", 10000 * 4096, 10000)
    sd = bench.transformer_state(8 * 2**20)
    nbytes = sum(t.numel() * t.element_size() for t in bench.tensors_of(sd))
    assert abs(nbytes - 8 * 2**20) <= 4 * 256  # exact to within one embedding row


@pytest.mark.parametrize("argv", [["--sizes=12"], ["--sizes=1000x3"], ["--sizes=big"], ["--reps=0"]])
def test_bench_save_rejects_bad_options(argv, capsys):
    bench = _bench_module()
    with pytest.raises(SystemExit) as exc:
        bench.main(argv + ["--skip-xla"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "size" in err or "reps" in err


def test_bench_lazy_smoke(tmp_path):
    """bench_lazy.py runs its CPU configurations end to end (a tiny model, a few steps)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_lazy.py"), "--configs", "none,eager,lazy",
         "--steps", "4", "--every", "2", "--width", "64", "--depth", "2", "--batch", "4", "--rounds", "1",
         "--skip-xla", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
        env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("| eager", "| lazy"))]
    assert len(rows) == 2 and not any("failed" in r for r in rows), proc.stdout[-3000:]


def test_bench_restore_smoke(tmp_path):
    """bench_restore.py --smoke: every method at every size, the XLA case (async_ckpt against
    torch_xla's manager, restored bytes compared) where torch_xla is installed, JSON and PNG."""
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PJRT_DEVICE="CPU")
    script = os.path.join(ROOT, "benchmarks", "bench_restore.py")
    proc = subprocess.run([sys.executable, script, "--smoke", "--out", str(out), "--dir", str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed" not in proc.stdout, proc.stdout[-3000:]
    report = json.loads((out / "bench_restore.json").read_text())
    assert set(report["results"]) == set(report["sizes"]) and len(report["sizes"]) == 2
    methods = {"async_ckpt restore", "torch.load + copy_", "torch.load(mmap=True) + copy_", "dcp.load"}
    for label, modes in report["results"].items():
        for mode, res in modes.items():
            assert set(res) == methods, (label, mode)
            assert all(r["median_s"] > 0 and len(r["pairs"]) == report["samples"] for r in res.values())
    if _has_xla():
        assert list(report["xla"]) == [report["sizes"][0]]
        for mode, x in report["xla"][report["sizes"][0]].items():
            assert x["bitwise_equal"] is True, mode
            for name in ("xla: async_ckpt restore", "xla: torch_xla CheckpointManager.restore"):
                assert x[name]["median_s"] > 0 and len(x[name]["samples_s"]) == report["samples"]
            assert len(x["paired_ratios"]) == report["samples"] and x["paired_ratio"] > 0
        assert "| paired ratio" in proc.stdout
    else:
        assert not report["xla"]
    assert (out / "bench_restore.png").stat().st_size > 1000
    assert not list(work.iterdir()), "the benchmark left files behind"
