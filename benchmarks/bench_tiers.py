"""Two-tier benchmark: the three targets of issue 21, each as a paired ratio, in one run.

The state dict is bench_save's transformer-like fp32 one (default 256 MiB). The local tier
lives on tmpfs (``/dev/shm``; a temporary directory on disk, with a note, where there is none).
Memory bandwidth on a shared machine drifts by 2-3x over minutes, so every sample of a method
is paired with its reference measured right before it, and the ratio reported is the median of
the per-pair ratios, with their min-max spread.

* ``local save``: ``CheckpointManager(path, local_dir=..., local_policy=1)`` saving steps only
  the local tier is due for (the persistent policy never fires), timed by ``SaveStats.durable_s``
  of the local save (and the wall time of ``save()``), vs a raw ``write`` + ``fsync`` of the same
  tensor bytes to one file on the same tmpfs (bench_save's raw reference). Before each pair the
  manager's background deleter (retention of the older local steps) is waited for, so that
  neither side of a pair pays for it. Target <= 1.3x.
* ``local restore (warm)``: ``restore(None)`` of a step both tiers hold, read from the local copy
  (the persistent copy sits on disk under a temporary directory), CRC-32C verification on (the
  default), vs a raw ``readinto`` of the same bytes from one file on the same tmpfs into the same
  target tensors (bench_restore's raw reference), after a warm-up of both. Also reported, not a
  target: ``verify=False``, and the peak extra resident memory of a restore (bench_restore's
  ``PeakRss``). Target <= 1.5x.
* ``training loop``: a loop that "computes" (sleeps; the host is idle during accelerator
  compute) and calls ``save_async`` every step. Two configurations: ``tiers``: a bucket on a
  loopback fake-gcs-server (``save_interval=N``, ``max_to_keep=2``) plus a local tier on tmpfs
  every step (``local_policy=1``); ``local only``: a manager whose path is a tmpfs directory,
  ``save_interval=1``, ``max_to_keep=2``. They alternate in segments of N steps, each starting
  with a step the bucket is due for, so that the segment's other saves run during that upload
  (a round: one segment of each; after a segment its saves are waited for, untimed). The stall
  of a save is the wall time of ``save_async`` (``SaveStats.blocking_s`` is recorded too). Per
  round: median stall of the tiers segment / median stall of the local-only one; the target
  (<= 1.1x) is the median of the round ratios. The saves due for both tiers (one in N) are
  also reported on their own. The compute time per step is chosen from warm-up segments so
  that a local save fits in one step and an upload in N steps (``--compute-s`` overrides it):
  a loop that saves faster than its storage absorbs stalls with any design.

Writes ``bench_tiers.json`` to ``--out`` and prints a markdown table.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_tiers.py                 # ~2-3 min here
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_tiers.py --smoke --out /tmp/b   # seconds
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_tiers.py --sizes 1G --samples 9 --skip-loop
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
from bench_restore import PeakRss  # noqa: E402
from bench_save import _ms, free_memory, machine_info, parse_size, small_state, tensors_of, transformer_state  # noqa: E402

warnings.filterwarnings("ignore")

MiB = 2**20
LOCAL_SAVE = "local save (tmpfs), durable"
LOCAL_RESTORE = "local restore (tmpfs, warm)"
LOOP = "training-loop stall, tiers vs local only"
CASES = [LOCAL_SAVE, LOCAL_RESTORE, LOOP]
TARGETS = {LOCAL_SAVE: 1.3, LOCAL_RESTORE: 1.5, LOOP: 1.1}


def make_state(label: str) -> Dict[str, Any]:
    _, total, count = parse_size(label)
    return small_state(count, total // count) if count else transformer_state(total)


def spread(ratios: Sequence[float]) -> Dict[str, Any]:
    return {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratios": list(ratios)}


def views_of(sd: Any) -> List[memoryview]:
    return [memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) for t in tensors_of(sd)]


def raw_write(path: str, views: List[memoryview]) -> float:
    """bench_save's reference: the tensor bytes into one file, fsynced."""
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for v in views:
            f.write(v)
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def raw_readinto(path: str, views: List[memoryview]) -> float:
    """bench_restore's reference: the bytes of one file read straight into the target tensors."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for v in views:
            f.readinto(v)
    return time.perf_counter() - t0


def wait_deleter(mgr: Any) -> None:
    """Wait until the local tier's background deletions (retention) are done: its deleter is a
    one-thread executor, so a no-op submitted now runs after them."""
    mgr.roots.local.store.deleter.submit(lambda: None).result()


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- a. local-tier save ----------------------------------------------------------------------

def bench_local_save(sd: Any, base: str, disk: str, samples: int, warmup: int) -> Dict[str, Any]:
    from async_ckpt import CheckpointManager

    local, raw = os.path.join(base, "save_local"), os.path.join(base, "save_raw.bin")
    persistent = tempfile.mkdtemp(prefix="persistent_", dir=disk)
    views = views_of(sd)
    pairs: List[Dict[str, float]] = []
    # the persistent policy never fires for steps >= 1: every save goes to the local tier only
    mgr = CheckpointManager(persistent, save_interval=10**9, local_dir=local, local_policy=1)
    try:
        for i in range(warmup + samples):
            step = i + 1
            wait_deleter(mgr)
            gc.collect()
            r = raw_write(raw, views)
            os.remove(raw)
            gc.collect()
            t0 = time.perf_counter()
            assert mgr.save(step, sd)
            wall = time.perf_counter() - t0
            st = [s for s in mgr.stats if s.step == step]
            assert len(st) == 1 and st[0].extra.get("tier") == "local", [s.extra for s in st]
            if i >= warmup:
                pairs.append({"raw_s": r, "durable_s": st[0].durable_s, "save_wall_s": wall,
                              "stage_s": st[0].stage_s, "write_s": st[0].write_s, "commit_s": st[0].commit_s,
                              "ratio": st[0].durable_s / r, "wall_ratio": wall / r})
        assert not [n for n in os.listdir(persistent) if n.isdigit()], "a step reached the persistent tier"
    finally:
        mgr.close()
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(persistent, ignore_errors=True)
    out = spread([p["ratio"] for p in pairs])
    wall = spread([p["wall_ratio"] for p in pairs])
    out.update({"n": len(pairs), "pairs": pairs,
                "median_s": statistics.median(p["durable_s"] for p in pairs),
                "ref_median_s": statistics.median(p["raw_s"] for p in pairs),
                "save_wall_median_s": statistics.median(p["save_wall_s"] for p in pairs),
                "wall_ratio_median": wall["ratio_median"], "wall_ratio_min": wall["ratio_min"],
                "wall_ratio_max": wall["ratio_max"], "reference": "raw write+fsync, same tmpfs"})
    return out


# ---- b. local-tier restore -------------------------------------------------------------------

def bench_local_restore(sd: Any, base: str, disk: str, samples: int) -> Dict[str, Any]:
    from async_ckpt import CheckpointManager

    local, raw = os.path.join(base, "restore_local"), os.path.join(base, "restore_raw.bin")
    persistent = tempfile.mkdtemp(prefix="persistent_", dir=disk)
    with open(raw, "wb") as f:
        for v in views_of(sd):
            f.write(v)
    with CheckpointManager(persistent, local_dir=local) as writer:
        writer.save(1, sd)  # both tiers
        assert writer.step_tiers() == {1: ("local", "persistent")}, writer.step_tiers()
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": -1}
    tviews = views_of(target)
    res: Dict[str, Any] = {}
    mgr = CheckpointManager(persistent, local_dir=local)
    try:
        raw_readinto(raw, tviews)  # the target's pages and the reference's first-call costs
        for key, verify in (("verify", True), ("no_verify", False)):
            for t in tensors_of(target):
                t.zero_()
            with PeakRss() as peak:
                assert mgr.restore(None, target, verify=verify) == 1  # warm-up (its memory counts)
            extra = peak.extra
            for a, b in zip(tensors_of(target), tensors_of(sd)):  # bitwise, once
                assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8)), "restore differs"
            pairs = []
            for _ in range(samples):
                gc.collect()
                r = raw_readinto(raw, tviews)
                gc.collect()
                with PeakRss() as peak:
                    t0 = time.perf_counter()
                    mgr.restore(None, target, verify=verify)
                    m = time.perf_counter() - t0
                extra = max(extra, peak.extra)
                pairs.append({"raw_s": r, "restore_s": m, "ratio": m / r})
            out = spread([p["ratio"] for p in pairs])
            out.update({"n": len(pairs), "pairs": pairs, "median_s": statistics.median(p["restore_s"] for p in pairs),
                        "ref_median_s": statistics.median(p["raw_s"] for p in pairs),
                        "extra_rss_mib": extra / MiB, "verify": verify,
                        "reference": "raw readinto, same tmpfs, same tensors"})
            res[key] = out
    finally:
        mgr.close()
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(persistent, ignore_errors=True)
        os.remove(raw)
    out = dict(res["verify"])
    out["no_verify"] = res["no_verify"]
    return out


# ---- c. training loop --------------------------------------------------------------------------

class LoopConfig:
    """One manager of the loop benchmark, kept open over the rounds."""

    def __init__(self, name: str, mgr: Any) -> None:
        self.name, self.mgr, self.step, self.allocations = name, mgr, -1, 0

    def segment(self, sd: Any, first: int, steps: int, compute_s: float) -> List[Dict[str, Any]]:
        """Loop iterations ``first .. first + steps - 1`` (compute, then ``save_async``); waits for
        every save after the last one (untimed), so that no upload runs into the other
        configuration's segment."""
        walls: Dict[int, float] = {}
        allocs = self.mgr.stager.pool.allocations
        for step in range(first, first + steps):
            self.step = step
            time.sleep(compute_s)
            t0 = time.perf_counter()
            taken = self.mgr.save_async(step, sd)
            walls[step] = time.perf_counter() - t0
            assert taken
        self.mgr.join()
        by_step: Dict[int, Dict[str, Any]] = {}
        for st in self.mgr.stats:
            if st.step >= first:
                e = by_step.setdefault(st.step, {"step": st.step, "stall_s": walls[st.step], "tiers": []})
                e["tiers"].append(st.extra.get("tier", "persistent"))
                e["blocking_s"] = st.blocking_s
                e["queue_wait_s"] = st.queue_wait_s
                e["stage_s"] = st.stage_s
                e[f"durable_{st.extra.get('tier', 'persistent')}_s"] = st.durable_s
                e[f"writer_{st.extra.get('tier', 'persistent')}_s"] = st.write_s + st.commit_s
        assert sorted(by_step) == list(range(first, first + steps)), (self.name, sorted(by_step))
        self.allocations = self.mgr.stager.pool.allocations - allocs  # new host buffers in the segment
        return [by_step[s] for s in sorted(by_step)]


def bench_loop(sd: Any, base: str, rounds: int, interval: int, compute_s: Optional[float]) -> Dict[str, Any]:
    """Segments of ``interval`` steps, each starting with a step due for both tiers, so that the
    other saves of the segment run while that upload does; the configurations alternate
    segment by segment (a round: one segment of each)."""
    from async_ckpt import CheckpointManager
    from tests.support.storage_servers import FakeGCSServer

    steps = interval
    server = FakeGCSServer().start()
    tiers = only = None
    try:
        bucket = server.new_bucket("bench-tiers")
        tiers = LoopConfig("tiers", CheckpointManager(
            bucket.url, save_interval=interval, max_to_keep=2, storage_options=bucket.storage_options,
            local_dir=os.path.join(base, "loop_tiers_local"), local_policy=1))
        only = LoopConfig("local only", CheckpointManager(os.path.join(base, "loop_local_only"), save_interval=1,
                                                          max_to_keep=2))
        # warm-up (untimed): leases, pools, connections; and the write times that size the compute
        warm_t = tiers.segment(sd, 0, steps, compute_s if compute_s is not None else 0.0)
        warm_o = only.segment(sd, 0, steps, compute_s if compute_s is not None else 0.0)
        # a writer's own time (write + commit; durable_s would count the warm-up's queueing)
        local_w = statistics.median([e["writer_local_s"] for e in warm_t[1:] or warm_t]
                                    + [e["writer_persistent_s"] for e in warm_o[1:] or warm_o])
        upload = warm_t[0]["writer_persistent_s"]
        chosen = compute_s if compute_s is not None else round(max(0.05, 1.5 * local_w, 1.3 * upload / interval), 3)
        log(f"  loop: local write {local_w * 1e3:.0f} ms, upload {upload * 1e3:.0f} ms in warm-up -> "
            f"compute {chosen * 1e3:.0f} ms per step, a save every step, an upload every {interval}")
        per_round = []
        for r in range(rounds):
            free_memory()
            a = tiers.segment(sd, (r + 1) * steps, steps, chosen)
            assert len(a[0]["tiers"]) == 2, a[0]  # the segment starts with the upload
            free_memory()
            b = only.segment(sd, (r + 1) * steps, steps, chosen)
            ma = statistics.median(e["stall_s"] for e in a)
            mb = statistics.median(e["stall_s"] for e in b)
            both = [e["stall_s"] for e in a if len(e["tiers"]) == 2]
            per_round.append({"tiers": a, "local_only": b, "tiers_median_s": ma, "local_only_median_s": mb,
                              "tiers_pool_allocations": tiers.allocations,
                              "local_only_pool_allocations": only.allocations,
                              "ratio": ma / mb,
                              "both_due_median_s": statistics.median(both) if both else None,
                              "both_due_ratio": statistics.median(both) / mb if both else None})
            log(f"  loop round {r + 1}/{rounds}: stall tiers {ma * 1e3:.1f} ms, local only {mb * 1e3:.1f} ms, "
                f"x{ma / mb:.2f}" + (f" (saves due for both tiers {statistics.median(both) * 1e3:.1f} ms)"
                                     if both else ""))
    finally:
        for cfg in (tiers, only):
            if cfg is not None:
                try:
                    cfg.mgr.close()
                except Exception as exc:  # report, then go on cleaning up
                    log(f"  loop: closing {cfg.name} failed: {exc}")
        server.stop()
        shutil.rmtree(os.path.join(base, "loop_tiers_local"), ignore_errors=True)
        shutil.rmtree(os.path.join(base, "loop_local_only"), ignore_errors=True)
    out = spread([p["ratio"] for p in per_round])
    all_a = [e for p in per_round for e in p["tiers"]]
    all_b = [e for p in per_round for e in p["local_only"]]
    both = [p["both_due_ratio"] for p in per_round if p["both_due_ratio"] is not None]
    uploads = [e["durable_persistent_s"] for e in all_a if e.get("durable_persistent_s") is not None]
    out.update({
        "n": len(per_round), "rounds": per_round, "compute_s": chosen, "interval": interval, "steps_per_segment": steps,
        "median_s": statistics.median(e["stall_s"] for e in all_a),
        "ref_median_s": statistics.median(e["stall_s"] for e in all_b),
        "tiers_max_s": max(e["stall_s"] for e in all_a), "local_only_max_s": max(e["stall_s"] for e in all_b),
        "pooled_ratio": statistics.median(e["stall_s"] for e in all_a) / statistics.median(e["stall_s"] for e in all_b),
        "tiers_pool_allocations": sum(p["tiers_pool_allocations"] for p in per_round),
        "local_only_pool_allocations": sum(p["local_only_pool_allocations"] for p in per_round),
        "tiers_blocking_median_s": statistics.median(e["blocking_s"] for e in all_a),
        "local_only_blocking_median_s": statistics.median(e["blocking_s"] for e in all_b),
        "both_due": spread(both) if both else None,
        "upload_durable_median_s": statistics.median(uploads) if uploads else None,
        "upload_durable_max_s": max(uploads) if uploads else None,
        "reference": "local-only manager on the same tmpfs, save_interval=1",
    })
    return out


# ---- run and report --------------------------------------------------------------------------

def targets(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for label, res in report["results"].items():
        for case in CASES:
            r = res.get(case)
            if r:
                out.append({"name": case, "size": label, "value": r["ratio_median"], "min": r["ratio_min"],
                            "max": r["ratio_max"], "n": r["n"], "target": TARGETS[case],
                            "pass": r["ratio_median"] <= TARGETS[case]})
    return out


def markdown(report: Dict[str, Any]) -> str:
    lines = ["| size | case | async_ckpt (median) | reference (median) | paired ratio, median (min-max) | n | target "
             "| result |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in report["targets"]:
        r = report["results"][t["size"]][t["name"]]
        lines.append(f"| {t['size']} | {t['name']} | {_ms(r['median_s'])} | {_ms(r['ref_median_s'])} "
                     f"({r['reference']}) | {t['value']:.2f}x ({t['min']:.2f}-{t['max']:.2f}) | {t['n']} | "
                     f"<= {t['target']:g}x | {'pass' if t['pass'] else 'miss'} |")
    lines += ["", "| size | also measured | value |", "| --- | --- | --- |"]
    for label, res in report["results"].items():
        s = res.get(LOCAL_SAVE)
        if s:
            lines.append(f"| {label} | local save: wall time of `save()` / raw write+fsync, median (min-max) | "
                         f"{s['wall_ratio_median']:.2f}x ({s['wall_ratio_min']:.2f}-{s['wall_ratio_max']:.2f}), "
                         f"{_ms(s['save_wall_median_s'])} |")
            lines.append(f"| {label} | local save: host copy / background write / commit, medians | "
                         f"{_ms(statistics.median(p['stage_s'] for p in s['pairs']))} / "
                         f"{_ms(statistics.median(p['write_s'] for p in s['pairs']))} / "
                         f"{_ms(statistics.median(p['commit_s'] for p in s['pairs']))} |")
        r = res.get(LOCAL_RESTORE)
        if r:
            nv = r["no_verify"]
            lines.append(f"| {label} | local restore, `verify=False` / raw readinto, median (min-max) | "
                         f"{nv['ratio_median']:.2f}x ({nv['ratio_min']:.2f}-{nv['ratio_max']:.2f}), "
                         f"{_ms(nv['median_s'])} |")
            lines.append(f"| {label} | local restore: peak extra resident memory (verify on / off) | "
                         f"{r['extra_rss_mib']:.0f} / {nv['extra_rss_mib']:.0f} MiB |")
        lp = res.get(LOOP)
        if lp:
            if lp["both_due"]:
                b = lp["both_due"]
                lines.append(f"| {label} | loop: stall of the saves due for both tiers / local-only median, per round "
                             f"| {b['ratio_median']:.2f}x ({b['ratio_min']:.2f}-{b['ratio_max']:.2f}) |")
            lines.append(f"| {label} | loop: median stall over all saves, tiers / local only (unpaired) | "
                         f"{lp['pooled_ratio']:.2f}x |")
            lines.append(f"| {label} | loop: new host buffers allocated in the timed segments, tiers / local only | "
                         f"{lp['tiers_pool_allocations']} / {lp['local_only_pool_allocations']} |")
            lines.append(f"| {label} | loop: largest stall, tiers / local only | {_ms(lp['tiers_max_s'])} / "
                         f"{_ms(lp['local_only_max_s'])} |")
            lines.append(f"| {label} | loop: `SaveStats.blocking_s` median, tiers / local only | "
                         f"{_ms(lp['tiers_blocking_median_s'])} / {_ms(lp['local_only_blocking_median_s'])} |")
            lines.append(f"| {label} | loop: compute per step; upload durable median (max), every {lp['interval']} "
                         f"steps | {_ms(lp['compute_s'])}; {_ms(lp['upload_durable_median_s'])} "
                         f"({_ms(lp['upload_durable_max_s'])}) |")
    if report.get("note"):
        lines += ["", "Note: " + report["note"]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256M", help="comma-separated state dict sizes (256M, 1G, 10000x4K, ...)")
    p.add_argument("--samples", type=int, default=7, help="paired samples of the save and restore cases")
    p.add_argument("--warmup", type=int, default=1, help="untimed local saves first")
    p.add_argument("--rounds", type=int, default=10,
                   help="loop rounds (each: --interval steps of the tiers run, then as many of the local-only run)")
    p.add_argument("--interval", type=int, default=5, help="the loop's save_interval to the bucket")
    p.add_argument("--compute-s", type=float, default=None,
                   help="seconds of 'compute' per loop step (default: sized from the warm-up's write times)")
    p.add_argument("--dir", default=None, help="tmpfs directory for the local tier (default: /dev/shm)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="directory for bench_tiers.json")
    p.add_argument("--skip-loop", action="store_true", help="no training loop (no GCS server needed)")
    p.add_argument("--smoke", action="store_true", help="2 MiB, 2 samples, 1 short loop round: seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.samples, args.warmup, args.rounds, args.interval = "2M", 2, 1, 2, 2
        if args.compute_s is None:
            args.compute_s = 0.05
    if args.samples < 1 or args.warmup < 0 or args.rounds < 1 or args.interval < 1:
        p.error("--samples, --rounds and --interval >= 1, --warmup >= 0")
    try:
        sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
        labels = [parse_size(s)[0] for s in sizes]
    except ValueError as exc:
        p.error(str(exc))
    note = None
    shm = args.dir or "/dev/shm"
    if not (os.path.isdir(shm) and os.access(shm, os.W_OK)):
        shm = tempfile.gettempdir()
        note = f"no writable /dev/shm: the 'local tier' is a directory under {shm} (disk, not tmpfs)"
        log("note: " + note)
    base = tempfile.mkdtemp(prefix="bench_tiers_", dir=shm)
    disk = tempfile.mkdtemp(prefix="bench_tiers_disk_")
    report: Dict[str, Any] = {"machine": machine_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "config": {"sizes": labels, "samples": args.samples, "warmup": args.warmup,
                                         "rounds": args.rounds,
                                         "interval": args.interval, "compute_s": args.compute_s,
                                         "local_dir_fs": shm, "smoke": args.smoke},
                              "note": note, "results": {}}
    try:
        for size, label in zip(sizes, labels):
            free_memory()
            sd = make_state(size)
            res = report["results"].setdefault(label, {})
            log(f"{label}:")
            r = res[LOCAL_SAVE] = bench_local_save(sd, base, disk, args.samples, args.warmup)
            log(f"  {LOCAL_SAVE}: {_ms(r['median_s'])} vs raw {_ms(r['ref_median_s'])}: x{r['ratio_median']:.2f} "
                f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f})")
            free_memory()
            r = res[LOCAL_RESTORE] = bench_local_restore(sd, base, disk, args.samples)
            log(f"  {LOCAL_RESTORE}: {_ms(r['median_s'])} vs raw {_ms(r['ref_median_s'])}: x{r['ratio_median']:.2f} "
                f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}); verify=False x{r['no_verify']['ratio_median']:.2f}")
            if not args.skip_loop:
                free_memory()
                r = res[LOOP] = bench_loop(sd, base, args.rounds, args.interval, args.compute_s)
                log(f"  {LOOP}: {_ms(r['median_s'])} vs {_ms(r['ref_median_s'])}: x{r['ratio_median']:.2f} "
                    f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f})")
            del sd
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report["targets"] = targets(report)
    report["table_markdown"] = markdown(report)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_tiers.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    print(report["table_markdown"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
