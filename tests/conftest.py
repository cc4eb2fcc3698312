"""Shared fixtures. XLA runs for real on PJRT CPU (set by the Makefile: PJRT_DEVICE=CPU)."""

from __future__ import annotations

import os

import pytest
import torch

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


def clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clone_tree(v) for v in x]
    if isinstance(x, tuple):
        return tuple(clone_tree(v) for v in x)
    return x


def assert_bitwise_equal(a, b, path="root"):
    """Tensors equal bit for bit (same dtype, shape and bytes); other leaves equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        a_c, b_c = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        assert torch.equal(a_c.view(-1).view(torch.uint8), b_c.view(-1).view(torch.uint8)) if a_c.numel() else True, \
            f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(a)} len {len(a)} vs {type(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"

# Real GCS/S3 servers on loopback for the cloud tests (fixtures gcs_bucket, s3_bucket, ...).
pytest_plugins = ["tests.storage_servers"]
