"""Structure rules that keep one idea in one place: no module of async_ckpt takes a ``_private``
name (one leading underscore, not a dunder) from another module of async_ckpt.

Counted: ``from .x import _y`` / ``from ..x import _y`` / ``from async_ckpt.x import _y`` (at
module level or inside a function), and ``m._y`` where ``m`` is a name the module bound to
another async_ckpt module (``from . import m``, ``import async_ckpt.m as m``).
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set

import async_ckpt

PKG_DIR = os.path.dirname(os.path.abspath(async_ckpt.__file__))

def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules() -> Dict[str, str]:
    """Dotted module name -> file path, for every module of async_ckpt."""
    out: Dict[str, str] = {}
    root = os.path.dirname(PKG_DIR)
    for dirpath, _dirs, files in os.walk(PKG_DIR):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
            out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> Optional[str]:
    """The absolute module an ``ImportFrom`` imports from (None if outside async_ckpt)."""
    if node.level == 0:
        target = node.module or ""
    else:
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    return target if target == "async_ckpt" or target.startswith("async_ckpt.") else None


def offenders() -> List[str]:
    """Every private name a module of async_ckpt takes from another one, as
    ``"importer: module.name"``, sorted."""
    modules = _modules()
    found: Set[str] = set()
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        bound: Dict[str, str] = {}  # local name -> the async_ckpt module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node)
                if source is None:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:  # a submodule
                        bound[alias.asname or alias.name] = sub
                        if _is_private(alias.name) and source != module.rsplit(".", 1)[0] and source != module:
                            found.add(f"{module}: {sub}")  # a private module of another package
                    elif _is_private(alias.name) and source != module:
                        found.add(f"{module}: {source}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and _is_private(node.attr) and bound[node.value.id] != module):
                found.add(f"{module}: {bound[node.value.id]}.{node.attr}")
    return sorted(found)


def test_no_module_imports_a_private_name_of_another():
    new = offenders()
    assert not new, "private names taken across modules (make them public or move them):\n" + "\n".join(new)


def test_the_scan_finds_what_it_should(tmp_path):
    """The scanner itself: relative, absolute and attribute forms are found; dunders, a module's
    own names and public names are not."""
    tree = ast.parse("from .x import _y, z, __version__\nfrom . import x\nx._w\nx.__doc__\n")
    froms = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert _resolve("async_ckpt.storage.layout", False, froms[0]) == "async_ckpt.storage.x"
    assert _resolve("async_ckpt.storage", True, froms[0]) == "async_ckpt.storage.x"
    assert _resolve("async_ckpt.storage.layout", False, froms[1]) == "async_ckpt.storage"
    assert [a.name for a in froms[0].names if _is_private(a.name)] == ["_y"]
    assert _is_private("_w") and not _is_private("__doc__") and not _is_private("w")
