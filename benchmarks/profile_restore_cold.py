"""Where a single-process restore's time goes, cold or warm, next to a raw ``readinto``.

Saves the transformer-like state dict of bench_save once (async_ckpt's checkpoint and a raw
file of the tensor bytes), then takes paired samples in one process: the raw ``readinto`` of
the same bytes into the same tensors, right before each restore, each after dropping the page
cache (``--cold``, needs root). The restore's phases are timed by wrapping the functions that
make them up, and each ``preadv`` call is counted (number, bytes, file). Prints one line per
sample and a median summary.

    .venv/bin/python benchmarks/profile_restore_cold.py --size 256M --samples 5 --cold
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


class Phases:
    def __init__(self) -> None:
        self.spans: List[tuple] = []
        self.t0 = 0.0
        self.lock = threading.Lock()
        self.preads: List[tuple] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        real = getattr(owner, name)
        me = self

        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                with me.lock:
                    me.spans.append((label, t - me.t0, time.perf_counter() - me.t0))

        setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256M")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--work", default="/tmp/prof_restore")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--resave", action="store_true")
    args = ap.parse_args()

    import torch
    from bench_restore import make_state, tensors_of

    from async_ckpt import CheckpointManager
    from async_ckpt.io import read_exec, read_targets, step_io
    from async_ckpt.jobs import restore_job as restore_mod
    from async_ckpt.storage import step_dirs

    work = os.path.join(args.work, args.size)
    if args.resave or not os.path.exists(os.path.join(work, "raw.bin")):
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        sd = make_state(args.size)
        with open(os.path.join(work, "raw.bin"), "wb") as f:
            for t in tensors_of(sd):
                f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
        with CheckpointManager(os.path.join(work, "ours")) as mgr:
            mgr.save(1, sd)
        del sd
    step_dir = [d for d in os.listdir(os.path.join(work, "ours")) if d.isdigit() or "1" in d]
    print("files:", {d: sorted((n, os.path.getsize(os.path.join(work, "ours", d, n)))
                               for n in os.listdir(os.path.join(work, "ours", d)))
                     for d in step_dir if os.path.isdir(os.path.join(work, "ours", d))})

    target = make_state(args.size)
    for t in tensors_of(target):
        t.zero_()
    views = [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in tensors_of(target)]
    mgr = CheckpointManager(os.path.join(work, "ours"), write_threads=args.threads)

    ph = Phases()
    ph.wrap(restore_mod, "prepare_target", "prepare_target")
    ph.wrap(step_dirs.StepDirectories, "read_committed", "read_committed")
    ph.wrap(restore_mod, "read_metadata", "read_metadata")
    ph.wrap(step_io, "read_direct", "read_direct")
    ph.wrap(step_io, "plan_direct", "plan")
    ph.wrap(read_exec.OpenFiles, "__init__", "open")
    run_calls = [0]
    real_run = read_exec.run_all

    def run_wrap(pool: Any, fns: Any) -> Any:
        run_calls[0] += 1
        label = {1: "probes", 2: "reads"}.get(run_calls[0] % 2 or 2, "run")
        t = time.perf_counter()
        try:
            return real_run(pool, fns)
        finally:
            ph.spans.append((label, t - ph.t0, time.perf_counter() - ph.t0))

    read_exec.run_all = run_wrap  # type: ignore[assignment]
    read_targets.run_all = run_wrap  # type: ignore[assignment]
    real_preadv = os.preadv

    def preadv(fd: int, bufs: Any, off: int, *a: Any) -> int:
        t = time.perf_counter()
        n = real_preadv(fd, bufs, off, *a)
        ph.preads.append((fd, off, n, t - ph.t0, time.perf_counter() - ph.t0, threading.get_ident()))
        return n

    os.preadv = preadv  # type: ignore[assignment]

    def raw() -> None:
        with open(os.path.join(work, "raw.bin"), "rb", buffering=0) as f:
            for v in views:
                f.readinto(v)

    def timed(fn: Callable[[], Any]) -> float:
        if args.cold:
            drop_caches()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    raw()
    if not args.cold:
        mgr.restore(1, target)
        raw()
    rows = []
    for i in range(args.samples):
        r = timed(raw)
        ph.spans.clear()
        ph.preads.clear()
        run_calls[0] = 0
        if args.cold:
            drop_caches()
        ph.t0 = time.perf_counter()
        mgr.restore(1, target)
        m = time.perf_counter() - ph.t0
        agg: Dict[str, List[float]] = collections.defaultdict(lambda: [1e9, 0.0])
        for label, a, b in ph.spans:
            agg[label][0] = min(agg[label][0], a)
            agg[label][1] = max(agg[label][1], b)
        probe_n = sum(1 for p in ph.preads if p[2] <= 4096)
        first_big = min((p[3] for p in ph.preads if p[2] > 65536), default=float("nan"))
        row = {"raw": r, "restore": m, "ratio": m / r, "preadv": len(ph.preads), "small_preads": probe_n,
               "first_big_read_at": first_big, **{k: (v[0], v[1]) for k, v in agg.items()}}
        rows.append(row)
        print(f"sample {i}: raw {r:.3f}s restore {m:.3f}s ratio {m / r:.2f} preadv {len(ph.preads)} "
              f"(<=4K {probe_n}) first big read at {first_big:.3f}s")
        for label, (a, b) in sorted(agg.items(), key=lambda kv: kv[1][0]):
            print(f"    {label:15s} {a:7.3f} .. {b:7.3f}  ({b - a:.3f}s)")
    print("median raw %.3f restore %.3f ratio %.2f (ratios %s)" % (
        statistics.median(r["raw"] for r in rows), statistics.median(r["restore"] for r in rows),
        statistics.median(r["ratio"] for r in rows), ", ".join(f"{r['ratio']:.2f}" for r in rows)))
    mgr.close()


if __name__ == "__main__":
    main()
