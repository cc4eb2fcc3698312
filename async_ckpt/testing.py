"""Tools for testing and debugging code that saves with async_ckpt."""

from __future__ import annotations

import threading
from typing import Any, ContextManager, Optional

from .staging.lazy import cpu_lazily
from .staging.lazy_copies import copier

__all__ = ["hold_copies", "lazy_cpu_copies"]


class hold_copies:
    """Context manager that stops lazy copies from progressing until it exits.

    Lets tests and debugging force the copies of a lazy save to still be in flight when the
    training loop mutates tensors. Copies queued before it enters still run; the guard still
    copies a chunk itself when it has to wait for one.

    Args:
        release_after: If given, the copies go on after this many seconds even if the context
            has not exited.
    """

    def __init__(self, release_after: Optional[float] = None) -> None:
        self._barrier = threading.Event()
        self._timer = threading.Timer(release_after, self._barrier.set) if release_after is not None else None

    def release(self) -> None:
        """Let the held copies go on now."""
        self._barrier.set()

    def __enter__(self) -> "hold_copies":
        copier().hold(self._barrier)
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._barrier.set()
        if self._timer is not None:
            self._timer.cancel()


def lazy_cpu_copies() -> ContextManager[None]:
    """Context manager within which lazy saves stage CPU tensors lazily too.

    A lazy save copies CPU tensors before ``save_async`` returns, as an eager save does (a
    background copy would take the same cores as the training loop); CUDA and XLA tensors are
    copied in the background. Inside this context CPU tensors take the lazy path as well:
    their copies run in the background and the guard waits for them, so that the lazy
    machinery can be tested and debugged on a machine without an accelerator. Process-wide;
    nestable.

    Returns:
        The context manager.
    """
    return cpu_lazily()
