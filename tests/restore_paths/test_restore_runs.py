"""Direct restore of many small tensors: runs of same-sized records in one buffer, broken by
other sizes, dtypes and non-tensor items, land bitwise in their targets."""

import torch

from async_ckpt import CheckpointManager


def _state():
    g = torch.Generator().manual_seed(7)
    sd = {}
    for i in range(300):
        kind = i % 7
        if kind == 3:
            sd[f"t{i}"] = torch.randn(37, generator=g)  # another size breaks the run
        elif kind == 5:
            sd[f"t{i}"] = torch.randint(0, 2**15, (1024,), generator=g, dtype=torch.int16)  # another dtype
        elif kind == 6 and i % 2 == 0:
            sd[f"n{i}"] = {"step": i, "name": f"x{i}"}
        else:
            sd[f"t{i}"] = torch.randn(1024, generator=g)
    sd["inf"] = torch.randn(512, generator=g)
    return sd


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def test_small_runs_restore_bitwise(tmp_path):
    sd = _state()
    CheckpointManager(str(tmp_path)).save(1, sd)
    target = {k: (torch.full_like(v, 3) if isinstance(v, torch.Tensor) else {"step": -1, "name": ""}) for k, v in sd.items()}
    with torch.inference_mode():
        target["inf"] = torch.zeros(512)  # an inference tensor as a target
    CheckpointManager(str(tmp_path)).restore(1, target)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert _same(target[k], v), k
        else:
            assert target[k] == v, k
