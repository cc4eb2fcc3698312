"""Process-level hooks of every live manager: pending saves finish at interpreter exit, a
forked child's inherited managers refuse to be used, an unclosed collected manager stops its
threads."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Tuple

from ..compat import register_exit_hook
from ..jobs.write_queue import WriteQueue

log = logging.getLogger("async_ckpt")

live_managers: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _finish_pending_saves_at_exit() -> None:
    # The script ended on a Ctrl-C (the interpreter kept it as the unhandled exception): a
    # second one abandons the saves; otherwise they are finished quietly (see Manager._close).
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    for mgr in list(live_managers):
        if mgr._forked:
            continue  # a forked child's copy: its parent finishes the saves
        try:
            mgr._close(notice="interrupt" if interrupted else "exit")
        except KeyboardInterrupt:  # the saves were abandoned (and said so): exit quietly
            pass
        except Exception as exc:  # the interpreter is exiting: report, do not raise
            log.error("a pending save failed at exit: %s", exc)


# Runs before concurrent.futures refuses new work at interpreter exit (threading's exit hooks
# run in reverse order of registration), so pending saves can still finish their writes.
if not register_exit_hook(_finish_pending_saves_at_exit):  # pragma: no cover
    atexit.register(_finish_pending_saves_at_exit)


def _mark_forked_in_child() -> None:
    """After ``os.fork()``, in the child: every inherited manager refuses to be used (its writer
    threads were not copied) and forgets the parent's writer lease."""
    for mgr in list(live_managers):
        mgr._forked = True
        for root in mgr.roots:
            if root.store.lease is not None:
                root.store.lease.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked_in_child)


def stop_threads(parts: List[Tuple[WriteQueue, ThreadPoolExecutor, Any]], peers: Any = None) -> None:
    """Finalizer of a manager that was garbage-collected without ``close()``: per tier, its
    writer, its deleter and its lease; then its peer copies' thread and held roots (``peers``)."""
    for writer, deleter, lease in parts:
        try:
            writer.close()
        except Exception as exc:
            log.error("an unclosed CheckpointManager had a failed save: %s", exc)
        deleter.shutdown(wait=False)
        if lease is not None:
            lease.release()
    if peers is not None:
        peers.stop_threads()


