"""``CheckpointManager``: the façade, by composition: the public API and the wiring. Its
arguments become a validated :class:`~async_ckpt.options.ManagerOptions` (built once, from the
signature), and each part gets the option group it uses (``store_options``,
``local_tier_options``, ``peer_options``). It holds the roots
(:class:`~async_ckpt.jobs.roots.Roots`: the local tier, when there is one, then the persistent
root), probes them (:mod:`.probe`), agrees with the other ranks where a step is due
(:mod:`.decide`, over the pure :mod:`.schedule`) and submits the save (:mod:`.submission`: the
state dict staged once, the one host snapshot handed to each due root's writer thread, where
:mod:`.persist` runs the save job, then retention and the upload catch-up); :mod:`.checks` warns
about pickled values and checks declared-frozen tensors.

Data flows one way: state dict -> staging (host snapshot; the only blocking part) -> writer
thread (``jobs.save_job``: files, manifest, commit) -> storage. Restores go through
``jobs.restore_job`` with one :class:`~async_ckpt.options.RestoreOptions`. One process and N
run the same code; only the exchange differs (``ranks.exchange``).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
import uuid
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import (
    CheckpointError,
    InvalidArgumentError,
    InvalidStateDictError,
    StorageError,
    StorageUnreachableError,
)
from ..format.manifest import check_metrics
from ..format.step_names import StepNaming
from ..io import writer_process
from ..io.planners import load_planner_for
from ..jobs.local_tier import make_local_tier
from ..jobs.peers import PeerCopies
from ..jobs.preemption import PreemptionTracker, PreemptionWatcher
from ..jobs.promote import UploadCatchUp, promote
from ..jobs.restore_job import check_key_list, check_key_map, read_plain_dcp
from ..jobs.restore_job import restore as _restore
from ..jobs.roots import PERSISTENT, Root, Roots, StepMetadata, common_local_steps, foreign_steps, open_root
from ..jobs.save_job import SaveJob
from ..jobs.write_queue import WriteQueue
from ..options import ManagerOptions, RestoreOptions
from ..policies import (
    RetentionPolicy,
    SavePolicy,
    as_retention_policy,
    as_save_policy,
    best_checkpoint,
    check_step,
    find_keep_best,
)
from ..ranks import phase
from ..ranks.exchange import DEFAULT_TIMEOUT_S, exchange_for
from ..ranks.replicas import SaveShares
from ..ranks.topology import peer_topology
from ..staging import HostBufferPool, Stager
from ..staging.frozen import FrozenTensors
from ..stats import SaveStats, format_bytes, format_count, format_seconds, tier_name
from ..storage import RetryPolicy, Storage
from ..storage.stats_log import StatsLog
from .checks import check_user_metadata, frozen_changed_at_close
from .decide import SaveDecision
from .hooks import live_managers, stop_threads
from .persist import Persister
from .probe import RootProbe
from .submission import Submitter

log = logging.getLogger("async_ckpt")

#: At interpreter exit (no Ctrl-C), saves still running after this many seconds are named in a
#: warning (the process is waiting for them); quicker ones finish without a word.
EXIT_NOTICE_AFTER_S = 3.0


def _weak_idle(mgr: "CheckpointManager") -> Callable[[], bool]:
    """Whether ``mgr`` (weakly referenced) has no save or deletion in flight: another manager
    of this process may then take its writer lease over (see ``storage.lease``)."""
    ref = weakref.ref(mgr)

    def idle() -> bool:
        m = ref()
        return m is None or m._idle()
    return idle


def _tensor_bytes(tree: Any) -> Tuple[int, int]:
    """Bytes and number of the tensors in a state dict (what a restore filled), through dicts,
    lists and ``Stateful`` values."""
    import torch

    nbytes = count = 0
    stack = [tree]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            nbytes += v.numel() * v.element_size()
            count += 1
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif callable(getattr(v, "state_dict", None)) and not isinstance(v, type):
            try:
                stack.append(v.state_dict())
            except Exception:  # noqa: BLE001 - only counted for the log line
                pass
    return nbytes, count


def _raise_all(errors: List[BaseException]) -> None:
    """Raise the one failure, or the first naming the others (each tier's failure is raised
    once: one left out would never be seen again)."""
    if len(errors) == 1:
        raise errors[0]
    for e in errors:
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: as they are
            raise e
    raise CheckpointError("; and ".join(str(e) for e in errors), step=getattr(errors[0], "step", None)) from errors[0]


class CheckpointManager:
    """Asynchronous checkpointing of a state dict to a local path or any fsspec URL.

    A drop-in for ``torch_xla.experimental.distributed_checkpoint.CheckpointManager`` (same
    positional arguments and methods) that also surfaces background failures, commits
    atomically, verifies on restore and reuses host buffers between saves.

    Args:
        path: checkpoint root: a local path or an fsspec URL (``file://``, ``memory://``,
            ``gs://``, ``s3://``, ...). Each step is a DCP checkpoint in ``<path>/<step>/``.
        save_interval: save when ``step % save_interval == 0`` (default 1: every step; with
            ``save_policy`` it is ignored, and a warning says so when both are given).
        max_to_keep: keep the N most recently committed steps (commit order, as torch_xla);
            0 or None keeps all (ignored if ``retention``).
        max_pending_async: saves that may be in flight at once; the next one waits for a slot.
        num_of_threads: torch_xla's name for ``write_threads`` (kept so that positional
            arguments match torch_xla's ``CheckpointManager``).
        process_group: process group for multi-process saves (default: the default group).
        chkpt_on_preemption: detect preemption (off by default: no signal handler is installed
            unless asked). After a preemption signal, the next ``save``/``save_async`` takes a
            checkpoint whatever the save policy says and :meth:`reached_preemption` turns True.
            Must be set from the main thread (it installs a signal handler). See docs/policies.md.
        preemption_signals: signals that mean "preempted" (default ``(signal.SIGTERM,)``; add
            ``signal.SIGUSR1`` for SLURM's ``--signal``). Handlers that were installed before are
            still called.
        preemption_sync: ``"auto"`` (torch_xla's preemption sync point on TPU, signals
            elsewhere), ``"signal"``, or ``"xla"`` (the sync point, also on PJRT CPU).
        storage_options: passed to fsspec (credentials, endpoint, project, ...).
        save_policy: an object with ``should_save(step) -> bool``; overrides ``save_interval``.
        retention: an object with ``keep(checkpoints) -> set[int]``; overrides ``max_to_keep``.
        memory_budget_bytes: bound on pooled host staging memory (None: the pool keeps only
            what recent saves used, within about 1.1x the largest save's need).
        write_threads: files written concurrently per rank.
        commit_mode: ``"auto"`` (rename on POSIX, marker on object stores), ``"rename"``, ``"marker"``.
        verify: check checksums on restore (sizes are always checked).
        keep_incomplete: keep steps that never committed instead of cleaning them up.
        retry: backoff for transient storage errors and the time bounds of storage calls
            (default: ``RetryPolicy()``, 5 attempts). Its ``connect_timeout`` (30 s) bounds the
            first request at opening: a remote root that does not answer by then raises
            :class:`~async_ckpt.errors.StorageUnreachableError` (with ``local_dir``: logged,
            saves go to the local tier meanwhile).
        on_saved: called with the :class:`SaveStats` of each committed save (writer thread).
        stats_log: append each save's :class:`SaveStats` as a JSON line to a file under the root:
            ``True`` for ``<path>/save_stats.jsonl``, or a path relative to ``path`` (see
            :class:`async_ckpt.storage.stats_log.StatsLog`; on object stores the file is
            rewritten per save).
        lazy: default of ``save_async(..., lazy=)``: return once the host copies of device
            tensors (CUDA, XLA) are issued (CPU tensors are copied at the call, as in an eager
            save); a guard waits for them right before an optimizer step or module forward
            would change the tensors (see :meth:`save_async` and docs/design.md).
        lease_timeout: seconds the first save waits for the root's writer lease when another
            live writer holds it (default 0: raise :class:`LeaseHeldError` at once).
        collective_timeout_s: multi-process: how long a rank waits for the others at each
            exchange of a save or restore; a rank that died makes the others' next
            ``save_async``/``join``/``close`` raise after at most this long. After such a
            failure every later save or restore of the manager raises
            :class:`~async_ckpt.errors.CoordinationError` at once (create a new manager on
            every rank to go on; see docs/distributed.md).
        local_dir: a second, fast tier (node-local disk, ``/dev/shm``, or any fsspec URL):
            steps the ``local_policy`` selects are committed there, those the save policy
            selects go to ``path``; a step due for both is staged once and written to both
            side by side. ``restore(None)`` takes the newest commit over both tiers, the local
            copy first. With several ranks each rank writes its own ``<local_dir>/rank<r>``.
            With a local tier, failed writes to ``path`` (and a ``path`` that cannot be reached
            when a save is due there: that step goes to ``local_dir``) are logged at once and
            raised by :meth:`join`/:meth:`close`, not by the next save (see docs/tiers.md).
            A ``save_async`` due for ``path`` while its upload slots are busy (a slow or
            unreachable bucket) does not wait: that step is saved to ``local_dir`` only, with
            a warning, listed in :attr:`skipped_uploads` and marked ``upload_skipped`` in its
            :class:`SaveStats` (one process; with several ranks the save waits for the slot);
            when the running upload ends, the same slot uploads the newest skipped step's local
            copy, so ``path`` is never more than one upload behind (each save's
            ``SaveStats.extra["upload_lag"]`` says how far it was; see docs/tiers.md).
            A forced (``force=True``) or preemption save is never skipped: it waits its turn.
        local_policy: when to save to ``local_dir``: a save policy, a callable
            ``fn(step) -> bool`` or an int N (every N steps); default: the save policy.
        local_retention: retention of ``local_dir``: a policy or an int N (keep the N newest
            commits); default 2. ``local_dir`` needs room for N + 1 copies (a save is written
            before the oldest goes); with less, a save first deletes what retention would drop
            after it, never the newest copy. A local write that fails for want of space is
            logged and raised by :meth:`join`/:meth:`close` (see docs/tiers.md).
        local_replicas: several ranks: the nodes that keep each rank's local copy, its own
            included (default 1: only its own). With N > 1, after each local commit a rank's
            copy is sent in the background, over the manager's own gloo group, to one rank on
            each of the next N - 1 nodes (``torchrun``'s ``GROUP_RANK``, else the host name),
            which keeps it (CRC-32C checked on arrival) under ``<local tier>/held-rank<r>``
            with ``local_retention``; a restart after losing a node restores its ranks' newest
            copies from those peers instead of ``path`` (see docs/tiers.md).
        incremental: write only the tensors that changed: a save compares each tensor of at
            least 64 KiB with the same key's in the last step this manager committed to the
            root (by an XXH3-128 hash of its bytes) and takes the data files of that step
            holding unchanged ones (a hard link on POSIX paths, so the bytes are stored once; a
            server-side copy on object stores, which saves the upload but not the storage).
            Every step stays a complete DCP checkpoint of plain files (see docs/incremental.md).
        full_every: with ``incremental``: every N-th save writes everything, so that no taken
            file is older than N saves (default None: no bound).
        frozen: with ``incremental``: tensors that never change, by state-dict key (e.g.
            ``async_ckpt.frozen_keys(model, prefix="model.")``, the base of a LoRA run) or a
            callable ``key -> bool``. One whose version counter and data pointer did not move
            since its bytes were last committed is not copied to host memory at all (the
            stall shrinks to the changing tensors); every ``frozen_check_every`` saves and at
            :meth:`close` their bytes are hashed, and a changed one is written in full and
            raises :class:`~async_ckpt.errors.FrozenTensorChangedError` (docs/incremental.md).
        frozen_check_every: every N-th save copies and checks every ``frozen`` tensor (default 10).
        replicated_saves: several ranks: a tensor of at least 64 KiB that several ranks hold
            (DDP's model, HSDP replicas; same key, dtype, shape and shard offsets) is staged and
            written by one of them, balanced by bytes, so each rank's stall is its share (default
            True; False: every rank stages everything and DCP writes one copy). A save due for
            the local tier stages everything: each rank's local copy restores that rank alone.
            Either way a checkpoint holds one value per key: values that differ between ranks
            under one key are logged once and listed in the manifest's ``diverged_keys``.
        metrics_reduce: several ranks: how each rank's ``metrics=`` of a save become the
            step's (what :meth:`metrics`, :meth:`best_step` and ``KeepBest`` see): ``"rank0"``
            (default: rank 0's values, the other ranks' are not read), or ``"mean"``,
            ``"min"``, ``"max"`` of each name over the ranks that gave it; reduced in the
            exchange the save makes anyway (its file records). A local tier's copy (each
            rank's own) records that rank's own metrics.
        replicated_reads: several ranks, at restore: ``"once"``: a tensor every rank restores
            as a plain tensor is read from storage by one rank and sent to the others over
            the manager's gloo group (CRC-checked after the transfer); ``"every_rank"``: each
            rank reads it; ``"auto"`` (default): once on object stores and other remote
            filesystems, every rank on local paths (re-reads hit the page cache).
        read_only: a manager that only lists and restores (an evaluation job following a live
            run, a dashboard): it never creates, writes or deletes anything under ``path``, takes
            no writer lease, and ``save``/``save_async``/``delete``/``promote`` raise
            :class:`CheckpointError`. A root that does not exist yet opens all the same (it
            lists no step); :meth:`wait_for_step` waits for the writer's next commit. Not with
            ``local_dir``, ``chkpt_on_preemption`` or ``stats_log`` (see docs/reliability.md,
            "Reading a live run").
        writer: who writes a save's files after the stall. ``"process"``: a writer process
            (one per training process, started at the first save, shared by its managers)
            reads the staging buffers, which are then shared memory, and writes the files of
            local paths, so the training thread never shares its GIL with a write; the
            manifest, commit, retention, lease and the ranks' exchanges stay here. ``"thread"``:
            this process's writer thread writes them. ``"auto"`` (default): ``$ASYNC_CKPT_WRITER``
            if set, else ``"process"`` on Linux. Object stores are written by the thread
            either way (see docs/design.md, "The writer process").
        overwrite: whether a save of a step that is already committed (or being written) replaces
            it, atomically (default True, as torch_xla's manager); False raises
            :class:`~async_ckpt.errors.StepAlreadyExistsError` at the call instead (Orbax's
            behaviour). A step directory another program wrote (plain DCP) is never replaced
            either way: its save raises :class:`~async_ckpt.errors.ForeignStepError`.
        step_prefix: how step directories are named: ``<step_prefix><step>`` (``"step-"``:
            torchtitan's ``step-100``; ``"ckpt_"``: Orbax's ``step_prefix="ckpt"``). Recorded in
            the root at the first save (``.async_ckpt_naming.json``), so later managers, readers
            and the CLI find the steps without being told; None (default): the root's recorded
            naming, else ``<step>``. A naming other than the root's raises
            :class:`~async_ckpt.errors.InvalidArgumentError`. See docs/concepts.md.
        step_width: zero-pad the step number to this many digits (``8``: ``00000100``, Orbax's
            ``step_format_fixed_length``); None: the root's, else not padded.
        wall_clock: the clock of the commit times recorded in manifests (default
            ``time.time``; commit order survives it stepping back).
        interval_clock: the clock time-based save policies measure intervals with (the times
            of :class:`SaveContext`, the local tier's too; default ``time.monotonic``): a wall
            clock that steps back (NTP, a VM restored from a snapshot) never delays a save.
            Both clocks are injectable for tests.

    Commit order is the order: :meth:`latest_step` and ``restore(None)`` mean the most recently
    committed step, retention drops the oldest commits, and any step may be saved in any order
    (a re-save replaces a step atomically). One live writer per root: a manager takes the root's
    writer lease at its first save, so managers that only list and restore never interfere with
    a writer, and never delete, rename or clean up anything.
    """

    def __init__(
        self,
        path: str,
        save_interval: Optional[int] = None,
        max_to_keep: Optional[int] = 0,
        max_pending_async: int = 1,
        num_of_threads: Optional[int] = None,
        process_group: Any = None,
        chkpt_on_preemption: bool = False,
        *,
        storage_options: Optional[Dict[str, Any]] = None,
        save_policy: Optional[SavePolicy] = None,
        retention: Optional[RetentionPolicy] = None,
        memory_budget_bytes: Optional[int] = None,
        write_threads: int = 8,
        commit_mode: str = "auto",
        verify: bool = True,
        keep_incomplete: bool = False,
        retry: Optional[RetryPolicy] = None,
        on_saved: Optional[Callable[[SaveStats], None]] = None,
        stats_log: Any = None,
        preemption_signals: Optional[Sequence[int]] = None,
        preemption_sync: str = "auto",
        lazy: bool = False,
        lease_timeout: float = 0.0,
        collective_timeout_s: float = DEFAULT_TIMEOUT_S,
        local_dir: Optional[str] = None,
        local_policy: Any = None,
        local_retention: Any = 2,
        local_replicas: int = 1,
        incremental: bool = False,
        full_every: Optional[int] = None,
        frozen: Any = None,
        frozen_check_every: int = 10,
        replicated_saves: bool = True,
        replicated_reads: str = "auto",
        metrics_reduce: str = "rank0",
        read_only: bool = False,
        writer: str = "auto",
        overwrite: bool = True,
        step_prefix: Optional[str] = None,
        step_width: Optional[int] = None,
        wall_clock: Callable[[], float] = time.time,
        interval_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: the validated options this manager was built from (its arguments, by name)
        self.options = opts = ManagerOptions.from_arguments(locals())
        self._preemption: Optional[PreemptionTracker] = None
        if opts.chkpt_on_preemption:  # validated now, installed once everything else is set up
            import signal as _signal

            self._preemption = PreemptionTracker(PreemptionWatcher(
                (_signal.SIGTERM,) if opts.preemption_signals is None else tuple(opts.preemption_signals),
                opts.preemption_sync))
            if opts.preemption_signals is not None and self._preemption.watcher.sync == "xla":
                raise InvalidArgumentError("preemption_signals cannot be combined with torch_xla's preemption sync "
                                           "point (it handles SIGTERM itself); pass preemption_sync='signal' to use "
                                           "signals")
        # Collective: every rank creates the checkpoint groups, first, before anything that
        # could fail on one rank only (a no-op exchange in a single process).
        self._exchange = exchange_for(opts.process_group, opts.collective_timeout_s)
        peer_options = opts.peer_options()
        topology = peer_topology(peer_options, self._exchange)  # collective too (local_replicas > 1)
        # names each save in both tiers' manifests (CopyIdentity.save_id): rank 0's, on every rank
        run_id = uuid.uuid4().hex[:12] if opts.local_dir is not None else ""
        if opts.local_dir is not None and self._exchange.world_size > 1:
            run_id = phase.primary(self._exchange, "naming the saves", None, lambda: run_id)
        self.storage = Storage(opts.path, opts.storage_options, retry=opts.retry)
        try:  # the first request, bounded: a wrong endpoint or network fails here, in one line
            self.storage.probe()
        except StorageUnreachableError as exc:
            if opts.local_dir is None:
                raise
            log.warning("%s (saves go to local_dir %s meanwhile)", exc, opts.local_dir)
        except StorageError:
            pass  # it answered: opening checks the root and says what is wrong (RootProbe.open)
        naming = None if opts.step_prefix is None and opts.step_width is None else \
            StepNaming(opts.step_prefix or "", opts.step_width or 0)
        self.process_group = opts.process_group
        self.chkpt_on_preemption = opts.chkpt_on_preemption
        self.verify = opts.verify
        self.write_threads = opts.write_threads
        self.on_saved = opts.on_saved
        self.lazy = opts.lazy
        # with a local tier an upload overlaps local saves on and off: keep buffers for both
        self.stager = Stager(HostBufferPool(opts.memory_budget_bytes, hold_peak=opts.local_dir is not None,
                                            shared=opts.writer == "process"))
        #: the writer process that writes this manager's local files (``writer="process"``)
        self.writer_process = writer_process.shared() if opts.writer == "process" else None
        self.stats: Deque[SaveStats] = collections.deque(maxlen=1000)
        # with a local tier, failed uploads are raised by join()/close(), not by the next save
        upload_writer = functools.partial(WriteQueue, opts.max_pending_async, defer_errors=opts.local_dir is not None)
        persistent = open_root(PERSISTENT, self.storage, opts.store_options(), exchange=self._exchange,
                               writer=upload_writer, retention=opts.retention, policy=opts.save_policy, naming=naming)
        self.layout = persistent.store.layout
        self.catalog = persistent.store.catalog
        #: peer copies of the local tier (``local_replicas`` > 1 on several nodes)
        self._peers: Optional[PeerCopies] = None
        #: the manager's roots, nearest first: the local tier (with ``local_dir``), then the
        #: persistent root (always last). A restore tries the copies of one save in this order.
        self.roots = Roots(persistent)
        self._closed = False
        self._forked = False
        self._pid = os.getpid()
        self._in_flight: List[int] = []  # steps queued or being written (one entry per root's job)
        try:
            if opts.local_dir is not None:
                local_error, local = phase.attempt(self._exchange, lambda: self._open_local_tier(opts))
                if local is not None:
                    self.roots = Roots(persistent, local)
                if self._exchange.world_size > 1:  # every rank lists the steps every rank committed
                    common_local_steps(local, self._exchange, local_error)
                for r in self.roots:  # log lines name the root: "deleted step 10 from the local tier"
                    r.store.label = f" from {tier_name(r.name)}"
                if topology is not None:
                    assert self.roots.local is not None
                    self._peers = PeerCopies(topology, self.roots.local, peer_options, self._exchange)
            self._probe = RootProbe(self.storage, self.roots.local.url if self.roots.local is not None else None)
            if self._exchange.is_primary:
                self._probe.describe()
            # Created and checked when possible; a read-only root (an evaluation job's credential
            # or mount) opens all the same, for listing and restoring: the first save checks again.
            self._probe.open(read_only=opts.read_only)
            if naming is not None:
                self.layout.naming  # noqa: B018 - a naming that is not the root's is refused here
            if self._preemption is not None:
                self._preemption.watcher.install()
        except BaseException:  # a refused manager leaves no thread behind
            stop_threads([(r.writer, r.store.deleter, r.store.lease) for r in self.roots])
            if self._peers is not None:
                self._peers.stop_threads()
            raise
        self._decision = SaveDecision(self.roots, self._exchange, self._probe, self._preemption, opts.interval_clock)
        self._decision.overwrite = opts.overwrite
        catch_up = UploadCatchUp() if opts.local_dir is not None else None
        self._persister = Persister(self.roots, self._exchange, threads=opts.write_threads, verify=opts.verify,
                                    wall_clock=opts.wall_clock, stats=self.stats,
                                    stats_log=StatsLog.from_option(self.storage, opts.stats_log),
                                    on_saved=opts.on_saved, catch_up=catch_up, in_flight=self._in_flight,
                                    writer_process=self.writer_process)
        self._submitter = Submitter(
            self.roots, self._exchange, self.stager, run_id=run_id,
            frozen=FrozenTensors(opts.frozen, opts.frozen_check_every) if opts.frozen is not None else None,
            shares=SaveShares() if opts.replicated_saves and self._exchange.world_size > 1 else None,
            peers=self._peers, catch_up=catch_up, preemption=self._preemption, in_flight=self._in_flight,
            wall_clock=opts.wall_clock, interval_clock=opts.interval_clock, metrics_reduce=opts.metrics_reduce)
        # An unclosed manager that is garbage-collected stops its threads (it has no pending
        # work then: a queued save holds a reference to it).
        for root in self.roots:
            if root.store.lease is not None:
                root.store.lease.idle = _weak_idle(self)
        self._finalizer = weakref.finalize(self, stop_threads,
                                           [(r.writer, r.store.deleter, r.store.lease) for r in self.roots],
                                           self._peers)
        live_managers.add(self)

    def _open_local_tier(self, opts: ManagerOptions) -> Root:
        """This rank's local tier, with its writer lease taken: a manager with ``local_dir`` writes
        there, and a second job whose ranks share the directory is refused here, not at a save."""
        tier = make_local_tier(opts.local_tier_options(), self.storage, self._exchange)
        try:
            if tier.store.lease is not None:  # an idle manager of this process holding it is taken over
                tier.store.lease.idle = _weak_idle(self)
            tier.store.become_writer()
        except BaseException:
            stop_threads([(tier.writer, tier.store.deleter, tier.store.lease)])
            raise
        return tier

    @property
    def save_policy(self) -> SavePolicy:
        """The persistent root's save policy.

        Assignable: a policy object or a callable ``fn(step) -> bool``."""
        policy = self.roots.persistent.policy
        assert policy is not None
        return policy

    @save_policy.setter
    def save_policy(self, policy: Any) -> None:
        self.roots.persistent.policy = as_save_policy(policy)

    @property
    def retention(self) -> RetentionPolicy:
        """The persistent root's retention policy.

        Assignable: a policy object or a callable ``fn(checkpoints) -> steps to keep``."""
        return self.roots.persistent.retention

    @retention.setter
    def retention(self, policy: Any) -> None:
        self.roots.persistent.retention = as_retention_policy(policy)

    def _idle(self) -> bool:
        """No save queued or being written at any root; then waits (30 s at most) for the
        background deletions retention started to finish."""
        return (all(r.writer.pending == 0 for r in self.roots)
                and all(r.store.wait_idle(timeout=30.0) for r in self.roots))

    # ---- when to save ------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether a checkpoint is due at ``step``.

        Args:
            step: the training step.

        Returns:
            True when the save policy (or, with ``local_dir``, the local policy) wants one, or a
            preemption was detected and its checkpoint is not taken yet. ``save_async`` of a
            step it answers False for does nothing (beyond raising an earlier background
            failure).

        Raises:
            InvalidArgumentError: ``step`` is not an int >= 0.
        """
        return self._decision.due(check_step(step))

    def reached_preemption(self, step: int) -> bool:
        """Whether the loop should stop for a preemption.

        Call it every step after ``save``/``save_async`` (torch_xla's loop shape). If the signal
        arrives after this step's save decision, it answers False once more, so the next step's
        save takes the checkpoint before the loop is told to stop.

        Args:
            step: the training step.

        Returns:
            True once a preemption was detected and its checkpoint was taken (or is due) at or
            before ``step``: the loop should then :meth:`join` (the checkpoint becomes durable)
            and exit. Always False unless the manager was created with
            ``chkpt_on_preemption=True``.

        Raises:
            InvalidArgumentError: ``step`` is not an int >= 0.
        """
        step = check_step(step)
        return self._preemption is not None and self._preemption.reached(step)

    def trigger_preemption(self) -> None:
        """Act as if a preemption signal arrived (for schedulers that announce it another way).

        Raises:
            CheckpointError: the manager was created without ``chkpt_on_preemption=True``.
        """
        if self._preemption is None:
            raise CheckpointError("trigger_preemption() needs chkpt_on_preemption=True")
        self._preemption.watcher.trigger()

    def save_async(self, step: int, state_dict: Mapping[str, Any], force: bool = False,
                   metrics: Optional[Dict[str, float]] = None, *, lazy: Optional[bool] = None,
                   metadata: Optional[Mapping[str, Any]] = None) -> bool:
        """Snapshot ``state_dict`` to host memory and write it in the background.

        Returns once host copies of every tensor exist (the training loop may then mutate its
        tensors freely); returns ``False`` without doing anything when no save is due and
        ``force`` is not set. Raises the error of an earlier failed background save.

        With ``lazy=True`` (default: the manager's ``lazy``) it returns once the copies of
        device tensors (CUDA, XLA) are *issued*: CPU tensors are copied before it returns, as in
        an eager save (a background copy would take the training loop's own cores and memory
        bandwidth; ``async_ckpt.testing.lazy_cpu_copies`` stages them lazily for tests), and so
        are tensors up to 64 KiB (cheaper than guarding them). The others are copied in the
        background, and a guard waits for the outstanding copies of
        exactly the tensors about to change, right before ``optimizer.step()`` (params and
        optimizer state) or a module's forward (its buffers). Other in-place writes must come
        after :meth:`wait_for_staging`; one that bumps ``_version`` before its copy finished
        makes that save fail with ``TornSnapshotError`` (never a torn checkpoint). With several
        ranks each rank stages its own shards lazily and the save fails on every rank if one
        rank's snapshot tore.

        Args:
            step: the training step (an int >= 0; with several ranks, the same on every rank).
            state_dict: what to save: tensors on any device, containers of them, ``Stateful``
                values (saved through their ``state_dict()``) and plain values.
            force: save even when no save policy wants this step.
            metrics: numbers stored with the step (see :meth:`best_step` and ``KeepBest``).
            lazy: return once the copies of device tensors are issued (CPU tensors are copied
                at the call); None: the manager's ``lazy``.
            metadata: the user's metadata of this save, a dict of JSON values (stored in the
                manifest as JSON, never pickled; read back by :meth:`metadata`).

        Returns:
            True when a save was taken; False when none was due.

        Raises:
            InvalidArgumentError: ``step`` or ``metrics`` is invalid.
            ForeignStepError: another program's directory holds the step (never replaced).
            StepAlreadyExistsError: ``overwrite=False`` and the step exists.
            LeaseHeldError: another live writer holds the root's writer lease.
            StorageError: the root cannot be reached (without a local tier).
            CheckpointError: an earlier background save failed (its error, raised once), the
                state dict cannot be staged, another rank could not save the step, or the
                manager is ``read_only``.
        """
        return self._save(step, state_dict, force, metrics, wait=False, lazy=self.lazy if lazy is None else lazy,
                          user_metadata=metadata)

    def wait_for_staging(self) -> None:
        """Wait until the host copies of every lazy save of this manager are done.

        Cheap when none is outstanding. Call it before mutating saved tensors outside
        ``optimizer.step()``.

        Raises:
            CheckpointError: a host copy failed.
        """
        self.stager.synchronize_staging()

    def save(self, step: int, state_dict: Mapping[str, Any], force: bool = False,
             metrics: Optional[Dict[str, float]] = None, *, metadata: Optional[Mapping[str, Any]] = None) -> bool:
        """Like :meth:`save_async`, but returns only once the step is committed.

        Args:
            step: the training step (an int >= 0; with several ranks, the same on every rank).
            state_dict: what to save: tensors on any device, containers of them, ``Stateful``
                values (saved through their ``state_dict()``) and plain values.
            force: save even when no save policy wants this step.
            metrics: numbers stored with the step (see :meth:`best_step` and ``KeepBest``).
            metadata: the user's metadata of this save, a dict of JSON values (see :meth:`metadata`).

        Returns:
            True once the step is committed; False when no save was due.

        Raises:
            InvalidArgumentError: ``step`` or ``metrics`` is invalid.
            ForeignStepError: another program's directory holds the step (never replaced).
            StepAlreadyExistsError: ``overwrite=False`` and the step exists.
            LeaseHeldError: another live writer holds the root's writer lease.
            StorageError: the root cannot be reached (without a local tier).
            CheckpointError: an earlier background save failed (its error, raised once), the
                state dict cannot be staged, another rank could not save the step, or the
                manager is ``read_only``.
        """
        return self._save(step, state_dict, force, metrics, wait=True, user_metadata=metadata)

    def _save(self, step: Any, state_dict: Mapping[str, Any], force: bool, metrics: Any, wait: bool,
              lazy: bool = False, user_metadata: Any = None) -> bool:
        """Training thread of every rank. With several ranks every rank must call it with the
        same step; rank 0's decision (policy, ``force``, preemption) is taken by every rank
        (:meth:`SaveDecision.where`), then the save is submitted to the roots it is due at
        (:meth:`Submitter.submit`: a rank that raises after the agreement still queues its part
        of the save as a failed job). A rank whose step or metrics are invalid says so in the
        agreement: it raises its own error, the others a ``CheckpointError`` naming it."""
        self._check_open()
        self._check_writer("save")
        invalid: Optional[Exception] = None
        try:
            step = check_step(step)
            metrics = check_metrics(metrics)
            user_metadata = check_user_metadata(user_metadata)
        except (TypeError, ValueError) as exc:
            invalid = exc  # raised by the decision (at once in one process, on every rank together with several)
        tx = time.perf_counter()
        where = self._decision.where(step, force, invalid)
        exchange_s = time.perf_counter() - tx  # the agreement (one collective with several ranks)
        return self._submitter.submit(step, state_dict, where, run=self._persist, force=force, wait=wait, lazy=lazy,
                                      metrics=metrics, user_metadata=user_metadata, exchange_s=exchange_s)

    def _persist(self, job: SaveJob, tier: Root) -> None:
        """Writer thread: ``job`` on ``tier`` (:meth:`Persister.persist`). A queued save holds
        the manager through this bound method: a manager with saves in flight is never collected
        (its lease is not idle, its threads are not stopped under the save)."""
        self._persister.persist(job, tier)

    @property
    def peers(self) -> Optional[PeerCopies]:
        """The peer copies of the local tier, or None (``local_replicas`` 1, or one node).

        Its ``topology`` (``dests``: the ranks this rank's copies go to; ``sources``: the ranks
        whose copies it holds), ``transfers`` (bytes and seconds of each exchange, and what
        failed) and ``broken`` (why replication stopped on this rank, if it did)."""
        return self._peers

    @property
    def last_stats(self) -> Optional[SaveStats]:
        """Statistics of the most recently committed save."""
        return self.stats[-1] if self.stats else None

    # ---- restoring ---------------------------------------------------------------------------
    def restore(self, step: Any, state_dict: Dict[str, Any], *, verify: Optional[bool] = None,
                allow_pickle: bool = False, atomic: bool = False, strict: bool = True,
                key_map: Optional[Mapping[str, str]] = None, cast: bool = False,
                keys: Optional[Sequence[str]] = None, exclude: Optional[Sequence[str]] = None) -> int:
        """Load a committed step into ``state_dict`` in place and return the step.

        ``step=None`` (or ``"latest"``, as the CLI spells it) picks the most recently committed step (see :meth:`latest_step`); if it
        fails verification, the next older commit that verifies is used, with a warning naming
        the skipped step, and its data overwrites everything again. A named step that is
        damaged raises :class:`CorruptCheckpointError`. With ``local_dir`` the local copy of a
        step is tried first, then the one under ``path`` (see docs/tiers.md). A named step that
        only another program's directory holds (plain DCP: :meth:`foreign_steps`) is read as it
        is, read-only (sizes checked against its ``.metadata``; it has no checksums).

        One process reads the files straight into the target tensors, checking sizes and
        CRC-32Cs (``verify``) as the data arrives. When a restore fails after its first write,
        ``state_dict`` holds part of the failed step, and the error says so; ``atomic=True``
        reads and verifies every file into buffers of the manager's host pool first, so a failed
        restore leaves ``state_dict`` as it was (memory the size of the files, within
        ``memory_budget_bytes``: a larger checkpoint raises :class:`StagingBudgetError` before
        anything is read; the buffers are reused by the next restore or save).

        Keys of ``state_dict`` the checkpoint lacks raise :class:`StateDictMismatchError`
        naming up to ten, with the checkpoint's keys that matched nothing and, where a prefix
        explains them, the ``key_map`` that fixes it; so does a target tensor that cannot be
        written in place (a meta tensor, an expanded one), before anything is written. Entries
        the checkpoint has but ``state_dict`` lacks are added only inside a container that is
        empty in ``state_dict`` (a fresh optimizer's ``state``, an empty dict): others (a layer
        the target lacks) are left out and named in a warning. ``strict=False`` loads only the
        keys both have and lists the others in a warning. ``key_map`` renames the checkpoint's
        (flattened, dotted) keys by prefix before matching: ``{"module.": ""}`` restores a DDP
        checkpoint into a plain model, ``{"model._orig_mod.": "model."}`` a ``torch.compile``'d
        one's ``{"model": ...}``. Top-level values with ``state_dict()``/``load_state_dict()`` (DCP's
        ``Stateful``) get what was saved through their ``load_state_dict``. Multi-process: call
        it on every rank; each reads its shards (DCP reshards to this job's world size).

        Args:
            step: the step, or None (or ``"latest"``) for the most recent commit that verifies.
            state_dict: the target, filled in place.
            verify: check CRC-32Cs (None: the manager's ``verify``); sizes are always checked.
            allow_pickle: unpickle saved values outside torch's ``weights_only`` safe set.
            atomic: read and verify everything into host buffers first.
            strict: every key of ``state_dict`` must be in the checkpoint.
            key_map: checkpoint key prefix -> target key prefix.
            cast: a target tensor of another dtype than the checkpoint's is cast into, as
                ``dcp.load`` does (a bf16 step into an fp32 model); default: a mismatch.
            keys: restore only these checkpoint keys and what lies under them (flattened,
                dotted: ``["model"]`` is the model's part of ``{"model": ..., "optim": ...}``);
                the target's other keys are left as they are, and neither they nor the
                checkpoint's other keys are warned about. None: every key.
            exclude: leave out these keys and what lies under them (e.g. ``["optim"]``).

        Returns:
            The step restored.

        Raises:
            StepNotFoundError: the step (or any step, for None) is not committed.
            CorruptCheckpointError: the named step (or every candidate, for None) is damaged.
            PartlyWrittenError: the restore failed after writing into ``state_dict``.
            StateDictMismatchError: the target does not match the checkpoint.
            InvalidStateDictError: ``state_dict`` is not a mapping.
        """
        self._check_process()
        invalid: Optional[Exception] = None
        prefixes: Optional[Dict[str, str]] = None
        selected: Optional[Tuple[str, ...]] = None
        excluded: Tuple[str, ...] = ()
        try:
            if not isinstance(state_dict, Mapping):
                hint = ""
                if callable(getattr(state_dict, "state_dict", None)):
                    hint = (f"; pass its state_dict() (e.g. {{'model': model.state_dict()}}), or put the "
                            f"{type(state_dict).__name__} itself under a key ({{'model': model}}: restored "
                            "through its load_state_dict)")
                raise InvalidStateDictError(f"state_dict must be a mapping, got {type(state_dict).__name__}{hint}")
            if isinstance(step, str) and step.strip().lower() == "latest":
                step = None
            step = None if step is None else check_step(step)
            prefixes = check_key_map(key_map)
            selected = check_key_list("keys", keys)
            excluded = check_key_list("exclude", exclude) or ()
            if not isinstance(cast, bool):
                raise InvalidArgumentError(f"cast must be a bool, got {cast!r}")
        except (TypeError, ValueError, CheckpointError) as exc:
            invalid = exc
        if not self._closed:  # pending saves land first (their errors surface); ranks agree on the step
            self._submitter.settle("restore", invalid,
                                   key=None if invalid is not None else 0 if step is None else step + 1)
        if invalid is not None:
            raise invalid
        opts = RestoreOptions(verify=self.verify if verify is None else verify, allow_pickle=allow_pickle,
                              threads=self.write_threads, planner=load_planner_for(state_dict, allow_pickle),
                              atomic=atomic, strict=strict, pool=self.stager.pool, key_map=prefixes,
                              replicated_reads=self.options.replicated_reads, cast=cast, keys=selected,
                              exclude=excluded)
        t0 = time.perf_counter()
        if self._peers is not None:  # a rank that lost its copies gets them from its peers first
            self._peers.fill(step)
        done, skipped = _restore(functools.partial(self.roots.candidates, self._exchange, step), state_dict,
                                 exchange=self._exchange, step=step, opts=opts)
        s = done.step
        where = done.store.storage.url
        if len(self.roots) > 1:
            where = f"the {self.roots.tier_of(done.store)} tier ({where})"
        if self._peers is not None and self._peers.missing is not None and self._exchange.is_primary:
            log.warning("restore: peer copies could not supply the newest local save (%s); restored step %d from %s",
                        self._peers.missing, s, where)
        elif skipped:  # an earlier copy was skipped: say which one was used
            log.warning("restored step %d from %s", s, where)
        self._decision.restored = s
        for root in self.roots:  # incremental saves compare with the step just read and verified, where it was read
            root.store.note_restored(s if root.store is done.store else None)
        if log.isEnabledFor(logging.INFO):
            nbytes, count = _tensor_bytes(state_dict)
            log.info("%srestored step %d: %s in %s in %s from %s",
                     f"rank {self._exchange.rank} " if self._exchange.world_size > 1 else "", s, format_bytes(nbytes),
                     format_count(count, "tensor"), format_seconds(time.perf_counter() - t0), where)
        return s

    # ---- listing -----------------------------------------------------------------------------
    def best_step(self, metric: Optional[str] = None, mode: Optional[str] = None) -> Optional[int]:
        """The committed step with the best value of ``metric`` (ties: the earliest commit).

        Args:
            metric: the metric's name; default: that of the retention's :class:`KeepBest` (a
                ``KeepBest`` inside ``AnyOf`` counts).
            mode: ``"min"`` or ``"max"``; default: the ``KeepBest``'s for its metric, else
                ``"min"``.

        Returns:
            The step, or None when no committed step has the metric.

        Raises:
            InvalidArgumentError: no ``metric`` and the retention policy has no ``KeepBest``.
        """
        best = find_keep_best(self.retention)
        if metric is None:
            if best is None:
                raise InvalidArgumentError("best_step() needs metric= (the retention policy has no KeepBest)")
            metric = best.metric
        if mode is None:
            mode = best.mode if best is not None and best.metric == metric else "min"
        found = best_checkpoint(self.roots.records(), metric, mode)
        return None if found is None else found.step

    def all_steps(self) -> List[int]:
        """Committed steps over every root, ascending (as torch_xla's manager lists them).

        The order that counts is commit order: see :meth:`steps_in_commit_order` and
        :meth:`latest_step`.

        Returns:
            The steps.
        """
        self._check_process()
        return self.roots.steps()

    def metadata(self, step: int) -> StepMetadata:
        """What a committed step holds, without reading its tensors' bytes.

        Its keys, shapes and dtypes (from DCP's ``.metadata``, checked against the manifest),
        metrics, commit time, size and the user metadata its save was given
        (``save(..., metadata=)``). Of its newest save, over the roots.

        Args:
            step: the step.

        Returns:
            The step's :class:`StepMetadata`.

        Raises:
            StepNotFoundError: no root holds the step.
            CorruptCheckpointError: its marker, manifest or ``.metadata`` is damaged.
        """
        self._check_process()
        return self.roots.step_metadata(check_step(step), threads=self.write_threads)

    def import_step(self, source: str, step: int, *, storage_options: Optional[Dict[str, Any]] = None,
                    allow_pickle: bool = False) -> None:
        """Save a plain DCP checkpoint directory (another program's) as ``step`` of this root.

        ``source`` (torch_xla's, torchtitan's or ``dcp.save``'s step directory, a local path or
        an fsspec URL) is read whole into host memory, then saved as a committed, checksummed
        step here (``save(step, ..., force=True)``); ``source`` is only read.

        Args:
            source: the DCP checkpoint's directory.
            step: the step to save it as.
            storage_options: fsspec options of ``source``'s storage.
            allow_pickle: unpickle values outside torch's ``weights_only`` safe set.

        Raises:
            CorruptCheckpointError: ``source`` is damaged (or not a DCP checkpoint).
            ForeignStepError: another program's directory holds ``step`` here.
            CheckpointError: as :meth:`save`.
        """
        self._check_open()
        self._check_writer("import")
        step = check_step(step)
        src = Storage(source, storage_options)
        state = read_plain_dcp(src, src.root, threads=self.write_threads, allow_pickle=allow_pickle)
        self.save(step, state, force=True)

    def last_save_future(self) -> Optional["Future[int]"]:
        """The future of the most recent save that was taken (``save_async``'s bool stays).

        Returns:
            A ``concurrent.futures.Future`` that gives the step once every root's write of that
            save committed, or raises its failure (which the next ``save``/``join`` raises too);
            None before the first save.
        """
        return self._submitter.last_future

    @property
    def skipped_uploads(self) -> List[int]:
        """With a local tier: the steps whose upload to ``path`` was skipped (one still running).

        ``save_async`` never waits for the previous upload: the step went to the local tier, and
        the next free upload slot uploads the newest of them from there."""
        return self._submitter.skipped_uploads

    def is_saving_in_progress(self) -> bool:
        """Whether a save of this manager is staged, queued or being written at any root.

        Returns:
            True until every save taken so far has committed or failed (:meth:`join` waits for that).
        """
        return any(r.writer.pending > 0 for r in self.roots)

    def foreign_steps(self) -> Dict[int, str]:
        """Step directories under ``path`` that another program wrote.

        That is plain ``dcp.save``, torch_xla's or torchtitan's checkpointer (no ``COMMITTED``
        marker of ours). They are read-only here: not in :meth:`all_steps`, never taken by ``restore(None)``,
        replaced by a save (:class:`~async_ckpt.errors.ForeignStepError`), deleted by retention,
        :meth:`delete` or the cleanup of incomplete steps; ``restore(step, ...)`` reads one.

        Returns:
            step -> the directory's path, ascending.
        """
        self._check_process()
        return self.layout.foreign_steps()

    def step_tiers(self) -> Dict[int, Tuple[str, ...]]:
        """Which roots hold each committed step.

        Returns:
            Committed step -> the roots holding it (``"local"``, ``"persistent"``), newest commit
            first. Without ``local_dir`` every step is ``("persistent",)``.
        """
        self._check_process()
        return {h.step: h.tiers for h in self.roots.held()}

    def steps_in_commit_order(self) -> List[int]:
        """Committed steps, oldest commit first (the order retention sees them in).

        Returns:
            The steps.
        """
        self._check_process()
        return [c.step for c in self.roots.records()]

    def latest_step(self) -> Optional[int]:
        """The most recently committed step over every root.

        In a run whose steps only go up this is also the highest step. After a deliberate roll
        back (restore 10, train on, save 11 and 12) it is 12, not an abandoned higher step.

        Returns:
            The step, or None when there is none.
        """
        self._check_process()
        records = self.roots.records()
        if records:
            return records[-1].step
        steps = self.all_steps()  # only steps whose manifests do not read
        return steps[-1] if steps else None

    def wait_for_step(self, after: Optional[int] = None, *, timeout: float, poll_s: float = 1.0) -> Optional[int]:
        """Wait until a live writer commits a new step: for an evaluation job following a run.

        Lists the root every ``poll_s`` seconds (a listing only; the manifests are read when the
        steps listed change). With several ranks rank 0 lists and every rank gets its answer.
        Then ``restore(None, ...)`` loads the newest step that exists when it reads (it may be
        newer still; retention may have dropped the one returned here meanwhile): see
        docs/reliability.md, "Reading a live run".

        Args:
            after: the step last seen (e.g. the one last restored); None: any committed step.
            timeout: seconds to wait at most (``math.inf``: no bound).
            poll_s: seconds between listings.

        Returns:
            The most recently committed step, as soon as it is higher than ``after``, or is
            another step committed while this call waited (a run that rolled back saves lower
            steps); None when no such step came within ``timeout``.

        Raises:
            InvalidStepError: ``after`` is not a step (an int >= 0).
            InvalidArgumentError: ``timeout`` / ``poll_s`` is not a number of seconds (>= 0, > 0).
            StorageError: the root could not be listed (after retries).
        """
        self._check_process()
        if after is not None:
            after = check_step(after)
        for name, v, least in (("timeout", timeout, 0.0), ("poll_s", poll_s, None)):
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or v != v
                    or (v < least if least is not None else v <= 0) or (name == "poll_s" and v == float("inf"))):
                raise InvalidArgumentError(f"wait_for_step: {name} must be a number of seconds "
                                           f"{'>= 0' if least is not None else '> 0'}, got {v!r}")
        deadline = time.monotonic() + timeout
        state: Dict[str, Any] = {"listed": None, "start": None, "first": True}

        def look() -> Tuple[Optional[int], bool]:  # rank 0: (a new step, whether to stop waiting)
            listed = tuple(tuple(r.store.layout.committed_steps()) for r in self.roots)
            if listed != state["listed"]:
                state["listed"] = listed
                records = self.roots.records()
                newest = records[-1] if records else None
                if state["first"]:
                    state["start"] = newest
                start = state["start"]
                if newest is not None and (after is None or newest.step > after or (
                        not state["first"] and newest.step != after
                        and (start is None or newest.commit_time > start.commit_time))):
                    return newest.step, True
            state["first"] = False
            return None, time.monotonic() >= deadline

        while True:
            found, stop = phase.primary(self._exchange, "listing the committed steps", None, look)
            if stop:
                return found
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))

    def metrics(self, step: int) -> Dict[str, float]:
        """The metrics stored with a committed step (of its newest save, over the roots).

        A root that cannot be read (a bucket that is down) is skipped with a warning while
        another root holds the step. Another job's local copy (saved for another checkpoint
        path) is not read.

        Args:
            step: the step.

        Returns:
            The metrics (name -> value).

        Raises:
            StepNotFoundError: no root holds this job's copy of the step.
            StorageError: no root that could be read holds it, and one could not be read (its
                error).
        """
        return self.roots.metrics(check_step(step))

    # ---- explicit actions on committed steps -------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete a committed step (an explicit user action) from every root that holds it.

        It is no longer listed or restorable when this returns, and its files are gone. Waits
        for pending saves first and takes the root's writer lease. Multi-process: call it on
        every rank; rank 0 deletes (each rank its own local copy), and a failure on any rank
        (one rank's earlier failed save, its local copy that cannot be deleted) is raised on
        every rank.

        Args:
            step: the step.

        Raises:
            StepNotFoundError: the step is not committed.
            LeaseHeldError: another writer holds the root's writer lease.
            CheckpointError: the manager is ``read_only``.
        """
        self._check_open()
        self._check_writer("delete")
        invalid: Optional[Exception] = None
        try:
            step = check_step(step)
        except (TypeError, ValueError, CheckpointError) as exc:
            invalid = exc
        # every rank names the same step
        self._submitter.settle("delete", invalid, key=None if invalid is not None else step + 1)
        if invalid is not None:
            raise invalid

        def delete_here() -> None:  # this rank's local copy; rank 0: the persistent root's too
            local = self.roots.local
            local_held = (local is not None and step in local.store.layout.committed_steps()
                          and not foreign_steps(local, step))  # another job's copy is not ours
            if local_held and local is not None:
                local.store.become_writer()
                local.store.delete(step)
            if self._exchange.is_primary and (not local_held or step in self.layout.committed_steps()):
                self.roots.persistent.store.become_writer()
                self.roots.persistent.store.delete(step)
            if self._peers is not None:  # the copies this rank holds for others: a peer never brings it back
                self._peers.delete_held(step)

        phase.everyone(self._exchange, "delete", step, delete_here)

    def promote(self, step: int) -> List[int]:
        """Copy the local tier's committed ``step`` to ``path`` and commit it there.

        Every file is checked against the local manifest first. The persistent root's
        retention pass after it keeps the promoted step; later saves' passes see it as any
        other step, at its original commit time. Waits for pending saves; takes the writer
        lease of ``path``. One process only (a rank's local copy holds only its own shards).

        Args:
            step: the step.

        Returns:
            The steps ``path``'s retention then dropped (logged too).

        Raises:
            CheckpointError: no local tier, several ranks, another job's copy, the step is
                already committed under ``path``, or the manager is ``read_only``.
            StepNotFoundError: the local tier does not hold the step.
            CorruptCheckpointError: a local file is not as its manifest says.
        """
        self._check_open()
        self._check_writer("promote")
        step = check_step(step)
        local = self.roots.local
        if local is None:
            raise CheckpointError("promote() needs a manager with local_dir=")
        if self._exchange.world_size > 1:
            raise CheckpointError("promote() copies one process's local step; with several ranks each local "
                                  "copy holds one rank's shards: save the step with force=True instead")
        self._submitter.settle("promote")  # an earlier failed upload (still raised by join) is what promote repairs
        self.roots.persistent.store.become_writer()
        _, dropped = promote(local, self.roots.persistent, step, verify=self.verify, threads=self.write_threads)
        if dropped:
            log.warning("promote(%d): the retention of %s dropped steps %s", step, self.storage.url, dropped)
        return dropped

    # ---- lifecycle ---------------------------------------------------------------------------
    def join(self) -> None:
        """Wait for every pending save to commit (and retention's decision after it).

        Raises the first background failure (with ``local_dir``: also the failed writes to ``path``).

        Raises:
            CheckpointError: a background save failed (each root's failure is raised once).
        """
        self._check_process()
        self.wait_for_staging()
        errors: List[BaseException] = []
        for tier in self.roots:
            try:
                tier.writer.join()
            except BaseException as exc:  # noqa: BLE001 - every tier is waited for, then raised
                errors.append(exc)
        if self._peers is not None and not self._peers.wait_idle():  # their peer copies too (failures: logged)
            log.warning("join(): peer copies are still being exchanged after %s s (a peer is still writing its "
                        "local copy, or stopped answering); they go on in the background",
                        self.options.collective_timeout_s)
        if errors:
            _raise_all(errors)

    def close(self) -> None:
        """Finish pending saves and deletions, stop the threads, release the leases, raise failures.

        A ``KeyboardInterrupt`` (Ctrl-C) while it waits for a save abandons the saves still
        being written: they fail at their next file and remove what they wrote (nothing is
        committed, committed steps stay), then it is raised again."""
        self._close()

    def _close(self, notice: Optional[str] = None) -> None:
        """:meth:`close`; ``notice``: ``"interrupt"`` (after a Ctrl-C) says first which saves
        it waits for and that another Ctrl-C abandons them; ``"exit"`` (interpreter exit, no
        Ctrl-C) says so only if they are still running after :data:`EXIT_NOTICE_AFTER_S`."""
        if self._closed:
            return
        self._check_process()
        pending = sorted(set(self._in_flight))
        steps = ", ".join(map(str, pending))
        try:
            if pending and notice == "interrupt":
                log.warning("finishing the save of step %s; Ctrl-C again to abandon it", steps)
            elif pending and notice == "exit":
                log.info("finishing the save of step %s before exiting", steps)
                if not self._idle_within(EXIT_NOTICE_AFTER_S):
                    log.warning("still finishing the save of step %s before exiting; Ctrl-C to abandon it", steps)
            self._close_now()
        except KeyboardInterrupt:
            self._abandon(pending)
            raise

    def _idle_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every tier's queued saves; whether they all ended."""
        deadline = time.monotonic() + seconds
        for tier in self.roots:
            try:
                tier.writer.wait_idle(timeout=max(0.0, deadline - time.monotonic()))
            except CheckpointError:  # still running: a timeout
                return False
        return True

    def _abandon(self, pending: List[int]) -> None:
        """A Ctrl-C while closing: every tier refuses further writes, so the saves being
        written fail at their next file and remove their temporary directories; wait for that
        (30 s at most; another Ctrl-C stops waiting), then release the leases."""
        for tier in self.roots:
            tier.store.storage.abandon()
        deadline = time.monotonic() + 30.0
        try:
            for tier in self.roots:
                try:
                    tier.writer.wait_idle(timeout=max(0.0, deadline - time.monotonic()))
                except CheckpointError:
                    pass
        except KeyboardInterrupt:
            pass
        for tier in self.roots:
            try:
                tier.store.close()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self._finalizer.detach()
        live_managers.discard(self)
        try:  # what the saves it waited for became: only those that did not commit were abandoned
            committed = set(self.catalog.infos())
        except Exception:  # noqa: BLE001 - cannot tell: all of them are named as not committed
            committed = set()
        lost = [s for s in pending if s not in committed]
        done = [s for s in pending if s in committed]
        if lost:
            log.warning("abandoned the save of step %s: not committed (committed steps are kept)",
                        ", ".join(map(str, lost)))
        if not pending or done:
            log.warning("closing interrupted (Ctrl-C): %s; committed steps are kept",
                        f"the save of step {', '.join(map(str, done))} had committed" if done
                        else "no save was being written")

    def _close_now(self) -> None:
        self._closed = True
        live_managers.discard(self)
        if self._preemption is not None:
            self._preemption.watcher.uninstall()
        errors: List[BaseException] = []
        try:
            self.wait_for_staging()  # lazy saves' writers wait for their copies to be sealed
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        for tier in self.roots:
            try:
                tier.writer.close()
            except BaseException as exc:  # noqa: BLE001 - every tier is closed, then raised
                errors.append(exc)
            finally:
                tier.store.close()
        if self._peers is not None:  # after the local writer: its last copies are exchanged too
            try:
                self._peers.close()
            except BaseException as exc:  # noqa: BLE001 - raised with the rest
                errors.append(exc)
        try:  # the declared-frozen tensors, checked once more
            changed = frozen_changed_at_close(self._submitter.frozen, [r.store.reuse.same_bytes for r in self.roots
                                                             if r.store.reuse is not None])
            if changed is not None:
                errors.append(changed)
        except Exception as exc:  # noqa: BLE001 - reported with the rest
            errors.append(exc)
        self._finalizer.detach()
        if errors:
            _raise_all(errors)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self._close(notice="interrupt" if issubclass(exc_type, KeyboardInterrupt) else None)
            except KeyboardInterrupt:  # a second Ctrl-C abandoned the saves: the first one propagates
                if not issubclass(exc_type, KeyboardInterrupt):
                    raise
            except Exception as close_exc:  # do not mask the original exception
                log.error("pending save failed while handling another error: %s", close_exc)

    def _check_process(self) -> None:
        if self._forked:
            raise CheckpointError(
                f"this CheckpointManager ({self.storage.url}) was created in process {self._pid} and is "
                f"used in a forked child (pid {os.getpid()}): its writer threads do not exist here, so "
                f"saves would never be written. Create a new CheckpointManager in the child.")

    def _check_open(self) -> None:
        self._check_process()
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")

    def _check_writer(self, what: str) -> None:
        if self.options.read_only:
            raise CheckpointError(f"{what}: this CheckpointManager of {self.storage.url} was opened with "
                                  f"read_only=True: it lists and restores only (open one without read_only to "
                                  f"{what})")

