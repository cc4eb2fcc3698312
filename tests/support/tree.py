"""Tree helpers for tests, importable without pytest or torch_xla (the torchrun workers use them)."""

from __future__ import annotations

import torch


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
    """Tensors equal bit for bit (same dtype, shape and bytes); other leaves equal and of one type."""
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
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"
