"""Bounded exponential backoff for transient storage errors; permanent errors fail at once."""

from __future__ import annotations

import errno
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from ..errors import StorageError

T = TypeVar("T")
log = logging.getLogger("async_ckpt")

_PERMANENT_ERRNO = {errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EROFS, errno.EDQUOT, errno.ENOENT, errno.EEXIST,
                    errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG}
_TRANSIENT_ERRNO = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE,
                    errno.EAGAIN, errno.EIO, errno.EHOSTUNREACH, errno.ENETUNREACH}


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: timeouts, connection resets, HTTP 408/429/5xx."""
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    status = getattr(exc, "code", None) or getattr(exc, "status", None) or getattr(exc, "status_code", None)
    if isinstance(status, int):
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


# Base classes (by name, so that neither aiohttp nor botocore need be imported) whose every
# subclass is a network-level failure: aiohttp's connection errors (gcsfs, s3fs), botocore's
# and requests' ConnectionError / HTTPClientError, whatever their errno.
_TRANSIENT_BASES = {("aiohttp.client_exceptions", "ClientConnectionError"),
                    ("aiohttp.client_exceptions", "ClientPayloadError"),
                    ("botocore.exceptions", "ConnectionError"), ("botocore.exceptions", "HTTPClientError"),
                    ("requests.exceptions", "ConnectionError"), ("requests.exceptions", "Timeout")}


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
    """Retry transient errors up to ``attempts`` times with capped, jittered exponential backoff."""

    attempts: int = 5
    initial_delay: float = 0.2
    max_delay: float = 5.0

    def call(self, fn: Callable[[], T], what: str) -> T:
        delay = self.initial_delay
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as exc:
                if attempt == self.attempts or not is_transient(exc):
                    if isinstance(exc, (FileNotFoundError, StorageError)):
                        raise
                    if isinstance(exc, OSError):
                        raise StorageError(f"{what} failed: {exc}") from exc
                    raise
                log.warning("%s failed (%s: %s); retry %d/%d in %.2fs", what,
                            type(exc).__name__, exc, attempt, self.attempts - 1, delay)
                time.sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, self.max_delay)
        raise AssertionError("unreachable")
