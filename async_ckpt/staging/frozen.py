"""Declared-frozen tensors: which tensors a save leaves uncopied (``CheckpointManager(frozen=)``).

A fine-tuning run's base weights never change, so with ``incremental=True`` a save need not even
copy them to host memory: it refers to the bytes the last step holds. What is trusted, and what
is checked:

* every save reads each declared tensor's version counter (``Tensor._version``, which every
  in-place operation, ``optimizer.step()`` and ``load_state_dict`` move) and data pointer: a
  tensor whose pair is the one recorded when its bytes were last hashed and committed is not
  copied; any other is copied and hashed like every tensor;
* every ``check_every`` saves every declared tensor is copied and hashed, and ``close()``
  hashes them once more: bytes that differ from the last step's although the counter stood (a
  change through ``.data`` or a raw pointer) are written in full and raise
  :class:`~async_ckpt.errors.FrozenTensorChangedError`. A change the counter shows (a restore,
  ``load_state_dict``) is simply saved: declaring a tensor frozen promises nothing the counter
  can check.
"""

from __future__ import annotations

from typing import Callable, Collection, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple, Union

import torch

from .. import compat
from ..errors import warn_user
from .plan import StagingPlan

Version = Tuple[int, int]  # (version counter, data pointer or XLA device buffer address)
Declared = Union[Collection[str], Callable[[str], bool]]


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor with ``t``'s bytes (``t`` itself when it is one already)."""
    t = t.detach()
    if t.is_cpu and t.is_contiguous():
        return t
    return t.contiguous() if t.is_cpu else t.cpu().contiguous()


def frozen_keys(module: torch.nn.Module, prefix: str = "") -> List[str]:
    """The state-dict keys of a module's frozen parameters, for ``CheckpointManager(frozen=)``.

    Args:
        module: the model (e.g. a PEFT model, whose base parameters have ``requires_grad=False``).
        prefix: what the module's keys are prefixed with in the saved state dict (``"model."``
            when it is saved as ``{"model": module.state_dict(), ...}``).

    Returns:
        ``prefix + name`` for every parameter with ``requires_grad=False``.
    """
    return [prefix + name for name, p in module.named_parameters() if not p.requires_grad]


def version_of(t: torch.Tensor) -> Optional[Version]:
    """What says whether ``t`` may have changed: its version counter and where its data lives
    (the data pointer; on XLA, the device buffer's address: XLA never updates a buffer in place,
    so a new value is a new buffer). ``None`` when the address cannot be had (an XLA tensor
    whose value is not computed yet): such a tensor is always copied."""
    try:
        if t.device.type == "xla":
            ptr = compat.xla_buffer_pointer_fn()(t)
        else:
            ptr = t.data_ptr()
    except Exception:  # noqa: BLE001 - no address to compare: never trusted
        return None
    if not ptr:
        return None
    return t._version, ptr


class FrozenTensors:
    """The declared-frozen tensors of one manager and when their content is checked.

    Args:
        declared: the keys (flattened state-dict keys) or a predicate on a key.
        check_every: every N-th save copies and hashes every declared tensor.
    """

    def __init__(self, declared: Declared, check_every: int) -> None:
        names: Optional[FrozenSet[str]] = None if callable(declared) else frozenset(declared)
        self._names = names
        self._is: Callable[[str], bool] = declared if callable(declared) else (lambda key: key in names)  # type: ignore[operator]
        self._warned = False  # about declared keys the state dict lacks (once)
        self.check_every = check_every
        self._saves = 0
        #: the declared tensors of the last save, by key: ``close()`` hashes them once more
        self.last: Dict[str, torch.Tensor] = {}

    def choose(self, plan: StagingPlan, unchanged: Callable[[str, torch.Tensor, Version], bool]
               ) -> Tuple[Set[int], Dict[str, Version]]:
        """Which tensors of ``plan`` this save leaves uncopied (training thread).

        Args:
            plan: the save's staging plan.
            unchanged: whether every root due for the save holds ``key``'s bytes as of ``version``.

        Returns:
            The plan indices not to copy, and the version of every declared tensor.
        """
        self._saves += 1
        check = self._saves % self.check_every == 0
        keep: Set[int] = set()
        seen: Dict[str, Version] = {}
        last: Dict[str, torch.Tensor] = {}
        keys = plan.keys if len(plan.keys) == len(plan.tensors) else []
        for i, (key, t) in enumerate(zip(keys, plan.tensors)):
            if not self._is(key) or type(t) is not torch.Tensor:
                continue
            last[key] = t
            v = version_of(t)
            if v is None:
                continue  # no address to compare: copied and hashed like any tensor
            seen[key] = v
            if not check and unchanged(key, t, v):
                keep.add(i)
        if not self._warned and self._names is not None:
            self._warned = True
            missing = sorted(self._names - set(keys))
            if missing:
                warn_user(f"frozen= names {len(missing)} key(s) the state dict does not have (e.g. "
                          f"{', '.join(missing[:3])}): they are not skipped. The keys are flattened state-dict "
                          "keys: a module saved as {'model': module.state_dict()} needs "
                          "frozen_keys(module, prefix='model.')")
        self.last = last
        return keep, seen


def changed_keys(tensors: Dict[str, torch.Tensor], holds: Iterable[Callable[..., Optional[bool]]]
                 ) -> List[str]:
    """The keys of ``tensors`` whose bytes changed behind their version counter (``close()``'s
    check): each of ``holds`` answers, for a key, a host tensor and the tensor's version, True
    (its last step holds the same bytes), False (others, recorded at that same version) or None
    (no record of the key at that version: a change the counter showed is no error)."""
    checks = list(holds)
    out = []
    for key, t in tensors.items():
        v = version_of(t)
        if v is None:
            continue
        host = host_copy(t)
        if any(h(key, host, v) is False for h in checks):
            out.append(key)
    return out
