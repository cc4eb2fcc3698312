"""Crash-trial worker for tests/damage/test_crash.py: a fork server for "training" processes.

Importing torch costs seconds, so this process imports torch and async_ckpt once and then, for
each trial read from stdin (one JSON object a line), forks a child that resumes from the
newest committed step and saves every step with ``save_async`` until it is SIGKILLed. The
server itself sleeps the trial's delay, sends SIGKILL, reaps the child and answers one JSON
line on stdout with what the child reported through a pipe before it died (the harness:
tests/support/fork_trials.py):

    {"status": "killed", "committed": [...], "started": [...], "resumed": step|null,
     "resume_ok": bool|null, "error": str|null}

The state saved at step ``s`` is :func:`make_state` ``(s)``: deterministic, so the parent can
recompute exactly what must come back. Run ``python crash_worker.py`` and write
``{"dir": ..., "mode": "rename"|"marker", "delay": 0.4, "replay": false}`` lines (``dir`` may be
a ``faulty://`` URL: the fsspec code path of object stores, over local files, without faults;
``"local_dir": ..., "save_interval": N`` adds a local tier that saves every step).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tests.support.fork_trials import Report, serve  # noqa: E402

MAX_TO_KEEP = 3


def make_state(step: int) -> Dict[str, Any]:
    """The state a training run holds at ``step``: several dtypes, nesting, non-tensor leaves."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {
            "w": torch.randn(192, 256, generator=g),
            "b": torch.arange(256, dtype=torch.float64) * step,
            "emb": torch.randn(64, 96, generator=g).to(torch.bfloat16),
        },
        "optim": {
            "m": torch.randint(-(2**40), 2**40, (96, 128), generator=g, dtype=torch.int64),
            "mask": torch.rand(333, generator=g) > 0.5,
            "lr": 0.001 * (step + 1),
        },
        "step": step,
    }


def resave_value(step: int, i: int) -> int:
    """The state (as a :func:`make_state` seed) of the ``i``-th re-save of ``step``."""
    return step + 1000 * (1 + i % 2)


def empty_like_state() -> Dict[str, Any]:
    """A restore target with the right structure and different contents."""
    s = make_state(0)
    for part in ("model", "optim"):
        for k, v in s[part].items():
            if isinstance(v, torch.Tensor):
                s[part][k] = torch.zeros_like(v)
    s["optim"]["lr"] = -1.0
    s["step"] = -1
    return s


def states_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested state (tensors compared byte for byte)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(states_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _child(spec: Dict[str, Any], report: Report) -> None:
    """The training process: resume (or roll back), then save every step until killed."""
    from async_ckpt import CheckpointManager

    torch.set_num_threads(1)
    if spec.get("resave") is not None:
        # re-save one existing step over and over, alternating two states, until killed
        k = int(spec["resave"])
        mgr = CheckpointManager(spec["dir"], commit_mode=spec["mode"])
        for i in range(100000):
            report("s", i)
            mgr.save(k, make_state(resave_value(k, i)))
            report("c", i)
    tiers: Dict[str, Any] = {}
    if spec.get("local_dir"):  # two tiers: every step locally, every save_interval-th to "dir"
        tiers = dict(local_dir=spec["local_dir"], local_policy=1, local_retention=2,
                     save_interval=int(spec["save_interval"]))
    mgr = CheckpointManager(spec["dir"], max_to_keep=MAX_TO_KEEP, commit_mode=spec["mode"],
                            on_saved=lambda st: report("c", st.step), **tiers)
    steps = mgr.all_steps()
    start = 0
    if steps:
        target = empty_like_state()
        # replay: roll back to an older step and train on from there (re-saving steps that
        # exist: each re-save replaces its step atomically); else resume from the newest.
        got = mgr.restore(steps[max(0, len(steps) - 3)] if spec.get("replay") else None, target)
        report("r", got, int(states_equal(target, make_state(got))))
        start = got + 1
    for step in range(start, start + 100000):
        report("s", step)
        mgr.save_async(step, make_state(step))


def main() -> None:
    # Import everything a child needs before forking, so that a trial costs a fork, not an
    # import: one throwaway save and restore pulls in whatever the save path imports lazily.
    # Single-threaded ops, and every thread joined again, so that forking stays safe.
    import tempfile

    from async_ckpt import CheckpointManager
    from tests.support import faulty_fs  # noqa: F401  (registers faulty://, for trials on the fsspec code path)

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        mgr = CheckpointManager(d)
        state = make_state(0)
        mgr.save(0, state)
        mgr.restore(0, state)
        mgr.close()

    serve(_child)


if __name__ == "__main__":
    main()
