"""The one fork-and-pipe trial harness of the SIGKILL trials (tests/damage/test_crash.py,
tests/incremental/test_incremental.py).

Importing torch costs seconds, so a worker imports torch and async_ckpt once and serves trials
(:func:`serve`): for each JSON line on stdin it forks a "training" child, lets it run the trial's
``delay`` seconds, SIGKILLs it, reaps it and answers one JSON line on stdout with what the child
reported through a pipe before it died (:func:`trial`):

    {"status": "killed"|"exited N", "committed": [...], "started": [...], "resumed": step|null,
     "resume_ok": bool|null, "error": str|null}

The child reports with ``report(kind, ...)``: ``report("s", step)`` a save started,
``report("c", step)`` a step committed, ``report("r", step, 0|1)`` the step it resumed from and
whether it restored bitwise; an exception it raises is reported as ``error``.

The test side starts such a worker with :func:`fork_server` and asks it one trial at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterator

Report = Callable[..., None]
Child = Callable[[Dict[str, Any], Report], None]


def trial(spec: Dict[str, Any], child: Child) -> Dict[str, Any]:
    """Fork ``child(spec, report)``, SIGKILL it after ``spec["delay"]`` seconds, and return what it
    reported (the dict in the module docstring)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)

        def report(*fields: Any) -> None:
            os.write(w, (" ".join(map(str, fields)) + "\n").encode())  # < PIPE_BUF: atomic

        try:
            try:
                child(spec, report)
            except BaseException:
                report("e", json.dumps(traceback.format_exc()))
                os._exit(3)
            os._exit(0)
        finally:
            os._exit(4)
    os.close(w)
    time.sleep(float(spec["delay"]))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    chunks = []
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    out: Dict[str, Any] = {"committed": [], "started": [], "resumed": None, "resume_ok": None, "error": None}
    for line in b"".join(chunks).decode().splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "c":
            out["committed"].append(int(rest))
        elif kind == "s":
            out["started"].append(int(rest))
        elif kind == "r":
            step, ok = rest.split()
            out["resumed"], out["resume_ok"] = int(step), bool(int(ok))
        elif kind == "e":
            out["error"] = json.loads(rest)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    out["status"] = "killed" if killed else f"exited {os.waitstatus_to_exitcode(status)}"
    return out


def serve(child: Child) -> None:
    """The worker's loop: say ready, then run one :func:`trial` of ``child`` per JSON line on stdin
    and answer each on stdout. Import (and warm up) whatever the child needs before calling it, so
    that a trial costs a fork, not an import."""
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(trial(json.loads(line), child)), flush=True)


@contextlib.contextmanager
def fork_server(tmp_path: Any, script: str, *args: str, **env: str) -> Iterator[Callable[[Dict[str, Any]], Dict[str, Any]]]:
    """Start the trial worker ``script`` (a file name under tests/workers/) with ``args`` and
    :func:`~tests.support.launch.worker_env` (``env`` on top), wait until it is ready, and yield
    ``ask(spec) -> result``; its stderr goes to ``tmp_path/worker.stderr``, quoted when it dies."""
    from .launch import worker_env
    from .paths import WORKERS

    err_path = os.path.join(str(tmp_path), "worker.stderr")

    def stderr_tail() -> str:
        with open(err_path) as f:
            return f.read()[-4000:]

    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, os.path.join(WORKERS, script), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=WORKERS, env=worker_env(**env))
        try:
            def ask(spec: Dict[str, Any]) -> Dict[str, Any]:
                proc.stdin.write(json.dumps(spec) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                assert line, f"{script} died; stderr:\n{stderr_tail()}"
                return json.loads(line)

            ready = proc.stdout.readline()
            assert ready.startswith('{"ready"'), f"{script} failed to start:\n{stderr_tail()}"
            yield ask
            proc.stdin.close()
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
