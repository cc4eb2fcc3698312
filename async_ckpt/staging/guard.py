"""The guard of lazy snapshots: the process-wide hooks that wait for copies in flight.

Installed (:func:`install`) while lazy copies (:mod:`.lazy_copies`) are outstanding:
    * an optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``):
      before ``optimizer.step()`` it waits for exactly the outstanding chunks that hold that
      optimizer's parameters or state tensors (matched by storage ``data_ptr``);
    * a module forward pre-hook (``register_module_forward_pre_hook``): before a module runs,
      it waits for the chunks holding that module's own buffers (BatchNorm updates its running
      statistics in forward *without* bumping ``_version``); with no buffers to wait for, it
      seals the chunks whose copies completed;
    * XLA: when buffer donation is enabled (``_xla_set_enable_alias_with_buffer_donor_config``)
      the optimizer hook also waits for every outstanding XLA copy before any optimizer step
      of XLA parameters, so a donated buffer is never read.
    What the hooks do not see is caught by the version and storage checks of
    :mod:`.lazy_copies`. Mutations that neither a hook nor ``_version`` sees (``.data``,
    ``torch.no_grad`` writes through ``.data``, foreign kernels) are *not* detected: call
    ``CheckpointManager.wait_for_staging()`` before such writes.

torch's optimizer-step and module-forward hooks are global registrations, so the hooks are
installed once per process and see every outstanding handle of every stager. They note what
they wait for in the :class:`~.lazy_copies.NeedOrder` of each handle's stager. The forward hook
(it costs every module call a Python call) is removed once nothing is outstanding.
"""

from __future__ import annotations

from typing import Any, Iterable, Set, Tuple

import torch

from .. import compat
from .lazy_copies import PendingCopies, StorageKey, outstanding, storage_key

_opt_handle: Any = None
_fwd_handle: Any = None


def _note_needed(active: Tuple[PendingCopies, ...], keys: Iterable[StorageKey]) -> None:
    """Note ``keys`` in the order of each outstanding snapshot's stager, for its own storages."""
    for pc in active:
        if pc.order is not None:
            pc.order.note(keys, pc.by_key)


def _donation_enabled() -> bool:
    try:
        return compat.xla_loaded() and compat.xla_alias_with_buffer_donor()
    except Exception:  # torch_xla absent or without buffer donation: nothing to guard
        return False


def _optimizer_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    active = outstanding.handles
    if not active:
        _remove_forward_hook()
        return
    keys: Set[StorageKey] = set()
    xla = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            k = storage_key(p)
            if k is None:
                xla = xla or p.device.type == "xla"
            else:
                keys.add(k)
    for st in optimizer.state.values():
        if isinstance(st, dict):
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    k = storage_key(v)
                    if k is not None:
                        keys.add(k)
    _note_needed(active, keys)
    donation = xla and _donation_enabled()
    for pc in active:
        pc.wait(keys)
        if donation:
            pc.wait_xla()


def _forward_pre_hook(module: torch.nn.Module, args: Any) -> None:
    active = outstanding.handles
    if not active:
        return
    bufs = module._buffers
    keys = [k for k in (storage_key(b) for b in bufs.values() if b is not None) if k is not None] if bufs else ()
    if keys:
        _note_needed(active, keys)
        for pc in active:
            pc.wait(keys)
    else:
        for pc in active:
            pc.seal_ready()


def _remove_forward_hook() -> None:
    """Drop the forward hook (it costs every module call a Python call). Only from the
    training thread, never from inside a forward pre-hook (the hook dict is being iterated)."""
    global _fwd_handle
    if _fwd_handle is not None and not outstanding.handles:
        _fwd_handle.remove()
        _fwd_handle = None


def install() -> None:
    """Install the hooks if any lazy copies are outstanding (:data:`~.lazy_copies.outstanding`).
    Training thread, after :func:`~.lazy_copies.start`."""
    global _opt_handle, _fwd_handle
    if not outstanding.handles:
        return
    if _opt_handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _opt_handle = register_optimizer_step_pre_hook(_optimizer_pre_hook)
    if _fwd_handle is None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        _fwd_handle = register_module_forward_pre_hook(_forward_pre_hook)


def settle_hooks() -> None:
    """Remove the forward hook if nothing is outstanding (call at safe points: training thread)."""
    _remove_forward_hook()
