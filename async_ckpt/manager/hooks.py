"""Process-level hooks of every live manager and integration writer: pending saves finish at
interpreter exit (a failed one is printed and makes the exit status non-zero), a forked
child's inherited managers refuse to be used, an unclosed collected manager stops its threads."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Protocol, Set, Tuple

from ..compat import register_exit_hook
from ..jobs.write_queue import WriteQueue

log = logging.getLogger("async_ckpt")

live_managers: "weakref.WeakSet[Any]" = weakref.WeakSet()


class ExitWork(Protocol):
    """Background writes that must end before the process does (an integration's writer)."""

    def finish_at_exit(self) -> List[str]:
        """Wait for every pending write; what failed and was never raised to the caller, one
        line each (naming the checkpoint and the error)."""


_exit_work: Set[Any] = set()  # held while they have pending writes or unraised failures
_exit_lock = threading.Lock()
_failed_at_exit: List[str] = []


def finish_at_exit(work: ExitWork, pending: bool) -> None:
    """Hold ``work`` for the exit hook while it has something to finish or to report.

    At interpreter exit :meth:`ExitWork.finish_at_exit` is called; each failure it returns is
    printed to stderr and the process exits with status 1 (as a pending manager save that fails
    at exit does).

    Args:
        work: the writer.
        pending: True while it has pending writes or failures not raised yet; False lets it go.
    """
    with _exit_lock:
        if pending:
            _exit_work.add(work)
        else:
            _exit_work.discard(work)


def _report_at_exit(message: str) -> None:
    _failed_at_exit.append(message)
    try:
        print(f"async_ckpt: {message}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - stderr closed: the exit status still says it
        pass


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
            _report_at_exit(f"a pending save failed at exit: {exc}")
    with _exit_lock:
        work = list(_exit_work)
    for w in work:
        try:
            failures = w.finish_at_exit()
        except KeyboardInterrupt:
            return
        except Exception as exc:  # noqa: BLE001 - reported like the writes' own failures
            failures = [f"a pending checkpoint write failed at exit: {type(exc).__name__}: {exc}"]
        for message in failures:
            _report_at_exit(message)


def _exit_status() -> None:
    """The last exit handler (registered first): after a failure at exit, exit with status 1."""
    if not _failed_at_exit:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed or gone: nothing left to flush
            pass
    os._exit(1)


# atexit runs its handlers last-registered first: registered at import, this one runs after
# those of everything imported later (frameworks, trackers) and ends the process with status 1
# only when a save failed at exit.
atexit.register(_exit_status)

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


