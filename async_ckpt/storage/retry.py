"""Bounded exponential backoff for transient storage errors; permanent errors fail at once."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, TypeVar

from ..errors import InvalidArgumentError, StorageError, StorageTimeoutError

T = TypeVar("T")
log = logging.getLogger("async_ckpt")

_PERMANENT_ERRNO = {errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EROFS, errno.EDQUOT, errno.ENOENT, errno.EEXIST,
                    errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG}
_TRANSIENT_ERRNO = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE,
                    errno.EAGAIN, errno.EIO, errno.EHOSTUNREACH, errno.ENETUNREACH}


#: the backoff's jitter: a generator of its own, so a storage call never moves the training
#: job's global ``random`` state (a run that seeds it draws the same numbers with or without us)
_JITTER = random.Random()


def is_transient(exc: BaseException) -> bool:
    """Whether an error is worth retrying: timeouts, connection resets, HTTP 408/429/5xx.

    Args:
        exc: the error a storage call raised.

    Returns:
        True for a transient error; False for a permanent one (no space, permission denied,
        not found, ...) and for anything unknown.
    """
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    status = http_status(exc)
    if status is not None:
        return status in (408, 429) or 500 <= status < 600
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in _PERMANENT_ERRNO:
            return False
        return exc.errno in _TRANSIENT_ERRNO
    name = type(exc).__name__
    if name in {"ClientConnectionError", "ServerDisconnectedError", "ClientPayloadError", "ReadTimeoutError",
                "ConnectTimeoutError", "EndpointConnectionError", "RemoteDisconnected", "IncompleteRead"}:
        return True
    return _is_transient_cloud(exc)


def http_status(exc: BaseException) -> Optional[int]:
    """The HTTP status a storage client's error carries, or None.

    Read from ``code``, ``status`` or ``status_code`` (gcsfs's ``HttpError``, aiohttp's,
    requests').

    Args:
        exc: the error a storage call raised.

    Returns:
        The status, or None for an error without one.
    """
    status = getattr(exc, "code", None) or getattr(exc, "status", None) or getattr(exc, "status_code", None)
    return status if isinstance(status, int) and not isinstance(status, bool) else None


# Base classes (by name, so that neither aiohttp nor botocore need be imported) whose every
# subclass is a network-level failure: aiohttp's connection errors (gcsfs, s3fs), botocore's
# and requests' ConnectionError / HTTPClientError, whatever their errno.
_TRANSIENT_BASES = {("aiohttp.client_exceptions", "ClientConnectionError"),
                    ("aiohttp.client_exceptions", "ClientPayloadError"),
                    ("botocore.exceptions", "ConnectionError"), ("botocore.exceptions", "HTTPClientError"),
                    ("requests.exceptions", "ConnectionError"), ("requests.exceptions", "Timeout")}


#: the packages of storage clients: an error of theirs is a storage error, whatever its class
_CLIENT_PACKAGES = frozenset({"botocore", "aiobotocore", "boto3", "s3fs", "gcsfs", "google", "aiohttp", "requests",
                              "urllib3", "fsspec", "adlfs", "azure", "ocifs", "huggingface_hub"})


def is_client_error(exc: BaseException) -> bool:
    """Whether an error comes from storage (an ``OSError``, an HTTP error, a client's error).

    An HTTP error is one with a status; a client's error is any error of a storage client's
    package (botocore, gcsfs, aiohttp, fsspec, ...).

    Args:
        exc: the error a storage call raised.

    Returns:
        True for those; False for anything else (a bug, one of async_ckpt's own errors).
    """
    if isinstance(exc, OSError) or http_status(exc) is not None:
        return True
    return any(c.__module__.split(".", 1)[0] in _CLIENT_PACKAGES for c in type(exc).__mro__)


def _is_transient_cloud(exc: BaseException) -> bool:
    """gcsfs/s3fs errors: network failures by class; HTTP status of a botocore ``ClientError``
    (s3fs chains it as ``__cause__`` of the ``OSError`` it raises)."""
    for e in (exc, exc.__cause__):
        if e is None:
            continue
        if any((c.__module__, c.__name__) in _TRANSIENT_BASES for c in type(e).__mro__):
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            code = (response.get("Error") or {}).get("Code")
            if code in ("SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"):
                return True
            if isinstance(status, int):
                return status in (408, 429) or 500 <= status < 600
    return False


@dataclass
class RetryPolicy:
    """Retries of transient storage errors, and the time bounds of every storage call.

    Up to ``attempts`` tries with capped, jittered exponential backoff.

    Attributes:
        attempts: tries of one call on a transient error. Where the client library retries
            each request itself (gcsfs on ``gs://``, s3fs/botocore on ``s3://``) async_ckpt makes
            one attempt: a single retry layer, the client's.
        initial_delay: seconds before the first retry (doubled per retry, jittered).
        max_delay: cap of the delay between retries, seconds.
        request_timeout: seconds one request may wait to connect and for each read of the
            answer, passed to the client library (gcsfs ``requests_timeout``, s3fs
            ``config_kwargs`` ``connect_timeout``/``read_timeout``) unless ``storage_options``
            sets them. A bucket that stops answering fails each request after this long.
        connect_timeout: seconds the first request to a remote root may take when the root
            is opened (:meth:`~async_ckpt.storage.storage.Storage.probe`): a wrong bucket,
            endpoint or network then fails within this time with
            :class:`~async_ckpt.errors.StorageUnreachableError` instead of after the client's
            retries. Raise it for a store that is slow to answer its first request.
        deadline: seconds one storage call on a remote filesystem may take with all its
            retries (ours and the client's); then it fails with
            :class:`~async_ckpt.errors.StorageTimeoutError`. Enforced by waiting at most this
            long for the call (so also on filesystems without timeouts of their own); a failed
            upload therefore ends at most ``deadline`` after its stalled call started.
        bounded: set by :meth:`for_storage`: each attempt runs on a helper thread waited for
            at most the time left until the deadline (remote storage; local calls are never
            abandoned).

    Raises:
        InvalidArgumentError: ``attempts`` is not an int >= 1, or a time is not a number of
            seconds >= 0 (> 0 for ``request_timeout`` and ``deadline``).
    """

    attempts: int = 5
    initial_delay: float = 0.2
    max_delay: float = 5.0
    request_timeout: float = 60.0
    connect_timeout: float = 30.0
    deadline: float = 600.0
    bounded: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool) or self.attempts < 1:
            raise InvalidArgumentError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        positive = ("request_timeout", "connect_timeout", "deadline")
        for name in ("initial_delay", "max_delay", *positive):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (v == 0 and name in positive):
                raise InvalidArgumentError(f"RetryPolicy.{name} must be a number of seconds "
                                           f"{'> 0' if name in positive else '>= 0'}, got {v!r}")

    def for_storage(self, *, remote: bool, client_retries: bool) -> "RetryPolicy":
        """The policy a storage applies.

        Bounded waits on ``remote`` storage, and one attempt where the client library retries itself
        (``client_retries``).

        Args:
            remote: the storage is not local POSIX paths (calls may wait on a network).
            client_retries: the client library retries each request itself.

        Returns:
            A copy of this policy (this one is not changed).
        """
        return dataclasses.replace(self, attempts=1 if client_retries else self.attempts, bounded=remote)

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` with retries of transient errors, within ``deadline`` when bounded.

        Args:
            fn: the storage call (one attempt).
            what: what it does, for messages (``"write <path>"``).

        Returns:
            What ``fn`` returned.

        Raises:
            StorageTimeoutError: a bounded call did not finish within ``deadline``.
            StorageError: an error of the storage (:func:`is_client_error`: an ``OSError``,
                an HTTP error, any error of a storage client such as botocore's or aiohttp's)
                that is permanent or outlasted the attempts (a ``StorageError`` ``fn`` raised is
                raised as it is).
            FileNotFoundError: ``fn`` raised it (never retried).
        """
        delay = self.initial_delay
        end = time.monotonic() + self.deadline
        for attempt in range(1, self.attempts + 1):
            try:
                if self.bounded:
                    return _run_bounded(fn, end, what, self.deadline)
                return fn()
            except StorageTimeoutError:
                raise
            except Exception as exc:
                pause = delay * (0.5 + _JITTER.random() / 2)
                if (attempt == self.attempts or not is_transient(exc)
                        or (self.bounded and time.monotonic() + pause >= end)):
                    if isinstance(exc, (FileNotFoundError, StorageError)):
                        raise
                    if is_client_error(exc):
                        raise StorageError(f"{what} failed: {_describe(exc)}") from exc
                    raise
                log.warning("%s failed (%s: %s); retry %d/%d in %.2fs", what,
                            type(exc).__name__, exc, attempt, self.attempts - 1, pause)
                time.sleep(pause)
                delay = min(delay * 2, self.max_delay)
        raise AssertionError("unreachable")


# ---- abandoned calls ---------------------------------------------------------------------------
#
# A bounded call still running at its deadline is abandoned: its caller raises and gives back the
# memory the call was reading into or writing from (a restore's buffers, a snapshot's pooled
# buffers), while the call's thread may go on until its requests time out (a trickling bucket).
# Such a call must never touch that memory again: a copy into the caller's memory runs under
# :func:`caller_memory` (the caller's timeout waits for a copy in progress, and none starts once
# the call is abandoned), and a streamed write stops at its next :func:`check_abandoned`. What a
# write stuck in a request may still read when the request returns is never reused: a save whose
# write failed gives its buffers up instead of returning them to the pool.


class _Call:
    """One bounded call on its helper thread."""

    __slots__ = ("lock", "done", "abandoned")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.abandoned = False


_current = threading.local()  # the _Call a helper thread runs


@contextlib.contextmanager
def caller_memory(what: str) -> Iterator[None]:
    """Touch the caller's memory only while the caller of this bounded call still waits.

    Inside a bounded call, a copy into memory its caller owns (a read into the caller's
    buffer) runs under it: the caller's timeout waits for a copy in progress, and none starts
    once the call is abandoned. Elsewhere (a call that is not bounded, a caller's own thread):
    nothing.

    Args:
        what: what the call does, for the message.

    Raises:
        StorageTimeoutError: the caller abandoned the call (nothing is touched).
    """
    call: Optional[_Call] = getattr(_current, "call", None)
    if call is None:
        yield
        return
    with call.lock:
        if call.abandoned:
            raise StorageTimeoutError(f"{what}: abandoned after its deadline; its caller's memory is left alone")
        yield


def check_abandoned(what: str) -> None:
    """Raise once the caller of this bounded call abandoned it.

    A streamed write then stops reading its caller's buffers, and is not completed.
    Elsewhere (a call that is not bounded): nothing.

    Args:
        what: what the call does, for the message.

    Raises:
        StorageTimeoutError: the caller abandoned the call.
    """
    call: Optional[_Call] = getattr(_current, "call", None)
    if call is not None and call.abandoned:
        raise StorageTimeoutError(f"{what}: abandoned after its deadline; not written")


def _run_bounded(fn: Callable[[], T], end: float, what: str, deadline: float) -> T:
    """``fn()`` on a daemon thread, waited for until monotonic time ``end``. A call still
    running then is abandoned (it ends on its own: its requests have timeouts; it touches its
    caller's memory no more, see :func:`caller_memory`) and :class:`StorageTimeoutError` is
    raised."""
    result: List[Any] = []
    failure: List[BaseException] = []
    done = threading.Event()
    call = _Call()

    def run() -> None:
        _current.call = call
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)
        finally:
            _current.call = None
            with call.lock:
                call.done = True
            done.set()

    threading.Thread(target=run, name="async-ckpt-storage-call", daemon=True).start()
    if not done.wait(max(0.0, end - time.monotonic())):
        with call.lock:  # waits for a copy into the caller's memory in progress (memory speed)
            call.abandoned = not call.done
        if call.abandoned:
            raise StorageTimeoutError(f"{what} did not finish within {deadline:g}s (RetryPolicy.deadline): the "
                                      f"storage is not answering; raise RetryPolicy(deadline=...) if it is only slow")
        done.wait()  # it had just finished
    if failure:
        exc = failure.pop()  # never left in this frame: its traceback holds the frame (and so
        try:  # the caller's, a manager's) in a cycle that only a cyclic GC would free
            raise exc
        finally:
            del exc
    return result.pop()


def _describe(exc: BaseException) -> str:
    """An error as one line: its message; a client's error (not an ``OSError``) with its class's
    name, which its message alone may not say (``EndpointConnectionError``)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, OSError) else f"{type(exc).__name__}: {text}"
