"""The background writer: a bounded queue of save jobs run in order on one worker thread.

At most ``max_pending`` jobs are in flight (staged but not yet committed); ``wait_for_slot``
blocks the caller until one is free. A job that fails does not stop the worker: its error is
kept and re-raised to the training thread at the next ``raise_if_failed`` (every
``save``/``save_async``/``join``/``close`` calls it), and its slot is released, so training
never hangs on a failed save.

A writer made with ``defer_errors=True`` (the persistent tier's, when a local tier keeps
training protected) logs each failure at once and raises it only from ``join``/``close``, so
an unreachable bucket does not stop the training loop while local saves go on. ``defer_if``
defers only the failures it answers True for (the local tier's: a full disk, so that the
bucket's saves go on while the local tier is full).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..errors import CheckpointError, InvalidArgumentError

_STOP = object()

log = logging.getLogger("async_ckpt")

#: failures kept for the training thread (the last slot holds the newest beyond that)
MAX_KEPT_ERRORS = 100


def _with_message(exc: CheckpointError, message: str) -> CheckpointError:
    """A copy of ``exc`` (its type and attributes: ``step``, ``path``, ...) with ``message``; a
    plain :class:`CheckpointError` of its step when its type cannot be built from a message."""
    try:
        new = type(exc)(message)
    except Exception:  # noqa: BLE001 - a subclass with another constructor
        new = CheckpointError(message, step=exc.step)
    new.__dict__.update({k: v for k, v in vars(exc).items() if k != "__notes__"})
    return new


class WriteQueue:
    """Runs submitted jobs one after another on a daemon thread (see the module docstring).

    Args:
        max_pending: jobs in flight at most (slots; an int >= 1).
        name: the worker thread's name (also in the messages of deferred failures).
        defer_errors: keep every failure for :meth:`join`/:meth:`close` (logged at once)
            instead of raising it at the next :meth:`raise_if_failed`.
        defer_if: defer only the failures it answers True for.

    Raises:
        InvalidArgumentError: ``max_pending`` is not an int >= 1.
    """

    def __init__(self, max_pending: int = 1, name: str = "async-ckpt-writer", *, defer_errors: bool = False,
                 defer_if: Optional[Callable[[BaseException], bool]] = None) -> None:
        if not isinstance(max_pending, int) or max_pending < 1:
            raise InvalidArgumentError(f"max_pending_async must be an int >= 1, got {max_pending!r}")
        self.max_pending = max_pending
        self.defer_errors = defer_errors
        self.defer_if = defer_if
        self._slots = threading.BoundedSemaphore(max_pending)
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._errors: List[Tuple[Optional[int], BaseException, bool]] = []  # (step, error, deferred)
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- training-thread side ----------------------------------------------------------------
    def wait_for_slot(self, timeout: Optional[float] = None) -> None:
        """Block until fewer than ``max_pending`` jobs are in flight, and take a slot.

        Args:
            timeout: seconds to wait at most (None: no limit).

        Raises:
            CheckpointError: an earlier job failed (as :meth:`raise_if_failed`), or no slot
                came free within ``timeout``.
        """
        self.raise_if_failed()
        if not self._slots.acquire(timeout=timeout):
            raise CheckpointError(f"timed out after {timeout}s waiting for a free save slot")
        try:
            self.raise_if_failed()
        except BaseException:
            self._slots.release()
            raise

    def try_slot(self) -> bool:
        """Take a free slot if there is one, without waiting.

        Returns:
            Whether a slot was taken.

        Raises:
            CheckpointError: an earlier job failed (as :meth:`raise_if_failed`).
        """
        self.raise_if_failed()
        if not self._slots.acquire(blocking=False):
            return False
        try:
            self.raise_if_failed()
        except BaseException:
            self._slots.release()
            raise
        return True

    def take_slot(self) -> None:
        """Block until a slot is free and take it, whatever earlier saves' failures.

        For a failed job that must still be queued: see :meth:`submit`."""
        self._slots.acquire()

    def release_slot(self) -> None:
        """Give back a slot taken by :meth:`wait_for_slot` when no job will be submitted."""
        self._slots.release()

    def submit(self, fn: Callable[[], Any], *, step: Optional[int] = None) -> "Future[Any]":
        """Queue a job; the caller holds a slot, which the job releases when it ends.

        Args:
            fn: the job (its failure is kept by :meth:`add_failure`).
            step: the step it saves, for error messages.

        Returns:
            A future of the job's result.

        Raises:
            CheckpointError: the writer is closed (the slot is released).
        """
        if self._closed:
            self._slots.release()
            raise CheckpointError("the checkpoint writer is closed", step=step)
        fut: "Future[Any]" = Future()
        with self._lock:
            self._pending += 1
        self._queue.put((fn, step, fut))
        return fut

    def failed(self) -> bool:
        """Whether :meth:`raise_if_failed` (not ``deferred``) would raise now."""
        with self._lock:
            return any(not (self.defer_errors or d) for _, _, d in self._errors)

    def raise_if_failed(self, *, deferred: bool = False) -> None:
        """Raise the kept background failures (once; the list is then cleared).

        A writer with ``defer_errors`` raises only when ``deferred`` (``join``/``close``); the
        failures ``defer_if`` deferred too (the others are raised, and these kept, when not
        ``deferred``).

        One failure that is a :class:`CheckpointError` of its step is raised as it is; any other
        is wrapped in a :class:`CheckpointError` naming the step (chained from it). With several
        failures, what is raised is the first one's (its type and ``step`` when it is a
        ``CheckpointError`` of its step), its message ending in ``(and N more failed save(s):
        steps [...])``, chained from the first failure.

        Args:
            deferred: raise the deferred failures too (``join``/``close``).

        Raises:
            CheckpointError: a kept failure, as described above.
        """
        with self._lock:
            due = [e for e in self._errors if deferred or not (self.defer_errors or e[2])]
            if not due:
                return
            self._errors = [e for e in self._errors if not any(e is d for d in due)]
        errors = [(s, x) for s, x, _ in due]
        step, exc = errors[0]
        more = f" (and {len(errors) - 1} more failed save(s): steps {[s for s, _ in errors[1:]]})" if len(errors) > 1 else ""
        if isinstance(exc, CheckpointError) and exc.step == step:
            if not more:
                raise exc
            raise _with_message(exc, f"{exc}{more}") from exc
        raise CheckpointError(
            f"background save of step {step} failed: {type(exc).__name__}: {exc}{more}", step=step
        ) from exc

    def add_failure(self, step: Optional[int], exc: BaseException) -> None:
        """Keep ``exc`` as the failure of the save of ``step``.

        A job that raised, or a save that failed before it was queued; it is raised as a job's
        failure is. A writer with ``defer_errors`` (or a failure ``defer_if`` defers) logs it now.

        Args:
            step: the step whose save failed.
            exc: the failure.
        """
        deferred = False
        if self.defer_if is not None:
            try:
                deferred = bool(self.defer_if(exc))
            except Exception:  # noqa: BLE001 - not deferred, then
                deferred = False
        with self._lock:
            if len(self._errors) < MAX_KEPT_ERRORS:
                self._errors.append((step, exc, deferred))
            else:  # a long outage: keep the first errors and the failed steps
                self._errors[-1] = (step, exc, deferred)
        if self.defer_errors or deferred:
            log.error("%s: save of step %s failed (raised at join()/close()): %s: %s",
                      self._thread.name, step, type(exc).__name__, exc)

    def wait_idle(self, timeout: Optional[float] = None) -> None:
        """Wait until every queued job has finished (failures stay kept for :meth:`join`).

        Args:
            timeout: seconds to wait at most (None: no limit).

        Raises:
            CheckpointError: jobs were still running after ``timeout``.
        """
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout=timeout):
                raise CheckpointError(f"timed out after {timeout}s waiting for pending saves")

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait until every queued job has finished, then raise any failure (deferred ones too).

        Args:
            timeout: seconds to wait at most (None: no limit).

        Raises:
            CheckpointError: a job failed, or jobs were still running after ``timeout``.
        """
        self.wait_idle(timeout)
        self.raise_if_failed(deferred=True)

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return self._pending

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish queued jobs, stop the worker thread, and raise any failure (deferred ones too).

        On the worker thread itself (a job's end collected the last owner), the thread stops
        once the job returns, without a wait.

        Args:
            timeout: seconds to wait for the worker thread at most (None: no limit).

        Raises:
            CheckpointError: a job failed.
        """
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            # Called on the worker thread itself (the finalizer of a manager collected when its
            # last job let go of it): the thread ends once that job returns.
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)
        self.raise_if_failed(deferred=True)

    # ---- worker side -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, step, fut = item
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - surfaced to the training thread
                self.add_failure(step, exc)
                fut.set_exception(exc)
            finally:
                # Drop the job before waiting for the next one: it references its manager,
                # which must stay collectable while this thread idles.
                del item, fn, fut
                self._slots.release()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


def all_done(futures: Sequence["Future[Any]"], result: Any) -> "Future[Any]":
    """One future for several writers' jobs (one save at several roots).

    Args:
        futures: the jobs' futures (:meth:`WriteQueue.submit`).
        result: what the future gives once every job succeeded.

    Returns:
        A future that gives ``result`` once every job ended well, or raises the first
        failure (in the order of ``futures``) once every job ended.
    """
    out: "Future[Any]" = Future()
    lock = threading.Lock()
    left = [len(futures)]

    def one_done(_: "Future[Any]") -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result(result)

    if not futures:
        out.set_result(result)
    for f in futures:
        f.add_done_callback(one_done)
    return out
