"""Multi-rank benchmark of replicated state (issue 28): each replicated byte staged once, written
once, read once. 4 gloo ranks on this machine (``torch.multiprocessing``, one process per rank).

The DDP-style state: a model replicated on every rank (default 256 MiB: bench_save's
transformer-like fp32 state dict; under 64 MiB, tensors of 256 KiB) plus each rank's own
tensors (default 4 MiB per rank, ``rank<r>.x``). Memory bandwidth on a shared machine drifts,
so each sample of a method is paired with its reference timed right before it; ratios are
reported as the median over (rank, sample) pairs with their min-max.

* ``stall``: ``SaveStats.blocking_s`` of ``save_async`` (``replicated_saves=True``, the default)
  vs the host-copy floor of the rank's *full* state (``copy_`` into preallocated tensors on that
  rank; target <= 0.4x: each rank copies about 1/4 of the replicated bytes) and vs the stall of
  ``dcp.async_save`` of the same state in the same sample (target <= 0.5x). Per sample the
  order is: floor, ``dcp.async_save`` (waited for), async_ckpt with and without the divergence
  check (below; which of the two goes first alternates from sample to sample), async_ckpt with
  ``replicated_saves=False`` (today's behaviour, for the table); each async_ckpt save is joined
  and its step deleted (``delete()``, synchronous) before the next one starts, so that no
  method's save overlaps the background deletion of another's step. ``blocking_s`` leaves
  out the ranks' agreement on the save (a collective inside ``save_async``), so the same ratios
  are also reported for the wall time of the ``save_async`` call (what the training thread
  really waits; ``dcp.async_save``'s stall is its call's wall time too).
* ``bytes written``: the ranks' ``SaveStats.written_bytes`` summed / the state's tensor bytes
  (each byte once: target 1.0x; DCP's framing and the metadata add a little).
* ``bytes read``: a restore from a root on a counting fsspec filesystem over a local dir
  (``countfs://``, tests/workers/replicated_worker.py): the ``*.distcp`` bytes read by all ranks /
  the checkpoint's ``*.distcp`` bytes, with ``replicated_reads="once"`` (target <= 1.05x) and
  ``"every_rank"`` (about 4x).
* ``GCS restore``: restore time from a loopback fake-gcs-server bucket, ``once`` vs
  ``every_rank`` timed right before it (target <= 0.5x).
* ``exchange``: the wall time of ``save_async`` on a step nothing is due for (the per-save
  exchange among the ranks), median per rank; and of a due ``save_async``.
* ``FSDP2``: a model of the same size sharded with ``fully_shard`` over the 4 ranks (nothing
  replicated): stall (``blocking_s`` and the wall time of ``save_async``) and durable time with
  ``replicated_saves=True`` vs ``False`` timed right before it (target: no regression, <= 1.1x).
* ``divergence check``: what finding values that differ between ranks under one key costs
  (``async_ckpt.ranks.replicas``: a sample of each large replicated tensor, taken at the call
  by the ranks that leave it to another, and from the host copy on the writer thread by the
  rank that stages it; fingerprints ride in the write's outcome). Stall, ``save_async`` wall
  time and durable time of a save with it vs the same save with ``replicas.SAMPLE_RUNS = 0``
  (large tensors not compared) timed right before or right after it (alternating), in the
  ``stall`` samples; the added milliseconds are in the table too (target: <= 1.05x).

Prints a markdown table (metric, measured, target, verdict) and writes
``bench_multirank.json`` to ``--out``.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_multirank.py                 # full run
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_multirank.py --smoke --out /tmp/b   # seconds
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_multirank.py --samples 9 --skip-gcs
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

# the loopback GCS emulator only: gcsfs otherwise probes every bucket over gRPC (minutes per call)
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
from bench_save import _ms, free_memory, machine_info, tensors_of, transformer_state  # noqa: E402

warnings.filterwarnings("ignore")

KiB, MiB = 2**10, 2**20

STALL_FLOOR = "stall / host-copy floor of the full state"
STALL_DCP = "stall / dcp.async_save stall"
WALL_FLOOR = "save_async wall time / host-copy floor of the full state"
WALL_DCP = "save_async wall time / dcp.async_save stall"
LEGACY_FLOOR = "stall, replicated_saves=False / host-copy floor"
LEGACY_DCP = "stall, replicated_saves=False / dcp.async_save stall"
WRITTEN = "bytes written across ranks / state bytes"
WRITTEN_LEGACY = "bytes written across ranks / state bytes, replicated_saves=False"
READ_ONCE = "bytes read at restore / checkpoint bytes, once"
READ_EVERY = "bytes read at restore / checkpoint bytes, every_rank"
GCS_RESTORE = "GCS restore time, once / every_rank"
EXCHANGE_IDLE = "save_async, nothing due (per-save exchange)"
EXCHANGE_DUE = "save_async, due (stall incl. exchange)"
FSDP_STALL = "FSDP2 stall, replicated_saves True / False"
FSDP_WALL = "FSDP2 save_async wall time, replicated_saves True / False"
FSDP_DURABLE = "FSDP2 durable, replicated_saves True / False"
CHECK_STALL = "divergence check: stall, with / without"
CHECK_WALL = "divergence check: save_async wall time, with / without"
CHECK_DURABLE = "divergence check: durable, with / without"

#: metric -> (target as text, check on the measured value or None for information only)
TARGETS: Dict[str, Any] = {
    STALL_FLOOR: ("<= 0.4x", lambda v: v <= 0.4),
    STALL_DCP: ("<= 0.5x", lambda v: v <= 0.5),
    WALL_FLOOR: ("<= 0.4x", lambda v: v <= 0.4),
    WALL_DCP: ("<= 0.5x", lambda v: v <= 0.5),
    LEGACY_FLOOR: ("- (today's behaviour)", None),
    LEGACY_DCP: ("- (today's behaviour)", None),
    WRITTEN: ("1.0x (<= 1.02x)", lambda v: v <= 1.02),
    WRITTEN_LEGACY: ("- (DCP de-duplicates)", None),
    READ_ONCE: ("<= 1.05x", lambda v: v <= 1.05),
    READ_EVERY: ("- (~4x)", None),
    GCS_RESTORE: ("<= 0.5x", lambda v: v <= 0.5),
    EXCHANGE_IDLE: ("-", None),
    EXCHANGE_DUE: ("-", None),
    FSDP_STALL: ("no regression (<= 1.1x)", lambda v: v <= 1.1),
    FSDP_WALL: ("no regression (<= 1.1x)", lambda v: v <= 1.1),
    FSDP_DURABLE: ("no regression (<= 1.1x)", lambda v: v <= 1.1),
    CHECK_STALL: ("<= 1.05x", lambda v: v <= 1.05),
    CHECK_WALL: ("<= 1.05x", lambda v: v <= 1.05),
    CHECK_DURABLE: ("<= 1.05x", lambda v: v <= 1.05),
}
METRICS = list(TARGETS)


def log(msg: str) -> None:
    print(msg, flush=True)


def spread(values: Sequence[float]) -> Dict[str, Any]:
    return {"ratio_median": statistics.median(values), "ratio_min": min(values), "ratio_max": max(values),
            "n": len(values), "ratios": list(values)}


def nbytes_of(sd: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(sd))


# ---- state dicts ---------------------------------------------------------------------------------

def replicated_model(total: int) -> Dict[str, torch.Tensor]:
    """The model every rank holds (the same values): bench_save's transformer-like state from
    64 MiB on, else tensors of 256 KiB (all over the 64 KiB threshold)."""
    if total >= 64 * MiB:
        return transformer_state(total, seed=0)["model"]
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(64 * KiB, generator=g) for i in range(max(1, total // (256 * KiB)))}


def ddp_state(model: Dict[str, torch.Tensor], per_rank: int, rank: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(100 + rank)
    return {"model": model, f"rank{rank}": {"x": torch.randn(per_rank // 4, generator=g)}}


def empty_like_tree(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.empty_like(sd)
    if isinstance(sd, dict):
        return {k: empty_like_tree(v) for k, v in sd.items()}
    return sd


def copy_floor(src: List[torch.Tensor], dst: List[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for s, d in zip(src, dst):
        d.copy_(s)
    return time.perf_counter() - t0


def data_bytes(step_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(step_dir, n)) for n in os.listdir(step_dir) if n.endswith(".distcp"))


# ---- one rank ------------------------------------------------------------------------------------

class Rank:
    """What one rank measures; every phase is collective (all ranks call it in the same order)."""

    def __init__(self, rank: int, world: int, cfg: Dict[str, Any]) -> None:
        self.rank, self.world, self.cfg = rank, world, cfg
        self.base = cfg["base"]
        self.model = replicated_model(cfg["replicated_bytes"])
        self.sd = ddp_state(self.model, cfg["per_rank_bytes"], rank)
        self.state_bytes = nbytes_of(self.model) + world * nbytes_of(self.sd[f"rank{rank}"])
        self.out: Dict[str, Any] = {"rank": rank, "rank_state_bytes": nbytes_of(self.sd),
                                    "state_bytes": self.state_bytes}

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def path(self, *parts: str) -> str:
        return os.path.join(self.base, *parts)

    def rm_shared(self, path: str) -> None:
        """Remove a directory all ranks wrote (rank 0, after every rank is done with it)."""
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.barrier()

    # -- saves: stall vs floor and dcp.async_save, bytes written
    def saves(self) -> None:
        import torch.distributed.checkpoint as dcp

        from async_ckpt import CheckpointManager
        from async_ckpt.ranks import replicas

        samples, warmup = self.cfg["samples"], self.cfg["warmup"]
        src = tensors_of(self.sd)
        dst = [torch.empty_like(t) for t in src]
        # every step kept by retention and deleted by the benchmark after its join (delete() returns
        # once the files are gone): retention would delete the last step in the background, over
        # the next method's save, which then pays for it and its predecessor does not
        ours = CheckpointManager(self.path("ours"), max_to_keep=0)
        legacy = CheckpointManager(self.path("legacy"), max_to_keep=0, replicated_saves=False)
        unchecked = CheckpointManager(self.path("unchecked"), max_to_keep=0)
        runs = replicas.SAMPLE_RUNS
        pairs: List[Dict[str, Any]] = []

        def timed(mgr: Any, step: int, check: bool = True) -> Any:
            """``save_async`` (its wall time), ``join()``, the step deleted; with ``check=False``
            the divergence check leaves large tensors out (``SAMPLE_RUNS = 0``)."""
            free_memory()
            self.barrier()
            replicas.SAMPLE_RUNS = runs if check else 0
            try:
                t0 = time.perf_counter()
                assert mgr.save_async(step, self.sd)
                wall = time.perf_counter() - t0
                mgr.join()
            finally:
                replicas.SAMPLE_RUNS = runs
            stats = mgr.stats[-1]
            mgr.delete(step)
            return wall, stats

        try:
            for i in range(warmup + samples):
                step = i + 1
                free_memory()
                self.barrier()
                floor = copy_floor(src, dst)
                self.barrier()
                d = self.path("dcp", str(step))
                t0 = time.perf_counter()
                fut = dcp.async_save(self.sd, checkpoint_id=d)
                dcp_stall = time.perf_counter() - t0
                fut.result()
                dcp_durable = time.perf_counter() - t0
                self.rm_shared(self.path("dcp"))
                # the divergence check with and without, in alternating order (neither always second)
                if i % 2:
                    ours_wall, st = timed(ours, step)
                    unchecked_wall, ut = timed(unchecked, step, check=False)
                else:
                    unchecked_wall, ut = timed(unchecked, step, check=False)
                    ours_wall, st = timed(ours, step)
                legacy_wall, lt = timed(legacy, step)
                if i < warmup:
                    continue
                pairs.append({"step": step, "floor_s": floor, "dcp_stall_s": dcp_stall, "dcp_durable_s": dcp_durable,
                              "stall_s": st.blocking_s, "save_async_wall_s": ours_wall, "stage_s": st.stage_s,
                              "durable_s": st.durable_s, "nbytes": st.nbytes, "written_bytes": st.written_bytes,
                              "legacy_stall_s": lt.blocking_s, "legacy_save_async_wall_s": legacy_wall,
                              "legacy_durable_s": lt.durable_s, "legacy_nbytes": lt.nbytes,
                              "legacy_written_bytes": lt.written_bytes, "unchecked_stall_s": ut.blocking_s,
                              "unchecked_save_async_wall_s": unchecked_wall, "unchecked_durable_s": ut.durable_s})
        finally:
            ours.close()
            legacy.close()
            unchecked.close()
        self.out["saves"] = pairs
        self.rm_shared(self.path("ours"))
        self.rm_shared(self.path("legacy"))
        self.rm_shared(self.path("unchecked"))

    # -- the per-save exchange when nothing is due
    def exchange(self) -> None:
        from async_ckpt import CheckpointManager

        calls = self.cfg["idle_calls"]
        times = []
        with CheckpointManager(self.path("idle"), save_interval=10**9) as mgr:
            for step in range(1, calls + 1):
                t0 = time.perf_counter()
                assert not mgr.save_async(step, self.sd)
                times.append(time.perf_counter() - t0)
        self.out["idle_save_async_s"] = times
        self.rm_shared(self.path("idle"))

    # -- bytes read at restore, counted
    def reads(self) -> None:
        from async_ckpt import CheckpointManager
        from tests.workers import replicated_worker as counting  # registers countfs://

        local = self.path("counted")
        root = "countfs://" + local
        with CheckpointManager(root) as mgr:
            assert mgr.save(1, self.sd)
        self.barrier()
        out: Dict[str, Any] = {"data_bytes": data_bytes(os.path.join(local, "1"))}
        target = empty_like_tree(self.sd)
        for mode in ("every_rank", "once"):
            with CheckpointManager(root, replicated_reads=mode) as mgr:
                self.barrier()
                counting.READS.clear()
                t0 = time.perf_counter()
                assert mgr.restore(1, target) == 1
                out[mode] = {"read_bytes": counting.data_read(), "restore_s": time.perf_counter() - t0}
            for a, b in zip(tensors_of(target), tensors_of(self.sd)):
                assert torch.equal(a, b), "restore is not bitwise"
        self.out["reads"] = out
        self.rm_shared(local)

    # -- restore time from the loopback GCS bucket
    def gcs(self) -> None:
        from async_ckpt import CheckpointManager

        url, opts = self.cfg["gcs_url"], self.cfg["gcs_options"]
        with CheckpointManager(url, storage_options=opts) as mgr:
            assert mgr.save(1, self.sd)
        target = empty_like_tree(self.sd)
        pairs = []
        mgrs = {mode: CheckpointManager(url, storage_options=opts, replicated_reads=mode)
                for mode in ("every_rank", "once")}
        try:
            for i in range(1 + self.cfg["samples"]):
                times = {}
                for mode in ("every_rank", "once"):
                    free_memory()
                    self.barrier()
                    t0 = time.perf_counter()
                    assert mgrs[mode].restore(1, target) == 1
                    times[mode] = time.perf_counter() - t0
                if i:  # the first pair warms connections and caches
                    pairs.append({"every_rank_s": times["every_rank"], "once_s": times["once"]})
        finally:
            for m in mgrs.values():
                m.close()
        self.out["gcs"] = pairs

    # -- FSDP2: nothing replicated, no regression
    def fsdp(self) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from async_ckpt import CheckpointManager

        total = self.cfg["replicated_bytes"] + self.world * self.cfg["per_rank_bytes"]
        d = 2048 if total >= 64 * MiB else 256
        layers = max(1, round(total / (4 * d * (d + 1))))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)])
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sd = {"model": get_model_state_dict(model)}
        self.out["fsdp_state_bytes"] = layers * 4 * d * (d + 1)
        mgrs = {flag: CheckpointManager(self.path(f"fsdp_{flag}"), max_to_keep=1, replicated_saves=flag)
                for flag in (False, True)}
        pairs = []
        try:
            for i in range(self.cfg["warmup"] + self.cfg["samples"]):
                row = {}
                for flag in (False, True):  # the reference (today's behaviour) right before
                    free_memory()
                    self.barrier()
                    t0 = time.perf_counter()
                    assert mgrs[flag].save_async(i + 1, sd)
                    row[f"wall_{flag}"] = time.perf_counter() - t0
                    mgrs[flag].join()
                    st = mgrs[flag].stats[-1]
                    row[f"stall_{flag}"], row[f"durable_{flag}"] = st.blocking_s, st.durable_s
                    row[f"nbytes_{flag}"] = st.nbytes
                if i >= self.cfg["warmup"]:
                    pairs.append(row)
        finally:
            for m in mgrs.values():
                m.close()
        self.out["fsdp"] = pairs
        for flag in (False, True):
            self.rm_shared(self.path(f"fsdp_{flag}"))


def rank_main(rank: int, world: int, cfg: Dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(cfg["base"], "store"), rank=rank,
                           world_size=world)
    try:
        r = Rank(rank, world, cfg)
        phases = [("saves", r.saves), ("exchange", r.exchange), ("reads", r.reads)]
        if cfg.get("gcs_url"):
            phases.append(("gcs", r.gcs))
        phases.append(("fsdp", r.fsdp))
        for name, fn in phases:
            t0 = time.perf_counter()
            fn()
            if rank == 0:
                log(f"  {name}: {time.perf_counter() - t0:.1f} s")
        with open(os.path.join(cfg["base"], f"rank{rank}.json"), "w") as f:
            json.dump(r.out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---- report --------------------------------------------------------------------------------------

def aggregate(ranks: List[Dict[str, Any]], cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Per-metric results from every rank's measurements."""
    m: Dict[str, Any] = {}
    saves = [(r["rank"], p) for r in ranks for p in r["saves"]]

    def ratio(num: str, den: str, what: str) -> Dict[str, Any]:
        out = spread([p[num] / p[den] for _, p in saves])
        out.update({"median_s": statistics.median(p[num] for _, p in saves),
                    "ref_median_s": statistics.median(p[den] for _, p in saves), "reference": what,
                    "per_rank_median": [statistics.median(p[num] / p[den] for rr, p in saves if rr == r["rank"])
                                        for r in ranks]})
        return out

    m[STALL_FLOOR] = ratio("stall_s", "floor_s", "copy_ of the rank's full state into allocated tensors")
    m[STALL_DCP] = ratio("stall_s", "dcp_stall_s", "dcp.async_save stall, same sample")
    m[WALL_FLOOR] = ratio("save_async_wall_s", "floor_s", "copy_ of the rank's full state into allocated tensors")
    m[WALL_DCP] = ratio("save_async_wall_s", "dcp_stall_s", "dcp.async_save stall, same sample")
    m[LEGACY_FLOOR] = ratio("legacy_stall_s", "floor_s", "copy_ of the rank's full state into allocated tensors")
    m[LEGACY_DCP] = ratio("legacy_stall_s", "dcp_stall_s", "dcp.async_save stall, same sample")
    unchecked = "the same save with replicas.SAMPLE_RUNS = 0 (large tensors not compared), timed right before or after"
    for name, key in ((CHECK_STALL, "stall_s"), (CHECK_WALL, "save_async_wall_s"), (CHECK_DURABLE, "durable_s")):
        m[name] = ratio(key, f"unchecked_{key}", unchecked)
        m[name]["added_median_s"] = statistics.median(p[key] - p[f"unchecked_{key}"] for _, p in saves)
    state = ranks[0]["state_bytes"]
    n_saves = len(ranks[0]["saves"])
    for name, key in ((WRITTEN, "written_bytes"), (WRITTEN_LEGACY, "legacy_written_bytes")):
        per_save = [sum(r["saves"][i][key] for r in ranks) / state for i in range(n_saves)]
        m[name] = spread(per_save)
        m[name].update({"state_bytes": state, "per_rank_written_bytes": [r["saves"][-1][key] for r in ranks]})
    m["staged bytes per rank"] = {"replicated_saves=True": [r["saves"][-1]["nbytes"] for r in ranks],
                                  "replicated_saves=False": [r["saves"][-1]["legacy_nbytes"] for r in ranks],
                                  "state_bytes": state}
    data = ranks[0]["reads"]["data_bytes"]
    for name, mode in ((READ_ONCE, "once"), (READ_EVERY, "every_rank")):
        per_rank = [r["reads"][mode]["read_bytes"] for r in ranks]
        m[name] = {"ratio_median": sum(per_rank) / data, "ratio_min": sum(per_rank) / data,
                   "ratio_max": sum(per_rank) / data, "n": 1, "per_rank_read_bytes": per_rank, "data_bytes": data}
    if all("gcs" in r for r in ranks):
        gp = [p for r in ranks for p in r["gcs"]]
        m[GCS_RESTORE] = spread([p["once_s"] / p["every_rank_s"] for p in gp])
        m[GCS_RESTORE].update({"median_s": statistics.median(p["once_s"] for p in gp),
                               "ref_median_s": statistics.median(p["every_rank_s"] for p in gp),
                               "reference": "replicated_reads='every_rank', timed right before"})
    idle = [statistics.median(r["idle_save_async_s"]) for r in ranks]
    m[EXCHANGE_IDLE] = {"median_s": statistics.median(t for r in ranks for t in r["idle_save_async_s"]),
                        "per_rank_median_s": idle, "min_s": min(idle), "max_s": max(idle),
                        "calls": len(ranks[0]["idle_save_async_s"])}
    due = [statistics.median(p["save_async_wall_s"] for p in r["saves"]) for r in ranks]
    m[EXCHANGE_DUE] = {"median_s": statistics.median(p["save_async_wall_s"] for _, p in saves),
                       "per_rank_median_s": due, "min_s": min(due), "max_s": max(due)}
    fp = [p for r in ranks for p in r["fsdp"]]
    for name, key in ((FSDP_STALL, "stall"), (FSDP_WALL, "wall"), (FSDP_DURABLE, "durable")):
        m[name] = spread([p[f"{key}_True"] / p[f"{key}_False"] for p in fp])
        m[name].update({"median_s": statistics.median(p[f"{key}_True"] for p in fp),
                        "ref_median_s": statistics.median(p[f"{key}_False"] for p in fp),
                        "reference": "replicated_saves=False, timed right before",
                        "state_bytes": ranks[0]["fsdp_state_bytes"]})
    return m


def measured_text(name: str, r: Dict[str, Any]) -> str:
    if name in (EXCHANGE_IDLE, EXCHANGE_DUE):
        return f"{_ms(r['median_s'])} (ranks {_ms(r['min_s'])}-{_ms(r['max_s'])})"
    text = f"{r['ratio_median']:.2f}x"
    if r["n"] > 1:
        text += f" ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}, n={r['n']})"
    if "median_s" in r:
        text += f"; {_ms(r['median_s'])} vs {_ms(r['ref_median_s'])}"
    if "added_median_s" in r:
        text += f"; added {r['added_median_s'] * 1e3:+.2f} ms (median of pairs)"
    return text


def targets(metrics: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for name in METRICS:
        target, check = TARGETS[name]
        r = metrics.get(name)
        if r is None:
            out.append({"name": name, "measured": None, "target": target, "verdict": "not run"})
            continue
        value = r.get("ratio_median", r.get("median_s"))
        verdict = "info" if check is None else ("pass" if check(value) else "miss")
        out.append({"name": name, "measured": value, "measured_text": measured_text(name, r), "target": target,
                     "verdict": verdict})
    return out


def markdown(report: Dict[str, Any]) -> str:
    lines = ["| metric | measured | target | verdict |", "| --- | --- | --- | --- |"]
    for t in report["targets"]:
        lines.append(f"| {t['name']} | {t.get('measured_text') or '-'} | {t['target']} | {t['verdict']} |")
    staged = report["metrics"].get("staged bytes per rank")
    if staged:
        lines += ["", f"Bytes staged per rank (state {staged['state_bytes'] / MiB:.1f} MiB): replicated_saves=True "
                  + ", ".join(f"{b / MiB:.1f}" for b in staged["replicated_saves=True"]) + " MiB; False "
                  + ", ".join(f"{b / MiB:.1f}" for b in staged["replicated_saves=False"]) + " MiB."]
    if report.get("note"):
        lines += ["", "Note: " + report["note"]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="gloo ranks (processes) on this machine")
    p.add_argument("--replicated-mib", type=float, default=256, help="the model every rank holds, MiB")
    p.add_argument("--per-rank-mib", type=float, default=4, help="each rank's own tensors, MiB")
    p.add_argument("--samples", type=int, default=5, help="paired samples per measurement")
    p.add_argument("--warmup", type=int, default=1, help="untimed saves first")
    p.add_argument("--idle-calls", type=int, default=20, help="save_async calls on steps nothing is due for")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"),
                   help="directory for bench_multirank.json")
    p.add_argument("--skip-gcs", action="store_true", help="no restore from the loopback GCS server")
    p.add_argument("--smoke", action="store_true", help="2 MiB replicated + 256 KiB per rank, 1 sample: seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.replicated_mib, args.per_rank_mib, args.samples, args.warmup, args.idle_calls = 2, 0.25, 1, 0, 3
    if args.ranks < 2 or args.samples < 1 or args.warmup < 0 or args.idle_calls < 1:
        p.error("--ranks >= 2, --samples and --idle-calls >= 1, --warmup >= 0")
    base = tempfile.mkdtemp(prefix="bench_multirank_", dir=args.dir)
    cfg: Dict[str, Any] = {"base": base, "replicated_bytes": int(args.replicated_mib * MiB),
                           "per_rank_bytes": int(args.per_rank_mib * MiB) // 4 * 4, "samples": args.samples,
                           "warmup": args.warmup, "idle_calls": args.idle_calls}
    report: Dict[str, Any] = {"machine": machine_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "config": {"ranks": args.ranks, "replicated_bytes": cfg["replicated_bytes"],
                                         "per_rank_bytes": cfg["per_rank_bytes"], "samples": args.samples,
                                         "warmup": args.warmup, "idle_calls": args.idle_calls, "smoke": args.smoke,
                                         "gcs": not args.skip_gcs},
                              "note": None}
    server = None
    try:
        if not args.skip_gcs:
            try:
                from tests.support.storage_servers import FakeGCSServer

                server = FakeGCSServer().start()
                bucket = server.new_bucket("bench-multirank")
                cfg["gcs_url"], cfg["gcs_options"] = bucket.url, bucket.storage_options
            except Exception as exc:  # noqa: BLE001 - reported; the other measurements still run
                report["note"] = f"no GCS restore: the loopback server did not start ({exc})"
                report["config"]["gcs"] = False
                log("note: " + report["note"])
        free_memory()
        log(f"{args.ranks} ranks, {args.replicated_mib:g} MiB replicated + {args.per_rank_mib:g} MiB per rank:")
        import torch.multiprocessing as mp

        mp.spawn(rank_main, args=(args.ranks, cfg), nprocs=args.ranks, join=True)
        ranks = []
        for r in range(args.ranks):
            with open(os.path.join(base, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
    gc.collect()
    report["ranks"] = ranks
    report["metrics"] = aggregate(ranks, cfg)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report["targets"] = targets(report["metrics"])
    report["table_markdown"] = markdown(report)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_multirank.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    print(report["table_markdown"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
