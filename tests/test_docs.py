"""Every ```python block in README.md and docs/*.md runs, so that the docs cannot rot.

Rules (also in docs/index.md, "About these docs"):

* The blocks of one file run in order, in one namespace, in a fresh temporary working
  directory for that file (so a later block can restore what an earlier one saved under a
  relative path). Files are independent of each other.
* A block is skipped only when the line right before its fence is ``<!-- no-test -->`` (for
  what cannot run here: torchrun, a real GCS bucket, a TPU).
* Blocks run in this test process (torch is imported once); logging configuration is restored
  and any ``CheckpointManager`` left open is closed after each file.

The other checks: relative links between the docs point at files that exist, and
docs/api.md mentions every name ``async_ckpt`` exports.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
NO_TEST = "<!-- no-test -->"
_OPEN = re.compile(r"^```python\s*$")
_CLOSE = re.compile(r"^```\s*$")


def doc_files() -> List[Path]:
    files = sorted((ROOT / "docs").glob("*.md"))
    readme = ROOT / "README.md"
    return ([readme] if readme.exists() else []) + files


def python_blocks(text: str) -> List[Tuple[int, str, bool]]:
    """``(first line number, source, skipped)`` of each ```python block, in order."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        if _OPEN.match(lines[i]):
            prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            start = i + 1
            j = start
            while j < len(lines) and not _CLOSE.match(lines[j]):
                j += 1
            if j == len(lines):
                raise ValueError(f"line {i + 1}: ```python block is never closed")
            out.append((start + 1, "\n".join(lines[start:j]) + "\n", prev == NO_TEST))
            i = j + 1
        else:
            i += 1
    return out


def test_block_parser():
    text = "x\n```python\na = 1\n```\n<!-- no-test -->\n\n```python\nb = 2\n```\n```sh\nls\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n", False), (8, "b = 2\n", True)]


def _close_managers(ns: dict) -> None:
    from async_ckpt import CheckpointManager

    for v in list(ns.values()):
        if isinstance(v, CheckpointManager):
            try:
                v.close()
            except Exception:
                pass


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_code_blocks_run(path: Path, tmp_path, monkeypatch):
    rel = str(path.relative_to(ROOT))
    blocks = python_blocks(path.read_text())
    runnable = [b for b in blocks if not b[2]]
    if not runnable:
        pytest.skip(f"{rel} has no runnable python blocks")
    if any(re.search(r"^\s*(import|from) torch_xla", src, re.M) for _, src, _ in runnable):
        pytest.importorskip("torch_xla", reason=f"{rel} runs torch_xla code (not installed with this torch)")
    monkeypatch.chdir(tmp_path)
    root_logger, pkg_logger = logging.getLogger(), logging.getLogger("async_ckpt")
    saved_logging = (list(root_logger.handlers), root_logger.level, pkg_logger.level)
    ns: dict = {"__name__": "__main__"}
    try:
        for line, src, skipped in blocks:
            if skipped:
                continue
            # Pad so that tracebacks show the line number in the .md file.
            code = compile("\n" * (line - 1) + src, f"{rel}", "exec")
            try:
                exec(code, ns)
            except BaseException as exc:
                raise AssertionError(f"{rel}: the ```python block at line {line} failed: "
                                     f"{type(exc).__name__}: {exc}") from exc
    finally:
        _close_managers(ns)
        root_logger.handlers[:] = saved_logging[0]
        root_logger.setLevel(saved_logging[1])
        pkg_logger.setLevel(saved_logging[2])


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_resolve():
    broken = []
    for path in doc_files():
        for target in _LINK.findall(path.read_text()):
            if re.match(r"^[a-z]+://|^mailto:|^#", target):
                continue
            file = target.split("#", 1)[0]
            if file and not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, "links to files that do not exist: " + ", ".join(broken)


def test_api_reference_names_every_export():
    import async_ckpt

    api = ROOT / "docs" / "api.md"
    if not api.exists():
        pytest.skip("docs/api.md not written")
    text = api.read_text()
    missing = [n for n in async_ckpt.__all__ if n != "__version__" and f"`{n}" not in text]
    assert not missing, f"docs/api.md does not document: {', '.join(missing)}"
