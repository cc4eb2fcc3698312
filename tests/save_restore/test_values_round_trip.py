"""Values come back as they were saved: non-tensor values at any depth (inside lists and tuples,
which DCP stores as one item), and targets of unusual strides; targets that cannot be
restored into are refused before anything is written."""

from __future__ import annotations

import datetime
import os
import types
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from async_ckpt import CheckpointManager
from async_ckpt.format.torch_record import PickledObject

from ..support.paths import REPO


def _assert_same(a, b, path="root"):
    """Equal leaf by leaf, of one type: tensors and arrays bit for bit (dtype, shape, bytes)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} saved, {type(b).__name__} restored ({b!r:.200})"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        x, y = (torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()) for t in (a, b))  # standard strides
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{path}: bytes differ"
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b) or set(a) == set(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, types.SimpleNamespace):
        _assert_same(vars(a), vars(b), path)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _no_placeholder(x, path="root"):
    assert type(x) is not PickledObject, f"{path}: a placeholder came back: {x!r}"
    if isinstance(x, dict):
        for k, v in x.items():
            _no_placeholder(v, f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _no_placeholder(v, f"{path}.{i}")


def _nested_values() -> dict:
    g = torch.Generator().manual_seed(3)
    rs = np.random.RandomState(5)
    return {
        "deep": {"a": [1, (2.5, rs.randint(-9, 9, (2, 3)).astype(np.int16))]},  # dict > list > tuple > ndarray
        "nested_tuples": (("x", (np.float32(1.5), datetime.date(2020, 1, 2))), (), ((None,),)),
        "mixed": [torch.randn(4, generator=g), np.arange(3), {"k": datetime.date(2021, 5, 6)},
                  (torch.randn(2, generator=g).to(torch.bfloat16), np.array([1.5]), datetime.time(1, 2))],
        "np_rng": rs.get_state(),
        "torch_rng": [torch.get_rng_state(), 7],
        "torch_rng_tuple": (torch.get_rng_state(),),
        "objects_only": [np.arange(3), 1],
        "dates": [datetime.date(2020, 1, 2)],
        "object_holding_a_tensor": [types.SimpleNamespace(t=torch.arange(3), s={1, 2})],
        "plain": {"arr": np.arange(4.0), "w": torch.ones(3)},
    }


def _blank(x):
    """A restore target of ``x``'s structure (what DCP walks into): tensors zeroed, the rest None."""
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    if isinstance(x, dict):
        return {k: _blank(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_blank(v) for v in x]
    return None


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("atomic", [False, True], ids=["direct", "atomic"])
def test_values_inside_lists_and_tuples_round_trip_at_any_depth(tmp_path, lazy, atomic):
    """Non-tensor values inside tuples and lists (stored by DCP as one item) used to come back
    as ``PickledObject`` placeholders, through restore and plain ``dcp.load`` alike; now every
    leaf comes back bitwise, numpy's and torch's RNG states included."""
    saved = _nested_values()
    root = str(tmp_path / "ck")
    with CheckpointManager(root) as mgr:
        mgr.save_async(1, saved, lazy=lazy)
        mgr.join()
        for target in ({}, _blank(saved)):
            mgr.restore(1, target, allow_pickle=True, atomic=atomic)
            _no_placeholder(target)
            _assert_same(saved, target)
            # a tensor inside a tuple is its own storage, not a view into the staging buffer it was saved from
            for t in (target["torch_rng_tuple"][0], target["mixed"][3][0]):
                assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes

    plain = _blank(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled ..."
        dcp.load(plain, checkpoint_id=os.path.join(root, "1"), no_dist=True)
    _no_placeholder(plain)
    _assert_same(saved, plain)

    # the restored RNG states are usable as such
    np_rng = np.random.RandomState()
    np_rng.set_state(target["np_rng"])
    expected = np.random.RandomState(5)
    expected.randint(-9, 9, (2, 3))
    assert np_rng.random_sample(5).tobytes() == expected.random_sample(5).tobytes()
    torch_rng = torch.Generator()
    torch_rng.set_state(target["torch_rng"][0])
    torch_rng2 = torch.Generator()
    torch_rng2.set_state(target["torch_rng_tuple"][0])
    assert torch.equal(torch.rand(4, generator=torch_rng), torch.rand(4, generator=torch_rng2))


def test_global_numpy_rng_state_in_a_state_dict_can_be_set_after_restore(tmp_path):
    """``{"rng": np.random.get_state()}``: the exact case of the report."""
    np.random.seed(11)
    np.random.rand(3)
    state = np.random.get_state()
    expected = np.random.rand(4)
    with CheckpointManager(str(tmp_path / "ck")) as mgr:
        mgr.save(1, {"rng": state, "w": torch.ones(2)})
        np.random.seed(0)
        out = {"rng": None, "w": torch.zeros(2)}
        mgr.restore(1, out, allow_pickle=True)
    assert type(out["rng"]) is tuple and type(out["rng"][1]) is np.ndarray
    np.random.set_state(out["rng"])
    assert np.random.rand(4).tobytes() == expected.tobytes()


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_tensors_inside_a_tuple_are_saved_without_their_staging_neighbours(tmp_path, lazy):
    """A tuple is stored as one ``torch.save``-d item, and ``torch.save`` writes a tensor's
    whole storage: a staged tensor used to take the shared host buffer it sat in along (other
    keys' bytes in the item), and came back as a view at an offset into it."""
    g = torch.Generator().manual_seed(8)
    saved = {"a": torch.randn(300, generator=g), "pair": (torch.randn(7, generator=g), torch.arange(5), "x"),
             "b": torch.randn(200, generator=g), "rng": (torch.get_rng_state(),)}
    root = str(tmp_path / "ck")
    with CheckpointManager(root) as mgr:
        mgr.save_async(1, saved, lazy=lazy)
        mgr.join()
        out = {"a": torch.zeros(300), "pair": None, "b": torch.zeros(200), "rng": None}
        mgr.restore(1, out, allow_pickle=True)
    _assert_same(saved, out)
    for t in (*out["pair"][:2], out["rng"][0]):
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes, \
            f"restored as a view into {t.untyped_storage().nbytes()} bytes"
    torch.Generator().set_state(out["rng"][0])  # crashed on a view at an offset


def _odd_strided(shape, strides, offset=2):
    """A tensor of ``shape`` and ``strides`` at ``offset`` into a storage of its own, values 1, 2, ..."""
    need = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
    return torch.as_strided(torch.arange(need + offset + 3, dtype=torch.float32) + 1, shape, strides, offset)


#: contiguous (``is_contiguous()``) whatever the strides of their size-1 and size-0 dimensions
ODD_STRIDES = [((1,), (5,)), ((1, 1), (7, 3)), ((1,), (0,)), ((1, 1, 1), (0, 0, 0)), ((2, 1), (1, 9)),
               ((1, 3), (11, 1)), ((3, 1, 2), (2, 100, 1)), ((0, 3), (5, 1)), ((3, 0), (0, 0))]


@pytest.mark.parametrize("atomic", [False, True], ids=["direct", "atomic"])
def test_contiguous_targets_with_odd_strides_restore_bitwise(tmp_path, atomic):
    """A one-element target whose stride is not 1 (``w[:, 0]`` of a ``(1, N)`` matrix, or its
    clone) is contiguous, but the direct read's planner viewed it as bytes through
    ``view(-1)``, which keeps the stride: "self.stride(-1) must be 1 to view Float as Byte"."""
    w = torch.randn(1, 6, generator=torch.Generator().manual_seed(2))
    saved = {"col": w[:, 0], "col_clone": w[:, 0].clone(), "big": torch.randn(70_000)}
    saved.update({f"odd{i}": _odd_strided(shape, st) for i, (shape, st) in enumerate(ODD_STRIDES)})
    assert all(t.is_contiguous() for t in saved.values())
    with CheckpointManager(str(tmp_path / "ck")) as mgr:
        mgr.save(1, saved)
        target = {"col": torch.zeros(1, 6)[:, 0], "col_clone": torch.zeros(1, 6)[:, 0].clone(),
                  "big": torch.zeros(70_000)}
        target.update({f"odd{i}": _odd_strided(shape, st).zero_() if all(shape) else _odd_strided(shape, st)
                       for i, (shape, st) in enumerate(ODD_STRIDES)})
        strides = {k: v.stride() for k, v in target.items()}
        mgr.restore(1, target, atomic=atomic)
    _assert_same(saved, target)
    assert {k: v.stride() for k, v in target.items()} == strides  # restored in place


def test_a_misaligned_record_into_a_one_element_target_of_odd_stride():
    """The misaligned-record path of the reader views a contiguous target as bytes too: a
    one-element float64 target of stride 7, its record at every byte offset 0..7."""
    import io

    from async_ckpt.format.torch_record import stored_bytes

    src = torch.tensor([[3.25]], dtype=torch.float64)
    buf = io.BytesIO()
    torch.save(src, buf)
    for shift in range(8):
        blob = memoryview(bytearray(shift) + buf.getvalue())[shift:]
        req = types.SimpleNamespace(storage_offsets=[0, 0], lengths=[1, 1])
        target = torch.as_strided(torch.zeros(20, dtype=torch.float64), (1, 1), (7, 3), 1)
        pair = stored_bytes(blob, req, target)
        assert pair is not None
        dst, src_view = pair
        dst.copy_(src_view)
        assert target.item() == 3.25, shift


def _three(n: int = 70_000) -> dict:
    g = torch.Generator().manual_seed(6)
    return {"a": torch.randn(n, generator=g), "b": torch.randn(n, generator=g), "c": torch.randn(n, generator=g)}


@pytest.mark.parametrize("atomic", [False, True], ids=["direct", "atomic"])
def test_a_meta_target_is_refused_naming_the_key(tmp_path, atomic):
    """A meta tensor target used to fail with DCP's "Default process group has not been
    initialized" (the direct restore declined it); now a typed error names the key and the fix,
    and nothing is written."""
    from async_ckpt import StateDictMismatchError

    with CheckpointManager(str(tmp_path / "ck")) as mgr:
        mgr.save(1, _three())
        target = {"a": torch.zeros(70_000), "b": torch.empty(70_000, device="meta"), "c": torch.zeros(70_000)}
        with pytest.raises(StateDictMismatchError, match=r"b: the target is a meta tensor.*to_empty"):
            mgr.restore(1, target, atomic=atomic)
    assert not target["a"].any() and not target["c"].any()


@pytest.mark.parametrize("atomic", [False, True], ids=["direct", "atomic"])
@pytest.mark.parametrize("n", [70_000, 5], ids=["large", "small"])
def test_an_expanded_target_is_refused_before_the_first_write(tmp_path, atomic, n):
    """An expanded (stride-0) target cannot take a value per element: restore used to write the
    keys around it, then fail saying the target "was partly written" (atomic=True too). Now it
    is refused up front, naming the key, and no key is written."""
    from async_ckpt import StateDictMismatchError

    with CheckpointManager(str(tmp_path / "ck")) as mgr:
        mgr.save(1, _three(n))
        target = {"a": torch.zeros(n), "b": torch.zeros(1).expand(n), "c": torch.zeros(n)}
        with pytest.raises(StateDictMismatchError, match=r"b: the target is an expanded tensor") as info:
            mgr.restore(1, target, atomic=atomic)
        assert "partly written" not in str(info.value)
        assert not target["a"].any() and not target["c"].any() and not target["b"].any()
        # the keys of their own restore once the target is fixed
        target["b"] = torch.zeros(n)
        mgr.restore(1, target, atomic=atomic)
        _assert_same(_three(n), target)


def test_import_cli_save_and_restore_without_numpy(tmp_path):
    """numpy is not a dependency (torch does not require it): ``import async_ckpt`` used to fail
    on ``import numpy`` in the DCP writer, and restore took its buffers through
    ``Tensor.numpy()`` ("Numpy is not available"). A child process where ``import numpy``
    fails imports async_ckpt, runs the CLI's ``--help`` (both entries) and round-trips a save,
    direct and atomic."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import sys
        sys.modules["numpy"] = None  # import numpy raises ImportError, as where it is not installed
        import runpy, torch
        import async_ckpt
        from async_ckpt.cli import main
        for entry in (lambda: main(["--help"]), lambda: runpy.run_module("async_ckpt", run_name="__main__")):
            try:
                entry()
            except SystemExit as exc:
                assert exc.code in (0, None), exc.code
        g = torch.Generator().manual_seed(0)
        sd = {{"big": torch.randn(100_000, generator=g), "small": torch.randn(7, generator=g), "obj": {{1, 2}},
              "pair": (torch.arange(3), "x")}}
        with async_ckpt.CheckpointManager({str(tmp_path / "ck")!r}) as mgr:
            mgr.save(1, sd)
            for atomic in (False, True):
                out = {{"big": torch.zeros(100_000), "small": torch.zeros(7), "obj": None, "pair": None}}
                mgr.restore(1, out, atomic=atomic)
                assert torch.equal(out["big"], sd["big"]) and torch.equal(out["small"], sd["small"])
                assert out["obj"] == {{1, 2}} and torch.equal(out["pair"][0], sd["pair"][0])
        assert sys.modules["numpy"] is None
        print("NO-NUMPY-OK")
    """)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "NO-NUMPY-OK" in proc.stdout, proc.stderr[-3000:]
    assert "usage: async-ckpt" in proc.stdout


def _rng_states() -> dict:
    """Every kind of RNG state a training loop saves, at the top level and nested in lists and tuples."""
    import random

    gen = np.random.default_rng(7)
    gen.random(3)
    legacy = np.random.RandomState(9)
    cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())] or [torch.get_rng_state()]
    return {
        "py": random.getstate(),
        "py_obj": random.Random(4),
        "np": np.random.get_state(),
        "np_legacy_obj": legacy,
        "np_gen": gen,
        "np_gen_state": gen.bit_generator.state,
        "np_philox": np.random.Generator(np.random.Philox(3)),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "deep": {"list": [np.random.get_state(), (gen.bit_generator.state, np.random.default_rng(1))],
                 "tuple": ((random.getstate(), np.random.RandomState(2)), [np.uint32(5), np.arange(3)])},
    }


def _same_rng(a, b, path="root"):
    """Equal leaf by leaf, bitwise; a generator object equal by its state and its next numbers."""
    import random

    assert type(a) is type(b), f"{path}: {type(a).__name__} saved, {type(b).__name__} restored ({b!r:.200})"
    if isinstance(a, random.Random):
        assert a.getstate() == b.getstate() and a.random() == b.random(), path
    elif isinstance(a, np.random.RandomState):
        _same_rng(a.get_state(), b.get_state(), path)
        assert a.random_sample(4).tobytes() == b.random_sample(4).tobytes(), path
    elif isinstance(a, np.random.Generator):
        _same_rng(a.bit_generator.state, b.bit_generator.state, path)
        assert a.random(4).tobytes() == b.random(4).tobytes(), path
    elif isinstance(a, (dict, list, tuple)):
        assert len(a) == len(b), path
        for k, x, y in (((k, a[k], b[k]) for k in a) if isinstance(a, dict) else zip(range(len(a)), a, b)):
            _same_rng(x, y, f"{path}.{k}")
    else:
        _assert_same(a, b, path)


@pytest.mark.parametrize("atomic", [False, True], ids=["direct", "atomic"])
def test_rng_states_round_trip_bitwise_without_allow_pickle(tmp_path, atomic):
    """``{"rng": np.random.get_state()}`` was refused on restore with advice to allowlist
    ``pickle.loads``. Python's, NumPy's (legacy, ``Generator``, its ``bit_generator.state``) and
    torch's RNG states come back bitwise at any depth without ``allow_pickle``, warn nothing at
    save, and a restored RNG draws the numbers the saved one would have drawn."""
    import random

    saved = _rng_states()
    with CheckpointManager(str(tmp_path / "ck")) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "values that restore(..., allow_pickle=True) must unpickle"
            mgr.save(1, {**saved, "w": torch.ones(2)})
        for target in ({}, {**_blank(saved), "w": torch.zeros(2)}):
            mgr.restore(1, target, atomic=atomic)
            target.pop("w", None)
            _same_rng(_rng_states(), target)  # the same states made again (comparing draws from them)

    random.setstate(target["deep"]["tuple"][0][0])
    np.random.set_state(target["np"])
    torch.set_rng_state(target["torch"])
    draws = (random.random(), np.random.rand(3).tobytes(), torch.rand(3))
    random.setstate(saved["py"])
    np.random.set_state(saved["np"])
    torch.set_rng_state(saved["torch"])
    assert draws[:2] == (random.random(), np.random.rand(3).tobytes()) and torch.equal(draws[2], torch.rand(3))


def test_an_unsafe_value_in_a_list_is_refused_without_advice_to_allowlist_a_loader(tmp_path):
    """A value of a class outside the safe set inside a list is saved as a pickle that restore
    would have to ``pickle.loads``: the error said to allowlist ``pickle.loads`` (which would let
    any pickle run); it says to pass ``allow_pickle=True`` for a trusted checkpoint."""
    import async_ckpt

    with CheckpointManager(str(tmp_path / "ck")) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "saved values that restore(..., allow_pickle=True) ..."
        mgr.save(1, {"dates": [datetime.date(2020, 1, 2), np.arange(2)]})
        with pytest.raises(async_ckpt.UnsafeCheckpointError) as info:
            mgr.restore(1, {"dates": None})
        assert "allow_pickle=True" in str(info.value) and "add_safe_globals" not in str(info.value), info.value
        out = {"dates": None}
        mgr.restore(1, out, allow_pickle=True)
    assert out["dates"][0] == datetime.date(2020, 1, 2) and out["dates"][1].tobytes() == np.arange(2).tobytes()
