"""Where a step lives, how it is committed, and which steps count as committed.

Commit protocols (Orbax calls them ATOMIC_RENAME and COMMIT_FILE):

* ``rename`` (POSIX paths): the step is written under ``.tmp-<step>-<token>/`` (data files,
  then ``manifest.json``, then the ``COMMITTED`` marker, each fsynced), then renamed to
  ``<step>/`` in one atomic ``rename`` and the parent directory is fsynced.
* ``marker`` (object stores, which have no rename): the step is written in place under
  ``<step>/`` and the ``COMMITTED`` marker, written last, alone decides that it exists.

Either way, a step is listed only when its marker exists; restore then checks that the marker
vouches for the manifest and the manifest for every file.

On local paths a step, temp or trash directory that is a symbolic link is *foreign*: it is
never listed as committed, restored, recovered, cleaned up or deleted (deleting "through" it
would remove whatever it points to), and writing a step whose directory is a link is refused.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

from ..errors import CorruptCheckpointError, StepNotFoundError, StorageError
from .fs import MISSING, Storage
from .manifest import MANIFEST_NAME, MARKER_NAME, PENDING_NAME, Manifest, check_marker, marker_bytes

_STEP_RE = re.compile(r"^\d+$")
_TMP_RE = re.compile(r"^\.tmp-(\d+)-[0-9a-f]+$")
_TRASH_RE = re.compile(r"^\.trash-(\d+)-[0-9a-f]+$")

COMMIT_MODES = ("auto", "rename", "marker")


@dataclass
class StepTarget:
    """Where the files of one step being written go."""

    step: int
    path: str  # directory the data files are written into
    final: str  # directory of the committed step


class CheckpointLayout:
    """Step directories under one root, and the commit protocol for them."""

    def __init__(self, storage: Storage, commit_mode: str = "auto") -> None:
        if commit_mode not in COMMIT_MODES:
            raise ValueError(f"commit_mode must be one of {COMMIT_MODES}, got {commit_mode!r}")
        if commit_mode == "rename" and not storage.is_local:
            raise ValueError(f"commit_mode='rename' needs a POSIX path; {storage.url!r} has no atomic rename")
        self.storage = storage
        self.mode = ("rename" if storage.is_local else "marker") if commit_mode == "auto" else commit_mode

    # ---- names -------------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return self.storage.join(str(step))

    def marker_path(self, step: int) -> str:
        return self.storage.join(str(step), MARKER_NAME)

    @staticmethod
    def step_of(path: str) -> Optional[int]:
        """The step a step, temp or trash directory belongs to (None for other names)."""
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if _STEP_RE.match(name):
            return int(name)
        m = _TMP_RE.match(name) or _TRASH_RE.match(name)
        return int(m.group(1)) if m else None

    # ---- writing -----------------------------------------------------------------------------
    def begin(self, step: int, token: Optional[str] = None) -> StepTarget:
        """Prepare an empty place to write ``step`` into. ``token`` must match across ranks."""
        final = self.step_dir(step)
        self._refuse_link(final, f"write step {step}")
        if self.mode == "rename":
            path = self.storage.join(f".tmp-{step}-{token or uuid.uuid4().hex[:12]}")
        else:
            path = final
            if self.storage.exists(final):
                self.delete(step)  # re-saving a step replaces it: unmark first, then clear
        self.storage.makedirs(path)
        if self.mode != "rename":
            # Before any data: marks the unmarked <step>/ as ours, so that cleanup may remove it
            # if this save never commits (a foreign directory without it is never touched).
            self.storage.write_bytes(f"{path}/{PENDING_NAME}", b"")
        return StepTarget(step, path, final)

    def commit(self, target: StepTarget, manifest: Manifest) -> None:
        """Write the manifest, then the marker, then (rename mode) move the step into place."""
        st = self.storage
        mbytes = manifest.to_json()
        st.write_bytes(f"{target.path}/{MANIFEST_NAME}", mbytes)
        if self.mode != "rename":
            st.fsync_dir(target.path)  # marker mode on a POSIX path: entries durable before the marker
        st.write_bytes_atomic(f"{target.path}/{MARKER_NAME}", marker_bytes(target.step, mbytes))
        st.fsync_dir(target.path)  # (no-op on object stores)
        if self.mode != "rename":
            st.fsync_dir(st.root)
            try:
                st.rm(f"{target.path}/{PENDING_NAME}", recursive=False)  # tidy; the marker decides
            except Exception:
                pass
            return
        trash = None
        self._refuse_link(target.final, f"commit step {target.step}")
        if st.exists(target.final):
            trash = st.join(f".trash-{target.step}-{uuid.uuid4().hex[:12]}")
            st.write_bytes(f"{target.final}/{PENDING_NAME}", b"")  # unmarked, but recognisably ours
            st.rm(f"{target.final}/{MARKER_NAME}", recursive=False)
            st.rename(target.final, trash)
        st.rename(target.path, target.final)
        st.fsync_dir(st.root)
        if trash is not None:
            st.rm(trash)

    def recover(self) -> List[int]:
        """Finish rename commits that a crash interrupted; return the steps put in place.

        A ``.tmp-<step>-*`` directory whose marker vouches for its manifest was completely
        written (the marker is written and fsynced last); if no committed ``<step>/`` exists
        (a crash between unmarking the old copy and the final rename of a re-save), it is
        renamed into place. Rename mode only, and only while no save of this root is running.
        """
        if self.mode != "rename":
            return []
        st = self.storage
        done = []
        for e in st.listdir(st.root):
            m = _TMP_RE.match(e["name"])
            if not m or e.get("type") != "directory":
                continue
            step, tmp = int(m.group(1)), st.join(e["name"])
            if st.is_link(tmp) or st.is_link(self.step_dir(step)):
                continue  # foreign: never moved, never written through
            if st.exists(self.marker_path(step)):
                continue  # a committed copy exists: this one is stale and gets cleaned up
            try:
                check_marker(st.read_bytes(f"{tmp}/{MARKER_NAME}"), st.read_bytes(f"{tmp}/{MANIFEST_NAME}"),
                             where=tmp, step=step)
                final = self.step_dir(step)
                if st.exists(final):
                    if not self.is_ours_incomplete(final):
                        continue  # a foreign directory holds the name: leave both alone
                    st.rename(final, st.join(f".trash-{step}-{uuid.uuid4().hex[:12]}"))
                st.rename(tmp, final)
                st.fsync_dir(st.root)
            except (OSError, CorruptCheckpointError):
                continue  # never completed (or cannot be moved): left to the cleanup
            done.append(step)
        return done

    def abort(self, target: StepTarget) -> None:
        """Best-effort removal of a step that failed before its commit."""
        try:
            if self.mode == "marker":
                self.storage.rm(f"{target.path}/{MARKER_NAME}", recursive=False)
            self.storage.rm(target.path)
        except Exception:
            pass

    def delete(self, step: int) -> None:
        """Remove a step: its marker first, so a half-deleted step never looks committed.

        The pending sentinel goes in before the marker goes out, so a deletion cut short leaves
        a directory that the startup cleanup recognises as ours and removes. A step directory
        that is a symbolic link raises :class:`StorageError`: nothing is deleted through it.
        """
        self._refuse_link(self.step_dir(step), f"delete step {step}")
        try:
            self.storage.write_bytes(f"{self.step_dir(step)}/{PENDING_NAME}", b"")
        except FileNotFoundError:
            return  # already gone
        self.storage.rm(self.marker_path(step), recursive=False)
        d = self.step_dir(step)
        # Everything but the sentinel first: a recursive delete may take it before the data,
        # and a kill then left data that cleanup could not recognise (found by the crash trials).
        for e in self.storage.listdir(d):
            if e["name"] != PENDING_NAME:
                self.storage.rm(f"{d}/{e['name']}")
        self.storage.rm(d)

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

    def _refuse_link(self, path: str, what: str) -> None:
        if self.storage.is_link(path):
            raise StorageError(f"refusing to {what}: {path} is a symbolic link (a foreign directory; async_ckpt "
                               "never writes or deletes through one)")

    def is_foreign_link(self, name: str) -> bool:
        """Whether the entry ``name`` under the root is a symbolic link (always False on object stores)."""
        return self.storage.is_link(self.storage.join(name))

    # ---- reading -----------------------------------------------------------------------------
    def committed_steps(self) -> List[int]:
        """Steps whose commit marker exists, ascending (never a step directory that is a link)."""
        st = self.storage
        st.invalidate_cache()
        if st.is_local:
            import os

            try:
                names = os.listdir(st.root)
            except FileNotFoundError:
                return []
            return sorted(int(n) for n in names
                          if _STEP_RE.match(n) and not os.path.islink(os.path.join(st.root, n))
                          and os.path.exists(os.path.join(st.root, n, MARKER_NAME)))
        try:
            found = st.retry.call(lambda: st.fs.glob(st.join("*", MARKER_NAME)), f"list {st.root}")
        except FileNotFoundError:
            return []
        steps = []
        for p in found:
            parts = p.rstrip("/").split("/")
            if len(parts) >= 2 and _STEP_RE.match(parts[-2]):
                steps.append(int(parts[-2]))
        return sorted(set(steps))

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of a committed step, checked against its marker.

        A marker or manifest that is a directory, or a link leading out of the step directory,
        is damage (:class:`CorruptCheckpointError`); a step directory that is a link is not a
        committed step (:class:`StepNotFoundError`).
        """
        where = self.step_dir(step)
        kpath = self.marker_path(step)
        st = self.storage
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
        return m

    def check_step(self, step: int) -> Tuple[Manifest, Dict[str, str]]:
        """A cheap check of a committed step that reads no data: the marker must vouch for the
        manifest (else :class:`CorruptCheckpointError`, as :meth:`read_manifest`), and every
        file the manifest lists must be a regular file inside the step directory with the size
        the manifest gives. Returns the manifest and, per file that fails, what is wrong (an
        empty dict: the step passed).

        A step that passes can still fail checks that read contents (checksums, DCP
        metadata); one that fails is damaged whatever its contents.
        """
        man = self.read_manifest(step)
        st = self.storage
        where = self.step_dir(step)
        listed: Optional[Dict[str, Dict]] = None
        if not st.is_local:  # one listing gives every size
            listed = {e["name"]: e for e in st.listdir(where)}
        problems: Dict[str, str] = {}
        for name, rec in sorted(man.files.items()):
            path = f"{where}/{name}"
            if listed is not None:
                e = listed.get(name)
                if e is None:
                    problems[name] = MISSING
                    continue
                if e.get("type") == "directory":
                    problems[name] = "is a directory, not a file"
                    continue
                size = int(e["size"]) if e.get("size") is not None else st.size(path)
            else:
                problem = st.file_problem(path, where)
                if problem is not None:
                    problems[name] = problem
                    continue
                size = st.size(path)
            if size != rec.size:
                problems[name] = f"size is {size} bytes, manifest says {rec.size}"
        return man, problems

    def incomplete(self, exclude: Iterable[str] = ()) -> List[str]:
        """Paths of steps that never committed (temp dirs, unmarked step dirs, leftover trash);
        never a symbolic link."""
        skip: Set[str] = set(exclude)
        out = []
        for e in self.storage.listdir(self.storage.root):
            name = e["name"]
            path = self.storage.join(name)
            if path in skip or e.get("type") != "directory" or e.get("islink") or self.storage.is_link(path):
                continue
            if _TMP_RE.match(name) or _TRASH_RE.match(name):
                out.append(path)
            elif (_STEP_RE.match(name) and not self.storage.exists(f"{path}/{MARKER_NAME}")
                  and self.is_ours_incomplete(path)):
                out.append(path)
        return out
