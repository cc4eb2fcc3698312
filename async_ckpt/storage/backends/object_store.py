"""Object stores through fsspec (``gs://``, ``s3://``, ...): no directories, no rename; one
PUT of an object is atomic, and the service checks each upload's length."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from .fsspec import FsspecBackend

#: fsspec protocols of object stores.
OBJECT_STORE_PROTOCOLS = frozenset({"gs", "gcs", "s3", "s3a", "az", "abfs", "abfss", "adl", "oss", "oci", "cos",
                                    "tos", "r2", "b2"})

#: protocols whose fsspec client retries each request itself
RETRYING_CLIENTS = frozenset({"gs", "gcs", "s3", "s3a"})

#: protocols whose service keeps each object's CRC-32C and whose client's ``info()`` gives it
CRC32C_KEEPERS = frozenset({"gs", "gcs"})

# The writer aims for data files of about this size, so one checkpoint becomes many objects
# uploaded concurrently (each a single request) rather than a few long streams; 8-16 MiB is
# the request size both GCS and S3 recommend for parallel transfers.
OBJECT_FILE_BYTES = 16 * 2**20


class ObjectStoreBackend(FsspecBackend):
    """gs://, s3://, ... (see :class:`~.base.Backend`)."""

    length_checked_writes = True
    default_max_file_bytes: Optional[int] = OBJECT_FILE_BYTES
    atomic_puts = True
    probe_writes = True

    def __init__(self, fs: Any) -> None:
        super().__init__(fs)
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        # gcsfs retries every request (6 tries, backoff to 32 s), s3fs/botocore too
        self.client_retries = any(p in RETRYING_CLIENTS for p in protocols)
        self.keeps_crc32c = any(p in CRC32C_KEEPERS for p in protocols)

    def endpoint(self) -> Optional[str]:
        """The URL the client sends its requests to, where the client says it (gcsfs: its
        endpoint, the emulator's or Google's; s3fs: an ``endpoint_url`` given, or botocore's
        ``AWS_ENDPOINT_URL*`` variables); else None."""
        fs = self.fs
        location = getattr(fs, "_location", None)  # gcsfs
        if isinstance(location, str):
            return location
        kwargs = getattr(fs, "client_kwargs", None) or {}
        for url in (getattr(fs, "endpoint_url", None), kwargs.get("endpoint_url"),
                    os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_ENDPOINT_URL")):
            if isinstance(url, str) and url:
                return url
        return None

    def makedirs(self, path: str) -> None:
        pass  # no directories; and gcsfs/s3fs makedirs would silently create a missing bucket

    @contextmanager
    def open_write(self, path: str, size_hint: Optional[int], *, block_size: int,
                   pipe_max_bytes: int) -> Iterator[Any]:
        """A file whose ``size_hint`` is at most ``pipe_max_bytes`` is buffered in memory and
        uploaded in one ``pipe_file`` call on exit; otherwise it streams in ``block_size``
        chunks (resumable/multipart upload), completed on exit."""
        if size_hint is not None and size_hint <= pipe_max_bytes:
            buf = _BufferFile(size_hint)
            yield buf
            self.fs.pipe_file(path, buf.getvalue())
        else:
            with super().open_write(path, size_hint, block_size=block_size, pipe_max_bytes=pipe_max_bytes) as f:
                yield f


class _BufferFile:
    """A write-only in-memory file backed by one ``bytearray`` (no copy when it is uploaded)."""

    def __init__(self, size_hint: int) -> None:
        self._buf = bytearray(max(0, size_hint) + 65536)  # torch.save adds headers beyond the raw bytes
        self._n = 0
        self.closed = False

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        end = self._n + mv.nbytes
        if end > len(self._buf):
            self._buf.extend(bytes(max(end - len(self._buf), len(self._buf) // 4)))
        self._buf[self._n:end] = mv
        self._n = end
        return mv.nbytes

    def tell(self) -> int:
        return self._n

    def flush(self) -> None:
        pass

    def getvalue(self) -> bytearray:
        del self._buf[self._n:]  # truncate in place
        return self._buf
