"""Typed errors raised by async_ckpt. Every error is a :class:`CheckpointError`."""

from __future__ import annotations

import copy
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Type

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _inside(frame: Any) -> bool:
    """Whether ``frame`` runs async_ckpt's code: a file of the package, or code generated for one
    of its modules (a dataclass's ``__init__``, whose file is ``<string>``)."""
    name = frame.f_code.co_filename
    if name.startswith("<"):
        module = frame.f_globals.get("__name__") or ""
        return module == "async_ckpt" or module.startswith("async_ckpt.")
    return os.path.abspath(name).startswith(_PACKAGE_DIR)


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
    while frame is not None and _inside(frame):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure in a phase that every rank of a manager runs (see ``CheckpointError.failures``).

    Attributes:
        rank: the rank (in the manager's process group) that failed.
        kind: the class name of the error it raised.
        message: that error's message.
    """

    rank: int
    kind: str
    message: str


class CheckpointError(RuntimeError):
    """Base class for every error async_ckpt raises.

    Background failures are re-raised as ``CheckpointError`` (with ``step`` set and the
    original exception chained as ``__cause__``) at the next ``save``/``save_async``/
    ``join``/``close``.

    Args:
        message: what went wrong, for people.
        step: the step the error concerns, or None.
        failures: every rank's failure in the phase that failed, or empty.

    Attributes:
        step: the step the failure concerns, where there is one.
        failures: with several ranks, every rank's failure in the phase that failed (the same
            on every rank); empty for a failure of this process alone.
    """

    def __init__(self, message: str, *, step: Optional[int] = None, failures: Sequence[RankFailure] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.failures: Tuple[RankFailure, ...] = tuple(failures)

    def with_context(self, *, step: Optional[int] = None, failures: Optional[Sequence[RankFailure]] = None,
                     **attrs: Any) -> "CheckpointError":
        """This error as an outer layer that knows more of it raises it again (a copy).

        The same class, message, attributes, cause and traceback, with ``step`` (where it named
        none), ``failures`` and ``attrs`` set. A copy: an error is never changed once raised (it
        may be held elsewhere, a writer's kept failures or a log record); itself when nothing
        is added.

        Args:
            step: the step it concerns (kept where the error names one already).
            failures: every rank's failure in the phase that failed.
            **attrs: other attributes of its class (``damaged_steps``).

        Returns:
            The error to raise.
        """
        if (step is None or self.step is not None) and failures is None and not attrs:
            return self
        new = copy.copy(self)
        if self.step is None and step is not None:
            new.step = step
        if failures is not None:
            new.failures = tuple(failures)
        for name, value in attrs.items():
            setattr(new, name, value)
        new.__cause__, new.__context__ = self.__cause__, self.__context__
        new.__suppress_context__ = self.__suppress_context__
        return new.with_traceback(self.__traceback__)


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


class StepAlreadyExistsError(CheckpointError):
    """A save of a step that already exists, refused: the manager was created with
    ``overwrite=False`` (see :class:`ForeignStepError` for a directory another program wrote).

    Args:
        message: what was refused, and what to do instead.
        step: the step (``step`` attribute).
        path: the step's existing directory (``path`` attribute), or None.
    """

    def __init__(self, message: str, *, step: Optional[int] = None, path: Optional[str] = None) -> None:
        super().__init__(message, step=step)
        self.path = path


class ForeignStepError(StepAlreadyExistsError):
    """A save of a step whose directory another program wrote (plain ``dcp.save``, torch_xla's or
    torchtitan's checkpointer: no ``COMMITTED`` marker of async_ckpt's), refused.

    async_ckpt never replaces or deletes a directory it did not write. ``restore(step, ...)``
    reads such a step; save it under another root, or save another step."""


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
        failures: with several ranks, every rank's failure (see :class:`CheckpointError`).
    """

    def __init__(self, message: str, *, step: Optional[int] = None, path: Optional[str] = None,
                 failures: Sequence[RankFailure] = ()) -> None:
        super().__init__(message, step=step, failures=failures)
        self.path = path


class PartlyWrittenError(CheckpointError):
    """A restore that failed after it had written part of the checkpoint into its target.

    The target state dict was written in place and must not be used as is (``restore(...,
    atomic=True)`` leaves the target untouched on failure).

    Args:
        message: the cause's text and what was written.
        step: the step the restore was reading.
        cause: the failure that stopped the restore.
        damaged_steps: the steps whose failed attempts wrote into the target, newest first.
        keys_left: keys of the target left holding a damaged step's data.
        failures: with several ranks, every rank's failure (see :class:`CheckpointError`).

    Attributes:
        cause: the failure that stopped the restore (also ``__cause__``): a
            :class:`CorruptCheckpointError` when the step's data was damaged.
        damaged_steps: the steps whose failed attempts wrote into the target, newest first.
        keys_left: keys of the target that a damaged step's failed attempt wrote and no
            later attempt overwrote (empty where the read layer does not know them).
    """

    def __init__(self, message: str, *, step: Optional[int] = None, cause: Optional[BaseException] = None,
                 damaged_steps: Sequence[int] = (), keys_left: Sequence[str] = (),
                 failures: Sequence[RankFailure] = ()) -> None:
        super().__init__(message, step=step, failures=failures)
        self.cause = cause
        self.damaged_steps: Tuple[int, ...] = tuple(damaged_steps)
        self.keys_left: Tuple[str, ...] = tuple(keys_left)
        if cause is not None:
            self.__cause__ = cause

    @property
    def damaged(self) -> bool:
        """Whether the failure was damaged data (then this is a :class:`CorruptCheckpointError` too)."""
        return isinstance(self, CorruptCheckpointError)


class CorruptPartlyWrittenError(PartlyWrittenError, CorruptCheckpointError):
    """A :class:`PartlyWrittenError` whose cause is damaged data.

    ``except CorruptCheckpointError`` catches it too, and its ``path`` is the damaged file's.

    Args:
        message: what failed, and what the target holds now.
        step: the step the restore was reading.
        cause: the :class:`CorruptCheckpointError` (its ``path`` becomes this error's).
        damaged_steps: the steps whose failed attempts wrote into the target.
        keys_left: keys of the target left holding a damaged step's data.
        failures: with several ranks, every rank's failure (see :class:`CheckpointError`).
    """

    def __init__(self, message: str, *, step: Optional[int] = None, cause: Optional[BaseException] = None,
                 damaged_steps: Sequence[int] = (), keys_left: Sequence[str] = (),
                 failures: Sequence[RankFailure] = ()) -> None:
        super().__init__(message, step=step, cause=cause, damaged_steps=damaged_steps, keys_left=keys_left,
                         failures=failures)
        self.path = getattr(cause, "path", None)


def partly_written_error(message: str, *, cause: BaseException, step: Optional[int] = None,
                         damaged_steps: Sequence[int] = (), keys_left: Sequence[str] = ()) -> PartlyWrittenError:
    """The error of a restore that failed (``cause``) after it had written into its target.

    Args:
        message: the whole message (the cause's text and what was written).
        cause: the failure.
        step: the step the restore was reading.
        damaged_steps: the steps whose failed attempts wrote into the target.
        keys_left: keys of the target left holding a damaged step's data.

    Returns:
        A :class:`CorruptPartlyWrittenError` when ``cause`` is a :class:`CorruptCheckpointError`,
        a :class:`StoragePartlyWrittenError` when it is a :class:`StorageError`, else a
        :class:`PartlyWrittenError`.
    """
    if isinstance(cause, CorruptCheckpointError):
        return CorruptPartlyWrittenError(message, step=step, cause=cause, damaged_steps=damaged_steps,
                                         keys_left=keys_left)
    if isinstance(cause, StorageError):
        return StoragePartlyWrittenError(message, step=step, cause=cause, damaged_steps=damaged_steps,
                                         keys_left=keys_left)
    return PartlyWrittenError(message, step=step, cause=cause, damaged_steps=damaged_steps, keys_left=keys_left)


class StorageError(CheckpointError, OSError):
    """The storage backend refused an operation (permissions, no space, unreachable)."""


class NotACheckpointRootError(StorageError, NotADirectoryError):
    """A checkpoint path that cannot be a checkpoint root: a file, or a path under one.

    A :class:`StorageError` (the path cannot be created) and a ``NotADirectoryError``. The
    ``async-ckpt`` command raises it too for a Lightning ``.ckpt`` file given as PATH."""


class StorageTimeoutError(StorageError):
    """A storage call did not finish within ``RetryPolicy.deadline``.

    The storage stopped answering (a network black hole, a hung mount)."""


class StoragePartlyWrittenError(PartlyWrittenError, StorageError):
    """A :class:`PartlyWrittenError` whose cause is a :class:`StorageError`.

    ``except StorageError`` (and ``OSError``) catches it too, as it caught the cause before, so a
    restore from the local tier still falls back to the other tier's copy."""


class TornSnapshotError(CheckpointError):
    """A tensor of a lazy snapshot was modified before its host copy completed.

    Raised by the background save (and re-raised at the next ``save_async``/``join``), never
    silently written. Call ``CheckpointManager.wait_for_staging()`` before mutating tensors by
    hand while a lazy save is staging, or save with ``lazy=False``.
    """


class FrozenTensorChangedError(CheckpointError):
    """A tensor declared frozen (``CheckpointManager(frozen=...)``) changed.

    Found when a save hashed it (every ``frozen_check_every`` saves, and at ``close()``) and its
    bytes differed from the last step's although its version counter had not moved (a change
    through ``.data`` or a raw pointer, which saves between two checks cannot see: they held the
    tensor as it was). The save that found it wrote the new bytes in full; the error is raised
    by the next ``save``/``save_async``/``join``/``close``. A change that moves the counter (a
    restore, ``load_state_dict``, an optimizer step) is saved without an error. Stop declaring
    the tensor frozen, or change it only in ways that move its version counter.

    Args:
        message: what went wrong.
        keys: the flattened state-dict keys of the tensors that changed.
        step: the save that found it.

    Attributes:
        keys: the keys that changed.
    """

    def __init__(self, message: str, *, keys: Sequence[str] = (), step: Optional[int] = None) -> None:
        super().__init__(message, step=step)
        self.keys: Tuple[str, ...] = tuple(keys)


class CoordinationError(CheckpointError):
    """The ranks of a manager could not complete an exchange (a rank died or came too late).

    A rank did not take part within the manager's ``collective_timeout_s``. The ranks' exchanges over the manager's own process groups can then no longer be paired
    (a rank that gave up and one that came late are at different exchanges), so every later call
    of that manager that needs the other ranks raises this error at once, naming the first
    failure, instead of waiting or pairing the wrong exchanges. Close the manager and create a
    new ``CheckpointManager`` on every rank to save again (committed steps are not affected).
    """


class WriterProcessError(CheckpointError):
    """The writer process (``writer="process"``) died or could not be reached during a save.

    That save is not committed (committed steps are not affected); the next save starts a new
    writer process. The message says how the process ended (its exit code or signal).
    """


class StagingBudgetError(CheckpointError, MemoryError):
    """A state dict needs more host staging memory than the configured budget allows."""


class UnsafeCheckpointError(CheckpointError):
    """Checkpoint metadata that tries to load something outside the allowed classes."""


class LeaseHeldError(CheckpointError):
    """Another live writer holds the checkpoint root's writer lease, or this one lost it.

    Args:
        message: which root, who holds its lease, and what to do.
        holder: who holds the lease (``"pid 123 on host"``; the ``holder`` attribute), or None.
        step: the step whose save or deletion was refused, or None.
        failures: with several ranks, every rank's failure (see :class:`CheckpointError`).
    """

    def __init__(self, message: str, *, holder: Optional[str] = None, step: Optional[int] = None,
                 failures: Sequence[RankFailure] = ()) -> None:
        super().__init__(message, step=step, failures=failures)
        self.holder = holder
