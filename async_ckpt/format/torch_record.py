"""The ``torch.save`` record format: rendered and parsed here, and nowhere else.

DCP stores every tensor as its own ``torch.save`` archive (a small zip, a "record"). This
module is the one place that knows that archive's layout:

* **Rendering** (the writer). Records are written as ``torch.save`` writes them with its
  zip CRC-32s turned off (``torch.serialization.set_crc32_options(False)``, a torch option;
  ``torch.load`` never checks them, and a checkpoint's integrity is the manifest's CRC-32C of
  every record, checked on every read). Computing zip CRC-32s is what makes ``torch.save``
  slow and hold the GIL over a tensor's whole data; without them the archive of a given
  dtype and shape is ``head + data + tail``, the same ``head`` and ``tail`` whatever the data.
  :class:`RecordTemplates` captures them once per (dtype, shape) from torch's own writer
  (:func:`~async_ckpt.compat.torch_save_without_crc`, the data left out), and the writer then
  emits a record as ``head``, the tensor's memory as it is, ``tail``: no copy of a large
  tensor and nothing per byte under the GIL. A template holds only if two captures agree (so a
  torch version that changes the format falls back to ``torch.save`` itself).
  :class:`RecordBatch` renders runs of small records in one gather;
  :func:`pickle_value` / :class:`PickledObject` render non-tensor values.
* **Parsing** (every reader and the command line). :func:`data_start` finds where the raw
  data of a single-tensor record lies, through a ``get(lo, hi)`` callable (so a large record is
  probed without reading its data); :func:`plain_data_start` does so for a record in memory,
  first against :data:`HEADS` (the bytes before the data, per dtype and shape, as async_ckpt
  and as ``torch.save`` with its default options write them), then by parsing.
  :func:`member_data_offset` is the zip arithmetic both halves share.
  :func:`stored_bytes` / :func:`aligned_copy`: a single-tensor record's data into its target,
  straight from the read buffer (every reader: the direct restore and DCP's reader).
  :class:`TensorDescUnpickler` reads a record's ``data.pkl`` as a description only.
"""

from __future__ import annotations

import ctypes
import functools
import io
import itertools
import pickle
import struct
import sys
import threading
import types
import warnings
import zipfile
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple, Union

import torch

from .. import compat
from ..addresses import gather
from .buffers import address_of

TEMPLATE_MAX_BYTES = 1 << 20  # records up to this size are copied into the writer's buffer


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


def own_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as its record holds it when ``torch.save`` renders it (no template fits): a view of
    part of a bigger storage (a slice, an ``expand``) cloned, because ``torch.save`` writes a
    tensor's whole storage while a record holds the view's own ``numel * element_size`` bytes,
    as the DCP metadata says and every reader expects. Both writers (the thread and the writer
    process) render such a tensor from this."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


_serials = itertools.count(1)


class RecordTemplate:
    """One (dtype, shape)'s record: ``head + data + tail``, with ``head`` and ``tail`` fixed.
    ``serial`` names it for as long as the process lives (never reused, unlike ``id()``): the
    writer process knows templates by it."""

    __slots__ = ("serial", "strides", "head", "tail", "nbytes", "length", "ctype")

    def __init__(self, head: bytes, tail: bytes, nbytes: int, strides: Tuple[int, ...]) -> None:
        self.serial = next(_serials)
        self.strides = strides  # the (contiguous) strides the archive's pickle records
        self.head = head
        self.tail = tail
        self.nbytes = nbytes
        self.length = len(head) + nbytes + len(tail)
        self.ctype = ctypes.c_char * nbytes  # the data as a buffer, straight from its address

    def append_to(self, out: bytearray, data: Any) -> int:
        """Append the record whose ``data/0`` holds ``data`` to ``out``; return its length."""
        out += self.head
        out += data
        out += self.tail
        return self.length

    def reads_as(self, dtype: torch.dtype, shape: Tuple[int, ...]) -> bool:
        """Whether a reader takes ``head + data + tail`` for a record of ``dtype`` and ``shape``
        with its data right after ``head`` (:func:`data_start`, reading only the head and tail)."""
        head, tail, n = self.head, self.tail, self.nbytes

        def get(lo: int, hi: int) -> bytes:  # the record with its data left out (zeros if asked)
            out = bytearray(hi - lo)
            for start, part in ((0, head), (len(head) + n, tail)):
                a, b = max(lo, start), min(hi, start + len(part))
                if a < b:
                    out[a - lo:b - lo] = part[a - start:b - start]
            return bytes(out)

        return data_start(get, self.length, dtype, shape) == len(head)


class _Capture:
    """A file for ``torch.save`` that keeps every write except the one handing over the data
    of the tensor being saved (``nbytes`` bytes at ``address``), and notes where that went."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes
        self.buf = bytearray()
        self.at = -1  # where the data went; -1: not seen as one write of its own memory

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        if self.at < 0 and mv.nbytes == self.nbytes and address_of(mv) == self.address:
            self.at = len(self.buf)
        else:
            self.buf += mv
        return mv.nbytes

    def flush(self) -> None:
        pass


def _capture(t: torch.Tensor) -> Optional[Tuple[bytes, bytes]]:
    """``(head, tail)`` of :func:`~async_ckpt.compat.torch_save_without_crc` of ``t``: its bytes
    before and after the tensor's data, or ``None`` if the data was not written as one piece."""
    cap = _Capture(t.data_ptr(), t.numel() * t.element_size())
    compat.torch_save_without_crc(t, cap)
    if cap.at < 0:
        return None
    return bytes(cap.buf[:cap.at]), bytes(cap.buf[cap.at:])


class _Spot:
    """A file for ``torch.save`` that passes every write on to ``f`` and notes where the one
    handing over ``nbytes`` bytes at ``address`` (the tensor's data) went."""

    def __init__(self, f: Any, address: int, nbytes: int) -> None:
        self.f, self.address, self.nbytes = f, address, nbytes
        self.size = 0
        self.at = -1

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        n = mv.nbytes
        if self.at < 0 and n == self.nbytes and address_of(mv) == self.address:
            self.at = self.size
        self.f.write(b)
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def save_record(t: torch.Tensor, f: Any) -> int:
    """Write the record of ``t`` to ``f`` as ``torch.save`` writes it (zip CRC-32s off, as the
    templates are; a view as its own bytes, :func:`own_bytes`): the record of a tensor no
    template fits, whichever writer renders it.

    Args:
        t: a CPU tensor (detached).
        f: a file-like object (``write``).

    Returns:
        Where in the record the tensor's data starts, or ``-1`` where it is not plain
        contiguous data written as one piece (a reader then parses the record).
    """
    t = own_bytes(t)
    if not t.is_contiguous():
        compat.torch_save_without_crc(t, f)
        return -1
    spot = _Spot(f, t.data_ptr(), t.numel() * t.element_size())
    compat.torch_save_without_crc(t, spot)
    return spot.at


class RecordBatch:
    """Renders many records of one template at once, into one reused buffer.

    The records' fixed parts are written once per batch buffer and the data of all tensors is
    copied in by one gather (by address, see :mod:`async_ckpt.addresses`): no Python per
    record. The bytes are those of :meth:`RecordTemplate.append_to`, record for record (tests
    compare them).
    """

    def __init__(self, tpl: "RecordTemplate", size: int) -> None:
        import numpy as np

        self.tpl = tpl
        self.size = size
        head, n = len(tpl.head), tpl.nbytes
        self.chunk = np.empty((size, tpl.length), np.uint8)
        self.chunk[:, :head] = np.frombuffer(tpl.head, np.uint8)
        self.chunk[:, head + n:] = np.frombuffer(tpl.tail, np.uint8)
        self.data = torch.from_numpy(self.chunk)[:, head:head + n]  # each record's data/0
        self.flat = memoryview(self.chunk.reshape(-1))  # type: ignore[arg-type, unused-ignore]  # numpy declares the buffer protocol for Python >= 3.12 only

    def render(self, ts: List[torch.Tensor]) -> memoryview:
        """The records of ``ts`` (at most ``size``, each eligible for the template), concatenated."""
        b = len(ts)
        with torch.no_grad():
            gather(torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64), self.tpl.nbytes, self.data[:b])
        return self.flat[: b * self.tpl.length]


class RecordTemplates:
    """Produces the record (``torch.save`` archive) of a contiguous CPU tensor from a template
    per (dtype, shape): see the module docstring.

    Thread-safe. :meth:`template` gives the template of a tensor of any size, or ``None`` when
    the tensor is not eligible (empty, not a plain contiguous CPU tensor, or its template could
    not be made); :meth:`append` copies a record of at most ``max_bytes`` of data into a buffer.
    """

    def __init__(self, max_bytes: int = TEMPLATE_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._templates: Dict[Tuple[torch.dtype, Tuple[int, ...]], Optional[RecordTemplate]] = {}
        self._lock = threading.Lock()

    def template(self, t: torch.Tensor) -> Optional[RecordTemplate]:
        """The checked template for ``t``, or ``None`` when ``t`` must go through ``torch.save``.
        One (dtype, shape) has one template for the life of the process (built once, under the
        lock: every caller gets the same object)."""
        tpl: Union[RecordTemplate, None, Literal[False]] = self._templates.get((t.dtype, t.shape), False)
        if tpl is False:
            if not self._eligible(t):
                return None
            with self._lock:
                tpl = self._templates.get((t.dtype, t.shape), False)
                if tpl is False:
                    tpl = self._templates[(t.dtype, tuple(t.shape))] = self._build(t)
        # The exact strides, not is_contiguous(): that ignores the stride of a size-1 dimension,
        # which torch.save records.
        if tpl is None or type(t) is not torch.Tensor or not t.is_cpu or t.requires_grad \
                or t.layout != torch.strided or t.stride() != tpl.strides or t.is_conj() or t.is_neg():
            return None
        return tpl

    def append(self, out: bytearray, t: torch.Tensor) -> int:
        """Append the record of ``t`` to ``out`` and return its length; ``-1`` (nothing appended)
        when ``t`` is not eligible or holds more than ``max_bytes``."""
        tpl = self.template(t)
        if tpl is None or tpl.nbytes > self.max_bytes:
            return -1
        return tpl.append_to(out, tpl.ctype.from_address(t.data_ptr()))

    def _eligible(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        return 0 < nbytes and type(t) is torch.Tensor and t.layout == torch.strided \
            and t.is_cpu and not t.is_quantized

    def _build(self, t: torch.Tensor) -> Optional[RecordTemplate]:
        """``t``'s template (called under the lock), or ``None`` where torch.save must write it."""
        try:
            # Two tensors of the shape (allocated, never read: no CRC is computed, and the
            # capture skips the data): the template holds only if both give the same bytes
            # around their data, each written as one piece straight from its memory, and a
            # reader takes the record for one of this dtype and shape.
            nbytes = t.numel() * t.element_size()
            # made as bytes: creating a complex32 tensor directly warns that it is experimental
            probe, check = (torch.empty(nbytes, dtype=torch.uint8).view(t.dtype).view(t.shape) for _ in range(2))
            first, second = _capture(probe), _capture(check)
            if first is not None and first == second:
                tpl = RecordTemplate(first[0], first[1], nbytes, probe.stride())
                if tpl.reads_as(t.dtype, tuple(t.shape)):
                    return tpl
        except Exception:  # noqa: BLE001 - an unusual dtype or a changed archive layout: torch.save writes it
            pass
        return None


#: The process's record templates (they depend on torch only): every writer uses these.
RECORDS = RecordTemplates()


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


class _Stop(Exception):
    """Ends :func:`pickle_archive`'s ``torch.save`` once its ``data.pkl`` is made: no storage is written."""


def _untyped(obj: Any) -> torch.UntypedStorage:
    return obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj


def pickle_archive(obj: Any) -> Tuple[bytes, List[torch.UntypedStorage], int]:
    """``obj``'s ``data.pkl`` as ``torch.save`` writes it, and the storages its records hold.

    ``torch.save``'s own code pickles ``obj`` (its pickler and storage ids: the locations,
    storage types and keys of the originals), handed a pickler base that keeps the bytes and
    each storage by key and stops before any data is written. So every tensor is reduced
    exactly as ``torch.save`` reduces it -- class, ``requires_grad``, subclass and attributes,
    views of one storage, conj/neg bits, sparse, quantized, meta -- and whatever ``torch.save``
    refuses is refused here, at the call.

    Args:
        obj: any object ``torch.save`` accepts.

    Returns:
        ``(data, storages, refs)``: the pickle; the untyped storage of record ``data/<i>`` at
        index ``i`` (the originals: copy them before they change); how many references to
        storages the pickle holds (one per tensor with data).

    Raises:
        Exception: what ``torch.save`` raises for ``obj``.
    """
    out: Dict[str, Any] = {"storages": [], "refs": 0}

    class _Capture(pickle.Pickler):
        def __init__(self, file: Any, protocol: Any = None, **kwargs: Any) -> None:
            torch_pid = self.persistent_id  # torch.save's own (its subclass of this class)
            storages: List[torch.UntypedStorage] = out["storages"]

            def persistent_id(o: Any) -> Any:
                pid = torch_pid(o)
                if pid is not None:
                    out["refs"] += 1
                if pid is not None and int(pid[2]) == len(storages):  # a storage met first
                    storages.append(_untyped(o))
                return pid

            self.persistent_id = persistent_id  # type: ignore[method-assign]  # read by __init__
            super().__init__(file, protocol, **kwargs)
            self._file = file

        def dump(self, value: Any) -> None:
            super().dump(value)
            out["data"] = self._file.getvalue()
            raise _Stop

    capture = types.SimpleNamespace(__name__="async_ckpt_capture_pickle", Pickler=_Capture)
    try:
        # torch.save itself: the save's one call of it, at the call, as TorchCheckpointIO makes it
        # (its zip writer only gets the end of an empty archive: the pickler stops first)
        torch.save(obj, io.BytesIO(), pickle_module=capture)
        # torch.save returned without pickling: it was replaced (a test's mock); torch's own
        # pickling, without the name
        compat.torch_save_pickle(obj, capture)
    except _Stop:
        return out["data"], out["storages"], out["refs"]
    raise RuntimeError("torch.save's pickling did not go through the given pickler")  # pragma: no cover


class _ArchivePickler:
    """Stands in for a pickler inside ``torch.save``: ``dump`` writes a :func:`pickle_archive`
    ``data.pkl`` unchanged and hands ``torch.save`` the storages of its records, in key order."""

    def __init__(self, file: Any, protocol: Any = None, **kwargs: Any) -> None:
        self._file = file

    def dump(self, parts: Tuple[bytes, List[torch.UntypedStorage]]) -> None:
        data, storages = parts
        for i, s in enumerate(storages):  # torch.save keys them "0", "1", ... as it meets them
            pid = self.persistent_id(s)  # type: ignore[attr-defined]  # torch.save's subclass has it
            if pid[2] != str(i):
                raise RuntimeError(f"storage {i} was keyed {pid[2]!r} by torch.save")
        self._file.write(data)


_ARCHIVE = types.SimpleNamespace(__name__="async_ckpt_archive_pickle", Pickler=_ArchivePickler)


def save_archive(data: bytes, storages: List[torch.UntypedStorage], f: Any) -> None:
    """Write the ``torch.save`` archive of a :func:`pickle_archive` result to ``f``.

    The file is the one ``torch.save`` writes for the original object: its ``data.pkl`` is
    ``data``, record ``data/<i>`` the bytes of ``storages[i]`` (host copies of the originals,
    each of exactly the original's size).

    Args:
        data: the ``data.pkl`` bytes.
        storages: the storages' host copies, by record index.
        f: a writable binary file object or a path.
    """
    compat.torch_save_file((data, storages), f, _ARCHIVE)


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


def _member_start(get: Callable[[int, int], bytes], info: zipfile.ZipInfo) -> int:
    """Where a stored member's data starts in the record (``ValueError`` if no header is there)."""
    off = info.header_offset
    start = member_data_offset(get(off, off + LOCAL_HEADER_BYTES))
    if start is None:
        raise ValueError("no local header where the zip directory says")
    return off + start


def _member(get: Callable[[int, int], bytes], info: zipfile.ZipInfo) -> bytes:
    """A stored member's bytes, read where its header says, with no zip CRC-32 check: records
    are written without them (see the module docstring); the manifest's CRC-32C covers them."""
    start = _member_start(get, info)
    return get(start, start + info.file_size)


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
            if order and (order[0].compress_type != zipfile.ZIP_STORED or _member(get, order[0]) != b"little"):
                return None
            desc = TensorDescUnpickler(io.BytesIO(_member(get, pkl[0]))).load()
            if desc != (dtype, 0, tuple(shape), _contiguous_strides(tuple(shape))):
                return None
            start = _member_start(get, data[0])
            if start + nbytes > length:
                return None
            return start
    except (zipfile.BadZipFile, ValueError, struct.error, pickle.UnpicklingError, EOFError, TypeError,
            AttributeError, IndexError, KeyError, NotImplementedError, OSError):
        return None


def _slice(mv: memoryview, lo: int, hi: int) -> bytes:
    return bytes(mv[lo:hi])


class Heads:
    """The bytes before the data, and the record's length, per (dtype, shape) of a small
    tensor, as async_ckpt writes a record (no zip CRC-32s) and as ``torch.save`` does with its
    default options (DCP's own writer, older checkpoints): a record that starts with either
    has its data right after."""

    def __init__(self) -> None:
        self._cache: Dict[Tuple[torch.dtype, Tuple[int, ...]], Tuple[Tuple[bytes, int], ...]] = {}
        self._lock = threading.Lock()

    def get(self, dtype: torch.dtype, shape: Tuple[int, ...]) -> Tuple[Tuple[bytes, int], ...]:
        """The ``(bytes before the data, record length)`` of each way a contiguous tensor of
        ``dtype`` and ``shape`` is written (none where :func:`data_start` does not parse it)."""
        key = (dtype, shape)
        got = self._cache.get(key)
        if got is not None:
            return got
        found: List[Tuple[bytes, int]] = []
        n = 1
        for d in shape:
            n *= d
        for save in (compat.torch_save_without_crc, torch.save):
            try:
                buf = io.BytesIO()
                # zeros made as bytes: creating a complex32 tensor directly warns that it is experimental
                save(torch.zeros(n * dtype.itemsize, dtype=torch.uint8).view(dtype).view(shape), buf)
                raw = buf.getvalue()
                start = data_start(functools.partial(_slice, memoryview(raw)), len(raw), dtype, shape)
            except Exception:  # noqa: BLE001 - a dtype torch cannot save: such records are parsed
                continue
            if start is not None and (raw[:start], len(raw)) not in found:
                found.append((raw[:start], len(raw)))
        with self._lock:
            self._cache[key] = tuple(found)
        return self._cache[key]


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
    for head, length in HEADS.get(dtype, shape):
        if length == len(item) and item[:len(head)] == head:
            return len(head)
    return data_start(lambda a, b: bytes(item[a:b]), len(item), dtype, shape)


# ---- a tensor record's data into its target -------------------------------------------------------

def stored_bytes(item: memoryview, req: Any, target: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The copy that puts a ``torch.save``-serialised tensor's raw data into its target.

    The data sits in the file wherever the records before it ended, so its address need not
    be a multiple of the dtype's size, and kernels for wide dtypes (complex128) may fault on
    a misaligned source. ``src`` is therefore the data viewed as ``target``'s dtype only where
    it is aligned; otherwise it stays bytes (see :func:`aligned_copy`).

    Args:
        item: the record's bytes, straight from the read buffer.
        req: the read item (its ``storage_offsets`` and ``lengths``).
        target: the tensor the item goes into.

    Returns:
        ``(dst, src)``: copying ``src`` into ``dst`` fills ``target``; ``None`` unless the item
        is the plain case (one little-endian, uncompressed storage of exactly ``target``'s size
        and shape, read whole, see :func:`~async_ckpt.format.torch_record.plain_data_start`),
        where ``torch.load`` is used.
    """
    nbytes = target.numel() * target.element_size()
    if nbytes == 0 or any(req.storage_offsets) or list(req.lengths) != list(target.size()):
        return None
    start = plain_data_start(item, target.dtype, tuple(target.shape))
    if start is None:
        return None
    with warnings.catch_warnings():  # a read-only buffer (bytes) is fine: it is only copied from
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(item, dtype=torch.uint8, count=nbytes, offset=start)
    return aligned_copy(raw, target)


def aligned_copy(raw: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(dst, src)`` that copy the bytes ``raw`` (flat uint8, ``target``'s size) into ``target``
    without ever reading ``raw`` as a wider type at an address that type is not aligned to.

    Aligned: ``raw`` viewed as ``target``'s dtype and shape. Misaligned, into a contiguous CPU
    or CUDA target without a conjugate or negative bit: ``target``'s bytes (a uint8 view) take
    ``raw`` as bytes (still one copy). Otherwise ``raw`` is first copied into a fresh (aligned)
    buffer, which is then viewed as ``target``'s dtype.
    """
    itemsize = target.element_size()
    if raw.data_ptr() % itemsize == 0:
        return target, raw.view(target.dtype).view(target.shape)
    if target.device.type in ("cpu", "cuda") and target.layout == torch.strided and target.is_contiguous() \
            and not target.is_conj() and not target.is_neg() and not target.is_quantized:
        # as_strided, not view(-1): a one-element target may have any stride (w[:, 0] of a (1, N) matrix)
        return target.as_strided((target.numel(),), (1,)).view(torch.uint8), raw
    return target, raw.clone().view(target.dtype).view(target.shape)
