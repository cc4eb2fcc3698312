"""``torch.save``'s exact bytes for a tensor, without ``torch.save``'s per-call cost.

DCP stores every tensor as its own ``torch.save`` archive (a small zip). For a 4 KiB tensor
``torch.save`` spends ~300 µs on the zip writer and the pickler, which makes 10,000 small
tensors take seconds to write. Yet for a given dtype and shape the archive differs only in the
tensor's bytes and in three values derived from them: the CRC-32 of ``data/0`` (stored twice),
and the ``serialization_id`` record (with its own CRC-32, stored twice), which torch computes
as ``hash_combine`` over the CRC-32s of the records before it.

:class:`RecordTemplates` therefore calls ``torch.save`` once per (dtype, shape), finds those
fields in its output, and from then on produces a record as ``prefix + data + suffix`` with
the fields patched. A template is only used after it reproduced a second ``torch.save`` output
byte for byte (so a torch version that changes the format falls back to ``torch.save``
itself), and tests compare the two outputs over many dtypes and shapes.
"""

from __future__ import annotations

import ctypes
import functools
import io
import pickle
import struct
import threading
import types
import zipfile
import zlib
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import torch

from ..addresses import byte_view, gather

_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B9

TEMPLATE_MAX_BYTES = 1 << 20  # larger tensors: torch.save's fixed cost is noise next to the data


def _hash_combine(seed: Any, value: Any) -> Any:
    """``c10::hash_combine`` on 64-bit ``size_t``: Python ints, or NumPy ``uint64`` values."""
    return (seed ^ ((value + _GOLDEN + (seed << 6) + (seed >> 2)) & _U64)) & _U64


def _data_offset(raw: bytes, info: zipfile.ZipInfo) -> int:
    """Where a stored (uncompressed) member's data starts: after its local header."""
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def _positions(raw: bytes, value: int, lo: int) -> List[int]:
    """Offsets >= ``lo`` where the little-endian uint32 ``value`` occurs in ``raw``."""
    needle = struct.pack("<I", value)
    out, at = [], raw.find(needle, lo)
    while at >= 0:
        out.append(at)
        at = raw.find(needle, at + 1)
    return out


class _Template:
    """One (dtype, shape)'s archive with the data-dependent fields located."""

    __slots__ = ("strides", "head", "data_crc_at", "tail", "sid_prefix_crc", "sid_at", "sid_crc_at",
                 "crc_before", "crc_after", "nbytes", "length", "ctype")

    def __init__(self, raw: bytes, nbytes: int, strides: Tuple[int, ...]) -> None:
        self.strides = strides  # the (contiguous) strides the archive's pickle records
        zf = zipfile.ZipFile(io.BytesIO(raw))
        infos = zf.infolist()
        names = [i.filename for i in infos]
        data_i = next(k for k, n in enumerate(names) if n.endswith("/data/0"))
        sid_i = next(k for k, n in enumerate(names) if n.endswith("/.data/serialization_id"))
        if sid_i != len(infos) - 1 or any(i.compress_type != zipfile.ZIP_STORED for i in infos):
            raise ValueError("unexpected torch.save archive layout")
        data_info, sid_info = infos[data_i], infos[sid_i]
        start = _data_offset(raw, data_info)
        if data_info.file_size != nbytes:
            raise ValueError("unexpected data record size")
        end = start + nbytes
        crcs = [zlib.crc32(zf.read(n)) for n in names[:sid_i]]
        combined = 0
        for c in crcs[:data_i]:
            combined = _hash_combine(combined, c)
        self.crc_before = combined
        self.crc_after = crcs[data_i + 1:]
        # After the data: the data descriptor's CRC, then (in the central directory) again.
        self.data_crc_at = [p - end for p in _positions(raw, data_info.CRC, end)]
        sid_start = _data_offset(raw, sid_info)
        sid = raw[sid_start:sid_start + sid_info.file_size]
        if len(sid) != 40 or not sid.isdigit():
            raise ValueError("unexpected serialization id")
        self.sid_prefix_crc = zlib.crc32(sid[:20])
        self.sid_at = sid_start + 20 - end
        self.sid_crc_at = [p - end for p in _positions(raw, sid_info.CRC, sid_start + 40)]
        if len(self.data_crc_at) != 2 or len(self.sid_crc_at) != 2:
            raise ValueError("CRC fields not found exactly twice")
        self.head = raw[:start]
        self.tail = raw[end:]
        self.nbytes = nbytes
        self.length = len(raw)
        self.ctype = ctypes.c_char * nbytes  # the data as a buffer, straight from its address

    def append_to(self, out: bytearray, data: Any) -> int:
        """Append the archive whose ``data/0`` holds ``data`` to ``out``; return its length."""
        crc = zlib.crc32(data)
        combined = _hash_combine(self.crc_before, crc)
        for c in self.crc_after:
            combined = _hash_combine(combined, c)
        digits = b"%020d" % combined
        sid_crc = zlib.crc32(digits, self.sid_prefix_crc)
        out += self.head
        out += data
        at = len(out)
        out += self.tail
        pack = _pack_u32
        p0, p1 = self.data_crc_at
        pack(out, at + p0, crc)
        pack(out, at + p1, crc)
        sid = at + self.sid_at
        out[sid:sid + 20] = digits
        p0, p1 = self.sid_crc_at
        pack(out, at + p0, sid_crc)
        pack(out, at + p1, sid_crc)
        return self.length


_pack_u32 = struct.Struct("<I").pack_into


class RecordBatch:
    """Renders many records of one template at once, into one reused buffer.

    :meth:`_Template.append_to` costs ~8 us of Python per record. Here the records' fixed parts
    are written once per batch buffer, the data of all tensors is copied by one gather (by
    address, see :mod:`async_ckpt.addresses`), the ``serialization_id`` arithmetic
    runs on arrays, and only the two CRC-32s remain a call per record. The bytes are those of
    :meth:`_Template.append_to`, record for record (tests compare them).
    """

    def __init__(self, tpl: "_Template", size: int) -> None:
        import numpy as np

        self.tpl = tpl
        self.size = size
        head, n = len(tpl.head), tpl.nbytes
        self.at = head + n  # where a record's tail starts
        self.chunk = np.empty((size, tpl.length), np.uint8)
        self.chunk[:, :head] = np.frombuffer(tpl.head, np.uint8)
        self.chunk[:, self.at:] = np.frombuffer(tpl.tail, np.uint8)
        self.data = torch.from_numpy(self.chunk)[:, head:self.at]  # each record's data/0
        self.flat = memoryview(self.chunk.reshape(-1))  # type: ignore[arg-type, unused-ignore]  # numpy declares the buffer protocol for Python >= 3.12 only

    def render(self, ts: List[torch.Tensor]) -> memoryview:
        """The records of ``ts`` (at most ``size``, each eligible for the template), concatenated."""
        import numpy as np

        tpl, b, n, length, at = self.tpl, len(ts), self.tpl.nbytes, self.tpl.length, self.at
        with torch.no_grad():
            gather(torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64), n, self.data[:b])
        flat, crc32 = self.flat, zlib.crc32
        start = at - n
        crcs = np.array([crc32(flat[k * length + start: k * length + at]) for k in range(b)], np.uint64)
        combined = _hash_combine(np.uint64(tpl.crc_before), crcs)  # uint64 arrays wrap like size_t
        for c in tpl.crc_after:
            combined = _hash_combine(combined, np.uint64(c))
        digits = np.empty((b, 20), np.uint8)  # "%020d" of each, as ASCII
        for j in range(19, -1, -1):
            digits[:, j] = combined % np.uint64(10) + np.uint64(48)
            combined //= np.uint64(10)
        dflat, prefix = memoryview(digits.reshape(-1)), tpl.sid_prefix_crc  # type: ignore[arg-type, unused-ignore]  # numpy declares the buffer protocol for Python >= 3.12 only
        sid_crcs = np.array([crc32(dflat[k * 20: k * 20 + 20], prefix) for k in range(b)], np.uint32)
        chunk = self.chunk
        c4 = crcs.astype("<u4").view(np.uint8).reshape(b, 4)
        for p in tpl.data_crc_at:
            chunk[:b, at + p: at + p + 4] = c4
        sid = at + tpl.sid_at
        chunk[:b, sid: sid + 20] = digits
        s4 = sid_crcs.astype("<u4").view(np.uint8).reshape(b, 4)
        for p in tpl.sid_crc_at:
            chunk[:b, at + p: at + p + 4] = s4
        return flat[: b * length]


def _torch_save_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, as an unsigned-byte memoryview."""
    return byte_view(t.reshape(-1).view(torch.uint8)).cast("B") if t.numel() else memoryview(b"")


class RecordTemplates:
    """Produces ``torch.save(t)``'s bytes for small contiguous CPU tensors from cached templates.

    Thread-safe. :meth:`append` appends the bytes to a buffer and returns their length, or
    ``-1`` when the tensor is not eligible (empty or larger than ``max_bytes``, not a
    contiguous CPU tensor, or its template failed the check); the caller then uses
    ``torch.save``.
    """

    def __init__(self, max_bytes: int = TEMPLATE_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._templates: Dict[Tuple[torch.dtype, Tuple[int, ...]], Optional[_Template]] = {}
        self._lock = threading.Lock()

    def template(self, t: torch.Tensor) -> Optional[_Template]:
        """The checked template for ``t``, or ``None`` when ``t`` must go through ``torch.save``."""
        tpl: Union[_Template, None, Literal[False]] = self._templates.get((t.dtype, t.shape), False)
        if tpl is False:
            if not self._eligible(t):
                return None
            tpl = self._build(t)
        # The exact strides, not is_contiguous(): that ignores the stride of a size-1 dimension,
        # which torch.save records.
        if tpl is None or type(t) is not torch.Tensor or not t.is_cpu or t.requires_grad \
                or t.layout != torch.strided or t.stride() != tpl.strides or t.is_conj() or t.is_neg():
            return None
        return tpl

    def append(self, out: bytearray, t: torch.Tensor) -> int:
        """Append ``torch.save(t)``'s bytes to ``out`` and return their length; ``-1`` (nothing
        appended) when ``t`` is not eligible."""
        tpl = self.template(t)
        if tpl is None:
            return -1
        return tpl.append_to(out, tpl.ctype.from_address(t.data_ptr()))

    def _eligible(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        return 0 < nbytes <= self.max_bytes and type(t) is torch.Tensor and t.layout == torch.strided \
            and t.is_cpu and not t.is_quantized

    def _build(self, t: torch.Tensor) -> Optional[_Template]:
        key = (t.dtype, tuple(t.shape))
        tpl: Optional[_Template]
        try:
            nbytes = t.numel() * t.element_size()
            # Random contents from a private generator: the global RNG (the training run's) must
            # not move because a checkpoint was written. Contiguous by construction.
            gen = torch.Generator().manual_seed(nbytes)

            def sample() -> torch.Tensor:
                raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
                return raw.view(t.dtype).reshape(t.shape)

            probe, check = sample(), sample()
            tpl = _Template(_torch_save_bytes(probe), nbytes, probe.stride())
            out = bytearray()
            tpl.append_to(out, _bytes_of(check))
            if out != _torch_save_bytes(check):
                tpl = None
        except Exception:  # an unusual dtype or a changed archive layout: use torch.save
            tpl = None
        with self._lock:
            self._templates[key] = tpl
        return tpl


# ---- non-tensor values -----------------------------------------------------------------------

class _HoldsStorage(Exception):
    """Raised inside :func:`pickle_value`'s pickler: the value holds a tensor or a storage."""


class _StoragelessPickler(pickle.Pickler):
    """Protocol-2 pickler (``torch.save``'s) that stops at the first tensor storage."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            raise _HoldsStorage
        return None


class _VerbatimPickler:
    """Stands in for a pickler inside ``torch.save``: ``dump`` writes the bytes a
    :class:`PickledObject` already holds as the archive's ``data.pkl``, unchanged."""

    def __init__(self, file: Any, protocol: Any = None, **kwargs: Any) -> None:
        self._file = file

    def dump(self, obj: "PickledObject") -> None:
        self._file.write(obj.data)


_VERBATIM = types.SimpleNamespace(__name__="async_ckpt_verbatim_pickle", Pickler=_VerbatimPickler)


class PickledObject:
    """A non-tensor value of a state dict, serialised once, when the save was called.

    The snapshot holds these bytes instead of the value, so a later mutation of the value
    cannot reach the checkpoint and the value's ``__reduce__`` runs exactly once, at the call
    (never a second time in the background, and nothing is ever unpickled on the save side).
    :meth:`archive` gives the item's bytes as DCP stores a non-tensor item (a ``torch.save``
    archive), which ``torch.load`` (and a restore) reads back as the original value.

    ``data`` is the protocol-2 pickle that ``torch.save`` writes as ``data.pkl`` (``archive``
    false), or, for a value that holds tensors, the whole ``torch.save`` archive.

    Inside a tuple or a list (which DCP stores as one item, ``torch.save``-d whole), a
    ``PickledObject`` is pickled as the value it stands for (:meth:`__reduce__`), so that
    every value comes back as itself at any depth.
    """

    __slots__ = ("data", "is_archive")

    def __init__(self, data: bytes, is_archive: bool = False) -> None:
        self.data = data
        self.is_archive = is_archive

    def archive(self) -> io.BytesIO:
        """The ``torch.save`` archive of the value, as a ``BytesIO``."""
        if self.is_archive:
            return io.BytesIO(self.data)
        buf = io.BytesIO()
        torch.save(self, buf, pickle_module=_VERBATIM)
        return buf

    def __reduce__(self) -> Tuple[Any, ...]:
        """Unpickled, the value itself (never a ``PickledObject``): ``pickle.loads`` of
        ``data``, or ``torch.load`` of the archive for a value holding tensors. Only standard
        callables are named, so ``torch.load(weights_only=False)`` and ``dcp.load`` rebuild
        the value without async_ckpt; nothing is unpickled here, on the save side."""
        if self.is_archive:
            return functools.partial(torch.load, weights_only=False), (io.BytesIO(self.data),)
        return pickle.loads, (self.data,)

    def __eq__(self, other: Any) -> bool:
        return type(other) is PickledObject and other.data == self.data and other.is_archive == self.is_archive

    def __hash__(self) -> int:
        return hash(self.data)

    def __repr__(self) -> str:
        return f"PickledObject({len(self.data)} bytes{', archive' if self.is_archive else ''})"


def pickle_value(value: Any) -> PickledObject:
    """``value`` serialised once for a checkpoint (see :class:`PickledObject`); raises what
    pickling raises for a value that cannot be saved.

    A value without tensors is pickled as ``torch.save`` pickles it (protocol 2), with no zip
    writer in between (a few microseconds instead of tens). A value that holds tensors is
    found out by the first storage the pickler meets, and is then written by ``torch.save``
    itself (its storages become the archive's data records).
    """
    buf = io.BytesIO()
    try:
        _StoragelessPickler(buf, protocol=2).dump(value)
    except _HoldsStorage:
        buf = io.BytesIO()
        torch.save(value, buf)
        return PickledObject(buf.getvalue(), is_archive=True)
    return PickledObject(buf.getvalue())
