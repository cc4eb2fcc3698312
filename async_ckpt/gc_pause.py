"""Keep Python's cyclic garbage collector out of the blocking part of a save.

Staging 10,000 tensors creates tens of thousands of short-lived Python objects (views, plan
entries). That regularly triggers a full collection, which walks every object in the process
while the training loop waits, and can cost more than the whole stage.
:func:`gc_paused` defers collections until the section ends; they
then run as they would have, outside the stall. Nothing else is changed, and a collector the
user disabled stays disabled.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_owned = False  # whether the outermost section disabled the collector (and so re-enables it)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable cyclic GC for a short CPU-bound section; nests and is thread-safe."""
    global _depth, _owned
    with _lock:
        if _depth == 0:
            _owned = gc.isenabled()
            if _owned:
                gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _owned:
                _owned = False
                gc.enable()
