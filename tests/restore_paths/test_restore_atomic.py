"""``restore(..., atomic=True)``: every file read and verified into buffers of the manager's
host buffer pool, within ``memory_budget_bytes``, before the target is written."""

from __future__ import annotations

import os

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.errors import CorruptCheckpointError, PartlyWrittenError, StagingBudgetError
from async_ckpt.format.crc import crc32c
from async_ckpt.format.unpickling import load_metadata
from async_ckpt.io import step_io
from async_ckpt.io.sinks import StagedFiles

from ..damage.test_durability import rewrite_manifest
from ..support.tree import assert_bitwise_equal, clone_tree
from .test_restore_data_at import _shift, big_state
from .test_restore_fast import _data_files, _flip_in_record, fresh_like, mixed_state


def _files_bytes(step_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(step_dir, n)) for n in _data_files(step_dir))


@pytest.fixture
def leases(monkeypatch):
    """Every lease the pools hand out: (the buffers' data pointers, sizes)."""
    from async_ckpt.staging.pool import HostBufferPool

    got = []
    real = HostBufferPool.acquire

    def spy(self, sizes, **kw):
        lease = real(self, sizes, **kw)
        got.append(([b.data_ptr() for b in lease.buffers], list(sizes)))
        return lease

    monkeypatch.setattr(HostBufferPool, "acquire", spy)
    return got


def _with_views(seed: int) -> dict:
    sd = mixed_state(seed)
    base = torch.randn(4, 256, 513, generator=torch.Generator().manual_seed(seed + 100))
    sd["model"]["view"] = base[1]  # a contiguous view at a storage offset
    sd["model"]["strided"] = base[:, 3, :7]  # not contiguous
    sd["model"]["param"] = torch.nn.Parameter(torch.randn(300, 300, generator=torch.Generator().manual_seed(seed)))
    return sd


def test_atomic_is_bitwise_the_direct_restore_and_stages_through_the_pool(tmp_path, leases):
    saved = _with_views(1)
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
    size = _files_bytes(os.path.join(root, "1"))
    leases.clear()  # the save's

    direct = fresh_like(_with_views(0))
    mgr = CheckpointManager(root)
    assert mgr.restore(1, direct) == 1
    assert leases == [], "the default restore reads straight into the target"
    atomic = fresh_like(_with_views(0))
    param = atomic["model"]["param"]
    assert mgr.restore(1, atomic, atomic=True) == 1
    assert_bitwise_equal(atomic, direct)
    assert_bitwise_equal(atomic, saved)
    assert atomic["model"]["param"] is param, "restored in place"
    # One lease of the data files' sizes, from the manager's pool, given back afterwards.
    assert len(leases) == 1 and sum(leases[0][1]) == size
    pool = mgr.stager.pool
    assert pool.leased_bytes == 0 and pool.allocated_bytes == size
    mgr.close()


def test_two_atomic_restores_reuse_the_pool_buffers_within_the_budget(tmp_path, leases):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, mixed_state(1))
        mgr.save(2, mixed_state(2))
    size = _files_bytes(os.path.join(root, "1"))
    leases.clear()  # the saves'
    budget = size + size // 2
    mgr = CheckpointManager(root, memory_budget_bytes=budget)
    pool = mgr.stager.pool
    target = fresh_like(mixed_state(0))
    mgr.restore(1, target, atomic=True)
    assert_bitwise_equal(target, mixed_state(1))
    allocations = pool.allocations
    assert allocations >= 1 and pool.allocated_bytes <= budget and pool.leased_bytes == 0
    mgr.restore(2, target, atomic=True)
    assert_bitwise_equal(target, mixed_state(2))
    assert pool.allocations == allocations, "no fresh allocation for the second restore"
    assert len(leases) == 2 and leases[1][0] == leases[0][0], "the very same buffers"
    assert pool.allocated_bytes <= budget and pool.leased_bytes == 0
    # saving afterwards stays within the budget too
    mgr.save(3, mixed_state(3))
    mgr.join()
    assert pool.allocated_bytes <= budget
    mgr.close()


@pytest.mark.parametrize("fqn", ["model.big", "small.p7"])
def test_flipped_byte_leaves_the_target_untouched_and_falls_back(tmp_path, fqn, leases, monkeypatch):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, mixed_state(1))
        mgr.save(2, mixed_state(2))
    _flip_in_record(os.path.join(root, "2"), fqn)
    leases.clear()  # the saves'

    # The damaged step, named: nothing written; the pool's buffers are back.
    mgr = CheckpointManager(root)
    target = fresh_like(mixed_state(0))
    before = clone_tree(target)
    writes = []
    real = step_io.read_direct
    monkeypatch.setattr(step_io, "read_direct", lambda *a, **k: (writes.append(1), real(*a, **k))[1])
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as ei:
        mgr.restore(2, target, atomic=True)
    assert "partly written" not in str(ei.value) and ei.value.step == 2
    assert_bitwise_equal(target, before)
    assert writes == [], "the damage is found before the copy into the target starts"
    assert len(leases) == 1 and mgr.stager.pool.leased_bytes == 0

    # restore(None): the older step's data lands.
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2"):
        assert mgr.restore(None, target, atomic=True) == 1
    assert_bitwise_equal(target, mixed_state(1))
    assert writes, "control: the spy sees the copy into the target where one is made"
    assert len(leases) == 3 and mgr.stager.pool.leased_bytes == 0
    mgr.close()

    # One step only: CorruptCheckpointError, the target as it was.
    solo = str(tmp_path / "solo")
    with CheckpointManager(solo) as mgr:
        mgr.save(5, mixed_state(5))
    _flip_in_record(os.path.join(solo, "5"), fqn)
    target = fresh_like(mixed_state(0))
    del target["optim"]["state"][3]  # an entry restore adds: taken out again on failure
    before = clone_tree(target)
    with pytest.warns(RuntimeWarning, match="skipping damaged step 5"):
        with pytest.raises(CorruptCheckpointError, match="passed verification") as ei:
            CheckpointManager(solo).restore(None, target, atomic=True)
    assert "partly written" not in str(ei.value)
    assert_bitwise_equal(target, before)


def test_budget_too_small_raises_before_touching_the_target(tmp_path, leases):
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, mixed_state(1))
    size = _files_bytes(os.path.join(root, "1"))
    leases.clear()  # the save's
    budget = size // 2
    mgr = CheckpointManager(root, memory_budget_bytes=budget)
    target = fresh_like(mixed_state(0))
    del target["optim"]["state"][3]
    before = clone_tree(target)
    for step in (1, None):  # restore(None) does not fall back: no other step would fit either
        with pytest.raises(StagingBudgetError) as ei:
            mgr.restore(step, target, atomic=True)
        msg = str(ei.value)
        assert f"{size} bytes" in msg and f"{budget} bytes" in msg and "memory_budget_bytes" in msg, msg
        assert "atomic=False" in msg and os.path.join(root, "1") in msg, msg
        assert_bitwise_equal(target, before)
    assert leases == [] and mgr.stager.pool.allocations == 0, "nothing allocated or read"
    # the default restore needs no staging memory
    assert mgr.restore(1, target) == 1
    assert_bitwise_equal(target, mixed_state(1))
    mgr.close()


class _Sub(torch.Tensor):
    """A tensor subclass: the direct path leaves it to DCP."""


def test_targets_the_direct_path_does_not_take_are_loaded_by_dcp_from_the_staged_buffers(tmp_path, monkeypatch):
    saved = mixed_state(1)
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, saved)
    target = fresh_like(mixed_state(0))
    target["model"]["big"] = torch.zeros_like(saved["model"]["big"]).as_subclass(_Sub)
    sources = []
    real = step_io.load_state_dict

    def spy(storage, *a, **k):
        sources.append(type(storage))
        return real(storage, *a, **k)

    monkeypatch.setattr(step_io, "load_state_dict", spy)
    mgr = CheckpointManager(root)
    mgr.restore(1, target, atomic=True)
    assert sources == [StagedFiles]
    assert torch.equal(target["model"]["big"].as_subclass(torch.Tensor).view(torch.uint8),
                       saved["model"]["big"].view(torch.uint8))
    target["model"]["big"] = target["model"]["big"].as_subclass(torch.Tensor)
    assert_bitwise_equal(target, saved)
    assert mgr.stager.pool.leased_bytes == 0 and mgr.stager.pool.allocations >= 1
    mgr.close()


@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_object_store_without_known_sizes_catches_a_file_of_another_size(change):
    """fsspec's memory:// (the size of a file is unknown until it is read): a data file one byte
    longer or shorter than the manifest says fails the atomic restore before any write."""
    import random

    import fsspec

    url = f"memory://atomic-{random.getrandbits(32):x}"
    with CheckpointManager(url) as mgr:
        mgr.save(1, mixed_state(1))
    fs = fsspec.filesystem("memory")
    target = fresh_like(mixed_state(0))
    assert CheckpointManager(url).restore(1, target, atomic=True) == 1
    assert_bitwise_equal(target, mixed_state(1))

    name = sorted(p for p in fs.ls(f"{url}/1", detail=False) if p.endswith(".distcp"))[0]
    data = fs.cat_file(name)
    fs.pipe_file(name, data + b"\0" if change == "longer" else data[:-1])
    target = fresh_like(mixed_state(0))
    before = clone_tree(target)
    with pytest.raises(CorruptCheckpointError, match="size is more than" if change == "longer" else "size is") as ei:
        CheckpointManager(url).restore(1, target, atomic=True)
    assert "partly written" not in str(ei.value) and os.path.basename(name) in str(ei.value)
    assert_bitwise_equal(target, before)


def _unreadable_record(step_dir: str, fqn: str) -> None:
    """Break ``fqn``'s record (its first byte: the zip's first header) and re-sign the step
    with the file's new CRC-32C: a consistent step whose record only fails when it is read."""
    with open(os.path.join(step_dir, ".metadata"), "rb") as f:
        md = load_metadata(f.read())
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    path = os.path.join(step_dir, info.relative_path)
    with open(path, "r+b") as f:
        f.seek(info.offset)
        b = f.read(1)
        f.seek(info.offset)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(path, "rb") as f:
        crc = crc32c(f.read())

    def edit(m):
        m.files[info.relative_path].crc32c = crc
        m.files[info.relative_path].records = None

    rewrite_manifest(step_dir, edit)


@pytest.mark.parametrize("problem", ["data offset", "unreadable record"])
def test_a_problem_found_while_placing_the_data_leaves_the_target_untouched(tmp_path, problem):
    """Files that verify, but a record whose data is not where the manifest says, or a record
    that cannot be read: found before the first write, the target as it was, then the older
    step restores."""
    root = str(tmp_path / "c")
    with CheckpointManager(root) as mgr:
        mgr.save(1, big_state(1))
        mgr.save(2, big_state(2))
    if problem == "data offset":
        _shift("large.save_path", 64, root, 2)
        match = "large.save_path.*offset the manifest gives"
    else:
        _unreadable_record(os.path.join(root, "2"), "small.p39")
        match = "small.p39.*cannot be read as a tensor"
    mgr = CheckpointManager(root)
    target = fresh_like(big_state(0))
    before = clone_tree(target)
    with pytest.raises(CorruptCheckpointError, match=match) as ei:
        mgr.restore(2, target, atomic=True)
    assert "partly written" not in str(ei.value) and not isinstance(ei.value, PartlyWrittenError)
    assert_bitwise_equal(target, before)
    with pytest.warns(RuntimeWarning, match="skipping damaged step 2"):
        assert mgr.restore(None, target, atomic=True) == 1
    expected = big_state(1)
    expected["large"]["grad"] = expected["large"]["grad"].detach()
    target["large"]["grad"] = target["large"]["grad"].detach()
    assert_bitwise_equal(target, expected)
    mgr.close()
