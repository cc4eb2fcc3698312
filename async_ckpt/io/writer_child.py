"""The writer process's own code, and the messages between it and the training process.

It imports no torch (nor anything of async_ckpt that does): the process starts in a fraction
of a second and holds tens of MiB, not the training process's hundreds. It is started by
:class:`~async_ckpt.io.writer_process.WriterProcess` with :data:`BOOTSTRAP`, which
makes ``async_ckpt`` and its packages importable without running their package ``__init__``
(which import torch), then calls :func:`child_main`.

What it does: it maps the shared-memory staging blocks it is sent (their descriptors come
with the message, ``SCM_RIGHTS``), hashes ranges of them (XXH3-128, for incremental saves:
:func:`~async_ckpt.io.reuse.content_hash`'s hash), and writes data files from
descriptions of their records
— a template's head and tail around a range of a block, or bytes — through the same
:func:`~.record_stream.write_record_file` as the training process's writer thread, so a file
and its record (sizes, CRC-32Cs) are the same whichever process wrote it. Each job runs on a
thread of its own; each answer is the files' records or the error that ended the job (with
its causes). It ends when its socket closes or its parent changes.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import struct
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..storage.storage import Storage
from .record_stream import RecordStream, keep_data_at, write_record_file

_HEADER = struct.Struct("<QI")  # payload bytes, descriptors attached
MAX_FDS = 250  # descriptors per message (SCM_RIGHTS allows 253 on Linux)

#: ``python -I -c`` code that starts the writer process: ``argv``: the package directory, the
#: socket's descriptor, the parent's pid, then the directories its third-party modules
#: (``crc32c``, ``xxhash``) were found in by the training process. Isolated (``-I``): neither the
#: working directory nor ``PYTHON*`` variables nor the user's site directory reach its
#: ``sys.path``, so a ``random.py`` or ``queue.py`` beside the job is never run; the directories
#: named are appended after the standard library. It ignores the signals a scheduler sends every
#: process of a job (``SIGTERM``, ``SIGUSR1``... of Slurm and systemd, a Ctrl-C's ``SIGINT``):
#: the training process decides what they end, and the writer ends with it. The packages it imports from are stood in for
#: by empty modules with the package's path, so that importing this module runs no
#: ``__init__`` of theirs (they import torch).
BOOTSTRAP = (
    "import signal, sys, types\n"
    "for s in ('SIGINT', 'SIGTERM', 'SIGHUP', 'SIGUSR1', 'SIGUSR2'):\n"
    "    signal.signal(getattr(signal, s), signal.SIG_IGN)\n"
    "sys.path += [p for p in sys.argv[4:] if p not in sys.path]\n"
    "pkg = sys.argv[1]\n"
    "for name, sub in (('async_ckpt', ''), ('async_ckpt.format', '/format'), ('async_ckpt.storage', '/storage'),\n"
    "                  ('async_ckpt.io', '/io')):\n"
    "    m = types.ModuleType(name); m.__path__ = [pkg + sub]; sys.modules[name] = m\n"
    "from async_ckpt.io.writer_child import child_main\n"
    "child_main(int(sys.argv[2]), int(sys.argv[3]))\n"
)

#: the third-party modules the writer process imports (``xxhash`` only for incremental saves)
NEEDS = ("crc32c", "xxhash")


# ---- framing: pickled messages over a Unix socket, with descriptors ---------------------------

def send(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    """One message: a header, then the pickle; ``fds`` ride with its first byte.

    Pickle is the framing between two processes of one job (the training process and the
    writer process it started), never a file format.
    """
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = _HEADER.pack(len(payload), len(fds)) + payload
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def _recv_exact(sock: socket.socket, n: int, into: bytearray) -> None:
    while len(into) < n:
        chunk = sock.recv(min(n - len(into), 1 << 20))
        if not chunk:
            raise EOFError("the other end of the writer process's socket closed")
        into += chunk


def recv(sock: socket.socket) -> Tuple[Any, List[int]]:
    """The next message and the descriptors that came with it.

    Raises:
        EOFError: the other end closed the socket.
    """
    msg, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
    if not msg:
        raise EOFError("the other end of the writer process's socket closed")
    head = bytearray(msg)
    _recv_exact(sock, _HEADER.size, head)
    size, nfds = _HEADER.unpack(head)
    if len(fds) != nfds:
        for fd in fds:
            os.close(fd)
        raise EOFError(f"a message came with {len(fds)} descriptors, {nfds} sent")
    body = bytearray()
    _recv_exact(sock, size, body)
    return pickle.loads(body), list(fds)


def error_chain(exc: BaseException) -> List[Tuple[Optional[bytes], str, str]]:
    """An error and its causes as they cross to the other process: each pickled (its type,
    arguments and attributes: ``errno``, ``filename``, ``step``...), with its type name and
    message for one that does not pickle."""
    chain: List[Tuple[Optional[bytes], str, str]] = []
    e: Optional[BaseException] = exc
    while e is not None and len(chain) < 8:
        try:
            blob: Optional[bytes] = pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - carried by name and message instead
            blob = None
        chain.append((blob, type(e).__name__, str(e)))
        e = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
    return chain


# ---- the writer process ----------------------------------------------------------------------

class _Blocks:
    """The shared segments (:class:`~async_ckpt.shared_memory.Segment`) mapped here, by id."""

    def __init__(self) -> None:
        self._views: Dict[int, memoryview] = {}
        self._lock = threading.Lock()

    def add(self, block_id: int, nbytes: int, fd: int) -> None:
        try:
            view = memoryview(mmap.mmap(fd, nbytes))
        finally:
            os.close(fd)
        with self._lock:
            self._views[block_id] = view

    def forget(self, ids: Sequence[int]) -> None:
        with self._lock:
            for block_id in ids:
                self._views.pop(block_id, None)  # unmapped once no job reads it

    def get(self, block_id: int) -> memoryview:
        with self._lock:
            view = self._views.get(block_id)
        if view is None:
            raise LookupError(f"shared block {block_id} is not mapped in the writer process")
        return view


def _produce(items: List[Tuple[Any, ...]], templates: Dict[int, Tuple[bytes, bytes]], blocks: _Blocks,
             records: bool) -> Any:
    def produce(stream: RecordStream, lengths: List[int], data_at: Dict[int, int]) -> None:
        for item in items:
            if item[0] == "r":  # head, a range of a shared block, tail
                _, tid, block_id, offset, nbytes = item
                head, tail = templates[tid]
                at = stream.tell()
                stream.write(head)
                stream.write(blocks.get(block_id)[offset:offset + nbytes])
                stream.write(tail)
                keep_data_at(data_at, at, len(head), nbytes)
                lengths.append(len(head) + nbytes + len(tail))
            else:  # the record's bytes, and where a tensor's data starts in them
                _, record, data_offset, nbytes = item
                keep_data_at(data_at, stream.tell(), data_offset, nbytes)
                stream.write(record)
                lengths.append(len(record))
            if records:
                stream.end_record()

    return produce


def run_job(job: Dict[str, Any], templates: Dict[int, Tuple[bytes, bytes]], blocks: _Blocks,
            storages: Dict[Tuple[str, str], Storage]) -> List[Tuple[int, Tuple[Any, ...]]]:
    """Write a job's files, ``threads`` at a time (the first failure ends the job); ``templates``:
    the heads and tails of the record templates, by serial (the job's own added already).

    Returns:
        Per file: its number and ``(name, record, item lengths)``.
    """
    key = (job["root"], repr(job["retry"]))
    storage = storages.get(key)
    if storage is None:
        storage = storages[key] = Storage(job["root"], None, retry=job["retry"])
    path, records = job["path"], job["records"]

    def one(name: str, items: List[Tuple[Any, ...]], hint: int) -> Tuple[Any, ...]:
        produce = _produce(items, templates, blocks, records)
        return storage.retry.call(lambda: write_record_file(storage, path, name, hint, records, produce),
                                  f"write {path}/{name}")

    files = job["files"]
    if len(files) == 1:
        k, name, items, hint = files[0]
        return [(k, one(name, items, hint))]
    with ThreadPoolExecutor(max(1, min(job["threads"], len(files)))) as pool:
        futures = [pool.submit(one, name, items, hint) for _, name, items, hint in files]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            f.cancel()
        return [(k, f.result()) for (k, _, _, _), f in zip(files, futures)]


def child_main(fd: int, parent_pid: int) -> None:
    """The writer process: serve the training process on socket ``fd`` until it goes."""
    sock = socket.socket(fileno=fd)  # signals: ignored from the start (BOOTSTRAP)

    def watch_parent() -> None:  # a SIGKILL-ed parent: the socket may stay open in its forks
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    blocks = _Blocks()
    templates: Dict[int, Tuple[bytes, bytes]] = {}
    storages: Dict[Tuple[str, str], Storage] = {}
    send_lock = threading.Lock()

    def reply(msg: Any) -> None:
        with send_lock:
            send(sock, msg)

    def run(job_id: int, job: Dict[str, Any]) -> None:
        try:
            out = run_job(job, templates, blocks, storages)
        except BaseException as exc:  # noqa: BLE001 - answered: the training process raises it
            reply(("failed", job_id, error_chain(exc)))
        else:
            reply(("done", job_id, out))

    def run_hash(job_id: int, job: Dict[str, Any]) -> None:
        try:
            import xxhash  # only incremental saves hash

            out = [xxhash.xxh3_128_intdigest(blocks.get(b)[off:off + n]) for b, off, n in job["items"]]
        except BaseException as exc:  # noqa: BLE001 - answered: the training process raises it
            reply(("failed", job_id, error_chain(exc)))
        else:
            reply(("done", job_id, out))

    reply(("ready", os.getpid()))
    try:
        while True:
            msg, fds = recv(sock)
            if msg[0] == "blocks":
                for (block_id, nbytes), bfd in zip(msg[1], fds):
                    blocks.add(block_id, nbytes, bfd)
            elif msg[0] == "forget":
                blocks.forget(msg[1])
            elif msg[0] == "write":
                # known before the job's thread starts: a later job may name them without sending them
                templates.update(msg[2]["templates"])
                threading.Thread(target=run, args=(msg[1], msg[2]), name=f"job-{msg[1]}", daemon=True).start()
            elif msg[0] == "hash":
                threading.Thread(target=run_hash, args=(msg[1], msg[2]), name=f"hash-{msg[1]}", daemon=True).start()
            elif msg[0] == "exit":
                break
    except (EOFError, OSError):
        pass  # the training process went: nothing more to write for it
    os._exit(0)
