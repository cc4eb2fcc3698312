"""The ``async-ckpt`` command: look into, verify, prune, promote and export checkpoint directories,
and read the save statistics log. ``ls`` and ``verify`` take ``--local-dir`` for a local tier.

Every subcommand takes a checkpoint root (a local path or any fsspec URL), prints a readable
table, and with ``--json`` prints one JSON document instead. Nothing here writes to the
checkpoint root except ``prune`` (and ``prune --dry-run`` does not) and ``promote`` (which
copies a local tier's step there); nothing here follows a
step directory that is a symbolic link (it is listed as foreign and left alone). Exit codes: 0 success,
1 a damaged checkpoint was found (``verify``) or read, 2 any other error (bad arguments, no
such step or path, storage errors). Expected errors print one line on stderr, no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from ..errors import CheckpointError, CorruptCheckpointError
from .common import (
    EXIT_DAMAGED,
    EXIT_ERROR,
    EXIT_OK,
    _cell,
    _parse_options,  # noqa: F401  (used by tests and by earlier imports)
)
from .export import cmd_export, cmd_stats, load_step
from .inspect import cmd_ls, cmd_show
from .verify import cmd_promote, cmd_prune, cmd_verify

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "EXIT_OK", "build_parser", "load_step", "main"]


# ---- entry point -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("path", metavar="PATH", help="checkpoint root: a local path or an fsspec URL")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable; VALUE is parsed as JSON when it can be)")

    p = argparse.ArgumentParser(prog="async-ckpt", description="Inspect, verify, prune, promote and export async_ckpt "
                                "checkpoint directories (local paths or fsspec URLs), and show "
                                "their save statistics.")
    from .. import __version__

    p.add_argument("--version", action="version", version=f"async-ckpt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    local = argparse.ArgumentParser(add_help=False)
    local.add_argument("--local-dir", metavar="DIR",
                       help="also the local tier (a manager's local_dir; with several ranks, one rank's "
                            "<local_dir>/rank<r>)")

    s = sub.add_parser("ls", parents=[common, local], help="list steps: commit time, size, metrics, status")
    s.set_defaults(fn=cmd_ls)

    s = sub.add_parser("show", parents=[common], help="the tree of keys of a step, with shapes, dtypes, sizes")
    s.add_argument("step", metavar="STEP", nargs="?", help="a step, or 'latest' (default)")
    s.add_argument("--values", action="store_true",
                   help="also read and print small non-tensor values (learning rates, step counters)")
    s.set_defaults(fn=cmd_show)

    s = sub.add_parser("verify", parents=[common, local], help="check every file's checksum; exit 1 on damage")
    s.add_argument("step", metavar="STEP", nargs="?", help="a step, or 'latest' (default)")
    s.add_argument("--all", action="store_true", help="verify every committed step")
    bar = s.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always show the progress bar (default: only on a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show it")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("prune", parents=[common], help="delete committed steps a retention policy drops")
    s.add_argument("--keep-last", type=int, required=True, metavar="N", help="keep the N newest commits")
    s.add_argument("--keep-every", type=int, metavar="K", help="also keep every step divisible by K")
    s.add_argument("--dry-run", action="store_true", help="show what would be deleted, delete nothing")
    s.set_defaults(fn=cmd_prune)

    s = sub.add_parser("promote", parents=[common], help="upload a local tier's step to PATH and commit it there")
    s.add_argument("step", metavar="STEP", help="a step the local tier holds")
    s.add_argument("--local-dir", metavar="DIR", required=True, help="the local tier (a manager's local_dir)")
    s.set_defaults(fn=cmd_promote)

    s = sub.add_parser("export", parents=[common], help="write a step as one .pt or .safetensors file")
    s.add_argument("step", metavar="STEP", help="a step, or 'latest'")
    s.add_argument("out", metavar="OUT", help="output file (.pt/.pth: torch.save; .safetensors: tensors only)")
    s.add_argument("--key", metavar="PREFIX", help="export only this subtree, e.g. 'model'")
    s.add_argument("--allow-pickle", action="store_true",
                   help="unpickle non-tensor entries outside torch's safe set (only for trusted checkpoints)")
    s.set_defaults(fn=cmd_export)
    s = sub.add_parser("stats", parents=[common], help="the save statistics log (stats_log=True), as a table")
    s.add_argument("--log", metavar="RELPATH", help="the log's path under PATH (default: save_stats.jsonl)")
    s.add_argument("--last", type=int, metavar="N", help="only the N most recent saves")
    s.set_defaults(fn=cmd_stats)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.fn(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `async-ckpt ls ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except CorruptCheckpointError as exc:
        _error(exc)
        return EXIT_DAMAGED
    except (CheckpointError, OSError, ValueError, ImportError) as exc:
        _error(exc)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("async-ckpt: interrupted", file=sys.stderr)
        return 130


def _error(exc: BaseException) -> None:
    msg = _cell(" ".join(str(exc).split()) or type(exc).__name__)  # no control characters on the terminal
    print(f"async-ckpt: error: {msg}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
