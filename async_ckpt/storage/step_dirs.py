"""Where a step lives, which steps count as committed, and which copy of a step counts.

How a step is written and committed is the commit protocol's business
(:mod:`async_ckpt.storage.commit`: rename on POSIX paths, marker on object stores).

A step is committed when one of its directories (``<step>/``, ``<step>.<token>/`` or a
finished ``.tmp-<step>-<token>/`` whose final rename a crash interrupted) holds a marker. When
a crash leaves two committed copies of one step, the one with the later commit time in its
manifest is the step; the other is cleaned up by the next writer. So a re-save interrupted at
any point leaves the old or the new copy restorable, never neither. Restore then checks that
the marker vouches for the manifest and the manifest for every file.

A live writer moves and deletes steps while others read them (a rename commit puts
``.tmp-<step>-<token>/`` in place, retention unmarks a step, then deletes its files). A reader
opens a step's committed copy with :meth:`StepDirectories.read_committed`, which opens it again
where it is now when it moved meanwhile, and after a failed read asks
:meth:`StepDirectories.copy_changed` whether the copy it opened is still the step's committed
copy: a failure of a copy that a writer moved, replaced or deleted is never damage.

On local paths a step, re-save, temp or trash directory that is a symbolic link is *foreign*:
it is never listed as committed, restored, recovered, cleaned up or deleted (deleting "through"
it would remove whatever it points to), and writing a step whose directory is a link is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

from ..errors import (
    CorruptCheckpointError,
    ForeignStepError,
    InvalidArgumentError,
    StepNotFoundError,
    StorageError,
    StorageTimeoutError,
)
from ..format import step_names
from ..format.manifest import MANIFEST_NAME, MARKER_NAME, PENDING_NAME, Manifest, check_marker
from ..format.step_names import StepNaming
from .commit import CommitProtocol, MarkerCommit, RenameCommit, StepTarget
from .storage import MISSING, Storage

__all__ = ["ABORT_WAIT_S", "COMMIT_MODES", "DELETED", "StepDirectories", "StepCopy", "StepTarget"]

COMMIT_MODES = ("auto", "rename", "marker")
#: seconds a failed step's clean-up waits for each deletion on remote storage (one attempt; none after one timed out)
ABORT_WAIT_S = 5.0
#: times :meth:`StepDirectories.read_committed` opens a step again that a writer moved while it was opened
OPEN_ATTEMPTS = 5
#: :meth:`StepDirectories.copy_changed`'s answer for a step that is no longer committed
DELETED = "was deleted"


@dataclass(frozen=True)
class StepCopy:
    """The committed copy of a step as a reader opened it.

    Attributes:
        step: the step.
        where: its directory when it was opened.
        manifest: its manifest (checked against the marker).
        marker: the marker's bytes (they vouch for the manifest, so they name this save of the step).
    """

    step: int
    where: str
    manifest: Manifest
    marker: bytes


class StepDirectories:
    """Step directories under one root, and the commit protocol for them."""

    def __init__(self, storage: Storage, commit_mode: str = "auto", naming: Optional[StepNaming] = None) -> None:
        if commit_mode not in COMMIT_MODES:
            raise InvalidArgumentError(f"commit_mode must be one of {COMMIT_MODES}, got {commit_mode!r}")
        if commit_mode == "rename" and not storage.is_local:
            raise InvalidArgumentError(f"commit_mode='rename' needs a POSIX path; {storage.url!r} has no atomic rename")
        self.storage = storage
        mode = ("rename" if storage.is_local else "marker") if commit_mode == "auto" else commit_mode
        self.protocol: CommitProtocol = RenameCommit() if mode == "rename" else MarkerCommit()
        self._asked = naming  # the naming the caller asked for (None: as the root records it)
        self._naming: Optional[StepNaming] = None  # resolved at first use (one read of the record)
        self._recorded = False  # the root's record holds the naming

    @property
    def naming(self) -> StepNaming:
        """How the root names its steps: as :data:`~async_ckpt.format.step_names.NAMING_FILE`
        records it (read once), or the default when it records none. A naming asked for at
        construction must be the recorded one; a root without a record takes it (recorded at
        the first write) unless it holds committed steps of the default naming.

        Raises:
            InvalidArgumentError: the naming asked for is not the root's.
        """
        if self._naming is None:
            self._naming = self._resolve_naming()
        return self._naming

    def _resolve_naming(self) -> StepNaming:
        st = self.storage
        try:
            recorded: Optional[StepNaming] = StepNaming.from_json(st.read_bytes(st.join(step_names.NAMING_FILE)))
        except FileNotFoundError:
            recorded = None
        self._recorded = recorded is not None
        asked = self._asked
        if asked is None or asked == recorded:
            return recorded or step_names.DEFAULT
        if recorded is not None:
            raise InvalidArgumentError(f"{st.url} names its steps {recorded.describe()} (recorded in "
                                       f"{step_names.NAMING_FILE}), not {asked.describe()}: drop step_prefix=/"
                                       f"step_width= to use its naming, or save to another path")
        if asked != step_names.DEFAULT:
            ours = [n for n in st.marked_dirs(MARKER_NAME) if step_names.DEFAULT.parse(n) is not None]
            if ours:
                raise InvalidArgumentError(f"{st.url} holds steps named <step> ({', '.join(sorted(ours)[:5])}); "
                                           f"naming new ones {asked.describe()} would hide them: drop step_prefix=/"
                                           f"step_width=, or save to another path")
        return asked

    def record_naming(self) -> None:
        """Before the first write (the holder of the lease): record a naming other than the
        default in the root, so that readers find its steps unprompted."""
        naming = self.naming
        if self._recorded or naming == step_names.DEFAULT:
            return
        self.storage.write_bytes_atomic(self.storage.join(step_names.NAMING_FILE), naming.to_json())
        self._recorded = True

    @property
    def mode(self) -> str:
        """The commit protocol's name: ``"rename"`` or ``"marker"``."""
        return self.protocol.name

    # ---- names -------------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        """The canonical directory of ``step`` (``<root>/<step>``, or as the root's naming says)."""
        return self.storage.join(self.naming.name(step))

    def marker_path(self, step: int) -> str:
        return self.storage.join(self.naming.name(step), MARKER_NAME)

    def step_of(self, path: str) -> Optional[int]:
        """The step a step, re-save, temp or trash directory belongs to (None for other names),
        in the root's naming (:meth:`~async_ckpt.format.step_names.StepNaming.parse`)."""
        parsed = self.naming.parse(path)
        return parsed.step if parsed is not None else None

    def _is_step_name(self, name: str) -> bool:
        parsed = self.naming.parse(name)
        return parsed is not None and parsed.kind == step_names.STEP

    # ---- listing -----------------------------------------------------------------------------
    def _dir_names(self) -> List[str]:
        st = self.storage
        st.invalidate_cache()
        try:
            return [e["name"] for e in st.listdir(st.root) if e.get("type") == "directory"]
        except FileNotFoundError:
            return []

    def _marked(self) -> Dict[int, List[str]]:
        """step -> names of its directories that hold a commit marker (canonical name first)."""
        out: Dict[int, List[str]] = {}
        for n in self.storage.marked_dirs(MARKER_NAME):
            parsed = self.naming.parse(n)
            step = parsed.step if parsed is not None and parsed.kind in step_names.COMMITTABLE else None
            if step is not None and n not in out.get(step, []):
                out.setdefault(step, []).append(n)
        for names in out.values():
            names.sort(key=lambda n: (not self._is_step_name(n), n))
        return out

    def _commit_time(self, name: str) -> float:
        try:
            return Manifest.from_json(self.storage.read_bytes(self.storage.join(name, MANIFEST_NAME))).commit_time
        except Exception:  # an unreadable manifest: a copy that loses to any readable one
            return float("-inf")

    def _choose(self, names: List[str]) -> Tuple[str, List[str]]:
        """(the committed copy that counts, the superseded ones) among one step's marked dirs."""
        if len(names) == 1:
            return names[0], []
        # The latest commit wins; on a tie, the copy that is not the canonical directory (a
        # re-save written beside it).
        ranked = sorted(names, key=lambda n: (self._commit_time(n), not self._is_step_name(n)))
        return ranked[-1], ranked[:-1]

    def locations(self) -> Dict[int, str]:
        """step -> the directory (path) holding its committed copy, for every committed step."""
        return {step: self.storage.join(self._choose(names)[0]) for step, names in self._marked().items()}

    def committed_steps(self) -> List[int]:
        """Steps with a committed copy, ascending."""
        return sorted(self._marked())

    def _copies(self, step: int) -> List[str]:
        """Names of ``step``'s marked directories (as :meth:`_marked`). A listing that runs while
        a writer renames a directory may miss it (``readdir`` may return neither name): when it
        finds none on a local path, the canonical directory, where a rename commit puts the
        step, is checked directly."""
        names = self._marked().get(step)
        if names:
            return names
        st = self.storage
        final = self.step_dir(step)
        if st.is_local and not st.is_link(final) and st.exists(f"{final}/{MARKER_NAME}"):
            return [self.naming.name(step)]
        return []

    def locate(self, step: int) -> str:
        """The directory of ``step``'s committed copy; :class:`StepNotFoundError` if none."""
        names = self._copies(step)
        if not names:
            raise StepNotFoundError(f"no committed checkpoint for step {step} under {self.storage.url}", step=step)
        return self.storage.join(self._choose(names)[0])

    def marked_copies(self, step: int) -> List[str]:
        """Names of the directories that hold a committed copy of ``step``."""
        return list(self._marked().get(step, []))

    def foreign_steps(self) -> Dict[int, str]:
        """Step directories another program wrote (see :meth:`is_foreign`), by step.

        Returns:
            step -> the directory's path, for every ``<root>/<step>`` that holds no marker and
            that async_ckpt did not write (a plain DCP checkpoint, say); never a symbolic link.
        """
        marked = self._marked()
        out: Dict[int, str] = {}
        for name in self._dir_names():
            parsed = self.naming.parse(name)
            if parsed is None or parsed.kind != step_names.STEP or name in marked.get(parsed.step, ()):
                continue
            path = self.storage.join(name)
            if self.is_foreign(path):
                out[parsed.step] = path
        return dict(sorted(out.items()))

    def is_foreign(self, path: str) -> bool:
        """Whether ``path`` is a directory another program wrote: it exists, is no symbolic link
        (those are refused on their own), holds no marker and is not an incomplete step of ours
        (:meth:`is_ours_incomplete`).

        Args:
            path: a step directory's path.

        Returns:
            True for a foreign directory.
        """
        st = self.storage
        try:
            if st.is_link(path) or not st.exists(path) or st.exists(f"{path}/{MARKER_NAME}"):
                return False
        except FileNotFoundError:
            return False
        return not self.is_ours_incomplete(path)

    def refuse_foreign(self, step: int) -> None:
        """Raise :class:`ForeignStepError` if another program's directory holds ``step``'s name.

        Args:
            step: the step about to be written.

        Raises:
            ForeignStepError: ``<root>/<step>`` is foreign (:meth:`is_foreign`).
        """
        path = self.step_dir(step)
        if self.is_foreign(path):
            raise ForeignStepError(
                f"step {step}: refusing to save: {path} holds a checkpoint async_ckpt did not write (no "
                f"COMMITTED marker: plain dcp.save, torch_xla's or torchtitan's checkpointer), and async_ckpt never "
                f"replaces or deletes such a directory. restore({step}, state_dict) reads it; save it under "
                f"another root to import it (`async-ckpt import {path} NEW_ROOT`), or save another step",
                step=step, path=path)

    @staticmethod
    def new_token() -> str:
        """A fresh token for one save's directory names (:func:`~async_ckpt.format.step_names.new_token`)."""
        return step_names.new_token()

    # ---- writing -----------------------------------------------------------------------------
    def begin(self, step: int, token: Optional[str] = None) -> StepTarget:
        """Prepare an empty place to write ``step`` into. ``token`` must match across ranks.

        Nothing committed is touched: an existing copy of the step stays restorable until the
        new one is committed. A directory another program wrote under the step's name raises
        :class:`ForeignStepError` (:meth:`refuse_foreign`).
        """
        self.refuse_link(self.step_dir(step), f"write step {step}")
        self.refuse_foreign(step)
        self.record_naming()
        return self.protocol.begin(self, step, token or step_names.new_token())

    def commit(self, target: StepTarget, manifest: Manifest) -> None:
        """Write the manifest, then the marker; then put the step in place and retire any
        older copy of it (see :mod:`async_ckpt.storage.commit`)."""
        self.protocol.finish(self, target, manifest)

    def recover(self) -> List[int]:
        """Settle what a crashed writer left: return the steps whose committed copy moved.

        Per step, the newest committed copy is put in place by the commit protocol (rename
        mode: a finished ``.tmp-<step>-*`` is renamed into ``<step>/``); older committed copies
        are unmarked (then cleaned up as incomplete). Only for the holder of the writer lease.
        """
        st = self.storage
        done = []
        for step, names in sorted(self._marked().items()):
            if st.is_link(self.step_dir(step)):
                continue  # foreign: never moved, never written through
            try:
                winner, losers = self._choose(names)
                if losers or winner != self.naming.name(step):
                    # the copy that counts must vouch for itself before anything older goes
                    where = st.join(winner)
                    check_marker(st.read_bytes(f"{where}/{MARKER_NAME}"), st.read_bytes(f"{where}/{MANIFEST_NAME}"),
                                 where=where, step=step)
                if self.protocol.settle(self, step, winner, losers):
                    done.append(step)
                for name in losers:
                    self.condemn_dir(st.join(name))
            except (OSError, CorruptCheckpointError):
                continue  # cannot be moved now: left for the next writer
        return done

    def abort(self, target: StepTarget) -> None:
        """Best-effort removal of a step that failed before its commit. On remote storage each
        deletion is one attempt waited for at most :data:`ABORT_WAIT_S` (a failed upload's
        storage is often down: what is left is removed by the next writer's clean-up)."""
        try:
            self.storage.rm(f"{target.path}/{MARKER_NAME}", recursive=False, wait=ABORT_WAIT_S)
        except StorageTimeoutError:
            return  # not answering: the next writer's clean-up removes the step
        except Exception:  # best effort: the next writer's clean-up removes the step
            pass
        try:
            self.storage.rm(target.path, wait=ABORT_WAIT_S)
        except Exception:  # best effort: the next writer's clean-up removes the step
            pass

    def condemn(self, step: int) -> List[str]:
        """Make ``step`` no longer committed (every copy unmarked); return its directories, whose
        files :meth:`remove` deletes. Fast: one sentinel write and one marker removal per copy."""
        return [self.condemn_dir(self.storage.join(n)) for n in self._marked().get(step, [])]

    def condemn_dir(self, path: str) -> str:
        """Unmark one step directory. The pending sentinel goes in before the marker goes out, so
        a deletion cut short leaves a directory the startup cleanup recognises as ours. A
        directory that is a symbolic link raises :class:`StorageError`: nothing is written or
        deleted through it."""
        self.refuse_link(path, "delete " + path)
        try:
            self.storage.write_bytes(f"{path}/{PENDING_NAME}", b"")
        except FileNotFoundError:
            return path  # already gone
        try:
            self.storage.rm(f"{path}/{MARKER_NAME}", recursive=False)
        except FileNotFoundError:
            pass
        return path

    def remove(self, path: str) -> None:
        """Delete an unmarked step directory: everything but the sentinel first (a recursive
        delete may take the sentinel before the data, and a kill then left data that cleanup
        could not recognise), then the directory. A directory that holds a marker is committed
        and left alone; a symbolic link raises :class:`StorageError`."""
        self.refuse_link(path, "delete " + path)
        if self.storage.exists(f"{path}/{MARKER_NAME}"):
            return
        try:
            entries = self.storage.listdir(path)
        except FileNotFoundError:
            return
        for e in entries:
            if e["name"] != PENDING_NAME:
                self.storage.rm(f"{path}/{e['name']}")
        self.storage.rm(path)

    def delete(self, step: int) -> None:
        """Remove every copy of a step: markers first, so a half-deleted step never looks committed.
        A step directory that is a symbolic link raises :class:`StorageError`."""
        self.refuse_link(self.step_dir(step), f"delete step {step}")
        for path in self.condemn(step):
            self.remove(path)

    def is_ours_incomplete(self, path: str) -> bool:
        """An unmarked step directory that async_ckpt wrote (sentinel or manifest), or an empty one.

        A step-numbered directory with neither marker nor sentinel (e.g. a checkpoint written by
        torch_xla's manager or plain ``dcp.save``) is not ours: it is never listed, restored or
        removed. A symbolic link is never ours.
        """
        if self.storage.is_link(path):
            return False
        if self.storage.exists(f"{path}/{PENDING_NAME}") or self.storage.exists(f"{path}/{MANIFEST_NAME}"):
            return True
        try:
            return not self.storage.listdir(path)
        except OSError:
            return False

    def refuse_link(self, path: str, what: str) -> None:
        if self.storage.is_link(path):
            raise StorageError(f"refusing to {what}: {path} is a symbolic link (a foreign directory; async_ckpt "
                               "never writes or deletes through one)")

    def is_foreign_link(self, name: str) -> bool:
        """Whether the entry ``name`` under the root is a symbolic link (always False on object stores)."""
        return self.storage.is_link(self.storage.join(name))

    # ---- reading -----------------------------------------------------------------------------
    def read_manifest(self, step: int) -> Manifest:
        """The manifest of a committed step, checked against its marker (see :meth:`read_committed`)."""
        return self.read_committed(step).manifest

    def read_committed(self, step: int) -> StepCopy:
        """The committed copy of ``step``: its directory, its manifest checked against its marker,
        and the marker.

        A copy that a writer moves while it is opened (a rename commit puts its temporary
        directory in place; a re-save replaces it) is opened again where the step is now; one
        that a writer deletes meanwhile raises :class:`StepNotFoundError`, as a step that is not
        committed does. Only a failure of a copy that stayed where it was is damage.

        Args:
            step: the step.

        Returns:
            The copy.

        Raises:
            StepNotFoundError: ``step`` is not committed (or a step directory that is a link).
            CorruptCheckpointError: the marker or manifest is missing, unreadable, does not match
                the other, or is a directory or a link leading out of the step directory.
        """
        for attempt in range(OPEN_ATTEMPTS):
            where = self.locate(step)
            seen: List[bytes] = []  # the marker, once read
            try:
                return self._open_at(step, where, seen)
            except (StepNotFoundError, CorruptCheckpointError):
                marker = seen[0] if seen else None
                if attempt == OPEN_ATTEMPTS - 1 or not self._moved(step, where, marker):
                    raise
        raise AssertionError("unreachable")

    def _moved(self, step: int, where: str, marker: Optional[bytes]) -> bool:
        """Whether ``step``'s committed copy is no longer the one at ``where`` whose marker was
        ``marker`` (None: not read; then: whether ``where`` still holds a marker)."""
        names = self._copies(step)
        if not names or self.storage.join(self._choose(names)[0]) != where:
            return True
        now = self._marker_at(where)
        return now is None if marker is None else now != marker

    def _marker_at(self, where: str) -> Optional[bytes]:
        """The marker in ``where`` now (None: there is none; a marker that cannot be a file, a
        directory say, as the text of its problem)."""
        kpath = f"{where}/{MARKER_NAME}"
        problem = self.storage.file_problem(kpath, where)
        if problem is not None:
            return None if problem.startswith(MISSING) else problem.encode()
        try:
            return self.storage.read_bytes(kpath)
        except FileNotFoundError:
            return None

    def copy_changed(self, step: int, opened: Optional[StepCopy]) -> Optional[str]:
        """After a failed read of ``opened``: whether a writer moved, replaced or deleted it since
        (the failure is then the writer's doing, not damage).

        Args:
            step: the step.
            opened: the copy that was read (None: the step could not be opened).

        Returns:
            None when ``opened`` is still the step's committed copy (or, for None, the step is
            still committed); :data:`DELETED` when the step is no longer committed; else what
            happened to the copy (``"was moved"``, ``"was saved again"``).
        """
        names = self._copies(step)
        if not names:
            return DELETED
        if opened is None:
            return None
        where = self.storage.join(self._choose(names)[0])
        marker = self._marker_at(where)
        if marker is None:  # unmarked since it was listed: being deleted
            return DELETED if not self._copies(step) else "was moved"
        if marker != opened.marker:
            return "was saved again"
        return None if where == opened.where else "was moved"

    def _open_at(self, step: int, where: str, seen: List[bytes]) -> StepCopy:
        st = self.storage
        kpath = f"{where}/{MARKER_NAME}"
        problem = st.file_problem(kpath, where)
        if st.is_link(where) or problem == MISSING:
            raise StepNotFoundError(f"no committed checkpoint for step {step} under {st.url}", step=step)
        if problem is not None:
            raise CorruptCheckpointError(f"step {step}: {kpath}: commit marker {problem}", step=step, path=kpath)
        try:
            marker = st.read_bytes(kpath)
        except FileNotFoundError:
            raise StepNotFoundError(f"no committed checkpoint for step {step} under {st.url}",
                                    step=step) from None
        seen.append(marker)
        mpath = f"{where}/{MANIFEST_NAME}"
        problem = st.file_problem(mpath, where)
        if problem is not None:
            if problem == MISSING:
                problem = "manifest is missing"
            raise CorruptCheckpointError(f"step {step}: {mpath}: {problem}", step=step, path=mpath)
        try:
            mbytes = st.read_bytes(mpath)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"step {step}: {mpath}: manifest is missing", step=step,
                                         path=mpath) from None
        try:
            check_marker(marker, mbytes, where=where, step=step)
            m = Manifest.from_json(mbytes, where=mpath)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"step {step}: {exc}", step=step, path=exc.path) from exc
        if m.step != step:
            raise CorruptCheckpointError(f"step {step}: {mpath}: manifest says step {m.step}", step=step, path=mpath)
        return StepCopy(step, where, m, marker)

    def incomplete(self, exclude: Iterable[str] = ()) -> List[str]:
        """Paths of steps that never committed (temp dirs, unmarked step dirs, leftover trash);
        never a symbolic link."""
        skip: Set[str] = set(exclude)
        out = []
        for name in self._dir_names():
            path = self.storage.join(name)
            if path in skip or self.storage.is_link(path):
                continue
            parsed = self.naming.parse(name)
            if parsed is None:
                continue
            if parsed.kind == step_names.TRASH:
                out.append(path)
            elif parsed.kind == step_names.TMP and not self.storage.exists(f"{path}/{MARKER_NAME}"):
                out.append(path)
            elif (parsed.kind in (step_names.STEP, step_names.RESAVE)
                  and not self.storage.exists(f"{path}/{MARKER_NAME}") and self.is_ours_incomplete(path)):
                out.append(path)
        return out

