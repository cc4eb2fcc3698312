"""CUDA save/restore benchmark: what a checkpoint costs a training loop on a GPU (issue 29).

Every number is paired: the reference is timed right before each sample of the method, on the
same state, so that the ratios hold up under load that changes over seconds. Reported for each:
every sample, the median, min and max; ratios are medians of the per-sample ratios.

State: a transformer-like mixed-precision state on the device (default 2 GiB): bf16 weights
(``model``) and their fp32 master copy (``optim``), the same layout as ``bench_save.py``'s
(an embedding, N blocks of 12 tensors, a final norm; d_model 1024 for sizes >= 64 MiB).

1. stall: ``CheckpointManager.save_async`` returns, vs the floor = ``copy_(non_blocking=True)``
   into preallocated pinned host tensors + ``torch.cuda.synchronize()``;
2. stall: ``dcp.async_save`` with DCP's own pinned ``DefaultStager`` (``StagingOptions``:
   pinned, non-blocking copies, synchronous staging; one stager reused across saves, so its
   pinned storages are cached), vs the same floor (``"unavailable"`` where this torch lacks
   that API);
3. durable: ``save_async`` until ``join()`` returns, vs ``dcp.async_save`` until its future's
   ``result()`` (same disk, ``--dir``);
4. lazy: one training step (forward + backward + AdamW step of a small transformer) that
   starts with ``save_async(lazy=True)`` of the model and optimizer state, vs a step without a
   save right before it; the same for an eager ``save_async``;
5. restore: ``CheckpointManager.restore`` into CUDA tensors (then ``synchronize``), vs a raw
   ``readinto`` of the same bytes from one file into preallocated pinned host tensors, each
   followed by its ``non_blocking`` host-to-device copy, then ``synchronize`` (page cache warm).
   The restored tensors are compared bitwise with the saved ones.

Writes ``bench_cuda.json`` under ``--out`` after every section (``"complete": false`` until the
end), so a run stopped by ``timeout`` still leaves what it measured. Without async_ckpt's
dependencies (crc32c) the async_ckpt parts are recorded as unavailable and the references run.

    python3 benchmarks/bench_cuda.py --out /tmp/b                        # a GPU, 2 GiB
    python3 benchmarks/bench_cuda.py --dry-run --out /tmp/b              # CPU, 8 MiB: seconds
    python3 benchmarks/bench_cuda.py --size-mb 512 --samples 7 --dir /mnt/nvme/tmp
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

warnings.filterwarnings("ignore")

MiB = 2**20

#: section names: the keys of the JSON's ``results``
SECTIONS = ("stall", "dcp_stall", "durable", "lazy", "restore")


# ---- state ---------------------------------------------------------------------------------------

def layout(total_bytes: int, elem_bytes: int) -> List[Tuple[str, Tuple[int, ...]]]:
    """Names and shapes of a GPT-like state of about ``total_bytes`` at ``elem_bytes`` per
    element (the layout of ``bench_save.transformer_state``)."""
    d = 1024 if total_bytes >= 64 * MiB else (256 if total_bytes >= 4 * MiB else 64)
    block = elem_bytes * (12 * d * d + 13 * d)
    final = elem_bytes * 2 * d
    layers = max(1, round(total_bytes * 0.875 / block))
    while layers > 1 and total_bytes - layers * block - final < elem_bytes * d:
        layers -= 1
    vocab = max(1, (total_bytes - layers * block - final) // (elem_bytes * d))
    out: List[Tuple[str, Tuple[int, ...]]] = [("embed.weight", (vocab, d))]
    for i in range(layers):
        p = f"blocks.{i}."
        out += [(p + "ln1.weight", (d,)), (p + "ln1.bias", (d,)),
                (p + "attn.qkv.weight", (3 * d, d)), (p + "attn.qkv.bias", (3 * d,)),
                (p + "attn.out.weight", (d, d)), (p + "attn.out.bias", (d,)),
                (p + "ln2.weight", (d,)), (p + "ln2.bias", (d,)),
                (p + "mlp.up.weight", (4 * d, d)), (p + "mlp.up.bias", (4 * d,)),
                (p + "mlp.down.weight", (d, 4 * d)), (p + "mlp.down.bias", (d,))]
    return out + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def make_state(total_bytes: int, device: torch.device, dtype: str, seed: int = 0) -> Dict[str, Any]:
    """The benchmark's state on ``device``: ``mixed`` = bf16 ``model`` + fp32 master ``optim``
    (one third / two thirds of the bytes), or all ``fp32`` / all ``bf16`` in ``model``."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(shape: Tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, device=device, generator=g, dtype=torch.float32).to(dt)

    if dtype == "mixed":
        master = {n: rand(s, torch.float32) for n, s in layout(total_bytes * 2 // 3, 4)}
        return {"model": {n: t.to(torch.bfloat16) for n, t in master.items()},
                "optim": {"master." + n: t for n, t in master.items()}, "step": 0}
    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    return {"model": {n: rand(s, dt) for n, s in layout(total_bytes, dt.itemsize)}, "step": 0}


def tensors_of(sd: Any) -> List[torch.Tensor]:
    if isinstance(sd, torch.Tensor):
        return [sd]
    if isinstance(sd, dict):
        return [t for v in sd.values() for t in tensors_of(v)]
    if isinstance(sd, (list, tuple)):
        return [t for v in sd for t in tensors_of(v)]
    return []


def clone(sd: Any) -> Any:
    """A deep copy of the tensors of ``sd`` (same structure, non-tensors kept)."""
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: clone(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [clone(v) for v in sd]
    return sd


def like(sd: Any, fill: float = 0.0) -> Any:
    """A fresh state of the same structure; tensors filled with ``fill``, non-tensors kept."""
    if isinstance(sd, torch.Tensor):
        return torch.full_like(sd, fill)
    if isinstance(sd, dict):
        return {k: like(v, fill) for k, v in sd.items()}
    if isinstance(sd, list):
        return [like(v, fill) for v in sd]
    return sd


def host_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no numpy needed)."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def bitwise_equal(a: Any, b: Any) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8),
                                                                  y.reshape(-1).view(torch.uint8))
        for x, y in zip(ta, tb))


# ---- timing --------------------------------------------------------------------------------------

class Bench:
    """Device, clock, deadline and the report (written after every section)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.cuda = device.type == "cuda"
        self.deadline = time.monotonic() + args.budget_s if args.budget_s > 0 else None
        self.report: Dict[str, Any] = {}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def samples(self) -> range:
        return range(self.args.warmup + self.args.samples)

    def stop_early(self, taken: int) -> bool:
        """Past the deadline with at least 2 timed samples: the section ends with what it has."""
        return taken >= 2 and self.past_deadline()

    def write(self) -> None:
        path = os.path.join(self.args.out, "bench_cuda.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.report, f, indent=1, default=str)
        os.replace(tmp, path)


def stats(values: List[float]) -> Dict[str, Any]:
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values),
            "samples_s": values, "n": len(values)}


def ratio(name: str, pairs: List[Tuple[float, float]], what: str) -> Dict[str, Any]:
    """``name``: median over the samples of method / reference; ``pairs``: (method, reference)."""
    rs = [m / r for m, r in pairs if r > 0]
    return {"name": name, "what": what, "median": statistics.median(rs), "min": min(rs), "max": max(rs),
            "samples": rs}


def pinned_like(ts: List[torch.Tensor], cuda: bool) -> List[torch.Tensor]:
    return [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in ts]


def floor_copy(b: Bench, dst: List[torch.Tensor], src: List[torch.Tensor]) -> float:
    """The floor: ``copy_`` into preallocated (pinned) host tensors, then synchronize."""
    b.sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=b.cuda)
    b.sync()
    return time.perf_counter() - t0


def free(b: Bench) -> None:
    gc.collect()
    if b.cuda:
        torch.cuda.empty_cache()


# ---- sections ------------------------------------------------------------------------------------

def bench_ours(b: Bench, sd: Dict[str, Any], work: str) -> Dict[str, Any]:
    """Section 1 and the async_ckpt half of 3: paired (floor, save_async) samples, then join."""
    from async_ckpt import CheckpointManager

    src = tensors_of(sd)
    dst = pinned_like(src, b.cuda)
    root = os.path.join(work, "ours")
    floors: List[float] = []
    stalls: List[float] = []
    durables: List[float] = []
    stage: List[float] = []
    mgr = CheckpointManager(root, max_to_keep=0)
    try:
        for i in b.samples():
            f = floor_copy(b, dst, src)
            b.sync()  # nothing of the training stream's pending work lands in the stall
            t0 = time.perf_counter()
            mgr.save_async(i, sd)
            t1 = time.perf_counter()
            mgr.join()
            t2 = time.perf_counter()
            st = mgr.last_stats
            assert st is not None and st.step == i, "async_ckpt did not record the save"
            shutil.rmtree(os.path.join(root, str(i)), ignore_errors=True)
            if i >= b.args.warmup:
                floors.append(f)
                stalls.append(t1 - t0)
                durables.append(t2 - t0)
                stage.append(st.stage_s)
                if b.stop_early(len(stalls)):
                    break
    finally:
        mgr.close()
        del mgr, dst
        shutil.rmtree(root, ignore_errors=True)
        free(b)
    return {"floor": stats(floors), "save_async": stats(stalls), "durable": stats(durables),
            "stage_s": stats(stage), "pairs": list(zip(stalls, floors)), "durables": durables}


def dcp_stager_factory(cuda: bool) -> Tuple[Optional[Callable[[], Any]], str]:
    """DCP's ``DefaultStager`` with pinned memory (torch >= 2.9), or None and why not."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        def make() -> Any:
            return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                use_async_staging=False, use_non_blocking_copy=cuda))

        make().close()  # the API as expected, or the exception below
        return make, "DefaultStager(StagingOptions(use_pinned_memory=%s, use_shared_memory=False, " \
                     "use_async_staging=False, use_non_blocking_copy=%s))" % (cuda, cuda)
    except Exception as e:  # another torch: the API differs
        return None, f"unavailable: {type(e).__name__}: {e}"


def _dcp_result(h: Any) -> None:
    """Wait for ``dcp.async_save``'s upload: a Future, or an ``AsyncSaveResponse``."""
    if hasattr(h, "upload_completion"):
        h.staging_completion.result()
        h.upload_completion.result()
    else:
        h.result()


def bench_dcp(b: Bench, sd: Dict[str, Any], work: str) -> Dict[str, Any]:
    """Section 2 and DCP's half of 3: paired (floor, dcp.async_save) samples, then its future."""
    import torch.distributed.checkpoint as dcp

    make, how = dcp_stager_factory(b.cuda)
    if make is None:
        return {"unavailable": how}
    stager = make()
    src = tensors_of(sd)
    dst = pinned_like(src, b.cuda)
    root = os.path.join(work, "dcp")
    floors: List[float] = []
    stalls: List[float] = []
    durables: List[float] = []
    try:
        for i in b.samples():
            f = floor_copy(b, dst, src)
            b.sync()
            t0 = time.perf_counter()
            h = dcp.async_save(sd, checkpoint_id=os.path.join(root, str(i)), no_dist=True, async_stager=stager)
            if hasattr(h, "staging_completion"):
                h.staging_completion.result()  # "returned" means "snapshot taken", as for the others
            t1 = time.perf_counter()
            _dcp_result(h)
            t2 = time.perf_counter()
            shutil.rmtree(os.path.join(root, str(i)), ignore_errors=True)
            if i >= b.args.warmup:
                floors.append(f)
                stalls.append(t1 - t0)
                durables.append(t2 - t0)
                if b.stop_early(len(stalls)):
                    break
    except Exception as e:
        return {"unavailable": f"dcp.async_save failed: {type(e).__name__}: {e}", "stager": how}
    finally:
        stager.close()
        inner = getattr(stager, "_state_dict_stager", None)  # its pinned cache (torch 2.9)
        if inner is not None and hasattr(inner, "close"):
            inner.close()
        del stager, dst
        shutil.rmtree(root, ignore_errors=True)
        free(b)
    return {"stager": how, "floor": stats(floors), "async_save": stats(stalls), "durable": stats(durables),
            "pairs": list(zip(stalls, floors)), "durables": durables}


class TinyTransformer(torch.nn.Module):
    def __init__(self, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def bench_lazy(b: Bench, work: str) -> Dict[str, Any]:
    """Section 4: step time with a lazy (and an eager) save_async at its start vs without."""
    from async_ckpt import CheckpointManager

    a = b.args
    torch.manual_seed(0)
    model = TinyTransformer(a.model_dim, a.model_layers, a.model_heads).to(b.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(a.batch, a.seq, a.model_dim, device=b.device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if b.cuda else None

    def step() -> None:
        if amp is not None:
            with amp:
                loss = model(x).float().square().mean()
        else:
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state() -> Dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    for _ in range(3):  # warm-up: kernels, optimizer state, allocator
        step()
    b.sync()
    state_bytes = sum(t.numel() * t.element_size() for t in tensors_of(state()))
    root = os.path.join(work, "lazy")
    out: Dict[str, Any] = {"state_bytes": state_bytes, "params": sum(p.numel() for p in model.parameters()),
                           "config": {"dim": a.model_dim, "layers": a.model_layers, "heads": a.model_heads,
                                      "batch": a.batch, "seq": a.seq, "autocast_bf16": b.cuda}}
    mgr = CheckpointManager(root, max_to_keep=0)
    equal: Optional[bool] = None
    try:
        for mode in ("lazy", "eager"):
            plain: List[float] = []
            saving: List[float] = []
            for i in b.samples():
                b.sync()
                t0 = time.perf_counter()
                step()
                b.sync()
                p = time.perf_counter() - t0
                check = mode == "lazy" and i == 0  # the first lazy save (untimed) is checked bitwise
                ref = clone(state()) if check else None
                b.sync()
                t0 = time.perf_counter()
                mgr.save_async(i, state(), force=True, lazy=mode == "lazy")
                step()  # the copies of a lazy save run while this forward/backward does
                b.sync()
                s = time.perf_counter() - t0
                mgr.join()  # the write is not the step's business; the next pair starts idle
                if ref is not None:
                    target = like(ref, -1.0)
                    mgr.restore(i, target)
                    equal = bitwise_equal(target, ref)
                shutil.rmtree(os.path.join(root, str(i)), ignore_errors=True)
                if i >= a.warmup:
                    plain.append(p)
                    saving.append(s)
                    if b.stop_early(len(plain)):
                        break
            out[mode] = {"step_without_save": stats(plain), "step_with_save": stats(saving),
                         "pairs": list(zip(saving, plain))}
        out["lazy_snapshot_bitwise_equal"] = equal  # the state at the call, not after the step
    finally:
        mgr.close()
        shutil.rmtree(root, ignore_errors=True)
        free(b)
    return out


def bench_restore(b: Bench, sd: Dict[str, Any], work: str) -> Dict[str, Any]:
    """Section 5: paired (raw readinto pinned + non_blocking H2D, async_ckpt restore) samples."""
    from async_ckpt import CheckpointManager

    root = os.path.join(work, "restore")
    raw = os.path.join(work, "raw.bin")
    src = tensors_of(sd)
    with CheckpointManager(root) as mgr:
        mgr.save(1, sd)
    with open(raw, "wb") as f:
        for t in src:
            host = t.detach().contiguous().cpu()  # held: the view does not keep it alive
            f.write(host_view(host))
        f.flush()
        os.fsync(f.fileno())
    target = like(sd, 0.0)
    dsts = tensors_of(target)
    raw_target = [torch.empty_like(t) for t in src]
    hosts = pinned_like(src, b.cuda)
    views = [host_view(h) for h in hosts]
    reader = CheckpointManager(root)

    def raw_read() -> float:
        b.sync()
        t0 = time.perf_counter()
        with open(raw, "rb", buffering=0) as f:
            for v, h, d in zip(views, hosts, raw_target):
                f.readinto(v)
                d.copy_(h, non_blocking=b.cuda)  # runs while the next tensor is read
        b.sync()
        return time.perf_counter() - t0

    def ours() -> float:
        b.sync()
        t0 = time.perf_counter()
        reader.restore(1, target)
        b.sync()
        return time.perf_counter() - t0

    pairs: List[Tuple[float, float]] = []
    equal: Optional[bool] = None
    try:
        raw_read()  # warm: page cache, first-call costs
        ours()
        equal = bitwise_equal(target, sd) and bitwise_equal(raw_target, src)
        for i in range(b.args.samples):
            if i % 2 == 0:  # each goes first in every other sample
                r = raw_read()
                pairs.append((ours(), r))
            else:
                m = ours()
                pairs.append((m, raw_read()))
            if b.stop_early(len(pairs)):
                break
        equal = equal and bitwise_equal(target, sd)
        on_device = all(t.device.type == b.device.type for t in tensors_of(target))
    finally:
        reader.close()
        for held in (dsts, raw_target, views, hosts):  # the pinned buffers go before the next section
            held.clear()
        shutil.rmtree(root, ignore_errors=True)
        os.remove(raw)
        free(b)
    return {"restore": stats([m for m, _ in pairs]), "raw_read_h2d": stats([r for _, r in pairs]),
            "pairs": pairs, "bitwise_equal": equal, "targets_on_device": on_device, "page_cache": "warm"}


# ---- report --------------------------------------------------------------------------------------

def fs_type(path: str) -> str:
    """The file system type of the mount that holds ``path`` (from /proc/mounts), or ``"?"``."""
    best, kind = "", "?"
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def machine(device: torch.device) -> Dict[str, Any]:
    info: Dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "torch": torch.__version__, "cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "device": str(device),
                            "nproc": os.cpu_count()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}")
    try:
        import async_ckpt

        info["async_ckpt"] = async_ckpt.__version__
        info["async_ckpt_file"] = async_ckpt.__file__
    except Exception as e:
        info["async_ckpt"] = f"unavailable: {type(e).__name__}: {e}"
    return info


def durable(results: Dict[str, Any]) -> None:
    """Section 3, from the saves of sections 1 and 2: until committed / until the future is done."""
    d: Dict[str, Any] = {}
    if "durable" in results.get("stall", {}):
        d["save_async_join"] = results["stall"]["durable"]
    if "durable" in results.get("dcp_stall", {}):
        d["dcp_async_save_result"] = results["dcp_stall"]["durable"]
    if d:
        results["durable"] = d


def ratios(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    ours, dcp = results.get("stall", {}), results.get("dcp_stall", {})
    if "pairs" in ours:
        out.append(ratio("stall: save_async / floor", ours["pairs"],
                         "save_async return vs copy_(non_blocking) into preallocated pinned host + synchronize, paired"))
    if "pairs" in dcp:
        out.append(ratio("stall: dcp.async_save (pinned DefaultStager) / floor", dcp["pairs"],
                         "dcp.async_save return (synchronous pinned staging) vs the floor, paired"))
    if "pairs" in ours and "pairs" in dcp:
        n = min(len(ours["pairs"]), len(dcp["pairs"]))
        out.append(ratio("stall: save_async / dcp.async_save", [(ours["pairs"][i][0], dcp["pairs"][i][0])
                                                                for i in range(n)],
                         "i-th samples of each (taken a section apart)"))
        out.append(ratio("durable: save_async+join / dcp.async_save+result", [
            (ours["durables"][i], dcp["durables"][i]) for i in range(n)], "i-th samples of each"))
    lazy = results.get("lazy", {})
    for mode in ("lazy", "eager"):
        if mode in lazy:
            out.append(ratio(f"step time: with {mode} save_async / without", lazy[mode]["pairs"],
                             "forward+backward+AdamW step, paired with a plain step right before"))
    rest = results.get("restore", {})
    if "pairs" in rest:
        out.append(ratio("restore into device tensors / raw readinto pinned + non_blocking H2D", rest["pairs"],
                         "page cache warm, paired, order alternating"))
    return out


def print_summary(report: Dict[str, Any]) -> None:
    res = report["results"]
    print("\n| measurement | median | min | max | n |\n| --- | --- | --- | --- | --- |")
    rows = [("floor (copy_ to pinned)", res.get("stall", {}).get("floor")),
            ("save_async stall", res.get("stall", {}).get("save_async")),
            ("save_async durable (join)", res.get("stall", {}).get("durable")),
            ("dcp.async_save stall (pinned stager)", res.get("dcp_stall", {}).get("async_save")),
            ("dcp.async_save durable", res.get("dcp_stall", {}).get("durable")),
            ("step without save", res.get("lazy", {}).get("lazy", {}).get("step_without_save")),
            ("step with lazy save", res.get("lazy", {}).get("lazy", {}).get("step_with_save")),
            ("step with eager save", res.get("lazy", {}).get("eager", {}).get("step_with_save")),
            ("raw read + H2D", res.get("restore", {}).get("raw_read_h2d")),
            ("async_ckpt restore", res.get("restore", {}).get("restore"))]
    for name, s in rows:
        if s:
            print(f"| {name} | {s['median_s'] * 1e3:.1f} ms | {s['min_s'] * 1e3:.1f} ms | "
                  f"{s['max_s'] * 1e3:.1f} ms | {s['n']} |")
    print("\n| ratio (median of paired samples) | median | min | max |\n| --- | --- | --- | --- |")
    for r in report["ratios"]:
        print(f"| {r['name']} | {r['median']:.2f}x | {r['min']:.2f}x | {r['max']:.2f}x |")
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda where available)")
    ap.add_argument("--size-mb", type=int, default=2048, help="state size in MiB (default 2048)")
    ap.add_argument("--dtype", default="mixed", choices=["mixed", "fp32", "bf16"])
    ap.add_argument("--samples", type=int, default=5, help="timed samples per section")
    ap.add_argument("--warmup", type=int, default=1, help="untimed samples first")
    ap.add_argument("--model-dim", type=int, default=1024)
    ap.add_argument("--model-layers", type=int, default=8)
    ap.add_argument("--model-heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: the temp dir)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="after this many seconds sections end at 2 samples and later ones are skipped (0: off)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="a subset of " + ",".join(SECTIONS))
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, 8 MiB, a tiny model, 2 samples: checks that the script runs (seconds)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.size_mb, args.samples, args.warmup = "cpu", 8, 2, 1
        args.model_dim, args.model_layers, args.model_heads, args.batch, args.seq = 64, 2, 4, 4, 16
    want = [s.strip() for s in args.sections.split(",") if s.strip()]
    if set(want) - set(SECTIONS) or args.samples < 1 or args.size_mb < 1:
        ap.error(f"--sections from {','.join(SECTIONS)}; --samples and --size-mb >= 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu or --dry-run)")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench_cuda_", dir=args.dir)
    b = Bench(args, device)
    started = time.time()
    b.report = {"complete": False, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
                "config": {k: v for k, v in vars(args).items()}, "machine": machine(device),
                "dir": work, "dir_fs": fs_type(work), "results": {}, "ratios": [], "skipped": {}, "errors": {}}

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        import async_ckpt  # noqa: F401

        ours_ok, why = True, ""
    except Exception as e:
        ours_ok, why = False, f"async_ckpt cannot be imported ({type(e).__name__}: {e}); carry crc32c's wheel"
        print("note: " + why, flush=True)
    log = lambda msg: print(f"[{time.time() - started:6.1f}s] {msg}", flush=True)
    try:
        log(f"state: {args.size_mb} MiB {args.dtype} on {device}")
        sd = make_state(args.size_mb * MiB, device, args.dtype)
        b.sync()
        b.report["state"] = {"bytes": sum(t.numel() * t.element_size() for t in tensors_of(sd)),
                             "tensors": len(tensors_of(sd)), "dtype": args.dtype}
        runs: Dict[str, Callable[[], Dict[str, Any]]] = {
            "stall": lambda: bench_ours(b, sd, work), "dcp_stall": lambda: bench_dcp(b, sd, work),
            "lazy": lambda: bench_lazy(b, work), "restore": lambda: bench_restore(b, sd, work)}
        for name in SECTIONS:
            if name == "durable":  # measured with the stall sections (same saves)
                continue
            if name not in want and not (name in ("stall", "dcp_stall") and "durable" in want):
                continue
            if name != "dcp_stall" and not ours_ok:
                b.report["skipped"][name] = why
                continue
            if b.past_deadline():
                b.report["skipped"][name] = f"not started: past --budget-s {args.budget_s:g}"
                continue
            log(f"{name} ...")
            t0 = time.perf_counter()
            try:
                res = runs[name]()
            except Exception as e:  # a failing section (the CUDA path never ran before) keeps the others
                traceback.print_exc()
                res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
                b.report["errors"][name] = res["error"]
            res["section_s"] = time.perf_counter() - t0
            b.report["results"][name] = res
            durable(b.report["results"])
            if "unavailable" in res:
                b.report["skipped"][name] = res["unavailable"]
            b.report["ratios"] = ratios(b.report["results"])
            b.write()
            log(f"{name} done in {res['section_s']:.1f}s")
        b.report["complete"] = True
    finally:
        b.report["ratios"] = ratios(b.report["results"])
        b.report["elapsed_s"] = time.time() - started
        b.write()
        shutil.rmtree(work, ignore_errors=True)
    print_summary(b.report)
    for name, err in b.report["errors"].items():
        print(f"FAILED {name}: {err}")
    return 1 if b.report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
