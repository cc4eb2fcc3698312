"""The one verified read: every engine and sink gives the plain path's bytes, and a flipped byte
gives every engine the same :class:`CorruptCheckpointError` wording."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from async_ckpt import CorruptCheckpointError
from async_ckpt.format.dcp_layout import METADATA_NAME
from async_ckpt.format.manifest import FileRecord
from async_ckpt.format.unpickling import load_metadata
from async_ckpt.io import load_state_dict, save_state_dict
from async_ckpt.io.read_exec import read_files
from async_ckpt.io.sinks import FRESH, NULL, IntoBuffers
from async_ckpt.io.step_io import read_step
from async_ckpt.options import RestoreOptions
from async_ckpt.storage import Storage

from ..conftest import assert_bitwise_equal


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(512, 1024, generator=g),  # 2 MiB: read straight into its target
        "small": {f"s{i}": torch.randn(16, generator=g) for i in range(40)},  # read with neighbours, scattered
        "half": torch.randn(300, generator=g).to(torch.float16),
        "step": 7,  # a non-tensor item
    }


def _empty_like(sd):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _empty_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = 0
    return out


@pytest.fixture(params=["own writer", "DCP planner"])
def step(tmp_path, request):
    """A step saved by the single-process writer, or through DCP's planner (whose manifest lists
    each record's CRC, so that DCP's reader checks only the records a load touches)."""
    path = str(tmp_path / "ck")
    storage = Storage(path)
    storage.makedirs(path)
    sd = _state()
    planner = DefaultSavePlanner() if request.param == "DCP planner" else None
    files = save_state_dict(storage, path, sd, threads=2, planner=planner)
    with open(os.path.join(path, METADATA_NAME), "rb") as f:
        md = load_metadata(f.read())
    return storage, path, sd, files, md


def read_file_bytes(storage, path, name, rec):
    """One file of a step, read whole and verified (the one verified read into a fresh buffer)."""
    return memoryview(bytes(read_files(storage, path, {name: rec}, FRESH)[name].numpy()))


def load_direct(storage, path, target, *, files, metadata):
    """The one-process restore straight into the target (the direct path); whether it applied."""
    from async_ckpt.io.read_targets import plan_direct

    applies = plan_direct(_empty_like(_state()), files, metadata, local=True) is not None
    read_step(storage, path, target, files=files, metadata=metadata, opts=RestoreOptions(verify=True, threads=8))
    return applies


def load_staged(storage, path, target, *, files, metadata):
    """``restore(..., atomic=True)``'s read: every file verified into host buffers first."""
    read_step(storage, path, target, files=files, metadata=metadata,
              opts=RestoreOptions(verify=True, threads=8, atomic=True))


def _whole_files(files):
    """The manifest's records without per-record CRCs: DCP's reader reads whole files."""
    return {n: FileRecord(r.size, r.crc32c) for n, r in files.items()}


def _engines(storage, path, files, md):
    """Each engine, as a function of its target (restores) or of nothing (checks)."""
    return {
        "direct": lambda t: load_direct(storage, path, t, files=files, metadata=md),
        "staged": lambda t: load_staged(storage, path, t, files=files, metadata=md),
        "dcp records": lambda t: load_state_dict(storage, path, t, files=files, metadata=md),
        "dcp whole files": lambda t: load_state_dict(storage, path, t, files=_whole_files(files), metadata=md),
    }


def test_every_engine_and_sink_gives_the_plain_bytes(step):
    storage, path, sd, files, md = step
    for name, load in _engines(storage, path, files, md).items():
        target = _empty_like(sd)
        assert load(target) is not False, name
        assert_bitwise_equal(target, sd)
    data = {n: r for n, r in files.items() if n != METADATA_NAME}
    plain = {}
    for n in data:
        with open(os.path.join(path, n), "rb") as f:
            plain[n] = f.read()
    fresh = read_files(storage, path, data, FRESH, chunk=4096)
    assert {n: bytes(b.numpy()) for n, b in fresh.items()} == plain
    views = {n: torch.empty(r.size, dtype=torch.uint8) for n, r in data.items()}
    assert read_files(storage, path, data, IntoBuffers(views), threads=3, chunk=65536).keys() == data.keys()
    assert {n: bytes(b.numpy()) for n, b in views.items()} == plain
    assert read_files(storage, path, data, NULL, chunk=8192) == {}
    for n, rec in data.items():
        assert bytes(read_file_bytes(storage, path, n, rec)) == plain[n]


def test_a_flipped_byte_reads_the_same_from_every_engine(step):
    storage, path, sd, files, md = step
    big = next(i for idx, i in md.storage_data.items() if idx.fqn == "big")
    where = f"{path}/{big.relative_path}"
    with open(where, "r+b") as f:
        f.seek(big.offset + big.length // 2)
        b = f.read(1)
        f.seek(big.offset + big.length // 2)
        f.write(bytes([b[0] ^ 0x01]))
    whole = re.compile(re.escape(where) + r": checksum mismatch \(crc32c 0x[0-9a-f]{8}, manifest says 0x[0-9a-f]{8}\)")
    said = {}
    for name, load in _engines(storage, path, files, md).items():
        with pytest.raises(CorruptCheckpointError) as ei:
            load(_empty_like(sd))
        said[name] = str(ei.value)
    rec = files[big.relative_path]
    for name, fn in {"verify (null sink)": lambda: read_files(storage, path, {big.relative_path: rec}, NULL),
                     "bytes": lambda: read_file_bytes(storage, path, big.relative_path, rec)}.items():
        with pytest.raises(CorruptCheckpointError) as ei:
            fn()
        said[name] = str(ei.value)
    if files[big.relative_path].records is not None:
        # the record a load touches is checked alone, with the same wording, naming the record
        record = said.pop("dcp records")
        assert record.startswith(f"{where}: checksum mismatch in the record at bytes "), record
    firsts = {name: whole.match(msg) for name, msg in said.items()}
    assert all(firsts.values()), said
    assert len({m.group(0) for m in firsts.values()}) == 1, said  # the same file, the same checksums
    # the direct path wrote into its target first, and says so after the same words
    assert "partly written" in said["direct"]
    assert all(msg == firsts[name].group(0) for name, msg in said.items() if name != "direct"), said


def test_a_short_file_reads_the_same_from_every_whole_file_engine(step):
    storage, path, sd, files, md = step
    name = next(n for n in files if n != METADATA_NAME and files[n].size > 4096)
    where = f"{path}/{name}"
    with open(where, "r+b") as f:
        f.truncate(files[name].size - 3)
    said = set()
    for fn in (lambda: read_files(storage, path, {name: files[name]}, NULL),
               lambda: read_file_bytes(storage, path, name, files[name]),
               lambda: load_staged(storage, path, _empty_like(sd), files=files, metadata=md)):
        with pytest.raises(CorruptCheckpointError) as ei:
            fn()
        said.add(str(ei.value))
    assert said == {f"{where}: size is {files[name].size - 3} bytes, manifest says {files[name].size}"}


def test_overlapping_items_are_found_in_any_order(step):
    """Items of one file that overlap are reported naming both, whether the metadata lists them
    in file order or not; out of order without overlapping is fine."""
    from async_ckpt.format.validate import check_step_metadata

    storage, path, sd, files, md = step
    where = f"{path}/{METADATA_NAME}"
    assert set(check_step_metadata(md, files, where=where)) == {n for n in files if n != METADATA_NAME}
    big = next(i for idx, i in md.storage_data.items() if idx.fqn == "big")
    items = sorted(((i.offset, idx.fqn, i) for idx, i in md.storage_data.items()
                    if i.relative_path == big.relative_path), key=lambda x: x[0])
    assert len(items) >= 3
    # the same items listed in reverse file order: still one valid file
    md.storage_data = dict(reversed(list(md.storage_data.items())))
    assert set(check_step_metadata(md, files, where=where)) == {n for n in files if n != METADATA_NAME}
    for order in (list, lambda x: list(reversed(x))):
        md.storage_data = dict(order(list(md.storage_data.items())))
        second = items[1][2]
        saved = second.offset
        second.offset = items[0][0] + 1  # inside the first item
        try:
            with pytest.raises(CorruptCheckpointError, match=f"{items[0][1]} and {items[1][1]} overlap in "
                                                             f"{big.relative_path}"):
                check_step_metadata(md, files, where=where)
        finally:
            second.offset = saved
