"""Does training keep its speed while a checkpoint is written? (issue 37)

Two loops, each run while checkpoints are written in the background, against the same loop
without a checkpoint measured right before (paired), methods interleaved round by round:

* **launch-bound**: one Python thread dispatching tiny tensor ops (as a GPU training loop
  dispatching kernels does: the GIL is released and retaken at every op). For each sample the
  loop's rate is measured for ``--ref-s`` seconds, then a save starts and the loop runs until
  the save is durable. *lost* = the window's length minus the time the loop's work in it takes
  at the reference rate: the training time the background write cost. The stall (the call
  itself) is reported apart.
* **cpu-bound**: an MLP trained with AdamW on the CPU, checkpointing its model + optimizer state
  every ``--every`` steps; *cost per checkpoint* = (run with checkpoints - the same run without)
  / number of checkpoints, paired run by run.

Methods: ``floor`` (a plain thread doing ``os.write`` + ``fsync`` of the same bytes from an
existing host copy: what any thread writer costs at least), async_ckpt (``ours``, ``ours-lazy``,
``ours-incremental``, ``ours-tiered``: a local tier and a second root every save),
``dcp-thread``, ``dcp-process`` (``dcp.async_save`` thread and process executors),
``dcp-stager`` (thread mode with one reused ``DefaultStager``), ``torch-save`` (synchronous,
cpu-bound only) and, where installed (the newest-torch environment), ``torch-checkpointing``
and ``lightning`` (Lightning's ``AsyncCheckpointIO`` over ``TorchCheckpointIO``).

Usage::

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_training_speed.py              # both loops, 512 MiB
    .venv/bin/python benchmarks/bench_training_speed.py --loop launch --methods floor,ours,dcp-process
    .venv-newest/bin/python benchmarks/bench_training_speed.py --loop cpu             # with the peers
    .venv/bin/python benchmarks/bench_training_speed.py --smoke --out /tmp/b          # seconds: the test

Results: ``--out``/bench_training_speed.json (every sample, medians, spreads, ratios to the
floor and to DCP's process mode paired by round) and a chart (``--chart``).
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
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import machine_info, parse_size, small_state, tensors_of, transformer_state  # noqa: E402

MiB = 2**20


# ---- methods: start a save in the background, tell when it is durable ----------------------------

class Method:
    """One way to checkpoint: ``start`` returns once training may go on; ``done`` says (cheaply,
    it is polled by the loop) whether the save is durable; ``finish`` waits for it and raises its
    error."""

    name = "?"

    def __init__(self, root: str) -> None:
        self.root = os.path.join(root, self.name)
        os.makedirs(self.root, exist_ok=True)

    def start(self, i: int, sd: Dict[str, Any]) -> Any:
        raise NotImplementedError

    def done(self, h: Any) -> bool:
        raise NotImplementedError

    def finish(self, h: Any) -> None:
        pass

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class Floor(Method):
    """A plain thread writing the tensors' bytes with ``os.write`` and ``fsync``, from host
    tensors that already exist (no copy): the least any thread writer can cost the loop."""

    name = "floor"

    def start(self, i: int, sd: Dict[str, Any]) -> Any:
        ts = [t for t in tensors_of(sd) if t.numel()]
        path = os.path.join(self.root, f"{i}.bin")

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for t in ts:
                    mv = memoryview(t.detach().numpy()).cast("B")
                    while mv:
                        mv = mv[os.write(fd, mv):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.remove(path)

        th = threading.Thread(target=write, daemon=True)
        th.start()
        return th

    def done(self, h: Any) -> bool:
        return not h.is_alive()

    def finish(self, h: Any) -> None:
        h.join()


class Ours(Method):
    name = "ours"
    kwargs: Dict[str, Any] = {}

    def __init__(self, root: str) -> None:
        super().__init__(root)
        from async_ckpt import CheckpointManager

        self.mgr = CheckpointManager(os.path.join(self.root, "ckpt"), max_to_keep=2, **self._kwargs())

    def _kwargs(self) -> Dict[str, Any]:
        return dict(self.kwargs)

    def start(self, i: int, sd: Dict[str, Any]) -> Any:
        self.mgr.save_async(i, sd, force=True)
        return None

    def done(self, h: Any) -> bool:
        return all(r.writer.pending == 0 for r in self.mgr.roots)

    def finish(self, h: Any) -> None:
        self.mgr.join()

    def close(self) -> None:
        self.mgr.close()
        super().close()


class OursThread(Ours):
    """The writer thread instead of the writer process (``writer="thread"``)."""

    name = "ours-thread"
    kwargs = {"writer": "thread"}


class OursLazy(Ours):
    name = "ours-lazy"
    kwargs = {"lazy": True}


class OursIncremental(Ours):
    """Incremental saves; the loop changes a quarter of the tensors between saves."""

    name = "ours-incremental"
    kwargs = {"incremental": True}
    changes = 0.25


class OursTiered(Ours):
    """A local tier and a persistent root, both due at every save."""

    name = "ours-tiered"

    def _kwargs(self) -> Dict[str, Any]:
        return {"local_dir": os.path.join(self.root, "local"), "local_policy": 1, "save_interval": 1}


class DcpBase(Method):
    executor = "thread"
    cached = False

    def __init__(self, root: str) -> None:
        super().__init__(root)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.dcp = dcp
        self.kind = AsyncCheckpointerType.PROCESS if self.executor == "process" else AsyncCheckpointerType.THREAD
        self.stager: Any = None
        if self.cached:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=False))
        if self.executor == "process":  # the process executor needs a process group
            _ensure_process_group(root)
        self.last: Optional[str] = None

    def start(self, i: int, sd: Dict[str, Any]) -> Any:
        path = os.path.join(self.root, str(i))
        kw: Dict[str, Any] = {"async_checkpointer_type": self.kind}
        if self.stager is not None:
            kw["async_stager"] = self.stager
        import torch.distributed as dist

        if self.executor != "process" and not dist.is_initialized():
            kw["no_dist"] = True
        resp = self.dcp.async_save(sd, checkpoint_id=path, **kw)
        fut = getattr(resp, "upload_completion", resp)
        return fut, path

    def done(self, h: Any) -> bool:
        return h[0].done()

    def finish(self, h: Any) -> None:
        h[0].result()
        if self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = h[1]

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        super().close()


class DcpThread(DcpBase):
    name = "dcp-thread"


class DcpProcess(DcpBase):
    name = "dcp-process"
    executor = "process"


class DcpStager(DcpBase):
    name = "dcp-stager"
    cached = True


class TorchCheckpointing(Method):
    """meta-pytorch torch_checkpointing's ``CheckpointManager`` with its default (async) saver:
    a pinned/shared-memory stager and a writer process (newest torch only)."""

    name = "torch-checkpointing"

    def __init__(self, root: str) -> None:
        super().__init__(root)
        import torch_checkpointing as tc
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        # O_DIRECT off: on this machine's ext4 its unaligned O_DIRECT writes fail with EINVAL
        # (torch_checkpointing 0.1.1 falls back only when the open fails)
        self.mgr = tc.CheckpointManager(tc.CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
        self.last: Optional[str] = None

    def start(self, i: int, sd: Dict[str, Any]) -> Any:
        path = os.path.join(self.root, str(i))
        return path, self.mgr.save(path, sd)

    def done(self, h: Any) -> bool:
        return h[1] is None or h[1].done()

    def finish(self, h: Any) -> None:
        if h[1] is not None:
            h[1].result()
        if self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = h[0]

    def close(self) -> None:
        self.mgr.close()
        super().close()


class LightningAsync(Method):
    """Lightning's AsyncCheckpointIO (a thread pool around TorchCheckpointIO's torch.save)."""

    name = "lightning"

    def __init__(self, root: str) -> None:
        super().__init__(root)
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def start(self, i: int, sd: Dict[str, Any]) -> Any:
        path = os.path.join(self.root, f"{i}.ckpt")
        self.io.save_checkpoint(sd, path)
        # its one worker runs jobs in order: this one ends when the save has
        return path, self.io._executor.submit(lambda: None)

    def done(self, h: Any) -> bool:
        return h[1].done()

    def finish(self, h: Any) -> None:
        h[1].result()
        if os.path.exists(h[0]):
            os.remove(h[0])

    def close(self) -> None:
        self.io.teardown()
        super().close()


class TorchSave(Method):
    """Synchronous ``torch.save`` + ``fsync`` (cpu-bound loop only)."""

    name = "torch-save"

    def start(self, i: int, sd: Dict[str, Any]) -> Any:
        path = os.path.join(self.root, f"{i}.pt")
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        os.remove(path)
        return None

    def done(self, h: Any) -> bool:
        return True


METHODS: Dict[str, Callable[[str], Method]] = {
    m.name: m for m in (Floor, Ours, OursThread, OursLazy, OursIncremental, OursTiered, DcpThread, DcpProcess, DcpStager,
                        TorchCheckpointing, LightningAsync, TorchSave)
}
LAUNCH_DEFAULT = "floor,ours,ours-thread,ours-lazy,ours-incremental,ours-tiered,dcp-thread,dcp-process,dcp-stager," \
                 "torch-checkpointing,lightning"
CPU_DEFAULT = "ours,ours-lazy,dcp-stager,dcp-process,torch-checkpointing,lightning,torch-save"


_PG = False


def _ensure_process_group(root: str) -> None:
    global _PG
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(root, "pg_store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    _PG = True


def available(names: List[str], root: str, log: Callable[[str], None]) -> List[Method]:
    out: List[Method] = []
    for n in names:
        try:
            out.append(METHODS[n](root))
        except ImportError as exc:
            log(f"  skipped {n}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a peer that does not run here is reported, not fatal
            log(f"  skipped {n}: {type(exc).__name__}: {exc}")
    return out


# ---- the launch-bound loop -----------------------------------------------------------------------

class _Step(torch.nn.Module):
    """20 tiny ops per call: a module's forward, as a training loop's work comes (lazy saves
    seal their copies at module calls, so the loop must make some)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(20):
            x.add_(1.0)
        return x


_STEP = _Step()


def _spin(x: torch.Tensor, seconds: float) -> int:
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        _STEP(x)
        n += 20
    return n


def _mutate(sd: Dict[str, Any], fraction: float, i: int) -> None:
    ts = [t for t in tensors_of(sd) if t.numel() > 1024] or tensors_of(sd)  # a state of small tensors: all
    k = max(1, int(len(ts) * fraction))
    with torch.no_grad():
        for t in ts[(i * k) % len(ts):][:k]:
            t.add_(1.0)


def _cached_bytes() -> int:
    """The page cache's size (``Cached`` in /proc/meminfo), 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Cached:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def launch_sample(m: Method, i: int, sd: Dict[str, Any], ref_s: float, limit_s: float) -> Dict[str, float]:
    x = torch.zeros(8)
    if getattr(m, "changes", 0):
        _mutate(sd, m.changes, i)
    gc.collect()
    time.sleep(0.05)
    rate = _spin(x, ref_s) / ref_s
    cached = _cached_bytes()
    t0 = time.perf_counter()
    h = m.start(i, sd)
    t1 = time.perf_counter()
    n = 0
    while True:
        _STEP(x)
        n += 20
        if m.done(h) or time.perf_counter() - t1 > limit_s:
            break
    t2 = time.perf_counter()
    m.finish(h)
    window = t2 - t1
    return {"stall_s": t1 - t0, "window_s": window, "lost_s": window - n / rate,
            "speed": (n / rate) / window if window > 0 else 1.0, "ref_rate": rate,
            "page_cache_growth_b": float(_cached_bytes() - cached)}


# ---- the cpu-bound loop --------------------------------------------------------------------------

def mlp(state_mib: int, seed: int = 0) -> torch.nn.Module:
    """An MLP whose parameters + AdamW state are about ``state_mib`` MiB (params are a third)."""
    torch.manual_seed(seed)
    d = 1024
    layers = max(1, round(state_mib * MiB / 3 / (4 * (d * d + d))))
    mods: List[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(d, d), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def cpu_run(m: Optional[Method], model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, every: int,
            batch: torch.Tensor, tag: int) -> Dict[str, float]:
    gc.collect()
    pending: Any = None
    t0 = time.perf_counter()
    saves = 0
    for s in range(steps):
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if m is not None and (s + 1) % every == 0:
            if pending is not None:
                m.finish(pending)
            pending = m.start(tag * 1000 + s, {"model": model.state_dict(), "optim": opt.state_dict()})
            saves += 1
    if m is not None and pending is not None:
        m.finish(pending)
    return {"elapsed_s": time.perf_counter() - t0, "saves": saves}


# ---- driver --------------------------------------------------------------------------------------

def _summary(vals: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def run_launch(args: argparse.Namespace, root: str, log: Callable[[str], None]) -> Dict[str, Any]:
    if args.tensors:  # many small tensors instead (e.g. 10000x4K)
        _, total, count = parse_size(args.tensors)
        sd = small_state(count, total // count)
    else:
        sd = transformer_state(args.size_mib * MiB)
    log(f"launch-bound loop, state {sum(t.nbytes for t in tensors_of(sd)) / MiB:.0f} MiB in "
        f"{len(tensors_of(sd))} tensors")
    methods = available([n for n in args.methods_launch.split(",") if n and n != "torch-save"], root, log)
    samples: Dict[str, List[Dict[str, float]]] = {m.name: [] for m in methods}
    try:
        for m in methods:  # warm-up: pools, page faults, first-call costs
            for w in range(args.warmup):
                launch_sample(m, 10_000 + w, sd, args.ref_s, args.limit_s)
        for r in range(args.samples):
            for m in methods:
                s = launch_sample(m, r, sd, args.ref_s, args.limit_s)
                samples[m.name].append(s)
                log(f"  round {r} {m.name:<20} stall {s['stall_s'] * 1e3:7.1f} ms  window {s['window_s'] * 1e3:7.0f} ms"
                    f"  lost {s['lost_s'] * 1e3:7.1f} ms  speed {s['speed'] * 100:5.1f}%")
    finally:
        for m in methods:
            m.close()
    out: Dict[str, Any] = {"state_mib": sum(t.nbytes for t in tensors_of(sd)) / MiB, "tensors": len(tensors_of(sd)),
                           "methods": {}}
    for name, ss in samples.items():
        res: Dict[str, Any] = {"samples": ss}
        for key in ("stall_s", "window_s", "lost_s", "speed", "page_cache_growth_b"):
            res[key] = _summary([s[key] for s in ss])
        for ref in ("floor", "dcp-process"):
            if ref in samples and ref != name and len(samples[ref]) == len(ss):
                ratios = [s["lost_s"] / max(f["lost_s"], 1e-3) for s, f in zip(ss, samples[ref])]
                res[f"lost_vs_{ref}"] = _summary(ratios)
        out["methods"][name] = res
    return out


def _rank_main(rank: int, args: argparse.Namespace, root: str, store_path: str, out_path: str) -> None:
    """One rank of ``--ranks N``: its own part of the state, the launch-bound loop, its samples."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, args.ranks)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.ranks)
    global _PG
    _PG = True
    sd = transformer_state(args.size_mib * MiB // args.ranks, seed=rank)
    sd = {f"rank{rank}": sd["model"], "step": 0}
    names = [n for n in args.methods_launch.split(",") if n in RANK_METHODS]
    # one checkpoint root for all ranks; the floor writes a file per rank
    methods = [METHODS[n](os.path.join(root, f"r{rank}") if n == "floor" else os.path.join(root, "shared"))
               for n in names]
    samples: Dict[str, List[Dict[str, float]]] = {m.name: [] for m in methods}
    try:
        for m in methods:
            for w in range(args.warmup):
                dist.barrier()
                launch_sample(m, 10_000 + w, sd, args.ref_s, args.limit_s)
        for r in range(args.samples):
            for m in methods:
                dist.barrier()
                samples[m.name].append(launch_sample(m, r, sd, args.ref_s, args.limit_s))
        dist.barrier()
    finally:
        for m in methods:
            m.close()
    with open(out_path, "w") as f:
        json.dump(samples, f)
    dist.destroy_process_group()


#: methods that run in every rank of ``--ranks N`` (the others are one-process only)
RANK_METHODS = ("floor", "ours", "ours-thread", "ours-lazy", "ours-incremental", "dcp-thread", "dcp-process")


def run_launch_ranks(args: argparse.Namespace, root: str, log: Callable[[str], None]) -> Dict[str, Any]:
    """``--ranks N``: N gloo processes, each with 1/N of the state, each running the loop."""
    import torch.multiprocessing as mp

    log(f"launch-bound loop on {args.ranks} ranks, {args.size_mib} MiB state in all")
    store_path = os.path.join(root, "store")
    outs = [os.path.join(root, f"out{r}.json") for r in range(args.ranks)]
    mp.start_processes(_rank_entry, args=(args, root, store_path, outs), nprocs=args.ranks, start_method="spawn")
    per_rank = []
    for o in outs:
        with open(o) as f:
            per_rank.append(json.load(f))
    out: Dict[str, Any] = {"state_mib": args.size_mib, "ranks": args.ranks, "tensors": None, "methods": {}}
    for name in per_rank[0]:
        # a save's cost to the job: the rank that lost the most in each round
        ss = [max((rk[name][i] for rk in per_rank), key=lambda s: s["lost_s"]) for i in range(len(per_rank[0][name]))]
        res: Dict[str, Any] = {"samples": ss}
        for key in ("stall_s", "window_s", "lost_s", "speed"):
            res[key] = _summary([s[key] for s in ss])
        out["methods"][name] = res
    floor = out["methods"].get("floor")
    for name, res in out["methods"].items():
        if floor is not None and name != "floor":
            res["lost_vs_floor"] = _summary([s["lost_s"] / max(f["lost_s"], 1e-3)
                                             for s, f in zip(res["samples"], floor["samples"])])
    for name, res in out["methods"].items():
        log(f"  {name:<20} lost {_ms(res['lost_s'])}  speed {res['speed']['median'] * 100:.0f}%")
    return out


def _rank_entry(rank: int, args: argparse.Namespace, root: str, store_path: str, outs: List[str]) -> None:
    _rank_main(rank, args, root, store_path, outs[rank])


def run_cpu(args: argparse.Namespace, root: str, log: Callable[[str], None]) -> Dict[str, Any]:
    model = mlp(args.size_mib)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(args.batch, 1024)
    cpu_run(None, model, opt, 2, 10**9, batch, 0)  # optimizer state exists from here on
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of({"m": model.state_dict(),
                                                                      "o": opt.state_dict()["state"]}))
    log(f"cpu-bound loop: MLP + AdamW, state {nbytes / MiB:.0f} MiB, a checkpoint every {args.every} steps")
    methods = available([n for n in args.methods_cpu.split(",") if n and n != "floor"], root, log)
    rows: Dict[str, List[Dict[str, float]]] = {m.name: [] for m in methods}
    try:
        for m in methods:
            cpu_run(m, model, opt, args.every, args.every, batch, 99)  # warm-up: one save
        for r in range(args.samples):
            for m in methods:
                base = cpu_run(None, model, opt, args.steps, args.every, batch, r)
                run = cpu_run(m, model, opt, args.steps, args.every, batch, r)
                cost = (run["elapsed_s"] - base["elapsed_s"]) / max(1, run["saves"])
                rows[m.name].append({"base_s": base["elapsed_s"], "with_s": run["elapsed_s"], "saves": run["saves"],
                                     "cost_per_ckpt_s": cost, "slowdown": run["elapsed_s"] / base["elapsed_s"]})
                log(f"  round {r} {m.name:<20} base {base['elapsed_s']:6.2f} s  with {run['elapsed_s']:6.2f} s"
                    f"  cost/ckpt {cost * 1e3:7.1f} ms  slowdown {run['elapsed_s'] / base['elapsed_s']:.3f}x")
    finally:
        for m in methods:
            m.close()
    out: Dict[str, Any] = {"state_mib": nbytes / MiB, "every": args.every, "steps": args.steps, "methods": {}}
    for name, ss in rows.items():
        res: Dict[str, Any] = {"samples": ss}
        for key in ("cost_per_ckpt_s", "slowdown"):
            res[key] = _summary([s[key] for s in ss])
        for ref in ("torch-save", "ours"):  # paired by round (ours: e.g. ours-lazy against an eager save)
            if ref in rows and name != ref:
                ratios = [s["cost_per_ckpt_s"] / max(t["cost_per_ckpt_s"], 1e-3) for s, t in zip(ss, rows[ref])]
                res[f"cost_vs_{ref}"] = _summary(ratios)
        out["methods"][name] = res
    return out


def markdown(report: Dict[str, Any]) -> str:
    lines: List[str] = []
    env = report["machine"]
    lines.append(f"torch {env.get('torch')}; `nproc` = {env.get('nproc')}; {report['args']['samples']} rounds, "
                 "methods interleaved in each; median [min, max].")
    if "launch" in report:
        lr = report["launch"]
        lines += ["", f"Launch-bound loop, {lr['state_mib']:.0f} MiB state in {lr['tensors']} tensors:", "",
                  "| method | stall | loop time lost during the write | loop speed during the write | lost / floor (paired) "
                  "| page cache grown by a save |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, res in lr["methods"].items():
            ratio = res.get("lost_vs_floor")
            lines.append(f"| {name} | {res['stall_s']['median'] * 1e3:.1f} ms | {_ms(res['lost_s'])} | "
                         f"{res['speed']['median'] * 100:.0f}% [{res['speed']['min'] * 100:.0f}, "
                         f"{res['speed']['max'] * 100:.0f}] | {_x(ratio)} | "
                         f"{res['page_cache_growth_b']['median'] / MiB:.0f} MiB |")
    if "launch_ranks" in report:
        lr = report["launch_ranks"]
        lines += ["", f"Launch-bound loop on {lr['ranks']} gloo ranks, {lr['state_mib']} MiB state in all "
                      "(each round: the rank that lost most):", "",
                  "| method | stall | loop time lost during the write | loop speed during the write | lost / floor (paired) |",
                  "| --- | --- | --- | --- | --- |"]
        for name, res in lr["methods"].items():
            lines.append(f"| {name} | {res['stall_s']['median'] * 1e3:.1f} ms | {_ms(res['lost_s'])} | "
                         f"{res['speed']['median'] * 100:.0f}% [{res['speed']['min'] * 100:.0f}, "
                         f"{res['speed']['max'] * 100:.0f}] | {_x(res.get('lost_vs_floor'))} |")
    if "cpu" in report:
        cr = report["cpu"]
        lines += ["", f"CPU-bound loop (MLP + AdamW, {cr['state_mib']:.0f} MiB state, a checkpoint every "
                      f"{cr['every']} steps):", "",
                  "| method | cost per checkpoint | slowdown | cost / torch.save's (paired) | cost / ours's (paired) |",
                  "| --- | --- | --- | --- | --- |"]
        for name, res in cr["methods"].items():
            lines.append(f"| {name} | {_ms(res['cost_per_ckpt_s'])} | {res['slowdown']['median']:.3f}x | "
                         f"{_x(res.get('cost_vs_torch-save'))} | {_x(res.get('cost_vs_ours'))} |")
    return "\n".join(lines) + "\n"


def _ms(s: Dict[str, float]) -> str:
    return f"{s['median'] * 1e3:.0f} ms [{s['min'] * 1e3:.0f}, {s['max'] * 1e3:.0f}]"


def _x(s: Optional[Dict[str, float]]) -> str:
    return "-" if s is None else f"{s['median']:.2f}x [{s['min']:.2f}, {s['max']:.2f}]"


def chart(report: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("launch", "cpu") if k in report]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        ms = report[key]["methods"]
        metric = "lost_s" if key == "launch" else "cost_per_ckpt_s"
        names = list(ms)
        med = [ms[n][metric]["median"] * 1e3 for n in names]
        lo = [m - ms[n][metric]["min"] * 1e3 for n, m in zip(names, med)]
        hi = [ms[n][metric]["max"] * 1e3 - m for n, m in zip(names, med)]
        ax.barh(names, med, xerr=[lo, hi], color=["tab:green" if n.startswith("ours") else "tab:gray" for n in names])
        ax.set_xlabel("loop time lost per save (ms)" if key == "launch" else "training time per checkpoint (ms)")
        ax.set_title("launch-bound loop" if key == "launch" else "CPU-bound loop (MLP + AdamW)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loop", choices=["launch", "cpu", "both"], default="both")
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--tensors", default=None,
                   help="launch-bound: a state of small tensors instead of --size-mib's, e.g. 10000x4K")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ref-s", type=float, default=0.5, help="launch-bound: reference window before each save")
    p.add_argument("--limit-s", type=float, default=30.0, help="launch-bound: give up waiting for a save")
    p.add_argument("--methods-launch", default=LAUNCH_DEFAULT)
    p.add_argument("--methods-cpu", default=CPU_DEFAULT)
    p.add_argument("--steps", type=int, default=20, help="cpu-bound: training steps per run")
    p.add_argument("--every", type=int, default=5, help="cpu-bound: a checkpoint every this many steps")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ranks", type=int, default=1, help="launch-bound: also run it on N gloo ranks")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--chart", default=None, help="PNG path (default: <out>/bench_training_speed.png)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.size_mib, args.samples, args.warmup, args.ref_s, args.steps, args.every, args.batch = 8, 1, 0, 0.05, 4, 2, 8
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench_training_speed_", dir=args.dir)

    def log(msg: str) -> None:
        print(msg, flush=True)

    report: Dict[str, Any] = {"machine": {**machine_info(), "torch": torch.__version__}, "args": vars(args)}
    try:
        if args.loop in ("launch", "both"):
            report["launch"] = run_launch(args, root, log)
            if args.ranks > 1:
                report["launch_ranks"] = run_launch_ranks(args, root, log)
        if args.loop in ("cpu", "both"):
            report["cpu"] = run_cpu(args, root, log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open(os.path.join(args.out, "bench_training_speed.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    print(md)
    chart(report, args.chart or os.path.join(args.out, "bench_training_speed.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
