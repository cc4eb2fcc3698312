"""Typed errors raised by async_ckpt. Every error is a :class:`CheckpointError`."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Optional, Type

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: Type[Warning] = UserWarning) -> None:
    """Issue a warning attributed to the caller's first frame outside async_ckpt.

    That is the line of the user's code that called into the library, whatever the depth of the call
    inside it.

    Args:
        message: the text; it is prefixed with ``"async_ckpt: "`` unless it starts with it.
        category: the warning class: ``UserWarning`` for something about the caller's input or
            setup, ``RuntimeWarning`` for something that happened to storage or data.
    """
    if not message.startswith("async_ckpt: "):
        message = f"async_ckpt: {message}"
    level = 2
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


class CheckpointError(RuntimeError):
    """Base class for every error async_ckpt raises.

    Background failures are re-raised as ``CheckpointError`` (with ``step`` set and the
    original exception chained as ``__cause__``) at the next ``save``/``save_async``/
    ``join``/``close``.

    Args:
        message: what went wrong, for people.
        step: the step the error concerns (kept as the ``step`` attribute), or None.
    """

    def __init__(self, message: str, *, step: Optional[int] = None) -> None:
        super().__init__(message)
        self.step = step


class InvalidArgumentError(CheckpointError, ValueError, TypeError):
    """An invalid argument of the public API: a wrong type or value.

    For example ``save_interval=0``, a NaN or non-number metric, an unknown ``commit_mode``. It is a
    ``ValueError`` and a ``TypeError`` too, so code that caught those keeps working."""


class InvalidStepError(CheckpointError, ValueError):
    """A step that is not a non-negative integer."""


class InvalidStateDictError(CheckpointError, TypeError):
    """A state dict that is not a mapping, or holds a leaf that cannot be saved."""


class StepNotFoundError(CheckpointError, FileNotFoundError):
    """Restore of a step that has no committed checkpoint."""


class StateDictMismatchError(CheckpointError, ValueError):
    """A restore target that does not fit the checkpoint.

    Its keys, shapes or dtypes do not match the checkpoint's, or its target tensors cannot be
    written in place (meta tensors, expanded tensors)."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose files fail verification (size, checksum, manifest).

    Args:
        message: what failed verification.
        step: the damaged step (``step`` attribute), or None.
        path: the damaged file (``path`` attribute), or None.
    """

    def __init__(self, message: str, *, step: Optional[int] = None, path: Optional[str] = None) -> None:
        super().__init__(message, step=step)
        self.path = path


class StorageError(CheckpointError, OSError):
    """The storage backend refused an operation (permissions, no space, unreachable)."""


class StorageTimeoutError(StorageError):
    """A storage call did not finish within ``RetryPolicy.deadline``.

    The storage stopped answering (a network black hole, a hung mount)."""


class StagingBudgetError(CheckpointError, MemoryError):
    """A state dict needs more host staging memory than the configured budget allows."""


class UnsafeCheckpointError(CheckpointError):
    """Checkpoint metadata that tries to load something outside the allowed classes."""


class LeaseHeldError(CheckpointError):
    """Another live writer holds the checkpoint root's writer lease, or this one lost it.

    Args:
        message: which root, who holds its lease, and what to do.
        holder: who holds the lease (``"pid 123 on host"``; the ``holder`` attribute), or None.
    """

    def __init__(self, message: str, *, holder: Optional[str] = None) -> None:
        super().__init__(message)
        self.holder = holder
