"""A/B of two checkouts of async_ckpt: the save stall, the durable time and the restore time,
measured alternately (A, B, A, B, ...) so that the machine's drift hits both alike.

Each sample runs in a fresh process with the checkout's package first on ``PYTHONPATH``, on the
same state dicts (a 256 MiB transformer-like fp32 dict, and 10,000 tensors of 4 KiB), and
reports, after warm-up saves of the same manager:

* ``stall``: ``save_async`` (the snapshot; training waits this long);
* ``durable``: ``save_async`` to ``join`` (the step committed and fsynced);
* ``restore warm``: ``restore`` into the state dict's tensors, files in the page cache;
* ``restore cold``: the same after ``echo 3 > /proc/sys/vm/drop_caches`` (root only; skipped
  otherwise).

Medians and spreads (min-max) per checkout, and the paired ratio B/A per round (its median).

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_ab.py --a ../base --b . --rounds 5
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_ab.py --smoke      # this checkout twice, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = r"""
import json, os, shutil, sys, time
import torch
from async_ckpt import CheckpointManager
kind, root, warmup, cold = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
torch.manual_seed(0)
if kind == "small":
    sd = {f"t{i}": torch.randn(1024) for i in range(int(sys.argv[5]))}
else:
    n = int(sys.argv[5]) // 4
    d = 1024
    sd, k = {}, 0
    while n > 0:
        rows = min(n // d, 4 * d) or 1
        sd[f"layer{k}.w"] = torch.randn(rows, d)
        n -= rows * d
        k += 1
out = {}
with CheckpointManager(root, save_interval=1, max_to_keep=2) as mgr:
    for step in range(warmup + 1):
        t0 = time.perf_counter()
        mgr.save_async(step, sd)
        t1 = time.perf_counter()
        mgr.join()
        t2 = time.perf_counter()
    out["stall"], out["durable"] = t1 - t0, t2 - t0
    t0 = time.perf_counter()
    mgr.restore(step, sd)
    out["restore warm"] = time.perf_counter() - t0
    if cold:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        t0 = time.perf_counter()
        mgr.restore(step, sd)
        out["restore cold"] = time.perf_counter() - t0
print("RESULT " + json.dumps(out))
"""

CASES = {"256M": ("big", 256 * 2**20), "10000x4K": ("small", 10000)}


def sample(checkout: str, case: str, root: str, warmup: int, cold: bool) -> Dict[str, float]:
    """One fresh process of ``checkout`` saving and restoring ``case`` under ``root``."""
    kind, n = CASES[case]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, "-c", _CHILD, kind, root, str(warmup), "1" if cold else "0", str(n)],
                          env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{checkout} {case} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT "):])


def _stats(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default=os.path.dirname(HERE), help="checkout A (default: this one)")
    p.add_argument("--b", default=os.path.dirname(HERE), help="checkout B (default: this one)")
    p.add_argument("--cases", default="256M,10000x4K")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--out", default=None, help="JSON report path")
    p.add_argument("--smoke", action="store_true", help="this checkout twice, 1 round, 1 warm-up, small sizes")
    args = p.parse_args(argv)
    if args.smoke:
        CASES["256M"] = ("big", 4 * 2**20)
        CASES["10000x4K"] = ("small", 200)
        args.rounds, args.warmup = 1, 1
    cold = os.geteuid() == 0 and os.path.exists("/proc/sys/vm/drop_caches") and not args.smoke
    report: Dict[str, Any] = {"a": os.path.abspath(args.a), "b": os.path.abspath(args.b), "rounds": args.rounds,
                              "cases": {}}
    for case in args.cases.split(","):
        got: Dict[str, List[Dict[str, float]]] = {"a": [], "b": []}
        for r in range(args.rounds):
            for side in ("a", "b"):
                with tempfile.TemporaryDirectory(dir=args.dir) as root:
                    got[side].append(sample(getattr(args, side), case, os.path.join(root, "ck"), args.warmup, cold))
            print(f"{case} round {r + 1}: A {got['a'][-1]}  B {got['b'][-1]}", flush=True)
        rows = {}
        for metric in got["a"][0]:
            a = [s[metric] for s in got["a"]]
            b = [s[metric] for s in got["b"]]
            rows[metric] = {"a": _stats(a), "b": _stats(b),
                            "ratio b/a": _stats([y / x for x, y in zip(a, b) if x > 0])}
        report["cases"][case] = rows
    print("\n| case | metric | A median (min-max) | B median (min-max) | B/A paired median (min-max) |")
    print("| --- | --- | --- | --- | --- |")
    for case, rows in report["cases"].items():
        for metric, r in rows.items():
            a, b, q = r["a"], r["b"], r["ratio b/a"]
            print(f"| {case} | {metric} | {a['median'] * 1e3:.0f} ms ({a['min'] * 1e3:.0f}-{a['max'] * 1e3:.0f}) | "
                  f"{b['median'] * 1e3:.0f} ms ({b['min'] * 1e3:.0f}-{b['max'] * 1e3:.0f}) | "
                  f"{q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f}) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
