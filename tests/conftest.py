"""Shared fixtures. XLA runs for real on PJRT CPU (set by the Makefile: PJRT_DEVICE=CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from .tree import assert_bitwise_equal, clone_tree  # noqa: F401  (re-exported for the tests)

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
pytest_plugins = ["tests.storage_servers"]
