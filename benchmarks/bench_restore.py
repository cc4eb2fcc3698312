"""Restore-path benchmark: reading a checkpoint back into tensors that already exist.

One run, the same transformer-like fp32 state dicts as bench_save (default 256 MiB, 1 GiB and
10,000 small tensors of 4 KiB; ``--sizes`` adds 2G), each saved once by every method's own
writer. Then, per size and method, a fresh worker process allocates the target tensors (touched,
so their page faults are not timed) and takes ``--samples`` paired samples: the reference (raw
``readinto`` of the same tensor bytes from one file, into the same tensors) right before each
sample of the method, each after dropping the page cache (``cold``, when running as root) or
after a warm-up read (``warm``). Reported: the median time, the median of the per-pair ratios
method / raw, and the peak extra host memory of the method: the largest, over its samples, of
the resident-set high-water mark during the call (``VmHWM`` of ``/proc/self/status``, reset
right before it by writing 5 to ``/proc/self/clear_refs``) minus the resident set right before
it, the warm-up call included (later calls may reuse memory the allocator kept from it); where
the mark cannot be reset, the resident set is sampled from a thread every 1 ms instead. For ``torch.load(mmap=True)`` that includes the mapped file pages.

Methods: ``raw readinto``; ``async_ckpt restore`` (verification on, the default); ``torch.load
+ copy_``; ``torch.load(mmap=True) + copy_``; ``dcp.load`` (a plain ``dcp.save`` checkpoint).
torch_xla's ``CheckpointManager.restore`` is not measured (it needs a process group and XLA
targets; see docs/benchmarks.md).

    .venv/bin/python benchmarks/bench_restore.py                      # full run
    .venv/bin/python benchmarks/bench_restore.py --sizes 256M --samples 3
    .venv/bin/python benchmarks/bench_restore.py --smoke --out /tmp/b  # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

warnings.filterwarnings("ignore")

RAW = "raw readinto"
OURS = "async_ckpt restore"
TLOAD = "torch.load + copy_"
TMMAP = "torch.load(mmap=True) + copy_"
DCP = "dcp.load"
METHODS = [OURS, TLOAD, TMMAP, DCP]


def can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def make_state(label: str) -> Dict[str, Any]:
    from bench_save import parse_size, small_state, transformer_state

    _, total, count = parse_size(label)
    return small_state(count, total // count) if count else transformer_state(total)


def tensors_of(sd: Any) -> List[Any]:
    from bench_save import tensors_of as t

    return t(sd)


def prepare(label: str, work: str) -> None:
    """Every method's checkpoint of the ``label`` state dict under ``work``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from async_ckpt import CheckpointManager

    sd = make_state(label)
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "raw.bin"), "wb") as f:
        for t in tensors_of(sd):
            f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
    torch.save(sd, os.path.join(work, "torch.pt"))
    dcp.save(sd, checkpoint_id=os.path.join(work, "dcp"), no_dist=True)
    with CheckpointManager(os.path.join(work, "ours")) as mgr:
        mgr.save(1, sd)


def worker(method: str, label: str, work: str, samples: int, cold: bool) -> Dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    from async_ckpt import CheckpointManager

    torch.set_num_threads(max(1, torch.get_num_threads()))
    # The shapes from the torch.save file, mapped (its data pages are never touched), so that
    # no source copy of the state dict raises the worker's RSS high-water mark.
    shapes = torch.load(os.path.join(work, "torch.pt"), weights_only=True, mmap=True)
    target = {"model": {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in shapes["model"].items()}, "step": -1}
    del shapes
    ts = tensors_of(target)
    views = [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in ts]
    mgr = CheckpointManager(os.path.join(work, "ours")) if method == OURS else None

    def raw() -> None:
        with open(os.path.join(work, "raw.bin"), "rb", buffering=0) as f:
            for v in views:
                f.readinto(v)

    def copy_all(loaded: Dict[str, Any]) -> None:
        for k, v in loaded["model"].items():
            target["model"][k].copy_(v)

    def run() -> None:
        if method == OURS:
            mgr.restore(1, target)  # type: ignore[union-attr]
        elif method == TLOAD:
            copy_all(torch.load(os.path.join(work, "torch.pt"), weights_only=True))
        elif method == TMMAP:
            copy_all(torch.load(os.path.join(work, "torch.pt"), weights_only=True, mmap=True))
        elif method == DCP:
            dcp.load(target, checkpoint_id=os.path.join(work, "dcp"), no_dist=True)
        elif method == RAW:
            raw()

    extra = {"raw": 0, "method": 0}

    def timed(fn: Any, who: str) -> float:
        if cold:
            drop_caches()
        with PeakRss() as peak:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        extra[who] = max(extra[who], peak.extra)
        return dt

    raw()  # the targets' pages and the reference's first-call costs
    if not cold:
        timed(run, "method")  # warm-up (untimed): page cache, imports, first-call costs; its memory
        # counts (later calls may reuse what the allocator kept from it without a new peak)
    pairs = []
    for _ in range(samples):
        r = timed(raw, "raw")
        m = timed(run, "method")
        pairs.append((r, m))
    if mgr is not None:
        mgr.close()
    return {"pairs": pairs, "extra_rss_bytes": extra["method"], "raw_extra_rss_bytes": extra["raw"]}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """The peak resident-set increase inside a ``with`` block, in bytes (``.extra``): the
    kernel's high-water mark reset at entry where possible, else a 1 ms sampling thread."""

    def __enter__(self) -> "PeakRss":
        self.extra = 0
        self.before = _status_kib("VmRSS")
        self.exact = _reset_hwm()
        self._stop = threading.Event()
        self._peak = self.before
        self._thread: Optional[threading.Thread] = None
        if not self.exact:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, _status_kib("VmRSS"))
            time.sleep(0.001)

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, _status_kib("VmRSS"))
        else:
            peak = _status_kib("VmHWM")
        self.extra = max(0, peak - self.before) * 1024


def summarize(res: Dict[str, Any]) -> Dict[str, Any]:
    raws = [r for r, _ in res["pairs"]]
    times = [m for _, m in res["pairs"]]
    return {"median_s": statistics.median(times), "raw_median_s": statistics.median(raws),
            "ratio_to_raw": statistics.median(m / r for r, m in res["pairs"]),
            "extra_rss_mib": res["extra_rss_bytes"] / 2**20,
            "raw_extra_rss_mib": res.get("raw_extra_rss_bytes", 0) / 2**20, "pairs": res["pairs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256M,1G,10000x4K")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 samples")
    ap.add_argument("--worker", nargs=5, metavar=("METHOD", "LABEL", "WORK", "SAMPLES", "COLD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        method, label, work, samples, cold = args.worker
        print(json.dumps(worker(method, label, work, int(samples), cold == "1")))
        return
    if args.smoke:
        args.sizes, args.samples = "4M,200x4K", 2
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    cold_ok = can_drop_caches()
    base = args.dir or tempfile.mkdtemp(prefix="bench_restore_")
    os.makedirs(args.out, exist_ok=True)
    report: Dict[str, Any] = {"sizes": sizes, "samples": args.samples, "cold_available": cold_ok,
                              "cpus": os.cpu_count(), "results": {}}
    if not cold_ok:
        print("note: cannot drop the page cache (not root): only warm results", flush=True)
    try:
        for label in sizes:
            work = os.path.join(base, label.replace(" ", ""))
            prepare(label, work)
            for mode in (["warm", "cold"] if cold_ok else ["warm"]):
                for method in METHODS:
                    cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, label, work,
                           str(args.samples), "1" if mode == "cold" else "0"]
                    proc = subprocess.run(cmd, capture_output=True, text=True)
                    if proc.returncode != 0:
                        print(f"{label} {mode} {method}: failed\n{proc.stderr[-2000:]}", flush=True)
                        continue
                    s = summarize(json.loads(proc.stdout.strip().splitlines()[-1]))
                    report["results"].setdefault(label, {}).setdefault(mode, {})[method] = s
                    print(f"{label:>12} {mode:4} {method:32} {s['median_s']:8.3f} s  x{s['ratio_to_raw']:5.2f} raw "
                          f"(raw {s['raw_median_s']:.3f} s)  +{s['extra_rss_mib']:7.1f} MiB", flush=True)
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    with open(os.path.join(args.out, "bench_restore.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))


def table(report: Dict[str, Any]) -> str:
    lines = ["| size | mode | method | median s | x raw readinto | vs torch.load | vs dcp.load | extra RSS MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, modes in report["results"].items():
        for mode, methods in modes.items():
            raw = statistics.median([s["raw_median_s"] for s in methods.values()])
            raw_rss = max(s.get("raw_extra_rss_mib", 0.0) for s in methods.values())
            lines.append(f"| {label} | {mode} | {RAW} | {raw:.3f} | 1.00 | | | {raw_rss:.0f} |")
            tl, dl = methods.get(TLOAD, {}).get("median_s"), methods.get(DCP, {}).get("median_s")
            for name, s in methods.items():
                vt = f"{s['median_s'] / tl:.2f}" if tl else ""
                vd = f"{s['median_s'] / dl:.2f}" if dl else ""
                lines.append(f"| {label} | {mode} | {name} | {s['median_s']:.3f} | {s['ratio_to_raw']:.2f} | {vt} | "
                             f"{vd} | {s['extra_rss_mib']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
