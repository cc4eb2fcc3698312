"""The options of a :class:`~async_ckpt.CheckpointManager` and of one restore, validated once.

``ManagerOptions``: every option keeps the name and meaning of the manager's argument (see its
docstring), and is built from the manager's own arguments (:meth:`ManagerOptions.from_arguments`:
spelled once, in the signature); ``__post_init__`` checks them and resolves the ones with
several spellings (``num_of_threads`` and ``write_threads``; ``save_interval`` and
``save_policy``; ``max_to_keep`` and ``retention``; ints for the local tier's policy and
retention) into one value each.

Each layer below the manager gets the option group it uses, not the whole ``ManagerOptions``
(the fields keep the manager's argument names, so a parameter reads the same from the signature
to its use): :class:`StoreOptions` (how every root keeps its steps:
:func:`~async_ckpt.jobs.roots.open_root`), :class:`LocalTierOptions`
(:func:`~async_ckpt.jobs.local_tier.make_local_tier`) and :class:`PeerOptions` (the peer copies,
:mod:`async_ckpt.jobs.peers`), each made by a method of ``ManagerOptions``.

``RestoreOptions``: how one ``restore`` reads, handed down its chain (the candidate loop, each
attempt, the read of a step) as one object.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

from .errors import InvalidArgumentError, warn_user
from .policies import (
    EveryNSteps,
    KeepAll,
    KeepLatest,
    as_retention_policy,
    as_save_policy,
)

#: ``replicated_reads=``: who reads a tensor every rank restores (see CheckpointManager)
REPLICATED_READS = ("auto", "once", "every_rank")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


WRITERS = ("auto", "thread", "process")


def _resolve_writer(writer: Any) -> str:
    """``writer=``: ``"thread"`` or ``"process"``; ``"auto"`` is ``$ASYNC_CKPT_WRITER`` if set,
    else ``"process"`` where the system can share memory with a writer process (Linux)."""
    if writer not in WRITERS:
        raise InvalidArgumentError(f"writer must be one of {WRITERS} (who writes a save's files: a thread of this "
                                   f"process, or a writer process), got {writer!r}")
    can = hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
    if writer == "auto":
        env = os.environ.get("ASYNC_CKPT_WRITER", "")
        if env not in ("", "thread", "process"):
            raise InvalidArgumentError(f"ASYNC_CKPT_WRITER must be 'thread' or 'process', got {env!r}")
        writer = env or ("process" if can else "thread")
        if writer == "process" and not can:
            writer = "thread"
    elif writer == "process" and not can:
        raise InvalidArgumentError("writer='process' needs memfd_create and descriptor passing (Linux); use "
                                   "writer='thread' on this system")
    return str(writer)


def _is_seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: how the ``metrics=`` of several ranks become the step's (``CheckpointManager(metrics_reduce=)``)
METRICS_REDUCE = ("rank0", "mean", "min", "max")


@dataclass
class ManagerOptions:
    """What a manager was asked to do, checked (the arguments of ``CheckpointManager``).

    After ``__post_init__``: ``write_threads`` is the thread count (``num_of_threads`` when
    given), ``save_policy`` and ``retention`` are the resolved policies (``save_interval`` and
    ``max_to_keep`` folded in), ``local_policy`` is a save policy or None (the persistent
    root's decision) and ``local_retention`` a retention policy.

    Raises:
        InvalidArgumentError: an option out of its range or of the wrong type (the message
            names the option).
    """

    path: str
    save_interval: Optional[int] = None
    max_to_keep: Optional[int] = 0
    max_pending_async: int = 1
    num_of_threads: Optional[int] = None
    process_group: Any = None
    chkpt_on_preemption: bool = False
    storage_options: Optional[Dict[str, Any]] = None
    save_policy: Any = None
    retention: Any = None
    memory_budget_bytes: Optional[int] = None
    write_threads: int = 8
    commit_mode: str = "auto"
    verify: bool = True
    keep_incomplete: bool = False
    retry: Any = None
    on_saved: Optional[Callable[[Any], None]] = None
    stats_log: Any = None
    preemption_signals: Optional[Sequence[int]] = None
    preemption_sync: str = "auto"
    lazy: bool = False
    lease_timeout: float = 0.0
    #: no default here: the coordinator's (the manager's signature shows it)
    collective_timeout_s: float = field(kw_only=True)
    local_dir: Optional[str] = None
    local_policy: Any = None
    local_retention: Any = 2
    local_replicas: int = 1
    incremental: bool = False
    full_every: Optional[int] = None
    frozen: Any = None
    frozen_check_every: int = 10
    replicated_saves: bool = True
    replicated_reads: str = "auto"
    metrics_reduce: str = "rank0"
    read_only: bool = False
    writer: str = "auto"
    overwrite: bool = True
    step_prefix: Optional[str] = None
    step_width: Optional[int] = None
    wall_clock: Callable[[], float] = field(default=time.time)
    interval_clock: Callable[[], float] = field(default=time.monotonic)

    @classmethod
    def from_arguments(cls, arguments: Dict[str, Any]) -> "ManagerOptions":
        """The options of a manager's call, from its arguments by name (``locals()`` of
        ``CheckpointManager.__init__``: every field of this class is one of its parameters).

        Args:
            arguments: the call's arguments, by name (others, ``self``, are left out).

        Returns:
            The validated options.

        Raises:
            InvalidArgumentError: an option out of its range or of the wrong type.
        """
        return cls(**{f.name: arguments[f.name] for f in fields(cls)})

    def __post_init__(self) -> None:
        if self.num_of_threads is not None:  # torch_xla's name for the writer's thread count
            if not _is_int(self.num_of_threads) or self.num_of_threads < 1:
                raise InvalidArgumentError(f"num_of_threads must be an int >= 1, got {self.num_of_threads!r}")
            self.write_threads = self.num_of_threads
        if not _is_int(self.write_threads) or self.write_threads < 1:
            raise InvalidArgumentError(f"write_threads must be an int >= 1, got {self.write_threads!r}")
        if self.max_to_keep is not None and (not isinstance(self.max_to_keep, int) or self.max_to_keep < 0):
            raise InvalidArgumentError(f"max_to_keep must be an int >= 0 or None, got {self.max_to_keep!r}: "
                                       "pass None (or 0) to keep every step, N > 0 to keep the N newest")
        if not _is_seconds(self.lease_timeout) or self.lease_timeout < 0:
            raise InvalidArgumentError(f"lease_timeout must be a number of seconds >= 0, got {self.lease_timeout!r}")
        self.lease_timeout = float(self.lease_timeout)
        if not _is_seconds(self.collective_timeout_s) or self.collective_timeout_s <= 0:
            raise InvalidArgumentError(
                f"collective_timeout_s must be a number of seconds > 0, got {self.collective_timeout_s!r}")
        self.collective_timeout_s = float(self.collective_timeout_s)
        if not isinstance(self.incremental, bool):
            raise InvalidArgumentError(f"incremental must be a bool, got {self.incremental!r}")
        if self.full_every is not None and (not _is_int(self.full_every) or self.full_every < 1):
            raise InvalidArgumentError(f"full_every must be an int >= 1 (every N-th save writes everything) or None, "
                                       f"got {self.full_every!r}")
        if self.full_every is not None and not self.incremental:
            raise InvalidArgumentError("full_every= bounds incremental saves: pass incremental=True with it")
        if self.frozen is not None:
            self._check_frozen()
        if not isinstance(self.replicated_saves, bool):
            raise InvalidArgumentError(f"replicated_saves must be a bool, got {self.replicated_saves!r}")
        if self.replicated_reads not in REPLICATED_READS:
            raise InvalidArgumentError(f"replicated_reads must be one of {REPLICATED_READS}, got "
                                       f"{self.replicated_reads!r}")
        if self.metrics_reduce not in METRICS_REDUCE:
            raise InvalidArgumentError(f"metrics_reduce must be one of {METRICS_REDUCE} (how the metrics= of several "
                                       f"ranks become the step's), got {self.metrics_reduce!r}")
        if not isinstance(self.lazy, bool):
            raise InvalidArgumentError(f"lazy must be a bool, got {self.lazy!r}")
        for name in ("wall_clock", "interval_clock"):
            fn = getattr(self, name)
            if not callable(fn):
                raise InvalidArgumentError(f"{name} must be a callable returning seconds (like time.time), got {fn!r}")
        if self.save_policy is not None and self.save_interval is not None:
            warn_user(f"save_interval={self.save_interval!r} is ignored: save_policy={self.save_policy!r} decides "
                      "when to save (pass one of them)")
        self.save_policy = as_save_policy(
            self.save_policy if self.save_policy is not None
            else EveryNSteps(1 if self.save_interval is None else self.save_interval))
        self.retention = (as_retention_policy(self.retention) if self.retention is not None
                          else KeepLatest(self.max_to_keep) if self.max_to_keep else KeepAll())
        if self.preemption_signals is not None and not self.chkpt_on_preemption:
            raise InvalidArgumentError("preemption_signals needs chkpt_on_preemption=True")
        if self.local_dir is not None:
            self._check_local()
        if not _is_int(self.local_replicas) or self.local_replicas < 1:
            raise InvalidArgumentError(f"local_replicas must be an int >= 1 (the nodes holding each rank's local copy, "
                                       f"its own included; 1: no peer copies), got {self.local_replicas!r}")
        if self.local_replicas > 1 and self.local_dir is None:
            raise InvalidArgumentError(f"local_replicas={self.local_replicas} keeps copies of the local tier on other "
                                       f"nodes: pass local_dir= too")
        if not isinstance(self.read_only, bool):
            raise InvalidArgumentError(f"read_only must be a bool, got {self.read_only!r}")
        if not isinstance(self.overwrite, bool):
            raise InvalidArgumentError(f"overwrite must be a bool, got {self.overwrite!r}")
        self.writer = _resolve_writer(self.writer)
        if self.read_only:
            for name, given in (("local_dir", self.local_dir is not None),
                                ("chkpt_on_preemption", self.chkpt_on_preemption),
                                ("stats_log", self.stats_log not in (None, False))):
                if given:
                    raise InvalidArgumentError(f"read_only=True: a manager that only lists and restores takes no "
                                               f"{name}= (it saves nothing); drop {name}= or read_only=")

    def store_options(self) -> "StoreOptions":
        """How every root of this manager keeps its steps (the persistent root, the local tier,
        the copies held for a peer).

        Returns:
            The options of :func:`~async_ckpt.jobs.roots.open_root`.
        """
        return StoreOptions(commit_mode=self.commit_mode, keep_incomplete=self.keep_incomplete,
                            lease_timeout=self.lease_timeout, retry=self.retry, wall_clock=self.wall_clock,
                            incremental=self.incremental, full_every=self.full_every)

    def local_tier_options(self) -> "LocalTierOptions":
        """The local tier's options (``local_dir`` set).

        Returns:
            The options of :func:`~async_ckpt.jobs.local_tier.make_local_tier`.
        """
        assert self.local_dir is not None
        return LocalTierOptions(local_dir=self.local_dir, local_policy=self.local_policy,
                                local_retention=self.local_retention, max_pending_async=self.max_pending_async,
                                collective_timeout_s=self.collective_timeout_s, store=self.store_options())

    def peer_options(self) -> "PeerOptions":
        """The peer copies' options (``local_replicas``; the held copies' store).

        Returns:
            The options of :func:`~async_ckpt.ranks.topology.peer_topology` and
            :class:`~async_ckpt.jobs.peers.PeerCopies`.
        """
        # a held copy is landed whole from a peer, never saved incrementally
        store = replace(self.store_options(), incremental=False, full_every=None)
        return PeerOptions(local_replicas=self.local_replicas, local_dir=self.local_dir,
                           local_retention=self.local_retention, process_group=self.process_group,
                           collective_timeout_s=self.collective_timeout_s, verify=self.verify, store=store)

    def _check_frozen(self) -> None:
        """``frozen``: keys (strings) or a callable on a key, with ``incremental``."""
        if not self.incremental:
            raise InvalidArgumentError("frozen= lets incremental saves skip the host copy of unchanged tensors: "
                                       "pass incremental=True with it")
        if isinstance(self.frozen, (str, bytes)) or not (callable(self.frozen) or isinstance(self.frozen, Iterable)):
            raise InvalidArgumentError(f"frozen must be a collection of state-dict keys (e.g. "
                                       f"async_ckpt.frozen_keys(model, prefix='model.')) or a callable key -> bool, "
                                       f"got {self.frozen!r}")
        if not callable(self.frozen):
            self.frozen = frozenset(self.frozen)
            bad = [k for k in self.frozen if not isinstance(k, str)]
            if bad:
                raise InvalidArgumentError(f"frozen must hold state-dict keys (strings), got {bad[0]!r}")
        if not _is_int(self.frozen_check_every) or self.frozen_check_every < 1:
            raise InvalidArgumentError(f"frozen_check_every must be an int >= 1, got {self.frozen_check_every!r}")

    def _check_local(self) -> None:
        """The local tier's options: ``local_dir`` a path, ``local_policy`` and
        ``local_retention`` resolved to policies."""
        if not isinstance(self.local_dir, (str, os.PathLike)):
            raise InvalidArgumentError(f"local_dir must be a path or URL string, got {type(self.local_dir).__name__}")
        self.local_dir = os.fspath(self.local_dir)
        policy = self.local_policy
        if isinstance(policy, bool) or (isinstance(policy, int) and policy < 1):
            raise InvalidArgumentError(f"local_policy as an int is a save interval >= 1, got {policy!r}")
        self.local_policy = None if policy is None else as_save_policy(
            EveryNSteps(policy) if isinstance(policy, int) else policy)
        keep = self.local_retention
        if isinstance(keep, bool) or (isinstance(keep, int) and keep < 1):
            raise InvalidArgumentError(f"local_retention as an int keeps the N newest local steps, N >= 1; got {keep!r}")
        self.local_retention = KeepLatest(keep) if isinstance(keep, int) else as_retention_policy(keep)


@dataclass(frozen=True)
class StoreOptions:
    """How a root keeps its steps: every root of a manager (the persistent root, the local tier,
    the copies held for a peer) is opened with these (:func:`~async_ckpt.jobs.roots.open_root`).
    Each keeps the name and meaning of the manager's argument.

    Attributes:
        commit_mode: ``"auto"``, ``"rename"`` or ``"marker"``.
        keep_incomplete: keep steps that never committed instead of cleaning them up.
        lease_timeout: seconds the first save waits for the root's writer lease.
        retry: backoff and time bounds of storage calls (a ``RetryPolicy``; None: the default).
        wall_clock: the clock of commit times.
        incremental: saves write only the tensors that changed since the root's last step.
        full_every: with ``incremental``: every N-th save writes everything (None: no bound).
    """

    commit_mode: str = "auto"
    keep_incomplete: bool = False
    lease_timeout: float = 0.0
    retry: Any = None
    wall_clock: Callable[[], float] = time.time
    incremental: bool = False
    full_every: Optional[int] = None


@dataclass(frozen=True)
class LocalTierOptions:
    """The local tier's options (``local_dir=``; see ``CheckpointManager``).

    Attributes:
        local_dir: the local tier's directory (each rank's ``rank<r>`` under it with several).
        local_policy: when a save is due there (None: whenever the persistent root's is).
        local_retention: which local copies stay (a retention policy).
        max_pending_async: saves in flight at once at the tier.
        collective_timeout_s: the bound of the tier's (rank-local) exchanges.
        store: how the tier keeps its steps.
    """

    local_dir: str
    local_policy: Any
    local_retention: Any
    max_pending_async: int
    collective_timeout_s: float
    store: StoreOptions


@dataclass(frozen=True)
class PeerOptions:
    """The peer copies' options (``local_replicas=``; see ``CheckpointManager``).

    Attributes:
        local_replicas: the nodes that keep each rank's local copy, its own included.
        local_dir: the local tier's directory (listed at a restore for every rank's copies).
        local_retention: the retention of the copies held for a peer (the local tier's).
        process_group: the group the replication group is made from.
        collective_timeout_s: how long a transfer waits for a peer.
        verify: check CRC-32Cs of what is sent and received.
        store: how the held copies are kept (never incremental: a held copy lands whole).
    """

    local_replicas: int
    local_dir: Optional[str]
    local_retention: Any
    process_group: Any
    collective_timeout_s: float
    verify: bool
    store: StoreOptions


@dataclass(frozen=True)
class RestoreOptions:
    """How one restore reads (the arguments of ``CheckpointManager.restore`` and what the
    manager adds to them), handed down the restore's chain as one object.

    Attributes:
        verify: compare CRC-32Cs (sizes are always compared).
        allow_pickle: unpickle saved values outside torch's ``weights_only`` safe set.
        threads: how many reads run at once.
        planner: a custom DCP load planner (torch_xla's for SPMD targets), or None.
        atomic: every file read and verified into host buffers before the first write.
        strict: every key of the target must be in the checkpoint.
        pool: the host buffer pool that ``atomic`` stages through (None: fresh buffers).
        key_map: checkpoint key prefix -> target key prefix, or None.
        replicated_reads: several ranks: who reads a tensor every rank restores (``"once"``,
            ``"every_rank"``, ``"auto"``).
        cast: a target tensor of another dtype than the checkpoint's is cast into, as
            ``dcp.load`` does (False: a dtype that differs is a mismatch).
        keys: restore only these checkpoint keys and what lies under them (flattened, dotted
            keys: ``"model"`` selects ``"model.w"``); None: every key.
        exclude: leave out these keys and what lies under them.
    """

    verify: bool = True
    allow_pickle: bool = False
    threads: int = 8
    planner: Any = None
    atomic: bool = False
    strict: bool = True
    pool: Any = None
    key_map: Optional[Dict[str, str]] = None
    replicated_reads: str = "auto"
    cast: bool = False
    keys: Optional[Tuple[str, ...]] = None
    exclude: Tuple[str, ...] = ()

    def selects_all(self) -> bool:
        """Whether every key is restored (no ``keys``, no ``exclude``)."""
        return self.keys is None and not self.exclude

    def selects(self, key: str) -> bool:
        """Whether the checkpoint's (flattened, dotted) ``key`` is restored.

        Args:
            key: a flattened checkpoint key.

        Returns:
            True when ``keys`` (if given) holds it or a prefix of it, and ``exclude`` does not.
        """
        def under(prefixes: Tuple[str, ...]) -> bool:
            return any(key == p or key.startswith(p + ".") for p in prefixes)

        return (self.keys is None or under(self.keys)) and not under(self.exclude)
