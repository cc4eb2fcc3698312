"""The optional JSON-lines log of every committed save's :class:`~async_ckpt.stats.SaveStats`."""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Union

from ..errors import InvalidArgumentError
from ..stats import DEFAULT_STATS_LOG, SaveStats, check_stats_relpath
from .backends.posix import open_nofollow, open_own_file
from .storage import Storage

log = logging.getLogger("async_ckpt")


class StatsLog:
    """Appends one JSON line per committed save to a file under the checkpoint root.

    On a local path the file is opened in append mode, written and fsynced for each save. Object
    stores cannot append, so there the log is kept in memory (seeded once with the file's
    existing content) and the whole object is rewritten after each save: a few hundred bytes
    per save, and a reader always sees a complete file. Two processes logging to the same
    object-store file would overwrite each other's lines; only rank 0 of a process group logs.
    A failure to write the log is logged as a warning and never fails the save. The log never
    creates the checkpoint root (see :meth:`append`).

    Args:
        storage: the checkpoint root.
        relpath: the log's path relative to the root.

    Raises:
        InvalidArgumentError: ``relpath`` is absolute, a URL, leaves the root (``..``) or would
            collide with step directories.
    """

    def __init__(self, storage: Storage, relpath: str = DEFAULT_STATS_LOG) -> None:
        self.storage = storage
        self.relpath = check_stats_relpath(relpath)
        self.path = storage.join(self.relpath)
        self._lock = threading.Lock()
        self._buf: Optional[bytearray] = None

    def _open_local(self) -> int:
        """Open the log for appending below the root, creating its directories one by one (so a
        root that vanishes meanwhile is not re-created: ``FileNotFoundError``). Neither the file
        nor a directory below the root is followed if it is a symbolic link, and a log file with
        another name (a hard link) is refused (``StorageError``): the log never appends to what a
        link planted in the root points to."""
        *dirs, name = self.relpath.split("/")
        fd = os.open(self.storage.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            for part in dirs:
                if not part or part == ".":
                    continue
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
                sub = open_nofollow(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = sub
            return open_own_file(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, dir_fd=fd)
        finally:
            os.close(fd)

    @classmethod
    def from_option(cls, storage: Storage, option: Union[bool, str, os.PathLike, None]) -> Optional["StatsLog"]:
        """The log a manager's ``stats_log=`` option asks for.

        Args:
            storage: the checkpoint root.
            option: ``None``/``False``: no log; ``True``: ``<root>/save_stats.jsonl``; a str or
                ``os.PathLike``: that path relative to the root.

        Returns:
            The log, or None.

        Raises:
            InvalidArgumentError: ``option`` is of another type, or not a valid relative path.
        """
        if option is None or option is False:
            return None
        if option is True:
            return cls(storage)
        if isinstance(option, (str, os.PathLike)):
            return cls(storage, os.fspath(option))
        raise InvalidArgumentError(f"stats_log must be a bool or a relative path, got {type(option).__name__}")

    def append(self, stats: SaveStats) -> None:
        """Write one record; never raises (a failure is logged as a warning).

        The manager calls it on rank 0 only. On a local path the record is written only while the
        checkpoint root exists (otherwise skipped, with a debug log): the log never creates the
        root, so a root that went away (a mount gone) stays away and the saves there fail.

        Args:
            stats: the committed save's statistics.
        """
        try:
            line = (stats.to_json() + "\n").encode()
            with self._lock:
                if self.storage.is_local:
                    if not os.path.isdir(self.storage.root):
                        log.debug("not writing the stats log %s: the checkpoint root %s does not "
                                  "exist (it is never created here)", self.path, self.storage.root)
                        return
                    with os.fdopen(self._open_local(), "ab") as f:
                        f.write(line)
                        f.flush()
                        os.fsync(f.fileno())
                else:
                    if self._buf is None:
                        try:
                            self._buf = bytearray(self.storage.read_bytes(self.path))
                        except FileNotFoundError:
                            self._buf = bytearray()
                        if self._buf and not self._buf.endswith(b"\n"):
                            self._buf += b"\n"
                    self._buf += line
                    self.storage.write_bytes(self.path, bytes(self._buf))
        except Exception as exc:  # statistics must never break a committed save
            log.warning("could not write the stats log %s: %s", self.path, exc)
