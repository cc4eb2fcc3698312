"""Local POSIX paths: plain files and ``os`` calls, ``fsync`` per file and directory, atomic
``rename``, early writeback with ``sync_file_range``, and never deleting through a link."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import sys
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

from ...errors import StorageError
from .base import MISSING, FileState, temp_name

WRITEBACK_BYTES = 8 * 2**20  # local files: disk writes start after every this many bytes


def open_nofollow(path: str, flags: int, mode: int = 0o644, *, dir_fd: Optional[int] = None) -> int:
    """``os.open`` that never follows a symbolic link in ``path``'s last component.

    Every file async_ckpt creates or writes under a checkpoint root is opened through it: a
    link planted there (a shared directory, a local tier under ``/dev/shm``) must never make
    a save, a deletion or the lease overwrite the file it points to.

    Args:
        path: the file (relative to ``dir_fd`` when given).
        flags: ``os.O_*`` flags; ``O_NOFOLLOW`` and ``O_CLOEXEC`` are added.
        mode: permissions of a file it creates.
        dir_fd: a directory descriptor ``path`` is relative to.

    Returns:
        The open file descriptor.

    Raises:
        StorageError: ``path`` is a symbolic link (nothing was opened or written).
        OSError: any other failure of ``os.open``.
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):  # a link: ELOOP, or ENOTDIR with O_DIRECTORY
            raise
        try:
            link = stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if not link:
            raise
        raise StorageError(f"refusing to write {path}: it is a symbolic link, and async_ckpt never writes "
                           f"through one under a checkpoint root (remove the link, or use a directory "
                           f"that only this job can write)") from exc


def open_own_file(path: str, flags: int, mode: int = 0o644, *, dir_fd: Optional[int] = None) -> int:
    """Open a file async_ckpt writes in place (:func:`open_nofollow`), refusing any that is not
    a regular file with exactly one name.

    A hard link planted under a checkpoint root (a step's pending sentinel, the writer lock,
    the stats log) is a second name of a file elsewhere: writing it in place would change that
    file, possibly outside the root. A new file always has one name; an existing one with
    more is left untouched. ``O_TRUNC`` is applied only after that check, and a FIFO is
    refused without waiting for a reader.

    Args:
        path: the file (relative to ``dir_fd`` when given).
        flags: ``os.O_*`` flags (``O_NOFOLLOW`` and ``O_CLOEXEC`` are added).
        mode: permissions of a file it creates.
        dir_fd: a directory descriptor ``path`` is relative to.

    Returns:
        The open file descriptor (blocking, as ``flags`` asked).

    Raises:
        StorageError: ``path`` is a symbolic link, a hard link (more than one name), or not a
            regular file (nothing was written).
        FileNotFoundError: ``path`` was removed by another program while it was being opened.
        OSError: any other failure of ``os.open``.
    """
    import fcntl

    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        fd = open_nofollow(path, (flags & ~os.O_TRUNC) | nonblock, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: a FIFO nobody reads
            raise
        raise StorageError(f"refusing to write {path}: it is not a regular file") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StorageError(f"refusing to write {path}: it is not a regular file, and async_ckpt writes only "
                               "its own files under a checkpoint root (remove it, or use a directory that only "
                               "this job can write)")
        if st.st_nlink == 0:
            # No name left: another program removed the file (or its directory) since it was opened.
            raise FileNotFoundError(errno.ENOENT, "removed by another program while async_ckpt opened it to write "
                                    "(was its directory deleted while a save was pending? wait() before removing it)",
                                    path)
        if st.st_nlink != 1:
            raise StorageError(f"refusing to write {path}: it is a hard link to another file ({st.st_nlink} names), "
                               "and async_ckpt never writes in place through one: that would change the file "
                               "behind its other names, maybe outside the checkpoint root (remove it, or use a "
                               "directory that only this job can write)")
        if nonblock and not flags & nonblock:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~nonblock)
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def refuse_replacing(path: str) -> None:
    """Raise :class:`StorageError` if a symbolic link or a directory is at ``path``: a file
    written by its name replaces only a file there, never what a link or a directory holds."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise StorageError(f"refusing to replace {path}: it is a symbolic link, and async_ckpt never replaces "
                           "one it did not write (remove the link, or save to another directory)")
    if stat.S_ISDIR(st.st_mode):
        raise StorageError(f"refusing to replace {path}: a directory is at that name (remove it, or save to "
                           "another directory)")


class PosixBackend:
    """A local filesystem (see :class:`~.base.Backend`)."""

    is_local = True
    length_checked_writes = False
    keeps_crc32c = False
    default_max_file_bytes: Optional[int] = None
    client_retries = False
    atomic_puts = False
    probe_writes = False

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def normalize_root(self, root: str) -> str:
        return os.path.abspath(root)

    def endpoint(self) -> Optional[str]:
        return None

    def url_of(self, path: str) -> str:
        return path

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    @contextmanager
    def open_write(self, path: str, size_hint: Optional[int], *, block_size: int,
                   pipe_max_bytes: int) -> Iterator[Any]:
        """A plain file; flushed and fsynced on exit, its writeback started as it fills, and its
        pages then dropped from the page cache (:func:`drop_behind`)."""
        f = os.fdopen(open_own_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb")
        try:
            w = _WritebackFile(f)
            yield w
            f.flush()
            w.start_writeback()
            os.fsync(f.fileno())
            drop_behind(f.fileno())
        finally:
            f.close()

    def write_bytes(self, path: str, data: bytes) -> None:
        with self.open_write(path, None, block_size=0, pipe_max_bytes=0) as f:
            f.write(data)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def write_file_atomic(self, path: str, write_to: Callable[[str], None]) -> int:
        """A fresh temporary file beside ``path`` (created empty here: a regular file of one
        name), written by ``write_to``, fsynced, then renamed over ``path`` unless a link or a
        directory is there; the temporary is removed if anything fails."""
        refuse_replacing(path)
        tmp = temp_name(path)
        os.close(open_own_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        try:
            write_to(tmp)
            fd = open_own_file(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            refuse_replacing(path)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return size

    def remove_file(self, path: str) -> None:
        os.unlink(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def share(self, src: str, dst: str) -> bool:
        if os.path.islink(src) or os.path.islink(dst):
            raise StorageError(f"refusing to share {src} as {dst}: a symbolic link (async_ckpt never writes "
                               "through one)")
        try:
            os.link(src, dst)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
        shutil.copyfile(src, dst)  # a filesystem without hard links: a copy, then made durable
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return False

    def before_delete(self, path: str, root: str) -> None:
        """Raise :class:`StorageError` if a directory between ``root`` and ``path`` is a link."""
        rel = os.path.relpath(os.path.abspath(path), root)
        if rel == os.curdir or rel == os.pardir or rel.startswith(os.pardir + os.sep):
            return  # not below the root (the root itself may well be a link)
        cur = root
        for part in rel.split(os.sep)[:-1]:
            cur = os.path.join(cur, part)
            if os.path.islink(cur):
                raise StorageError(f"refusing to delete {path}: {cur} is a symbolic link, and async_ckpt never "
                                   "deletes through one")

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def file_problem(self, path: str, inside: str) -> Optional[str]:
        """It must exist, be a regular file (a directory in its place is damage), and, if it is a
        symbolic link, resolve to a file inside ``inside``."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return MISSING
        except NotADirectoryError:
            return f"{MISSING} (a parent is not a directory)"
        if stat.S_ISLNK(st.st_mode):
            real, base = os.path.realpath(path), os.path.realpath(inside)
            if os.path.commonpath([real, base]) != base or real == base:
                return f"is a symbolic link to {real!r}, outside the step directory"
            try:
                st = os.stat(path)
            except OSError:
                return "is a dangling symbolic link"
        if stat.S_ISDIR(st.st_mode):
            return "is a directory, not a file"
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        return None

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        with open(path, "rb") as f:
            f.seek(start)
            return f.readinto(out)

    def open_ranges(self, path: str) -> "_PosixRanges":
        return _PosixRanges(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def file_state(self, path: str) -> FileState:
        st = os.lstat(path)  # a link in a step's place is not the file the step wrote
        if not stat.S_ISREG(st.st_mode):
            return FileState(st.st_size)  # no identity: read (and refused) if anything is to be taken from it
        return FileState(st.st_size, None, (st.st_dev, st.st_ino, st.st_mtime_ns), st.st_ctime_ns, st.st_nlink)

    def ls(self, path: str) -> List[Dict[str, Any]]:
        return self.fs.ls(path, detail=True)

    def marked(self, root: str, marker: str) -> List[str]:
        """A listing taken again while the root changed under it (:func:`listdir_settled`);
        symbolic links left out."""
        try:
            names = listdir_settled(root)
        except FileNotFoundError:
            return []
        return [n for n in names if not os.path.islink(os.path.join(root, n))
                and os.path.exists(os.path.join(root, n, marker))]


#: times a local listing is taken again because the directory changed while it was read
LIST_ATTEMPTS = 3


def listdir_settled(path: str) -> List[str]:
    """``os.listdir(path)``, taken again (up to :data:`LIST_ATTEMPTS` times) while the directory
    changed during the listing: ``readdir`` concurrent with a rename in the directory (a writer's
    rename commit) may return neither the old name nor the new one."""
    names: List[str] = []
    for _ in range(LIST_ATTEMPTS):
        before = os.stat(path)
        names = os.listdir(path)
        after = os.stat(path)
        if (before.st_mtime_ns, before.st_ctime_ns, before.st_ino) == (after.st_mtime_ns, after.st_ctime_ns,
                                                                      after.st_ino):
            break
    return names


class _PosixRanges:
    """One file descriptor; each read is ``preadv`` straight into the caller's buffer (no
    intermediate copy, no shared file position, so threads may read concurrently)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self.known_size: Optional[int] = os.fstat(self._fd).st_size
        except BaseException:
            os.close(self._fd)
            raise

    def read_into(self, start: int, out: memoryview) -> int:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        got, want = 0, len(out)
        while got < want:
            n = os.preadv(self._fd, [out[got:]], start + got)
            if n <= 0:
                break
            got += n
        return got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _load_sync_file_range() -> Optional[Callable[[int, int, int], None]]:
    """Linux ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``: start writing a
    range of dirty pages to disk and return without waiting. ``None`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # CDLL releases the GIL in the call
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE


_sync_file_range = _load_sync_file_range()


def drop_behind(fd: int) -> None:
    """Drop a file's pages from the page cache once they are on disk (``fsync`` done):
    ``posix_fadvise(POSIX_FADV_DONTNEED)``.

    A checkpoint is read back seldom (a restart, a promote), while the pages the training job
    itself reads (its data set through the loader) are read all the time: without this, every
    save would push as many bytes of them out of the cache as the checkpoint holds, and they
    would stay out until read from disk again. A hint only: where it is missing it does
    nothing; on tmpfs (``/dev/shm``) the pages are the file and stay.
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        try:
            advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # a hint: a filesystem that refuses it keeps the pages


class _WritebackFile:
    """A local file being written, whose pages start going to disk while the rest is produced.

    Without it, nothing reaches the disk before the final ``fsync``, which then waits for the
    whole file: producing the bytes (for many small tensors, mostly Python) and writing them
    run one after the other. Kicking off the writeback of every full ``WRITEBACK_BYTES`` as it
    is written overlaps the two; the ``fsync`` still decides durability. A hint only: where
    ``sync_file_range`` is missing or fails, the file is simply written as before.
    """

    def __init__(self, f: Any, every: Optional[int] = None) -> None:
        self._f = f
        self._every = every if every is not None else WRITEBACK_BYTES
        self._written = 0
        self._started = 0  # bytes before this offset have had their writeback started

    def write(self, b: Any) -> int:
        n = self._f.write(b)
        self._written += n
        if self._written - self._started >= self._every:
            self._f.flush()
            self.start_writeback()
        return n

    def start_writeback(self) -> None:
        """Start (not wait for) the disk writes of everything written and flushed so far."""
        if _sync_file_range is not None and self._written > self._started:
            _sync_file_range(self._f.fileno(), self._started, self._written - self._started)
        self._started = self._written

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()
