"""Review findings of the two tiers (issue 21): each test fails without its fix."""

from __future__ import annotations

import json
import os

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.errors import StorageError

from .conftest import assert_bitwise_equal
from .test_tiers import state, zeros


@pytest.fixture
def roots(tmp_path):
    return str(tmp_path / "bucket"), str(tmp_path / "local")


def test_an_unlistable_bucket_and_an_empty_local_tier_raise_the_listing_error(roots, monkeypatch):
    """A fresh node (empty local_dir) and a bucket that is down: 'no checkpoint' would make the
    job start from scratch (and its saves' retention later drop the bucket's real steps)."""
    path, local = roots
    with CheckpointManager(path) as plain:
        plain.save(1, state(1))
    mgr = CheckpointManager(path, local_dir=local)

    def down():
        raise StorageError(f"{path}: connection refused")

    monkeypatch.setattr(mgr.layout, "committed_steps", down)
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        with pytest.raises(StorageError, match="connection refused"):
            mgr.restore(None, zeros())
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        with pytest.raises(StorageError, match="connection refused"):
            mgr.latest_step()
    with pytest.warns(RuntimeWarning, match="cannot be listed"):
        with pytest.raises(StorageError, match="connection refused"):
            mgr.all_steps()
    monkeypatch.undo()
    out = zeros()
    assert mgr.restore(None, out) == 1
    assert_bitwise_equal(out, state(1))
    mgr.close()
