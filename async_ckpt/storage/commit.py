"""The two commit protocols (Orbax's ``AtomicRenameTemporaryPath`` / ``CommitFileTemporaryPath``).

Both write data files, then ``manifest.json``, then the ``COMMITTED`` marker (which vouches for
the manifest); they differ in where a step is written and how it takes its place:

* :class:`RenameCommit` (POSIX paths): written under ``.tmp-<step>-<token>/``, then renamed to
  ``<step>/`` (an older copy of the step is first renamed out of the way, marker and all) and
  the parent directory is fsynced. A directory another program wrote there is never moved: the
  commit raises :class:`~async_ckpt.errors.ForeignStepError` instead.
* :class:`MarkerCommit` (object stores, which have no rename): written in place under
  ``<step>/`` (or beside an existing copy, as ``<step>.<token>/``); the marker, written last,
  alone decides that it exists, and an older copy is removed once the new marker is written.

Either way a crash at any point leaves the old or the new copy of a step committed, never
neither (see :class:`~async_ckpt.storage.step_dirs.StepDirectories` for how a step's copy is
chosen). The protocols know a step's temporary and final paths (:class:`StepTarget`) and reach
the root's other step directories through :class:`Directories`; names come from
:mod:`async_ckpt.format.step_names`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Protocol

from ..format import step_names
from ..format.manifest import MANIFEST_NAME, MARKER_NAME, PENDING_NAME, Manifest, marker_bytes
from .storage import Storage

log = logging.getLogger("async_ckpt")


@dataclass
class StepTarget:
    """Where the files of one step being written go."""

    step: int
    path: str  # directory the data files are written into
    final: str  # directory of the committed step (the same as ``path`` in marker mode)


class Directories(Protocol):
    """What a commit protocol needs of the root's step directories
    (:class:`~async_ckpt.storage.step_dirs.StepDirectories` provides it)."""

    storage: Storage

    @property
    def naming(self) -> step_names.StepNaming:
        """How the root names its step directories."""

    def step_dir(self, step: int) -> str:
        """The canonical directory of ``step``."""

    def marked_copies(self, step: int) -> List[str]:
        """Names of the directories that hold a committed copy of ``step``."""

    def is_ours_incomplete(self, path: str) -> bool:
        """Whether ``path`` is an unmarked step directory async_ckpt wrote (or an empty one)."""

    def refuse_link(self, path: str, what: str) -> None:
        """Raise :class:`~async_ckpt.errors.StorageError` if ``path`` is a symbolic link."""

    def refuse_foreign(self, step: int) -> None:
        """Raise :class:`~async_ckpt.errors.ForeignStepError` if another program's directory
        holds ``step``'s canonical name."""

    def condemn_dir(self, path: str) -> str:
        """Unmark one step directory; return its path."""

    def remove(self, path: str) -> None:
        """Delete an unmarked step directory."""


class CommitProtocol(Protocol):
    """Where a step is written, how it is committed, and how a crashed commit is settled."""

    name: str

    def begin(self, dirs: Directories, step: int, token: str) -> StepTarget:
        """An empty directory to write ``step`` into; nothing committed is touched."""

    def finish(self, dirs: Directories, target: StepTarget, manifest: Manifest) -> None:
        """Manifest, then marker; then the step takes its place and an older copy retires."""

    def settle(self, dirs: Directories, step: int, winner: str, losers: List[str]) -> bool:
        """After a crash: put ``winner`` (the newest committed copy, already checked against its
        marker) in place; True if it moved. ``losers`` (older committed copies) are unmarked by
        the caller; a loser this call moved out of the way is taken off the list."""


def _write_manifest_and_marker(dirs: Directories, target: StepTarget, manifest: Manifest,
                               sync_entries: bool) -> None:
    st = dirs.storage
    mbytes = manifest.to_json()
    st.write_bytes(f"{target.path}/{MANIFEST_NAME}", mbytes)
    if sync_entries:
        st.fsync_dir(target.path)  # marker mode on a POSIX path: entries durable before the marker
    st.write_bytes_atomic(f"{target.path}/{MARKER_NAME}", marker_bytes(target.step, mbytes))
    st.fsync_dir(target.path)  # (no-op on object stores)


def _retire(dirs: Directories, path: str) -> None:
    """Remove an older copy of a step once the new one is committed. Past the commit point, so
    a failure must not fail (and then abort) the save: the copy is left for the next writer's
    recovery and cleanup, which retire superseded and unmarked copies."""
    try:
        dirs.remove(dirs.condemn_dir(path))
    except Exception as exc:
        log.warning("could not remove the replaced copy %s (the next writer removes it): %s", path, exc)


class RenameCommit:
    """Write under a temporary name, then one atomic rename into ``<step>/``."""

    name = "rename"

    def begin(self, dirs: Directories, step: int, token: str) -> StepTarget:
        path = dirs.storage.join(step_names.tmp_name(step, token))
        dirs.storage.makedirs(path)
        return StepTarget(step, path, dirs.step_dir(step))

    def finish(self, dirs: Directories, target: StepTarget, manifest: Manifest) -> None:
        st = dirs.storage
        _write_manifest_and_marker(dirs, target, manifest, sync_entries=False)
        trash = None
        dirs.refuse_link(target.final, f"commit step {target.step}")
        dirs.refuse_foreign(target.step)  # written there since begin(): never moved out of the way
        if st.exists(target.final):
            # The old copy keeps its marker until it is out of the way: a crash between the two
            # renames leaves the new copy committed under its temporary name.
            trash = st.join(step_names.trash_name(target.step, step_names.new_token()))
            st.rename(target.final, trash)
        try:
            st.rename(target.path, target.final)
        except BaseException:
            if trash is not None:  # the save fails: the old copy goes back where it was
                st.rename(trash, target.final)
            raise
        st.fsync_dir(st.root)
        if trash is not None:
            _retire(dirs, trash)

    def settle(self, dirs: Directories, step: int, winner: str, losers: List[str]) -> bool:
        st = dirs.storage
        if not step_names.is_kind(winner, step_names.TMP):
            return False
        tmp = st.join(winner)
        final = dirs.step_dir(step)
        if st.exists(final):
            if dirs.naming.name(step) not in losers and not dirs.is_ours_incomplete(final):
                return False  # a foreign directory holds the name: leave both alone
            st.rename(final, st.join(step_names.trash_name(step, step_names.new_token())))
            if dirs.naming.name(step) in losers:
                losers.remove(dirs.naming.name(step))  # moved to trash: the cleanup removes it
        st.rename(tmp, final)
        st.fsync_dir(st.root)
        return True


class MarkerCommit:
    """Write in place (or beside an existing copy); the marker written last commits."""

    name = "marker"

    def begin(self, dirs: Directories, step: int, token: str) -> StepTarget:
        st = dirs.storage
        final = dirs.step_dir(step)
        path = final if not st.exists(final) else st.join(dirs.naming.resave_name(step, token))
        st.makedirs(path)
        # Before any data: marks the unmarked directory as ours, so that cleanup may remove it
        # if this save never commits (a foreign directory without it is never touched).
        st.write_bytes(f"{path}/{PENDING_NAME}", b"")
        return StepTarget(step, path, path)

    def finish(self, dirs: Directories, target: StepTarget, manifest: Manifest) -> None:
        st = dirs.storage
        _write_manifest_and_marker(dirs, target, manifest, sync_entries=True)
        st.fsync_dir(st.root)
        try:
            st.rm(f"{target.path}/{PENDING_NAME}", recursive=False)  # tidy; the marker decides
        except Exception:  # the marker decides; the next writer's clean-up removes a leftover
            pass
        here = target.path.rstrip("/").rsplit("/", 1)[-1]
        for name in dirs.marked_copies(target.step):
            if name != here:
                _retire(dirs, st.join(name))

    def settle(self, dirs: Directories, step: int, winner: str, losers: List[str]) -> bool:
        return False  # nothing to move: the newest marked copy is the step wherever it is
