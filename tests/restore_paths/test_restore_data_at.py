"""Where each large tensor's data starts, kept in the manifest by the writer: restore reads
straight into the targets without probing the records, equals the probing path bitwise, and
catches a manifest whose offsets are wrong; manifests without them still restore."""

from __future__ import annotations

import base64
import os
import pickle
import struct
import warnings

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.errors import CorruptCheckpointError, PartlyWrittenError
from async_ckpt.format import torch_record
from async_ckpt.format.manifest import MANIFEST_NAME, FileRecord, Manifest
from async_ckpt.format.unpickling import load_metadata
from async_ckpt.io import read_targets as direct

from ..damage.test_durability import rewrite_manifest
from ..support.tree import assert_bitwise_equal
from .test_restore_fast import fresh_like, mixed_state


def big_state(seed: int) -> dict:
    """Large tensors of each writer path (torch.save, record templates, requires_grad, a view
    of a larger storage), small ones and objects."""
    g = torch.Generator().manual_seed(seed)
    sd = mixed_state(seed)
    base = torch.randn(3, 600, 700, generator=g)
    sd["large"] = {
        "save_path": torch.randn(1100, 1000, generator=g),  # > 1 MiB: torch.save writes it
        "template": torch.randn(300, 300, generator=g),  # 64 KiB .. 1 MiB: a record template
        "f64": torch.randn(70000, dtype=torch.float64, generator=g),
        "grad": torch.randn(700, 700, generator=g).requires_grad_(True),
        "view": base[1],  # part of a larger storage: saved as a copy of itself
        "bf16": torch.randn(400, 400, generator=g).to(torch.bfloat16),
    }
    return sd


def _tensors(sd, md):
    out = {}
    for fqn, path in md.planner_data.items():
        v = sd
        for p in path:
            v = v[p] if not isinstance(v, (list, tuple)) and p in v else v[int(p)]  # int keys, list items
        if isinstance(v, torch.Tensor):
            out[fqn] = v
    return out


def _step(root: str, step: int):
    d = os.path.join(root, str(step))
    with open(os.path.join(d, ".metadata"), "rb") as f:
        md = load_metadata(f.read())
    with open(os.path.join(d, MANIFEST_NAME), "rb") as f:
        man = Manifest.from_json(f.read())
    return d, md, man


def test_writer_records_where_each_large_tensor_data_starts(tmp_path):
    root = str(tmp_path / "c")
    sd = big_state(1)
    with CheckpointManager(root) as mgr:
        mgr.save(1, sd)
    d, md, man = _step(root, 1)
    tensors = _tensors(sd, md)
    listed = 0
    for idx, info in md.storage_data.items():
        at = (man.files[info.relative_path].data_at or {}).get(info.offset)
        t = tensors.get(idx.fqn)
        if t is None or t.nbytes < 64 * 2**10:
            assert at is None, idx.fqn  # objects and small tensors: not listed
            continue
        assert at is not None, idx.fqn
        with open(os.path.join(d, info.relative_path), "rb") as f:
            f.seek(info.offset + at)
            assert f.read(t.nbytes) == t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes(), idx.fqn
        listed += 1
    assert listed == 8  # model.big, model.big_c128 and the six of "large"


class _CountedProbe(direct.Probe):
    made = 0

    def __init__(self, *a, **k):
        type(self).made += 1
        super().__init__(*a, **k)


def _strip_offsets(m: Manifest) -> None:
    for rec in m.files.values():
        rec.data_at = None


def test_restore_with_offsets_probes_nothing_and_equals_the_probing_path(tmp_path, monkeypatch):
    root, old = str(tmp_path / "c"), str(tmp_path / "old")
    for r in (root, old):
        with CheckpointManager(r) as mgr:
            mgr.save(1, big_state(1))
    rewrite_manifest(os.path.join(old, "1"), _strip_offsets)  # as a manifest from before data_at
    assert all(rec.data_at is None for rec in _step(old, 1)[2].files.values())
    monkeypatch.setattr(direct, "Probe", _CountedProbe)
    _CountedProbe.made = 0
    fast = fresh_like(big_state(0))
    assert CheckpointManager(root).restore(1, fast) == 1
    assert _CountedProbe.made == 0  # no record probed: every large one had its offset
    slow = fresh_like(big_state(0))
    assert CheckpointManager(old).restore(1, slow) == 1
    assert _CountedProbe.made == 8  # the same records, probed
    assert_bitwise_equal(fast, slow)
    expected = big_state(1)
    expected["large"]["grad"] = expected["large"]["grad"].detach()
    fast["large"]["grad"] = fast["large"]["grad"].detach()
    assert_bitwise_equal(fast, expected)


def _shift(fqn: str, by: int, root: str, step: int):
    d, md, _ = _step(root, step)
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)

    def edit(m: Manifest) -> None:
        data_at = m.files[info.relative_path].data_at
        data_at[info.offset] += by

    rewrite_manifest(d, edit)


@pytest.mark.parametrize("verify", [True, False])
def test_a_wrong_offset_in_the_manifest_is_caught_and_falls_back(tmp_path, verify):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, big_state(1))
        mgr.save(2, big_state(2))
    _shift("large.save_path", 64, root, 2)  # a consistent manifest that misplaces the data
    mgr = CheckpointManager(root)
    with pytest.raises(CorruptCheckpointError, match="large.save_path.*offset the manifest gives.*partly written") as ei:
        mgr.restore(2, fresh_like(big_state(0)), verify=verify)
    assert isinstance(ei.value, PartlyWrittenError)
    target = fresh_like(big_state(0))
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2"):
        assert mgr.restore(None, target, verify=verify) == 1
    expected = big_state(1)
    expected["large"]["grad"] = expected["large"]["grad"].detach()
    target["large"]["grad"] = target["large"]["grad"].detach()
    assert_bitwise_equal(target, expected)
    mgr.close()


def test_an_offset_that_leaves_its_record_is_probed_instead(tmp_path, monkeypatch):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, big_state(1))
    d, md, _ = _step(root, 1)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "large.template")
    _shift("large.template", info.length, root, 1)  # data past its record's end: not used
    monkeypatch.setattr(direct, "Probe", _CountedProbe)
    _CountedProbe.made = 0
    target = fresh_like(big_state(0))
    assert CheckpointManager(root).restore(1, target) == 1
    assert _CountedProbe.made == 1
    assert torch.equal(target["large"]["template"].view(torch.uint8),
                       big_state(1)["large"]["template"].view(torch.uint8))


@pytest.mark.parametrize("atomic", [False, True])
def test_a_record_whose_layout_is_not_parsed_takes_the_slow_path(tmp_path, monkeypatch, atomic):
    """A record that ``data_start`` cannot parse (a torch.save format it does not know) with
    its data offset in the manifest is read by ``torch.load``, never called damaged."""
    root = str(tmp_path / "c")
    saved = big_state(1)
    saved["large"]["u16"] = torch.arange(300_000, dtype=torch.int64).to(torch.uint16)
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
    assert any(rec.data_at for rec in _step(root, 1)[2].files.values())

    def unknown(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name}")

    monkeypatch.setattr(torch_record.TensorDescUnpickler, "find_class", unknown)
    monkeypatch.setattr(torch_record, "HEADS", torch_record.Heads())  # not the shared cache: it would keep the refusals
    target = fresh_like(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no step skipped as damaged
        assert CheckpointManager(root).restore(None, target, atomic=atomic) == 1
    saved["large"]["grad"] = saved["large"]["grad"].detach()
    target["large"]["grad"] = target["large"]["grad"].detach()
    assert_bitwise_equal(target, saved)


def test_manifest_data_at_round_trip_and_malformed_entries():
    rec = FileRecord(1000, 7, data_at={0: 700, 5000 - 4400: 64})
    back = FileRecord.from_dict(rec.to_dict(), name="f", where="m")
    assert back.data_at == {0: 700, 600: 64}
    assert FileRecord.from_dict({"size": 10, "crc32c": 1}, name="f", where="m").data_at is None  # older manifests
    assert "data_at" not in FileRecord(10, 1).to_dict()
    for bad in ("not base64!", base64.b64encode(b"\0" * 5).decode(), 12,
                base64.b64encode(struct.pack("<QI", 990, 20)).decode()):  # 990 + 20 > 1000
        with pytest.raises(CorruptCheckpointError, match="f: .*data offset"):
            FileRecord.from_dict({"size": 1000, "crc32c": 7, "data_at": bad}, name="f", where="m")
