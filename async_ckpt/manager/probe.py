"""Probing a manager's persistent root: what it holds, whether it can be written, read.

A manager opens its root without writing to it (a read-only credential or mount lists and
restores all the same); the first save due there checks again (:meth:`RootProbe.ensure_writable`).
What the root holds besides async_ckpt's steps is said once, at opening
(:meth:`RootProbe.describe`: the diagnosis the ``async-ckpt`` command prints too).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from ..errors import NotACheckpointRootError, StorageError, warn_user
from ..format import step_names
from ..storage.diagnosis import PARENT_OF_ROOTS, STEP_DIR, diagnose, file_in_the_way, not_a_root_message
from ..storage.storage import Storage

log = logging.getLogger("async_ckpt")


class RootProbe:
    """What a manager knows of whether its persistent root can be written.

    Args:
        storage: the persistent root's storage.
        local_url: the local tier's URL (a root that cannot be written is then logged, the
            saves going to the local tier meanwhile), or None.
    """

    def __init__(self, storage: Storage, local_url: Optional[str]) -> None:
        self.storage = storage
        self.local_url = local_url
        self._problem: Optional[Exception] = None  # why the root could not be written at opening
        self._writable = False  # the root was found writable (checked by the first save due there)

    def open(self, *, read_only: bool) -> None:
        """At opening: the root is created and checked when possible; a root that cannot be
        written opens all the same when it can be read. A ``read_only`` manager creates and
        checks nothing (the root may not exist yet).

        Raises:
            NotACheckpointRootError: a file is in the way of the root.
            StorageError: the root can be neither written nor read (without a local tier).
        """
        if read_only:
            self._refuse_a_file()
            return
        self._writable = self._check_writable(quiet=True)
        if not self._writable:
            self._refuse_a_file()
        if not self._writable and self.local_url is None:
            self._check_readable()

    def describe(self) -> None:
        """Say at INFO that the root is new or empty (a typo'd path would otherwise restart a
        run from step 0 silently), and warn when it looks like a step directory, the parent of
        checkpoint roots, or holds only checkpoints of another kind (the diagnosis the
        ``async-ckpt`` command prints too: :func:`~async_ckpt.storage.diagnosis.diagnose`).
        Reads only; a root that cannot be listed is left to the calls that need it."""
        st = self.storage
        try:
            entries = st.listdir(st.root)
            findings = diagnose(st, entries)
            has_steps = any(e.get("type") == "directory" and step_names.is_kind(e["name"], step_names.STEP)
                            for e in entries)
            for f in findings:
                if f.kind in (STEP_DIR, PARENT_OF_ROOTS):
                    warn_user(f"the checkpoint path {f.message}")
                elif not has_steps:
                    warn_user(f"the checkpoint path {st.url} holds no async_ckpt steps: {f.message}")
            if not entries:
                log.info("checkpoint root %s is new and empty: nothing to restore (check the path if a run "
                         "should resume from it); the first save creates it", st.url)
        except Exception as exc:  # noqa: BLE001 - advice only: listing and restoring raise their own errors
            log.debug("could not list %s: %s", st.url, exc)

    def ensure_writable(self) -> None:
        """Before the first save due at the root (the primary rank): the root exists and can be
        written; once it was, never again.

        Raises:
            StorageError: it cannot be written (without a local tier; with one it is logged).
        """
        if not self._writable:
            self._writable = self._check_writable()

    def _refuse_a_file(self) -> None:
        """The root could not be created: raise :class:`NotACheckpointRootError` when a file is
        in the way (the root itself, or a parent of a local root), never to be a directory."""
        blocker = file_in_the_way(self.storage)
        if blocker is not None:
            raise NotACheckpointRootError(not_a_root_message("checkpoint path", self.storage, blocker)) \
                from self._problem

    def _check_readable(self) -> None:
        """The root could not be written when the manager was opened: raise that error unless
        the root can be read (a read-only mount or credential: listing and restoring work, the
        first save raises). A root whose bucket or parent directory does not exist, or that
        cannot be listed either (wrong credentials), raises now."""
        problem = self._problem
        if problem is None:
            return
        cause: Optional[BaseException] = problem
        while cause is not None:
            if isinstance(cause, (FileNotFoundError, NotADirectoryError, FileExistsError)):
                raise problem
            cause = cause.__cause__ or cause.__context__
        try:
            self.storage.listdir(self.storage.root)
            readable = True
        except Exception:  # noqa: BLE001 - neither readable: the writability error says why
            readable = False
        if not readable:
            raise problem

    def _check_writable(self, quiet: bool = False) -> bool:
        """Whether the root exists (it is created) and can be written. Otherwise raise
        :class:`StorageError`; with a local tier log it instead; ``quiet`` (opening the
        manager, which needs only read access): return False, logged at DEBUG."""
        st = self.storage
        try:
            try:
                st.makedirs(st.root)
            except (OSError, StorageError) as exc:
                raise StorageError(f"checkpoint path {st.url!r} cannot be written: {exc}") from exc
            st.check_writable()  # object stores: probe object (missing bucket, bad credentials)
            if st.is_local and not os.access(st.root, os.W_OK):
                raise StorageError(f"checkpoint path {st.url!r} is not writable")
        except StorageError as exc:
            if quiet:
                log.debug("%s cannot be written: %s", st.url, exc)
                self._problem = exc
                return False
            if self.local_url is None:
                raise
            log.warning("%s cannot be written now (saves go to local_dir %s meanwhile): %s",
                        st.url, self.local_url, exc)
            return False
        return True
