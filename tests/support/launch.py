"""The one way the tests start workers in processes of their own: ``torchrun`` over gloo, or
plain Python, with the environment every worker needs (this checkout importable, PJRT on CPU,
one OpenMP thread per rank on a 2-core machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .paths import REPO, WORKERS


def worker_env(**extra: str) -> dict:
    """This process's environment with the checkout on ``PYTHONPATH``, ``PJRT_DEVICE=CPU`` and
    ``OMP_NUM_THREADS=1``; ``extra`` on top (a value of ``""`` is kept as the empty string)."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PJRT_DEVICE": "CPU",
                "PYTHONPATH": os.pathsep.join([REPO, env.get("PYTHONPATH", "")])})
    env.update(extra)
    return env


def torchrun_command(nproc: int, script: str, *args: str) -> List[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=nproc script args...``
    (``script``: a path, or a file name under tests/workers/)."""
    path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", path,
            *map(str, args)]


def torchrun(nproc: int, script: str, *args: str, env: Optional[dict] = None, timeout: float = 300,
             drop: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` ranks under torchrun and wait (at most ``timeout`` seconds).

    Args:
        nproc: ranks.
        script: the worker (a path, or a file name under tests/workers/).
        args: its arguments.
        env: extra environment variables (on top of :func:`worker_env`'s).
        timeout: seconds before the launch is killed (``subprocess.TimeoutExpired``).
        drop: environment variables to remove (e.g. ``PYTHONHASHSEED``).

    Returns:
        The finished process, its stderr merged into ``stdout`` (text).
    """
    full = worker_env(**(env or {}))
    for name in drop:
        full.pop(name, None)
    return subprocess.run(torchrun_command(nproc, script, *args), env=full, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def start_ranks(world: int, script: str, *args: str, env: Optional[Dict[str, str]] = None,
                rank_env: Optional[Callable[[int], Dict[str, str]]] = None) -> List[subprocess.Popen]:
    """Start ``world`` ranks of ``script`` by hand, without torchrun (which would end the others
    when one dies): each with :func:`worker_env`, ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` /
    ``MASTER_PORT`` (a free port), then ``env`` and ``rank_env(rank)`` on top; stderr merged into
    stdout (text). Collect each with :func:`finish`."""
    from .storage_servers import free_port

    port = str(free_port())
    procs = []
    for rank in range(world):
        full = worker_env(**{"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": port, **(env or {}), **(rank_env(rank) if rank_env else {})})
        procs.append(subprocess.Popen([sys.executable, os.path.join(WORKERS, script), *map(str, args)], env=full,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(proc: subprocess.Popen, timeout: float) -> Tuple[int, str]:
    """Wait at most ``timeout`` seconds for ``proc`` (stdout piped, text) and kill it past that.

    Returns:
        Its exit status (negative: the signal that ended it) and its whole output.
    """
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out or ""
