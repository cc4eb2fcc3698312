"""What a path given as a checkpoint root holds when it is not one: one step's directory, the
parent of checkpoint roots, or checkpoints of another kind (Lightning ``.ckpt`` files, Hugging
Face ``checkpoint-N`` directories, a plain DCP checkpoint).

One diagnosis for every caller: the manager warns with it when it opens such a root, and the
``async-ckpt`` command prints it (``ls``) or adds it to its "no committed checkpoint" errors.
Reads only: one listing of the root (and of at most 20 subdirectories for the parent of roots).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..format import step_names
from ..format.manifest import MANIFEST_NAME, MARKER_NAME
from .storage import Storage

#: a step's directory under the root
STEP_DIR = "step_dir"
#: a directory whose subdirectories are checkpoint roots
PARENT_OF_ROOTS = "parent_of_roots"
LIGHTNING = "lightning"
HUGGINGFACE = "huggingface"
DCP = "dcp"

LIGHTNING_HINT = ("a torch.save file written by Lightning, e.g. through async_ckpt.integrations.lightning's "
                  "AsyncCkptIO; inspect it with torch.load(FILE, weights_only=False), resume with "
                  "Trainer.fit(..., ckpt_path=FILE)")
HF_HINT = ("Hugging Face Trainer checkpoint directories (HF's own layout, e.g. written by "
           "async_ckpt.integrations.transformers' AsyncCkptCallback); resume with "
           "trainer.train(resume_from_checkpoint=True), inspect trainer_state.json in each")
DCP_HINT = ("a torch.distributed.checkpoint (DCP) checkpoint not written by async_ckpt (no COMMITTED "
            "marker, no manifest.json); import it into an async_ckpt root, see docs/migration.md")
_HF_RE = re.compile(r"^checkpoint-\d+$")
_HINTS = {LIGHTNING: f"Lightning checkpoint files: {LIGHTNING_HINT}", HUGGINGFACE: HF_HINT,
          DCP: f"the root is {DCP_HINT}"}


@dataclass(frozen=True)
class Finding:
    """One thing a path holds that makes it something else than a checkpoint root.

    Attributes:
        kind: :data:`STEP_DIR`, :data:`PARENT_OF_ROOTS`, :data:`LIGHTNING`,
            :data:`HUGGINGFACE` or :data:`DCP`.
        names: the entries that show it (sorted).
        message: one sentence: what the path looks like and what to do.
        suggestion: the path to pass instead (a step directory's root, one of the roots
            under a parent), or None.
    """

    kind: str
    names: Tuple[str, ...]
    message: str
    suggestion: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        """The finding as JSON: ``kind``, ``names``, ``message``, ``suggestion``."""
        return {"kind": self.kind, "names": list(self.names), "message": self.message,
                "suggestion": self.suggestion}


def _natural(name: str) -> Tuple[str, int]:
    m = re.search(r"(\d+)$", name.rsplit(".", 1)[0])
    return (name[: m.start()] if m else name, int(m.group(1)) if m else -1)


def _is_dir(entry: Dict[str, Any]) -> bool:
    return entry.get("type") == "directory"


def other_kinds(entries: Sequence[Dict[str, Any]]) -> List[Finding]:
    """Checkpoints of other kinds among a root's entries, which async_ckpt does not list:
    Lightning ``.ckpt`` files, Hugging Face ``checkpoint-N`` directories (or the root being one),
    and the root being a plain DCP checkpoint itself (a ``.metadata`` without async_ckpt's
    manifest; a step directory of async_ckpt is :func:`diagnose`'s :data:`STEP_DIR`).

    Args:
        entries: the root's listing (``Storage.listdir``).

    Returns:
        One finding per kind, by kind.
    """
    names = {e["name"] for e in entries}
    found: Dict[str, List[str]] = {}
    for e in entries:
        name = e["name"]
        if name.startswith("."):
            if name == ".metadata" and not _is_dir(e) and MANIFEST_NAME not in names:
                found.setdefault(DCP, []).append(name)
            continue  # a hidden temporary (an integration's write in flight) is not a checkpoint
        if name.endswith(".ckpt") and not _is_dir(e):
            found.setdefault(LIGHTNING, []).append(name)
        elif _HF_RE.match(name) and _is_dir(e):
            found.setdefault(HUGGINGFACE, []).append(name)
        elif name == "trainer_state.json":  # the path is one checkpoint-N directory
            found.setdefault(HUGGINGFACE, []).append(".")
    out = []
    for kind, hits in sorted(found.items()):
        ordered = tuple(sorted(hits, key=_natural))
        shown = ", ".join(ordered[:5]) + (f", ... ({len(ordered)} in all)" if len(ordered) > 5 else "")
        out.append(Finding(kind, ordered, f"found {shown}: {_HINTS[kind]}; async_ckpt does not list these"))
    return out


def diagnose(storage: Storage, entries: Optional[Sequence[Dict[str, Any]]] = None,
             name: Optional[str] = None) -> List[Finding]:
    """What the root of ``storage`` holds besides (or instead of) async_ckpt's steps.

    * one step's directory (it holds ``manifest.json`` or ``COMMITTED``): pass its parent;
    * no steps, but subdirectories that hold steps: the parent of checkpoint roots, pass one;
    * checkpoints of another kind (:func:`other_kinds`), whether or not steps are there too.

    Args:
        storage: the root.
        entries: its listing, if already made (else listed here).
        name: how the messages call the root (default: its URL), e.g. the path a user typed.

    Returns:
        The findings (empty for a plain checkpoint root or an empty directory).

    Raises:
        OSError: the root cannot be listed.
    """
    listing = list(storage.listdir(storage.root) if entries is None else entries)
    names = {e["name"] for e in listing}
    url = (storage.url if name is None else name).rstrip("/") or "/"
    if MANIFEST_NAME in names or MARKER_NAME in names:
        parent = url.rsplit("/", 1)[0] if "/" in url else "."
        held = " and ".join(n for n in (MANIFEST_NAME, MARKER_NAME) if n in names)
        return [Finding(STEP_DIR, tuple(sorted(n for n in (MANIFEST_NAME, MARKER_NAME) if n in names)),
                        f"{url} looks like one step's directory (it holds {held}): pass the checkpoint root, "
                        f"its parent {parent}, instead", suggestion=parent)]
    out = other_kinds(listing)
    dirs = sorted(e["name"] for e in listing if _is_dir(e))
    if any(step_names.parse(d) is not None for d in dirs):
        return out
    roots = []
    for d in [d for d in dirs if not d.startswith(".")][:20]:
        try:
            below = storage.listdir(storage.join(d))
        except OSError:
            continue
        if any(_is_dir(c) and step_names.parse(c["name"]) is not None and not c["name"].startswith(".")
               for c in below):
            roots.append(d)
    if roots:
        first = f"{url}/{roots[0]}"
        out.insert(0, Finding(
            PARENT_OF_ROOTS, tuple(roots),
            f"{url} holds no steps but its subdirector{'ies' if len(roots) > 1 else 'y'} "
            f"{', '.join(roots[:5])} hold{'' if len(roots) > 1 else 's'} checkpoint steps: it looks like the "
            f"parent of checkpoint roots; pass one of them (e.g. {first})", suggestion=first))
    return out


def file_in_the_way(storage: Storage) -> Optional[str]:
    """The file that keeps the root of ``storage`` from being a directory: the root itself, or
    (local paths) the nearest existing ancestor when that is a file.

    Args:
        storage: the root.

    Returns:
        That file's path, or None (the root is a directory, or nothing is in the way).
    """
    import os

    try:
        if storage.exists(storage.root):
            return None if storage.fs.isdir(storage.root) else storage.root
        if not storage.is_local:
            return None
        path = os.path.abspath(storage.root)
        while True:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
            if os.path.lexists(path):
                return None if os.path.isdir(path) else path
    except OSError:  # cannot tell: the caller's own error stands
        return None


def not_a_root_message(what: str, storage: Storage, in_the_way: str) -> str:
    """The error text for a checkpoint path a file is in the way of.

    Args:
        what: how the caller names the path ("checkpoint path", "local_dir").
        storage: the root.
        in_the_way: :func:`file_in_the_way`'s answer.

    Returns:
        One sentence naming the file and what to pass instead.
    """
    if in_the_way == storage.root:
        return (f"{what} {storage.url} is a file, not a directory: pass a directory for the checkpoints "
                f"(a missing one is created)")
    return (f"{what} {storage.url} cannot be written: {in_the_way} is a file, not a directory, so the path "
            f"cannot be created; pass a path under a directory")
