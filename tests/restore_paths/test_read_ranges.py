"""Per-record CRCs: the DCP writer lists each item's length and CRC-32C in the manifest, and the
reader then fetches and checks only the records a load plan touches (the multi-process restore
path; tests/ranks/test_distributed.py runs it with 2 ranks)."""

from __future__ import annotations

import base64
import os

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from async_ckpt import CorruptCheckpointError
from async_ckpt.format.crc import crc32c
from async_ckpt.format.dcp_layout import METADATA_NAME
from async_ckpt.format.manifest import FileRecord, Manifest
from async_ckpt.format.unpickling import load_metadata
from async_ckpt.io import load_state_dict, save_state_dict, write
from async_ckpt.storage import Storage

from ..conftest import assert_bitwise_equal


class CountingStorage(Storage):
    """A :class:`Storage` that counts the bytes read from each file and the read requests."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.bytes: dict = {}
        self.requests: dict = {}

    def _add(self, path: str, n: int) -> None:
        name = os.path.basename(path)
        self.bytes[name] = self.bytes.get(name, 0) + n
        self.requests[name] = self.requests.get(name, 0) + 1

    def read_bytes(self, path):
        data = super().read_bytes(path)
        self._add(path, len(data))
        return data

    def read_into(self, path, start, out):
        got = super().read_into(path, start, out)
        self._add(path, min(got, len(out)))
        return got

    def open_ranges(self, path):
        ranges = super().open_ranges(path)
        real = ranges.read_into

        def counted(start, out):
            got = real(start, out)
            self._add(path, min(got, len(out)))
            return got

        ranges.read_into = counted
        return ranges

    def data_bytes(self) -> dict:
        return {n: c for n, c in self.bytes.items() if n.endswith(".distcp")}


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "small": {f"s{i}": torch.randn(64, generator=g) for i in range(40)},  # a batched template run
        "few": [torch.randn(3, generator=g), torch.randn(5, generator=g)],  # single templated records
        "big": torch.randn(3 * 2**20 // 4 + 7, generator=g),  # torch.save, checksummed once and combined
        "mid": torch.randn(200000, generator=g).half(),
        "view": torch.randn(100, 500, generator=g)[:, 1:],  # not contiguous: torch.save of a clone
        "obj": {"step": 3, "name": "x" * 100000},  # pickled objects
    }


def _zeros(tree):
    if isinstance(tree, dict):
        return {k: _zeros(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_zeros(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return torch.zeros(tree.shape, dtype=tree.dtype)
    return {int: 0, str: ""}.get(type(tree), tree)


def _save(tmp_path, monkeypatch, sd=None):
    """Save through DCP's planner (what every multi-process save runs), several files."""
    monkeypatch.setattr(write, "MIN_FILE_BYTES", 2**20)
    path = str(tmp_path / "ck")
    storage = Storage(path)
    storage.makedirs(path)
    sd = _state() if sd is None else sd
    files = save_state_dict(storage, path, sd, planner=DefaultSavePlanner(), threads=3)
    with open(os.path.join(path, METADATA_NAME), "rb") as f:
        md = load_metadata(f.read())
    return path, sd, files, md


def _items(md, name):
    return sorted((i.offset, i.length, idx.fqn) for idx, i in md.storage_data.items() if i.relative_path == name)


def test_writer_lists_every_item_with_its_crc(tmp_path, monkeypatch):
    path, _, files, md = _save(tmp_path, monkeypatch)
    data_files = [n for n in files if n != METADATA_NAME]
    assert len(data_files) == 3
    assert files[METADATA_NAME].records is None
    for name in data_files:
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        rec = files[name]
        assert (rec.size, rec.crc32c) == (len(data), crc32c(data))
        items = _items(md, name)
        assert rec.records is not None and [n for n, _ in rec.records] == [n for _, n, _ in items]
        for (offset, length, fqn), (_, crc) in zip(items, rec.records):
            assert crc == crc32c(data[offset:offset + length]), fqn


def test_manifest_keeps_records_and_reads_old_and_bad_entries(tmp_path, monkeypatch):
    _, _, files, _ = _save(tmp_path, monkeypatch)
    m = Manifest(step=1, commit_time=1.0, files=files)
    back = Manifest.from_json(m.to_json())
    assert back.files == files
    # A manifest without records (older writers, the single-process save) reads as before.
    old = Manifest(step=1, commit_time=1.0, files={"a.distcp": FileRecord(10, 5)}).to_json()
    assert b"records" not in old
    assert Manifest.from_json(old).files["a.distcp"] == FileRecord(10, 5, None)
    for bad in ("not base64!", base64.b64encode(b"\0" * 11).decode(),
                base64.b64encode((9).to_bytes(8, "little") + (1).to_bytes(4, "little")).decode()):
        text = old.replace(b'"size": 10', b'"records": "' + bad.encode() + b'", "size": 10')
        with pytest.raises(CorruptCheckpointError, match="a.distcp"):
            Manifest.from_json(text, where="x/manifest.json")


def test_a_partial_load_reads_only_the_records_it_needs(tmp_path, monkeypatch):
    path, sd, files, md = _save(tmp_path, monkeypatch)
    storage = CountingStorage(path)
    part = {"big": torch.zeros_like(sd["big"]), "small": {"s3": torch.zeros(64), "s4": torch.zeros(64)},
            "obj": {"step": 0}}
    load_state_dict(storage, path, part, files=files, strict=False)
    assert_bitwise_equal(part, {"big": sd["big"], "small": {"s3": sd["small"]["s3"], "s4": sd["small"]["s4"]},
                                "obj": {"step": 3}})
    wanted = {"big", "small.s3", "small.s4", "obj.step"}
    need: dict = {}
    for idx, info in md.storage_data.items():
        if idx.fqn in wanted:
            need[info.relative_path] = need.get(info.relative_path, 0) + info.length
    assert storage.data_bytes() == need
    assert sum(need.values()) < sum(files[n].size for n in need)


def test_adjacent_records_are_one_request(tmp_path, monkeypatch):
    sd = {f"p{i}": torch.full((16,), float(i)) for i in range(100)}
    path, sd, files, md = _save(tmp_path, monkeypatch, sd)
    (name,) = [n for n in files if n != METADATA_NAME]
    items = _items(md, name)
    run = [fqn for _, _, fqn in items[10:20]]  # ten adjacent records
    part = {k: torch.zeros(16) for k in run + [items[50][2]]}
    storage = CountingStorage(path)
    load_state_dict(storage, path, part, files=files, strict=False)
    assert_bitwise_equal(part, {k: sd[k] for k in part})
    assert storage.requests[name] == 2  # the run, and the record apart from it
    assert storage.bytes[name] == sum(n for _, n, _ in items[10:20]) + items[50][1]


def test_a_manifest_without_records_reads_whole_files(tmp_path, monkeypatch):
    path, sd, files, _ = _save(tmp_path, monkeypatch)
    old = {n: FileRecord(r.size, r.crc32c) for n, r in files.items()}
    storage = CountingStorage(path)
    part = {"big": torch.zeros_like(sd["big"])}
    load_state_dict(storage, path, part, files=old, strict=False)
    assert torch.equal(part["big"], sd["big"])
    assert list(storage.data_bytes().values()) == [old[n].size for n in storage.data_bytes()]


def _flip(path, name, at):
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_flipped_byte_in_a_needed_record_fails_before_any_write(tmp_path, monkeypatch):
    path, sd, files, md = _save(tmp_path, monkeypatch)
    big = next(i for idx, i in md.storage_data.items() if idx.fqn == "big")
    _flip(path, big.relative_path, big.offset + big.length - 10)
    storage = CountingStorage(path)
    # Not needed by this load: not read, so the load succeeds.
    part = {"mid": torch.zeros_like(sd["mid"])}
    load_state_dict(storage, path, part, files=files, strict=False)
    assert_bitwise_equal(part, {"mid": sd["mid"]})
    # Needed: caught, naming the file and the record, and nothing is written.
    target = _zeros(sd)
    with pytest.raises(CorruptCheckpointError, match=f"{big.relative_path}: checksum mismatch in the record at bytes "
                                                     f"{big.offset}-{big.offset + big.length}"):
        load_state_dict(storage, path, target, files=files)
    assert_bitwise_equal(target, _zeros(sd))


def test_a_short_file_is_caught(tmp_path, monkeypatch):
    path, sd, files, md = _save(tmp_path, monkeypatch)
    big = next(i for idx, i in md.storage_data.items() if idx.fqn == "big")
    with open(os.path.join(path, big.relative_path), "r+b") as f:
        f.truncate(files[big.relative_path].size - 1)
    with pytest.raises(CorruptCheckpointError, match="size is"):
        load_state_dict(Storage(path), path, {"big": torch.zeros_like(sd["big"])}, files=files, strict=False)


def test_a_full_load_reads_every_record_once_bitwise(tmp_path, monkeypatch):
    path, sd, files, _ = _save(tmp_path, monkeypatch)
    storage = CountingStorage(path)
    target = _zeros(sd)
    load_state_dict(storage, path, target, files=files)
    assert_bitwise_equal(target, sd)
    assert storage.data_bytes() == {n: r.size for n, r in files.items() if n != METADATA_NAME}


def test_remote_storage_reads_only_the_needed_records(monkeypatch):
    """fsspec's memory:// (ranged requests, the file's size unknown until read): the same."""
    import random

    monkeypatch.setattr(write, "MIN_FILE_BYTES", 2**20)
    url = f"memory://read-ranges-{random.getrandbits(32):x}"
    sd = _state()
    files = save_state_dict(Storage(url), url, sd, planner=DefaultSavePlanner(), threads=3)
    storage = CountingStorage(url)
    with storage.open_ranges(f"{url}/{METADATA_NAME}") as r:
        assert r.known_size is None
    md = load_metadata(storage.read_bytes(f"{url}/{METADATA_NAME}"))
    part = {"mid": torch.zeros_like(sd["mid"]), "few": [torch.zeros(3), torch.zeros(5)]}
    storage.bytes.clear()
    load_state_dict(storage, url, part, files=files, strict=False)
    assert_bitwise_equal(part, {"mid": sd["mid"], "few": sd["few"]})
    need: dict = {}
    for idx, info in md.storage_data.items():
        if idx.fqn in ("mid", "few.0", "few.1"):
            need[info.relative_path] = need.get(info.relative_path, 0) + info.length
    assert storage.data_bytes() == need
