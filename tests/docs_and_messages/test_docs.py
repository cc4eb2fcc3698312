"""Every ```python block in README.md and docs/*.md runs, so that the docs cannot rot.

Rules (also in docs/index.md, "About these docs"):

* The blocks of one file run in order, in one namespace, in a fresh temporary working
  directory for that file (so a later block can restore what an earlier one saved under a
  relative path). Files are independent of each other.
* A block is skipped only when the line right before its fence is ``<!-- no-test -->`` (for
  what cannot run here: torchrun, a real GCS bucket, a TPU).
* Blocks run in this test process (torch is imported once); logging configuration is restored
  and any ``CheckpointManager`` left open is closed after each file.
* A ```sh block right after ``<!-- run -->`` runs too, in order with the file's python blocks:
  each line is an ``async-ckpt ...`` command, run through ``async_ckpt.cli.main``; it must exit
  0, or the code its comment names (``# exit 1: ...``).

The other checks: relative links between the docs point at files that exist, and
docs/api.md mentions every name ``async_ckpt`` exports.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import List, Tuple

import pytest

from ..support.paths import REPO

ROOT = Path(REPO)
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


RUN = "<!-- run -->"
_SH_OPEN = re.compile(r"^```sh\s*$")
_EXIT = re.compile(r"#.*\bexit (\d+)\b")


def runnable_blocks(text: str) -> List[Tuple[int, str, str]]:
    """``(first line number, kind, source)`` of the blocks that run, in order: ```python blocks
    (not after ``<!-- no-test -->``) and ```sh blocks after ``<!-- run -->`` (kind ``"sh"``)."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        kind = "python" if _OPEN.match(lines[i]) else "sh" if _SH_OPEN.match(lines[i]) else None
        if kind is None:
            i += 1
            continue
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        j = i + 1
        while j < len(lines) and not _CLOSE.match(lines[j]):
            j += 1
        src = "\n".join(lines[i + 1:j]) + "\n"
        if (kind == "python" and prev != NO_TEST) or (kind == "sh" and prev == RUN):
            out.append((i + 2, kind, src))
        i = j + 1
    return out


def run_sh(rel: str, line: int, src: str) -> None:
    """Run a ``<!-- run -->`` block's ``async-ckpt`` commands through the CLI's ``main``."""
    import shlex

    from async_ckpt.cli import main

    for n, cmd in enumerate(src.splitlines()):
        if not cmd.strip() or cmd.lstrip().startswith("#"):
            continue
        m = _EXIT.search(cmd)
        want = int(m.group(1)) if m else 0
        argv = shlex.split(cmd, comments=True)
        assert argv[0] == "async-ckpt", f"{rel}:{line + n}: a run block holds async-ckpt commands, got {cmd!r}"
        code = main(argv[1:])
        assert code == want, f"{rel}:{line + n}: {cmd!r} exited {code}, the docs say {want}"


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
    runnable = runnable_blocks(path.read_text())
    if not runnable:
        pytest.skip(f"{rel} has no runnable python blocks")
    if any(re.search(r"^\s*(import|from) torch_xla", src, re.M) for _, kind, src in runnable if kind == "python"):
        pytest.importorskip("torch_xla", reason=f"{rel} runs torch_xla code (not installed with this torch)")
    monkeypatch.chdir(tmp_path)
    root_logger, pkg_logger = logging.getLogger(), logging.getLogger("async_ckpt")
    saved_logging = (list(root_logger.handlers), root_logger.level, pkg_logger.level)
    ns: dict = {"__name__": "__main__"}
    try:
        for line, kind, src in runnable:
            if kind == "sh":
                run_sh(rel, line, src)
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


def test_runnable_block_parser():
    text = ("```python\na = 1\n```\n<!-- run -->\n```sh\nasync-ckpt ls x   # exit 0\n```\n```sh\nls\n```\n"
            "<!-- no-test -->\n```python\nb = 2\n```\n")
    assert runnable_blocks(text) == [(2, "python", "a = 1\n"), (6, "sh", "async-ckpt ls x   # exit 0\n")]


def test_quickstart_why_was_a_save_slow_shows_the_info_line(tmp_path, monkeypatch, capsys):
    """The section configures logging before its saves, so the INFO line it promises appears."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    monkeypatch.chdir(tmp_path)
    root_logger, pkg_logger = logging.getLogger(), logging.getLogger("async_ckpt")
    saved = (list(root_logger.handlers), root_logger.level, pkg_logger.level)
    root_logger.handlers[:] = []  # basicConfig configures only a root logger without handlers
    ns: dict = {"__name__": "__main__"}
    try:
        for line, kind, src in runnable_blocks(text):
            assert kind == "python", "quickstart.md runs no command blocks"
            exec(compile("\n" * (line - 1) + src, "docs/quickstart.md", "exec"), ns)
    finally:
        _close_managers(ns)
        root_logger.handlers[:] = saved[0]
        root_logger.setLevel(saved[1])
        pkg_logger.setLevel(saved[2])
    err = capsys.readouterr().err
    assert re.search(r"^INFO:async_ckpt:saved step \d+: .* blocked ", err, re.M), err[-2000:]


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


def test_the_docs_tell_one_truth_about_the_writer_extras_and_defaults():
    """docs/index.md and the README say who writes alike; the quickstart's install table names
    every extra its commands need (``stats --plot``: ``[plot]``, as pyproject declares); the
    README's drop-in claim names the default that differs from torch_xla's; the restore's INFO
    line is said to need logging configured."""
    index = (ROOT / "docs" / "index.md").read_text()
    readme = (ROOT / "README.md").read_text()
    quick = (ROOT / "docs" / "quickstart.md").read_text()
    assert "a writer process" in readme and "a writer process of its own writes" in index
    assert "then a background thread writes a standard" not in index
    assert 'plot = ["matplotlib' in (ROOT / "pyproject.toml").read_text()
    assert "| `[plot]` | `matplotlib>=3.7` | `async-ckpt stats --plot`" in quick
    drop_in = readme[readme.index("A drop-in for torch_xla's `CheckpointManager`"):]
    assert "`chkpt_on_preemption` is off here, on in torch_xla" in drop_in[:400]
    line = quick[quick.index("Each restore logs one INFO line"):][:300]
    assert "logging.basicConfig(level=logging.INFO)" in line
