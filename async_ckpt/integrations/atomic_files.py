"""The files the framework integrations write: atomic, durable, and checked before loading.

A file is written to a hidden temporary name next to it (:func:`tmp_name`, ending in
:data:`TMP_SUFFIX`), fsynced, then renamed into place (:func:`write_file`); what an interrupted
write left is removed by :func:`remove_stale_tmps`. :func:`verify_torch_file` checks a
``torch.save`` file before it is loaded.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

from ..errors import CorruptCheckpointError

TMP_SUFFIX = ".async-ckpt-tmp"


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory ``path`` durable.

    Best effort where the OS cannot open or fsync directories (errors are ignored).

    Args:
        path: the directory.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file under ``root``, then each directory.

    So a rename of ``root`` that follows publishes durable contents.

    Args:
        root: the directory tree.
    """
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(d)


def tmp_name(path: str) -> str:
    """A hidden temporary name next to ``path``: ``.<name>.<random>.async-ckpt-tmp``.

    Args:
        path: the file the temporary stands in for.

    Returns:
        The temporary's path.
    """
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")


def remove_stale_tmps(path: str) -> None:
    """Delete temporary files of ``path`` left by an interrupted write (errors are ignored).

    Args:
        path: the file whose temporaries (:func:`tmp_name`) are removed.
    """
    d, base = os.path.split(path)
    try:
        names = os.listdir(d or ".")
    except OSError:
        return
    prefix = f".{base}."
    for n in names:
        if n.startswith(prefix) and n.endswith(TMP_SUFFIX):
            try:
                os.remove(os.path.join(d, n))
            except OSError:
                pass


def write_file(path: str, write: Callable[[Any], None], *, fsync: bool = True) -> None:
    """Write a file atomically: to a temporary name, fsynced, then renamed to ``path``.

    On POSIX ``path`` is the old file or the complete new one, never torn; the temporary is
    removed if the write fails.

    Args:
        path: the file (its directory is created if missing).
        write: writes the content into the binary file object it is given.
        fsync: fsync the file and then its directory.

    Raises:
        OSError: the file cannot be written or renamed (what ``write`` raises passes through).
    """
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(d)


def verify_torch_file(f: Any, name: str) -> None:
    """Check a ``torch.save`` file: a complete zip whose records all match their stored CRC-32.

    A legacy (non-zip) file passes unchecked. ``f`` is left at its start.

    Args:
        f: the file, opened for binary reading and seekable.
        name: names the file in the error.

    Raises:
        CorruptCheckpointError: the file is empty, its zip structure is incomplete or a record
            fails its CRC-32 check.
    """
    import zipfile

    head = f.read(4)
    f.seek(0)
    if head != b"PK\x03\x04":
        if not head:
            raise CorruptCheckpointError(f"{name}: the checkpoint file is empty (a save of it that did not "
                                         "commit: the process ended while it was written)", path=name)
        return  # a legacy (non-zip) torch.save file: torch.load checks what it can
    try:
        with zipfile.ZipFile(f) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{name}: not a complete torch.save archive ({exc})", path=name) from exc
    finally:
        f.seek(0)
    if bad is not None:
        raise CorruptCheckpointError(f"{name}: record {bad!r} fails its CRC-32 check", path=name)
