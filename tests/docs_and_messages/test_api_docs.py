"""The public API is documented, Google style.

Every public class, method, property and function reachable from ``async_ckpt``'s exports, the
integration modules and the documented modules has a docstring that starts with a one-line
summary; every one that takes parameters names each of them in an ``Args:`` section (a class:
in its own or its ``__init__``'s docstring, ``Attributes:`` for dataclass fields); and what a
``Raises:`` section names is an exception class.

Only what async_ckpt defines is checked: methods a class inherits from a framework
(Lightning's ``CheckpointIO``, HF's ``TrainerCallback``, ``Exception``) are not.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import inspect
import re
import sys
from typing import Any, Iterator, List, Optional, Set, Tuple

import pytest

from ..support.paths import REPO

#: modules whose public names (``__all__``, else the public names they define) are checked
MODULES = [
    "async_ckpt",
    "async_ckpt.errors",
    "async_ckpt.stats",
    "async_ckpt.policies",
    "async_ckpt.jobs.preemption",
    "async_ckpt.jobs.write_queue",
    "async_ckpt.compat",
    "async_ckpt.storage.retry",
    "async_ckpt.storage.storage",
    "async_ckpt.storage.lease",
    "async_ckpt.storage.stats_log",
    "async_ckpt.staging",
    "async_ckpt.cli",
]
#: the integration modules; each is checked where its framework is installed
INTEGRATIONS = [
    ("async_ckpt.integrations.lightning", "lightning"),
    ("async_ckpt.integrations.transformers", "transformers"),
    ("async_ckpt.integrations.accelerate", "accelerate"),
    ("async_ckpt.integrations.torchtitan", "torchtitan"),
    ("async_ckpt.integrations.object_snapshot", "torch"),
    ("async_ckpt.integrations.atomic_files", "torch"),
    ("async_ckpt.integrations.background_writer", "torch"),
    ("async_ckpt.integrations.save_figures", "torch"),
]
#: names documented by the engineers who rewrite them (removed from this list after the merge)
EXCLUDED: set = set()

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Attributes|Returns|Yields|Raises|Note|Notes|Example|Examples):\s*$")
_ENTRY = re.compile(r"^\**(\w+)(\s*\([^)]*\))?\s*:")


def section_names(doc: str, headers: Tuple[str, ...]) -> Set[str]:
    """The names a docstring's ``headers`` sections (``Args:``, ``Attributes:``) document.

    Args:
        doc: the docstring (as ``inspect.getdoc`` returns it: dedented).
        headers: the section titles to read.

    Returns:
        The entry names (``**kwargs:`` gives ``kwargs``).
    """
    names: Set[str] = set()
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        m = _SECTION.match(lines[i])
        if m is None or m.group(2) not in headers:
            i += 1
            continue
        indent = len(m.group(1))
        entry_indent: Optional[int] = None
        i += 1
        while i < len(lines):
            line = lines[i]
            if line.strip():
                here = len(line) - len(line.lstrip())
                if here <= indent:
                    break
                if entry_indent is None:
                    entry_indent = here
                if here == entry_indent:
                    e = _ENTRY.match(line.strip())
                    if e is not None:
                        names.add(e.group(1))
            i += 1
    return names


def _params(fn: Any) -> List[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values() if p.name not in ("self", "cls") and not p.name.startswith("_")]


def _ours(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "async_ckpt"


def _defining_class(cls: type, name: str) -> Optional[type]:
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return None


def _exception_names() -> Set[str]:
    """Names of the builtin exceptions and of every exception class async_ckpt's loaded modules
    define or import."""
    names = {n for n, v in vars(builtins).items() if inspect.isclass(v) and issubclass(v, BaseException)}
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.split(".")[0] == "async_ckpt" and mod is not None:
            names |= {n for n, v in vars(mod).items() if inspect.isclass(v) and issubclass(v, BaseException)}
    return names


def _check_callable(where: str, fn: Any, doc: Optional[str], problems: List[str],
                    headers: Tuple[str, ...] = ("Args",)) -> None:
    if not doc or not doc.strip():
        problems.append(f"{where}: no docstring")
        return
    if "\n" in doc.strip().split("\n\n")[0]:
        problems.append(f"{where}: the summary (first paragraph) is more than one line")
    unknown = sorted(section_names(doc, ("Raises",)) - _exception_names())
    if unknown:
        problems.append(f"{where}: Raises: names {unknown}, which are not exception classes")
    params = _params(fn)
    if not params:
        return
    documented = section_names(doc, headers)
    if not documented:
        problems.append(f"{where}: takes {params} but has no {' / '.join(h + ':' for h in headers)} section")
        return
    missing = [p for p in params if p not in documented]
    if missing:
        problems.append(f"{where}: {' / '.join(h + ':' for h in headers)} does not name {missing}")


def _check_class(where: str, cls: type, problems: List[str]) -> None:
    doc = inspect.getdoc(cls) if cls.__doc__ else None
    if not doc or not doc.strip():
        problems.append(f"{where}: no docstring")
    elif "\n" in doc.strip().split("\n\n")[0]:
        problems.append(f"{where}: the summary (first paragraph) is more than one line")
    init_owner = _defining_class(cls, "__init__")
    if init_owner is cls and _ours(cls) and not _is_protocol(cls):
        init = vars(cls)["__init__"]
        text = "\n".join(x for x in (inspect.getdoc(cls), inspect.getdoc(init) if init.__doc__ else None) if x)
        headers = ("Args", "Attributes") if dataclasses.is_dataclass(cls) else ("Args",)
        _check_callable(f"{where}()", init, text, problems, headers)
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = _defining_class(cls, name)
        if owner is None or not _ours(owner):
            continue  # a framework's (Lightning's, HF's, Exception's)
        raw = vars(owner)[name]
        if isinstance(raw, property):
            doc = inspect.getdoc(raw) or ""
            if not doc.strip():
                problems.append(f"{where}.{name}: property without a docstring")
            elif "\n" in doc.strip().split("\n\n")[0]:
                problems.append(f"{where}.{name}: the summary (first paragraph) is more than one line")
            continue
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if inspect.isfunction(raw):
            _check_callable(f"{where}.{name}", raw, inspect.getdoc(getattr(cls, name)), problems)


def _is_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


def _public(module: Any) -> Iterator[Tuple[str, Any]]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items()
                 if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__]
    for n in names:
        if n in EXCLUDED or n.startswith("_"):
            continue
        yield n, getattr(module, n)


def problems_of(module_name: str) -> List[str]:
    """What is undocumented among ``module_name``'s public classes and functions.

    Args:
        module_name: a module of async_ckpt.

    Returns:
        One line per problem (empty when everything is documented).
    """
    module = importlib.import_module(module_name)
    problems: List[str] = []
    for name, obj in _public(module):
        where = f"{module_name}.{name}"
        if inspect.isclass(obj):
            if _ours(obj):
                _check_class(where, obj, problems)
        elif inspect.isfunction(obj) and _ours(obj):
            _check_callable(where, obj, inspect.getdoc(obj), problems)
    return problems


def test_section_names_reads_google_style_sections():
    doc = ("Summary.\n\nArgs:\n    a: the a.\n    b (int): the b,\n        on two lines.\n"
           "    **kwargs: more.\n\nReturns:\n    x: not an argument.\n")
    assert section_names(doc, ("Args",)) == {"a", "b", "kwargs"}
    assert section_names("No sections.", ("Args",)) == set()
    assert section_names("Raises:\n    StorageError: refused.\n", ("Raises",)) == {"StorageError"}


@pytest.mark.parametrize("module_name", MODULES)
def test_public_api_has_docstrings_with_args(module_name):
    problems = problems_of(module_name)
    assert not problems, "undocumented public API:\n" + "\n".join(problems)


@pytest.mark.parametrize("module_name,framework", INTEGRATIONS, ids=[m for m, _ in INTEGRATIONS])
def test_integrations_have_docstrings_with_args(module_name, framework):
    pytest.importorskip(framework)
    problems = problems_of(module_name)
    assert not problems, "undocumented public API:\n" + "\n".join(problems)


def test_api_md_lists_every_save_stats_field():
    """docs/api.md's table of SaveStats fields is the dataclass's fields, in order."""
    from pathlib import Path

    from async_ckpt import SaveStats

    text = (Path(REPO) / "docs" / "api.md").read_text()
    section = text.split("### `SaveStats`", 1)[1].split("\n### ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert listed == [f.name for f in dataclasses.fields(SaveStats)], listed
