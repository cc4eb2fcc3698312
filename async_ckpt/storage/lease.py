"""The writer lease: one live writer per checkpoint root.

Only the holder of the lease writes, commits, deletes, recovers or cleans up under a root. A
manager takes it at its first save (or explicit ``delete``), not at construction, so managers
that only list and restore (an evaluation job, a dashboard, the CLI's read commands) never get
in a writer's way. Two implementations behind one small protocol:

* :class:`PosixLease`: an advisory ``flock`` on ``<root>/.async_ckpt.lock``. The kernel drops
  it when the holder dies, so a dead writer's lease is free at once.
* :class:`ObjectStoreLease`: a JSON object ``<root>/.async_ckpt.lease`` with the holder's
  name, a random token and an expiry, renewed by a heartbeat thread. A lease whose expiry passed
  (or whose holder is a dead process on this host) is free.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Dict, Optional

from ..errors import InvalidArgumentError, LeaseHeldError
from .backends.posix import open_own_file
from .storage import Storage

log = logging.getLogger("async_ckpt")

LOCK_NAME = ".async_ckpt.lock"
LEASE_NAME = ".async_ckpt.lease"
#: how a :class:`LeaseHeldError` says to wait for the lease (the ``async-ckpt`` command names
#: its ``--lease-timeout`` option instead)
LEASE_WAIT_HINT = "pass lease_timeout= to wait"
#: a lease-object holder commits or deletes only while its last renewal is younger than this
#: share of the TTL (the heartbeat renews every third of it: one failed beat is tolerated)
SAFE_SHARE = 0.75


def _me() -> Dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _describe(info: Optional[Dict[str, Any]]) -> str:
    if not info:
        return "another process"
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}"


_here_lock = threading.Lock()
#: the lease each root's holder in this process took, by root (see :class:`_ProcessLocal`)
_here: "Dict[str, weakref.ref[_ProcessLocal]]" = {}


class _ProcessLocal:
    """What both leases share: a manager of this process may take over the lease another
    manager of this process holds on the same root while that one is idle (torch_xla's tests
    and notebooks re-create a manager without closing the first); the old one then refuses
    every later save and delete with a clear :class:`LeaseHeldError`."""

    key: str
    #: set by a manager: whether it has no save or deletion in flight (a lease without it, the
    #: CLI's, neither takes over nor is taken over)
    idle: Optional[Callable[[], bool]] = None
    _superseded: Optional[str] = None

    @property
    def held(self) -> bool:  # pragma: no cover - each lease's own
        raise NotImplementedError

    def release(self) -> None:  # pragma: no cover - each lease's own
        raise NotImplementedError

    def _refuse_if_superseded(self) -> None:
        if self._superseded is not None:
            raise LeaseHeldError(self._superseded, holder=_describe(_me()))

    def _take_over_here(self) -> Optional[str]:
        """Before taking the lease: supersede an idle holder of this process on the same root.
        Returns a hint for the error when the holder here is busy (None otherwise)."""
        with _here_lock:
            ref = _here.get(self.key)
            old = ref() if ref is not None else None
        if old is None or old is self or not old.held or self.idle is None or old.idle is None:
            return None  # only a manager's lease takes over, and only from a manager (not the CLI's)
        if not old.idle():
            return (" (another CheckpointManager of this process holds it and has saves or deletions in flight: "
                    "close() it first)")
        old._superseded = (
            f"{self.key!r}: the writer lease of this CheckpointManager was taken over by another "
            f"CheckpointManager of this process (pid {os.getpid()}) on the same root; this one no longer "
            f"saves or deletes there. Use the new manager (or close() this one before creating another)")
        log.warning("a new CheckpointManager takes over the writer lease of %s from an idle "
                    "one of this process (close() a manager you no longer use)", self.key)
        old.release()
        return None

    def _register_here(self) -> None:
        with _here_lock:
            _here[self.key] = weakref.ref(self)

    def _unregister_here(self) -> None:
        with _here_lock:
            ref = _here.get(self.key)
            if ref is not None and ref() in (None, self):
                del _here[self.key]


class PosixLease(_ProcessLocal):
    """``flock`` on a lock file in the root (advisory: every async_ckpt writer takes it).

    Args:
        root: the checkpoint root (a local directory that exists).
    """

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LOCK_NAME)
        self.key = os.path.realpath(root)
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        """Whether this holder holds the lock now."""
        return self._fd is not None

    def acquire(self, timeout: float = 0.0) -> None:
        """Take the lock and record this process in the lock file (a no-op when held already).

        Args:
            timeout: seconds to wait at most while another process holds it.

        Raises:
            LeaseHeldError: another process still holds it after ``timeout``, or a newer
                manager of this process took this one's lease over.
            StorageError: the lock file is a symbolic link, a hard link or not a regular file.
        """
        import fcntl

        if self._fd is not None:
            return
        self._refuse_if_superseded()
        busy = self._take_over_here() or ""
        fd = open_own_file(self.path, os.O_RDWR | os.O_CREAT)  # never written through a link of either kind
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = self._read_holder(fd)
                    os.close(fd)
                    raise LeaseHeldError(
                        f"{os.path.dirname(self.path)!r} has a live writer ({_describe(holder)} holds "
                        f"{self.path}){busy}; only one writer per checkpoint root is allowed. Open it read-only "
                        f"(list/restore only), write elsewhere, or {LEASE_WAIT_HINT}",
                        holder=_describe(holder)) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
        self._fd = fd
        self._register_here()

    @staticmethod
    def _read_holder(fd: int) -> Optional[Dict[str, Any]]:
        try:
            return json.loads(os.pread(fd, 4096, 0) or b"null")
        except (OSError, ValueError):
            return None

    def check(self) -> None:
        """Raise :class:`LeaseHeldError` if a manager of this process took the lock over.

        A flock is never lost while its descriptor is open."""
        self._refuse_if_superseded()

    def release(self) -> None:
        """Unlock and close the lock file (a no-op when not held)."""
        import fcntl

        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._unregister_here()
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def forget(self) -> None:
        """In a forked child: drop this copy of the descriptor without unlocking.

        ``flock`` locks belong to the open file description the parent still uses."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class ObjectStoreLease(_ProcessLocal):
    """A lease object with an expiry, renewed by a heartbeat thread, for stores without locks.

    Args:
        storage: the checkpoint root.
        ttl_s: seconds a lease object stays valid without renewal (renewed every third of it).
        clock: the monotonic clock that measures the time since the last renewal.

    Raises:
        InvalidArgumentError: ``ttl_s`` is not > 0.
    """

    def __init__(self, storage: Storage, ttl_s: float = 30.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise InvalidArgumentError(f"lease ttl must be > 0, got {ttl_s!r}")
        self.storage = storage
        self.path = storage.join(LEASE_NAME)
        self.key = storage.url
        self.ttl_s = ttl_s
        #: monotonic clock of "time since the last renewal" (injectable for tests)
        self.clock = clock
        self.token = uuid.uuid4().hex
        self._held = False
        self._lost: Optional[str] = None
        self._renewed = float("-inf")  # self.clock() when the last successful renewal was issued
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def held(self) -> bool:
        """Whether this holder took the lease and has not released it (see :meth:`check`)."""
        return self._held

    def _read(self) -> Optional[Dict[str, Any]]:
        try:
            d = json.loads(self.storage.read_bytes(self.path))
            return d if isinstance(d, dict) else None
        except FileNotFoundError:
            return None
        except ValueError:
            return None  # unreadable: treated as free (a torn write of a dead writer)

    def _free(self, cur: Optional[Dict[str, Any]]) -> bool:
        if cur is None or cur.get("token") == self.token:
            return True
        try:
            if float(cur.get("expires", 0)) < time.time():
                return True
        except (TypeError, ValueError):
            return True
        if cur.get("host") == socket.gethostname() and isinstance(cur.get("pid"), int):
            try:
                os.kill(cur["pid"], 0)
            except ProcessLookupError:
                return True  # its holder died on this host
            except PermissionError:
                pass
        return False

    def _write(self, token: str) -> float:
        """Write the lease object; returns ``self.clock()`` from before the write (the lease
        is ours until that moment plus the TTL, whatever the write's latency)."""
        issued = self.clock()
        self.storage.write_bytes(self.path, json.dumps(
            {**_me(), "token": token, "expires": time.time() + self.ttl_s}).encode())
        return issued

    def acquire(self, timeout: float = 0.0) -> None:
        """Take the lease and start the heartbeat (a no-op when held).

        This holder's lease object is written where none is, or where the one there expired or
        belongs to a dead process of this host.

        Args:
            timeout: seconds to wait at most while another live writer holds it.

        Raises:
            LeaseHeldError: another live writer still holds it after ``timeout``, or a newer
                manager of this process took this one's lease over.
            StorageError: the lease object cannot be read or written.
        """
        if self._held:
            return
        self._refuse_if_superseded()
        busy = self._take_over_here() or ""
        self.token = uuid.uuid4().hex  # each holding its own: a late write of an earlier one is foreign
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            cur = self._read()
            if self._free(cur):
                issued = self._write(self.token)
                time.sleep(0.05)  # a writer that raced us wrote after our read: its object wins
                after = self._read()
                if after is not None and after.get("token") == self.token:
                    break
                cur = after
            if time.monotonic() >= deadline:
                left = ""
                try:
                    left = f", expires in {max(0.0, float(cur['expires']) - time.time()):.0f} s" if cur else ""
                except (KeyError, TypeError, ValueError):
                    pass
                raise LeaseHeldError(
                    f"{self.storage.url!r} has a live writer ({_describe(cur)} holds {self.path}{left}){busy}; "
                    f"only one writer per checkpoint root is allowed. Open it read-only (list/restore "
                    f"only), write elsewhere, or {LEASE_WAIT_HINT}", holder=_describe(cur))
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        self._held, self._lost, self._renewed = True, None, issued
        self._register_here()
        self._stop = threading.Event()  # this holding's own: a stuck beat of an earlier one stays stopped
        self._thread = threading.Thread(target=self._heartbeat, args=(self.token, self._stop),
                                        name="async-ckpt-lease", daemon=True)
        self._thread.start()

    def _age(self) -> float:
        return self.clock() - self._renewed

    def _lapsed(self) -> Optional[str]:
        """Why this holder can no longer prove it holds the lease (None: it can). Its last
        renewal must be younger than ``SAFE_SHARE`` of the TTL: others may take the lease
        once the TTL has passed by their wall clock, which may run ahead of ours."""
        age = self._age()
        if age < self.ttl_s * SAFE_SHARE:
            return None
        return (f"this writer's lease was last renewed {age:.1f} s ago, and it is valid for {self.ttl_s:g} s "
                f"(a network partition, a suspended process or a hung request kept the heartbeat from renewing "
                f"it), so another writer may have taken the root over")

    def _heartbeat(self, token: str, stop: threading.Event) -> None:
        while not stop.wait(self.ttl_s / 3):
            if not self._beat(token, stop):
                return

    def beat(self) -> bool:
        """Run one heartbeat of the current holding now.

        As the heartbeat thread does every third of the TTL: check the lease object is still
        ours, then renew it.

        Returns:
            True while the lease is held and renewed (or a transient error left it for the
            next beat); False once it was lost (taken over, or lapsed by ``clock``): ``check``
            then raises.
        """
        return self._beat(self.token, self._stop)

    def _beat(self, token: str, stop: threading.Event) -> bool:
        if self._lost is not None:
            return False
        lapsed = self._lapsed()
        if lapsed is not None:  # never renewed after the fact: a successor may hold it now
            if not stop.is_set():
                self._lost = lapsed
            log.error("%s; this manager commits and deletes nothing until its next save "
                      "takes the lease again", lapsed)
            return False
        try:
            cur = self._read()
            if cur is not None and cur.get("token") != token:
                if not stop.is_set():
                    self._lost = f"the writer lease was taken over by {_describe(cur)}"
                log.error("%s; this manager's next commit fails", self._lost)
                return False
            issued = self._write(token)
            late = self._lapsed()
            if late is not None:  # it landed once a successor could hold the lease (and overwrote
                # its lease object, maybe): it proves nothing, this holder stops here
                if not stop.is_set():
                    self._lost = f"{late}; its renewal landed too late to count"
                log.error("%s; its renewal landed too late to count: this manager commits and "
                          "deletes nothing until its next save takes the lease again", late)
                return False
            if not stop.is_set():
                self._renewed = max(self._renewed, issued)
        except Exception as exc:  # a transient error: the next beat tries again
            log.warning("could not renew the writer lease: %s", exc)
        return True

    def check(self) -> None:
        """Prove this holder still holds the lease, right before a commit or a delete.

        Raises:
            LeaseHeldError: the heartbeat saw another writer's lease object, or the last
                successful renewal is older than ``SAFE_SHARE`` of the TTL (by ``clock``).
        """
        self._refuse_if_superseded()
        if not self._held:
            raise LeaseHeldError(f"{self.storage.url!r}: this manager does not hold the writer lease")
        why = self._lost or self._lapsed()
        if why is not None:
            raise LeaseHeldError(f"{self.storage.url!r}: {why}; nothing was committed or deleted. The next save "
                                 f"takes the lease again if it is free")

    def release(self) -> None:
        """Stop the heartbeat and delete the lease object if it is still this holder's.

        A no-op when not held; storage errors are logged, not raised."""
        if not self._held:
            return
        self._held = False
        self._unregister_here()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)  # bounded: a beat stuck in a hung request is left behind
        try:
            cur = self._read()
            if cur is not None and cur.get("token") == self.token:
                self.storage.rm(self.path, recursive=False)
        except Exception as exc:
            log.warning("could not release the writer lease: %s", exc)

    def forget(self) -> None:
        """In a forked child: stop pretending to hold the parent's lease."""
        self._held = False


def writer_lease(storage: Storage) -> "PosixLease | ObjectStoreLease":
    """The lease kind for a storage (not taken yet).

    Args:
        storage: the checkpoint root.

    Returns:
        A :class:`PosixLease` (``flock``) on local paths, an :class:`ObjectStoreLease` elsewhere.
    """
    return PosixLease(storage.root) if storage.is_local else ObjectStoreLease(storage)


def _flocked(st: os.stat_result) -> Optional[bool]:
    """Whether some process holds a ``flock`` on the file of ``st`` (Linux ``/proc/locks``,
    read without locking anything); None where that cannot be told."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want:
            return True
    return False


def _running(info: Dict[str, Any]) -> Optional[bool]:
    """Whether the process ``info`` names is running: known only on this host."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return None
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def lease_holder(storage: Storage) -> Optional[Dict[str, Any]]:
    """Who holds, or last held, a root's writer lease, and whether that writer is alive.

    Read without taking the lease (a listing never gets in a writer's way).

    Args:
        storage: the checkpoint root.

    Returns:
        None when no writer ever took the lease; else ``host`` and ``pid`` of the last
        holder, ``live`` (True: it holds the lease now, False: the lease is free, None:
        cannot be told from here: another host's process) and ``text``, one sentence.

    Raises:
        StorageError: the lease could not be read.
    """
    if storage.is_local:
        path = os.path.join(storage.root, LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:  # a link in its place: never read through
            return None
        try:
            info = PosixLease._read_holder(fd) or {}
            live = _flocked(os.fstat(fd))
        finally:
            os.close(fd)
        if live is None:
            live = _running(info)
    else:
        cur = ObjectStoreLease(storage)._read()
        if cur is None:
            return None
        info = cur
        try:
            expired = float(cur.get("expires", 0)) < time.time()
        except (TypeError, ValueError):
            expired = True
        running = _running(info)
        live = False if expired or running is False else (True if running else None)
    who = _describe(info)
    if live is True:
        text = f"the writer lease is held by {who}, which is running: a save may be in progress"
    elif live is False:
        running = _running(info)
        how = "" if running is None else (", which released it" if running else ", no longer running")
        text = f"the writer lease is free (last held by {who}{how}): no save is in progress"
    else:
        text = f"the writer lease is held by {who}, whose liveness cannot be checked from this host"
    return {"host": info.get("host"), "pid": info.get("pid"), "live": live, "text": text}
