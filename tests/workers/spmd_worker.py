"""PyTorch/XLA SPMD scenarios on PJRT CPU (4 virtual devices), one per process.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/workers/spmd_worker.py <root>             # mesh
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/workers/spmd_worker.py <scenario> <root>

``mesh`` (tests/ranks/test_distributed.py): saves tensors sharded with ``mark_sharding`` on a (4, 1)
mesh through CheckpointManager (each shard staged once, written as its own DCP chunk), then
restores into a (2, 2) mesh with other partition specs, and into plain CPU tensors without XLA;
all bitwise. Prints ``SPMD OK``.

The others (tests/xla/test_spmd.py) are the scenarios of torch_xla 2.9's own
``test/spmd/test_xla_distributed_checkpoint.py`` (``CheckpointManagerTest``,
``OptimizerCheckpointTest``) written afresh against ``async_ckpt.CheckpointManager``, their
assertions kept, and the states and interoperability cases issue 34 lists. Each prints
``<scenario> OK``; one scenario per process, so that a crash (an abort in torch_xla's C++) ends
only its own.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def mesh(root: str) -> None:
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    from async_ckpt import CheckpointManager
    from async_ckpt.format.unpickling import load_metadata

    n = xr.global_runtime_device_count()
    assert n == 4, f"expected 4 virtual devices (CPU_NUM_DEVICES=4), got {n}"
    dev = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    ref = {
        "w": torch.randn(8, 6, generator=g),  # row-sharded over 4 devices
        "v": torch.randn(4, 10, generator=g).to(torch.bfloat16),  # column-sharded, 2-way, replicated 2-way
        "b": torch.randn(5, generator=g),  # replicated
        "step": 7,
    }
    mesh = xs.Mesh(np.arange(4), (4, 1), ("x", "y"))
    mesh22 = xs.Mesh(np.arange(4), (2, 2), ("x", "y"))
    state = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in ref.items()}
    xs.mark_sharding(state["w"], mesh, ("x", None))
    xs.mark_sharding(state["v"], mesh22, (None, "y"))
    torch_xla.sync()

    # The snapshot says that it holds SPMD shards (staged eagerly and lazily); a replicated
    # tensor alone does not make one.
    from async_ckpt.staging import Stager

    st = Stager()
    for lazy in (False, True):
        snap = st.stage(state, lazy=lazy)
        snap.wait_copied()
        assert snap.xla_shards, lazy
        snap.release()
        snap = st.stage({"b": state["b"]}, lazy=lazy)
        snap.wait_copied()
        assert not snap.xla_shards, lazy
        snap.release()

    with CheckpointManager(root) as mgr:
        mgr.save(1, state)
        # The training step mutates the tensors after the save: the checkpoint keeps step 1's values.
        state["w"].add_(1.0)
        torch_xla.sync()
    with open(os.path.join(root, "1", ".metadata"), "rb") as f:
        md = load_metadata(f.read())
    assert len(md.state_dict_metadata["w"].chunks) == 4, md.state_dict_metadata["w"].chunks
    assert len(md.state_dict_metadata["v"].chunks) == 2, md.state_dict_metadata["v"].chunks  # replicas once

    # Restore into another mesh and other partition specs.
    target = {"w": torch.zeros(8, 6, device=dev), "v": torch.zeros(4, 10, dtype=torch.bfloat16, device=dev),
              "b": torch.zeros(5, device=dev), "step": 0}
    xs.mark_sharding(target["w"], mesh22, ("x", "y"))
    xs.mark_sharding(target["v"], mesh22, ("y", None))
    spec_before = torch_xla._XLAC._get_xla_sharding_spec(target["w"])
    with CheckpointManager(root) as mgr:
        assert mgr.restore(None, target) == 1
    assert torch_xla._XLAC._get_xla_sharding_spec(target["w"]) == spec_before, "sharding changed by restore"
    for k in ("w", "v", "b"):
        got = target[k].cpu()
        assert got.dtype == ref[k].dtype and torch.equal(got.view(-1).view(torch.uint8),
                                                         ref[k].view(-1).view(torch.uint8)), k
    assert target["step"] == 7

    # And without XLA tensors at all: plain CPU targets.
    plain = {"w": torch.zeros(8, 6), "v": torch.zeros(4, 10, dtype=torch.bfloat16), "b": torch.zeros(5), "step": 0}
    with CheckpointManager(root) as mgr:
        mgr.restore(1, plain)
    for k in ("w", "v", "b"):
        assert torch.equal(plain[k].view(-1).view(torch.uint8), ref[k].view(-1).view(torch.uint8)), k
    print("SPMD OK", flush=True)


# The scenarios of issue 34 live in spmd_scenarios.py (imported lazily: torch_xla's SPMD mode
# must be switched on before any XLA tensor exists).
if __name__ == "__main__":
    if len(sys.argv) == 2:
        mesh(sys.argv[1])
    else:
        from tests.workers.spmd_scenarios import run

        run(sys.argv[1], sys.argv[2])
