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


def _modules(pkg_dir: str = PKG_DIR) -> Dict[str, str]:
    """Dotted module name -> file path, for every module of async_ckpt."""
    out: Dict[str, str] = {}
    root = os.path.dirname(pkg_dir)
    for dirpath, _dirs, files in os.walk(pkg_dir):
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


def offenders(pkg_dir: str = PKG_DIR) -> List[str]:
    """Every private name a module of async_ckpt takes from another one, as
    ``"importer: module.name"``, sorted (``pkg_dir``: the package's directory)."""
    modules = _modules(pkg_dir)
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
                    elif alias.name in modules:  # ``import async_ckpt.x.y`` binds ``async_ckpt``
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]

        def reached(value: ast.expr, bound: Dict[str, str] = bound) -> Optional[str]:
            """The async_ckpt module an expression names (``m``, ``m.sub``, ``async_ckpt.x.y``)."""
            if isinstance(value, ast.Name):
                return bound.get(value.id)
            if isinstance(value, ast.Attribute):
                outer = reached(value.value, bound)
                if outer is not None and f"{outer}.{value.attr}" in modules:
                    return f"{outer}.{value.attr}"
            return None

        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = reached(node.value)
                if owner is not None and owner != module:
                    found.add(f"{module}: {owner}.{node.attr}")
    return sorted(found)


def test_no_module_imports_a_private_name_of_another():
    new = offenders()
    assert not new, "private names taken across modules (make them public or move them):\n" + "\n".join(new)


def test_the_scan_finds_what_it_should(tmp_path):
    """The scanner itself: relative, absolute and attribute forms are found; dunders, a module's
    own names and public names are not."""
    tree = ast.parse("from .x import _y, z, __version__\nfrom . import x\nx._w\nx.__doc__\n")
    froms = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert _resolve("async_ckpt.storage.step_dirs", False, froms[0]) == "async_ckpt.storage.x"
    assert _resolve("async_ckpt.storage", True, froms[0]) == "async_ckpt.storage.x"
    assert _resolve("async_ckpt.storage.step_dirs", False, froms[1]) == "async_ckpt.storage"
    assert [a.name for a in froms[0].names if _is_private(a.name)] == ["_y"]
    assert _is_private("_w") and not _is_private("__doc__") and not _is_private("w")


def test_the_scan_finds_private_names_reached_through_dotted_module_paths(tmp_path):
    """A private name reached through a module path (``import async_ckpt.a`` then
    ``async_ckpt.a._p``, or ``from async_ckpt import sub`` then ``sub.a._p``) is an offender too;
    the module's own private names and a package's own submodules' are not."""
    pkg = tmp_path / "async_ckpt"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def _p():\n    pass\n")
    (pkg / "b.py").write_text("import async_ckpt.sub.a\n\nasync_ckpt.sub.a._p()\n")
    (pkg / "c.py").write_text("from async_ckpt import sub\n\nsub.a._p()\n")
    (pkg / "d.py").write_text("from .sub import a\n\na._p()\n")
    (pkg / "e.py").write_text("def _own():\n    pass\n\n_own()\n")
    assert offenders(str(pkg)) == ["async_ckpt.b: async_ckpt.sub.a._p", "async_ckpt.c: async_ckpt.sub.a._p",
                                   "async_ckpt.d: async_ckpt.sub.a._p"]
