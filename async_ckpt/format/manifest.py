"""The JSON manifest of a step and its commit marker. No pickle in our own metadata.

Each file of a step is listed with its size and CRC-32C. A data file the writer also knows the
records of (the ``torch.save`` items DCP's ``.metadata`` places in it, one after another from
byte 0) lists them in ``"records"``: a base64 string of one little-endian ``(uint64 length,
uint32 crc32c)`` pair per record, in file order, so that a reader may fetch and check only the
records it needs. A file without ``"records"`` is read and checked whole.

A data file may also list, in ``"data_at"``, where the raw data of its large tensor records
begins: a base64 string of one little-endian ``(uint64 record offset in the file, uint32 data
offset in the record)`` pair per such record, so that a reader can read the data straight into
a tensor without first parsing the record's zip directory. A file without it (older manifests,
plain DCP checkpoints) is read the same way after those probes.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import CorruptCheckpointError, InvalidArgumentError
from .crc import crc32c

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MARKER_NAME = "COMMITTED"
PENDING_NAME = ".async_ckpt_pending"  # in an unmarked <step>/ that async_ckpt is writing or deleting
#: where a manifest's ``"extra"`` holds the user metadata of the save (``save(..., metadata=)``), JSON
USER_METADATA_KEY = "user_metadata"


def shown(text: Any) -> str:
    """``text`` as it may go into a message: unchanged when printable, else ``repr``-escaped
    (a name taken from a checkpoint may hold terminal escape codes or newlines)."""
    text = str(text)
    return text if text.isprintable() else repr(text)


def check_file_name(name: Any, *, where: str, step: Optional[int] = None) -> str:
    """Raise :class:`CorruptCheckpointError` unless ``name`` is a plain file name: one path
    component, not ``.``/``..``, without separators, NUL or other unprintable characters.

    Every file of a step lies directly in its step directory, so a name from a manifest or
    from DCP's ``.metadata`` that is anything else (``../x``, ``/etc/passwd``, ``a/b``) would
    reach outside it. ``where`` is the file that holds the name.
    """
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or not name.isprintable()):
        raise CorruptCheckpointError(
            f"{where}: names the file {shown(name)}, which is not a plain file name inside the step "
            "directory; refusing to read it", step=step, path=where)
    return name


_RECORD = struct.Struct("<QI")  # one record in a manifest's "records": length, crc32c
_HASH = struct.Struct("<Q16s")  # one record in a manifest's "hashes": record offset, XXH3-128 (little-endian)
_DATA_AT = struct.Struct("<QI")  # one record in a manifest's "data_at": record offset, data offset in it


@dataclass
class FileRecord:
    """A file of a step: its size and CRC-32C; ``records``: the ``(length, crc32c)`` of each of
    its records in file order, covering it from byte 0 to ``size``, where the writer recorded
    them (``None``: the file is checked whole); ``data_at``: for records whose tensor data
    the writer placed, record offset in the file -> offset of the data in the record (``None``:
    not recorded); ``ref``: for a file an incremental save took from an earlier step (a hard
    link, or a server-side copy on object stores), ``"<step>/<name>"`` of the file that first
    held its bytes (``None``: this step wrote it); ``hashes``: incremental saves, record offset
    -> XXH3-128 of the tensor bytes of the record there (so that a new manager's first save can
    compare with this step; ``None``: not recorded); ``carried``: for a taken file, how many
    saves in a row have taken it since the save that wrote it (``full_every`` counts with it;
    ``None``: 0, or not recorded); ``unused_records``: the file holds records this step's
    ``.metadata`` does not place (a taken file, whose stale records come along, or a copy of
    one: ``promote``); implied by ``ref``."""

    size: int
    crc32c: int
    records: Optional[Tuple[Tuple[int, int], ...]] = None
    data_at: Optional[Dict[int, int]] = None
    ref: Optional[str] = None
    hashes: Optional[Dict[int, int]] = None
    carried: Optional[int] = None
    unused_records: bool = False

    @property
    def may_hold_unused(self) -> bool:
        """Whether the file may hold records this step does not use (taken, or a copy of a
        taken file): its records may end before its size."""
        return self.ref is not None or self.unused_records

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"size": self.size, "crc32c": self.crc32c}
        if self.records is not None:
            d["records"] = base64.b64encode(b"".join(_RECORD.pack(n, c) for n, c in self.records)).decode()
        if self.data_at:
            d["data_at"] = base64.b64encode(b"".join(_DATA_AT.pack(a, h) for a, h in self.data_at.items())).decode()
        if self.ref is not None:
            d["ref"] = self.ref
        if self.carried:
            d["carried"] = self.carried
        if self.unused_records:
            d["unused_records"] = True
        if self.hashes:
            d["hashes"] = base64.b64encode(b"".join(_HASH.pack(a, h.to_bytes(16, "little"))
                                                    for a, h in sorted(self.hashes.items()))).decode()
        return d

    @staticmethod
    def from_dict(d: Dict[str, Any], *, name: str, where: str) -> "FileRecord":
        """The record of the manifest ``where``'s entry for the file ``name``; a ``"records"`` that is not valid base64 of whole
        pairs, or whose lengths do not add up to ``size``, is a :class:`CorruptCheckpointError`."""
        if not isinstance(d, dict):
            raise CorruptCheckpointError(f"{where}: {shown(name)}: its entry is {type(d).__name__}, not an object",
                                         path=where)
        size: Any = d.get("size")
        crc: Any = d.get("crc32c")
        if not _whole(size) or size >= 2**63:
            raise CorruptCheckpointError(f"{where}: {shown(name)}: size {shown(size)} is not a byte count",
                                         path=where)
        if not _whole(crc) or crc > 0xFFFFFFFF:
            raise CorruptCheckpointError(f"{where}: {shown(name)}: crc32c {shown(crc)} is not a 32-bit checksum",
                                         path=where)
        rec = FileRecord(size, crc)
        ref = d.get("ref")
        if ref is not None:
            if not isinstance(ref, str) or not _REF.fullmatch(ref):
                raise CorruptCheckpointError(f"{where}: {shown(name)}: ref {shown(json.dumps(ref)[:80])} is not "
                                             "\"<step>/<file name>\"", path=where)
            rec.ref = ref
        carried = d.get("carried")
        if carried is not None:
            if not _whole(carried):
                raise CorruptCheckpointError(f"{where}: {shown(name)}: carried {shown(json.dumps(carried)[:80])} is "
                                             "not a count of saves", path=where)
            rec.carried = carried
        unused = d.get("unused_records", False)
        if type(unused) is not bool:
            raise CorruptCheckpointError(f"{where}: {shown(name)}: unused_records {shown(json.dumps(unused)[:80])} "
                                         "is not true or false", path=where)
        rec.unused_records = unused
        if d.get("data_at") is not None:
            rec.data_at = _data_at(d["data_at"], rec.size, name=name, where=where)
        if d.get("hashes") is not None:
            what = f"{where}: {shown(name)}: the record hashes"
            hashes = {a: int.from_bytes(h, "little") for a, h in _HASH.iter_unpack(_packed(d["hashes"], _HASH, what,
                                                                                           where))}
            if any(a >= rec.size for a in hashes):
                raise CorruptCheckpointError(f"{what} place a record beyond its size {rec.size}", path=where)
            rec.hashes = hashes
        raw = d.get("records")
        if raw is None:
            return rec
        records = tuple(_RECORD.iter_unpack(_packed(raw, _RECORD, f"{where}: {shown(name)}: the record list", where)))
        if sum(n for n, _ in records) != rec.size:
            raise CorruptCheckpointError(f"{where}: {shown(name)}: its records add up to "
                                         f"{sum(n for n, _ in records)} bytes, but its size is {rec.size}", path=where)
        rec.records = records
        return rec


def _whole(x: Any) -> bool:
    """A non-negative JSON integer (not a bool, not a float)."""
    return type(x) is int and x >= 0


def _number(x: Any) -> bool:
    return type(x) in (int, float)


def _finite(x: Any) -> bool:
    return _number(x) and math.isfinite(x)


def _int_keys(v: Any) -> bool:
    """A manifest's ``extra["int_keys"]``: dotted key paths whose last part was an int key."""
    return isinstance(v, list) and all(isinstance(k, str) and _INT_KEY.fullmatch(k.rsplit(".", 1)[-1]) for k in v)


_INT_KEY = re.compile(r"-?[0-9]+")
_REF = re.compile(r"[0-9]+/[^/\\\x00-\x1f\x7f]+")  # "<step>/<file name>"


def _packed(raw: Any, layout: struct.Struct, what: str, where: str) -> bytes:
    """The bytes of a base64 field of packed ``layout`` entries; malformed (not a string, not
    base64, not whole entries): :class:`CorruptCheckpointError` saying ``what`` "is malformed"."""
    try:
        data = base64.b64decode(raw, validate=True) if isinstance(raw, str) else None
    except binascii.Error:
        data = None
    if data is None or len(data) % layout.size:
        raise CorruptCheckpointError(f"{what} is malformed", path=where)
    return data


def _data_at(raw: Any, size: int, *, name: str, where: str) -> Dict[int, int]:
    """A ``"data_at"`` entry decoded; malformed (not base64 of whole pairs, or a place outside
    the file's ``size`` bytes): :class:`CorruptCheckpointError`."""
    out = dict(_DATA_AT.iter_unpack(_packed(raw, _DATA_AT, f"{where}: {shown(name)}: the data offsets", where)))
    for at, head in out.items():
        if at + head > size:
            raise CorruptCheckpointError(f"{where}: {shown(name)}: a data offset ({at} + {head}) lies beyond its "
                                         f"size {size}", path=where)
    return out


#: where a manifest stores each field of its :class:`CopyIdentity` (in ``"extra"``, as ever)
_IDENTITY_KEYS = {"save_id": "save_id", "tier": "tier", "rank": "rank", "world_size": "world_size",
                  "home": "persistent_root"}


@dataclass(frozen=True)
class CopyIdentity:
    """Which save wrote a copy of a step, and whose copy it is.

    Stored in the manifest's ``"extra"`` object under the keys ``save_id``, ``tier``, ``rank``,
    ``world_size`` and ``persistent_root`` (the format async_ckpt has always written);
    :func:`copy_identity` reads them, in this one place.

    Attributes:
        save_id: the save that wrote the copy (a save due for both tiers writes one id into
            both copies, the same on every rank); None: not recorded.
        tier: ``"local"`` for a local tier's copy; None for the persistent root's.
        rank: a local copy: the rank whose shards it holds.
        world_size: a local copy: the ranks of the job that saved it (``Manifest.world_size``
            counts the ranks that wrote this copy's files).
        home: a local copy: the persistent root (``root_identity``) it was saved for.
    """

    save_id: Optional[str] = None
    tier: Optional[str] = None
    rank: Optional[int] = None
    world_size: Optional[int] = None
    home: Optional[str] = None

    def to_extra(self) -> Dict[str, Any]:
        """The entries of a manifest's ``"extra"`` that store it (none for a field that is None)."""
        return {key: getattr(self, name) for name, key in _IDENTITY_KEYS.items() if getattr(self, name) is not None}

    def same_save(self, other: "CopyIdentity") -> bool:
        """Whether both copies were written by one save: both carry a save id, the same."""
        return self.save_id is not None and self.save_id == other.save_id

    def saved_for_another(self, home: Optional[str]) -> Optional[str]:
        """The persistent root a local copy was saved for, when that is not ``home`` (this
        job's root); None for this job's copies, for copies saved before the root was
        recorded, and when ``home`` is None."""
        if home is None or self.home is None or self.home == home:
            return None
        return self.home

    def is_rank(self, rank: int, world_size: int) -> bool:
        """Whether the copy holds the shards of ``rank`` of a job of ``world_size`` ranks (a copy
        that records neither is one process's: rank 0 of 1)."""
        return (self.rank if self.rank is not None else 0, self.world_size or 1) == (rank, world_size)


def copy_identity(extra: Mapping[str, Any], *, where: str = "manifest") -> CopyIdentity:
    """The :class:`CopyIdentity` a manifest's ``"extra"`` records (a record's
    ``CheckpointInfo.extra`` too).

    Args:
        extra: the manifest's ``"extra"`` object.
        where: the manifest, for messages.

    Returns:
        The identity (fields not recorded are None).

    Raises:
        CorruptCheckpointError: a field of another type (a save id, tier or root that is not a
            string, a rank that is not an integer >= 0, a world size that is not one >= 1).
    """
    got = {name: extra.get(key) for name, key in _IDENTITY_KEYS.items()}
    for name in ("save_id", "tier", "home"):
        if got[name] is not None and not isinstance(got[name], str):
            raise CorruptCheckpointError(f"{where}: not a valid async_ckpt manifest: \"{_IDENTITY_KEYS[name]}\" is "
                                         f"{shown(json.dumps(got[name])[:80])}, not a string", path=where)
    for name, least in (("rank", 0), ("world_size", 1)):
        v = got[name]
        if v is not None and not (_whole(v) and v >= least):
            raise CorruptCheckpointError(f"{where}: not a valid async_ckpt manifest: \"{name}\" is "
                                         f"{shown(json.dumps(v)[:80])}, not an integer >= {least}", path=where)
    return CopyIdentity(**got)


@dataclass
class Manifest:
    """What a committed step holds. Written after the data, before the commit marker.

    ``identity`` says which save wrote this copy and whose it is (:class:`CopyIdentity`); ``extra``
    holds the other entries of the JSON ``"extra"`` object (``int_keys``, ``diverged_keys``,
    the job's retention).
    """

    step: int
    commit_time: float
    files: Dict[str, FileRecord]
    metrics: Dict[str, float] = field(default_factory=dict)
    nbytes: int = 0
    num_tensors: int = 0
    world_size: int = 1
    format_version: int = FORMAT_VERSION
    extra: Dict[str, Any] = field(default_factory=dict)
    identity: CopyIdentity = field(default_factory=CopyIdentity)

    @property
    def whole(self) -> bool:
        """Whether this copy holds every element of every tensor: ``False`` for one rank's share
        of a several-rank save (a local tier's copy, saved by a job of more than one rank);
        restore and ``verify`` then do not require its chunks to cover each tensor."""
        return (self.identity.world_size or 1) <= 1

    @property
    def int_keys(self) -> List[str]:
        """Dotted key paths whose last key was an int when saved (``extra["int_keys"]``)."""
        return list(self.extra.get("int_keys", ()))

    def all_extra(self) -> Dict[str, Any]:
        """The JSON ``"extra"`` object as stored: :attr:`extra` and the copy's identity."""
        return {**self.extra, **self.identity.to_extra()}

    @property
    def written_bytes(self) -> int:
        """Bytes of the files this step wrote (its data files that are not :attr:`referred_bytes`, and its metadata)."""
        return sum(r.size for r in self.files.values() if r.ref is None)

    @property
    def referred_bytes(self) -> int:
        """Bytes of the files an incremental save took from earlier steps (``FileRecord.ref``):
        stored once for every step that holds them on POSIX paths (hard links)."""
        return sum(r.size for r in self.files.values() if r.ref is not None)

    def to_json(self) -> bytes:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "identity"}  # not asdict: deep copies
        d["files"] = {k: v.to_dict() for k, v in self.files.items()}
        d["extra"] = self.all_extra()
        return json.dumps(d, indent=1, sort_keys=True, allow_nan=True).encode()

    @staticmethod
    def from_json(data: bytes, *, where: str = "manifest") -> "Manifest":
        """Parse and check a manifest: every field of its type and in its range (a step and
        counts are non-negative integers, ``world_size`` at least 1, ``commit_time`` a finite
        number, metrics numbers, ``extra`` an object, every file a plain name with a byte count
        and a 32-bit CRC), so that no reader meets a value it cannot use.

        Args:
            data: the manifest's bytes.
            where: the manifest's path, for messages.

        Returns:
            The manifest.

        Raises:
            CorruptCheckpointError: not valid JSON, a field missing, of another type or out
                of range (named), or a format newer than this async_ckpt.
        """
        try:
            d = json.loads(data)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{where}: not a valid async_ckpt manifest ({shown(exc)})",
                                         path=where) from exc
        if not isinstance(d, dict) or not isinstance(d.get("files"), dict):
            raise CorruptCheckpointError(f"{where}: not a valid async_ckpt manifest (no \"files\" object)",
                                         path=where)

        def field_of(key: str, default: Any, ok: Any, what: str) -> Any:
            value = d.get(key, default)
            if not ok(value):
                raise CorruptCheckpointError(f"{where}: not a valid async_ckpt manifest: \"{key}\" is "
                                             f"{shown(json.dumps(value)[:80])}, not {what}", path=where)
            return value

        version = field_of("format_version", FORMAT_VERSION, lambda v: _whole(v) and v >= 1, "a positive integer")
        if version > FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{where}: format version {version} is newer than this async_ckpt understands "
                f"({FORMAT_VERSION}); upgrade async_ckpt", path=where
            )
        step = field_of("step", None, _whole, "a non-negative integer")
        commit_time = field_of("commit_time", None, _finite, "a finite number")
        metrics = field_of("metrics", {}, lambda v: v is None or (isinstance(v, dict) and all(
            _number(x) and not math.isnan(x) for x in v.values())), "an object of numbers")
        nbytes = field_of("nbytes", 0, _whole, "a non-negative integer")
        num_tensors = field_of("num_tensors", 0, _whole, "a non-negative integer")
        world_size = field_of("world_size", 1, lambda v: _whole(v) and v >= 1, "a positive integer")
        extra = field_of("extra", {}, lambda v: v is None or (isinstance(v, dict) and _int_keys(v.get("int_keys", []))),
                         "an object (whose \"int_keys\" lists key paths that end in an integer)")
        for name in d["files"]:
            check_file_name(name, where=where)
        extra = dict(extra or {})
        identity = copy_identity(extra, where=where)
        for key in _IDENTITY_KEYS.values():
            extra.pop(key, None)
        return Manifest(
            step=step,
            commit_time=float(commit_time),
            files={k: FileRecord.from_dict(v, name=k, where=where) for k, v in d["files"].items()},
            metrics={k: float(v) for k, v in (metrics or {}).items()},
            nbytes=nbytes,
            num_tensors=num_tensors,
            world_size=world_size,
            format_version=version,
            extra=extra,
            identity=identity,
        )


def check_metrics(metrics: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """Validate ``metrics=``: a mapping of names to real numbers."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise InvalidArgumentError(f"metrics must be a dict of str -> float, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise InvalidArgumentError(f"metrics keys must be strings, got {k!r}")
        try:
            fv = float(v)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"metrics[{k!r}] must be a number, got {type(v).__name__}") from None
        if math.isnan(fv):
            raise InvalidArgumentError(f"metrics[{k!r}] is NaN, which cannot be ranked; nothing was saved. Leave it "
                                       f"out of metrics= (or save without metrics) for this step")
        out[k] = fv
    return out


def reduce_metrics(per_rank: Sequence[Dict[str, float]], how: str) -> Dict[str, float]:
    """The metrics a step records from every rank's ``metrics=``.

    Args:
        per_rank: each rank's validated metrics, by rank.
        how: ``"rank0"`` (rank 0's, as given), or ``"mean"``, ``"min"``, ``"max"`` of each
            name over the ranks that gave it (a name only some ranks give is reduced over those).

    Returns:
        Name -> value.
    """
    if how == "rank0" or not per_rank:
        return dict(per_rank[0]) if per_rank else {}
    names = sorted({k for m in per_rank for k in m})
    out: Dict[str, float] = {}
    for k in names:
        values = [m[k] for m in per_rank if k in m]
        out[k] = sum(values) / len(values) if how == "mean" else (min(values) if how == "min" else max(values))
    return out


def marker_bytes(step: int, manifest: bytes) -> bytes:
    return json.dumps(
        {"format_version": FORMAT_VERSION, "step": step, "manifest_size": len(manifest),
         "manifest_crc32c": crc32c(manifest)}, sort_keys=True
    ).encode()


def check_marker(marker: bytes, manifest: bytes, *, where: str, step: Optional[int] = None) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``marker`` vouches for exactly ``manifest``.

    ``where`` is the step directory; errors name the file at fault inside it.
    """
    mpath, kpath = f"{where}/{MANIFEST_NAME}", f"{where}/{MARKER_NAME}"
    try:
        d = json.loads(marker)
        size, crc = int(d["manifest_size"]), int(d["manifest_crc32c"])
        marked_step = d.get("step")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{kpath}: commit marker is unreadable ({exc})", step=step,
                                     path=kpath) from exc
    if step is not None and marked_step is not None and marked_step != step:
        raise CorruptCheckpointError(f"{kpath}: commit marker is for step {marked_step}, not {step}", step=step,
                                     path=kpath)
    if size != len(manifest) or crc != crc32c(manifest):
        raise CorruptCheckpointError(
            f"{mpath}: manifest does not match its commit marker (size {len(manifest)} vs {size}, "
            f"crc32c {crc32c(manifest):#010x} vs {crc:#010x})", step=step, path=mpath
        )
