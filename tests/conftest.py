"""Shared fixtures and helpers. XLA runs for real on PJRT CPU (set by the Makefile: PJRT_DEVICE=CPU).

Roots: ``ckpt_dir`` (a local path), ``memory_root`` (``memory://``), ``root`` (both, parametrized
``file`` / ``memory``); ``faulty://`` (tests/support/faulty_fs.py) is registered for every test.
State dicts: ``small_state(step)``, ``medium_state(step)``, ``make_state(seed)`` (a model and
its Adam optimizer), and ``target_like(tree)`` for a restore target. Damage: ``data_files``,
``flip_byte``, ``flip_data_byte``, ``flip_metadata_byte`` (tests/support/damage.py). Comparison:
``assert_bitwise_equal``, ``clone_tree`` (tests/support/tree.py).
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Dict

import fsspec
import pytest
import torch

from .support import faulty_fs  # noqa: F401  (registers faulty:// for every test)
from .support.damage import data_files, flip_byte, flip_data_byte, flip_metadata_byte  # noqa: F401  (re-exported)
from .support.tree import assert_bitwise_equal, clone_tree  # noqa: F401  (re-exported for the tests)

os.environ.setdefault("PJRT_DEVICE", "CPU")


def _xla_device():
    try:
        import torch_xla

        return torch_xla.device()
    except Exception:
        return None


# Touch the XLA device before any CPU backward() runs in this process: otherwise a later XLA
# backward() trips an internal assert in torch's autograd engine (see shared/cpu-recipes.md).
_XLA = _xla_device()
if _XLA is not None:
    torch.zeros(1, device=_XLA)


@pytest.fixture
def xla_device():
    if _XLA is None:
        pytest.skip("torch_xla is not installed")
    return _XLA


@pytest.fixture
def ckpt_dir(tmp_path):
    return str(tmp_path / "ckpt")


# ---- checkpoint roots ----------------------------------------------------------------------

def _memory_url() -> str:
    return f"memory://ckpt-{uuid.uuid4().hex}"


def _drop_memory(url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture
def memory_root():
    """A fresh checkpoint root on fsspec's ``memory://`` (ranged reads, marker commits, no
    locks); removed after the test."""
    url = _memory_url()
    yield url
    _drop_memory(url)


@pytest.fixture(params=["file", "memory"])
def root(request, tmp_path):
    """A checkpoint root, once a local directory (``file``) and once ``memory://`` (``memory``)."""
    if request.param == "file":
        yield str(tmp_path / "ckpt")
        return
    url = _memory_url()
    yield url
    _drop_memory(url)


# ---- state dicts -----------------------------------------------------------------------------

def small_state(step: int) -> Dict[str, Any]:
    """A small state dict that differs for every ``step`` >= 0: ``w`` (float32, 64 x 8), ``b``
    (int64, 5) and nested non-tensor values ``opt.lr`` (a float) and ``opt.betas`` (a tuple).
    test_hostile_metadata forges metadata entries by these names and shapes."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.arange(step, step + 5),
            "opt": {"lr": 0.1 * step, "betas": (0.9, 0.99)}}


def medium_state(step: int) -> Dict[str, Any]:
    """A nested model + optimizer state dict that differs for every ``step`` >= 0: float32,
    float64, bfloat16, int64 (beyond 32 bits) and bool tensors, and non-tensor values (floats,
    a list, an int, a string)."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 48, generator=g), "b": torch.arange(48, dtype=torch.float64) * step,
                  "e": torch.randn(33, generator=g).to(torch.bfloat16)},
        "optim": {"m": torch.randint(-(2**40), 2**40, (17, 5), generator=g), "mask": torch.rand(9, generator=g) > 0.5,
                  "lr": 0.01 * step, "betas": [0.9, 0.999]},
        "step": step,
        "tag": f"step-{step}",
    }


def target_like(tree: Any) -> Any:
    """A restore target of the same structure, shapes and dtypes as ``tree``, holding other
    values: tensors filled with 7 (bool tensors with True), numbers -1, strings ``"none"``, so a
    restore that leaves a value alone, or zeroes it, is seen."""
    if isinstance(tree, torch.Tensor):
        return torch.full_like(tree, True if tree.dtype == torch.bool else 7)
    if isinstance(tree, dict):
        return {k: target_like(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(target_like(v) for v in tree)
    if isinstance(tree, bool):
        return not tree
    if isinstance(tree, (int, float)):
        return type(tree)(-1)
    if isinstance(tree, str):
        return "none"
    return tree


def make_state(seed: int = 0, scale: int = 1):
    """A small model + Adam state dict with nested non-tensor entries."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16 * scale, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 16 * scale, generator=g)).sum().backward()
    opt.step()
    return model, opt


# Real GCS/S3 servers on loopback for the cloud tests (fixtures gcs_bucket, s3_bucket, ...).
pytest_plugins = ["tests.support.storage_servers"]
