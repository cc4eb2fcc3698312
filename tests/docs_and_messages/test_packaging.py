"""The built wheel carries what users' tools need: the py.typed marker and the license."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from ..support.paths import REPO

ROOT = Path(REPO)


def test_wheel_ships_py_typed_and_license(tmp_path: Path) -> None:
    # Build from a copy: setuptools leaves build/ and egg-info beside the sources.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "async_ckpt", src / "async_ckpt", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = out.glob("async_ckpt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "async_ckpt/py.typed" in names
    licenses = [n for n in names if n.endswith("LICENSE") and ".dist-info/" in n]
    assert licenses, names
    text = zipfile.ZipFile(wheel).read(licenses[0]).decode()
    assert "Apache License" in text and "Version 2.0" in text


def test_install_hints_name_extras_that_exist_as_installed_from_a_checkout() -> None:
    """async_ckpt is installed from a checkout (``pip install -e ".[extra]"``), not from an index:
    no doc or error message tells users to ``pip install async_ckpt[...]``, and every extra a
    hint names is defined in pyproject.toml."""
    import re

    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    texts = {p: p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                                        *(ROOT / "async_ckpt").rglob("*.py")]}
    named = set()
    for path, text in texts.items():
        assert not re.search(r"pip install [\"']?async_ckpt\[", text), f"{path}: names an extra of an index install"
        named |= {x for group in re.findall(r"pip install -e [\"']\.\[([a-z_,\-]+)\]", text) for x in group.split(",")}
    assert {"cli", "gcs", "lightning"} <= named, named
    assert named <= extras, f"hints name extras pyproject.toml does not define: {sorted(named - extras)}"
