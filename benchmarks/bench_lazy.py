"""Lazy snapshots vs eager ones on a CPU training loop, and the XLA snapshot cost, in one run.

CPU part: an MLP trained with Adam, whose state dict (params + two Adam moments) is large
enough that its host copy is a sizeable part of a step, checkpointed every ``k`` steps to a
local directory. Each configuration runs in its own process (same seed, same batches):

* ``none``: no checkpoints (the baseline);
* ``eager``: ``CheckpointManager.save_async(..., lazy=False)``;
* ``lazy``: ``CheckpointManager.save_async(..., lazy=True)`` (the guard waits before
  ``optimizer.step()``);
* ``dcp.async_save``: PyTorch DCP's async save (waiting for the previous one first, as
  torchtitan does), one directory per step;
* ``torch_xla manager``: ``torch_xla.experimental.distributed_checkpoint.CheckpointManager``
  with a 1-rank gloo process group.

Overhead = loop time - baseline loop time. Per-save stall = time inside the save call, plus
(lazy) time the guard made the loop wait, plus (dcp) the wait for the previous save.

XLA part (PJRT CPU): time of ``save_async`` (eager vs lazy) for state dicts that vary the
number of tensors and the bytes independently: lazy costs O(#tensors), eager O(bytes).

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_lazy.py [--steps 30] [--every 5]

Prints tables and writes JSON to ``benchmarks/results/``. One run per configuration: the
machine is small and shared, so treat differences under ~20% as noise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("PJRT_DEVICE", "CPU")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

MiB = 2**20
CONFIGS = ["none", "eager", "lazy", "dcp.async_save", "torch_xla manager"]


def build(width: int, depth: int, seed: int = 0):
    torch.manual_seed(seed)
    layers: List[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def run_cpu(config: str, steps: int, every: int, width: int, depth: int, batch: int) -> Dict[str, Any]:
    model, opt = build(width, depth)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(batch, width, generator=gen) for _ in range(4)]
    ys = [torch.randint(0, 10, (batch,), generator=gen) for _ in range(4)]
    root = tempfile.mkdtemp(prefix="bench_lazy_", dir=os.environ.get("BENCH_DIR"))
    stalls: List[float] = []
    mgr: Any = None
    xla_mgr: Any = None
    pending_dcp: Any = None
    dcp_dirs: List[str] = []
    guard_wait = [0.0]

    def train_step(i: int) -> None:
        loss = torch.nn.functional.cross_entropy(model(xs[i % 4]), ys[i % 4])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    if config in ("eager", "lazy"):
        from async_ckpt import CheckpointManager

        mgr = CheckpointManager(root, save_interval=every, max_to_keep=2, lazy=(config == "lazy"))
    elif config == "torch_xla manager":
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        from torch_xla.experimental.distributed_checkpoint import CheckpointManager as XlaCM

        xla_mgr = XlaCM(root, every, max_to_keep=2, process_group=dist.new_group(backend="gloo"),
                        chkpt_on_preemption=False)  # its default needs IP discovery (TPU only)

    for i in range(3):  # warm-up (and a first save, so buffers/pools/threads exist)
        train_step(i)
    if mgr is not None:
        mgr.save_async(0, {"model": model.state_dict(), "optim": opt.state_dict()}, force=True)
        mgr.join()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor))

    t_start = time.perf_counter()
    for step in range(1, steps + 1):
        if step % every == 0 and config != "none":
            pc = None
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            t0 = time.perf_counter()
            if mgr is not None:
                mgr.save_async(step, sd)
                pending = mgr.stager.lazy.pending
                pc = pending[-1] if pending else None
            elif config == "dcp.async_save":
                import torch.distributed.checkpoint as dcp

                if pending_dcp is not None:
                    pending_dcp.result()
                    while len(dcp_dirs) > 2:
                        shutil.rmtree(dcp_dirs.pop(0), ignore_errors=True)
                d = os.path.join(root, str(step))
                dcp_dirs.append(d)
                pending_dcp = dcp.async_save(sd, checkpoint_id=d)
                pc = None
            elif xla_mgr is not None:
                xla_mgr.save_async(step, sd)
                pc = None
            stalls.append(time.perf_counter() - t0)
            train_step(step)
            if pc is not None:
                stalls[-1] += pc.waited_s  # what the guard made this step wait
                guard_wait[0] += pc.waited_s
        else:
            train_step(step)
    loop = time.perf_counter() - t_start
    t_end = time.perf_counter()
    if mgr is not None:
        mgr.close()
    if pending_dcp is not None:
        pending_dcp.result()
    if xla_mgr is not None:
        xla_mgr.join()
    drain = time.perf_counter() - t_end
    shutil.rmtree(root, ignore_errors=True)
    return {"config": config, "loop_s": loop, "drain_s": drain, "saves": len(stalls), "stalls_s": stalls,
            "guard_wait_s": guard_wait[0], "state_mib": nbytes / MiB, "steps": steps}


def run_xla(tensor_counts: List[int], mibs: List[int]) -> List[Dict[str, Any]]:
    import torch_xla

    from async_ckpt import CheckpointManager

    dev = torch_xla.device()
    rows = []
    for n in tensor_counts:
        for mib in mibs:
            numel = mib * MiB // 4 // n
            sd = {f"t{i}": torch.randn(numel).to(dev) for i in range(n)}
            torch_xla.sync()
            for lazy in (False, True):
                root = tempfile.mkdtemp(prefix="bench_lazy_xla_", dir=os.environ.get("BENCH_DIR"))
                with CheckpointManager(root, max_to_keep=1, lazy=lazy) as mgr:
                    times = []
                    for step in range(4):
                        for t in sd.values():
                            t.add_(1.0)  # the state changes between saves, as in training
                        torch_xla.sync()
                        t0 = time.perf_counter()
                        mgr.save_async(step, sd)
                        times.append(time.perf_counter() - t0)
                        mgr.join()
                shutil.rmtree(root, ignore_errors=True)
                rows.append({"tensors": n, "mib": mib, "lazy": lazy, "save_async_s": statistics.median(times[1:])})
            del sd
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=2, help="runs per configuration, interleaved; the fastest counts")
    ap.add_argument("--xla-tensors", default="8,64,512")
    ap.add_argument("--xla-mib", default="32,256")
    ap.add_argument("--skip-xla", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="directory for the JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.child == "xla":
            out = run_xla([int(x) for x in args.xla_tensors.split(",")], [int(x) for x in args.xla_mib.split(",")])
        else:
            out = run_cpu(args.child, args.steps, args.every, args.width, args.depth, args.batch)
        print("RESULT " + json.dumps(out))
        return

    def child(name: str) -> Any:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name] + [
            f"--steps={args.steps}", f"--every={args.every}", f"--width={args.width}", f"--depth={args.depth}",
            f"--batch={args.batch}", f"--xla-tensors={args.xla_tensors}", f"--xla-mib={args.xla_mib}"]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        return {"config": name, "error": (p.stderr or p.stdout).strip().splitlines()[-1:] or ["failed"]}

    names = args.configs.split(",")
    runs: Dict[str, List[Any]] = {c: [] for c in names}
    for _ in range(args.rounds):  # interleaved, so a noisy minute hits every configuration alike
        for c in names:
            runs[c].append(child(c))
    results = []
    for c in names:
        ok = [r for r in runs[c] if "loop_s" in r]
        results.append(min(ok, key=lambda r: r["loop_s"]) if ok else runs[c][0])
        if ok:
            results[-1]["all_loop_s"] = [r["loop_s"] for r in ok]
    base = next((r["loop_s"] for r in results if r.get("config") == "none" and "loop_s" in r), None)
    print(f"\nCPU loop: MLP {args.depth}x{args.width}, Adam, batch {args.batch}, {args.steps} steps, "
          f"save every {args.every}; state {results[0].get('state_mib', 0):.0f} MiB; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; fastest of {args.rounds} interleaved runs")
    print("| method | loop s | overhead s | overhead % | per-save stall median s | max s | guard wait s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['config']} | failed: {r['error'][0][:80]} | | | | | |")
            continue
        ov = r["loop_s"] - base if base is not None else float("nan")
        base_ = base if base else float("nan")
        st = r["stalls_s"]
        med = statistics.median(st) if st else 0.0
        print(f"| {r['config']} | {r['loop_s']:.2f} | {ov:+.2f} | {100 * ov / base_:+.1f}% | {med:.3f} | "
              f"{max(st) if st else 0:.3f} | {r['guard_wait_s']:.3f} |")
    xla = None
    if not args.skip_xla:
        xla = child("xla")
        print("\nXLA (PJRT CPU): save_async blocking time (median of 3), eager vs lazy")
        print("| tensors | MiB | eager s | lazy s |")
        print("| --- | --- | --- | --- |")
        if isinstance(xla, dict):
            print(f"| failed: {xla.get('error')} | | | |")
        else:
            for n in sorted({r["tensors"] for r in xla}):
                for mib in sorted({r["mib"] for r in xla}):
                    e = next(r for r in xla if r["tensors"] == n and r["mib"] == mib and not r["lazy"])
                    lz = next(r for r in xla if r["tensors"] == n and r["mib"] == mib and r["lazy"])
                    print(f"| {n} | {mib} | {e['save_async_s']:.4f} | {lz['save_async_s']:.4f} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_lazy_{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "cpu": results, "cpu_runs": runs, "xla": xla, "host": platform.node(),
                   "torch": torch.__version__}, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
