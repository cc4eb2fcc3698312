"""storage.backends: one backend per kind of storage, picked by the filesystem's protocol, each
keeping the behaviour Storage documents (object stores: no directories, one PUT per small
file, atomic writes without a temporary name)."""

from __future__ import annotations

import os
import uuid

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from async_ckpt.errors import StorageError
from async_ckpt.storage.backends import FsspecBackend, ObjectStoreBackend, PosixBackend
from async_ckpt.storage.backends.object_store import OBJECT_FILE_BYTES
from async_ckpt.storage.retry import RetryPolicy
from async_ckpt.storage.storage import Storage

from ..support import faulty_fs  # noqa: F401 - registers faulty://


def test_backend_is_picked_by_the_filesystem(tmp_path, memory_root):
    local = Storage(str(tmp_path))
    assert type(local._backend) is PosixBackend and local.is_local and local.max_file_bytes is None
    assert type(Storage("file://" + str(tmp_path))._backend) is PosixBackend
    for url in (memory_root, "faulty://" + str(tmp_path / "f")):
        st = Storage(url)
        assert type(st._backend) is FsspecBackend and not st.is_local and not st.length_checked_writes
        assert st.max_file_bytes is None
    for url, opts in (("gs://bucket/run", {"token": "anon"}), ("s3://bucket/run", {"anon": True})):
        st = Storage(url, opts)
        assert type(st._backend) is ObjectStoreBackend and not st.is_local and st.length_checked_writes
        assert st.max_file_bytes == OBJECT_FILE_BYTES and st.root == "bucket/run"


class _Spy(MemoryFileSystem):
    """An in-memory filesystem (its own store) that records the calls an object store gets."""

    protocol = ("spy-object-store",)
    cachable = False  # a fresh filesystem (calls, store) per test

    def __init__(self):
        super().__init__()
        self.store, self.pseudo_dirs = {}, [""]
        self.calls = []
        self._piping = False

    def pipe_file(self, path, value, **kw):
        self.calls.append(("pipe_file", path, len(value)))
        self._piping = True
        try:
            return super().pipe_file(path, value, **kw)
        finally:
            self._piping = False

    def makedirs(self, path, exist_ok=False):
        self.calls.append(("makedirs", path))
        return super().makedirs(path, exist_ok=exist_ok)

    def mv(self, *a, **kw):
        self.calls.append(("mv",) + a)
        return super().mv(*a, **kw)

    def _open(self, path, mode="rb", **kw):
        if "w" in mode and not self._piping:
            self.calls.append(("open", path))
        return super()._open(path, mode, **kw)


def _object_store_storage() -> tuple:
    st = Storage(f"memory://os-{uuid.uuid4().hex}")
    spy = _Spy()
    st._backend = ObjectStoreBackend(spy)
    return st, spy


def test_object_store_small_files_are_one_put_and_big_ones_stream():
    st, spy = _object_store_storage()
    st.makedirs(st.join("step"))
    assert spy.calls == [], "no directories on an object store (and never a bucket)"
    small = os.urandom(5000)
    with st.open_write(st.join("step", "small"), size_hint=len(small)) as f:
        f.write(small[:100])
        f.write(small[100:])
    assert spy.calls == [("pipe_file", st.join("step", "small"), len(small))]
    st.pipe_max_bytes = 1000
    with st.open_write(st.join("step", "big"), size_hint=len(small)) as f:
        f.write(small)
    assert spy.calls[1:] == [("open", st.join("step", "big"))]
    assert spy.cat_file(st.join("step", "small")) == small and spy.cat_file(st.join("step", "big")) == small


def test_object_store_atomic_write_is_one_put_without_a_temporary_name():
    st, spy = _object_store_storage()
    st.write_bytes_atomic(st.join("m.json"), b"{}")
    assert spy.calls == [("pipe_file", st.join("m.json"), 2)]


def test_generic_fsspec_atomic_write_renames_a_temporary_file():
    st = Storage(f"memory://g-{uuid.uuid4().hex}")
    spy = _Spy()
    st.fs = spy  # the backend uses whatever filesystem Storage is given
    st.makedirs(st.root)
    st.write_bytes_atomic(st.join("m.json"), b"{}")
    (put,), (mv,) = [c for c in spy.calls if c[0] == "pipe_file"], [c for c in spy.calls if c[0] == "mv"]
    assert put[1].startswith(st.join(".m.json.tmp-")) and mv[1:] == (put[1], st.join("m.json"))
    assert [e["name"] for e in st.listdir(st.root)] == ["m.json"] and st.read_bytes(st.join("m.json")) == b"{}"
    assert st.fs is spy and st._backend.fs is spy


def test_posix_backend_keeps_links_out_of_deletes_and_reads(tmp_path):
    st = Storage(str(tmp_path / "root"))
    st.makedirs(st.root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"x")
    os.symlink(outside, os.path.join(st.root, "link"))
    with pytest.raises(StorageError, match="symbolic link"):
        st.rm(st.join("link", "keep"))
    assert (outside / "keep").read_bytes() == b"x"
    assert st.is_link(st.join("link"))
    assert "outside the step directory" in st.file_problem(st.join("link"), st.root)
    st.write_bytes_atomic(st.join("a"), b"abc")
    assert sorted(os.listdir(st.root)) == ["a", "link"], "no temporary file left behind"
    buf = bytearray(2)
    assert st.read_into(st.join("a"), 1, memoryview(buf)) == 2 and bytes(buf) == b"bc"


def test_file_commit_writes_into_a_directory_it_does_not_own(tmp_path):
    """A framework's directory: each file is written under a hidden temporary name, renamed
    over its own name; nothing else there is touched; a link or a directory at a name is never
    replaced, and a failed write leaves no temporary."""
    from async_ckpt.storage.commit import FileCommit

    target = tmp_path / "disk" / "ckpt"
    target.mkdir(parents=True)
    (target / "users.txt").write_text("mine")
    (target / "old.bin").write_bytes(b"old")
    os.symlink(target, tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"keep")
    os.symlink(elsewhere, target / "linked.bin")
    (target / "adir").mkdir()
    dead = 2**22 + 1  # above any pid_max: a process that is gone
    (target / f".old.bin.tmp-{dead}-abcdef12").write_bytes(b"torn")  # what killed writes left
    (target / f".async-ckpt-{dead}-0123456789ab").mkdir()
    live = target / f".old.bin.tmp-{os.getpid()}-abcdef12"  # a write in progress: kept
    live.write_bytes(b"")

    commit = FileCommit(str(tmp_path / "ckpt"))
    commit.begin()
    assert sorted(n for n in os.listdir(target) if n.startswith(".")) == [live.name]
    live.unlink()
    commit.write("old.bin", lambda p: open(p, "wb").write(b"new"))
    names = commit.write_tree(lambda d: [open(os.path.join(d, n), "w").write(n) for n in ("a.json", "b.json")])
    for name in ("linked.bin", "adir"):
        with pytest.raises(StorageError, match="refusing to replace"):
            commit.write(name, lambda p: open(p, "wb").write(b"x"))

    def fails(p):
        open(p, "wb").write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(StorageError, match="No space left"):
        commit.write("c.bin", fails)
    commit.finish()
    assert names == ["a.json", "b.json"] and commit.files == {"old.bin": 3, "a.json": 6, "b.json": 6}
    assert os.path.islink(tmp_path / "ckpt") and elsewhere.read_bytes() == b"keep"
    assert sorted(os.listdir(target)) == ["a.json", "adir", "b.json", "linked.bin", "old.bin", "users.txt"]
    assert (target / "old.bin").read_bytes() == b"new" and (target / "users.txt").read_text() == "mine"


def test_object_store_probe_names_a_missing_bucket():
    st, spy = _object_store_storage()

    def missing(path, value, **kw):
        raise FileNotFoundError(path)

    spy.pipe_file = missing
    st.retry = RetryPolicy(attempts=1)
    with pytest.raises(StorageError, match="bucket does not exist"):
        st.check_writable()


def _resident_fraction(path: str) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore`` over a mapping of it)."""
    import ctypes
    import mmap

    import numpy as np

    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        arr = np.frombuffer(mm, dtype=np.uint8)
        rc = libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec)
        del arr
        mm.close()
    if rc != 0:
        pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    return sum(v & 1 for v in vec) / pages


def test_written_data_files_leave_the_page_cache_once_durable(tmp_path):
    """A save's files are dropped from the page cache after their fsync (posix_fadvise
    DONTNEED), so a checkpoint does not push the job's own cached data out (not on tmpfs)."""
    import torch

    from async_ckpt import CheckpointManager

    with open("/proc/mounts") as f:
        mounts = [line.split() for line in f]
    best = max((m for m in mounts if str(tmp_path).startswith(m[1])), key=lambda m: len(m[1]))
    if best[2] == "tmpfs":
        pytest.skip("tmp_path is on tmpfs: its pages are the files")
    sd = {"w": torch.randn(2**20)}  # 4 MiB
    for writer in ("thread", "process"):
        with CheckpointManager(str(tmp_path / writer), writer=writer) as mgr:
            mgr.save(1, sd)
        data = [os.path.join(tmp_path, writer, "1", n) for n in os.listdir(tmp_path / writer / "1")
                if n.endswith(".distcp")]
        assert data and all(_resident_fraction(p) < 0.1 for p in data), writer
