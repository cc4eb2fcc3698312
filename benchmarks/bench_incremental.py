"""Incremental-save benchmark (issue 27): a LoRA-like state where most bytes never change.

The state: a frozen fp32 base (default 1 GiB, ``--base-mb``, in tensors of at most 64 MiB), a
trainable part (default 16 MiB, ``--trainable-mb``, in tensors of 1 MiB), its AdamW state (two
tensors per trainable one, so 2x the trainable bytes, plus a scalar ``step`` tensor each) and a
step counter. Before each save the trainable tensors and the optimizer state change (in place,
untimed); the base never does. "Changed bytes" are the trainable + optimizer tensor bytes.

Measured, each against a reference taken right before each sample (paired; the median, min and
max of the per-sample ratios are reported):

* ``written_vs_changed``: bytes written per save (``SaveStats.written_bytes`` where the library
  has it, else ``Manifest.written_bytes``) / changed bytes, saves 2..N (the first is whole).
  Target: written <= 1.1 x changed + 1 MiB.
* ``durable_vs_raw_write``: ``SaveStats.durable_s`` of ``save()`` / a raw write + fsync of the
  changed bytes into one file in the same directory, timed right before. Target <= 1.5.
* ``storage_vs_bound``: after N saves, all retained: the bytes of the unique inodes under the
  root / (one full copy + N x changed). Target <= 1.0. (One sample.)
* ``stall_vs_floor``: ``SaveStats.blocking_s`` of ``save_async`` (incremental, no ``frozen=``)
  / the host-copy floor of the whole state (``copy_`` into preallocated tensors) right before.
  Target <= 1.2.
* ``stall_frozen_vs_changing_floor``: the same with the base declared frozen (``frozen=``; only
  where the library has that option, else skipped with a note) / the floor of the changing
  tensors only. Target <= 1.2.
* ``pretrain_durable_inc_vs_full`` and ``pretrain_stall_inc_vs_full``: a state of the same total
  size where every tensor changes at every save: ``incremental=True`` against
  ``incremental=False`` (the reference saved right before, to another root). Targets <= 1.05 for
  the durable time (hashing is all it adds), and unchanged stall (<= 1.1, the noise of a copy).
* ``restore_vs_raw_read``: restoring the newest incremental step into preallocated tensors, cold
  (page cache dropped before each: needs root and a writable ``/proc/sys/vm/drop_caches``;
  otherwise, and with ``--smoke`` or ``--warm``, warm, with a note) / a raw ``readinto`` of all
  the step's files right before. Target <= 1.2.
* ``verify_vs_durable``: what verifying the files a save takes costs in the common case (each
  taken file written or checked earlier by this process: a ``stat`` before and after the link,
  and one of each written file): ``SaveStats.extra["verify_s"]`` / ``durable_s`` of the same
  save, saves 2..N of the LoRA phase (``verify_read_bytes`` is 0 there). Target <= 0.02.
* ``verify_after_restart_vs_raw_read``: the first save of a restarted manager (a new manager
  restores the newest step, then saves) reads the files it takes back once and checks their
  CRC32C: its ``verify_s`` / a raw ``readinto`` of the same bytes right after (both warm: the
  restore just read them). ``--restart-samples`` restarts. Target <= 1.5.

Prints a markdown table (metric, measured, target, verdict) and writes ``<name>.json`` (default
``bench_incremental``) under ``--out`` (default benchmarks/results).

    .venv/bin/python benchmarks/bench_incremental.py                   # full run: 1 GiB base
    .venv/bin/python benchmarks/bench_incremental.py --base-mb 256 --saves 5
    .venv/bin/python benchmarks/bench_incremental.py --smoke --out /tmp/b   # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore")

import torch  # noqa: E402

KiB, MiB, GiB = 2**10, 2**20, 2**30

#: metric key -> (what it compares, target ratio, target text)
METRICS = {
    "written_vs_changed": ("bytes written per save / changed bytes", None, "<= 1.1x changed + 1 MiB"),
    "durable_vs_raw_write": ("durable time per save / raw write+fsync of the changed bytes", 1.5, "<= 1.5"),
    "storage_vs_bound": ("storage of the retained steps (unique inodes) / (1 full copy + N x changed)", 1.0, "<= 1.0"),
    "stall_vs_floor": ("stall (blocking_s), no frozen= / host-copy floor of the whole state", 1.2, "<= 1.2"),
    "stall_frozen_vs_changing_floor": ("stall, base declared frozen= / host-copy floor of the changing tensors",
                                       1.2, "<= 1.2"),
    "durable_frozen_vs_raw_write": ("durable time per save, base declared frozen= / raw write+fsync of the "
                                    "changed bytes", 1.5, "<= 1.5"),
    "pretrain_durable_inc_vs_full": ("everything changes: durable time, incremental / not", 1.05, "<= 1.05"),
    "pretrain_stall_inc_vs_full": ("everything changes: stall, incremental / not", 1.1, "unchanged (<= 1.1)"),
    "restore_vs_raw_read": ("restore of the newest incremental step / raw read of its bytes", 1.2, "<= 1.2"),
    "verify_vs_durable": ("verifying the taken files (common case: stat) / durable time of the save", 0.02,
                          "<= 0.02"),
    "verify_after_restart_vs_raw_read": ("first save after a restart: verifying the taken files (read back) / raw "
                                         "read of them", 1.5, "<= 1.5"),
}


# ---- the state --------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoraState:
    """The benchmark's state dict and the parts of it that change."""

    sd: Dict[str, Any]
    base: List[torch.Tensor]  # frozen
    changing: List[torch.Tensor]  # trainable + optimizer tensors (>= 64 KiB ones and the step scalars)
    base_keys: List[str]  # flattened keys of the base tensors (for frozen=)

    @property
    def changed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.changing)

    @property
    def total_bytes(self) -> int:
        return self.changed_bytes + sum(t.numel() * t.element_size() for t in self.base)


def lora_state(base_bytes: int, trainable_bytes: int, base_tensor: int = 64 * MiB,
               trainable_tensor: int = MiB, seed: int = 0) -> LoraState:
    """The LoRA-like state: ``model.base.<i>`` (frozen), ``model.lora.<j>`` (trainable) and an
    AdamW-like ``optim`` state for each trainable tensor, plus ``step``."""
    g = torch.Generator().manual_seed(seed)

    def t(nbytes: int) -> torch.Tensor:
        return torch.empty(max(1, nbytes // 4)).normal_(generator=g)

    model: Dict[str, torch.Tensor] = {}
    base: List[torch.Tensor] = []
    left, i = base_bytes, 0
    while left > 0:
        n = min(base_tensor, left)
        model[f"base.{i}"] = x = t(n)
        base.append(x)
        left, i = left - n, i + 1
    changing: List[torch.Tensor] = []
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    left, j = trainable_bytes, 0
    while left > 0:
        n = min(trainable_tensor, left)
        model[f"lora.{j}"] = p = t(n)
        state[j] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        changing += [p, state[j]["step"], state[j]["exp_avg"], state[j]["exp_avg_sq"]]
        left, j = left - n, j + 1
    sd = {"model": model, "optim": {"state": state, "param_groups": [{"lr": 1e-4, "params": list(range(j))}]},
          "step": 0}
    return LoraState(sd, base, changing, [f"model.base.{k}" for k in range(i)])


def pretrain_state(total_bytes: int, tensor: int = 64 * MiB, seed: int = 1) -> LoraState:
    """A state of ``total_bytes`` in which every tensor changes at every save."""
    g = torch.Generator().manual_seed(seed)
    model, left, i = {}, total_bytes, 0
    while left > 0:
        n = min(tensor, left)
        model[f"w.{i}"] = torch.empty(max(1, n // 4)).normal_(generator=g)
        left, i = left - n, i + 1
    return LoraState({"model": model, "step": 0}, [], list(model.values()), [])


def step_state(st: LoraState, step: int) -> None:
    """One training step's change (untimed): every changing tensor moves, the base does not."""
    with torch.no_grad():
        for t in st.changing:
            t.add_(1e-3 * (step + 1))
    st.sd["step"] = step


# ---- references -------------------------------------------------------------------------------------

def floor_copy(src: List[torch.Tensor], dst: List[torch.Tensor]) -> float:
    """Seconds to ``copy_`` ``src`` into the preallocated ``dst`` (the host-copy floor)."""
    t0 = time.perf_counter()
    for s, d in zip(src, dst):
        d.copy_(s)
    return time.perf_counter() - t0


def raw_write(tensors: List[torch.Tensor], path: str) -> float:
    """Seconds to write the tensors' bytes into one new file and fsync it (then removed)."""
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def raw_read(directory: str, buffers: Dict[str, bytearray]) -> float:
    """Seconds to ``readinto`` every file of ``directory`` into preallocated buffers."""
    t0 = time.perf_counter()
    for name, buf in buffers.items():
        with open(os.path.join(directory, name), "rb", buffering=0) as f:
            view, got = memoryview(buf), 0
            while got < len(buf):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
    return time.perf_counter() - t0


def can_drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def unique_bytes(root: str) -> int:
    """Bytes of the regular files under ``root``, each inode counted once (hard links)."""
    seen, total = set(), 0
    for d, _, files in os.walk(root):
        for n in files:
            st = os.lstat(os.path.join(d, n))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def summary(samples: Sequence[float]) -> Dict[str, Any]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def has_frozen_option() -> bool:
    from async_ckpt.options import ManagerOptions

    return "frozen" in {f.name for f in dataclasses.fields(ManagerOptions)}


def _written(mgr: Any, step: int) -> Dict[str, Any]:
    st = mgr.stats[-1]
    if hasattr(st, "written_bytes"):
        return {"written_bytes": st.written_bytes, "referred_bytes": st.referred_bytes, "source": "SaveStats"}
    man = mgr.layout.read_manifest(step)
    return {"written_bytes": man.written_bytes, "referred_bytes": man.referred_bytes, "source": "Manifest"}


# ---- the phases -------------------------------------------------------------------------------------

def phase_lora(args: argparse.Namespace, work: str, report: Dict[str, Any], log: Callable[[str], None]) -> str:
    """Saves 1..N of the LoRA state with ``save()``: bytes written, durable time, storage."""
    from async_ckpt import CheckpointManager

    st = lora_state(args.base_mb * MiB, args.trainable_mb * MiB, args.base_tensor_mb * MiB)
    report["state"] = {"base_bytes": st.total_bytes - st.changed_bytes, "changed_bytes": st.changed_bytes,
                       "total_bytes": st.total_bytes, "tensors": len(st.base) + len(st.changing)}
    root = os.path.join(work, "lora")
    changed = [t for t in st.changing]
    saves: List[Dict[str, Any]] = []
    with CheckpointManager(root, incremental=True, max_to_keep=args.saves + 1) as mgr:
        for s in range(1, args.saves + 1):
            step_state(st, s)
            gc.collect()
            raw = raw_write(changed, os.path.join(work, "raw.bin"))
            mgr.save(s, st.sd)
            stats = mgr.stats[-1]
            rec = {"step": s, "raw_write_s": raw, "durable_s": stats.durable_s, "blocking_s": stats.blocking_s,
                   "verify_s": stats.extra.get("verify_s"), "verify_read_bytes": stats.extra.get("verify_read_bytes"),
                   **_written(mgr, s)}
            saves.append(rec)
            log(f"lora save {s}: {rec['written_bytes'] / MiB:.1f} MiB written, {rec['referred_bytes'] / MiB:.1f} MiB "
                f"taken, durable {rec['durable_s'] * 1e3:.1f} ms (raw write of the changed bytes {raw * 1e3:.1f} ms)")
    later = saves[1:]
    m = report["metrics"]
    bound = 1.1 * st.changed_bytes + MiB
    w = summary([x["written_bytes"] / st.changed_bytes for x in later])
    w.update(samples=[x["written_bytes"] for x in later], changed_bytes=st.changed_bytes, bound_bytes=bound,
             verdict="pass" if w["median"] * st.changed_bytes <= bound else "FAIL", source=later[0]["source"])
    m["written_vs_changed"] = w
    m["durable_vs_raw_write"] = _paired([x["durable_s"] for x in later], [x["raw_write_s"] for x in later],
                                        "durable_vs_raw_write")
    storage = unique_bytes(root)
    bound_storage = st.total_bytes + args.saves * st.changed_bytes
    m["storage_vs_bound"] = {**summary([storage / bound_storage]), "unique_bytes": storage,
                             "bound_bytes": bound_storage, "steps": args.saves,
                             "verdict": _verdict(storage / bound_storage, "storage_vs_bound")}
    if later[0]["verify_s"] is None:
        m["verify_vs_durable"] = {"verdict": "skipped", "note": "this async_ckpt does not report verify_s"}
    else:
        m["verify_vs_durable"] = _paired([x["verify_s"] for x in later], [x["durable_s"] for x in later],
                                         "verify_vs_durable")
        m["verify_vs_durable"]["read_bytes"] = [x["verify_read_bytes"] for x in later]
    report["lora_saves"] = saves
    return root


def phase_verify_restart(args: argparse.Namespace, root: str, work: str, report: Dict[str, Any],
                         log: Callable[[str], None]) -> None:
    """The first save of a restarted manager: it reads back (and checks) the files it takes,
    which this process never saw; its ``verify_s`` against a raw read of those files."""
    from async_ckpt import CheckpointManager

    st = lora_state(args.base_mb * MiB, args.trainable_mb * MiB, args.base_tensor_mb * MiB)  # the same base
    target = lora_state(args.base_mb * MiB, args.trainable_mb * MiB, args.base_tensor_mb * MiB, seed=7).sd
    verify, refs, nread = [], [], []
    for _ in range(args.restart_samples):
        with CheckpointManager(root, incremental=True, max_to_keep=args.saves + args.restart_samples + 1) as mgr:
            step = mgr.restore(None, target) + 1  # untimed: what a resumed job does first
            step_state(st, step)
            gc.collect()
            mgr.save(step, st.sd)
            stats = mgr.stats[-1]
            if stats.extra.get("verify_s") is None:
                report["metrics"]["verify_after_restart_vs_raw_read"] = {
                    "verdict": "skipped", "note": "this async_ckpt does not report verify_s"}
                return
            man = mgr.layout.read_manifest(step)
            where = mgr.layout.locate(step)
            taken = {n: bytearray(r.size) for n, r in man.files.items() if r.ref is not None}
            refs.append(raw_read(where, taken))
            verify.append(stats.extra["verify_s"])
            nread.append(stats.extra.get("verify_read_bytes", 0))
            log(f"save after a restart: verify {verify[-1] * 1e3:.1f} ms ({nread[-1] / MiB:.1f} MiB read back), "
                f"raw read of the taken files {refs[-1] * 1e3:.1f} ms")
    out = _paired(verify, refs, "verify_after_restart_vs_raw_read")
    out["read_bytes"] = nread
    report["metrics"]["verify_after_restart_vs_raw_read"] = out


def phase_stall(args: argparse.Namespace, work: str, report: Dict[str, Any], log: Callable[[str], None]) -> None:
    """Stall of ``save_async`` (incremental), against the host-copy floor right before each."""
    from async_ckpt import CheckpointManager

    st = lora_state(args.base_mb * MiB, args.trainable_mb * MiB, args.base_tensor_mb * MiB)
    src_all = st.base + st.changing
    dst_all = [torch.empty_like(t) for t in src_all]
    dst_changing = dst_all[len(st.base):]
    variants = [("stall_vs_floor", {}, src_all, dst_all)]
    if has_frozen_option():
        variants.append(("stall_frozen_vs_changing_floor", {"frozen": list(st.base_keys)}, st.changing, dst_changing))
    else:
        report["metrics"]["stall_frozen_vs_changing_floor"] = {
            "verdict": "skipped", "note": "this async_ckpt has no frozen= option (declared-frozen tensors)"}
        report["notes"].append("stall with frozen=: skipped (the library has no frozen= option yet)")
    for key, extra, src, dst in variants:
        floor_copy(src, dst)  # first touch of the destinations, untimed
        blocking, floors, durable, raws = [], [], [], []
        with CheckpointManager(os.path.join(work, key), incremental=True, max_to_keep=2, **extra) as mgr:
            for s in range(1, args.saves + 1):
                step_state(st, s)
                mgr.join()  # the previous save's write is not the stall's business
                gc.collect()
                raw = raw_write(st.changing, os.path.join(work, "raw.bin")) if extra else 0.0
                f = floor_copy(src, dst)
                mgr.save_async(s, st.sd)
                if s > 1:  # the first save of a manager allocates its host buffers
                    floors.append(f)
                    blocking.append(mgr.stats[-1].blocking_s)
                if extra:
                    mgr.join()
                    if s > 1 and mgr.stats[-1].durable_s is not None:
                        durable.append(mgr.stats[-1].durable_s)
                        raws.append(raw)
            mgr.join()
        report["metrics"][key] = _paired(blocking, floors, key)
        log(f"{key}: median {report['metrics'][key]['median']:.3f}")
        if extra and durable:
            report["metrics"]["durable_frozen_vs_raw_write"] = _paired(durable, raws, "durable_frozen_vs_raw_write")
            log(f"durable_frozen_vs_raw_write: median {report['metrics']['durable_frozen_vs_raw_write']['median']:.3f}")
    del dst_all


def phase_pretrain(args: argparse.Namespace, work: str, report: Dict[str, Any], log: Callable[[str], None]) -> None:
    """Everything changes: incremental=True against incremental=False, the latter right before."""
    from async_ckpt import CheckpointManager

    total = (args.base_mb + 3 * args.trainable_mb) * MiB
    st = pretrain_state(total, args.base_tensor_mb * MiB)
    full = CheckpointManager(os.path.join(work, "pre_full"), max_to_keep=2)
    inc = CheckpointManager(os.path.join(work, "pre_inc"), incremental=True, max_to_keep=2)
    res: Dict[str, List[float]] = {"full_durable": [], "inc_durable": [], "full_stall": [], "inc_stall": []}
    try:
        for s in range(1, args.pretrain_saves + 1):
            step_state(st, s)
            for mgr in ((full, inc) if s % 2 else (inc, full)):  # alternating which one goes first
                gc.collect()
                mgr.save(s, st.sd)
            if s > 1:  # the first: buffers allocated, and the incremental one's first save is whole anyway
                for name, mgr in (("full", full), ("inc", inc)):
                    res[f"{name}_durable"].append(mgr.stats[-1].durable_s)
                    res[f"{name}_stall"].append(mgr.stats[-1].blocking_s)
                log(f"pretrain save {s}: durable {res['inc_durable'][-1] * 1e3:.1f} ms incremental, "
                    f"{res['full_durable'][-1] * 1e3:.1f} ms not")
    finally:
        full.close()
        inc.close()
    report["metrics"]["pretrain_durable_inc_vs_full"] = _paired(res["inc_durable"], res["full_durable"],
                                                                "pretrain_durable_inc_vs_full")
    report["metrics"]["pretrain_stall_inc_vs_full"] = _paired(res["inc_stall"], res["full_stall"],
                                                              "pretrain_stall_inc_vs_full")


def phase_restore(args: argparse.Namespace, root: str, report: Dict[str, Any], log: Callable[[str], None]) -> None:
    """Restore of the newest incremental step against a raw read of its files right before."""
    from async_ckpt import CheckpointManager

    cold = not args.warm and can_drop_caches()
    if not cold:
        why = ("--smoke/--warm" if args.warm else "the page cache cannot be dropped here (needs root and a "
                                                  "writable /proc/sys/vm/drop_caches)")
        report["notes"].append(f"restore: measured warm, not cold: {why}")
    mgr = CheckpointManager(root)
    step = mgr.latest_step()
    where = mgr.layout.locate(step)
    man = mgr.layout.read_manifest(step)
    buffers = {n: bytearray(r.size) for n, r in man.files.items()}
    target = lora_state(args.base_mb * MiB, args.trainable_mb * MiB, args.base_tensor_mb * MiB, seed=7).sd
    ratios_in, refs = [], []
    if not cold:  # warm-up: page cache, first-call costs
        raw_read(where, buffers)
        mgr.restore(step, target)
    for _ in range(args.restore_samples):
        gc.collect()
        if cold:
            drop_caches()
        r = raw_read(where, buffers)
        if cold:
            drop_caches()
        t0 = time.perf_counter()
        mgr.restore(step, target)
        ratios_in.append(time.perf_counter() - t0)
        refs.append(r)
    out = _paired(ratios_in, refs, "restore_vs_raw_read")
    out.update(cold=cold, step=step, bytes=sum(r.size for r in man.files.values()),
               referred_bytes=man.referred_bytes)
    report["metrics"]["restore_vs_raw_read"] = out
    log(f"restore ({'cold' if cold else 'warm'}): median ratio {out['median']:.3f}")


# ---- report -----------------------------------------------------------------------------------------

def _verdict(value: float, key: str) -> str:
    target = METRICS[key][1]
    return "pass" if target is None or value <= target else "FAIL"


def _paired(samples: List[float], refs: List[float], key: str) -> Dict[str, Any]:
    """Per-sample ratios ``samples[i] / refs[i]`` (each reference timed right before its sample)."""
    ratios = [s / r for s, r in zip(samples, refs) if r > 0]
    out = summary(ratios) if ratios else {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    out.update(samples_s=samples, references_s=refs, sample_median_s=statistics.median(samples) if samples else None,
               reference_median_s=statistics.median(refs) if refs else None,
               verdict=_verdict(out["median"], key) if ratios else "no samples")
    return out


def markdown(report: Dict[str, Any]) -> str:
    lines = ["| metric | measured (median [min, max] of paired ratios) | target | verdict |", "| --- | --- | --- | --- |"]
    for key, (what, _, target) in METRICS.items():
        m = report["metrics"].get(key)
        if m is None or "median" not in m:
            lines.append(f"| {what} | {m.get('note', 'not measured') if m else 'not measured'} | {target} | "
                         f"{m.get('verdict', '-') if m else '-'} |")
            continue
        text = f"{m['median']:.3f}x [{m['min']:.3f}, {m['max']:.3f}]"
        if key == "written_vs_changed":
            text += f" ({statistics.median(m['samples']) / MiB:.1f} MiB of {m['changed_bytes'] / MiB:.1f} MiB changed)"
        elif key == "storage_vs_bound":
            text = f"{m['median']:.3f}x ({m['unique_bytes'] / MiB:.1f} MiB, bound {m['bound_bytes'] / MiB:.1f} MiB)"
        elif key == "restore_vs_raw_read":
            text += " cold" if m.get("cold") else " warm"
        elif key in ("verify_vs_durable", "verify_after_restart_vs_raw_read"):
            text += f" ({m['sample_median_s'] * 1e3:.2f} ms, {statistics.median(m['read_bytes']) / MiB:.1f} MiB read back)"
        lines.append(f"| {what} | {text} | {target} | {m['verdict']} |")
    notes = [f"\n{n}" for n in report.get("notes", [])]
    return "\n".join(lines) + "".join(notes)


def machine() -> Dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "platform": platform.platform()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-mb", type=int, default=1024, help="frozen base, MiB (default 1024)")
    p.add_argument("--trainable-mb", type=int, default=16, help="trainable part, MiB (AdamW state: 2x this)")
    p.add_argument("--base-tensor-mb", type=int, default=64, help="largest base tensor, MiB")
    p.add_argument("--saves", type=int, default=10, help="saves of the LoRA state (and retained steps)")
    p.add_argument("--pretrain-saves", type=int, default=6, help="paired saves of the everything-changes state")
    p.add_argument("--restore-samples", type=int, default=5, help="paired restore samples")
    p.add_argument("--restart-samples", type=int, default=3, help="restarted managers' first saves (verify cost)")
    p.add_argument("--warm", action="store_true", help="restore warm (no page-cache drop)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="directory of the JSON report")
    p.add_argument("--name", default="bench_incremental", help="the report's file name, without .json")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few samples, warm: checks the script works")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.base_mb, args.trainable_mb, args.base_tensor_mb = 4, 1, 1
        args.saves, args.pretrain_saves, args.restore_samples, args.warm = 3, 2, 1, True
        args.restart_samples = 1
    if min(args.base_mb, args.trainable_mb, args.base_tensor_mb) < 1 or args.saves < 2 or args.pretrain_saves < 2 \
            or args.restore_samples < 1 or args.restart_samples < 1:
        p.error("sizes must be >= 1 MiB, --saves and --pretrain-saves >= 2, --restore-samples and "
                "--restart-samples >= 1")

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    report: Dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}, "machine": machine(),
                              "frozen_option": has_frozen_option(), "metrics": {}, "notes": []}
    work = tempfile.mkdtemp(prefix="bench-incremental-", dir=args.dir)
    try:
        root = phase_lora(args, work, report, log)
        phase_restore(args, root, report, log)
        phase_verify_restart(args, root, work, report, log)
        shutil.rmtree(root, ignore_errors=True)
        phase_stall(args, work, report, log)
        phase_pretrain(args, work, report, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["table_markdown"] = markdown(report)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    print(report["table_markdown"])
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
