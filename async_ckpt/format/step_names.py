"""Names of the directories under a root: every one is made and parsed here.

A root holds four kinds of step directory:

* ``<step>/`` (:data:`STEP`): the canonical directory of a step;
* ``<step>.<token>/`` (:data:`RESAVE`): a re-save written beside an existing copy (marker mode);
* ``.tmp-<step>-<token>/`` (:data:`TMP`): a step being written (rename mode), or one whose final
  rename a crash interrupted;
* ``.trash-<step>-<token>/`` (:data:`TRASH`): a replaced copy being deleted.

``<token>`` is :func:`new_token`'s twelve hex digits (one per save, the same on every rank).
Any other name under the root is not a step directory.

A root may name its steps otherwise (:class:`StepNaming`: a prefix and a fixed width, e.g.
torchtitan's ``step-<step>``, Orbax's ``<prefix>_<step>`` or zero-padded ``00000100``): then
``<name>/`` and ``<name>.<token>/`` replace ``<step>/`` and ``<step>.<token>/``; temp and trash
directories keep their names. The naming is recorded in the root (:data:`NAMING_FILE`), so that
readers and the CLI find the steps without being told; the module-level functions are those of
the default naming.

A local tier (``local_dir``) shared by several ranks holds one root per rank, ``rank<r>/``
(:func:`rank_dir_name`), and inside a rank's root, one root per rank whose copies it holds for
it (peer copies, ``local_replicas=``), ``held-rank<r>/`` (:func:`held_dir_name`); neither
parses as a step directory, so a root's own listing never sees them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

from ..errors import InvalidArgumentError

STEP = "step"
RESAVE = "resave"
TMP = "tmp"
TRASH = "trash"

_RANK_DIR = re.compile(r"^rank(\d+)$")
_HELD_DIR = re.compile(r"^held-rank(\d+)$")

#: the names every naming shares (a step's and a re-save's are the naming's: :meth:`StepNaming.parse`)
_PATTERNS = (
    (TMP, re.compile(r"^\.tmp-(\d+)-[0-9a-f]+$")),
    (TRASH, re.compile(r"^\.trash-(\d+)-[0-9a-f]+$")),
)
#: the kinds of directory that can hold a committed copy of a step (trash never does)
COMMITTABLE = (STEP, RESAVE, TMP)


@dataclass(frozen=True)
class StepDirName:
    """A parsed step directory name."""

    step: int
    kind: str  # STEP, RESAVE, TMP or TRASH


#: the file, directly under a root, that records its :class:`StepNaming` (absent: the default)
NAMING_FILE = ".async_ckpt_naming.json"
#: the widest fixed width of a step number
MAX_WIDTH = 20


@dataclass(frozen=True)
class StepNaming:
    """How a root names its step directories: ``<prefix><step>``, the step zero-padded to
    ``width`` digits (0: not padded). The default (``""``, 0) is ``<step>``; torchtitan's is
    ``StepNaming("step-")``; Orbax's ``step_prefix="ckpt"`` is ``StepNaming("ckpt_")`` and its
    ``step_format_fixed_length=8`` is ``width=8``.

    Args:
        prefix: what comes before the number: letters, digits, ``_``, ``-`` (not ending with a
            digit, not starting with ``.``).
        width: the number's fixed width (0..20).

    Raises:
        InvalidArgumentError: a prefix or width out of that range.
    """

    prefix: str = ""
    width: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not re.fullmatch(r"([A-Za-z0-9_-]*[A-Za-z_-])?", self.prefix):
            raise InvalidArgumentError(f"step_prefix must be letters, digits, '_' or '-' not ending with a digit "
                                       f"(e.g. 'step-' or 'ckpt_'), got {self.prefix!r}")
        if isinstance(self.width, bool) or not isinstance(self.width, int) or not 0 <= self.width <= MAX_WIDTH:
            raise InvalidArgumentError(f"step_width must be an int from 0 (not padded) to {MAX_WIDTH}, "
                                       f"got {self.width!r}")

    def name(self, step: int) -> str:
        """The canonical directory name of ``step``.

        Args:
            step: the step number.

        Returns:
            ``"<prefix><step>"``, the step zero-padded to the width.
        """
        return f"{self.prefix}{step:0{self.width}d}"

    def resave_name(self, step: int, token: str) -> str:
        """The directory name of a re-save of ``step`` written beside its existing copy.

        Args:
            step: the step number.
            token: the save's token (:func:`new_token`).

        Returns:
            ``"<name>.<token>"``.
        """
        return f"{self.name(step)}.{token}"

    def parse(self, name: str) -> Optional[StepDirName]:
        """What a directory name under a root is.

        Args:
            name: a directory name or path; only its last component counts.

        Returns:
            The step and kind of a step directory name, or None for any other name (a step
            name of another naming included).
        """
        base = name.rstrip("/").rsplit("/", 1)[-1]
        for kind, pattern in _PATTERNS:
            m = pattern.match(base)
            if m:
                return StepDirName(int(m.group(1)), kind)
        m = re.match(rf"^{re.escape(self.prefix)}(\d+)(\.[0-9a-f]{{12}})?$", base)
        if m is None:
            return None
        step = int(m.group(1))
        if m.group(1) != f"{step:0{self.width}d}":  # one spelling per step: "007" is not step 7 unpadded
            return None
        return StepDirName(step, RESAVE if m.group(2) else STEP)

    def to_json(self) -> bytes:
        """The record of this naming (:data:`NAMING_FILE`).

        Returns:
            JSON bytes.
        """
        return json.dumps({"step_prefix": self.prefix, "step_width": self.width}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "StepNaming":
        """A naming from its record.

        Args:
            data: the bytes of :data:`NAMING_FILE`.

        Returns:
            The naming.

        Raises:
            InvalidArgumentError: the record is not a naming's.
        """
        try:
            obj = json.loads(data)
            return cls(str(obj["step_prefix"]), int(obj["step_width"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"{NAMING_FILE}: not a step naming record ({exc})") from None

    def describe(self) -> str:
        """How the names look, for messages (``"step-<step>"``)."""
        return f"{self.prefix}<step>" + (f" zero-padded to {self.width} digits" if self.width else "")


#: the default naming: ``<step>``
DEFAULT = StepNaming()


def new_token() -> str:
    """A fresh token for the names of one save's directories.

    Returns:
        Twelve lowercase hex digits.
    """
    return uuid.uuid4().hex[:12]


def step_name(step: int) -> str:
    """The canonical directory name of ``step``.

    Args:
        step: The step number.

    Returns:
        ``"<step>"``.
    """
    return DEFAULT.name(step)


def resave_name(step: int, token: str) -> str:
    """The directory name of a re-save of ``step`` written beside its existing copy.

    Args:
        step: The step number.
        token: The save's token (:func:`new_token`).

    Returns:
        ``"<step>.<token>"``.
    """
    return DEFAULT.resave_name(step, token)


def tmp_name(step: int, token: str) -> str:
    """The temporary directory name a rename-mode save of ``step`` is written under.

    Args:
        step: The step number.
        token: The save's token (:func:`new_token`).

    Returns:
        ``".tmp-<step>-<token>"``.
    """
    return f".tmp-{step}-{token}"


def trash_name(step: int, token: str) -> str:
    """The directory name a replaced copy of ``step`` is moved to before it is deleted.

    Args:
        step: The step number.
        token: A fresh token (:func:`new_token`).

    Returns:
        ``".trash-<step>-<token>"``.
    """
    return f".trash-{step}-{token}"


def parse(name: str) -> Optional[StepDirName]:
    """What a directory name under a root of the default naming is (:meth:`StepNaming.parse`).

    Args:
        name: A directory name or path; only its last component counts.

    Returns:
        The step and kind of a step directory name, or None for any other name.
    """
    return DEFAULT.parse(name)


def step_of(name: str) -> Optional[int]:
    """The step a step, re-save, temp or trash directory belongs to.

    Args:
        name: A directory name or path; only its last component counts.

    Returns:
        The step, or None for a name that is not a step directory.
    """
    parsed = parse(name)
    return parsed.step if parsed is not None else None


def committable_step(name: str) -> Optional[int]:
    """The step of a directory name that can hold a committed copy (not trash).

    Args:
        name: A directory name or path; only its last component counts.

    Returns:
        The step, or None for trash and for names that are not step directories.
    """
    parsed = parse(name)
    return parsed.step if parsed is not None and parsed.kind in COMMITTABLE else None


def is_kind(name: str, *kinds: str) -> bool:
    """Whether ``name`` is a step directory name of one of ``kinds``.

    Args:
        name: A directory name or path; only its last component counts.
        *kinds: Any of :data:`STEP`, :data:`RESAVE`, :data:`TMP`, :data:`TRASH`.

    Returns:
        True if the name parses as one of those kinds.
    """
    parsed = parse(name)
    return parsed is not None and parsed.kind in kinds


def rank_dir_name(rank: int) -> str:
    """The directory of one rank's local tier under a ``local_dir`` that several ranks use.

    Args:
        rank: The rank.

    Returns:
        ``"rank<rank>"``.
    """
    return f"rank{int(rank)}"


def held_dir_name(rank: int) -> str:
    """The directory, inside a rank's local tier, of the copies it holds for ``rank`` (peer copies).

    Args:
        rank: The rank whose copies are held there.

    Returns:
        ``"held-rank<rank>"``.
    """
    return f"held-rank{int(rank)}"


def rank_of_dir(name: str) -> Optional[int]:
    """The rank of a rank's local-tier directory name (:func:`rank_dir_name`).

    Args:
        name: A directory name or path; only its last component counts.

    Returns:
        The rank, or None for any other name.
    """
    m = _RANK_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def rank_of_held_dir(name: str) -> Optional[int]:
    """The rank whose copies a held-copy directory holds (:func:`held_dir_name`).

    Args:
        name: A directory name or path; only its last component counts.

    Returns:
        The rank, or None for any other name.
    """
    m = _HELD_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None
