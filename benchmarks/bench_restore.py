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

The XLA case (``--cases xla``; needs torch_xla, run with ``PJRT_DEVICE=CPU`` or on a device):
restore into XLA tensors that already exist, async_ckpt's ``CheckpointManager.restore`` against
torch_xla's own (``torch_xla.experimental.distributed_checkpoint.CheckpointManager.restore``,
on a checkpoint it saved itself; it needs a process group, so a 1-rank gloo group on a FileStore
is created for it, as in bench_save). One worker process holds a target state dict for each;
each sample times both, async_ckpt first in every other sample (each after dropping the page
cache when cold; warm: after two untimed calls of each), each call followed by
``torch_xla.sync()`` and a wait for the device, so both end with the data on the device. Reported: the medians, and the median of the per-sample ratios async_ckpt /
torch_xla; both targets are compared bitwise after the first sample.

Writes ``<name>.json`` (default ``bench_restore``) and, where matplotlib is installed,
``<name>.png`` under ``--out``.

    .venv/bin/python benchmarks/bench_restore.py                      # full run
    .venv/bin/python benchmarks/bench_restore.py --sizes 256M --samples 3
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_restore.py --cases xla --sizes 256M,512M \
        --samples 3 --name bench_restore_xla
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
X_OURS = "xla: async_ckpt restore"
X_TXLA = "xla: torch_xla CheckpointManager.restore"
X_METHODS = [X_OURS, X_TXLA]
#: the XLA case's target: async_ckpt / torch_xla restore time, median of paired ratios
XLA_TARGET_RATIO = 0.6


def has_xla() -> bool:
    try:
        import torch_xla  # noqa: F401
    except Exception:
        return False
    return True


def _write_proc(path: str, text: str) -> bool:
    """Write ``text`` to a /proc file; False where that is not allowed (not root, no /proc)."""
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def can_drop_caches() -> bool:
    return _write_proc("/proc/sys/vm/drop_caches", "3")


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


def prepare(label: str, work: str, cpu: bool = True) -> None:
    """Every method's checkpoint of the ``label`` state dict under ``work`` (not ``cpu``: only
    the ones the XLA case reads: async_ckpt's, and the ``torch.save`` file it takes shapes from)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from async_ckpt import CheckpointManager

    sd = make_state(label)
    os.makedirs(work, exist_ok=True)
    torch.save(sd, os.path.join(work, "torch.pt"))
    if cpu:
        with open(os.path.join(work, "raw.bin"), "wb") as f:
            for t in tensors_of(sd):
                f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
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


def prepare_xla(label: str, work: str) -> None:
    """torch_xla's manager's own checkpoint (step 1) of the ``label`` state dict, saved from XLA
    tensors, under ``work/torch_xla``."""
    import torch
    import torch_xla
    from bench_save import ensure_process_group, map_tensors
    from torch_xla.experimental.distributed_checkpoint import CheckpointManager as XlaCheckpointManager

    dev = torch_xla.device()
    sd = map_tensors(make_state(label), lambda t: t.to(dev))
    torch_xla.sync()
    ensure_process_group(work)
    mgr = XlaCheckpointManager(os.path.join(work, "torch_xla"), save_interval=1, chkpt_on_preemption=False)
    assert mgr.save(1, sd, force=True)
    mgr.join()
    del sd, torch


def xla_worker(label: str, work: str, samples: int, cold: bool) -> Dict[str, Any]:
    """Paired samples (async_ckpt, torch_xla) of restoring into XLA tensors; see the module docstring."""
    import torch
    import torch_xla
    from bench_save import ensure_process_group
    from torch_xla.experimental.distributed_checkpoint import CheckpointManager as XlaCheckpointManager

    from async_ckpt import CheckpointManager

    dev = torch_xla.device()
    mapped = torch.load(os.path.join(work, "torch.pt"), weights_only=True, mmap=True)
    specs = [(k, v.shape, v.dtype) for k, v in mapped["model"].items()]
    del mapped

    def fresh() -> Dict[str, Any]:
        return {"model": {k: torch.zeros(shape, dtype=dtype, device=dev) for k, shape, dtype in specs}, "step": -1}

    targets = {X_OURS: fresh(), X_TXLA: fresh()}
    torch_xla.sync()
    ensure_process_group(work)
    mgrs = {X_OURS: CheckpointManager(os.path.join(work, "ours")),
            X_TXLA: XlaCheckpointManager(os.path.join(work, "torch_xla"), save_interval=1, chkpt_on_preemption=False)}

    def run(method: str) -> None:
        mgrs[method].restore(1, targets[method])
        torch_xla.sync()
        torch_xla._XLAC._xla_wait_device_ops([])

    extra = {m: 0 for m in X_METHODS}

    def timed(method: str) -> float:
        if cold:
            drop_caches()
        with PeakRss() as peak:
            t0 = time.perf_counter()
            run(method)
            dt = time.perf_counter() - t0
        extra[method] = max(extra[method], peak.extra)
        return dt

    if not cold:
        for _ in range(2):  # warm-up (untimed): page cache, imports, first-call costs, the heap's growth
            for m in X_METHODS:
                timed(m)
    pairs = []
    equal: Optional[bool] = None
    for i in range(samples):
        if i % 2 == 0:  # each method goes first in every other sample
            a = timed(X_OURS)
            pairs.append((a, timed(X_TXLA)))
        else:
            b = timed(X_TXLA)
            pairs.append((timed(X_OURS), b))
        if equal is None:
            a, b = targets[X_OURS]["model"], targets[X_TXLA]["model"]
            equal = all(torch.equal(a[k].cpu().view(-1).view(torch.uint8), b[k].cpu().view(-1).view(torch.uint8))
                        for k in a if a[k].numel())
    mgrs[X_OURS].close()  # type: ignore[attr-defined]
    return {"pairs": pairs, "extra_rss_bytes": extra, "bitwise_equal": equal}


def summarize_xla(res: Dict[str, Any]) -> Dict[str, Any]:
    ours = [a for a, _ in res["pairs"]]
    theirs = [b for _, b in res["pairs"]]
    ratios = [a / b for a, b in res["pairs"]]
    out: Dict[str, Any] = {}
    for name, times in ((X_OURS, ours), (X_TXLA, theirs)):
        out[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                     "samples_s": times, "extra_rss_mib": res["extra_rss_bytes"][name] / 2**20}
    out["paired_ratio"] = statistics.median(ratios)
    out["paired_ratios"] = ratios
    out["target_ratio"] = XLA_TARGET_RATIO
    out["pass"] = out["paired_ratio"] <= XLA_TARGET_RATIO
    out["bitwise_equal"] = res["bitwise_equal"]
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_hwm() -> bool:
    return _write_proc("/proc/self/clear_refs", "5")


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
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 samples (the XLA case on the first size only)")
    ap.add_argument("--cases", default="cpu,xla", help="cpu (CPU targets), xla (XLA targets), or both")
    ap.add_argument("--name", default="bench_restore", help="file name (no extension) of the JSON and PNG written")
    ap.add_argument("--no-chart", action="store_true", help="skip the PNG")
    ap.add_argument("--worker", nargs=5, metavar=("METHOD", "LABEL", "WORK", "SAMPLES", "COLD"), help=argparse.SUPPRESS)
    ap.add_argument("--prepare-xla", nargs=2, metavar=("LABEL", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prepare_xla:
        prepare_xla(*args.prepare_xla)
        return
    if args.worker:
        method, label, work, samples, cold = args.worker
        if method == "xla":
            print(json.dumps(xla_worker(label, work, int(samples), cold == "1")))
        else:
            print(json.dumps(worker(method, label, work, int(samples), cold == "1")))
        return
    if args.smoke:
        args.sizes, args.samples = "4M,200x4K", 2
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    if not cases or cases - {"cpu", "xla"}:
        ap.error(f"--cases: cpu, xla or both, not {args.cases!r}")
    if "xla" in cases and not has_xla():
        print("note: torch_xla is not installed: no XLA case", flush=True)
        cases.discard("xla")
    cold_ok = can_drop_caches()
    base = args.dir or tempfile.mkdtemp(prefix="bench_restore_")
    os.makedirs(args.out, exist_ok=True)
    report: Dict[str, Any] = {"sizes": sizes, "samples": args.samples, "cold_available": cold_ok,
                              "cpus": os.cpu_count(), "cases": sorted(cases), "results": {}, "xla": {}}
    if not cold_ok:
        print("note: cannot drop the page cache (not root): only warm results", flush=True)
    env = dict(os.environ)
    env.setdefault("PJRT_DEVICE", "CPU")
    try:
        for n, label in enumerate(sizes):
            work = os.path.join(base, label.replace(" ", ""))
            prepare(label, work, cpu="cpu" in cases)
            xla_here = "xla" in cases and not (args.smoke and n > 0)
            if xla_here:
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--prepare-xla", label, work],
                                      capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    print(f"{label} xla: torch_xla's save failed\n{proc.stderr[-2000:]}", flush=True)
                    xla_here = False
            for mode in (["warm", "cold"] if cold_ok else ["warm"]):
                if xla_here:
                    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "xla", label, work,
                           str(args.samples), "1" if mode == "cold" else "0"]
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    if proc.returncode != 0:
                        print(f"{label} {mode} xla: failed\n{proc.stderr[-2000:]}", flush=True)
                    else:
                        x = summarize_xla(json.loads(proc.stdout.strip().splitlines()[-1]))
                        report["xla"].setdefault(label, {})[mode] = x
                        for name in X_METHODS:
                            print(f"{label:>12} {mode:4} {name:42} {x[name]['median_s']:8.3f} s "
                                  f"[{x[name]['min_s']:.3f}-{x[name]['max_s']:.3f}]  "
                                  f"+{x[name]['extra_rss_mib']:7.1f} MiB", flush=True)
                        print(f"{label:>12} {mode:4} {'xla: async_ckpt / torch_xla (paired)':42} "
                              f"x{x['paired_ratio']:.2f} (target <= {XLA_TARGET_RATIO})  bitwise equal: "
                              f"{x['bitwise_equal']}", flush=True)
                for method in (METHODS if "cpu" in cases else []):
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
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump(report, f, indent=1)
    if report["results"]:
        print(table(report))
    if report["xla"]:
        print(xla_table(report))
    if not args.no_chart:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("note: matplotlib is not installed: no chart", flush=True)
        else:
            chart(report, os.path.join(args.out, args.name + ".png"))


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


def xla_table(report: Dict[str, Any]) -> str:
    lines = ["| size | mode | async_ckpt s (min-max) | torch_xla s (min-max) | paired ratio (per sample) | "
             "extra RSS MiB (ours / torch_xla) | bitwise equal |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, modes in report["xla"].items():
        for mode, x in modes.items():
            a, b = x[X_OURS], x[X_TXLA]
            per = ", ".join(f"{r:.2f}" for r in x["paired_ratios"])
            lines.append(f"| {label} | {mode} | {a['median_s']:.3f} ({a['min_s']:.3f}-{a['max_s']:.3f}) | "
                         f"{b['median_s']:.3f} ({b['min_s']:.3f}-{b['max_s']:.3f}) | {x['paired_ratio']:.2f} ({per}) | "
                         f"{a['extra_rss_mib']:.0f} / {b['extra_rss_mib']:.0f} | {x['bitwise_equal']} |")
    return "\n".join(lines)


def chart(report: Dict[str, Any], path: str) -> None:
    """Median restore time per size and method, one panel per mode (CPU and XLA targets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({m for r in (report["results"], report["xla"]) for v in r.values() for m in v}, reverse=True)
    if not modes:
        return
    fig, axes = plt.subplots(1, len(modes), figsize=(7.5 * len(modes), 5.5), squeeze=False)
    names = [RAW] + METHODS + X_METHODS
    cmap = plt.get_cmap("tab10")
    for ax, mode in zip(axes[0], modes):
        labels = [lb for lb in report["sizes"] if mode in report["results"].get(lb, {}) or mode in report["xla"].get(lb, {})]
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            vals = []
            for lb in labels:
                cpu = report["results"].get(lb, {}).get(mode, {})
                xla = report["xla"].get(lb, {}).get(mode, {})
                if name == RAW:
                    raws = [s["raw_median_s"] for s in cpu.values()]
                    vals.append(statistics.median(raws) if raws else 0.0)
                else:
                    vals.append((cpu.get(name) or xla.get(name) or {}).get("median_s", 0.0))
            if any(vals):
                ax.bar([i + j * width for i in range(len(labels))], vals, width, label=name, color=cmap(j % 10),
                       hatch="//" if name in X_METHODS else None)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
        ax.set_xticklabels(labels)
        ax.set_yscale("log")
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"restore, {mode} page cache")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    handles, lbls = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, lbls, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"async_ckpt bench_restore: {report['cpus']} cores, {report['samples']} samples", fontsize=10)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
