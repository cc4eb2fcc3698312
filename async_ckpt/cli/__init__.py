"""The ``async-ckpt`` command: look into, verify, prune, promote and export checkpoint directories,
and read the save statistics log. ``ls`` and ``verify`` take ``--local-dir`` for a local tier.

Every subcommand takes a checkpoint root (a local path or any fsspec URL), prints a readable
table, and with ``--json`` prints one JSON document instead. Nothing here writes to the
checkpoint root except ``prune`` (and ``prune --dry-run`` does not) and ``promote`` (which
copies a local tier's step there); nothing here follows a
step directory that is a symbolic link (it is listed as foreign and left alone). Exit codes: 0 success,
1 a damaged checkpoint was found (``verify``) or read, 2 any other error (bad arguments, no
such step or path, storage errors). Errors print one line on stderr, no traceback (with
``--json``: one JSON object on stdout instead); third-party loggers stay quiet unless
``--verbose``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import traceback
from typing import Any, List, NoReturn, Optional, Sequence

from ..errors import CheckpointError, CorruptCheckpointError, LeaseHeldError, StorageUnreachableError
from ..storage.lease import LEASE_WAIT_HINT
from .common import (
    DEFAULT_CONNECT_TIMEOUT,
    EXIT_DAMAGED,
    EXIT_ERROR,
    EXIT_OK,
    cell_text,
    cli_unreachable_message,
)
from .export import cmd_export, cmd_stats, load_step
from .inspect import cmd_ls, cmd_show
from .verify import cmd_import, cmd_promote, cmd_prune, cmd_rm, cmd_verify

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "EXIT_OK", "build_parser", "load_step", "main"]


# ---- entry point -----------------------------------------------------------------------------

class UsageError(CheckpointError):
    """A command line argparse refuses (unknown option, missing or malformed argument)."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """Raises :class:`UsageError` (with the parser that refused: a subcommand's usage, not the
    top level's) instead of printing and exiting, so that ``main`` reports it (as JSON with
    ``--json``)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``async-ckpt`` argument parser (every subcommand, with its options).

    Returns:
        The parser; its ``error`` raises :class:`UsageError` instead of exiting.
    """
    common = _Parser(add_help=False)
    common.add_argument("path", metavar="PATH", help="checkpoint root: a local path or an fsspec URL")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table (errors too)")
    common.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable; VALUE is parsed as JSON when it can be)")
    common.add_argument("--connect-timeout", type=_positive, default=DEFAULT_CONNECT_TIMEOUT, metavar="SECONDS",
                        help="give up when a remote root does not answer its first request within this "
                             f"long (default {DEFAULT_CONNECT_TIMEOUT:g})")
    common.add_argument("-v", "--verbose", action="store_true",
                        help="show the storage clients' log messages, and a traceback on errors")
    lease = _Parser(add_help=False)
    lease.add_argument("--lease-timeout", type=_positive, default=0.0, metavar="SECONDS",
                       help="wait up to this long for PATH's writer lease while another writer holds it "
                            "(default 0: refuse at once)")

    p = _Parser(prog="async-ckpt", description="Inspect, verify, prune, promote and export async_ckpt "
                                "checkpoint directories (local paths or fsspec URLs), and show "
                                "their save statistics.")
    from .. import __version__

    p.add_argument("--version", action="version", version=f"async-ckpt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    local = _Parser(add_help=False)
    local.add_argument("--local-dir", metavar="DIR",
                       help="also the local tier (a manager's local_dir; with several ranks, one rank's "
                            "<local_dir>/rank<r>)")

    s = sub.add_parser("ls", parents=[common, local], help="list steps: commit time, size, metrics, status",
                       description="List every step directory under PATH (and the local tier's with "
                                   "--local-dir): commit time, size, metrics, and status (listed, damaged, "
                                   "incomplete, superseded, foreign), and name the newest intact step "
                                   "(what restore(None) takes). Reads only.")
    s.add_argument("--verify", action="store_true",
                   help="read and checksum the newest steps, as restore(None) does, until one verifies "
                        "(marked verified; those that fail DAMAGED)")
    s.set_defaults(fn=cmd_ls)

    s = sub.add_parser("show", parents=[common], help="the tree of keys of a step, with shapes, dtypes, sizes",
                       description="Print the tree of keys of a committed step with each tensor's shape, "
                                   "dtype and size, read from its metadata. Reads only.")
    s.add_argument("step", metavar="STEP", nargs="?", help="a step, or 'latest' (default)")
    s.add_argument("--values", action="store_true",
                   help="also read and print small non-tensor values (learning rates, step counters)")
    s.set_defaults(fn=cmd_show)

    s = sub.add_parser("verify", parents=[common, local], help="check every file's checksum; exit 1 on damage",
                       description="Read every file of a committed step (or of all with --all) and check "
                                   "its size and CRC-32C against the manifest, and the metadata as a restore "
                                   "checks it. Exit code 1 when a step is damaged, 2 on any other error. "
                                   "Reads only.")
    s.add_argument("step", metavar="STEP", nargs="?", help="a step, or 'latest' (default)")
    s.add_argument("--all", action="store_true", help="verify every committed step")
    bar = s.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always show the progress bar (default: only on a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show it")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("prune", parents=[common, lease], help="delete committed steps a retention policy drops",
                       description="Delete the committed steps that --keep-last/--keep-best/--keep-every do not "
                                   "keep (the newest intact commit always stays; damaged steps are left alone; "
                                   "steps the job's own retention keeps, as its manifests record it, stay "
                                   "unless --force). Takes PATH's writer lease, so it refuses while a training "
                                   "job writes there.")
    s.add_argument("--keep-last", type=int, metavar="N", help="keep the N newest commits")
    s.add_argument("--keep-best", type=int, metavar="N", help="keep the N steps with the best --metric")
    s.add_argument("--metric", metavar="NAME", help="the metric --keep-best ranks by (a key of the saves' metrics=)")
    s.add_argument("--mode", choices=("min", "max"), default="min",
                   help="with --keep-best: the best is the lowest (min, a loss; default) or highest (max)")
    s.add_argument("--keep-every", type=int, metavar="K", help="also keep every step divisible by K")
    s.add_argument("--force", action="store_true",
                   help="also delete steps the job's own retention keeps (recorded in its manifests)")
    s.add_argument("--dry-run", action="store_true", help="show what would be deleted, delete nothing")
    s.set_defaults(fn=cmd_prune)

    s = sub.add_parser("promote", parents=[common, lease], help="upload a local tier's step to PATH and commit it there",
                       description="Copy a step of the local tier (--local-dir) to PATH, verifying every "
                                   "file, and commit it there (refused when PATH holds the step already). Takes "
                                   "PATH's writer lease.")
    s.add_argument("step", metavar="STEP", help="a step the local tier holds")
    s.add_argument("--local-dir", metavar="DIR", required=True, help="the local tier (a manager's local_dir)")
    s.set_defaults(fn=cmd_promote)

    s = sub.add_parser("rm", parents=[common, lease],
                       help="delete committed steps, as CheckpointManager.delete does, or incomplete ones "
                            "(takes the writer lease)",
                       description="Delete the given committed steps, as CheckpointManager.delete does (only "
                                   "those), or with --incomplete the steps that never committed (a killed "
                                   "save's). Takes PATH's writer lease, so it refuses while a writer holds it.")
    s.add_argument("steps", metavar="STEP", nargs="*", help="committed steps to delete")
    s.add_argument("--incomplete", action="store_true",
                   help="delete the steps that never committed (ls: INCOMPLETE); refused while a writer holds "
                        "the lease (a save may be in progress)")
    s.set_defaults(fn=cmd_rm)

    s = sub.add_parser("import", parents=[common, lease],
                       help="save a plain DCP checkpoint directory (torch_xla's, torchtitan's) as a step of PATH",
                       description="Read SOURCE, a DCP checkpoint directory another program wrote (no "
                                   "COMMITTED marker), and save it as STEP of PATH, committed and "
                                   "checksummed. SOURCE is only read. Takes PATH's writer lease.")
    s.add_argument("source", metavar="SOURCE", help="the DCP checkpoint directory (a local path or fsspec URL)")
    s.add_argument("step", metavar="STEP", help="the step to save it as")
    s.add_argument("--allow-pickle", action="store_true",
                   help="unpickle non-tensor entries outside torch's safe set (only for trusted checkpoints)")
    s.set_defaults(fn=cmd_import)

    s = sub.add_parser("export", parents=[common],
                       help="write a step as one .pt or .safetensors file, or a Hugging Face directory",
                       description="Read a committed step (verified) and write it, or the subtree --key "
                                   "selects, as one torch.save (.pt/.pth) or safetensors file, or (--format "
                                   "hf) as a Hugging Face checkpoint directory: sharded safetensors and "
                                   "model.safetensors.index.json, as save_pretrained writes them. Writes "
                                   "only OUT (in a directory: only the files it names).")
    s.add_argument("step", metavar="STEP", help="a step, or 'latest'")
    s.add_argument("out", metavar="OUT", help="output file (.pt/.pth: torch.save; .safetensors: tensors only), "
                                              "or directory (--format hf)")
    s.add_argument("--format", dest="fmt", choices=["auto", "hf"], default="auto",
                   help="auto: by OUT's extension; hf: a Hugging Face directory (tensors only)")
    s.add_argument("--max-shard-size", metavar="SIZE", default="5GB",
                   help="--format hf: the most bytes per shard file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    s.add_argument("--dtype", metavar="DTYPE", help="--format hf: cast floating-point tensors, e.g. bfloat16")
    s.add_argument("--key", metavar="PREFIX", help="export only this subtree, e.g. 'model'")
    s.add_argument("--allow-pickle", action="store_true",
                   help="unpickle non-tensor entries outside torch's safe set (only for trusted checkpoints)")
    s.add_argument("--force", action="store_true", help="overwrite OUT if it exists (refused otherwise)")
    bar = s.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always show the progress bar of the bytes written (default: only on a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show it")
    s.set_defaults(fn=cmd_export)
    s = sub.add_parser("stats", parents=[common], help="the save statistics log (stats_log=True), as a table",
                       description="Print the save statistics log a manager made with stats_log=True "
                                   "keeps under PATH: per save (per tier with a local tier), its blocking "
                                   "time, write and commit times and rates, sizes and marks; medians, "
                                   "sparklines; --plot draws them.")
    s.add_argument("--log", metavar="RELPATH", help="the log's path under PATH (default: save_stats.jsonl)")
    s.add_argument("--last", type=int, metavar="N", help="only the N most recent saves")
    s.add_argument("--plot", metavar="OUT", help="also draw the saves to OUT (.png, .svg, .pdf): blocking and "
                                                 "durable time per step, bytes written and shared, marks for "
                                                 "skipped uploads, fallbacks and failures (needs matplotlib)")
    s.add_argument("--watch", type=_positive, metavar="SECONDS",
                   help="print the table again every SECONDS until Ctrl-C (a job's saves as they come)")
    s.set_defaults(fn=cmd_stats)
    for sp in sub.choices.values():
        sp.set_defaults(_parser=sp)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line (the console script exits with what it returns).

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 success, 1 a damaged checkpoint, 2 any other error (one line on
        stderr, or with ``--json`` one JSON object ``{"error": {...}}`` on stdout).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    verbose = "-v" in argv or "--verbose" in argv
    with _quiet_logs(verbose):
        parser = build_parser()
        try:
            args, extra = parser.parse_known_args(argv)
            if extra:  # the subcommand's usage, not the top level's
                getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
            if args.command == "prune" and args.keep_last is None and args.keep_best is None:
                args._parser.error("one of the arguments --keep-last --keep-best is required")
            if args.command == "rm" and not args.steps and not args.incomplete:
                args._parser.error("give the STEPs to delete, or --incomplete")
        except UsageError as exc:
            return _usage_error(exc, as_json)
        try:
            code = int(args.fn(args))
            sys.stdout.flush()
            return code
        except BrokenPipeError:  # `async-ckpt ls ... | head`: stop quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return EXIT_OK
        except KeyboardInterrupt:
            return _error("interrupted", "KeyboardInterrupt", 130, as_json)
        except CorruptCheckpointError as exc:
            return _fail(exc, EXIT_DAMAGED, as_json, verbose, hint=_damage_hint(args))
        except LeaseHeldError as exc:
            return _fail(exc, EXIT_ERROR, as_json, verbose, text=cli_lease_message(exc))
        except StorageUnreachableError as exc:
            return _fail(exc, EXIT_ERROR, as_json, verbose, text=cli_unreachable_message(exc))
        except (CheckpointError, OSError, ValueError, ImportError) as exc:
            return _fail(exc, EXIT_ERROR, as_json, verbose)
        except Exception as exc:  # noqa: BLE001 - a bug or an unexpected storage error: still one line
            return _fail(exc, EXIT_ERROR, as_json, verbose, unexpected=True)


def _usage_error(exc: UsageError, as_json: bool) -> int:
    prog = exc.parser.prog
    if as_json:
        _print_error({"type": "UsageError", "message": str(exc), "exit_code": EXIT_ERROR,
                      "usage": exc.parser.format_usage().strip()})
    else:
        sys.stderr.write(exc.parser.format_usage())
        print(f"{prog}: error: {cell_text(str(exc))}", file=sys.stderr)
    return EXIT_ERROR


def _damage_hint(args: argparse.Namespace) -> str:
    """What to do about a damaged step a command had to read."""
    if args.command == "verify":
        return ""
    return (f"; `async-ckpt verify {args.path}` names the newest intact step"
            + (" (`export ... latest` takes it)" if args.command == "export" else ""))


def cli_lease_message(exc: LeaseHeldError) -> str:
    """The lease error with the command's option for waiting, ``--lease-timeout SECONDS``,
    instead of the Python argument ``lease_timeout=`` (which the message names in the API)."""
    return str(exc).replace(LEASE_WAIT_HINT, "pass --lease-timeout SECONDS to wait")


def _fail(exc: BaseException, code: int, as_json: bool, verbose: bool, unexpected: bool = False,
          hint: str = "", text: Optional[str] = None) -> int:
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    msg = " ".join((str(exc) if text is None else text).split()) or type(exc).__name__
    step = getattr(exc, "step", None)
    if isinstance(step, int) and not re.search(rf"\bsteps? {step}\b", msg):  # every error names its step
        msg = f"step {step}: {msg}"
    msg += hint
    if unexpected:
        msg = (f"{type(exc).__name__}: {msg} (unexpected; rerun with --verbose for the traceback, "
               f"and please report it)")
    return _error(msg, type(exc).__name__, code, as_json)


def _error(msg: str, kind: str, code: int, as_json: bool) -> int:
    if as_json:
        _print_error({"type": kind, "message": msg, "exit_code": code})
    else:
        print(f"async-ckpt: error: {cell_text(msg)}", file=sys.stderr)  # no control characters on the terminal
    return code


def _print_error(err: Any) -> None:
    print(json.dumps({"error": err}, indent=2, sort_keys=True))
    sys.stdout.flush()


_RETRY_RE = re.compile(r"; retry \d+/\d+ in ")


class _LogSink(logging.Handler):
    """The CLI's log handler: the storage clients (gcsfs, aiohttp, botocore, ...) log retries
    with tracebacks; the command prints one line instead; with ``--verbose`` prints every record."""

    def __init__(self, verbose: bool) -> None:
        super().__init__(logging.DEBUG if verbose else logging.WARNING)
        self.verbose = verbose
        self.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            ours = record.name.split(".")[0] == "async_ckpt" and record.levelno >= logging.WARNING
            if self.verbose:
                sys.stderr.write(self.format(record) + "\n")
            elif ours and not _RETRY_RE.search(record.getMessage()):  # a retry is summed up by the error
                print(f"async-ckpt: warning: {cell_text(' '.join(record.getMessage().split()))}", file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging never fails the command
            pass


class _quiet_logs:
    """Route every logger through :class:`_LogSink` for the command's duration (restored after:
    ``main`` also runs in-process)."""

    def __init__(self, verbose: bool) -> None:
        self.sink = _LogSink(verbose)
        self.saved: List[Any] = []

    def __enter__(self) -> "_quiet_logs":
        root = logging.getLogger()
        self.saved = [root.level, root.handlers[:], logging.lastResort]
        root.handlers = [self.sink]
        root.setLevel(self.sink.level)
        logging.lastResort = None
        return self

    def __exit__(self, *exc: Any) -> None:
        root = logging.getLogger()
        level, handlers, last = self.saved
        root.setLevel(level)
        root.handlers = handlers
        logging.lastResort = last


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
