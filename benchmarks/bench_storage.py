"""Upload and restore throughput to object-store servers on loopback, in one run.

For one state dict (default 512 MiB: 64 float32 tensors of 8 MiB), on each server
(fake-gcs-server for GCS; moto's S3 server, in its own process, for S3) it times:

* ``async_ckpt``: our DCP-format writer (``save_state_dict``) and reader (``load_state_dict``,
  verified with CRC32C), as the manager runs them;
* ``raw pipe`` / ``raw cat``: fsspec's concurrent ``fs.pipe`` / ``fs.cat`` of the same tensor
  bytes, one object per tensor, with no serialisation and no checksums: the ceiling;
* ``CheckpointManager.restore``: the manager's restore of a step it saved (what a user calls at
  startup), into existing tensors;
* ``DCP FsspecWriter``: ``dcp.save`` with ``FsspecWriter`` at its defaults (one thread) and
  with 8 threads; ``dcp.load`` with ``FsspecReader``.

Prints a table and writes JSON to ``benchmarks/results/``. One run per configuration: the
machine is small and shared, so treat differences under ~20% as noise.

    PJRT_DEVICE=CPU .venv/bin/python benchmarks/bench_storage.py [--mib 512] [--servers gcs,s3] [--samples 5]

The manager's restore is also timed in ``--samples`` pairs, each right after a raw ``fs.cat`` of
the same bytes; the summary gives the median and range of the per-pair throughput ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import uuid
import warnings
from typing import Any, Callable, Dict, List, Optional

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs is imported (emulator only)
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fsspec  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402

from async_ckpt import CheckpointManager  # noqa: E402
from async_ckpt.io import load_state_dict, save_state_dict  # noqa: E402
from async_ckpt.io.read_exec import read_files  # noqa: E402
from async_ckpt.io.sinks import NULL  # noqa: E402
from async_ckpt.storage.storage import READ_RANGE_BYTES, Storage  # noqa: E402
from tests.support.storage_servers import S3_KEY, S3_SECRET, FakeGCSServer, _http_ok, _wait, free_port  # noqa: E402

warnings.filterwarnings("ignore")
MiB = 2**20
MANAGER_RESTORE = "async_ckpt CheckpointManager.restore"


class MotoProcess:
    """moto's S3 server in a child process, so it does not share this process's GIL."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(lambda: _http_ok(f"{self.url}/moto-api/"), "moto server", timeout=60)

    def storage_options(self) -> Dict[str, Any]:
        return {"endpoint_url": self.url, "key": S3_KEY, "secret": S3_SECRET, "skip_instance_cache": True}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def make_state(mib: int, tensor_mib: int = 8) -> Dict[str, torch.Tensor]:
    n = max(1, mib // tensor_mib)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(tensor_mib * MiB // 4, generator=g) for i in range(n)}


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_server(kind: str, opts: Dict[str, Any], sd: Dict[str, torch.Tensor], threads: int,
                 file_mib: int = 0, samples: int = 5,
                 pairs: Optional[List[Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    proto = "gs" if kind == "gcs" else "s3"
    fs = fsspec.filesystem(proto, **opts)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    blobs = {k: t.numpy().tobytes() for k, t in sd.items()}
    rows: List[Dict[str, Any]] = []
    pairs = [] if pairs is None else pairs

    def row(name: str, op: str, secs: float) -> None:
        rows.append({"server": kind, "method": name, "op": op, "seconds": round(secs, 3),
                     "MiB_per_s": round(nbytes / MiB / secs, 1)})
        print(f"  {kind:4s} {op:8s} {name:32s} {nbytes / MiB / secs:8.1f} MiB/s  ({secs:.2f} s)", flush=True)

    def clear(prefix: str) -> None:
        try:
            fs.rm(f"{bucket}/{prefix}", recursive=True)
        except FileNotFoundError:
            pass
        fs.invalidate_cache()

    # raw concurrent pipe / cat of one object per tensor
    paths = {f"{bucket}/raw/{k}": v for k, v in blobs.items()}
    row("raw fs.pipe (1 object/tensor)", "upload", timed(lambda: fs.pipe(paths)))
    row("raw fs.cat (1 object/tensor)", "restore", timed(lambda: fs.cat(list(paths))))

    # async_ckpt's writer/reader
    st = Storage(f"{proto}://{bucket}/ours", opts)
    if file_mib:
        st.max_file_bytes = file_mib * MiB
    files: Dict[str, Any] = {}

    def ours_save() -> None:
        files.update(save_state_dict(st, st.join("0"), sd, threads=threads))

    row(f"async_ckpt ({threads} threads)", "upload", timed(ours_save))
    # Restore into initialised tensors, as into a freshly built model (not untouched pages).
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    row(f"async_ckpt ({threads} threads, crc)", "restore",
        timed(lambda: load_state_dict(st, st.join("0"), target, files=files, threads=threads)))
    assert all(torch.equal(target[k], sd[k]) for k in sd), "restore is not bitwise equal"
    # The same reads and CRC32C checks alone, without the copy into the caller's tensors (that
    # copy happens after every file is verified, so that a failed restore changes nothing).
    data = {n: r for n, r in files.items() if n.endswith(".distcp")}
    row("async_ckpt reads+crc only (no copy)", "restore",
        timed(lambda: read_files(st, st.join("0"), data, NULL, threads=threads, chunk=READ_RANGE_BYTES)))
    clear("ours")

    # The manager, as a user restores at startup: CheckpointManager.restore into existing tensors
    # (ranged reads of each record straight into the targets, CRC-32C as they arrive).
    url = f"{proto}://{bucket}/mgr"
    mgr = CheckpointManager(url, storage_options=opts, write_threads=threads)
    mgr.save(0, sd)
    mgr.close()
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    fresh = CheckpointManager(url, storage_options=opts, write_threads=threads)
    row(MANAGER_RESTORE, "restore", timed(lambda: fresh.restore(0, target)))
    assert all(torch.equal(target[k], sd[k]) for k in sd), "manager restore is not bitwise equal"
    # Paired samples: a raw fs.cat of the same bytes right before each manager restore (the
    # loopback servers share the two cores with the client, so single timings swing 2-3x).
    for _ in range(samples):
        raw_s = timed(lambda: fs.cat(list(paths)))
        ours_s = timed(lambda: fresh.restore(0, target))
        pairs.append({"raw_cat_s": round(raw_s, 3), "manager_restore_s": round(ours_s, 3),
                      "throughput_vs_raw_cat": round(raw_s / ours_s, 2)})
    fresh.close()
    clear("mgr")
    clear("raw")

    # DCP's own fsspec writer / reader
    for tc in (1, 8):
        url = f"{proto}://{bucket}/dcp{tc}"
        w = FsspecWriter(url, thread_count=tc, **opts)
        row(f"DCP FsspecWriter (thread_count={tc})", "upload", timed(lambda: dcp.save(sd, storage_writer=w, no_dist=True)))
        if tc == 1:
            target = {k: torch.zeros_like(v) for k, v in sd.items()}
            r = FsspecReader(url, **opts)
            row("dcp.load FsspecReader", "restore", timed(lambda: dcp.load(target, storage_reader=r, no_dist=True)))
        clear(f"dcp{tc}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="state dict size in MiB")
    ap.add_argument("--servers", default="gcs,s3", help="comma-separated: gcs, s3")
    ap.add_argument("--threads", type=int, default=8, help="async_ckpt write/read threads (the manager's default)")
    ap.add_argument("--file-mib", type=int, default=0, help="async_ckpt object size (default: Storage's)")
    ap.add_argument("--samples", type=int, default=5, help="paired samples of raw fs.cat then the manager's restore")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    sd = make_state(args.mib)
    rows: List[Dict[str, Any]] = []
    paired: Dict[str, List[Dict[str, Any]]] = {}
    for kind in [s.strip() for s in args.servers.split(",") if s.strip()]:
        srv: Any = FakeGCSServer().start() if kind == "gcs" else MotoProcess()
        try:
            paired[kind] = []
            rows += bench_server(kind, srv.storage_options(), sd, args.threads, args.file_mib, args.samples,
                                 paired[kind])
        finally:
            srv.stop()

    print("\n| server | op | method | MiB/s | s |\n|---|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['server']} | {r['op']} | {r['method']} | {r['MiB_per_s']} | {r['seconds']} |")
    summary = {}
    for kind in {r["server"] for r in rows}:
        by = {(r["op"], r["method"]): r["MiB_per_s"] for r in rows if r["server"] == kind}
        ours_up = next(v for (op, m), v in by.items() if op == "upload" and m.startswith("async_ckpt"))
        ours_rd = next(v for (op, m), v in by.items() if op == "restore" and m.startswith("async_ckpt ("))
        summary[kind] = {
            "upload_vs_raw_pipe": round(ours_up / by[("upload", "raw fs.pipe (1 object/tensor)")], 2),
            "upload_vs_dcp_default": round(ours_up / by[("upload", "DCP FsspecWriter (thread_count=1)")], 2),
            "upload_vs_dcp_8_threads": round(ours_up / by[("upload", "DCP FsspecWriter (thread_count=8)")], 2),
            "restore_vs_raw_cat": round(ours_rd / by[("restore", "raw fs.cat (1 object/tensor)")], 2),
            "manager_restore_vs_raw_cat": round(by[("restore", MANAGER_RESTORE)]
                                                / by[("restore", "raw fs.cat (1 object/tensor)")], 2),
            "restore_vs_dcp_load": round(ours_rd / by[("restore", "dcp.load FsspecReader")], 2),
        }
        ratios = sorted(p["throughput_vs_raw_cat"] for p in paired.get(kind, []))
        if ratios:
            summary[kind]["manager_restore_vs_raw_cat_paired_median"] = ratios[len(ratios) // 2]
            summary[kind]["manager_restore_vs_raw_cat_paired_range"] = [ratios[0], ratios[-1]]
        print(f"\n{kind}: " + ", ".join(f"{k} {v}x" for k, v in summary[kind].items()))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_storage_{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"mib": args.mib, "threads": args.threads, "cpus": os.cpu_count(), "python": platform.python_version(),
                   "torch": torch.__version__, "rows": rows, "summary": summary, "paired_restore": paired,
                   "note": "one run on a small shared machine; servers on 127.0.0.1"}, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
