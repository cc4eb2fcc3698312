"""The bytes of a large record a direct restore reads to find or confirm where its data lies.

:class:`Probe` holds the bytes read near a large record's ends; :class:`Arrived` gathers those
bytes from the reads of the whole file instead, where the manifest said where the data lies.
Both hand them to :func:`~async_ckpt.format.torch_record.data_start`, which parses them.
"""

from __future__ import annotations

import threading
from typing import Any, List, Tuple

import torch

from ..addresses import byte_view
from ..format.torch_record import data_start

#: Bytes read at each end of a large record to find where its data lies.
PROBE_BYTES = 4096


class Probe:
    """The bytes of a large record near its ends, read once; other bytes read on demand."""

    def __init__(self, reader: Any, rec: Any) -> None:
        self.reader, self.rec = reader, rec
        n = min(PROBE_BYTES, rec.length)
        self.windows: List[Tuple[int, bytes]] = []  # (offset in the file, bytes)
        self._fetch(rec.start, n)
        if rec.length > n:
            lo = max(rec.start + n, rec.start + rec.length - PROBE_BYTES)
            self._fetch(lo, rec.start + rec.length - lo)

    def _fetch(self, start: int, n: int) -> bytes:
        buf = bytearray(n)
        got = self.reader.read_into(start, memoryview(buf))
        data = bytes(buf[:got])
        self.windows.append((start, data))
        return data

    def get(self, lo: int, hi: int) -> bytes:  # record-relative
        a, b = self.rec.start + lo, self.rec.start + hi
        for w0, data in self.windows:
            if w0 <= a and b <= w0 + len(data):
                return data[a - w0:b - w0]
        return self._fetch(a, b - a)


class Arrived:
    """The bytes of a large record around its data (its head, from its start to the data, and
    its tail, from the end of the data to its end), gathered as the reads bring them in, to
    confirm where its data lies when that was taken from the manifest instead of probed."""

    def __init__(self, reader: Any, start: int, length: int, data_start: int, nbytes: int) -> None:
        self.reader, self.start, self.length = reader, start, length
        self.data_lo, self.data_hi = data_start, data_start + nbytes  # in the file
        self.head = bytearray(data_start - start)
        self.tail = bytearray(start + length - self.data_hi)
        self._missing = len(self.head) + len(self.tail)
        self._lock = threading.Lock()

    def take(self, lo: int, data: memoryview) -> bool:
        """Keep what of the file's bytes ``data`` (from offset ``lo``) lies in the head or tail;
        whether that completed them (true once, on the call that did)."""
        hi, n = lo + len(data), 0
        for buf, base, end in ((self.head, self.start, self.data_lo), (self.tail, self.data_hi, self.start + self.length)):
            a, b = max(lo, base), min(hi, end)
            if a < b:
                buf[a - base:b - base] = data[a - lo:b - lo]
                n += b - a
        if not n:
            return False
        with self._lock:
            self._missing -= n
            return self._missing == 0

    def get(self, lo: int, hi: int) -> bytes:  # record-relative
        a, b = self.start + lo, self.start + hi
        if self.start <= a and b <= self.data_lo:
            return bytes(self.head[a - self.start:b - self.start])
        if self.data_hi <= a and b <= self.start + self.length:
            return bytes(self.tail[a - self.data_hi:b - self.data_hi])
        buf = bytearray(b - a)  # not where zipfile looks in a torch.save record: read it
        got = self.reader.read_into(a, memoryview(buf))
        return bytes(buf[:got])

    def record(self, data: torch.Tensor) -> memoryview:
        """The whole record: the head and tail gathered, ``data`` (its bytes, flat uint8) between."""
        out = bytearray(self.length)
        h, n = len(self.head), self.data_hi - self.data_lo
        out[:h] = self.head
        out[h:h + n] = byte_view(data)
        out[h + n:] = self.tail
        return memoryview(out)

    def agrees(self, dtype: torch.dtype, shape: Tuple[int, ...]) -> bool:
        """Whether the record, parsed from the bytes gathered, has its data where it was said to."""
        return data_start(self.get, self.length, dtype, shape) == self.data_lo - self.start
