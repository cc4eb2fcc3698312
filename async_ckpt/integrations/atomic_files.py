"""Single files of the framework integrations, written and checked through storage/.

:func:`write_file` writes one file atomically by :class:`~async_ckpt.storage.commit.FileCommit`
(the commit of every framework save: a temporary name beside the file, fsync, rename; never
through a link); :func:`remove_stale_tmps` removes what an interrupted write of a file left;
:func:`verify_torch_file` checks a ``torch.save`` file before it is loaded.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

from ..errors import CorruptCheckpointError
from ..storage.backends.base import TEMP_INFIX
from ..storage.commit import FileCommit


def tmp_name(path: str) -> str:
    """A hidden temporary name next to ``path``: ``.<name>.<random>.async-ckpt-tmp``.

    For an upload moved into place afterwards (remote paths).

    Args:
        path: the file the temporary stands in for.

    Returns:
        The temporary's path.
    """
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}.{uuid.uuid4().hex[:12]}.async-ckpt-tmp")


def remove_stale_tmps(path: str) -> None:
    """Delete temporary files of ``path`` left by an interrupted write (errors are ignored).

    Args:
        path: the file whose temporaries (``.<name>.tmp-...``) are removed.
    """
    d, base = os.path.split(path)
    try:
        names = os.listdir(d or ".")
    except OSError:
        return
    prefix = f".{base}{TEMP_INFIX}"
    for n in names:
        if n.startswith(prefix):
            try:
                os.remove(os.path.join(d, n))
            except OSError:
                pass


def write_file(path: str, write: Callable[[Any], None], *, fsync: bool = True) -> None:
    """Write a file atomically: to a temporary name, fsynced, then renamed to ``path``.

    ``path`` is the old file or the complete new one, never torn; the temporary is removed if
    the write fails; a symbolic link or a directory at ``path`` is never replaced.

    Args:
        path: the file (its directory is created if missing).
        write: writes the content into the binary file object it is given.
        fsync: also fsync the directory (the file itself always is).

    Raises:
        StorageError: the file cannot be written or renamed, or a link is at ``path``.
    """
    commit = FileCommit(os.path.dirname(os.path.abspath(path)), fsync=fsync)
    commit.begin()

    def write_to(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f)

    commit.write(os.path.basename(path), write_to)
    commit.finish()


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
