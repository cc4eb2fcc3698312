"""Structure rules that keep one idea in one place.

- No module of async_ckpt takes a ``_private`` name (one leading underscore, not a dunder) from
  another module of async_ckpt. Counted: ``from .x import _y`` / ``from ..x import _y`` /
  ``from async_ckpt.x import _y`` (at module level or inside a function), and ``m._y`` where
  ``m`` is a name the module bound to another async_ckpt module (``from . import m``,
  ``import async_ckpt.m as m``).
- One executor reads a step's files (``io/read_exec``): nothing above ``storage/`` opens a file
  for reading on its own (see :func:`reads_outside_the_executor`).
- No broad ``except`` swallows an error without a word: it re-raises, logs or warns, keeps the
  error, or says why on its line (see :func:`silent_excepts`).
- An error is never changed once raised: no attribute of a caught error (``except ... as e``, or
  the error a context manager's ``__exit__`` receives) is assigned (raise
  ``e.with_context(step=...)``, a copy; see :func:`patched_errors`).
- ``CheckpointManager``'s arguments and ``ManagerOptions``' fields are the same list, and
  nothing below the manager's façade imports ``ManagerOptions`` (each layer gets its option group).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import sys
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


def test_the_manager_options_are_the_managers_arguments():
    """``ManagerOptions.from_arguments(locals())`` builds the options from the manager's own
    arguments: every parameter of ``CheckpointManager`` is a field of the same name, in the same
    order, with the same default (the coordinator's timeout has no default in the options; the
    signature shows it), and nothing else is."""
    import dataclasses
    import inspect

    from async_ckpt import CheckpointManager
    from async_ckpt.options import ManagerOptions

    params = [p for p in inspect.signature(CheckpointManager.__init__).parameters.values() if p.name != "self"]
    fields = dataclasses.fields(ManagerOptions)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        if f.name == "collective_timeout_s":
            assert f.default is dataclasses.MISSING
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if p.default is inspect.Parameter.empty:
            assert default is dataclasses.MISSING, f.name
        else:
            assert default == p.default, f.name


def takers_of_the_options_bag(pkg_dir: str = PKG_DIR) -> List[str]:
    """The modules of async_ckpt other than the manager's façade (``manager.core``) and
    ``options`` itself that import ``ManagerOptions``, sorted: a layer below the façade gets the
    option group it uses (``StoreOptions``, ``LocalTierOptions``, ``PeerOptions``), not the bag."""
    found: Set[str] = set()
    for module, path in _modules(pkg_dir).items():
        if module in ("async_ckpt.options", "async_ckpt.manager.core"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and _resolve(module, path.endswith("__init__.py"), node)
                    == "async_ckpt.options" and any(a.name == "ManagerOptions" for a in node.names)):
                found.add(module)
    return sorted(found)


def test_only_the_facade_takes_the_options_bag():
    """Following an option from ``CheckpointManager``'s signature to its use goes through one
    narrow group per layer: nothing below the façade imports ``ManagerOptions``."""
    assert takers_of_the_options_bag() == []


# ---- one executor reads a step's files ---------------------------------------------------------

#: The ranged reads of a step's data files (``Storage.open_ranges`` and its readers' ``read_into``).
RANGED_READS = {"open_ranges", "read_into"}
#: Whole-file reads and opens: ``Storage.read_bytes``, fsspec's ``cat*``, ``open``/``os.open``.
WHOLE_READS = {"read_bytes", "cat_file", "cat", "cat_ranges", "open", "fromfile", "mmap"}
#: The executor: the one module above ``storage/`` that reads a step's files.
EXECUTOR = "async_ckpt.io.read_exec"
#: Modules above ``storage/`` that read files that are not a step's: module -> what it reads.
READS_OTHER_FILES = {
    "async_ckpt.stats": "the stats log (JSON lines, not a step's file)",
    "async_ckpt.io.hf": "Hugging Face safetensors shards and their index (not a step's files)",
    "async_ckpt.integrations.lightning": "Lightning's own checkpoint files, handed to torch.load",
    "async_ckpt.integrations.atomic_files": "directories opened to fsync them",
    "async_ckpt.shared_memory": "staging buffers mapped from memfd (shared memory, not a step's file)",
    "async_ckpt.io.writer_child": "the staging buffers the writer process maps (shared memory, not a step's file)",
}


def _write_mode(call: ast.Call) -> bool:
    """Whether an ``open(path, mode)``-like call names a mode that only writes."""
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return "r" not in mode.value and "+" not in mode.value
    if isinstance(mode, (ast.BinOp, ast.Attribute)):  # os.open's flags: O_WRONLY | O_CREAT | ...
        names = {n.attr for n in ast.walk(mode) if isinstance(n, ast.Attribute)}
        return "O_WRONLY" in names or ("O_RDWR" not in names and "O_RDONLY" not in names and bool(names))
    return False


def reads_outside_the_executor(pkg_dir: str = PKG_DIR) -> List[str]:
    """Every read of a file by a module above ``storage/`` other than :data:`EXECUTOR`, as
    ``"module:line: call"``, sorted.

    Counted: a call of a ranged read (:data:`RANGED_READS`) anywhere but inside a function of
    the same name (a reader that hands the executor another's reader: ``StagedFiles``), and a
    call of a whole-file read (:data:`WHOLE_READS`, the builtin ``open`` and ``os.open`` with a
    mode that reads) outside the modules of :data:`READS_OTHER_FILES`. ``storage/`` is the layer
    the executor reads through (its backends, and the step directories' markers and manifests),
    so it is not counted; a method of the module's own class named like a read is not a read of
    a file (``self.open``, ``self._probe.open``: calls on ``self`` are skipped)."""
    found: List[str] = []
    for module, path in _modules(pkg_dir).items():
        if module == EXECUTOR or module.startswith("async_ckpt.storage"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        parents: Dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node

        def inside(node: ast.AST, parents: Dict[ast.AST, ast.AST] = parents) -> Optional[str]:
            while node in parents:
                node = parents[node]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    return node.name
            return None

        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
            if name is None:
                continue
            owner = fn.value if isinstance(fn, ast.Attribute) else None
            if isinstance(owner, ast.Name) and owner.id == "self":
                continue
            if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self" \
                    and owner.attr.startswith("_probe"):
                continue
            if name in RANGED_READS and inside(node) != name:
                found.append(f"{module}:{node.lineno}: {name}")
            elif name in WHOLE_READS and module not in READS_OTHER_FILES and not _write_mode(node):
                found.append(f"{module}:{node.lineno}: {name}")
    return sorted(found)


def test_only_the_executor_reads_a_steps_files():
    found = reads_outside_the_executor()
    assert not found, ("files read outside io/read_exec (read them through read_exec.execute / read_files, "
                       "or name the module in READS_OTHER_FILES if its files are not a step's):\n" + "\n".join(found))


def test_the_read_scan_finds_what_it_should(tmp_path):
    """The scanner itself: a ranged read, a read of whole bytes and opens that read are found
    above storage/; writes, a reader that delegates, the executor and storage/ are not."""
    pkg = tmp_path / "async_ckpt"
    (pkg / "io").mkdir(parents=True)
    (pkg / "storage").mkdir()
    for d in (pkg, pkg / "io", pkg / "storage"):
        (d / "__init__.py").write_text("")
    (pkg / "io" / "read_exec.py").write_text("def f(st):\n    st.open_ranges('a').read_into(0, b'')\n")
    (pkg / "storage" / "step_dirs.py").write_text("def f(st):\n    return st.read_bytes('m')\n")
    (pkg / "io" / "sinks.py").write_text(
        "class Staged:\n    def open_ranges(self, w):\n        return self._storage.open_ranges(w)\n")
    (pkg / "jobs.py").write_text(
        "import os\n\n"
        "def f(st, fs):\n"
        "    st.open_ranges('a')\n"  # 4
        "    st.read_bytes('b')\n"  # 5
        "    fs.open('c', 'rb')\n"  # 6
        "    open('d')\n"  # 7
        "    os.open('e', os.O_RDONLY)\n"  # 8
        "    fs.open('w', 'wb')\n"
        "    open('w', mode='w')\n"
        "    os.open('w', os.O_WRONLY | os.O_CREAT)\n"
        "    os.open('w', os.O_WRONLY)\n")
    assert reads_outside_the_executor(str(pkg)) == [
        "async_ckpt.jobs:4: open_ranges", "async_ckpt.jobs:5: read_bytes", "async_ckpt.jobs:6: open",
        "async_ckpt.jobs:7: open", "async_ckpt.jobs:8: open"]


# ---- no silent except --------------------------------------------------------------------------

#: Calls that report an error (a logger's methods, ``warn_user``, ``warnings.warn``).
REPORTS = {"exception", "error", "warning", "info", "debug", "critical", "warn", "warn_user"}


def silent_excepts(pkg_dir: str = PKG_DIR) -> List[str]:
    """Every ``except:``, ``except Exception`` or ``except BaseException`` (alone or in a tuple)
    of async_ckpt whose block neither raises, reports (:data:`REPORTS`) nor uses the error it
    bound, and whose ``except`` line has no comment saying why swallowing is safe, as
    ``"module:line"``, sorted."""
    found: List[str] = []
    for module, path in _modules(pkg_dir).items():
        with open(path, encoding="utf-8") as f:
            src = f.read()
        lines = src.splitlines()
        for node in ast.walk(ast.parse(src, filename=path)):
            if not isinstance(node, ast.ExceptHandler):
                continue
            kinds = [] if node.type is None else node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            if node.type is not None and not any(isinstance(k, ast.Name) and k.id in ("Exception", "BaseException")
                                                 for k in kinds):
                continue
            if "#" in lines[node.lineno - 1]:
                continue
            body = [n for stmt in node.body for n in ast.walk(stmt)]
            if any(isinstance(n, ast.Raise) for n in body):
                continue
            if any(isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
                   and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) in REPORTS for n in body):
                continue
            if node.name and any(isinstance(n, ast.Name) and n.id == node.name for n in body):
                continue
            found.append(f"{module}:{node.lineno}")
    return sorted(found)


def test_no_except_swallows_an_error_without_a_word():
    found = silent_excepts()
    assert not found, ("broad excepts that swallow without logging, keeping the error or a comment saying why "
                       "that is safe:\n" + "\n".join(found))


def test_the_except_scan_finds_what_it_should(tmp_path):
    pkg = tmp_path / "async_ckpt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text(
        "import logging\nlog = logging.getLogger()\n\n"
        "def f(g):\n"
        "    try:\n        g()\n    except Exception:\n        pass\n"  # 7: silent
        "    try:\n        g()\n    except:\n        return None\n"  # 11: silent
        "    try:\n        g()\n    except (OSError, BaseException):\n        pass\n"  # 15: silent
        "    try:\n        g()\n    except Exception:  # a probe: False is the answer\n        pass\n"
        "    try:\n        g()\n    except Exception:\n        raise\n"
        "    try:\n        g()\n    except Exception as exc:\n        log.warning('%s', exc)\n"
        "    try:\n        g()\n    except Exception as exc:\n        kept = exc\n"
        "    try:\n        g()\n    except OSError:\n        pass\n")
    assert silent_excepts(str(pkg)) == ["async_ckpt.m:11", "async_ckpt.m:15", "async_ckpt.m:7"]


# ---- an error is never patched once raised -----------------------------------------------------

def patched_errors(pkg_dir: str = PKG_DIR) -> List[str]:
    """Every assignment to an attribute of a caught error: the name an ``except ... as name``
    binds, inside its block, or the exception parameter of an ``__exit__`` method (its third
    argument after ``self``), as ``"module:line: name.attr"``, sorted."""
    found: List[str] = []
    for module, path in _modules(pkg_dir).items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        scopes: List[tuple] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and node.name:
                scopes.append((node.name, node.body))
            elif isinstance(node, ast.FunctionDef) and node.name == "__exit__" and len(node.args.args) >= 3:
                scopes.append((node.args.args[2].arg, node.body))
        for name, body in scopes:
            for n in (n for stmt in body for n in ast.walk(stmt)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] \
                    if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == name:
                        found.append(f"{module}:{n.lineno}: {name}.{t.attr}")
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr" and n.args \
                        and isinstance(n.args[0], ast.Name) and n.args[0].id == name:
                    found.append(f"{module}:{n.lineno}: setattr({name}, ...)")
    return sorted(set(found))


def test_no_error_is_patched_after_it_is_raised():
    found = patched_errors()
    assert not found, ("errors changed after they were raised (raise exc.with_context(...) instead: a copy):\n"
                       + "\n".join(found))


def test_the_patch_scan_finds_what_it_should(tmp_path):
    pkg = tmp_path / "async_ckpt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text(
        "def f(g):\n"
        "    try:\n        g()\n    except ValueError as exc:\n        exc.step = 1\n        raise\n"  # 5
        "    try:\n        g()\n    except ValueError as exc:\n        setattr(exc, 'step', 1)\n"  # 10
        "    try:\n        g()\n    except ValueError as exc:\n        raise exc.with_context(step=1)\n"
        "\n\nclass C:\n    def __exit__(self, t, e, tb):\n        e.step = 2\n"  # 19
        "\n    def other(self, e):\n        e.step = 3\n")
    assert patched_errors(str(pkg)) == ["async_ckpt.m:10: setattr(exc, ...)", "async_ckpt.m:19: e.step",
                                        "async_ckpt.m:5: exc.step"]


# ---- docstring references: every :mod:/:func:/:class:/:meth:/:attr:/:exc: names something that exists

_ROLE = re.compile(r":(mod|func|class|meth|attr|exc|data|obj):`([^`]+)`")
_OUTSIDE = ("torch", "torch_xla", "fsspec", "gcsfs", "s3fs", "lightning", "pytorch_lightning", "transformers",
            "accelerate", "peft", "torchtitan", "safetensors", "numpy", "botocore", "aiohttp", "crc32c", "xxhash")


def _lookup(dotted: str) -> bool:
    """Whether ``dotted`` names an importable module or an attribute chain below one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            if not hasattr(obj, p):
                return False
            obj = getattr(obj, p)
        return True
    return False


def _resolves(module: str, is_package: bool, target: str, source: str) -> bool:
    t = target.strip().lstrip("~").rstrip("()")
    if "<" in t:  # "text <target>"
        t = t[t.index("<") + 1:].rstrip(">")
    if t.startswith("."):  # relative to the module's package, as an import would resolve it
        dots = len(t) - len(t.lstrip("."))
        base = module.split(".") if is_package else module.split(".")[:-1]
        return _lookup(".".join(base[: len(base) - (dots - 1)] + [t.lstrip(".")]))
    first, *rest = t.split(".")
    if first in _OUTSIDE or first in sys.stdlib_module_names:
        return True
    if first == "async_ckpt":
        return _lookup(t)
    mod = importlib.import_module(module)
    if hasattr(mod, first):  # a name the module defines or imports
        obj = getattr(mod, first)
        for p in rest:
            if not hasattr(obj, p):
                return False
            obj = getattr(obj, p)
        return True
    if not rest:  # a method or attribute of a class of the module (the docstring's own class)
        for _name, cls in inspect.getmembers(mod, inspect.isclass):
            if hasattr(cls, first) or first in getattr(cls, "__dataclass_fields__", {}) \
                    or first in getattr(cls, "__annotations__", {}):
                return True
        if re.search(r"self\.%s\b" % re.escape(first), source):
            return True
    return _lookup(f"async_ckpt.{t}")


def stale_references(pkg_dir: str = PKG_DIR) -> List[str]:
    """Every Sphinx role in a docstring of async_ckpt that names nothing that exists, as
    ``"module: :role:`target`"``."""
    found: List[str] = []
    for module, path in sorted(_modules(pkg_dir).items()):
        if module.endswith("__main__"):
            continue
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:  # an integration whose framework is not installed here
            if (e.name or "").split(".")[0] not in _OUTSIDE:
                raise
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        for node in ast.walk(ast.parse(source, filename=path)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                for role, target in _ROLE.findall(ast.get_docstring(node, clean=False) or ""):
                    if not _resolves(module, path.endswith("__init__.py"), target, source):
                        found.append(f"{module}: :{role}:`{target}`")
    return found


def test_every_docstring_reference_names_something_that_exists():
    found = stale_references()
    assert not found, "docstrings name modules or names that do not exist (a move left them behind):\n" \
        + "\n".join(found)


def test_the_reference_scan_finds_what_it_should(tmp_path, monkeypatch):
    pkg = tmp_path / "async_ckpt"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    pass\n\n\nclass C:\n    def m(self):\n        pass\n")
    (pkg / "sub" / "b.py").write_text(
        '"""See :func:`~.a.f`, :meth:`.a.C.m`, :class:`C`, :meth:`m`, :mod:`.a` and :class:`torch.Tensor`;\n'
        'gone: :func:`~.a.g`, :mod:`.tiered`, :class:`~..storage.Gone`, :meth:`C.nope`, :func:`old_name`."""\n'
        "from .a import C\n")
    for name in [m for m in sys.modules if m == "async_ckpt" or m.startswith("async_ckpt.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert stale_references(str(pkg)) == [
        "async_ckpt.sub.b: :func:`~.a.g`", "async_ckpt.sub.b: :mod:`.tiered`",
        "async_ckpt.sub.b: :class:`~..storage.Gone`", "async_ckpt.sub.b: :meth:`C.nope`",
        "async_ckpt.sub.b: :func:`old_name`"]
