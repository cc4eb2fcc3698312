"""Lightning's ``AsyncCkptIO`` writes what ``TorchCheckpointIO`` writes, whatever the values.

A catalogue of values a Lightning checkpoint may hold (parameters kept by
``save_hyperparameters()``, tensor subclasses, attributes on tensors, views, conj/neg bits,
sparse, quantized, meta, ...) is saved with ``AsyncCkptIO`` and with Lightning's own
``TorchCheckpointIO``; the files must be equal byte for byte and load (``torch.load``) to equal
objects: type, class, ``requires_grad``, attributes, storage sharing, bits.
"""

from __future__ import annotations

import collections
import io
import warnings

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.fabric.plugins import TorchCheckpointIO  # noqa: E402

from async_ckpt import CheckpointError  # noqa: E402
from async_ckpt.integrations.lightning import AsyncCkptIO  # noqa: E402

from ..support.tree import assert_bitwise_equal  # noqa: E402


class TaggedTensor(torch.Tensor):
    """A tensor subclass (module level: ``torch.load`` finds it by name)."""


Pair = collections.namedtuple("Pair", "left right")


def _catalogue():
    torch.manual_seed(0)
    w = torch.randn(4, 6)
    tagged = torch.randn(3)
    tagged.note = "kept"  # an attribute set on a tensor
    sub = torch.randn(2, 2).as_subclass(TaggedTensor)
    sub.extra = {"k": 1}
    dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -3.0]])
    module = torch.nn.Linear(3, 2)  # a module kept by save_hyperparameters()
    module.weight.requires_grad_(False)
    cplx = torch.randn(3, dtype=torch.complex64)
    sd = collections.OrderedDict(a=torch.ones(2))
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    items = {
        "parameter (requires grad)": torch.nn.Parameter(torch.randn(3, 2)),
        "parameter (no grad)": torch.nn.Parameter(torch.randn(3), requires_grad=False),
        "leaf tensor requiring grad": torch.randn(2, requires_grad=True),
        "tensor subclass with attributes": sub,
        "tensor with attributes": tagged,
        "views sharing a storage": {"w": w, "row": w[1], "t": w.t(), "tied": w},
        "conj bit": cplx.conj(),
        "neg bit": torch.randn(3, dtype=torch.complex64).conj().imag,
        "sparse COO": dense.to_sparse(),
        "sparse CSR": dense.to_sparse_csr(),
        "sparse CSC": dense.to_sparse_csc(),
        "quantized qint8": torch.quantize_per_tensor(torch.randn(5), 0.1, 3, torch.qint8),
        "meta": torch.empty(3, 4, device="meta"),
        "bfloat16": torch.randn(5).to(torch.bfloat16),
        "float8_e4m3fn": torch.randn(4).to(torch.float8_e4m3fn),
        "complex128": torch.randn(3, dtype=torch.complex128),
        "bool / int64": [torch.tensor([True, False]), torch.arange(4)],
        "0-dim": torch.tensor(3.25),
        "non-contiguous": torch.arange(24.0).reshape(4, 6)[::2, 1::3],
        "empty": torch.empty(0, 3),
        "nested containers": {"d": {"l": [torch.ones(1), (torch.zeros(2), "s")]},
                              "nt": Pair(torch.ones(2), 7), "od": sd},
        "module object": module,
        "nested tensor": torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)]),
        "plain values": {"lr": 0.1, "name": "x", "none": None, "steps": [1, 2]},
    }
    if torch.cuda.is_available():  # staged by the batched CUDA copy; recorded location cuda:0
        g = torch.randn(4, 4, device="cuda")
        items["CUDA parameter and views"] = {"p": torch.nn.Parameter(g), "row": g[1], "t": g.t()}
        items["CUDA sparse"] = dense.cuda().to_sparse()
    return items


def _walk_equal(a, b, where, ptrs, seen):
    """Assert ``a`` and ``b`` are equal as torch.load rebuilt them (see the module docstring)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.requires_grad == b.requires_grad, f"{where}: requires_grad"
        assert a.layout == b.layout and a.dtype == b.dtype and a.device == b.device, f"{where}: layout/dtype/device"
        _walk_equal(dict(vars(a)), dict(vars(b)), f"{where}.__dict__", ptrs, seen)
        if a.is_nested:
            assert len(a.unbind()) == len(b.unbind()), f"{where}: components"
            for i, (x, y) in enumerate(zip(a.unbind(), b.unbind())):
                assert torch.equal(x, y), f"{where}[{i}]: bits"
            return
        assert a.shape == b.shape, f"{where}: shape"
        assert a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg(), f"{where}: conj/neg bit"
        if a.layout == torch.sparse_coo:
            _walk_equal(a._indices(), b._indices(), f"{where}.indices", ptrs, seen)
            _walk_equal(a._values(), b._values(), f"{where}.values", ptrs, seen)
            return
        if a.layout in (torch.sparse_csr, torch.sparse_csc):
            for name in ("crow_indices", "col_indices", "values") if a.layout == torch.sparse_csr else (
                    "ccol_indices", "row_indices", "values"):
                _walk_equal(getattr(a, name)(), getattr(b, name)(), f"{where}.{name}", ptrs, seen)
            return
        assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset(), f"{where}: strides"
        if a.is_meta:
            return
        if a.is_quantized:
            assert (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point()), where
            a, b = a.int_repr(), b.int_repr()
        sa, sb = a.untyped_storage(), b.untyped_storage()
        assert sa.nbytes() == sb.nbytes(), f"{where}: storage size"
        # storage sharing: one storage in one file is one storage in the other
        assert ptrs.setdefault(("a", sa.data_ptr()), sb.data_ptr()) == sb.data_ptr(), f"{where}: sharing"
        assert ptrs.setdefault(("b", sb.data_ptr()), sa.data_ptr()) == sa.data_ptr(), f"{where}: sharing"
        ba = torch.empty(0, dtype=torch.uint8).set_(sa)
        bb = torch.empty(0, dtype=torch.uint8).set_(sb)
        assert torch.equal(ba, bb), f"{where}: bits"
        return
    if id(a) in seen:
        return
    seen.add(id(a))
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys"
        for k in a:
            _walk_equal(a[k], b[k], f"{where}.{k}", ptrs, seen)
        if hasattr(a, "__dict__"):  # an OrderedDict's _metadata
            _walk_equal(dict(vars(a)), dict(vars(b)), f"{where}.__dict__", ptrs, seen)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            _walk_equal(x, y, f"{where}[{i}]", ptrs, seen)
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        _walk_equal(dict(vars(a)), dict(vars(b)), f"{where}.__dict__", ptrs, seen)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _compare(name, value, tmp_path, io_):
    ours, theirs = tmp_path / "ours.ckpt", tmp_path / "theirs.ckpt"
    ck = {"state_dict": {"value": value}, "hyper_parameters": {"value": value}, "global_step": 1}
    try:
        io_.save_checkpoint(ck, ours)
        io_.wait()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return f"refused ({type(exc).__name__})"
    TorchCheckpointIO().save_checkpoint(ck, theirs)
    a = torch.load(theirs, weights_only=False)
    b = torch.load(ours, weights_only=False)
    try:
        _walk_equal(a, b, name, {}, set())
    except AssertionError as exc:
        return f"different: {exc}"
    return "same bytes" if ours.read_bytes() == theirs.read_bytes() else "same after torch.load"


def test_lightning_catalogue_saves_what_torch_checkpoint_io_saves(tmp_path, capsys):
    io_ = AsyncCkptIO(log_stats=False)
    table = {name: _compare(name, v, tmp_path, io_) for name, v in _catalogue().items()}
    io_.teardown()
    assert len(table) >= 18
    with capsys.disabled():
        print("\n| value | AsyncCkptIO vs TorchCheckpointIO |\n| --- | --- |")
        for name, outcome in table.items():
            print(f"| {name} | {outcome} |")
    assert all(v == "same bytes" for v in table.values()), table


def test_lightning_whole_catalogue_in_one_checkpoint_is_torch_save_s_file(tmp_path):
    """All values in one checkpoint (views across entries): the file is ``torch.save``'s."""
    io_ = AsyncCkptIO(log_stats=False)
    ck = {"state_dict": _catalogue(), "global_step": 3}
    io_.save_checkpoint(ck, tmp_path / "x.ckpt")
    buf = io.BytesIO()
    torch.save(ck, buf)
    io_.teardown()
    assert (tmp_path / "x.ckpt").read_bytes() == buf.getvalue()


def test_lightning_parameters_of_a_saved_module_keep_requires_grad(tmp_path):
    """The issue's case: a module kept by ``save_hyperparameters()`` comes back with parameters
    that train (before: plain tensors with ``requires_grad=False``)."""
    io_ = AsyncCkptIO(log_stats=False)
    backbone = torch.nn.Linear(4, 2)
    io_.save_checkpoint({"hyper_parameters": {"backbone": backbone}}, tmp_path / "x.ckpt")
    io_.teardown()
    loaded = torch.load(tmp_path / "x.ckpt", weights_only=False)["hyper_parameters"]["backbone"]
    assert isinstance(loaded.weight, torch.nn.Parameter) and loaded.weight.requires_grad
    assert torch.equal(loaded.weight, backbone.weight)


def test_lightning_snapshot_is_taken_at_the_call_for_every_layout(tmp_path):
    """Storages are copied at the call: a later in-place change reaches no layout's file."""
    io_ = AsyncCkptIO(log_stats=False, sync_explicit=False)
    dense = torch.tensor([[0.0, 1.5], [2.0, 0.0]])
    ck = {"coo": dense.to_sparse(), "q": torch.quantize_per_tensor(dense, 0.5, 0, torch.quint8),
          "p": torch.nn.Parameter(dense.clone())}
    expect = io.BytesIO()
    torch.save(ck, expect)
    io_.save_checkpoint(ck, tmp_path / "x.ckpt")
    with torch.no_grad():
        ck["coo"]._values().add_(7)
        ck["p"].add_(7)
    io_.teardown()
    assert (tmp_path / "x.ckpt").read_bytes() == expect.getvalue()


def test_lightning_what_torch_save_refuses_is_refused_at_the_call(tmp_path):
    """One storage viewed as two dtypes (a complex tensor and its ``.imag``): ``torch.save``
    refuses it, and so does ``save_checkpoint``, at the call, with nothing written."""
    from async_ckpt import InvalidStateDictError

    c = torch.randn(3, dtype=torch.complex64)
    ck = {"c": c, "imag": c.imag}
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        torch.save(ck, io.BytesIO())
    io_ = AsyncCkptIO(log_stats=False)
    with pytest.raises(InvalidStateDictError, match="view the same data as different types"):
        io_.save_checkpoint(ck, tmp_path / "x.ckpt")
    io_.teardown()
    assert not (tmp_path / "x.ckpt").exists()


def _held_write(io_, tmp_path, name):
    """A save whose background write is held until the returned fault's ``release`` is set."""
    from ..support import faulty_fs  # noqa: F401  (registers faulty://)

    url = f"faulty://{tmp_path}/{name}"
    stuck = io_.filesystem(url).inject("write", f".{name}.*", "hang", times=1)
    ck = {"state_dict": {"w": torch.nn.Parameter(torch.arange(6.0))}, "global_step": 2}
    io_.save_checkpoint(ck, url)
    assert stuck.reached.wait(60)  # the write is in flight, held
    return url, stuck, ck


def test_lightning_load_checkpoint_right_after_an_async_save_finishes_the_write_first(tmp_path):
    import threading

    io_ = AsyncCkptIO(log_stats=False, sync_explicit=False)
    url, stuck, ck = _held_write(io_, tmp_path, "x.ckpt")
    out = {}
    reader = threading.Thread(target=lambda: out.setdefault("ck", io_.load_checkpoint(url)))
    reader.start()
    reader.join(1.0)
    assert reader.is_alive() and "ck" not in out  # waits for the write in flight
    stuck.release.set()
    reader.join(60)
    io_.teardown()
    w = out["ck"]["state_dict"]["w"]
    assert isinstance(w, torch.nn.Parameter) and torch.equal(w, ck["state_dict"]["w"])


def test_lightning_plain_torch_load_of_a_file_in_flight_names_wait(tmp_path):
    """``torch.load`` of a new name whose write is in flight raises an error naming ``wait()``
    (was: ``EOFError`` on the empty file that held the name)."""
    io_ = AsyncCkptIO(log_stats=False, sync_explicit=False)
    url, stuck, _ = _held_write(io_, tmp_path, "x.ckpt")
    with pytest.raises(CheckpointError, match=r"wait\(\)"):
        torch.load(tmp_path / "x.ckpt", weights_only=False)
    with pytest.raises(Exception, match="still_being_written"):  # weights_only: torch names the global
        torch.load(tmp_path / "x.ckpt", weights_only=True)
    stuck.release.set()
    io_.wait()
    assert torch.load(tmp_path / "x.ckpt", weights_only=False)["global_step"] == 2
    io_.teardown()


def test_lightning_load_checkpoint_refuses_a_placeholder_whose_write_never_committed(tmp_path):
    from async_ckpt import CorruptCheckpointError
    from async_ckpt.integrations.lightning import PLACEHOLDER

    (tmp_path / "x.ckpt").write_bytes(PLACEHOLDER)  # what a process killed mid-write leaves
    io_ = AsyncCkptIO(log_stats=False)
    with pytest.raises(CorruptCheckpointError, match="placeholder.*never committed"):
        io_.load_checkpoint(tmp_path / "x.ckpt")
    io_.teardown()


def test_lightning_inside_lightning_s_async_checkpoint_io_says_once_it_is_synchronous(tmp_path):
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    inner = AsyncCkptIO(log_stats=False)
    outer = AsyncCheckpointIO(inner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            outer.save_checkpoint({"w": torch.full((3,), float(i))}, tmp_path / f"{i}.ckpt")
        outer.teardown()
    said = [w for w in caught if "AsyncCheckpointIO" in str(w.message)]
    assert len(said) == 1 and "synchronous" in str(said[0].message), [str(w.message) for w in caught]
    assert [s.extra["synchronous"] for s in inner.stats] == [True] * 3
    for i in range(3):  # committed when the outer plugin's teardown returns
        assert torch.equal(torch.load(tmp_path / f"{i}.ckpt")["w"], torch.full((3,), float(i)))
    inner.teardown()


def test_lightning_each_save_calls_torch_save_once_as_torch_checkpoint_io_does(tmp_path):
    """Lightning's own tests count ``torch.save`` calls through a mock (``test_top_k``,
    ``test_model_checkpoint_no_extraneous_invocations``): one per save, as ``TorchCheckpointIO``,
    made by the time ``save_checkpoint`` returns (``on_train_end`` counts them while the last
    write may be pending); the background write does not go through ``torch.save``."""
    from unittest import mock

    io_ = AsyncCkptIO(log_stats=False)
    with mock.patch("torch.save", wraps=torch.save) as save:
        for i in range(3):
            io_.save_checkpoint({"w": torch.nn.Parameter(torch.full((2,), float(i)))}, tmp_path / f"{i}.ckpt")
            assert save.call_count == i + 1  # at the call, whatever the writer has done
        io_.wait()
        assert save.call_count == 3  # and none from the writes
    io_.teardown()
    assert torch.equal(torch.load(tmp_path / "2.ckpt", weights_only=False)["w"], torch.full((2,), 2.0))


def test_lightning_torch_save_is_called_at_the_call_not_by_the_background_write(tmp_path):
    """``on_train_end`` of Lightning's ``test_model_checkpoint_no_extraneous_invocations`` counts
    ``torch.save`` calls while the last write may still be pending: the count is made by the time
    ``save_checkpoint`` returns, even with the write held, and the write adds none."""
    from unittest import mock

    io_ = AsyncCkptIO(log_stats=False, sync_explicit=False, max_pending=2)
    with mock.patch("torch.save", wraps=torch.save) as save:
        url, stuck, ck = _held_write(io_, tmp_path, "held.ckpt")
        assert save.call_count == 1  # the held save's call was made before its write
        io_.save_checkpoint({"w": torch.nn.Parameter(torch.ones(2))}, tmp_path / "next.ckpt")
        assert save.call_count == 2  # queued behind the held write: counted all the same
        stuck.release.set()
        io_.wait()
        assert save.call_count == 2
    io_.teardown()
    assert_bitwise_equal(torch.load(tmp_path / "next.ckpt", weights_only=False), {"w": torch.ones(2)})


def test_lightning_torch_save_replaced_by_a_mock_is_called_once_per_save_and_the_file_is_written(tmp_path):
    """Lightning's ``test_top_k`` replaces ``torch.save`` by a plain mock (it pickles nothing) and
    counts its calls: one per save, at the call; the snapshot is still taken with torch's own
    pickling and the file written whole."""
    from unittest import mock

    io_ = AsyncCkptIO(log_stats=False, sync_explicit=False)
    states = [{"w": torch.nn.Parameter(torch.full((3,), float(i))), "step": i} for i in range(3)]
    with mock.patch("torch.save") as save:
        for i, st in enumerate(states):
            io_.save_checkpoint(st, tmp_path / f"{i}.ckpt")
            assert save.call_count == i + 1
        io_.wait()
        assert save.call_count == 3
    io_.teardown()
    for i, st in enumerate(states):
        assert_bitwise_equal(torch.load(tmp_path / f"{i}.ckpt", weights_only=False), st)
