"""What the DCP writer and reader share: running one DCP call, and reading its errors."""

from __future__ import annotations

import re
import threading
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Tuple

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError

# DCP warns on every single-process ``dcp.save``/``dcp.load``: async_ckpt's normal case.
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"

_quiet_lock = threading.Lock()
_quiet_users = 0  # blocks of _single_process_quiet() running now, on any thread
_quiet_entry: Optional[tuple] = None  # the one filter entry they added


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Ignore DCP's single-process warning while the block runs.

    ``warnings.catch_warnings`` restores the whole filter list on exit, so on a writer thread
    it would undo filters that other threads (the training loop, a test runner) set
    meanwhile, and two overlapping blocks on two threads would leave a filter behind for
    good. Here one entry, matching that message only, is put first in ``warnings.filters``
    while at least one block runs, and that entry alone is taken out when the last one ends.
    """
    global _quiet_users, _quiet_entry
    with _quiet_lock:
        _quiet_users += 1
        if _quiet_users == 1:
            # re.escape: never equal to a filter of the user's for the plain message, which
            # filterwarnings would otherwise replace (and the exit below then remove).
            warnings.filterwarnings("ignore", message=re.escape(_SINGLE_PROCESS_WARNING), category=UserWarning)
            _quiet_entry = warnings.filters[0]
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_users -= 1
            if _quiet_users == 0:
                entry, _quiet_entry = _quiet_entry, None
                for i, f in enumerate(warnings.filters):
                    if f is entry:
                        # typeshed types warnings.filters as a Sequence; it is a list.
                        del warnings.filters[i]  # type: ignore[attr-defined]  # an "ignore" entry leaves nothing cached behind
                        break


def call_dcp(fn: Callable[[], Any]) -> Any:
    """Run a DCP call; re-raise the error a ``CheckpointException`` wraps (this rank's, else the first).

    DCP wraps every failure in a ``CheckpointException`` (a ``BaseException``), which would hide
    our typed errors (``CorruptCheckpointError``, ``StorageError``, ...) from callers. Outside
    ``torch.distributed``, DCP's single-process warning is ignored while ``fn`` runs.
    """
    try:
        if distributed():
            return fn()
        with _single_process_quiet():
            return fn()
    except CheckpointException as exc:
        failures = getattr(exc, "failures", None) or {}
        rank = _rank()
        wrapped = failures.get(rank) if rank in failures else next(iter(failures.values()), None)
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else None
        if not isinstance(inner, Exception):
            raise
    raise inner  # outside the handler: keeps the inner error's own cause and context


def _rank() -> int:
    return torch.distributed.get_rank() if distributed() else 0


def world_size(process_group: Any = None) -> int:
    """Ranks taking part in a save: 1 without ``torch.distributed``, else the group's size."""
    import torch.distributed as dist

    return dist.get_world_size(process_group) if distributed() else 1


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def unwrap_dcp(exc: BaseException) -> Tuple[Optional[int], BaseException]:
    """The rank and underlying error of DCP's ``CheckpointException`` (which gathers every
    rank's errors): an async_ckpt error first (so a ``CorruptCheckpointError`` keeps its type),
    the failing rank's own before one that relays it, else the lowest rank's error. Any other
    error is returned as is, with rank None.

    Args:
        exc: an error raised by ``dcp.save``/``dcp.load`` or by our own code.

    Returns:
        (the rank that raised it where DCP says so, else None; the error).
    """
    if not isinstance(exc, CheckpointException):
        return None, exc
    failures = [(r, f[0] if isinstance(f, tuple) else f) for r, f in sorted(exc.failures.items())]
    failures = [(r, e) for r, e in failures if isinstance(e, BaseException)]
    if not failures:
        return None, exc
    ours = [(r, e) for r, e in failures if isinstance(e, CheckpointError)]
    # a rank that raised because another rank failed (its ``failures`` name only others) relays
    # that failure: the failing rank's own error is the one to raise
    own = [(r, e) for r, e in ours if not e.failures or any(f.rank == r for f in e.failures)]
    return (own or ours or failures)[0]
