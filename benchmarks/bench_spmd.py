"""SPMD save stall (issue 34): async_ckpt's ``save_async`` on a model sharded over 4 virtual XLA
devices (PJRT CPU, ``xr.use_spmd()``), paired with its references.

The state dict is bench_save's transformer-like fp32 one (default 256 MiB), moved to XLA: every
2-D weight split row-wise over a 1-D mesh of the 4 devices (``mark_sharding(w, mesh, (0, None))``,
as FSDP-style SPMD does), every 1-D parameter replicated. Before each sample, one "training
step" changes every tensor (``add_``, then ``torch_xla.sync()`` and a wait), so every method
reads fresh device buffers, never a host copy left by ``.to('xla')``. Then, in this order, each
timed right before the next (same moment, same machine state):

* ``torch_xla CheckpointManager``: its ``save_async`` (``torch_xla.sync()``, a wait, then
  ``_sharded_cpu_state_dict``: the local shards and the other tensors to the host) until it
  returns; then ``join()`` (untimed);
* ``batched _xla_get_cpu_tensors``: one call over every tensor of the state dict (PyTorch/XLA
  #5824's batched transfer; under SPMD it assembles each sharded tensor whole);
* ``async_ckpt save_async``: until it returns (the snapshot is then on the host); then
  ``join()``, whose time is reported as ``durable``.

With ``--loop K`` (issue 46), each sample also measures the training time a save costs, as
bench_training_speed.py does for CPU: for each manager (which goes first alternates from sample
to sample), K training steps with no save, timed right before (the reference time per step),
then its ``save_async`` followed at once by training steps, at least K and on until the save is
durable (the save's transfers and write run meanwhile), then ``join()``. *lost* = that window
minus its steps at the reference time per step: the stall plus what the background work slowed
the steps by (on a CPU host the "device" shares the cores with the background). Reported: lost
per save for each manager, and the paired difference and ratio async_ckpt vs torch_xla's
manager (median and min-max over the samples; the ratio is noise where the manager's lost time
is near 0: a state small against a step).

Reported per sample: async_ckpt / torch_xla's manager and async_ckpt / the batched call; the
medians of those paired ratios with their min-max, and the medians of the absolute times
(issue 34's targets: <= 0.25x the manager, <= 1.0x the batched call).

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv/bin/python benchmarks/bench_spmd.py               # 256 MiB, 7 samples
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv/bin/python benchmarks/bench_spmd.py --smoke --out /tmp/b   # seconds
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv/bin/python benchmarks/bench_spmd.py --size 64M --loop 8   # time lost
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
from bench_save import _ms, ensure_process_group, free_memory, machine_info, parse_size, tensors_of, transformer_state  # noqa: E402

warnings.filterwarnings("ignore")

OURS = "async_ckpt save_async"
TXLA = "torch_xla CheckpointManager save_async"
BATCHED = "batched _xla_get_cpu_tensors"
TARGETS = {TXLA: 0.25, BATCHED: 1.0}


def spread(values: Sequence[float]) -> Dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


def sharded_state(total_bytes: int) -> Dict[str, Any]:
    """bench_save's transformer state dict on the XLA device: 2-D weights split row-wise over a
    1-D mesh of every device, the rest replicated; synced and waited for."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("x",))
    cpu = transformer_state(total_bytes)
    model = {}
    for k, v in cpu["model"].items():
        t = v.to("xla")
        if t.dim() == 2 and t.shape[0] % n == 0:
            xs.mark_sharding(t, mesh, ("x", None))
        model[k] = t
    del cpu
    torch_xla.sync()
    torch_xla._XLAC._xla_wait_device_ops([])
    return {"model": model, "step": 0}


def training_step(sd: Dict[str, Any]) -> None:
    """New device buffers for every tensor (no host copy left), finished before the sample."""
    import torch_xla

    with torch.no_grad():
        for t in tensors_of(sd):
            t.add_(1e-3)
    torch_xla.sync()
    torch_xla._XLAC._xla_wait_device_ops([])


LOOP_KEYS = (f"ref_step_s {OURS}", f"ref_step_s {TXLA}", f"lost_s {OURS}", f"lost_s {TXLA}",
             f"steps {OURS}", f"steps {TXLA}")


def loop_lost(steps: int, sd: Dict[str, Any], txla: Any, ours: Any, i: int, txla_dir: str,
              ours_dir: str) -> Dict[str, float]:
    """The training time one save of each manager costs (see the module docstring): for each,
    ``steps`` steps without a save (its reference: their median time per step), then its ``save_async``
    and steps until ``steps`` are done and the save is durable; *lost* = that window minus the
    steps in it at the reference's time per step. Which manager goes first alternates with ``i``."""
    def step_time(n: int) -> float:  # the median step: a one-off (a compilation, a page fault) is no save's cost
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            training_step(sd)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    durable = {OURS: lambda: ours.last_save_future().done(),
               TXLA: lambda: all(f.done() for f in txla._async_futures)}
    managers = [(OURS, ours, ours_dir), (TXLA, txla, txla_dir)]
    out: Dict[str, float] = {}
    for name, mgr, d in managers if i % 2 == 0 else managers[::-1]:
        step = 10_000 + i
        gc.collect()
        ref = step_time(steps)
        gc.collect()
        t0 = time.perf_counter()
        mgr.save_async(step, sd)
        n = 0
        while n < steps or (not durable[name]() and n < 100 * steps):
            training_step(sd)
            n += 1
        out[f"lost_s {name}"] = time.perf_counter() - t0 - n * ref
        out[f"ref_step_s {name}"] = ref
        out[f"steps {name}"] = n
        mgr.join()
        shutil.rmtree(os.path.join(d, str(step)), ignore_errors=True)
    return out


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()
    from torch_xla.experimental.distributed_checkpoint import CheckpointManager as XlaManager

    from async_ckpt import CheckpointManager

    label, total, count = parse_size(args.size)
    if count:
        raise SystemExit("--size must be a dense size (e.g. 256M)")
    work = tempfile.mkdtemp(prefix="bench_spmd_", dir=args.dir)
    report: Dict[str, Any] = {"machine": machine_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "config": {"size": label, "bytes": total, "reps": args.reps, "warmup": args.warmup,
                                         "devices": xr.global_runtime_device_count(), "dir": work}}
    try:
        ensure_process_group(work)  # torch_xla's manager needs a process group
        sd = sharded_state(total)
        xts = tensors_of(sd)
        txla_dir, ours_dir = os.path.join(work, "torch_xla"), os.path.join(work, "async_ckpt")
        txla = XlaManager(txla_dir, save_interval=1, max_to_keep=0, chkpt_on_preemption=False)
        ours = CheckpointManager(ours_dir, max_to_keep=0)
        samples: List[Dict[str, float]] = []
        for i in range(args.warmup + args.reps):
            training_step(sd)
            gc.collect()
            t0 = time.perf_counter()
            txla.save_async(i, sd)
            t1 = time.perf_counter()
            txla.join()
            shutil.rmtree(os.path.join(txla_dir, str(i)), ignore_errors=True)
            gc.collect()
            t2 = time.perf_counter()
            out = torch_xla._XLAC._xla_get_cpu_tensors(xts)
            t3 = time.perf_counter()
            del out
            gc.collect()
            t4 = time.perf_counter()
            assert ours.save_async(i, sd)
            t5 = time.perf_counter()
            ours.join()
            t6 = time.perf_counter()
            st = ours.last_stats
            assert st is not None and st.step == i
            shutil.rmtree(os.path.join(ours_dir, str(i)), ignore_errors=True)
            s = {TXLA: t1 - t0, BATCHED: t3 - t2, OURS: t5 - t4, "durable_s": t6 - t4, "stage_s": st.stage_s}
            if args.loop:
                s.update(loop_lost(args.loop, sd, txla, ours, i, txla_dir, ours_dir))
            if i >= args.warmup:
                samples.append(s)
            if not args.quiet:
                print(f"  sample {i}{' (warm-up)' if i < args.warmup else ''}: " +
                      ", ".join(f"{k} {v:g}" if k.startswith("steps") else f"{k} {_ms(v)}" for k, v in s.items()), flush=True)
        ours.close()
        txla._async_worker_pool.shutdown(wait=True)
        report["samples"] = samples
        report["blocking"] = {m: spread([s[m] for s in samples]) for m in (OURS, TXLA, BATCHED)}
        report["durable"] = spread([s["durable_s"] for s in samples])
        if args.loop:
            report["loop"] = {"steps": args.loop, **{k: spread([s[k] for s in samples]) for k in LOOP_KEYS},
                              "lost, async_ckpt / torch_xla's manager, paired":
                                  spread([s[f"lost_s {OURS}"] / max(s[f"lost_s {TXLA}"], 1e-4) for s in samples]),
                              "lost, async_ckpt - torch_xla's manager, paired":
                                  spread([s[f"lost_s {OURS}"] - s[f"lost_s {TXLA}"] for s in samples])}
        report["ratios"] = [{"name": f"async_ckpt / {ref}, paired", "target": tgt,
                             **spread([s[OURS] / s[ref] for s in samples])} for ref, tgt in TARGETS.items()]
        for r in report["ratios"]:
            r["pass"] = r["median"] <= r["target"]
        del sd, xts
    finally:
        shutil.rmtree(work, ignore_errors=True)
        free_memory()
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return report


def markdown(report: Dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"SPMD, {c['devices']} virtual devices, {c['size']} fp32 (2-D weights split row-wise), "
             f"median of {len(report['samples'])} paired samples after {c['warmup']} warm-up (min-max)", "",
             "| method | blocking, median (min-max) |", "| --- | --- |"]
    for m, v in report["blocking"].items():
        lines.append(f"| {m} | {_ms(v['median'])} ({_ms(v['min'])}-{_ms(v['max'])}) |")
    d = report["durable"]
    lines.append(f"| async_ckpt save_async + join (durable) | {_ms(d['median'])} ({_ms(d['min'])}-{_ms(d['max'])}) |")
    if "loop" in report:
        lp = report["loop"]
        lines += ["", f"training time lost per save: at least {lp['steps']} steps after the call, until the save is "
                  "durable, minus those steps at the time per step measured right before (paired)", "",
                  "| method | lost per save, median (min-max) | time per step without a save | steps in the window |",
                  "| --- | --- | --- | --- |"]
        for m in (OURS, TXLA):
            v, r, n = lp[f"lost_s {m}"], lp[f"ref_step_s {m}"], lp[f"steps {m}"]
            lines.append(f"| {m} | {_ms(v['median'])} ({_ms(v['min'])}-{_ms(v['max'])}) | {_ms(r['median'])} | "
                         f"{n['median']:g} ({n['min']:g}-{n['max']:g}) |")
        d = lp["lost, async_ckpt - torch_xla's manager, paired"]
        lines.append(f"| lost, async_ckpt - torch_xla's manager, paired | {_ms(d['median'])} ({_ms(d['min'])} to "
                     f"{_ms(d['max'])}) | | |")
        r = lp["lost, async_ckpt / torch_xla's manager, paired"]
        lines.append(f"| lost, async_ckpt / torch_xla's manager, paired (noise when the latter is near 0) | "
                     f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f}) | | |")
    lines += ["", "| paired ratio | median (min-max) | target | result |", "| --- | --- | --- | --- |"]
    for r in report["ratios"]:
        lines.append(f"| {r['name']} | {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f}) | <= {r['target']:g}x | "
                     f"{'pass' if r['pass'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256M", help="state dict size (256M, 512M, ...)")
    p.add_argument("--reps", type=int, default=7, help="paired samples (medians reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed samples first (compilation, pools, page faults)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: /tmp)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="directory for bench_spmd.json")
    p.add_argument("--smoke", action="store_true", help="4 MiB, 1 sample: checks the script works (seconds)")
    p.add_argument("--loop", type=int, default=0, metavar="K",
                   help="also measure the training time lost per save over K steps after the call (0: off)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.reps, args.warmup = "4M", 1, 0
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be >= 1, --warmup >= 0")
    report = run(args)
    report["table_markdown"] = markdown(report)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_spmd.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(report["table_markdown"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
