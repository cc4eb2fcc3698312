"""Where the raw data of a ``torch.save`` record lies in it, found from a few of its bytes.

:func:`data_start` reads a record's zip directory and headers (through a ``get(lo, hi)``
callable, so a large record is probed without reading its data); :class:`Heads` caches, per
(dtype, shape), the bytes ``torch.save`` writes before the data, so that a small record that
starts with them needs no zip parsing; :class:`Probe` holds the bytes read near a large
record's ends; :class:`Arrived` gathers those bytes from the reads of the whole file instead,
where the manifest said where the data lies.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import threading
import zipfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...addresses import byte_view
from .reader import RecordFile
from .safety import _TensorDescUnpickler

#: Bytes read at each end of a large record to find where its data lies.
PROBE_BYTES = 4096


class Heads:
    """``torch.save``'s bytes before the data, and the record's length, per (dtype, shape)
    of a small tensor: a record that starts with them has its data right after."""

    def __init__(self) -> None:
        self._cache: Dict[Tuple[torch.dtype, Tuple[int, ...]], Optional[Tuple[bytes, int]]] = {}
        self._lock = threading.Lock()

    def get(self, dtype: torch.dtype, shape: Tuple[int, ...]) -> Optional[Tuple[bytes, int]]:
        key = (dtype, shape)
        if key in self._cache:
            return self._cache[key]
        got: Optional[Tuple[bytes, int]] = None
        try:
            buf = io.BytesIO()
            n = 1
            for d in shape:
                n *= d
            # zeros made as bytes: creating a complex32 tensor directly warns that it is experimental
            torch.save(torch.zeros(n * dtype.itemsize, dtype=torch.uint8).view(dtype).view(shape), buf)
            raw = buf.getvalue()
            mv = memoryview(raw)
            start = data_start(lambda a, b: bytes(mv[a:b]), len(raw), dtype, shape)
            if start is not None:
                got = (raw[:start], len(raw))
        except Exception:
            got = None
        with self._lock:
            self._cache[key] = got
        return got


HEADS = Heads()


def data_start(get: Callable[[int, int], bytes], length: int, dtype: torch.dtype,
                shape: Tuple[int, ...]) -> Optional[int]:
    """Where, in a ``torch.save`` record of ``length`` bytes (read through ``get``), the raw
    data of a contiguous ``dtype`` tensor of ``shape`` starts; None unless the record is
    exactly that (one little-endian uncompressed storage of that size, offset 0, contiguous
    strides)."""
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if sys.byteorder != "little":
        return None
    try:
        with zipfile.ZipFile(RecordFile(get, length)) as zf:
            infos = zf.infolist()
            data = [i for i in infos if i.filename.rsplit("/", 2)[-2:-1] == ["data"]]
            order = [i for i in infos if i.filename.endswith("/byteorder")]
            pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
            if len(data) != 1 or len(pkl) != 1 or data[0].compress_type != zipfile.ZIP_STORED \
                    or data[0].file_size != nbytes or pkl[0].compress_type != zipfile.ZIP_STORED:
                return None
            if order and zf.read(order[0]) != b"little":
                return None
            desc = _TensorDescUnpickler(io.BytesIO(zf.read(pkl[0]))).load()
            strides: List[int]
            strides, acc = [], 1
            for d in reversed(shape):
                strides.insert(0, acc)
                acc *= d
            if desc != (dtype, 0, tuple(shape), tuple(strides)):
                return None
            off = data[0].header_offset
            head = get(off, off + 30)
            if len(head) != 30 or head[:4] != b"PK\x03\x04":
                return None
            name_len, extra_len = struct.unpack_from("<HH", head, 26)
            start = off + 30 + name_len + extra_len
            if start + nbytes > length:
                return None
            return start
    except (zipfile.BadZipFile, ValueError, struct.error, pickle.UnpicklingError, EOFError, TypeError,
            AttributeError, IndexError, KeyError, NotImplementedError, OSError):
        return None


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
