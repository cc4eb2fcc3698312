"""Save-path benchmark: how long a checkpoint stalls training, and how long until it is durable.

One run, the same transformer-like fp32 state dicts for every method (default 256 MiB, 1 GiB,
2 GiB, and 10,000 small tensors of 4 KiB). Each method gets warm-up saves first, then the
median of ``--reps`` (>= 5 by default) steady-state saves is reported. Every sample of every
method starts after ``gc.collect()``, so no method pays for another's garbage.
The torch_xla manager runs last for each size: it initialises a 1-rank gloo group, which the
later sizes' async_ckpt saves then see (they must, and do, still take the single-process path).

CPU tensors:

* ``floor``: ``copy_`` into already allocated host tensors, one tensor at a time;
* ``raw write+fsync``: the same tensor bytes written to one file and fsynced, in the same
  directory as the checkpoints (the disk's ceiling for "durable");
* ``async_ckpt``: ``CheckpointManager.save_async`` (blocking) then ``join`` (durable), with the
  per-phase breakdown from ``mgr.last_stats``; and ``async_ckpt (lazy)``: the same with
  ``lazy=True`` (``save_async`` returns once the copies are issued);
* ``dcp.async_save``: default (a fresh ``DefaultStager`` per call), and ``dcp.async_save (cached
  stager)``: one ``DefaultStager`` reused across saves (its storages are cached and reused;
  pinned when CUDA exists, synchronous staging so that "blocking" means "snapshot taken");
* ``torch.save``: synchronous, into a file that is then fsynced (blocking == durable).

XLA tensors (PJRT CPU; the same state dict moved to the XLA device):

* ``xla .cpu() each``: ``.cpu()`` one tensor at a time;
* ``xla batched``: one ``torch_xla._XLAC._xla_get_cpu_tensors`` call (PyTorch/XLA #5824);
* ``xla dlpack+copy_``: zero-copy DLPack views ``copy_``-ed into preallocated host tensors
  (reference for what the zero-copy path can reach);
* ``async_ckpt`` and torch_xla's own manager
  (``torch_xla.experimental.distributed_checkpoint.CheckpointManager``: it needs a process group,
  so a 1-rank gloo group on a FileStore is created for it) on the XLA tensors. (On CPU tensors
  torch_xla's manager copies nothing -- ``_xla_get_cpu_tensors`` hands back the same storages --
  so it takes no snapshot there and is not timed.)

Also: resident host memory (VmRSS) after the 2nd and the 20th async_ckpt save of one state
dict. Prints markdown tables and the target ratios of issue 3, writes ``bench_save.json`` and
``bench_save.png`` to ``--out``.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_save.py                 # full run
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_save.py --smoke --out /tmp/b   # seconds
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_save.py --sizes 256M --reps 7 --skip-xla
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

warnings.filterwarnings("ignore")

KiB, MiB, GiB = 2**10, 2**20, 2**30

# Method names (the keys of the JSON "results" and the rows of the tables).
FLOOR = "floor (copy_ into allocated)"
RAW = "raw write+fsync"
OURS = "async_ckpt save_async"
OURS_LAZY = "async_ckpt save_async (lazy)"
DCP = "dcp.async_save (default)"
DCP_CACHED = "dcp.async_save (cached stager)"
TSAVE = "torch.save (sync, fsync)"
X_EACH = "xla: .cpu() one by one"
X_BATCHED = "xla: batched _xla_get_cpu_tensors"
X_DLPACK = "xla: dlpack view + copy_"
X_OURS = "xla: async_ckpt save_async"
X_TXLA_MGR = "xla: torch_xla CheckpointManager"

CPU_METHODS = [FLOOR, RAW, OURS, OURS_LAZY, DCP, DCP_CACHED, TSAVE]
XLA_METHODS = [X_EACH, X_BATCHED, X_DLPACK, X_OURS, X_TXLA_MGR]


# ---- state dicts ---------------------------------------------------------------------------------

def parse_size(text: str) -> Tuple[str, int, int]:
    """``"256M"``/``"1G"``/``"512K"``/bytes -> (label, total bytes, 0); ``"10000x4K"`` -> (label,
    total bytes, tensor count): that many small tensors of that size."""
    t = text.strip()
    m = re.fullmatch(r"(\d+)x(\d+)([KMG]?)(i?B)?", t, re.I)
    if m:
        count = int(m.group(1))
        each = int(m.group(2)) * {"": 1, "K": KiB, "M": MiB, "G": GiB}[m.group(3).upper()]
        if count <= 0 or each < 4 or each % 4:
            raise ValueError(f"bad small-tensor size {text!r}: count > 0, tensor bytes a multiple of 4")
        return f"{count}x{_fmt_bytes(each)}", count * each, count
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)(i?B)?", t, re.I)
    if not m:
        raise ValueError(f"bad size {text!r}: use e.g. 256M, 1G, 2G or 10000x4K")
    n = int(float(m.group(1)) * {"": 1, "K": KiB, "M": MiB, "G": GiB}[m.group(2).upper()])
    if n < 64 * KiB:
        raise ValueError(f"size {text!r} is too small (at least 64K)")
    return _fmt_bytes(n), n, 0


def _fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} B"


def transformer_state(total_bytes: int, seed: int = 0) -> Dict[str, Any]:
    """A GPT-like fp32 state dict of about ``total_bytes``: an embedding, N blocks of
    (qkv, attention out, 2 layer norms, MLP up/down with biases), a final norm.

    The embedding absorbs the remainder, so the size is exact to within one row.
    """
    d = 1024 if total_bytes >= 64 * MiB else (256 if total_bytes >= 4 * MiB else 64)
    layer = 4 * (12 * d * d + 13 * d)
    final = 4 * 2 * d
    layers = max(1, round(total_bytes * 0.875 / layer))
    while layers > 1 and total_bytes - layers * layer - final < 4 * d:
        layers -= 1
    vocab = max(1, (total_bytes - layers * layer - final) // (4 * d))
    g = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.empty(*shape).normal_(generator=g)

    sd: Dict[str, Any] = {"embed.weight": t(vocab, d)}
    for i in range(layers):
        p = f"blocks.{i}."
        sd[p + "ln1.weight"], sd[p + "ln1.bias"] = t(d), t(d)
        sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"] = t(3 * d, d), t(3 * d)
        sd[p + "attn.out.weight"], sd[p + "attn.out.bias"] = t(d, d), t(d)
        sd[p + "ln2.weight"], sd[p + "ln2.bias"] = t(d), t(d)
        sd[p + "mlp.up.weight"], sd[p + "mlp.up.bias"] = t(4 * d, d), t(4 * d)
        sd[p + "mlp.down.weight"], sd[p + "mlp.down.bias"] = t(d, 4 * d), t(d)
    sd["ln_f.weight"], sd["ln_f.bias"] = t(d), t(d)
    return {"model": sd, "step": 0}


def small_state(count: int, each_bytes: int, seed: int = 0) -> Dict[str, Any]:
    """``count`` fp32 tensors of ``each_bytes`` each, grouped 10 per "layer"."""
    g = torch.Generator().manual_seed(seed)
    n = each_bytes // 4
    return {"model": {f"layers.{i // 10}.p{i % 10}": torch.empty(n).normal_(generator=g) for i in range(count)},
            "step": 0}


def tensors_of(sd: Any) -> List[torch.Tensor]:
    if isinstance(sd, torch.Tensor):
        return [sd]
    if isinstance(sd, dict):
        return [t for v in sd.values() for t in tensors_of(v)]
    if isinstance(sd, (list, tuple)):
        return [t for v in sd for t in tensors_of(v)]
    return []


def map_tensors(sd: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(sd, torch.Tensor):
        return fn(sd)
    if isinstance(sd, dict):
        return {k: map_tensors(v, fn) for k, v in sd.items()}
    return sd


# ---- helpers -------------------------------------------------------------------------------------

def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def free_memory() -> None:
    gc.collect()
    try:  # give freed arenas back to the OS so the next method starts from the same RSS
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:
        pass


def machine_info() -> Dict[str, Any]:
    info: Dict[str, Any] = {"nproc": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(), "torch": torch.__version__}
    try:
        info["nproc"] = int(subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip())
    except Exception:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        info["loadavg_at_start"] = open("/proc/loadavg").read().split()[:3]
    except Exception:
        pass
    try:
        import torch_xla

        info["torch_xla"] = torch_xla.__version__
    except Exception:
        pass
    info["cuda"] = torch.cuda.is_available()
    info["intra_op_threads"] = torch.get_num_threads()
    return info


class Runner:
    """Runs one method: warm-up, then ``reps`` timed saves; returns the samples."""

    def __init__(self, reps: int, warmup: int, log: Callable[[str], None], budget_s: float = 0.0,
                 min_reps: int = 3, deadline: Optional[float] = None) -> None:
        self.reps, self.warmup, self.log = reps, warmup, log
        self.budget_s, self.min_reps, self.deadline = budget_s, min(min_reps, reps), deadline

    def run(self, name: str, label: str, fn: Callable[[int], Dict[str, float]],
            after: Optional[Callable[[int], None]] = None) -> Dict[str, Any]:
        samples: List[Dict[str, float]] = []
        t_start = time.perf_counter()
        for i in range(self.warmup + self.reps):
            # Every method starts each sample with no garbage pending, as timeit does: otherwise
            # a full collection owed by one method's allocations lands in whichever runs next.
            gc.collect()
            s = fn(i)
            if after is not None:
                after(i)
            if i >= self.warmup:
                samples.append(s)
                # --method-budget / --deadline: stop after min_reps (its n is reported)
                if len(samples) >= self.min_reps and (
                        (self.budget_s and time.perf_counter() - t_start > self.budget_s)
                        or (self.deadline is not None and time.time() > self.deadline)):
                    break
        out: Dict[str, Any] = {"samples": samples, "n": len(samples)}
        for key in samples[0]:
            vals = [s[key] for s in samples if s.get(key) is not None]
            if vals:
                out[key] = statistics.median(vals)
        dur = out.get("durable_s")
        self.log(f"  {label:>10} {name:<36} blocking {out['blocking_s'] * 1e3:9.1f} ms"
                 + (f"   durable {dur * 1e3:9.1f} ms" if dur is not None else "")
                 + f"   (n={len(samples)}, {time.perf_counter() - t_start:.1f}s)")
        return out


def _timed_pair(start: Callable[[], Any], finish: Callable[[Any], Any]) -> Dict[str, float]:
    t0 = time.perf_counter()
    h = start()
    t1 = time.perf_counter()
    finish(h)
    t2 = time.perf_counter()
    return {"blocking_s": t1 - t0, "durable_s": t2 - t0}


# ---- methods -------------------------------------------------------------------------------------

def bench_floor(r: Runner, label: str, sd: Any) -> Dict[str, Any]:
    src = tensors_of(sd)
    dst = [torch.empty_like(t) for t in src]

    def once(_: int) -> Dict[str, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            for d, s in zip(dst, src):
                d.copy_(s)
        return {"blocking_s": time.perf_counter() - t0}

    r.reps, reps = max(r.reps, 9), r.reps  # cheap: more samples for a steadier denominator
    try:
        return r.run(FLOOR, label, once)
    finally:
        r.reps = reps
        del dst


def bench_raw(r: Runner, label: str, sd: Any, root: str) -> Dict[str, Any]:
    src = [t.contiguous() for t in tensors_of(sd)]
    d = os.path.join(root, "raw")
    os.makedirs(d, exist_ok=True)

    def once(i: int) -> Dict[str, float]:
        t0 = time.perf_counter()
        with open(os.path.join(d, f"{i}.bin"), "wb", buffering=0) as f:
            for t in src:
                f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        return {"blocking_s": dt, "durable_s": dt}

    try:
        return r.run(RAW, label, once, after=lambda i: os.remove(os.path.join(d, f"{i}.bin")))
    finally:
        rmtree(d)


def bench_async_ckpt(r: Runner, label: str, sd: Any, root: str, name: str = OURS,
                     paired_floor: bool = False, lazy: bool = False) -> Dict[str, Any]:
    """``paired_floor``: also time the floor copy right before each save (same moment, same
    machine state), so that the ratio to the floor is immune to load that changes over minutes.
    ``lazy``: ``save_async`` returns once the copies are issued (they finish in the background)."""
    from async_ckpt import CheckpointManager

    d = os.path.join(root, "async_ckpt")
    mgr = CheckpointManager(d, max_to_keep=0, lazy=lazy)
    src = tensors_of(sd) if paired_floor else []
    dst = [torch.empty_like(t) for t in src]

    def once(i: int) -> Dict[str, float]:
        floor = None
        if dst:
            t0 = time.perf_counter()
            with torch.no_grad():
                for a, b in zip(dst, src):
                    a.copy_(b)
            floor = time.perf_counter() - t0
        s = _timed_pair(lambda: mgr.save_async(i, sd), lambda _: mgr.join())
        if floor is not None:
            s["paired_floor_s"] = floor
            s["paired_ratio"] = s["blocking_s"] / floor
        st = mgr.last_stats
        assert st is not None and st.step == i, "async_ckpt did not record the save"
        s.update(stage_s=st.stage_s, queue_wait_s=st.queue_wait_s,
                 write_s=st.write_s, commit_s=st.commit_s, files=st.files)
        return s

    try:
        out = r.run(name, label, once, after=lambda i: rmtree(os.path.join(d, str(i))))
        out["pool_allocations"] = mgr.stager.pool.allocations
        out["pool_allocated_bytes"] = mgr.stager.pool.allocated_bytes
        return out
    finally:
        mgr.close()
        del mgr, dst
        rmtree(d)


def bench_dcp(r: Runner, label: str, sd: Any, root: str, cached: bool) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    d = os.path.join(root, "dcp_cached" if cached else "dcp")
    os.makedirs(d, exist_ok=True)
    cuda = torch.cuda.is_available()
    # Synchronous staging: async_save returns once the snapshot exists, like the others here.
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=cuda)) if cached else None

    def once(i: int) -> Dict[str, float]:
        kw: Dict[str, Any] = {"async_stager": stager} if stager is not None else {}
        return _timed_pair(lambda: dcp.async_save(sd, checkpoint_id=os.path.join(d, str(i)), no_dist=True, **kw),
                           lambda fut: fut.result())

    try:
        return r.run(DCP_CACHED if cached else DCP, label, once, after=lambda i: rmtree(os.path.join(d, str(i))))
    finally:
        if stager is not None:
            stager.close()
            stager._state_dict_stager.close()
        rmtree(d)


def bench_torch_save(r: Runner, label: str, sd: Any, root: str) -> Dict[str, Any]:
    d = os.path.join(root, "torch_save")
    os.makedirs(d, exist_ok=True)

    def once(i: int) -> Dict[str, float]:
        t0 = time.perf_counter()
        with open(os.path.join(d, f"{i}.pt"), "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        return {"blocking_s": dt, "durable_s": dt}

    try:
        return r.run(TSAVE, label, once, after=lambda i: os.remove(os.path.join(d, f"{i}.pt")))
    finally:
        rmtree(d)


_PG_READY = False


def ensure_process_group(root: str) -> None:
    """torch_xla's manager asserts ``dist.is_initialized()``: a 1-rank gloo group on a FileStore."""
    global _PG_READY
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(root, "pg_store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    _PG_READY = True


def bench_torch_xla_manager(r: Runner, label: str, sd: Any, root: str, name: str) -> Dict[str, Any]:
    from torch_xla.experimental.distributed_checkpoint import CheckpointManager as XlaCheckpointManager

    ensure_process_group(root)
    d = os.path.join(root, "torch_xla_mgr")
    mgr = XlaCheckpointManager(d, save_interval=1, max_to_keep=0, chkpt_on_preemption=False)

    def once(i: int) -> Dict[str, float]:
        return _timed_pair(lambda: mgr.save_async(i, sd), lambda _: mgr.join())

    try:
        return r.run(name, label, once, after=lambda i: rmtree(os.path.join(d, str(i))))
    finally:
        mgr.join()
        mgr._async_worker_pool.shutdown(wait=True)
        del mgr
        rmtree(d)


def bench_xla_each(r: Runner, label: str, xts: List[torch.Tensor]) -> Dict[str, Any]:
    def once(_: int) -> Dict[str, float]:
        t0 = time.perf_counter()
        out = [t.cpu() for t in xts]
        dt = time.perf_counter() - t0
        del out
        return {"blocking_s": dt}

    return r.run(X_EACH, label, once)


def bench_xla_batched(r: Runner, label: str, xts: List[torch.Tensor]) -> Dict[str, Any]:
    import torch_xla

    def once(_: int) -> Dict[str, float]:
        t0 = time.perf_counter()
        out = torch_xla._XLAC._xla_get_cpu_tensors(xts)
        dt = time.perf_counter() - t0
        del out
        return {"blocking_s": dt}

    return r.run(X_BATCHED, label, once)


def bench_xla_dlpack(r: Runner, label: str, xts: List[torch.Tensor]) -> Optional[Dict[str, Any]]:
    from torch.utils.dlpack import from_dlpack
    from torch_xla.utils.dlpack import to_dlpack

    try:
        probe = from_dlpack(to_dlpack(xts[0]))
        if probe.device.type != "cpu":
            return None
    except Exception:
        return None
    dst = [torch.empty(t.shape, dtype=t.dtype) for t in xts]

    def once(_: int) -> Dict[str, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            for d, t in zip(dst, xts):
                d.copy_(from_dlpack(to_dlpack(t)))
        return {"blocking_s": time.perf_counter() - t0}

    try:
        return r.run(X_DLPACK, label, once)
    finally:
        del dst


def bench_rss(sd: Any, root: str, saves: int, log: Callable[[str], None]) -> Dict[str, Any]:
    """VmRSS after each of ``saves`` async_ckpt saves (save_async + join) of the same state dict."""
    from async_ckpt import CheckpointManager

    d = os.path.join(root, "async_ckpt_rss")
    mgr = CheckpointManager(d, max_to_keep=0)
    trace = []
    try:
        for i in range(saves):
            mgr.save_async(i, sd)
            mgr.join()
            rmtree(os.path.join(d, str(i)))
            trace.append(rss_bytes())
    finally:
        mgr.close()
        del mgr
        rmtree(d)
    out = {"saves": saves, "rss_after_2nd": trace[1], "rss_after_last": trace[-1],
           "growth": (trace[-1] - trace[1]) / trace[1], "trace": trace}
    log(f"  RSS after save 2: {trace[1] / MiB:.0f} MiB, after save {saves}: {trace[-1] / MiB:.0f} MiB "
        f"({out['growth'] * 100:+.2f}%)")
    return out


# ---- the run -------------------------------------------------------------------------------------

def run(args: argparse.Namespace, report: Dict[str, Any], checkpoint: Callable[[], None]) -> None:
    """Fill ``report`` size by size; ``checkpoint()`` writes what is there so far."""
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    root = tempfile.mkdtemp(prefix="bench_save_", dir=args.dir)
    runner = Runner(args.reps, args.warmup, log, budget_s=args.method_budget, deadline=_deadline(args.deadline))
    xla = None
    if not args.skip_xla:
        try:
            import torch_xla

            xla = torch_xla.device()
            torch.zeros(1, device=xla)
        except Exception as exc:  # not installed / no PJRT device: the CPU part still runs
            log(f"XLA part skipped: {exc}")
            xla = None
    report.update({
        "machine": machine_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "config": {"sizes": [s[0] for s in sizes], "reps": args.reps, "warmup": args.warmup,
                   "method_budget_s": args.method_budget, "dir": args.dir or tempfile.gettempdir(),
                   "xla": xla is not None, "smoke": args.smoke},
        "notes": [
            "blocking_s: time the caller is stalled; durable_s: until written and fsynced (committed).",
            "torch_xla's CheckpointManager is timed on XLA tensors only: on CPU tensors its "
            "_xla_get_cpu_tensors returns the same storages (no copy), so save_async takes no snapshot "
            "and its background write races the training loop.",
            "dcp.async_save (cached stager): one DefaultStager(StagingOptions(use_pinned_memory=<cuda>, "
            "use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=<cuda>)) reused across "
            "saves (it caches the staged storages); pinning needs CUDA and is off on a CPU-only machine.",
        ],
        "sizes": {}, "results": {}, "complete": False,
    })
    log(f"bench_save: {report['machine']}\nwriting under {root}")

    deadline = _deadline(args.deadline)
    rss_label = _rss_label(sizes) if args.rss_size == "auto" else parse_size(args.rss_size)[0]
    skipped: List[str] = report.setdefault("skipped", [])

    def record(res: Dict[str, Any], name: str, bench: Callable[[], Optional[Dict[str, Any]]]) -> None:
        if deadline is not None and time.time() > deadline:
            skipped.append(f"{label}: {name}")
            log(f"  {label:>10} {name:<36} skipped (--deadline {args.deadline} passed)")
            return
        value = bench()
        if value is not None:
            res[name] = value
        free_memory()
        checkpoint()

    try:
        for label, nbytes, count in sizes:
            sd = small_state(count, nbytes // count) if count else transformer_state(nbytes)
            ts = tensors_of(sd)
            real = sum(t.numel() * t.element_size() for t in ts)
            report["sizes"][label] = {"bytes": real, "tensors": len(ts), "small_tensors": count}
            log(f"{label}: {real / MiB:.1f} MiB in {len(ts)} tensors")
            res: Dict[str, Any] = {}
            report["results"][label] = res
            record(res, FLOOR, lambda: bench_floor(runner, label, sd))
            record(res, RAW, lambda: bench_raw(runner, label, sd, root))
            record(res, OURS, lambda: bench_async_ckpt(runner, label, sd, root, paired_floor=True))
            record(res, OURS_LAZY, lambda: bench_async_ckpt(runner, label, sd, root, name=OURS_LAZY, lazy=True))
            if label == rss_label:
                record(res, "RSS check", lambda: report.__setitem__(
                    "rss", dict(bench_rss(sd, root, args.rss_saves, log), size=label)))
            record(res, DCP, lambda: bench_dcp(runner, label, sd, root, cached=False))
            record(res, DCP_CACHED, lambda: bench_dcp(runner, label, sd, root, cached=True))
            record(res, TSAVE, lambda: bench_torch_save(runner, label, sd, root))
            if xla is not None:
                import torch_xla

                xsd = map_tensors(sd, lambda t: t.to(xla))
                torch_xla.sync()
                del sd, ts
                free_memory()
                xts = tensors_of(xsd)
                record(res, X_BATCHED, lambda: bench_xla_batched(runner, label, xts))
                record(res, X_DLPACK, lambda: bench_xla_dlpack(runner, label, xts))
                record(res, X_OURS, lambda: bench_async_ckpt(runner, label, xsd, root, name=X_OURS))
                record(res, X_TXLA_MGR, lambda: bench_torch_xla_manager(runner, label, xsd, root, X_TXLA_MGR))
                record(res, X_EACH, lambda: bench_xla_each(runner, label, xts))
                del xsd, xts
            else:
                del sd, ts
            free_memory()
        report["complete"] = True
    finally:
        rmtree(root)
        if _PG_READY:
            import torch.distributed as dist

            dist.destroy_process_group()
        report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")


def _deadline(text: Optional[str]) -> Optional[float]:
    """``HH:MM`` (local time, today; tomorrow if already past by more than 12 h) -> epoch seconds."""
    if not text:
        return None
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", text.strip())
    if not m:
        raise ValueError(f"--deadline must be HH:MM, got {text!r}")
    now = time.time()
    lt = time.localtime(now)
    t = time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday, int(m.group(1)), int(m.group(2)), 0, 0, 0, -1))
    return t + 86400 if t < now - 12 * 3600 else t


def _rss_label(sizes: Sequence[Tuple[str, int, int]]) -> Optional[str]:
    """The state dict for the RSS check: 1 GiB if measured, else the largest dense one."""
    dense = [s for s in sizes if not s[2]]
    if not dense:
        return None
    exact = [s for s in dense if s[1] == GiB]
    return (exact[0] if exact else max(dense, key=lambda s: s[1]))[0]


def _get(res: Dict[str, Any], method: str, key: str = "blocking_s") -> Optional[float]:
    v = res.get(method, {}).get(key)
    return float(v) if v is not None else None


def ratios(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The target ratios of issue 3, each with its target and pass/fail."""
    out: List[Dict[str, Any]] = []

    def add(name: str, size: Optional[str], num: Optional[float], den: Optional[float], target: float,
            unit: str = "x", scale: float = 1.0) -> None:
        if num is None or den is None or den <= 0:
            return
        value = num / den * scale
        out.append({"name": name, "size": size, "value": value, "target": target, "unit": unit,
                    "pass": value <= target})

    for label, res in report["results"].items():
        info = report["sizes"][label]
        if not info["small_tensors"] and info["bytes"] >= 256 * MiB:
            add("CPU blocking / floor (medians taken minutes apart)", label, _get(res, OURS), _get(res, FLOOR), 1.2)
            add("CPU blocking / floor, paired (median of per-save ratios)", label,
                _get(res, OURS, "paired_ratio"), 1.0, 1.2)
            add("CPU blocking / dcp.async_save (default)", label, _get(res, OURS), _get(res, DCP), 0.3)
            add("CPU blocking, lazy=True / dcp.async_save (default)", label, _get(res, OURS_LAZY),
                _get(res, DCP), 0.3)
        add("durable / raw write+fsync", label, _get(res, OURS, "durable_s"), _get(res, RAW, "durable_s"), 1.3)
        if X_OURS in res:
            add("XLA blocking / batched _xla_get_cpu_tensors", label, _get(res, X_OURS), _get(res, X_BATCHED), 1.0)
            add("XLA blocking / torch_xla CheckpointManager", label, _get(res, X_OURS), _get(res, X_TXLA_MGR), 0.25)
            if X_DLPACK in res:  # the zero-copy path applies
                # the stricter (lower) of the two floor measurements of this size
                floors = [f for f in (_get(res, FLOOR), _get(res, OURS, "paired_floor_s")) if f is not None]
                add("XLA blocking / floor (the lower of floor and paired floor)", label, _get(res, X_OURS),
                    min(floors) if floors else None, 3.0)
        if info["small_tensors"]:
            ours, floor = _get(res, OURS), _get(res, FLOOR)
            if ours is not None and floor is not None:
                v = (ours - floor) / info["small_tensors"] * 1e6
                out.append({"name": "per-tensor overhead (blocking - floor) / tensors", "size": label,
                            "value": v, "target": 20.0, "unit": "us", "pass": v <= 20.0})
            samples = res.get(OURS, {}).get("samples", [])
            diffs = [x["blocking_s"] - x["paired_floor_s"] for x in samples if "paired_floor_s" in x]
            if diffs:
                v = statistics.median(diffs) / info["small_tensors"] * 1e6
                out.append({"name": "per-tensor overhead, paired (median of per-save differences)", "size": label,
                            "value": v, "target": 20.0, "unit": "us", "pass": v <= 20.0})
    rss = report.get("rss")
    if rss:
        v = rss["growth"] * 100
        out.append({"name": f"RSS growth, save {rss['saves']} vs save 2", "size": rss["size"], "value": v,
                    "target": 5.0, "unit": "%", "pass": v <= 5.0})
    return out


# ---- output --------------------------------------------------------------------------------------

def _ms(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.1f} ms" if v < 10 else f"{v:.2f} s"


def markdown(report: Dict[str, Any]) -> str:
    labels = list(report["results"])
    methods = [m for m in CPU_METHODS + XLA_METHODS if any(m in report["results"][lb] for lb in labels)]
    head = "| method | " + " | ".join(f"{lb} blocking | {lb} durable" for lb in labels) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(labels))]
    for m in methods:
        cells = []
        for lb in labels:
            r = report["results"][lb].get(m, {})
            n = f" (n={r['n']})" if r and r.get("n", 0) < report["config"]["reps"] else ""
            cells += [_ms(r.get("blocking_s")) + n, _ms(r.get("durable_s")) + (n if r.get("durable_s") else "")]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    bd = ["", "| async_ckpt breakdown (medians) | plan + slot wait | host copy (stage) | floor right before (paired) "
          "| background write | commit | files |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for lb in labels:
        for m in (OURS, X_OURS):
            r = report["results"][lb].get(m)
            if r:
                bd.append(f"| {lb} {'XLA' if m == X_OURS else 'CPU'} | {_ms(r.get('queue_wait_s'))} | "
                          f"{_ms(r.get('stage_s'))} | {_ms(r.get('paired_floor_s'))} | {_ms(r.get('write_s'))} | "
                          f"{_ms(r.get('commit_s'))} | "
                          f"{int(r.get('files', 0))} |")
    rt = ["", "| target | size | measured | target | result |", "| --- | --- | --- | --- | --- |"]
    for x in report["ratios"]:
        val = f"{x['value']:.2f}x" if x["unit"] == "x" else f"{x['value']:.1f} {x['unit']}"
        tgt = f"<= {x['target']:g}x" if x["unit"] == "x" else f"<= {x['target']:g} {x['unit']}"
        rt.append(f"| {x['name']} | {x['size']} | {val} | {tgt} | {'pass' if x['pass'] else 'FAIL'} |")
    extra = [""]
    if report.get("skipped"):
        extra.append("Skipped (--deadline): " + "; ".join(report["skipped"]))
    if not report.get("complete", False):
        extra.append("The run did not complete: these are the results measured before it stopped.")
    return "\n".join(lines + bd + rt + extra).rstrip() + "\n"


DOCS_BEGIN, DOCS_END = "<!-- bench_save:begin -->", "<!-- bench_save:end -->"


def update_docs(report: Dict[str, Any], path: str) -> None:
    """Replace the text between the bench_save markers of ``path`` with this run's machine and tables."""
    with open(path) as f:
        text = f.read()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{path} has no {DOCS_BEGIN} ... {DOCS_END} section")
    m = report["machine"]
    c = report["config"]
    body = (f"Run {report['started']} to {report.get('finished', '?')}: `nproc` = {m.get('nproc')}, "
            f"CPU: {m.get('cpu', '?')}, RAM: {m.get('mem_total_gib', '?')} GiB, load average at start "
            f"{' / '.join(m.get('loadavg_at_start', []))}; torch {m.get('torch')}, torch_xla {m.get('torch_xla', '-')}; "
            f"median of {c['reps']} timed saves after {c['warmup']} warm-up (n shown where fewer), "
            f"files under `{c['dir']}`.\n\n" + report["table_markdown"])
    a, b = text.index(DOCS_BEGIN) + len(DOCS_BEGIN), text.index(DOCS_END)
    with open(path, "w") as f:
        f.write(text[:a] + "\n" + body + "\n" + text[b:])


def chart(report: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = [lb for lb in report["results"] if not report["sizes"][lb]["small_tensors"]]
    small = [lb for lb in report["results"] if report["sizes"][lb]["small_tensors"]]
    ncols = 2 + bool(small)
    fig, axes = plt.subplots(1, ncols, figsize=(6.2 * ncols, 6.4))
    methods = CPU_METHODS + XLA_METHODS
    cmap = plt.get_cmap("tab20")
    color = {m: cmap(i * 2 % 20 + (i * 2 >= 20)) for i, m in enumerate(methods)}
    for ax, key, title in ((axes[0], "blocking_s", "blocking time (training stalled)"),
                           (axes[1], "durable_s", "time to durable (written + fsynced)")):
        for i, m in enumerate(methods):
            pts = [(report["sizes"][lb]["bytes"] / MiB, report["results"][lb][m][key])
                   for lb in dense if report["results"][lb].get(m, {}).get(key) is not None]
            if not pts:
                continue
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", linestyle="--" if m in XLA_METHODS else "-",
                    linewidth=2.6 if m in (OURS, X_OURS) else 1.4, label=m, color=color[m])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("state dict size (MiB, fp32)")
        ax.set_ylabel("seconds (median)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8, frameon=False)
    if small:
        ax = axes[2]
        lb = small[0]
        names = [m for m in methods if report["results"][lb].get(m, {}).get("blocking_s") is not None]
        vals = [report["results"][lb][m]["blocking_s"] for m in names]
        ax.barh(range(len(names)), vals, color=[color[m] for m in names])
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("blocking seconds (median)")
        ax.set_title(f"{lb} small tensors: blocking")
        ax.invert_yaxis()
    m = report["machine"]
    fig.suptitle(f"async_ckpt bench_save — {m.get('nproc')} cores ({m.get('cpu', '?')}), "
                 f"{m.get('mem_total_gib', '?')} GiB RAM, shared/noisy; {report['started']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256M,1G,2G,10000x4K",
                   help="comma-separated state dict sizes (256M, 1G, ...) and small-tensor sets (10000x4K)")
    p.add_argument("--reps", type=int, default=5, help="timed saves per method (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed saves per method first")
    p.add_argument("--dir", default=None, help="where checkpoints and raw files are written (default: /tmp)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"),
                   help="directory for bench_save.json and bench_save.png")
    p.add_argument("--skip-xla", action="store_true", help="CPU methods only")
    p.add_argument("--method-budget", type=float, default=0.0,
                   help="seconds per method and size: after 3 timed saves, stop once exceeded (0: off); "
                        "n is reported per cell")
    p.add_argument("--deadline", default=None,
                   help="HH:MM: methods not started by then are skipped (listed in the JSON); the run ends "
                        "with what it has. SIGTERM also ends it cleanly with partial results")
    p.add_argument("--rss-size", default="auto", help="size label for the RSS check (auto: 1 GiB or the largest)")
    p.add_argument("--rss-saves", type=int, default=20, help="saves for the RSS check")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 rep: checks the script works (seconds)")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG")
    p.add_argument("--update-docs", default=None, metavar="MD",
                   help="rewrite the section between the bench_save markers of this markdown file")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="do not measure: recompute ratios, tables and chart from an earlier bench_save.json")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        report["ratios"] = ratios(report)
        report["table_markdown"] = markdown(report)
        os.makedirs(args.out, exist_ok=True)
        json_out = os.path.join(args.out, "bench_save.json")
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1)
        if not args.no_chart:
            chart(report, os.path.join(args.out, "bench_save.png"))
        if args.update_docs:
            update_docs(report, args.update_docs)
        print(report["table_markdown"])
        return 0
    if args.smoke:
        args.sizes, args.reps, args.warmup, args.rss_saves = "2M,200x4K", 1, 0, 2
    if args.reps < 1 or args.warmup < 0 or args.rss_saves < 2:
        p.error("--reps must be >= 1, --warmup >= 0, --rss-saves >= 2")
    try:
        if not [parse_size(s) for s in args.sizes.split(",") if s.strip()]:
            p.error("--sizes is empty")
        _deadline(args.deadline)
        if args.rss_size != "auto":
            parse_size(args.rss_size)
    except ValueError as exc:
        p.error(str(exc))
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench_save.json")
    report: Dict[str, Any] = {}

    def write_json() -> None:
        report["ratios"] = ratios(report)
        report["table_markdown"] = markdown(report)
        tmp = json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, json_path)

    # SIGTERM (e.g. `timeout`) ends the run cleanly: files removed, partial results written.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    interrupted = False
    try:
        run(args, report, write_json)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: writing the results measured so far", file=sys.stderr)
    if not report.get("results"):
        return 1
    write_json()
    if not args.no_chart:
        chart(report, os.path.join(args.out, "bench_save.png"))
    if args.update_docs:
        update_docs(report, args.update_docs)
    print(report["table_markdown"])
    print(f"\nwrote {json_path}" + ("" if args.no_chart else " and bench_save.png"))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
