"""Restore straight into the target tensors: bitwise results, checksums as data arrives, the
partly-written contract and ``atomic=True``, key-mismatch reports, DCP's ``Stateful``."""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.errors import CorruptCheckpointError, PartlyWrittenError, StateDictMismatchError
from async_ckpt.format.crc import crc32c, crc32c_combine, crc32c_concat
from async_ckpt.format.manifest import MANIFEST_NAME, Manifest
from async_ckpt.format.unpickling import load_metadata
from async_ckpt.io import read_targets as direct
from async_ckpt.io import step_io

from ..support.tree import assert_bitwise_equal, clone_tree


@pytest.fixture
def direct_calls(monkeypatch):
    """One entry per one-process restore that is not atomic (without a custom planner): True
    when the direct path read the step itself, False when DCP's reader did."""
    from async_ckpt.io.sinks import StagedFiles

    calls = []
    real_direct, real_dcp = step_io.read_direct, step_io.load_state_dict

    def direct(*a, **k):
        if not k.get("staged"):
            calls.append(True)
        return real_direct(*a, **k)

    def dcp_reader(storage, *a, **k):
        if not isinstance(storage, StagedFiles) and k.get("planner") is None:
            calls.append(False)
        return real_dcp(storage, *a, **k)

    monkeypatch.setattr(step_io, "read_direct", direct)
    monkeypatch.setattr(step_io, "load_state_dict", dcp_reader)
    return calls


def mixed_state(seed: int) -> dict:
    """Big and small records of many dtypes; odd-sized items in between, so that records (and
    complex128 data) start at odd file offsets."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(256, 513, generator=g)  # >= DIRECT_MIN_BYTES: read straight into the target
    return {
        "model": {
            "big": big,
            "odd": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
            "c128": torch.randn(37, dtype=torch.complex128, generator=g),
            "mask": torch.rand(5, generator=g) > 0.5,
            "big_c128": torch.randn(20000, dtype=torch.complex128, generator=g),
            "bf16": torch.randn(301, generator=g).to(torch.bfloat16),
            "i64": torch.randint(-(2**40), 2**40, (7, 3), generator=g),
            "scalar": torch.tensor(float(seed)),
            "h": torch.randn(11, generator=g).to(torch.float16),
            "empty": torch.zeros(0, 4),
        },
        "small": {f"p{i}": torch.randn(17 + i, generator=g) for i in range(40)},
        "optim": {"state": {0: {"m": torch.randn(9, generator=g)}, 3: {"m": torch.randn(4, generator=g)}},
                  "lr": 0.1 * seed, "betas": (0.9, 0.99), "names": ["a", "b"]},
        "step": seed,
        "tag": f"s{seed}",
    }


def fresh_like(sd):
    if isinstance(sd, torch.Tensor):
        return torch.full_like(sd, 3) if sd.dtype != torch.bool else torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: fresh_like(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(fresh_like(v) for v in sd)
    return None if isinstance(sd, str) else sd


def test_bitwise_restore_views_tied_int_keys_mixed_dtypes(tmp_path, direct_calls):
    saved = mixed_state(1)
    base = torch.randn(4, 256, 513)
    saved["model"]["view"] = base[1]  # a contiguous view at a storage offset
    saved["model"]["tied"] = saved["model"]["big"]  # tied weights: one tensor, two keys
    with CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.save(1, saved)

    target = fresh_like(saved)
    tbase = torch.zeros(4, 256, 513)
    target["model"]["view"] = tbase[2]  # restored into a view of the caller's own buffer
    target["model"]["tied"] = target["model"]["big"]
    target["model"]["strided"] = torch.zeros(513, 256).t()  # not contiguous: the slower path
    saved["model"]["strided"] = torch.randn(256, 513)
    with CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.save(2, saved)
        assert mgr.restore(2, target) == 2
    assert direct_calls == [True], "restored by direct reads, not through DCP"
    assert_bitwise_equal(target, saved)
    assert target["model"]["tied"] is target["model"]["big"]
    assert torch.equal(tbase[2], saved["model"]["view"]) and not tbase[1].any() and not tbase[3].any()
    assert sorted(target["optim"]["state"]) == [0, 3]


def test_restore_into_an_empty_target_and_parameters(tmp_path, direct_calls):
    saved = mixed_state(2)
    with CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.save(1, saved)
        target = {}
        mgr.restore(1, target)
        assert_bitwise_equal(target, saved)
        params = {"model": {k: torch.nn.Parameter(torch.zeros_like(v), requires_grad=v.is_floating_point())
                            for k, v in saved["model"].items()}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr.restore(1, params, strict=False)
    for k, v in saved["model"].items():
        assert torch.equal(params["model"][k].detach().view(-1).view(torch.uint8) if v.numel() else v,
                           v.reshape(-1).view(torch.uint8) if v.numel() else v), k
    assert direct_calls and all(direct_calls), direct_calls  # reached, and every read was direct


#: The dtypes torch.save writes as ``_rebuild_tensor_v3`` over an untyped storage (no typed
#: storage class of their own), where this torch has them.
V3_DTYPES = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                         "float8_e8m0fnu", "uint16", "uint32", "uint64", "complex32")
             if hasattr(torch, n)]


def _random_bytes_as(dtype: torch.dtype, numel: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)


@pytest.mark.parametrize("atomic", [False, True])
def test_dtypes_saved_as_rebuild_tensor_v3_restore_bitwise(tmp_path, atomic, direct_calls):
    """float8, uint16/32/64 and complex32 records, large (their data offset in the manifest)
    and small, restore bitwise by the direct path; step=None finds the step intact."""
    assert {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64} <= set(V3_DTYPES)
    g = torch.Generator().manual_seed(3)
    saved = {"f32": torch.randn(300_000, generator=g)}
    for dt in V3_DTYPES:
        saved[f"big_{dt}"] = _random_bytes_as(dt, 300_000, g)  # above DIRECT_MIN_BYTES for every itemsize
        saved[f"small_{dt}"] = _random_bytes_as(dt, 33, g)
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
    with open(os.path.join(root, "1", MANIFEST_NAME), "rb") as f:
        listed = sum(len(r.data_at or {}) for r in Manifest.from_json(f.read()).files.values())
    assert listed >= len(V3_DTYPES)  # the large records' data offsets are in the manifest
    for step in (1, None):
        target = {k: torch.zeros_like(v.view(torch.uint8)).view(v.dtype) for k, v in saved.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no step skipped as damaged, no dtype warnings
            assert CheckpointManager(root).restore(step, target, atomic=atomic) == 1
        for k, v in saved.items():
            assert target[k].dtype == v.dtype and torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)), k
    assert direct_calls == ([] if atomic else [True, True])


def _data_files(step_dir):
    return sorted(n for n in os.listdir(step_dir) if n.endswith(".distcp"))


def _flip_in_record(step_dir: str, fqn: str) -> None:
    """Flip one byte in the middle of ``fqn``'s record (inside its tensor data)."""
    with open(os.path.join(step_dir, ".metadata"), "rb") as f:
        md = load_metadata(f.read())
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    path = os.path.join(step_dir, info.relative_path)
    at = info.offset + info.length // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("fqn", ["model.big", "small.p7"])
def test_flipped_byte_falls_back_and_single_step_says_partly_written(tmp_path, fqn, direct_calls):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, mixed_state(1))
        mgr.save(2, mixed_state(2))
    _flip_in_record(os.path.join(root, "2"), fqn)
    mgr = CheckpointManager(root)
    target = fresh_like(mixed_state(0))
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2.*checksum mismatch.*partly written"):
        assert mgr.restore(None, target) == 1
    assert_bitwise_equal(target, mixed_state(1))  # step 1 overwrote everything again

    with pytest.raises(CorruptCheckpointError, match="checksum mismatch.*partly written") as ei:
        mgr.restore(2, fresh_like(mixed_state(0)))
    assert ei.value.step == 2 and isinstance(ei.value, PartlyWrittenError)
    mgr.close()

    # One step only, and it is damaged: restore(None) raises and says the target was written.
    solo = str(tmp_path / "solo")
    with CheckpointManager(solo) as mgr:
        mgr.save(5, mixed_state(5))
    _flip_in_record(os.path.join(solo, "5"), fqn)
    with pytest.warns(RuntimeWarning, match="skipping damaged step 5"):
        with pytest.raises(CorruptCheckpointError, match="passed verification.*partly written"):
            CheckpointManager(solo).restore(None, fresh_like(mixed_state(0)))


@pytest.mark.parametrize("fqn", ["model.big", "small.p7"])
def test_atomic_leaves_the_target_untouched(tmp_path, fqn):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, mixed_state(1))
    _flip_in_record(os.path.join(root, "1"), fqn)
    target = fresh_like(mixed_state(0))
    del target["optim"]["state"][3]  # an entry restore adds: taken out again on failure
    before = clone_tree(target)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as ei:
        CheckpointManager(root).restore(1, target, atomic=True)
    assert "partly written" not in str(ei.value)
    assert_bitwise_equal(target, before)


def test_truncated_file_is_caught_before_any_write(tmp_path):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, mixed_state(1))
    step = os.path.join(root, "1")
    name = _data_files(step)[0]
    with open(os.path.join(step, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(step, name)) - 10)
    target = fresh_like(mixed_state(0))
    before = clone_tree(target)
    with pytest.raises(CorruptCheckpointError, match="size is") as ei:
        CheckpointManager(root).restore(1, target)
    assert "partly written" not in str(ei.value)
    assert_bitwise_equal(target, before)


def _flip_near_end(step_dir: str) -> None:
    """Flip a byte near the end of the step's first data file (its last record's zip
    directory): found by the checksum once the records are written."""
    path = os.path.join(step_dir, _data_files(step_dir)[0])
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _newer_step_with_more_keys(root: str) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"a": torch.full((4,), 1.0)})
        mgr.save(2, {"a": torch.full((4,), 2.0), "b": torch.full((4,), 2.0)})
    _flip_near_end(os.path.join(root, "2"))


def test_fallback_with_strict_false_names_the_keys_left_with_the_damaged_step_data(tmp_path):
    """The damaged step 2 partly wrote ``a`` and ``b``; step 1, restored in the end, has no
    ``b``: a warning says that ``b`` holds data of damaged step 2."""
    root = str(tmp_path / "c")
    _newer_step_with_more_keys(root)
    target = {"a": torch.zeros(4), "b": torch.zeros(4)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert CheckpointManager(root).restore(None, target, strict=False) == 1
    said = [str(w.message) for w in caught]
    assert any("skipping damaged step 2" in m for m in said)
    left = [m for m in said if "the failed restore of damaged step 2 had partly written" in m]
    assert len(left) == 1 and left[0].endswith(": b"), said
    assert torch.equal(target["a"], torch.full((4,), 1.0))


def test_a_later_error_after_a_partial_write_says_the_target_is_partly_written(tmp_path):
    """strict=True: after damaged step 2 partly wrote the target, step 1 does not match it;
    that error says the target holds damaged step 2's data, with step 2's error as its cause.
    When no step is left, the final error says so too."""
    root = str(tmp_path / "c")
    _newer_step_with_more_keys(root)
    target = {"a": torch.zeros(4), "b": torch.zeros(4)}
    mgr = CheckpointManager(root)
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2"):
        with pytest.raises(PartlyWrittenError, match="missing from checkpoint: b.*partly written with the data "
                                                         "of damaged step 2") as ei:
            mgr.restore(None, target)
    assert isinstance(ei.value.cause, StateDictMismatchError) and not ei.value.damaged
    assert ei.value.damaged_steps == (2,) and ei.value.keys_left == ("a", "b")
    mgr.close()

    solo = str(tmp_path / "solo")
    with CheckpointManager(solo) as mgr:
        mgr.save(5, {"a": torch.full((4,), 5.0)})
    _flip_near_end(os.path.join(solo, "5"))
    with pytest.warns(RuntimeWarning, match="skipping damaged step 5"):
        with pytest.raises(CorruptCheckpointError, match="passed verification.*data of damaged step 5") as ei2:
            CheckpointManager(solo).restore(None, {"a": torch.zeros(4)})
    assert isinstance(ei2.value, PartlyWrittenError) and isinstance(ei2.value.__cause__, CorruptCheckpointError)
    assert ei2.value.damaged_steps == (5,)


@pytest.mark.parametrize("atomic", [False, True])
def test_a_failed_restore_takes_out_the_list_entries_it_added(tmp_path, atomic):
    """Entries a damaged step added to a list of the target (and to a dict) are taken out
    again, so the older step it falls back to matches the target."""
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"lst": [torch.full((2,), 1.0)], "d": {"a": torch.full((2,), 1.0)}})
        mgr.save(2, {"lst": [torch.full((2,), 2.0)] * 3 + [{"w": torch.full((2,), 2.0)}],
                     "d": {"a": torch.full((2,), 2.0), "b": torch.full((2,), 2.0)}})
    _flip_near_end(os.path.join(root, "2"))
    mgr = CheckpointManager(root)
    target = {"lst": [torch.zeros(2)], "d": {"a": torch.zeros(2)}}
    with pytest.raises(CorruptCheckpointError):
        mgr.restore(2, target, atomic=atomic)
    assert len(target["lst"]) == 1 and sorted(target["d"]) == ["a"]
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2"):
        assert mgr.restore(None, target, atomic=atomic) == 1
    assert_bitwise_equal(target, {"lst": [torch.full((2,), 1.0)], "d": {"a": torch.full((2,), 1.0)}})
    mgr.close()


def test_undo_of_insert_restores_lists_as_they_were():
    from async_ckpt.format.dcp_layout import remove_created, set_element

    root = {"lst": [None, 5], "d": {}}
    before = {"lst": [None, 5], "d": {}}
    added: list = []
    set_element(root, ("lst", 0, "w"), 1, created=added)  # a slot that held None
    set_element(root, ("lst", 4, 0), 2, created=added)  # past the end, a new list in it
    set_element(root, ("d", "x", 1), 3, created=added)
    assert root == {"lst": [{"w": 1}, 5, None, None, [2]], "d": {"x": [None, 3]}}
    remove_created(root, added)
    assert root == before


def test_a_path_names_the_int_key_it_spells_and_nothing_else():
    """One rule for every place that sets a value at a DCP path: DCP writes a dict key as
    ``str(key)``, so ``"7"`` names the int key 7 (and ``"-1"`` the int -1) where the dict holds
    it, while ``"007"`` (never ``str`` of an int) is the string key ``"007"``; a path listed in
    the manifest's ``int_keys`` is an int key even in an empty dict."""
    from async_ckpt.format.dcp_layout import set_element

    root: dict = {"s": {7: "old", -1: "neg"}}
    set_element(root, ("s", "7"), "seven")
    set_element(root, ("s", "-1"), "minus one")
    set_element(root, ("s", "007"), "string")
    assert root == {"s": {7: "seven", -1: "minus one", "007": "string"}}
    fresh: dict = {"state": {}}
    set_element(fresh, ("state", "0", "step"), 1, int_keys={"state.0"})
    set_element(fresh, ("state", "01", "step"), 2)
    assert fresh == {"state": {0: {"step": 1}, "01": {"step": 2}}}


def test_key_mismatch_reports(tmp_path):
    root = str(tmp_path / "c")
    saved = {"model": {f"w{i}": torch.randn(3) for i in range(5)}, "step": 3}
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
    mgr = CheckpointManager(root)
    target = {"model": {f"w{i}": torch.zeros(3) for i in range(5)}, "step": 0,
              "extra": {f"x{i:02d}": torch.zeros(2) for i in range(12)}}
    before = clone_tree(target)
    with pytest.raises(StateDictMismatchError) as ei:
        mgr.restore(1, target)
    msg = str(ei.value)
    assert all(f"extra.x{i:02d}" in msg for i in range(10)) and "extra.x10" not in msg and "and 2 more" in msg
    assert_bitwise_equal(target, before)

    # strict=False: the intersection is loaded; the keys the checkpoint lacks are left as they are.
    with pytest.warns(UserWarning, match="keys not in the checkpoint.*extra.x00"):
        mgr.restore(1, target, strict=False)
    assert_bitwise_equal(target["model"], saved["model"])
    assert target["step"] == 3
    assert_bitwise_equal(target["extra"], before["extra"])

    # Keys in the checkpoint, not in the target: with strict=False listed in a warning, not loaded.
    small = {"model": {"w0": torch.zeros(3)}}
    with pytest.warns(UserWarning, match="has keys the state_dict lacks.*model.w1"):
        mgr.restore(1, small, strict=False)
    assert sorted(small) == ["model"] and sorted(small["model"]) == ["w0"]
    assert torch.equal(small["model"]["w0"], saved["model"]["w0"])
    mgr.close()


class _NotDirect(torch.Tensor):
    """A tensor subclass: the direct path leaves the restore to DCP."""


def _sgd(seed: int, momentum: float = 0.9) -> torch.optim.SGD:
    """An SGD optimizer with momentum after one step: a tensor momentum buffer per parameter."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]
    optim = torch.optim.SGD(params, lr=0.1, momentum=momentum)
    (params[0].sum() * 2 + (params[1] ** 2).sum()).backward()
    optim.step()
    return optim


def _int_keyed(seed: int) -> dict:
    sd = {"optim": _sgd(seed).state_dict(), "counters": {0: {"step": 5 + seed}, 7: {"step": seed, "tag": f"t{seed}"}}}
    sd["optim"]["state"][1]["momentum_buffer"] = None  # as torch < 2.1 kept it without momentum
    return sd


@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("path", ["direct", "dcp"])
def test_non_tensor_values_under_int_keys_land_under_those_keys(tmp_path, atomic, path):
    """Optimizer state (keyed by parameter index) and other int-keyed dicts: non-tensor values
    (a None momentum buffer, a step count) go back under the int key, never under a new
    string key beside it, by the direct path and by DCP."""
    saved = _int_keyed(1)
    if path == "dcp":
        saved["sub"] = torch.randn(3)
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
    target = _int_keyed(2)  # the same keys, other values
    if path == "dcp":
        target["sub"] = torch.zeros(3).as_subclass(_NotDirect)
    assert CheckpointManager(root).restore(1, target, atomic=atomic) == 1
    if path == "dcp":
        target["sub"] = target["sub"].as_subclass(torch.Tensor)
    assert_bitwise_equal(target, saved)
    fresh = {"optim": {"state": {}, "param_groups": _sgd(3).state_dict()["param_groups"]}, "counters": {}}
    if path == "dcp":
        fresh["sub"] = torch.zeros(3).as_subclass(_NotDirect)
    assert CheckpointManager(root).restore(1, fresh, atomic=atomic) == 1
    if path == "dcp":
        fresh["sub"] = fresh["sub"].as_subclass(torch.Tensor)
    assert_bitwise_equal(fresh, saved)
    optim = _sgd(4)
    optim.load_state_dict(fresh["optim"])
    assert optim.state_dict()["state"][1]["momentum_buffer"] is None


@pytest.mark.parametrize("atomic", [False, True])
def test_inference_mode_targets_strided_or_not(tmp_path, atomic):
    """Tensors made under ``torch.inference_mode`` (a serving process): contiguous ones and
    transposed ones (the slow path's copy), small and large, restored bitwise."""
    g = torch.Generator().manual_seed(4)
    saved = {"small_t": torch.randn(5, 7, generator=g), "big_t": torch.randn(700, 300, generator=g),
             "small": torch.randn(4, generator=g), "big": torch.randn(300_000, generator=g)}
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
    with torch.inference_mode():
        target = {"small_t": torch.zeros(7, 5).t(), "big_t": torch.zeros(300, 700).t(),
                  "small": torch.zeros(4), "big": torch.zeros(300_000)}
    assert all(v.is_inference() for v in target.values())
    assert CheckpointManager(root).restore(1, target, atomic=atomic) == 1
    assert_bitwise_equal(target, saved)


@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("n", [64 * 2**20 // 4, 20], ids=["large", "small"])
def test_targets_sharing_memory_restored_from_untied_data(tmp_path, atomic, n):
    """One tensor under two keys, saved with different data under each: every restore (no
    false checksum mismatch from the other key's bytes) ends with the last key's data; an
    overlapping view takes its own data, the rest of its base the earlier key's."""
    saved = {"a": torch.full((n,), 1.0), "b": torch.full((n,), 2.0), "c": torch.full((n,), 4.0),
             "d": torch.full((2,), 3.0)}
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
    mgr = CheckpointManager(root)
    for _ in range(5):
        w, base = torch.zeros(n), torch.zeros(n)
        target = {"a": w, "b": w, "c": base, "d": base[3:5]}
        assert mgr.restore(1, target, atomic=atomic) == 1
        assert target["a"] is w and target["b"] is w
        assert torch.equal(w.view(torch.uint8), saved["b"].view(torch.uint8))
        expected = saved["c"].clone()
        expected[3:5] = 3.0
        assert torch.equal(base.view(torch.uint8), expected.view(torch.uint8))
    mgr.close()


class AppState:
    """What torchtitan and DCP users pass: a ``Stateful`` holding a model and its optimizer."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["model"])
        self.optim.load_state_dict(sd["optim"])


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def test_stateful_app_state_restores_model_and_fresh_optimizer(tmp_path):
    model, optim = _trained(0)
    with CheckpointManager(str(tmp_path / "c")) as mgr:
        mgr.save(1, {"app": AppState(model, optim), "step": 1})
    torch.manual_seed(99)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.5)  # fresh: empty state
    target = {"app": AppState(model2, optim2), "step": 0}
    assert CheckpointManager(str(tmp_path / "c")).restore(1, target) == 1
    assert target["step"] == 1 and isinstance(target["app"], AppState)
    assert_bitwise_equal(model2.state_dict(), model.state_dict())
    assert_bitwise_equal(optim2.state_dict()["state"], optim.state_dict()["state"])
    assert optim2.param_groups[0]["lr"] == 1e-2
    # training continues identically
    x = torch.randn(4, 8)
    for m, o in ((model, optim), (model2, optim2)):
        m(x).sum().backward()
        o.step()
    assert_bitwise_equal(model2.state_dict(), model.state_dict())


def test_memory_filesystem_ranged_reads(tmp_path, monkeypatch, direct_calls):
    """Remote storage (fsspec's memory://): ranged requests, direct reads of big records."""
    monkeypatch.setattr(direct, "REMOTE_DIRECT_MIN_BYTES", 64 * 1024)
    url = f"memory://restore-fast-{random.getrandbits(32):x}"
    saved = mixed_state(4)
    with CheckpointManager(url) as mgr:
        mgr.save(1, saved)
        target = fresh_like(saved)
        mgr.restore(1, target)
    assert direct_calls == [True]
    assert_bitwise_equal(target, saved)


def test_crc32c_combine_matches_crc_of_concatenation():
    rng = random.Random(0)
    for la, lb in [(0, 0), (0, 7), (9, 0), (1, 1), (1000, 4096), (65537, 3), (1 << 20, 12345)]:
        a, b = rng.randbytes(la), rng.randbytes(lb)
        assert crc32c_combine(crc32c(a), crc32c(b), lb) == crc32c(a + b)
    parts = [rng.randbytes(rng.randrange(0, 3000)) for _ in range(20)]
    assert crc32c_concat((crc32c(p), len(p)) for p in parts) == crc32c(b"".join(parts))
