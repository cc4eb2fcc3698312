"""Damage to checkpoint files for tests: flip one byte of a file, of a committed step's data file
or of its metadata, on local paths and fsspec URLs. Importable without pytest (the torchrun
workers use it); conftest re-exports it."""

from __future__ import annotations

import os
from typing import List, Optional

import fsspec


def data_files(step_dir: str) -> List[str]:
    """The paths of a step's data files (``*.distcp``), sorted; ``step_dir`` a path or URL."""
    fs, path = fsspec.core.url_to_fs(step_dir)
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    return [f"{step_dir.rstrip('/')}/{n}" for n in names if n.endswith(".distcp")]


def flip_byte(path: str, at: Optional[int] = None, mask: int = 0x01) -> None:
    """XOR one byte of a file with ``mask``, in place; ``at`` an offset (negative: from the
    end), the middle byte when None. ``path`` a local path or an fsspec URL."""
    if "://" not in path:
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            i = size // 2 if at is None else at % size
            f.seek(i)
            b = f.read(1)
            f.seek(i)
            f.write(bytes([b[0] ^ mask]))
        return
    fs, p = fsspec.core.url_to_fs(path)
    data = bytearray(fs.cat_file(p))
    data[len(data) // 2 if at is None else at] ^= mask
    fs.pipe_file(p, bytes(data))


def flip_data_byte(step_dir: str, at: Optional[int] = None, mask: int = 0x01) -> str:
    """Flip a byte (see :func:`flip_byte`) of a step's first data file; returns its path."""
    path = data_files(step_dir)[0]
    flip_byte(path, at, mask)
    return path


def flip_metadata_byte(step_dir: str, at: Optional[int] = None, mask: int = 0x01) -> str:
    """Flip a byte (see :func:`flip_byte`) of a step's ``.metadata``; returns its path."""
    path = f"{step_dir.rstrip('/')}/.metadata"
    flip_byte(path, at, mask)
    return path
