"""Reading host memory by address (async_ckpt/addresses.py), on ordinary host memory."""

from __future__ import annotations

import pytest
import torch

from async_ckpt import addresses
from async_ckpt.addresses import gather, host_bytes


def _source(seed=0, n=1 << 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g), g


def test_host_bytes_is_a_view_of_the_memory_at_an_address():
    src, _ = _source()
    view = host_bytes(src.data_ptr() + 3, 100)  # an unaligned start
    assert view.data_ptr() == src.data_ptr() + 3 and view.numel() == 100
    assert torch.equal(view, src[3:103])
    src[5] += 1
    assert view[2] == src[5], "a view, not a copy"


@pytest.mark.parametrize("split", [False, True], ids=["one range", "split ranges"])
def test_gather_reads_exactly_the_windows_asked_for(split, monkeypatch):
    """Windows at arbitrary (unaligned, repeated, unordered) addresses land in their rows, bit
    for bit; rows not asked for stay untouched, also in a strided destination."""
    if split:  # addresses too far apart for one unfolded range: gathered range by range
        monkeypatch.setattr(addresses, "MAX_UNFOLDED", 1 << 18)
    src, g = _source()
    base = src.data_ptr()
    for n in (1, 3, 8, 100, 4096):
        starts = torch.randint(0, src.numel() - n, (257,), generator=g)
        starts[7] = starts[3]  # the same window twice
        dest = torch.full((258, n + 5), 7, dtype=torch.uint8)
        out = dest[:257, 2:2 + n]  # strided rows, as RecordBatch writes into its records
        gather(starts + base, n, out)
        for k in range(257):
            s = int(starts[k])
            assert torch.equal(out[k], src[s: s + n]), (n, k)
        assert bool((dest[257] == 7).all()) and bool((dest[:, :2] == 7).all()) and bool((dest[:, 2 + n:] == 7).all())
