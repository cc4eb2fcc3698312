"""The background writer of the framework integrations: write jobs run in order on one thread."""

from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import Future
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ..errors import CheckpointError, InvalidArgumentError
from ..manager.hooks import finish_at_exit


class BackgroundWriter:
    """Runs write jobs one at a time, in order, on one thread; tracks them by key (a path).

    The thread exists only while jobs are queued or running: it is started by the first
    :meth:`submit` and ends once the queue is empty, so nothing is left behind by a framework
    that never calls the integration's teardown (Lightning's ``AsyncCheckpointIO`` wrapping a
    plugin, a script saving outside ``fit``). At interpreter exit the queued writes are
    finished first (the exit hook of :mod:`async_ckpt.manager.hooks`, which the managers' saves
    share); a failure never raised to the caller is then printed to stderr, naming the
    checkpoint and the error, and the process exits with status 1.

    A job's error is kept and raised, as :class:`CheckpointError` with the original chained,
    by the next :meth:`check` (which callers make at each entry point), :meth:`wait` or
    :meth:`wait_all`. ``max_pending`` bounds the jobs queued or running: :meth:`submit` waits
    for the oldest when the bound is reached (back-pressure on the host memory they hold).

    A pickled copy (a framework object holding it sent to a spawned process, or saved whole)
    is a new writer with the same settings: no thread, no jobs, no kept errors (the original's
    jobs and errors stay the original's).

    Args:
        name: the writer thread's name.
        max_pending: jobs queued or running at most.

    Raises:
        InvalidArgumentError: ``max_pending`` is below 1.
    """

    def __init__(self, name: str, max_pending: int = 2) -> None:
        if max_pending < 1:
            raise InvalidArgumentError(f"max_pending must be >= 1, got {max_pending}")
        self.name = name
        self.max_pending = max_pending
        self._thread: Optional[threading.Thread] = None
        self._queue: Deque[Tuple[Callable[[], None], Future]] = collections.deque()
        self._jobs: List[Tuple[str, Future]] = []
        self._errors: List[Tuple[str, BaseException]] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self) -> Dict[str, Any]:
        return {"name": self.name, "max_pending": self.max_pending}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["name"], state["max_pending"])  # type: ignore[misc]

    def submit(self, key: str, fn: Callable[[], None], on_drop: Optional[Callable[[], None]] = None) -> None:
        """Queue ``fn`` under ``key``, first waiting for the oldest job while ``max_pending`` are out.

        Args:
            key: what the job writes (a path), for :meth:`wait` and :meth:`pending`.
            fn: the job.
            on_drop: runs if the job could not be queued (an earlier job's error was raised).

        Raises:
            CheckpointError: an earlier job failed (the job is not queued).
        """
        try:
            self.check()
            while True:
                with self._lock:
                    self._reap()
                    if len(self._jobs) < self.max_pending:
                        break
                    oldest = self._jobs[0][1]
                oldest.exception()  # wait; its error is collected by the next check
                self.check()
            fut: Future = Future()
            with self._lock:
                self._queue.append((fn, fut))
                self._jobs.append((key, fut))
                self._pid = os.getpid()
                finish_at_exit(self, True)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.name)
                    self._thread.start()
        except BaseException:
            if on_drop is not None:
                on_drop()
            raise

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None  # a submit after this starts a new thread
                    return
                fn, fut = self._queue.popleft()
            fut.set_running_or_notify_cancel()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - kept, and raised by the next check
                fut.set_exception(exc)
            del fn, fut  # the job's host copy goes now, not when the next one arrives

    def _reap(self) -> None:
        keep = []
        for key, fut in self._jobs:
            if fut.done():
                exc = fut.exception()
                if exc is not None:
                    self._errors.append((key, exc))
            else:
                keep.append((key, fut))
        self._jobs = keep
        finish_at_exit(self, bool(self._jobs or self._errors))

    def finish_at_exit(self) -> List[str]:
        """At interpreter exit: wait for every job; the failures never raised by :meth:`check`.

        A forked child's copy (its jobs are its parent's) waits for nothing.

        Returns:
            One line per failed job, naming its key (the checkpoint) and the error.
        """
        if os.getpid() != self._pid:
            return []
        with self._lock:
            futs = [f for _, f in self._jobs]
        for f in futs:
            f.exception()
        with self._lock:
            self._reap()
            errors, self._errors = self._errors, []
            finish_at_exit(self, False)
        return [f"the background write of checkpoint {key} failed: {type(exc).__name__}: {exc}"
                for key, exc in errors]

    def pending(self, key: Optional[str] = None) -> List[str]:
        """Keys of the jobs queued or running.

        Args:
            key: only the jobs of this key (None: all).

        Returns:
            Their keys, oldest first.
        """
        with self._lock:
            self._reap()
            return [k for k, _ in self._jobs if key is None or k == key]

    def check(self) -> None:
        """Raise the first error of a finished job (and forget it).

        Raises:
            CheckpointError: a job failed (the original error chained).
        """
        with self._lock:
            self._reap()
            if not self._errors:
                return
            key, exc = self._errors.pop(0)
            finish_at_exit(self, bool(self._jobs or self._errors))
        raise CheckpointError(f"background checkpoint write of {key} failed: {type(exc).__name__}: {exc}") from exc

    def wait(self, key: str) -> None:
        """Wait for every job of ``key``.

        Args:
            key: what the jobs write.

        Raises:
            CheckpointError: a finished job failed (this key's or an earlier one).
        """
        with self._lock:
            futs = [f for k, f in self._jobs if k == key]
        for f in futs:
            f.exception()
        self.check()

    def wait_all(self, shutdown: bool = False) -> None:
        """Wait for every job.

        Args:
            shutdown: also wait for the thread to end (it ends by itself once no job is queued).

        Raises:
            CheckpointError: a job failed (the first error).
        """
        with self._lock:
            futs = [f for _, f in self._jobs]
        for f in futs:
            f.exception()
        if shutdown:
            with self._lock:
                thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join()
        self.check()
