"""The ``torch.save`` record format: rendered and parsed here, and nowhere else.

DCP stores every tensor as its own ``torch.save`` archive (a small zip, a "record"). This
module is the one place that knows that archive's layout:

* **Rendering** (the writer). For a 4 KiB tensor ``torch.save`` spends ~300 µs on the zip
  writer and the pickler. Yet for a given dtype and shape the archive differs only in the
  tensor's bytes and in three values derived from them: the CRC-32 of ``data/0`` (stored
  twice), and the ``serialization_id`` record (with its own CRC-32, stored twice), which torch
  computes as ``hash_combine`` over the CRC-32s of the records before it.
  :class:`RecordTemplates` therefore calls ``torch.save`` once per (dtype, shape), finds those
  fields in its output, and from then on produces a record as ``prefix + data + suffix`` with
  the fields patched. A template is only used after it reproduced a second ``torch.save``
  output byte for byte (so a torch version that changes the format falls back to ``torch.save``
  itself). :func:`pickle_value` / :class:`PickledObject` render non-tensor values.
* **Parsing** (every reader and the command line). :func:`data_start` finds where the raw
  data of a single-tensor record lies, through a ``get(lo, hi)`` callable (so a large record is
  probed without reading its data); :func:`plain_data_start` does so for a record in memory,
  first against :data:`HEADS` (the bytes ``torch.save`` writes before the data, per dtype and
  shape), then by parsing. :func:`member_data_offset` is the zip arithmetic both halves share.
  :class:`TensorDescUnpickler` reads a record's ``data.pkl`` as a description only.
"""

from __future__ import annotations

import ctypes
import functools
import io
import pickle
import struct
import sys
import threading
import types
import zipfile
import zlib
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple, Union

import torch

from .. import compat
from ..addresses import byte_view, gather

_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B9

TEMPLATE_MAX_BYTES = 1 << 20  # larger tensors: torch.save's fixed cost is noise next to the data


def _hash_combine(seed: Any, value: Any) -> Any:
    """``c10::hash_combine`` on 64-bit ``size_t``: Python ints, or NumPy ``uint64`` values."""
    return (seed ^ ((value + _GOLDEN + (seed << 6) + (seed >> 2)) & _U64)) & _U64


#: A zip local file header's fixed part: signature, ..., name length and extra length last.
LOCAL_HEADER_BYTES = 30
LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"


def member_data_offset(header: Any, header_offset: int = 0) -> Optional[int]:
    """Where a stored (uncompressed) zip member's data starts, from its local file header.

    Args:
        header: bytes holding the member's local header at ``header_offset`` (at least
            :data:`LOCAL_HEADER_BYTES` of it).
        header_offset: where the header starts, in ``header`` and in the archive.

    Returns:
        The offset of the member's data in the archive, or ``None`` when ``header`` holds no
        local header there.
    """
    if len(header) < header_offset + LOCAL_HEADER_BYTES \
            or bytes(header[header_offset:header_offset + 4]) != LOCAL_HEADER_SIGNATURE:
        return None
    name_len, extra_len = struct.unpack_from("<HH", header, header_offset + 26)
    return header_offset + LOCAL_HEADER_BYTES + name_len + extra_len


def _data_offset(raw: bytes, info: zipfile.ZipInfo) -> int:
    """Where a stored member of the whole archive ``raw`` starts (its header must be there)."""
    at = member_data_offset(raw, info.header_offset)
    if at is None:
        raise ValueError("no local header where the zip directory says")
    return at


def _positions(raw: bytes, value: int, lo: int) -> List[int]:
    """Offsets >= ``lo`` where the little-endian uint32 ``value`` occurs in ``raw``."""
    needle = struct.pack("<I", value)
    out, at = [], raw.find(needle, lo)
    while at >= 0:
        out.append(at)
        at = raw.find(needle, at + 1)
    return out


class RecordTemplate:
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

    :meth:`RecordTemplate.append_to` costs ~8 us of Python per record. Here the records' fixed parts
    are written once per batch buffer, the data of all tensors is copied by one gather (by
    address, see :mod:`async_ckpt.addresses`), the ``serialization_id`` arithmetic
    runs on arrays, and only the two CRC-32s remain a call per record. The bytes are those of
    :meth:`RecordTemplate.append_to`, record for record (tests compare them).
    """

    def __init__(self, tpl: "RecordTemplate", size: int) -> None:
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
        self._templates: Dict[Tuple[torch.dtype, Tuple[int, ...]], Optional[RecordTemplate]] = {}
        self._lock = threading.Lock()

    def template(self, t: torch.Tensor) -> Optional[RecordTemplate]:
        """The checked template for ``t``, or ``None`` when ``t`` must go through ``torch.save``."""
        tpl: Union[RecordTemplate, None, Literal[False]] = self._templates.get((t.dtype, t.shape), False)
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

    def _build(self, t: torch.Tensor) -> Optional[RecordTemplate]:
        key = (t.dtype, tuple(t.shape))
        tpl: Optional[RecordTemplate]
        try:
            nbytes = t.numel() * t.element_size()
            # Random contents from a private generator: the global RNG (the training run's) must
            # not move because a checkpoint was written. Contiguous by construction.
            gen = torch.Generator().manual_seed(nbytes)

            def sample() -> torch.Tensor:
                raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
                return raw.view(t.dtype).reshape(t.shape)

            probe, check = sample(), sample()
            tpl = RecordTemplate(_torch_save_bytes(probe), nbytes, probe.stride())
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
        """The ``torch.save`` archive of the value, as a ``BytesIO`` at its start."""
        if self.is_archive:
            return io.BytesIO(self.data)
        buf = io.BytesIO()
        torch.save(self, buf, pickle_module=_VERBATIM)
        buf.seek(0)
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


# ---- parsing -----------------------------------------------------------------------------------

class RecordFile(io.RawIOBase):
    """A record as a seekable read-only file for ``zipfile``, its bytes fetched by
    ``get(lo, hi)`` (zipfile reads only the directory and headers of it)."""

    def __init__(self, get: Callable[[int, int], bytes], length: int) -> None:
        super().__init__()
        self._get, self._len, self._pos = get, length, 0

    @classmethod
    def of(cls, mv: memoryview) -> "RecordFile":
        """A record already in memory."""
        return cls(lambda lo, hi: bytes(mv[lo:hi]), len(mv))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = 0 if whence == 0 else (self._pos if whence == 1 else self._len)
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, n: Optional[int] = -1) -> bytes:
        end = self._len if n is None or n < 0 else min(self._len, self._pos + n)
        if end <= self._pos:
            return b""
        out = self._get(self._pos, end)
        self._pos = end
        return out


# "FloatStorage" -> torch.float32, as torch.save names storages in data.pkl (empty for a torch
# without the map: every tensor item is then read with torch.load)
_STORAGE_DTYPES = compat.storage_type_dtypes()
# "uint16" -> torch.uint16: the dtypes as ``_rebuild_tensor_v3`` names them
_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
#: ``torch.storage.UntypedStorage`` in a persistent id: bytes, typed by ``_rebuild_tensor_v3``'s dtype.
_UNTYPED = object()


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Optional[Tuple[Any, ...]]:
    """``torch._utils._rebuild_tensor_v2`` over a typed storage (``FloatStorage``: its dtype);
    None for a tensor saved with metadata (``{'conj': True}``, ``{'neg': True}``): its bytes are
    not its values, torch.load reads it."""
    if not isinstance(storage, torch.dtype):
        raise pickle.UnpicklingError("_rebuild_tensor_v2 over an untyped storage")
    if any(rest[2:]):  # after requires_grad and the backward hooks: torch.save's metadata dict
        return None
    return storage, offset, tuple(size), tuple(stride)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
                *rest: Any) -> Optional[Tuple[Any, ...]]:
    """``torch._utils._rebuild_tensor_v3``: an untyped storage and the dtype as an argument, as
    torch.save writes the dtypes without a typed storage class (float8, uint16/32/64, complex32);
    None for a tensor saved with metadata, as :func:`_rebuild_v2`."""
    if storage is not _UNTYPED or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("_rebuild_tensor_v3 needs an untyped storage and a dtype")
    if any(rest):
        return None
    return dtype, offset, tuple(size), tuple(stride)


class TensorDescUnpickler(pickle.Unpickler):
    """Reads a single-tensor ``data.pkl`` as ``(dtype, storage_offset, size, stride)``, from
    either form torch.save writes (``_rebuild_tensor_v2`` over a typed storage,
    ``_rebuild_tensor_v3`` over an untyped one), or None where the tensor carries metadata
    (a conjugate or negative view: its stored bytes are not its values); refuses anything else
    (nothing is constructed, no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if module == "torch.storage" and name == "UntypedStorage":
            return _UNTYPED
        if module == "collections" and name == "OrderedDict":
            return lambda *a: None
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 2 and pid[0] == "storage" \
                and (isinstance(pid[1], torch.dtype) or pid[1] is _UNTYPED):
            return pid[1]
        raise pickle.UnpicklingError(f"persistent id {pid!r}")


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides: List[int] = []
    acc = 1
    for d in reversed(shape):
        strides.insert(0, acc)
        acc *= d
    return tuple(strides)


def data_start(get: Callable[[int, int], bytes], length: int, dtype: torch.dtype,
               shape: Tuple[int, ...]) -> Optional[int]:
    """Where the raw data of a contiguous tensor lies in a ``torch.save`` record.

    Args:
        get: ``get(lo, hi)`` gives the record's bytes ``lo`` to ``hi`` (only its zip directory
            and headers are asked for).
        length: the record's length in bytes.
        dtype: the tensor's dtype.
        shape: the tensor's shape.

    Returns:
        The offset of the data in the record, or ``None`` unless the record is exactly one
        little-endian, uncompressed storage of ``dtype`` and ``shape`` at offset 0 with
        contiguous strides (anything else is for ``torch.load``).
    """
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
            desc = TensorDescUnpickler(io.BytesIO(zf.read(pkl[0]))).load()
            if desc != (dtype, 0, tuple(shape), _contiguous_strides(tuple(shape))):
                return None
            off = data[0].header_offset
            start = member_data_offset(get(off, off + LOCAL_HEADER_BYTES))
            if start is None:
                return None
            start += off
            if start + nbytes > length:
                return None
            return start
    except (zipfile.BadZipFile, ValueError, struct.error, pickle.UnpicklingError, EOFError, TypeError,
            AttributeError, IndexError, KeyError, NotImplementedError, OSError):
        return None


class Heads:
    """``torch.save``'s bytes before the data, and the record's length, per (dtype, shape)
    of a small tensor: a record that starts with them has its data right after."""

    def __init__(self) -> None:
        self._cache: Dict[Tuple[torch.dtype, Tuple[int, ...]], Optional[Tuple[bytes, int]]] = {}
        self._lock = threading.Lock()

    def get(self, dtype: torch.dtype, shape: Tuple[int, ...]) -> Optional[Tuple[bytes, int]]:
        """``(bytes before the data, record length)`` of ``torch.save`` of a contiguous tensor
        of ``dtype`` and ``shape``; ``None`` where :func:`data_start` does not parse it."""
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


#: The process's cache of record heads (they depend on torch only).
HEADS = Heads()


def plain_data_start(item: Any, dtype: torch.dtype, shape: Tuple[int, ...]) -> Optional[int]:
    """:func:`data_start` for a record held in memory: first compared with :data:`HEADS` (no
    zip parsing for a record ``torch.save`` wrote for this dtype and shape), else parsed.

    Args:
        item: the record's bytes (a memoryview or bytes).
        dtype: the target tensor's dtype.
        shape: the target tensor's shape.

    Returns:
        The offset of the data in ``item``, or ``None`` for a record ``torch.load`` must read.
    """
    head = HEADS.get(dtype, shape)
    if head is not None and head[1] == len(item) and item[:len(head[0])] == head[0]:
        return len(head[0])
    return data_start(lambda a, b: bytes(item[a:b]), len(item), dtype, shape)
