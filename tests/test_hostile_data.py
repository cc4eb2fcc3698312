"""Data correctness under hostile inputs: misaligned records of wide dtypes on restore,
conjugate and negative views on save, state dicts that must be refused at the call, and
non-tensor values whose ``__reduce__`` must run exactly once."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
import textwrap
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_ckpt import CheckpointManager, InvalidStateDictError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values (conjugate and negative bits applied), as flat uint8."""
    resolved = t.detach().resolve_conj().resolve_neg()
    c = torch.empty(resolved.shape, dtype=resolved.dtype)  # standard strides, even for size-1 dims
    c.copy_(resolved)
    return c.reshape(-1).view(torch.uint8)


def _assert_restored(expected: dict, got: dict) -> None:
    assert list(got) == list(expected) or set(got) == set(expected)
    for k, exp in expected.items():
        g = got[k]
        assert g.dtype == exp.dtype and g.shape == exp.shape, f"{k}: {g.dtype}{tuple(g.shape)} vs {exp.dtype}{tuple(exp.shape)}"
        assert torch.equal(_bits(g), _bits(exp)), f"{k}: restored bytes differ from the saved values"


def _targets(sd: dict) -> dict:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}


def _run_child(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a segfault there must not take pytest down)."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, (f"child exited with {proc.returncode} (negative: killed by that signal)\n"
                                  f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


# ---- 1. restore reads misaligned records safely -------------------------------------------

def test_restore_and_export_of_complex128_at_misaligned_offsets():
    """Two complex128 tensors in one file: the second one's data is not 16-byte aligned in the
    read buffer. Restore and ``async-ckpt export`` used to hand copy_ a misaligned complex128
    source (a segfault); now both are bitwise exact, for a mix of dtypes in any order."""
    _run_child("""
        import os, tempfile, torch
        from async_ckpt import CheckpointManager
        from async_ckpt.cli import main

        def bits(t):
            return t.contiguous().reshape(-1).view(torch.uint8)

        g = torch.Generator().manual_seed(0)
        root = tempfile.mkdtemp()
        orders = [
            {"a": torch.randn(3, dtype=torch.complex128, generator=g),
             "b": torch.randn(5, dtype=torch.complex128, generator=g)},
            {"i8": torch.randint(-9, 9, (7,), dtype=torch.int8, generator=g),
             "c": torch.randn(9, dtype=torch.complex128, generator=g),
             "h": torch.randn(3, generator=g).half(),
             "d": torch.randn(2, 3, dtype=torch.complex64, generator=g),
             "f": torch.randn(5, dtype=torch.float64, generator=g),
             "z": torch.randn(4, dtype=torch.complex128, generator=g)},
        ]
        with CheckpointManager(root) as mgr:
            for step, sd in enumerate(orders, 1):
                mgr.save(step, sd)
                out = {k: torch.zeros_like(v) for k, v in sd.items()}
                mgr.restore(step, out)
                for k in sd:
                    assert torch.equal(bits(out[k]), bits(sd[k])), k
        for step, sd in enumerate(orders, 1):
            out_path = os.path.join(root, f"export{step}.pt")
            assert main(["export", root, str(step), out_path]) == 0
            exported = torch.load(out_path, weights_only=True)
            for k in sd:
                assert torch.equal(bits(exported[k]), bits(sd[k])), k
        print("OK")
    """)


def test_stored_bytes_never_reads_a_misaligned_wide_dtype():
    """Each dtype, its record placed at every byte offset 0..15 of the read buffer: the copy
    ``_stored_bytes`` sets up reads it aligned (or as bytes) and puts the exact bytes in."""
    _run_child("""
        import io, types, torch
        from async_ckpt.storage.dcp_io import _STORAGE_DTYPES, _stored_bytes

        g = torch.Generator().manual_seed(1)
        dtypes = [torch.complex128, torch.complex64, torch.float64, torch.float32, torch.bfloat16,
                  torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn]
        for dtype in dtypes:
            src = torch.randint(0, 256, (5 * 16,), dtype=torch.uint8, generator=g)
            if dtype is torch.bool:
                src = src % 2
            t = src.view(dtype).reshape(5, -1)
            buf = io.BytesIO()
            torch.save(t, buf)
            record = buf.getvalue()
            for shift in range(16):
                blob = memoryview(bytearray(shift) + record)[shift:]
                req = types.SimpleNamespace(storage_offsets=[0, 0], lengths=list(t.shape))
                for target in (torch.zeros_like(t), torch.zeros_like(t.t()).t()):  # contiguous, strided
                    pair = _stored_bytes(blob, req, target)
                    if pair is None:  # a dtype torch.save names no storage for: torch.load reads it
                        assert dtype not in _STORAGE_DTYPES.values(), (dtype, shift)
                        continue
                    dst, src_view = pair
                    if src_view.dtype != torch.uint8 or dtype in (torch.uint8, torch.bool, torch.int8, torch.float8_e4m3fn):
                        assert src_view.data_ptr() % t.element_size() == 0, (dtype, shift)
                    dst.copy_(src_view)
                    assert torch.equal(target.contiguous().view(-1).view(torch.uint8),
                                       t.contiguous().view(-1).view(torch.uint8)), (dtype, shift)
        print("OK")
    """)


# ---- 2. conjugate and negative views are saved resolved ----------------------------------

def _conj_neg_state(n: int):
    g = torch.Generator().manual_seed(n)
    z = torch.randn(n, dtype=torch.complex128, generator=g)
    w = torch.randn(n, 2, dtype=torch.complex64, generator=g)
    x = torch.randn(n, generator=g)
    return {
        "z": z, "zc": z.conj(), "zc_step": z.conj()[::2], "zc_imag": z.conj().imag,
        "zc_real": z.conj().real, "w_t_conj": w.t().conj(), "w_conj_alone": w.conj(),
        "x": x, "x_neg": torch._neg_view(x), "x_neg_step": torch._neg_view(x)[1::3],
        "x_expanded_neg": torch._neg_view(x[:1]).expand(4, 1),
    }


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("n", [6, 20_000], ids=["small", "big"])  # big: own buffers, copied in the background when lazy
def test_conjugate_and_negative_views_are_saved_resolved(tmp_path, lazy, n):
    sd = _conj_neg_state(n)
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in sd.items()}
    with CheckpointManager(str(tmp_path / "ck")) as mgr:
        mgr.save_async(1, sd, lazy=lazy)
        mgr.join()
        out = _targets(expected)
        mgr.restore(1, out)
    _assert_restored(expected, out)


def test_a_staged_conjugate_view_holds_its_resolved_values():
    from async_ckpt.staging.stager import Stager

    z = torch.randn(8, dtype=torch.complex128)
    sd = {"z": z, "zc": z.conj(), "zs": z.conj()[::2], "zi": z.conj().imag}
    snap = Stager().stage(sd)
    for k, v in sd.items():
        host = snap.state_dict[k]
        assert not host.is_conj() and not host.is_neg()
        assert torch.equal(_bits(host), _bits(v)), k
    snap.release()
