"""Byte ranges of a step's files, through the one verified read (:func:`read_ranges`: what the
command line shows of a step's items)."""

from __future__ import annotations

import bisect
from typing import Dict, List, Tuple

from ..format.manifest import FileRecord
from .read_exec import OpenFiles, Piece, StepFiles, execute
from .read_plan import record_pieces


def read_ranges(storage: StepFiles, path: str, files: Dict[str, FileRecord], wanted: Dict[str, List[Tuple[int, int]]],
                *, verify: bool = True, threads: int = 8) -> Dict[Tuple[str, int], bytes]:
    """Byte ranges of a step's files, through the one verified read: of a file whose manifest
    lists its records, the records the ranges lie in, each checked against its CRC-32C; of any
    other file, each range alone (its length checked: its checksum is the whole file's, which
    ``verify`` reads).

    Args:
        storage: the root's storage.
        path: the step directory.
        files: the manifest's records of the files.
        wanted: per file, the ``(offset, length)`` ranges to read.
        verify: compare checksums.
        threads: how many reads run at once.

    Returns:
        ``(file, offset)`` -> the bytes of that range.

    Raises:
        CorruptCheckpointError: a file missing, unsafe, too short, or a record's checksum.
    """
    listed = {n: r for n, r in wanted.items() if files[n].records is not None}
    pieces, covered, runs = record_pieces(files, listed, 32 * 2**20)
    alone: Dict[Tuple[str, int], bytearray] = {}
    for name, spans in wanted.items():
        if name in listed:
            continue
        covered[name] = []
        for offset, length in spans:
            buf = alone[(name, offset)] = bytearray(length)
            pieces.append(Piece(name, offset, offset + length, memoryview(buf)))
    with OpenFiles(storage, path, {n: files[n] for n in wanted}) as opened:
        execute(opened, pieces, verify=verify, threads=threads, records=covered)
    out = {k: bytes(v) for k, v in alone.items()}
    for name, spans in listed.items():
        starts, bufs = runs[name]
        for offset, length in spans:
            k = max(0, bisect.bisect_right(starts, offset) - 1)
            out[(name, offset)] = bytes(bufs[k][offset - starts[k]:offset - starts[k] + length])
    return out
