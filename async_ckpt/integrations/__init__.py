"""Framework integrations: one line to checkpoint asynchronously from a framework's trainer.

* :class:`async_ckpt.integrations.lightning.AsyncCkptIO` -- PyTorch Lightning:
  ``Trainer(plugins=[AsyncCkptIO()])``.
* :class:`async_ckpt.integrations.transformers.AsyncCkptCallback` -- Hugging Face
  ``Trainer(..., callbacks=[AsyncCkptCallback()])``.
* :func:`async_ckpt.integrations.accelerate.attach` -- Hugging Face Accelerate:
  ``saver = attach(accelerator)`` makes ``accelerator.save_state()`` asynchronous.

Each lives in its own module so that importing one needs only its own framework; the names
are also available here, imported on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AsyncCkptIO", "AsyncCkptCallback", "AsyncSaveState"]


def __getattr__(name: str) -> Any:
    if name == "AsyncCkptIO":
        from .lightning import AsyncCkptIO

        return AsyncCkptIO
    if name == "AsyncCkptCallback":
        from .transformers import AsyncCkptCallback

        return AsyncCkptCallback
    if name == "AsyncSaveState":
        from .accelerate import AsyncSaveState

        return AsyncSaveState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
