"""The writer process: a step's files written by another process, off the training process's GIL.

A training loop that dispatches work from one Python thread (as a GPU loop does) holds the
GIL nearly all the time; a background writer *thread* then slows it, however little Python it
runs: every time the writer thread comes back from a system call or a checksum it must take the
GIL from the loop. ``CheckpointManager(writer="process")`` (and ``"auto"`` on local paths) moves
the byte-moving part of a save — records rendered, CRC-32C computed, files written and
fsynced — into a process of its own, started once per training process and shared by its
managers; planning, the manifest, the commit, retention, the writer lease and the ranks'
exchanges stay in the training process.

Nothing is copied at the hand-off: the staging buffers are shared memory
(:mod:`async_ckpt.shared_memory`) that the writer process maps, and a save sends it
only a description of each item (a buffer id, an offset, dtype, shape and strides; the bytes of
non-tensor values, pickled at the call). Items outside shared buffers (a declared-frozen tensor
left uncopied, memory the system could not share) make their file go through the thread
writer, in the same save.

The process (:class:`WriterProcess`):

* is started with :mod:`subprocess` (``python -I -c``: isolated, nothing of the job's working
  directory or environment on its ``sys.path``), never ``fork`` of the training process
  and never ``multiprocessing``'s spawn (which re-imports the user's main script), in a
  session of its own, ignoring the signals a scheduler sends every process of the job
  (``SIGTERM``, ``SIGUSR1``, ``SIGINT``...): what they end is decided by the training process;
* ends by itself when the training process goes: at end-of-file on its socket, or when its
  parent changes (checked every half second), so a ``SIGKILL``-ed job leaves no writer behind;
* answers a job with the files' records (sizes, CRC-32Cs) or the error that ended it, raised
  in the training process as the thread writer raises it (``OSError`` with its errno, so the
  retry policy treats it alike); its death fails the jobs in flight with
  :class:`~async_ckpt.errors.WriterProcessError`, and the next save starts a new process;
* is used from one process only: after ``fork`` the child process starts its own.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import shared_memory
from ..errors import StorageError, WriterProcessError
from ..format.manifest import FileRecord
from ..format.torch_record import RECORDS, RecordTemplate, save_record
from ..storage import Storage
from . import writer_child

log = logging.getLogger("async_ckpt")

READY_TIMEOUT_S = 60.0  # the process answers once it can serve (its imports done)

Outs = List[Tuple[str, FileRecord, List[int]]]


# ---- what crosses: items described, errors carried --------------------------------------------

def _describe(data: Any, blocks: Dict[int, shared_memory.SharedBlock], templates: Dict[int, RecordTemplate]
              ) -> Optional[Tuple[Any, ...]]:
    """An item as the writer process writes it: a template's head and tail around a range of a
    shared segment (``("r", serial, segment id, offset, nbytes)``), or its record's bytes with where
    a tensor's data starts in them (``("b", bytes, data offset or -1, data bytes)``); ``None``
    for a tensor outside the shared blocks (its file is written by the thread writer).
    ``templates`` gathers the templates used, by serial."""
    if isinstance(data, io.BytesIO):
        return ("b", data.getvalue(), -1, 0)
    if type(data) is not torch.Tensor or not data.is_cpu:
        return None
    tpl = RECORDS.template(data)
    if tpl is None:  # e.g. an empty tensor or an expanded view: its record, rendered here
        buf = io.BytesIO()
        t = data.detach()
        at = save_record(t, buf)
        return ("b", buf.getvalue(), at, t.numel() * t.element_size())
    try:
        base = data.untyped_storage().data_ptr()
    except RuntimeError:
        return None
    blk = blocks.get(base)
    if blk is None:
        return None
    templates[tpl.serial] = tpl
    return ("r", tpl.serial, blk.segment.id, blk.offset + data.data_ptr() - base, tpl.nbytes)


def _rendered(items: List[Tuple[Any, ...]], lengths: List[int], templates: Dict[int, RecordTemplate]
              ) -> Dict[int, bytes]:
    """What must be where in a file the writer process rendered: each template-rendered
    record's head and tail, by file offset.

    Raises:
        WriterProcessError: a record's length is not its template's.
    """
    want: Dict[int, bytes] = {}
    at = 0
    for item, length in zip(items, lengths):
        if item[0] == "r":
            tpl = templates[item[1]]
            if length != tpl.length:
                raise WriterProcessError(f"the writer process wrote a record of {length} bytes at {at}, its "
                                         f"template makes {tpl.length}")
            want[at] = tpl.head
            want[at + tpl.length - len(tpl.tail)] = tpl.tail
        at += length
    return want


def _error_from(chain: List[Tuple[Optional[bytes], str, str]]) -> BaseException:
    """The error :func:`~.writer_child.error_chain` sent, rebuilt with its causes (what cannot be rebuilt
    becomes a :class:`WriterProcessError` naming it)."""
    built: List[BaseException] = []
    for blob, name, message in chain:
        err: Any = None
        if blob is not None:
            try:
                err = pickle.loads(blob)  # from the writer process this process started
            except Exception:  # noqa: BLE001 - rebuilt by name and message below
                err = None
        if not isinstance(err, BaseException):
            err = WriterProcessError(f"the writer process failed: {name}: {message}")
        built.append(err)
    for outer, inner in zip(built, built[1:]):
        outer.__cause__ = inner
    return built[0] if built else WriterProcessError("the writer process failed")


# ---- the training process's side ---------------------------------------------------------------

class WriterProcess:
    """The writer process of this training process (see the module docstring); :func:`shared`
    gives the one instance, started at its first job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the process, its socket and what it knows
        self._send_lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._sock: Optional[socket.socket] = None
        self._known: set = set()  # ids of the shared segments the process has mapped
        self._templates: set = set()  # serials of the record templates the process has
        self._pending: Dict[int, Tuple[Future, socket.socket]] = {}  # job id -> its future, its process's socket
        self._next_id = 0
        self._dead: Optional[str] = None
        self._cannot_start: Optional[str] = None  # why a process cannot be started at all
        self._owner = os.getpid()
        self.started = 0  # processes started so far

    # -- life --------------------------------------------------------------------------------------
    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # async_ckpt/
        python = sys.executable
        try:
            proc = subprocess.Popen([python, "-I", "-c", writer_child.BOOTSTRAP, package, str(child.fileno()),
                                     str(os.getpid()), *_module_dirs(writer_child.NEEDS)],
                                    pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:  # no python to run it (a virtualenv rebuilt under a long run...)
            parent.close()
            self._cannot_start = (f"the writer process cannot be started: its Python, {python!r}, cannot be run "
                                  f"({exc.strerror or exc})")
            raise WriterProcessError(self._cannot_start) from exc
        finally:
            child.close()
        parent.settimeout(READY_TIMEOUT_S)
        try:
            msg, _ = writer_child.recv(parent)
        except (OSError, EOFError) as exc:
            proc.kill()
            proc.wait()
            parent.close()
            raise WriterProcessError(f"the writer process did not start: {exc} (exit code {proc.poll()})") from exc
        parent.settimeout(None)
        if not (isinstance(msg, tuple) and msg[:1] == ("ready",)):
            proc.kill()
            parent.close()
            raise WriterProcessError(f"the writer process did not start: it said {msg!r}")
        self._proc, self._sock, self._known, self._dead = proc, parent, set(), None
        self._templates = set()
        self.started += 1
        threading.Thread(target=self._receive, args=(parent, proc), name="async-ckpt-writer-process",
                         daemon=True).start()

    def _ensure(self) -> socket.socket:
        if os.getpid() != self._owner:
            raise WriterProcessError("a writer process belongs to the process that started it (this one was forked)")
        if self._sock is None or self._dead is not None:
            self._stop()
            self._start()
        assert self._sock is not None
        return self._sock

    def _receive(self, sock: socket.socket, proc: subprocess.Popen) -> None:
        why = "its socket closed"
        try:
            while True:
                msg, _ = writer_child.recv(sock)
                with self._lock:
                    fut, _ = self._pending.pop(msg[1], (None, None))
                if fut is None:
                    continue
                if msg[0] == "done":
                    fut.set_result(msg[2])
                else:
                    fut.set_exception(_error_from(msg[2]))
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            why = str(exc)
        code = proc.poll()
        if code is None:
            try:
                code = proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                code = None
        dead = (f"the writer process (pid {proc.pid}) ended "
                + (f"with {_exit_text(code)}" if code is not None else f"({why})"))
        with self._lock:
            if self._sock is sock:
                self._dead = dead
            pending = {k: fut for k, (fut, s) in self._pending.items() if s is sock}  # not a newer process's
            for k in pending:
                del self._pending[k]
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(WriterProcessError(f"{dead} while writing; the next save starts a new one"))

    def _stop(self) -> None:
        sock, proc = self._sock, self._proc
        self._sock, self._proc = None, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already gone: closed below
            sock.close()
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Stop the process (it finishes nothing more; jobs in flight fail)."""
        with self._lock:
            if os.getpid() == self._owner:
                self._stop()

    def kill(self) -> None:
        """End the process at once (``SIGKILL``): for a job that must not read its buffers any
        more, and for tests."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._dead = f"the writer process (pid {self._proc.pid}) was stopped"

    def usable(self) -> bool:
        """Whether jobs can be sent: the process runs or starts now. False (and one warning,
        the first time) where it cannot be started at all, as when the Python that runs it is
        gone: saves are then written by the training process's writer thread. A process that
        started but did not answer is tried again by the job (whose save it fails).
        """
        with self._lock:
            if self._cannot_start is None:
                try:
                    self._ensure()
                except WriterProcessError:
                    if self._cannot_start is None:
                        return True  # the job's own start raises it, in its phase
                    log.warning("%s; saves are written by the training process's writer thread instead",
                                self._cannot_start)
            return self._cannot_start is None

    @property
    def pid(self) -> Optional[int]:
        """The running process's pid (None before the first job)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    # -- jobs --------------------------------------------------------------------------------------
    def submit(self, job: Dict[str, Any], blocks: Sequence[shared_memory.Segment],
               templates: Dict[int, RecordTemplate], op: str = "write") -> "Future[Any]":
        """Send a job (``op``: ``"write"`` files, ``"hash"`` block ranges); ``blocks``: the
        shared segments its items live in; ``templates``: the record templates its items name,
        by serial.

        Returns:
            The future of its files' ``(name, record, item lengths)``.

        Raises:
            WriterProcessError: the process could not be started or reached.
        """
        with self._lock:
            # A process found gone at the send (it died between saves, unnoticed yet) has none
            # of this job: it is sent once more, to a new process.
            for attempt in (0, 1):
                sock = self._ensure()
                fut: "Future[Outs]" = Future()
                self._next_id += 1
                job_id = self._next_id
                self._pending[job_id] = (fut, sock)
                try:
                    self._send(sock, op, job_id, job, blocks, templates)
                    return fut
                except OSError as exc:
                    self._pending.pop(job_id, None)
                    self._dead = f"the writer process could not be reached ({exc})"
                    if attempt:
                        raise WriterProcessError(f"{self._dead}; the next save starts a new one") from exc
        raise AssertionError("unreachable")

    def _send(self, sock: socket.socket, op: str, job_id: int, job: Dict[str, Any],
              blocks: Sequence[shared_memory.Segment], templates: Dict[int, RecordTemplate]) -> None:
        """Send a job with the blocks and templates the process does not have yet (under ``_lock``)."""
        with self._send_lock:
            gone = shared_memory.take_closed()
            if gone:
                self._known -= set(gone)
                writer_child.send(sock, ("forget", gone))
            new = [b for b in blocks if b.id not in self._known and b.fd >= 0]
            for k in range(0, len(new), writer_child.MAX_FDS):
                part = new[k:k + writer_child.MAX_FDS]
                writer_child.send(sock, ("blocks", [(b.id, b.nbytes) for b in part]), [b.fd for b in part])
                self._known.update(b.id for b in part)
            job = dict(job, templates={t: (tpl.head, tpl.tail) for t, tpl in templates.items()
                                       if t not in self._templates})
            writer_child.send(sock, (op, job_id, job))
            self._templates.update(templates)


def _module_dirs(names: Sequence[str]) -> List[str]:
    """The ``sys.path`` directories the modules ``names`` are imported from in this process
    (the isolated writer process is given exactly these; a module not found is left out)."""
    import importlib.util

    out: List[str] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not os.path.isabs(spec.origin):
            continue
        where = os.path.dirname(spec.origin)
        if spec.submodule_search_locations is not None:  # a package: its directory's parent
            where = os.path.dirname(where)
        if where not in out:
            out.append(where)
    return out


def _exit_text(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


#: The executor of the save being written on this thread (:func:`executing`); ``None``: the
#: thread writer writes its files.
_EXECUTOR: ContextVar[Optional["ProcessExecutor"]] = ContextVar("async_ckpt_executor", default=None)


@contextmanager
def executing(executor: Optional["ProcessExecutor"]) -> Iterator[None]:
    """Write (and hash) the files of the saves made inside the block through ``executor``
    (``None``: this thread's writer)."""
    token = _EXECUTOR.set(executor)
    try:
        yield
    finally:
        _EXECUTOR.reset(token)


def current_executor() -> Optional["ProcessExecutor"]:
    """The executor of :func:`executing` on this thread, if any."""
    return _EXECUTOR.get()


#: cores per file the writer process writes at once (local files): one per this many cores
CORES_PER_WRITING_FILE = 8


def files_at_once(threads: int) -> int:
    """How many local files the writer process writes at once: one per
    :data:`CORES_PER_WRITING_FILE` cores of the machine, at least one, at most ``threads``.

    Each file being written keeps a core busy (its CRC-32C and the copy into the page cache);
    the writer leaves the others to training: on this project's 2-core machine a launch-bound
    loop lost about 4x as much time to 8 files written at once as to one, while one file at a
    time made the save durable only ~10% later (early writeback overlaps a file's disk writes
    with the next one's copy). The files a save is cut into do not change.
    """
    return max(1, min(threads, (os.cpu_count() or 1) // CORES_PER_WRITING_FILE))


_SHARED: Optional[WriterProcess] = None
_SHARED_LOCK = threading.Lock()


def shared() -> WriterProcess:
    """This process's writer process handle (one per process: after ``fork`` a new one)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED._owner != os.getpid():
            _SHARED = WriterProcess()
        return _SHARED


def close_shared() -> None:
    """Stop this process's writer process, if it started one (at interpreter exit)."""
    with _SHARED_LOCK:
        if _SHARED is not None and _SHARED._owner == os.getpid():
            _SHARED.close()


class ProcessExecutor:
    """Writes a save's files through the writer process, those of its items that live in the
    snapshot's shared buffers; :meth:`write_files` has the contract of the thread writer's.

    Args:
        process: the writer process.
        blocks: the snapshot's shared-memory blocks.
        timeout_s: the longest a job may go without finishing once the process has it (then
            the process is killed, so it reads the buffers no more, and the save fails); None:
            no bound (local files, as the thread writer's).
    """

    def __init__(self, process: WriterProcess, blocks: Sequence[shared_memory.SharedBlock],
                 timeout_s: Optional[float] = None) -> None:
        self.process = process
        self.blocks = {b.address: b for b in blocks}
        self.segments = {b.segment.id: b.segment for b in blocks}
        self.timeout_s = timeout_s
        #: files the writer process wrote so far (the others: the thread writer)
        self.files_written = 0
        #: per file it wrote, the bytes its records' heads and tails must be, by file offset:
        #: checked before the step commits (:func:`.write.write_files`)
        self.rendered: Dict[str, Dict[int, bytes]] = {}

    def hashes(self, objs: List[Any], hashable: Callable[[Any], bool]) -> List[Optional[int]]:
        """The XXH3-128 of each of ``objs`` that ``hashable`` takes and that lives in the
        snapshot's shared blocks, computed by the writer process (``None``: the caller hashes it).

        Raises:
            WriterProcessError: the process died or could not be reached.
        """
        return _hash_items(self, objs, hashable)

    def write_files(self, storage: Storage, path: str, names: List[str], buckets: List[List[Any]], hints: List[int],
                    threads: int, resolve: Callable[[Any], Any], records: bool,
                    in_thread: Callable[[List[int], List[List[Any]]], Outs]) -> Outs:
        """Each bucket as one file (named by ``names``): in the writer process where every item
        of it can be described, else by ``in_thread`` (the thread writer, given the bucket
        numbers and their items' data, resolved once here).

        Returns:
            Per bucket, in order: its file's name, record and item lengths.

        Raises:
            WriterProcessError: the process died or could not be reached.
            OSError, StorageError: as the thread writer raises them.
        """
        # Each item is resolved once (a planner may refuse a second resolve of an item): a file
        # left to the thread writer gets its items' data as resolved here.
        datas = [[resolve(job) for job in bucket] for bucket in buckets]
        described: Dict[int, List[Tuple[Any, ...]]] = {}
        others: List[int] = []
        used: Dict[int, shared_memory.Segment] = {}
        templates: Dict[int, RecordTemplate] = {}
        for k, bucket in enumerate(datas):
            items: List[Tuple[Any, ...]] = []
            for data in bucket:
                d = _describe(data, self.blocks, templates)
                if d is None:
                    break
                items.append(d)
                if d[0] == "r":
                    used[d[2]] = self.segments[d[2]]
            if len(items) == len(bucket):
                described[k] = items
            else:
                others.append(k)
        outs: Dict[int, Tuple[str, FileRecord, List[int]]] = {}
        fut: Optional[Future] = None
        if described:
            job = {"root": storage.url, "retry": storage.retry, "path": path,
                   "files": [(k, names[k], described[k], hints[k]) for k in sorted(described)],
                   "threads": files_at_once(threads), "records": records}
            fut = self.process.submit(job, list(used.values()), templates)
        try:
            if others:
                for k, out in zip(others, in_thread(others, [datas[k] for k in others])):
                    outs[k] = out
        finally:
            if fut is not None:
                for k, out in _wait(fut, self.process, self.timeout_s):
                    outs[k] = out
                    self.files_written += 1
        for k, items in described.items():
            self.rendered[names[k]] = _rendered(items, outs[k][2], templates)
        return [outs[k] for k in range(len(buckets))]


def _hash_items(executor: "ProcessExecutor", objs: List[Any], hashable: Callable[[Any], bool]
                ) -> List[Optional[int]]:
    items: List[Tuple[int, int, int]] = []
    where: List[int] = []
    used: Dict[int, shared_memory.Segment] = {}
    for i, t in enumerate(objs):
        if not hashable(t):
            continue
        try:
            base = t.untyped_storage().data_ptr()
        except RuntimeError:
            continue
        blk = executor.blocks.get(base)
        if blk is None:
            continue
        items.append((blk.segment.id, blk.offset + t.data_ptr() - base, t.numel() * t.element_size()))
        used[blk.segment.id] = blk.segment
        where.append(i)
    out: List[Optional[int]] = [None] * len(objs)
    if items:
        fut = executor.process.submit({"items": items}, list(used.values()), {}, op="hash")
        for i, h in zip(where, _wait(fut, executor.process, executor.timeout_s)):
            out[i] = h
    return out


def _wait(fut: "Future[Any]", process: WriterProcess, timeout_s: Optional[float]) -> Any:
    """The job's result; past ``timeout_s`` the process is killed (it reads the buffers no more)
    and the job fails."""
    start = time.monotonic()
    while True:
        try:
            return fut.result(timeout=1.0)
        except TimeoutError:
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                process.kill()
                raise StorageError(f"the writer process did not finish writing within {timeout_s:.0f} s; "
                                   "it was stopped, and the next save starts a new one") from None


def _forget_after_fork() -> None:
    """In a forked child: drop the parent's handle without touching the connection it shares
    (closing only this process's descriptor; a shutdown would end the parent's too)."""
    global _SHARED
    proc = _SHARED
    _SHARED = None
    if proc is not None and proc._sock is not None:
        try:
            os.close(proc._sock.detach())
        except OSError:
            pass  # not open in this process: nothing to drop


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)

__all__ = ["ProcessExecutor", "WriterProcess", "close_shared", "current_executor", "executing", "shared"]
