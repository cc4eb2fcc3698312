"""Declared-frozen tensors: which tensors a save leaves uncopied (``CheckpointManager(frozen=)``).

A fine-tuning run's base weights never change, so with ``incremental=True`` a save need not even
copy them to host memory: it refers to the bytes the last step holds. What is trusted, and what
is checked:

* every save reads each declared tensor's version counter (``Tensor._version``, which every
  in-place operation, ``optimizer.step()`` and ``load_state_dict`` move) and data pointer: a
  tensor whose pair is the one recorded when its bytes were last hashed and committed is not
  copied; any other is copied and hashed like every tensor;
* every ``check_every`` saves every declared tensor is copied and hashed, and ``close()``
  hashes them once more: bytes that differ from the last step's (a change through ``.data`` or
  a raw pointer, which the counter does not see) are written in full and raise
  :class:`~async_ckpt.errors.FrozenTensorChangedError`.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch

from ..storage.dcp.reuse import host_copy
from .plan import StagingPlan

Version = Tuple[int, int]  # (version counter, data pointer)
Declared = Union[Collection[str], Callable[[str], bool]]


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


def version_of(t: torch.Tensor) -> Version:
    """What says whether ``t`` may have changed: its version counter and data pointer (0 where
    the device has none to give)."""
    try:
        ptr = t.data_ptr()
    except Exception:  # noqa: BLE001 - e.g. a device without host-visible pointers
        ptr = 0
    return t._version, ptr


class FrozenTensors:
    """The declared-frozen tensors of one manager and when their content is checked.

    Args:
        declared: the keys (flattened state-dict keys) or a predicate on a key.
        check_every: every N-th save copies and hashes every declared tensor.
    """

    def __init__(self, declared: Declared, check_every: int) -> None:
        self._is = declared if callable(declared) else frozenset(declared).__contains__
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
            v = seen[key] = version_of(t)
            last[key] = t
            if not check and unchanged(key, t, v):
                keep.add(i)
        self.last = last
        return keep, seen


def changed_keys(tensors: Dict[str, torch.Tensor], holds: Iterable[Callable[[str, Any], Optional[bool]]]
                 ) -> List[str]:
    """The keys of ``tensors`` whose bytes some root's last step holds otherwise (``close()``'s
    check): each of ``holds`` answers, for a key and a host tensor, True (the same bytes),
    False (others) or None (it holds no record of the key)."""
    checks = list(holds)
    out = []
    for key, t in tensors.items():
        host = host_copy(t)
        if any(h(key, host) is False for h in checks):
            out.append(key)
    return out
