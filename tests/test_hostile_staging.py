"""Hostile staging: storages freed or swapped under a lazy save, and the host pool's bound.

A lazy save whose source storage is freed (``untyped_storage().resize_(0)``, as FSDP does with
unsharded parameters) or replaced (``set_()``) before its background copy runs must fail that
save with ``TornSnapshotError``, never read freed memory. Each case runs in a subprocess: a
segfault there fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from async_ckpt.staging import HostBufferPool, Stager

from .conftest import assert_bitwise_equal

REPO = Path(__file__).resolve().parents[1]

_WORKER = textwrap.dedent(r"""
    import json, sys
    import torch
    from async_ckpt import CheckpointManager
    from async_ckpt.staging.lazy import TornSnapshotError, hold_copies

    mode, root = sys.argv[1], sys.argv[2]
    out = {}

    def same_bits(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    g = torch.Generator().manual_seed(0)
    base = torch.randn(2_000_000, generator=g)  # 8 MB: copied in the background
    if mode == "resize_span":  # two views of one storage: copied as one span of it
        sd = {"a": base[:1_000_000], "b": base[1_000_000:], "step": 1}
    else:
        sd = {"p": base, "q": torch.randn(300_000, generator=g), "step": 1}
    ref1 = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    with CheckpointManager(root, lazy=True) as mgr:
        mgr.save_async(1, sd)
        mgr.join()  # step 1 committed
        with hold_copies():
            mgr.save_async(2, sd)  # its copies wait behind the hold
            if mode == "resize":
                sd["p"].untyped_storage().resize_(0)
            elif mode == "resize_span":
                base.untyped_storage().resize_(0)
            elif mode == "set":
                sd["p"].set_(torch.zeros(10))
        try:
            mgr.join()
            out["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["error"] = type(exc).__name__
            out["torn"] = isinstance(exc, TornSnapshotError)
            out["message"] = str(exc)
            out["step"] = getattr(exc, "step", None)
        out["steps"] = mgr.all_steps()
        target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in ref1.items()}
        mgr.restore(1, target)
        out["step1_bitwise"] = all(same_bits(target[k], ref1[k]) for k in ref1 if isinstance(ref1[k], torch.Tensor))
        # the next save works
        sd3 = {"p": torch.randn(1_500_000, generator=g), "n": torch.arange(7), "step": 3}
        ref3 = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd3.items()}
        mgr.save_async(3, sd3)
        mgr.join()
        target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in ref3.items()}
        mgr.restore(3, target)
        out["step3_bitwise"] = all(same_bits(target[k], ref3[k]) for k in ref3 if isinstance(ref3[k], torch.Tensor))
        out["steps_after"] = mgr.all_steps()
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.parametrize("mode,name", [("resize", "p"), ("resize_span", "a"), ("set", "p")])
def test_lazy_save_of_freed_or_swapped_storage_fails_typed(tmp_path, mode, name):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = dict(os.environ, PYTHONPATH=str(REPO), PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, str(script), mode, str(tmp_path / "ckpt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker died (rc {proc.returncode}): {proc.stderr[-3000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    assert out["error"] == "TornSnapshotError" and out["torn"], out
    assert out["step"] == 2
    assert "freed, resized or replaced" in out["message"] and name in out["message"]
    assert out["steps"] == [1], "the failed save must not be committed"
    assert out["step1_bitwise"], "the committed earlier step must restore bit for bit"
    assert out["step3_bitwise"] and out["steps_after"] == [1, 3], "the next save must work"
