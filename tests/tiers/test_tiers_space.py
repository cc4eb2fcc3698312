"""A local tier on a small filesystem (a real tmpfs mount): a save that finds ``local_dir`` full
first deletes what retention drops once it commits (never the newest copy), a local write that
still fails for want of space is logged and raised by ``join()``/``close()`` (the bucket's saves go
on, and so do later local saves), and the newest step stays restorable throughout."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest
import torch

from async_ckpt import CheckpointManager
from async_ckpt.errors import CheckpointError

from ..conftest import assert_bitwise_equal, clone_tree

#: one local copy of ``state()`` on tmpfs: 256 KiB of data, its metadata and manifest (~280 KiB)
COPY_KIB = 280


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64 * 1024, generator=g), "i": torch.arange(16, dtype=torch.int64) * seed}


def zeros() -> dict:
    out = clone_tree(state(0))
    for v in out.values():
        v.zero_()
    return out


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a tmpfs of the size asked for (KiB) at a fresh directory; unmounted afterwards."""
    mounted = []

    def mount(kib: int) -> str:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        d = tmp_path / f"tmpfs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(d)], capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(str(d))
        return str(d)

    yield mount
    for d in mounted:
        subprocess.run(["umount", d], capture_output=True, timeout=30)


def local_steps(local: str) -> list:
    return sorted(int(n) for n in os.listdir(local) if n.isdigit())


def test_a_local_tier_with_room_for_two_and_a_half_copies_saves_every_step(tmp_path, small_tmpfs):
    """local_retention=2 on a tmpfs of ~2.5 copies: each save finds room for one copy only, so
    the oldest copy (which retention drops once the save commits) goes first; every step is
    saved locally, the newest is always restorable, and the bucket gets its steps."""
    local = os.path.join(small_tmpfs(COPY_KIB * 5 // 2), "ckpt")
    bucket = str(tmp_path / "bucket")
    saved = []
    with CheckpointManager(bucket, save_interval=3, local_dir=local, local_policy=1, local_retention=2,
                           on_saved=lambda st: saved.append((st.step, st.extra["tier"]))) as m:
        for step in range(1, 13):
            assert m.save_async(step, state(step))
            m.join()  # raises a failed local save
            out = zeros()
            assert m.restore(None, out) == step
            assert_bitwise_equal(out, state(step))
            assert local_steps(local) == list(range(max(1, step - 1), step + 1))
    assert sorted(s for s, t in saved if t == "local") == list(range(1, 13))
    assert sorted(s for s, t in saved if t == "persistent") == [3, 6, 9, 12]


def test_a_full_local_tier_does_not_stop_the_bucket_nor_later_saves(tmp_path, small_tmpfs, caplog):
    """Something else fills the tmpfs: the local writes fail for want of space (the newest copy
    is never deleted to make room). Each failure is logged at once and raised by join(), not by
    the next save_async: every step still goes to the bucket, the newest is restorable; once
    there is room again the local saves go on."""
    fs = small_tmpfs(COPY_KIB * 5 // 2)
    local, bucket = os.path.join(fs, "ckpt"), str(tmp_path / "bucket")
    with CheckpointManager(bucket, save_interval=1, local_dir=local, local_policy=1, local_retention=2) as m:
        assert m.save_async(1, state(1))
        m.join()
        filler = os.path.join(fs, "filler")
        with open(filler, "wb") as f:  # leaves less than one copy free
            f.write(b"\0" * ((COPY_KIB * 5 // 2 - COPY_KIB - 100) * 1024))
        with caplog.at_level(logging.ERROR, logger="async_ckpt"):
            for step in (2, 3, 4):  # each one's local write fails; none raises the one before
                assert m.save_async(step, state(step))
                m.wait_for_staging()
                out = zeros()
                assert m.restore(None, out) == step  # from the bucket
                assert_bitwise_equal(out, state(step))
        failed = [r.getMessage() for r in caplog.records if "async-ckpt-local-writer" in r.getMessage()]
        assert len(failed) == 3 and all("No space left on device" in msg for msg in failed), failed
        assert local_steps(local) == [1]  # the newest local copy was kept
        with pytest.raises(CheckpointError, match=r"step 2.*No space left.*\(and 2 more failed save\(s\): steps \[3, 4\]\)"):
            m.join()
        m.join()  # raised once
        os.remove(filler)
        for step in (5, 6, 7):
            assert m.save_async(step, state(step))
            m.join()  # the bucket idle before the next save: a busy upload would be skipped (tiers.md)
        assert local_steps(local) == [6, 7]
        assert m.step_tiers() == {7: ("local", "persistent"), 6: ("local", "persistent"), 5: ("persistent",),
                                  4: ("persistent",), 3: ("persistent",), 2: ("persistent",),
                                  1: ("persistent",)}
    with CheckpointManager(bucket, local_dir=local) as m:
        out = zeros()
        assert m.restore(None, out) == 7
        assert_bitwise_equal(out, state(7))


def test_a_blocking_save_raises_its_own_full_local_tier(tmp_path, small_tmpfs):
    """save() waits for its step in every tier: a local write that fails for want of space is
    raised by it (the bucket's copy is committed)."""
    fs = small_tmpfs(COPY_KIB // 2)
    local, bucket = os.path.join(fs, "ckpt"), str(tmp_path / "bucket")
    with CheckpointManager(bucket, save_interval=1, local_dir=local, local_policy=1) as m:
        with pytest.raises(CheckpointError, match="No space left"):
            m.save(1, state(1))
        assert m.step_tiers() == {1: ("persistent",)}


PROMOTE_RSS = r"""
import sys
from async_ckpt.cli import main
import torch  # noqa: F401  (imported before the baseline: its pages are not the copy's)

def status(key):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from now
    f.write("5")
before = status("VmRSS")
rc = main(["promote", sys.argv[1], "1", "--local-dir", sys.argv[2]])
print("RC", rc, "GROWTH_KIB", status("VmHWM") - before)
"""


def test_promote_copies_in_bounded_blocks_not_whole_files(tmp_path):
    """`async-ckpt promote` of a step with one 96 MiB data file: the process's peak RSS grows by
    far less than the file (it is streamed in blocks), and the bucket's copy restores bitwise."""
    import sys

    bucket, local = str(tmp_path / "bucket"), str(tmp_path / "local")
    big = {"w": torch.randn(24 * 2**20, generator=torch.Generator().manual_seed(5))}  # 96 MiB
    with CheckpointManager(bucket, save_interval=100, local_dir=local, local_policy=1) as m:
        m.save(1, big)
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", PROMOTE_RSS, bucket, local], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = [ln for ln in proc.stdout.splitlines() if ln.startswith("RC ")][-1].split()
    rc, growth = last[1], int(last[3])
    assert rc == "0", proc.stdout
    assert growth < 40 * 1024, f"promote grew the peak RSS by {growth // 1024} MiB for a 96 MiB file"
    shutil.rmtree(local)
    out = {"w": torch.zeros_like(big["w"])}
    with CheckpointManager(bucket) as m:
        assert m.restore(1, out) == 1
    assert_bitwise_equal(out, big)


def test_promote_refuses_a_damaged_local_copy_and_commits_nothing(tmp_path):
    """The streamed copy still checks every file: a flipped byte raises CorruptCheckpointError
    and leaves no step (and no partial directory) in the bucket."""
    from async_ckpt.errors import CorruptCheckpointError

    bucket, local = str(tmp_path / "bucket"), str(tmp_path / "local")
    with CheckpointManager(bucket, save_interval=100, local_dir=local, local_policy=1) as m:
        m.save(1, state(1))
        data = next(os.path.join(local, "1", f) for f in os.listdir(os.path.join(local, "1")) if f.endswith(".distcp"))
        with open(data, "r+b") as f:
            f.seek(1000)
            b = f.read(1)
            f.seek(1000)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            m.promote(1)
        assert m.step_tiers() == {1: ("local",)}
    assert [n for n in os.listdir(bucket) if not n.startswith(".async_ckpt")] == []
