"""Peer copies of the local tier (issue 38): what replication costs a save, what it sends, and
what it saves a restart after a lost node. 4 gloo ranks on this machine as 2 "nodes" of 2
(``torch.multiprocessing``; each rank's ``GROUP_RANK`` is its node, each node has its own
``local_dir`` on tmpfs, ``/dev/shm``, else a temporary directory on disk). Each rank's state is
its own tensors (default 64 MiB per rank, ``rank<r>.w<i>``, 4 MiB each).

* ``stall``: a loop that "computes" (sleeps ``--compute-s``) and calls ``save_async`` every step
  with a local tier every step (``local_policy=1``; the checkpoint path is never due), with
  ``local_replicas=2`` (each local copy sent to the peer rank on the other node, in the
  background) vs ``local_replicas=1``. They alternate in segments of ``--segment`` saves (a
  round: one segment of each, replication off first; after a segment its saves and copies are
  waited for, untimed). The stall is the wall time of ``save_async``. Per round: median stall
  with replication / median stall without; the result is the median of the round ratios over
  ranks and rounds (target: no change beyond noise, <= 1.1x).
* ``bytes sent``: per rank and replicated save, the file bytes its replication thread sent /
  its local copy's file bytes x (replicas - 1) (target 1.0x: data-parallel replicas that the
  peer holds are still sent, see docs/tiers.md). Also reported: the share of saves replicated
  (a copy whose turn comes after a newer save is not sent) and the seconds an exchange took.
* ``restart``: a step saved to both tiers (the checkpoint path: a bucket on a loopback
  fake-gcs-server), node 1's ``local_dir`` deleted, then every rank makes a fresh manager and
  calls ``restore(None)``: with ``local_replicas=2`` node 1's ranks get their copies from node
  0's ranks, with ``local_replicas=1`` they read the bucket (timed right before). A sample is the
  slowest rank's time (the job waits for it): construction + restore. Ratio peers / bucket per
  sample (target < 1: the point of the feature); both times are reported.

Writes ``bench_peer.json`` to ``--out`` and prints a markdown table.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_peer.py                        # full run
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_peer.py --smoke --out /tmp/b    # seconds
    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_peer.py --per-rank-mib 256 --samples 7
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
from bench_save import free_memory, machine_info, tensors_of  # noqa: E402

warnings.filterwarnings("ignore")

MiB = 2**20
RANKS, PER_NODE = 4, 2

STALL = "save_async stall, replication on / off"
SENT = "bytes sent per rank per save / local copy x (replicas - 1)"
RESTART = "restart after a lost node, peers / bucket"
#: metric -> (target as text, check on the measured median or None for information only)
TARGETS: Dict[str, Any] = {
    STALL: ("no change beyond noise (<= 1.1x)", lambda v: v <= 1.1),
    SENT: ("1.0x", lambda v: 0.99 <= v <= 1.01),
    RESTART: ("< 1x", lambda v: v < 1.0),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def spread(values: Sequence[float]) -> Dict[str, Any]:
    return {"ratio_median": statistics.median(values), "ratio_min": min(values), "ratio_max": max(values),
            "n": len(values), "ratios": list(values)}


def own_state(rank: int, nbytes: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    n = max(1, nbytes // (4 * MiB))
    each = max(1, nbytes // n // 4)
    return {f"rank{rank}": {f"w{i}": torch.randn(each, generator=g) for i in range(n)}}


def blank_like(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: blank_like(v) for k, v in sd.items()}
    return sd


class Rank:
    """What one rank measures; every phase is collective (all ranks call it in the same order)."""

    def __init__(self, rank: int, cfg: Dict[str, Any]) -> None:
        self.rank, self.cfg = rank, cfg
        self.node = rank // PER_NODE
        self.sd = own_state(rank, cfg["per_rank_bytes"])
        self.out: Dict[str, Any] = {"rank": rank, "state_bytes": sum(t.numel() * 4 for t in tensors_of(self.sd))}

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def local_dir(self, name: str) -> str:
        return os.path.join(self.cfg["local"], name, f"node{self.node}")

    def manager(self, path: str, local: str, replicas: int, **kw: Any) -> Any:
        from async_ckpt import CheckpointManager

        return CheckpointManager(path, local_dir=local, local_policy=1, local_retention=2, local_replicas=replicas,
                                 collective_timeout_s=120, **kw)

    # -- the stall of save_async, replication on vs off
    def stall(self) -> None:
        seg, compute = self.cfg["segment"], self.cfg["compute_s"]
        mgrs = {r: self.manager(os.path.join(self.cfg["base"], f"bucket{r}"), self.local_dir(f"stall{r}"), r,
                                save_interval=10**9) for r in (1, 2)}
        rounds: List[Dict[str, Any]] = []
        sizes: List[int] = []
        step = 0
        try:
            for i in range(self.cfg["warmup"] + self.cfg["samples"]):
                row: Dict[str, Any] = {}
                for r in (1, 2):
                    mgr = mgrs[r]
                    free_memory()
                    self.barrier()
                    walls = []
                    for _ in range(seg):
                        time.sleep(compute)
                        step += 1
                        t0 = time.perf_counter()
                        assert mgr.save_async(step, self.sd)
                        walls.append(time.perf_counter() - t0)
                    mgr.join()  # untimed: the segment's saves (and, on, their copies) land
                    row[f"stall_{r}"] = walls
                    row[f"blocking_{r}"] = [s.blocking_s for s in list(mgr.stats)[-seg:]]
                if i >= self.cfg["warmup"]:
                    rounds.append(row)
            peers = mgrs[2].peers
            assert peers is not None, "no peer copies: are the ranks on 2 nodes?"
            own = mgrs[2].roots[0].store
            for s in own.layout.committed_steps():
                sizes.append(sum(r.size for r in own.layout.read_manifest(s).files.values()))
            self.out["transfers"] = [{"step": t.step, "sent_bytes": t.sent_bytes, "received_bytes": t.received_bytes,
                                      "seconds": t.seconds, "problems": list(t.problems)} for t in peers.transfers]
            self.out["replicas"] = peers.topology.replicas
            self.out["saves"] = step // 2
        finally:
            for m in mgrs.values():
                m.close()
        self.out["stall"] = rounds
        self.out["copy_bytes"] = max(sizes) if sizes else 0

    # -- restart after node 1 is lost: from the peers vs from the bucket
    def restart(self) -> None:
        url, opts = self.cfg["gcs_url"], self.cfg["gcs_options"]
        local = self.local_dir("restart")
        with self.manager(url, local, 2, save_interval=1, storage_options=opts) as mgr:
            assert mgr.save(1, self.sd)
        target = blank_like(self.sd)
        pairs = []
        for i in range(self.cfg["restart_warmup"] + self.cfg["samples"]):
            row = {}
            for name, replicas in (("bucket", 1), ("peers", 2)):
                self.barrier()
                if self.rank == PER_NODE:  # the first rank of node 1: its node's disk is gone
                    shutil.rmtree(local, ignore_errors=True)
                free_memory()
                self.barrier()
                t0 = time.perf_counter()
                with self.manager(url, local, replicas, save_interval=1, storage_options=opts) as mgr:
                    assert mgr.restore(None, target) == 1
                    fetched = sum(t.received_bytes for t in mgr.peers.transfers) if mgr.peers is not None else 0
                row[f"{name}_s"] = time.perf_counter() - t0
                row[f"{name}_fetched_bytes"] = fetched
                for a, b in zip(tensors_of(target), tensors_of(self.sd)):
                    assert torch.equal(a, b), "restore is not bitwise"
                for t in tensors_of(target):
                    t.zero_()
            if i >= self.cfg["restart_warmup"]:
                pairs.append(row)
        self.out["restart"] = pairs


def rank_main(rank: int, cfg: Dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update({"GROUP_RANK": str(rank // PER_NODE), "LOCAL_RANK": str(rank % PER_NODE),
                       "LOCAL_WORLD_SIZE": str(PER_NODE)})
    dist.init_process_group("gloo", init_method="file://" + os.path.join(cfg["base"], "store"), rank=rank,
                            world_size=RANKS)
    try:
        r = Rank(rank, cfg)
        phases = [("stall", r.stall)]
        if cfg.get("gcs_url"):
            phases.append(("restart", r.restart))
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

def aggregate(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    m: Dict[str, Any] = {}
    ratios = [statistics.median(row["stall_2"]) / statistics.median(row["stall_1"]) for r in ranks for row in r["stall"]]
    m[STALL] = spread(ratios)
    m[STALL].update({"median_on_s": statistics.median(t for r in ranks for row in r["stall"] for t in row["stall_2"]),
                     "median_off_s": statistics.median(t for r in ranks for row in r["stall"] for t in row["stall_1"]),
                     "blocking_median_on_s": statistics.median(
                         t for r in ranks for row in r["stall"] for t in row["blocking_2"]),
                     "blocking_median_off_s": statistics.median(
                         t for r in ranks for row in r["stall"] for t in row["blocking_1"])})
    sent = [t["sent_bytes"] / (r["copy_bytes"] * (r["replicas"] - 1)) for r in ranks for t in r["transfers"]
            if t["sent_bytes"] and r["copy_bytes"]]
    if sent:
        m[SENT] = spread(sent)
        m[SENT].update({
            "sent_bytes_per_save": statistics.median(t["sent_bytes"] for r in ranks for t in r["transfers"]
                                                     if t["sent_bytes"]),
            "copy_bytes": [r["copy_bytes"] for r in ranks],
            "saves_replicated_share": statistics.median(
                sum(1 for t in r["transfers"] if t["sent_bytes"]) / max(1, r["saves"]) for r in ranks),
            "exchange_median_s": statistics.median(t["seconds"] for r in ranks for t in r["transfers"]
                                                   if t["sent_bytes"]),
            "problems": [p for r in ranks for t in r["transfers"] for p in t["problems"]]})
    if all("restart" in r for r in ranks):
        n = len(ranks[0]["restart"])
        peers = [max(r["restart"][i]["peers_s"] for r in ranks) for i in range(n)]
        bucket = [max(r["restart"][i]["bucket_s"] for r in ranks) for i in range(n)]
        m[RESTART] = spread([p / b for p, b in zip(peers, bucket)])
        m[RESTART].update({"peers_median_s": statistics.median(peers), "bucket_median_s": statistics.median(bucket),
                           "peers_s": peers, "bucket_s": bucket,
                           "fetched_bytes_per_rank": [r["restart"][-1]["peers_fetched_bytes"] for r in ranks]})
    return m


def markdown(report: Dict[str, Any]) -> str:
    lines = ["| metric | measured (median, min-max) | target | verdict |", "| --- | --- | --- | --- |"]
    for name, (target, check) in TARGETS.items():
        v = report["metrics"].get(name)
        if v is None:
            lines.append(f"| {name} | not measured | {target} | - |")
            continue
        cell = f"{v['ratio_median']:.2f}x ({v['ratio_min']:.2f}-{v['ratio_max']:.2f}, n={v['n']})"
        if name == STALL:
            cell += f"; {v['median_on_s'] * 1e3:.1f} vs {v['median_off_s'] * 1e3:.1f} ms"
        if name == SENT:
            cell += f"; {v['sent_bytes_per_save'] / MiB:.1f} MiB/save, {v['saves_replicated_share']:.0%} of saves"
        if name == RESTART:
            cell += f"; {v['peers_median_s']:.2f} s vs {v['bucket_median_s']:.2f} s"
        verdict = "-" if check is None else ("met" if check(v["ratio_median"]) else "NOT met")
        lines.append(f"| {name} | {cell} | {target} | {verdict} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-rank-mib", type=float, default=64, help="each rank's own state, MiB")
    p.add_argument("--samples", type=int, default=5, help="rounds (stall) and restarts per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (stall)")
    p.add_argument("--segment", type=int, default=4, help="saves per segment (stall)")
    p.add_argument("--compute-s", type=float, default=0.5, help="'compute' (sleep) before each save (stall)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="directory for bench_peer.json")
    p.add_argument("--skip-gcs", action="store_true", help="no restart measurement (needs the loopback GCS server)")
    p.add_argument("--smoke", action="store_true", help="1 MiB per rank, 1 sample: seconds")
    args = p.parse_args(argv)
    restart_warmup = 1
    if args.smoke:
        args.per_rank_mib, args.samples, args.warmup, args.segment, args.compute_s = 1, 1, 0, 2, 0.05
        restart_warmup = 0
    if args.samples < 1 or args.warmup < 0 or args.segment < 1 or args.compute_s < 0:
        p.error("--samples and --segment >= 1, --warmup and --compute-s >= 0")
    base = tempfile.mkdtemp(prefix="bench_peer_", dir=args.dir)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and args.dir is None else None
    local = tempfile.mkdtemp(prefix="bench_peer_local_", dir=shm or base)
    cfg: Dict[str, Any] = {"base": base, "local": local, "per_rank_bytes": int(args.per_rank_mib * MiB) // 4 * 4,
                           "samples": args.samples, "warmup": args.warmup, "segment": args.segment,
                           "compute_s": args.compute_s, "restart_warmup": restart_warmup}
    report: Dict[str, Any] = {"machine": machine_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "config": {"ranks": RANKS, "ranks_per_node": PER_NODE,
                                         "per_rank_bytes": cfg["per_rank_bytes"], "samples": args.samples,
                                         "warmup": args.warmup, "segment": args.segment, "compute_s": args.compute_s,
                                         "local_dir_on": "tmpfs" if shm else "disk", "smoke": args.smoke,
                                         "gcs": not args.skip_gcs},
                              "note": None}
    server = None
    try:
        if not args.skip_gcs:
            try:
                from tests.support.storage_servers import FakeGCSServer

                server = FakeGCSServer().start()
                bucket = server.new_bucket("bench-peer")
                cfg["gcs_url"], cfg["gcs_options"] = bucket.url, bucket.storage_options
            except Exception as exc:  # noqa: BLE001 - reported; the other measurements still run
                report["note"] = f"no restart measurement: the loopback GCS server did not start ({exc})"
                report["config"]["gcs"] = False
                log("note: " + report["note"])
        free_memory()
        log(f"{RANKS} ranks on 2 nodes, {args.per_rank_mib:g} MiB per rank:")
        import torch.multiprocessing as mp

        mp.spawn(rank_main, args=(cfg,), nprocs=RANKS, join=True)
        ranks = []
        for r in range(RANKS):
            with open(os.path.join(base, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    gc.collect()
    report["ranks"] = ranks
    report["metrics"] = aggregate(ranks)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report["table_markdown"] = markdown(report)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_peer.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    print(report["table_markdown"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
