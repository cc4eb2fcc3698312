"""Device targets (XLA, CUDA) of a direct restore: read into host stand-ins and put on their
devices once every file is verified (:class:`DeviceTargets`).

:func:`~.read_targets.load_direct` reads the data of each device target into a fresh host tensor of
the same dtype and shape (its *stand-in*; pinned for CUDA), like a CPU target and verified the
same way, so the device targets themselves are untouched until every file passed its size and
checksum checks. Only then does :meth:`DeviceTargets.commit` put the stand-ins on the devices.

CUDA: every target's ``copy_(stand_in, non_blocking=True)`` is issued on a side stream of its
device (which first waits for the work already queued on the current stream), then awaited
once; the current stream waits for the side stream, so later work sees the data.

XLA:

* where the PJRT device's memory is host memory (PJRT CPU), a DLPack import of each stand-in
  makes it the device buffer itself: nothing is copied;
* elsewhere, one batched host-to-device transfer for all of them per device
  (``_xla_tensors_from_aten``: every transfer issued, then awaited together);
* each target then takes its device tensor by ``copy_`` under ``no_grad``: the target stays
  the same Python object (parameters stay parameters), a whole tensor just holds the new
  buffer with no computation pending, and a view updates its base as ``copy_`` does.

A stand-in is never written again once it is on the device. A target listed twice (tied
parameters) has one stand-in and one transfer: the plan (:mod:`.read_plan`) reads the first
key's data into it and every later key's into a private host tensor, copied into the stand-in
in key order once every file is verified (the last key wins, as for CPU targets). Distinct
target objects that alias one device buffer get stand-ins of their own, committed in key order.
SPMD mode (tensors that may be sharded over devices) is not handled here: :func:`~.read_plan.device_supported` says so and the restore goes
through DCP.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import compat

#: Whether stand-ins become device buffers by DLPack import (True) or are transferred (False);
#: None: decided from the PJRT device type (DLPack on ``CPU``).
HOST_BACKED: Optional[bool] = None


def _host_backed() -> bool:
    if HOST_BACKED is not None:
        return HOST_BACKED
    try:
        import torch_xla.runtime as xr

        return xr.device_type() == "CPU"
    except Exception:  # no usable torch_xla runtime: not a CPU-backed XLA device
        return False


class DeviceTargets:
    """The device targets of one restore and their host stand-ins."""

    def __init__(self) -> None:
        self._pairs: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(target) -> (target, stand-in)

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def has(self, target: torch.Tensor) -> bool:
        """Whether ``target`` (this very object) already has a stand-in."""
        return id(target) in self._pairs

    def stand_in(self, target: torch.Tensor) -> torch.Tensor:
        """The contiguous host tensor that receives ``target``'s data (one per target object)."""
        got = self._pairs.get(id(target))
        if got is None:
            got = (target, _host_tensor(target))  # never zero-filled
            self._pairs[id(target)] = got
        return got[1]

    def commit(self) -> None:
        """Every stand-in onto its target's device, then into the target, in the order the
        targets were first given stand-ins (key order; see the module docstring); the stand-ins
        are released."""
        pairs = [p for p in self._pairs.values() if p[0].device.type == "xla"]
        cuda = [p for p in self._pairs.values() if p[0].device.type == "cuda"]
        self._pairs.clear()
        if cuda:
            _commit_cuda(cuda)
        srcs: List[Optional[torch.Tensor]] = [None] * len(pairs)
        if _host_backed():
            from torch.utils.dlpack import to_dlpack

            from_dlpack = compat.xla_from_dlpack_fn()
            for i, (target, host) in enumerate(pairs):
                try:
                    x = from_dlpack(to_dlpack(host))
                except Exception:  # no DLPack view of this buffer: the copy below transfers it
                    continue  # transferred below
                if x.device == target.device:
                    srcs[i] = x
        by_device: Dict[str, List[int]] = {}
        for i, (target, _) in enumerate(pairs):
            if srcs[i] is None:
                by_device.setdefault(str(target.device), []).append(i)
        for device, idx in by_device.items():
            moved = compat.xla_tensors_from_aten([pairs[i][1] for i in idx], device)
            for i, x in zip(idx, moved):
                srcs[i] = x
        with torch.no_grad():
            for (target, _), src in zip(pairs, srcs):
                assert src is not None
                target.copy_(src)


def _host_tensor(target: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor like ``target`` (pinned for a CUDA target, where pinning works)."""
    if target.device.type == "cuda":
        try:
            return torch.empty(tuple(target.shape), dtype=target.dtype, pin_memory=True)
        except RuntimeError:  # pinning refused (limits): a pageable buffer copies too, slower
            pass
    return torch.empty(tuple(target.shape), dtype=target.dtype)


def _commit_cuda(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every CUDA stand-in into its target: copies issued on one side stream per device, then
    awaited (the stand-ins must outlive them)."""
    by_device: Dict[torch.device, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    for target, host in pairs:
        by_device.setdefault(target.device, []).append((target, host))
    streams = []
    with torch.no_grad():
        for device, group in by_device.items():
            with torch.cuda.device(device):
                current = torch.cuda.current_stream(device)
                side = torch.cuda.Stream(device)
                side.wait_stream(current)  # the targets may still be in use by queued work
                with torch.cuda.stream(side):
                    for target, host in group:
                        target.copy_(host, non_blocking=host.is_pinned())
                streams.append((current, side))
    for current, side in streams:
        side.synchronize()
        current.wait_stream(side)
