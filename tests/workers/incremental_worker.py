"""States and subprocess workers for tests/incremental/test_incremental.py (incremental saves).

Importable (``from .incremental_worker import ...``: the deterministic states the tests compare
with) and runnable:

    python incremental_worker.py crash
        A fork server (tests/support/fork_trials.py, as tests/workers/crash_worker.py): imports torch once, then for each trial read
        from stdin (one JSON object a line: ``{"dir": ..., "delay": s, "full_every": N|null,
        "sync": bool}``) forks a child that resumes from the newest committed step (checking it
        bitwise) and saves every following step incrementally, with retention, until the server
        SIGKILLs it after ``delay`` seconds. Answers one JSON line per trial:
        ``{"status", "committed", "started", "resumed", "resume_ok", "error"}``.

    torchrun --standalone --nproc-per-node 2 incremental_worker.py dist <root>
        Two ranks (gloo) save steps 0..4 incrementally (a replicated, DDP-like part and a part
        of each rank's own), check the shared files' names per rank, restore every retained
        step at 2 ranks bitwise; then, as a restarted job, restore step 4, save step 5 (which
        takes files again) and restore it; then, in ``<root>-damage``, a byte flipped in rank 1's
        taken file makes rank 1's part of the next step whole (:func:`dist_damage`); and print
        ``RANK <r> OK``.

The state saved at step ``s`` is a function of ``s`` only (:func:`crash_state`,
:func:`dist_state`), so the parent rebuilds exactly what must come back.
"""

from __future__ import annotations

import os
import sys
import zlib
from typing import Any, Dict, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tests.support.fork_trials import Report, serve  # noqa: E402

KiB = 2**10
FILE_BYTES = 64 * KiB  # mgr.storage.max_file_bytes: one data file per large tensor

# ---- the states ------------------------------------------------------------------------------

#: the large tensors (>= 64 KiB: hashed, shareable): key path -> (shape, dtype)
BIG = {
    ("model", "emb"): ((256, 256), torch.float32),  # 256 KiB
    ("model", "layers", 0, "w"): ((128, 128), torch.float32),  # 64 KiB
    ("model", "layers", 1, "w"): ((128, 256), torch.float32),  # 128 KiB
    ("optim", "m"): ((256, 256), torch.bfloat16),  # 128 KiB
    ("optim", "v"): ((128, 192), torch.float64),  # 192 KiB
    ("extra", "mask"): ((160 * KiB,), torch.bool),  # 160 KiB
    ("extra", "ids"): ((96, 128), torch.int64),  # 96 KiB
}


def tensor_of(name: str, shape: tuple, dtype: torch.dtype, version: int) -> torch.Tensor:
    """A deterministic tensor, different for every ``(name, version)``."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) % 10_000 * 100_000 + version)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(dtype)


def big_tensor(key: tuple, version: int) -> torch.Tensor:
    """The large tensor ``key`` (of :data:`BIG`) at ``version``."""
    shape, dtype = BIG[key]
    return tensor_of(".".join(map(str, key)), shape, dtype, version)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def make_state(step: int, versions: Dict[tuple, int]) -> Dict[str, Any]:
    """Nested dicts and lists: the large tensors at ``versions``, and tiny tensors and
    non-tensor values that change at every step."""
    big = {k: big_tensor(k, versions[k]) for k in BIG}
    return {
        "model": {
            "emb": big[("model", "emb")],
            "layers": [
                {"w": big[("model", "layers", 0, "w")], "b": torch.arange(16, dtype=torch.float32) * step},
                {"w": big[("model", "layers", 1, "w")], "b": torch.full((7,), step, dtype=torch.int32)},
            ],
        },
        "optim": {"m": big[("optim", "m")], "v": big[("optim", "v")], "lr": 0.001 * (step + 1),
                  "betas": [0.9, 0.999], "count": torch.tensor([step], dtype=torch.int64)},
        "extra": {"mask": big[("extra", "mask")], "ids": big[("extra", "ids")],
                  "tiny_bf16": torch.linspace(0, 1, 33).to(torch.bfloat16) + step},
        "step": step,
        "name": f"run-step-{step}",
    }


#: crash trials: large tensor i takes a new version every PERIODS[i] steps (some every step,
#: one never), so each save changes a different subset
PERIODS = (1, 2, 3, 5, 7, 10**9, 4)


def crash_versions(step: int) -> Dict[tuple, int]:
    return {k: step // p for k, p in zip(BIG, PERIODS)}


def crash_state(step: int) -> Dict[str, Any]:
    """What a crash trial saves at ``step``."""
    return make_state(step, crash_versions(step))


WORLD = 2


def dist_state(step: int, rank: Optional[int]) -> Dict[str, Any]:
    """What rank ``rank`` of the 2-rank job saves at ``step``: a replicated part (the same on
    every rank, as DDP holds it) and a part of its own (keys ``rank<r>``); ``rank=None``: the
    whole checkpoint, as one process loads it."""
    out: Dict[str, Any] = {
        "replicated": {
            "w0": tensor_of("rep.w0", (128, 256), torch.float32, step // 3),  # 128 KiB
            "w1": tensor_of("rep.w1", (128, 128), torch.float32, step // 2),  # 64 KiB
            "b": torch.arange(10, dtype=torch.float64) + step,
        },
        "step": step,
    }
    for r in range(WORLD) if rank is None else [rank]:
        out[f"rank{r}"] = {
            "x": tensor_of(f"rank{r}.x", (32, 1024), torch.float32, (step + r) // 2),  # 128 KiB
            "y": tensor_of(f"rank{r}.y", (96 * KiB,), torch.bool, 0),  # 96 KiB, never changes
            "z": tensor_of(f"rank{r}.z", (64, 8), torch.float32, step),  # tiny: always written
        }
    return out


def empty_like(tree: Any) -> Any:
    """A restore target of the same structure holding other values."""
    if isinstance(tree, torch.Tensor):
        return torch.full_like(tree, True if tree.dtype == torch.bool else 7)
    if isinstance(tree, dict):
        return {k: empty_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [empty_like(v) for v in tree]
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return type(tree)(-1)
    if isinstance(tree, str):
        return "none"
    return tree


def states_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested state (tensors compared byte for byte)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# ---- crash trials ----------------------------------------------------------------------------

MAX_TO_KEEP = 2


def crash_manager(root: str, full_every: Optional[int] = None, **kw: Any):
    from async_ckpt import CheckpointManager

    mgr = CheckpointManager(root, incremental=True, full_every=full_every, max_to_keep=MAX_TO_KEEP, **kw)
    mgr.storage.max_file_bytes = FILE_BYTES
    return mgr


def _child(spec: Dict[str, Any], report: Report) -> None:
    torch.set_num_threads(1)
    mgr = crash_manager(spec["dir"], spec.get("full_every"), on_saved=lambda st: report("c", st.step))
    start = 0
    if mgr.all_steps():
        target = empty_like(crash_state(0))
        got = mgr.restore(None, target)
        report("r", got, int(states_equal(target, crash_state(got))))
        start = got + 1
    for step in range(start, start + 100000):
        report("s", step)
        if spec.get("sync"):
            mgr.save(step, crash_state(step))
        else:
            mgr.save_async(step, crash_state(step))


def crash_server() -> None:
    # Import everything a child needs before forking (one throwaway incremental save sequence
    # pulls in what the save path imports lazily); single-threaded ops so that forking is safe.
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        mgr = crash_manager(d)
        for s in range(2):
            mgr.save(s, crash_state(s))
        mgr.restore(1, crash_state(0))
        mgr.close()
    serve(_child)


# ---- two ranks -------------------------------------------------------------------------------

def dist_main(root: str) -> None:
    import torch.distributed as dist

    from async_ckpt import CheckpointManager

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    mgr = CheckpointManager(root, incremental=True, max_to_keep=3)
    mgr.storage.max_file_bytes = FILE_BYTES
    refs_seen = set()
    for step in range(5):
        if step % 2:
            mgr.save_async(step, dist_state(step, rank))
            mgr.join()
        else:
            mgr.save(step, dist_state(step, rank))
        man = mgr.layout.read_manifest(step)
        for name, rec in man.files.items():
            if "_ref" in name:
                r = int(name[2:name.index("_", 2)])
                assert name.startswith(f"__{r}_ref") and rec.ref is not None, (step, name, rec)
                src = rec.ref.split("/")[1]
                assert src.startswith(f"__{r}_") and "_ref" not in src, (step, name, rec.ref)
                refs_seen.add(r)
            else:
                assert rec.ref is None, (step, name, rec)
        if step > 0:
            assert man.referred_bytes > 0, (step, man.referred_bytes)
            assert mgr.stats[-1].referred_bytes > 0, (rank, step, mgr.stats[-1])
    assert refs_seen == set(range(WORLD)), refs_seen
    assert mgr.all_steps() == [2, 3, 4], mgr.all_steps()
    for step in mgr.all_steps():
        target = empty_like(dist_state(step, rank))
        assert mgr.restore(step, target) == step
        assert states_equal(target, dist_state(step, rank)), f"rank {rank}: step {step} restored wrong"
    mgr.close()
    # a restarted job: restore the newest step, then save: each rank takes its own files again
    mgr = CheckpointManager(root, incremental=True, max_to_keep=3)
    mgr.storage.max_file_bytes = FILE_BYTES
    target = empty_like(dist_state(4, rank))
    assert mgr.restore(None, target) == 4 and states_equal(target, dist_state(4, rank))
    mgr.save(5, dist_state(5, rank))
    assert mgr.stats[-1].referred_bytes > 0, (rank, mgr.stats[-1])
    target = empty_like(dist_state(5, rank))
    assert mgr.restore(5, target) == 5 and states_equal(target, dist_state(5, rank))
    assert mgr.all_steps() == [3, 4, 5], mgr.all_steps()
    mgr.close()
    dist_damage(root + "-damage", rank)
    dist.barrier()
    print(f"RANK {rank} OK", flush=True)
    dist.destroy_process_group()


def dist_damage(root: str, rank: int) -> None:
    """Two ranks, a new root: steps 0 and 1; then rank 1 flips a byte of a file step 1 took
    (one of its own, which step 2 would take again). Step 2 must be whole on rank 1 (which
    warns, naming the file) and still take rank 0's files; it restores at 2 ranks."""
    import logging

    import torch.distributed as dist

    from async_ckpt import CheckpointManager

    said: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                said.append(record.getMessage())

    handler = Keep()
    logging.getLogger("async_ckpt").addHandler(handler)
    try:
        mgr = CheckpointManager(root, incremental=True)
        mgr.storage.max_file_bytes = FILE_BYTES
        for step in range(2):
            mgr.save(step, dist_state(step, rank))
        dist.barrier()
        victim = None
        if rank == 1:
            man = mgr.layout.read_manifest(1)
            victim = next(n for n in sorted(man.files) if n.startswith("__1_ref"))
            path = os.path.join(root, "1", victim)
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 1]))
        dist.barrier()
        mgr.save(2, dist_state(2, rank))
        taken = sorted(n for n, r in mgr.layout.read_manifest(2).files.items() if r.ref is not None)
        assert taken and all(n.startswith("__0_ref") for n in taken), taken
        if rank == 1:
            assert any(victim in m and "step 2" in m for m in said), said
        target = empty_like(dist_state(2, rank))
        assert mgr.restore(2, target) == 2 and states_equal(target, dist_state(2, rank))
        mgr.close()
    finally:
        logging.getLogger("async_ckpt").removeHandler(handler)


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        crash_server()
    elif sys.argv[1] == "dist":
        dist_main(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
