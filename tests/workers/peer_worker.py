"""Worker for tests/tiers/test_peers_dist.py: peer copies of the local tier (issue 38), 4 ranks as 2
"nodes" of 2, launched without torchrun with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE=2``, ``GROUP_RANK`` = the node), so that one rank may die
without the launcher ending the others:

    RANK=r ... GROUP_RANK=r//2 python tests/workers/peer_worker.py <mode> <base>

Node ``n``'s ranks share the local_dir ``<base>/n<n>``; the bucket is ``countfs://<base>/bucket``
(every byte read from its data files is counted). Modes:

* ``lost``: saves steps 1-7 locally with ``local_replicas=2`` (the bucket every 5th), then, with
  fresh managers each time (as after a restart): node 1's local_dir deleted -> every rank
  restores step 7 bitwise with no byte read from the bucket; saves 8 and 9 (replicated again);
  node 0's local_dir deleted -> step 9, no bucket byte; saves 11, 12; node 1's local_dir deleted
  and the copy of rank 2's step 12 that node 0 holds damaged -> step 11 (the next step every
  rank can get), no bucket byte; node 1's copies lost again and rank 2's held step 11 damaged too
  -> the bucket's step 5; saves 13, then node 0's disk serves ranks 2 and 3 and ranks 0 and 1
  come back on an empty node -> step 13, no bucket byte (copies found on a rank's own disk are
  copied there, the others sent); saves 14 and deletes it: its copies held by peers go too, and
  a restore gives step 13.
* ``kill``: saves steps 1-3; rank 1 dies (``os._exit``) while it sends its step 3 to its peer:
  the survivors' next save raises (a rank is gone) instead of waiting, and rank 3 holds no copy
  of rank 1's step 3, committed or half-written.
* ``after-kill``: the next job, after node 0's local_dir was lost too: every rank restores step 2
  (the newest step every rank can get: rank 1's step 3 never reached its peer) from the peers,
  then saves step 4, which is replicated again.

Each check prints ``<NAME> RANK <r> OK`` or ``<NAME> RANK <r> FAILED: ...``.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import shutil
import sys
import time
import traceback
import warnings
from typing import Any, Dict, List, Optional

import fsspec
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from async_ckpt import CheckpointError, CheckpointManager  # noqa: E402
from tests.support.damage import flip_data_byte  # noqa: E402
from tests.support.faulty_fs import DIE_STATUS, FaultyFileSystem  # noqa: E402
from tests.support.tree import assert_bitwise_equal  # noqa: E402
from tests.workers.replicated_worker import READS, data_read  # noqa: E402  (registers countfs://)

KIB = 1024


def state(rank: int, step: int) -> Dict[str, Any]:
    """Rank ``rank``'s state at ``step``: its own tensors, one that every rank holds alike (as
    DDP's model), and plain values."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"rank{rank}": {"w": torch.randn(64 * KIB // 4, generator=g),
                            "h": torch.randn(4096, generator=g).to(torch.bfloat16),
                            "i": torch.randint(-(2**40), 2**40, (513,), generator=g)},
            "shared": torch.arange(32 * KIB, dtype=torch.float64) * step,
            "meta": {"step": step, "tag": f"s{step}"}}


def blank(rank: int) -> Dict[str, Any]:
    sd = state(rank, 0)
    for v in list(sd[f"rank{rank}"].values()) + [sd["shared"]]:
        v.fill_(7)
    sd["meta"] = {"step": -1, "tag": "none"}
    return sd


class DyingFileSystem(FaultyFileSystem):
    """``dyingfs:///abs/path``: the local files there; in a process whose ``PEER_DIE_READ`` is
    ``<path part>:<n>``, the n-th read of a data file whose path holds that part ends the process
    (``os._exit(DIE_STATUS)``): a rank killed while it sends that copy to its peer."""

    protocol = "dyingfs"
    opened = 0

    @staticmethod
    def _read(path: str) -> None:
        spec = os.environ.get("PEER_DIE_READ")
        if spec and path.endswith(".distcp"):
            part, n = spec.rsplit(":", 1)
            if part in path:
                DyingFileSystem.opened += 1
                if DyingFileSystem.opened >= int(n):
                    os._exit(DIE_STATUS)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode:
            self._read(path)
        return super()._open(path, mode, *args, **kwargs)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        self._read(path)
        return super().cat_file(path, start=start, end=end, **kwargs)


fsspec.register_implementation("dyingfs", DyingFileSystem, clobber=True)


# ---- helpers ---------------------------------------------------------------------------------------

def node_dir(base: str, node: int) -> str:
    return os.path.join(base, f"n{node}")


def manager(base: str, rank: int, node: Optional[int] = None, **kw: Any) -> CheckpointManager:
    local = node_dir(base, rank // 2 if node is None else node)
    if kw.pop("dying", False):
        local = "dyingfs://" + local
    opts: Dict[str, Any] = dict(save_interval=5, local_dir=local, local_policy=1, local_retention=2,
                                local_replicas=2, collective_timeout_s=30)
    opts.update(kw)
    return CheckpointManager("countfs://" + os.path.join(base, "bucket"), **opts)


def save_steps(mgr: CheckpointManager, rank: int, steps: List[int], each: bool = False) -> None:
    """Save ``steps``; ``each``: wait after each one (join() waits for its peer copies too, so
    every step is replicated: else a copy whose turn comes after a newer save is not sent)."""
    for s in steps:
        assert mgr.save_async(s, state(rank, s)), s
        if each:
            mgr.join()
    mgr.join()


def committed(root: str) -> List[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(n) for n in os.listdir(root) if n.isdigit() and os.path.exists(os.path.join(root, n, "COMMITTED")))


def held_dir(base: str, holder: int, owner: int) -> str:
    return os.path.join(node_dir(base, holder // 2), f"rank{holder}", f"held-rank{owner}")


def peer_of(rank: int) -> int:
    return (rank + 2) % 4


def lose_node(base: str, rank: int, node: int) -> None:
    dist.barrier()
    if rank == 2 * node:
        shutil.rmtree(node_dir(base, node))
    dist.barrier()


def restore_counted(base: str, rank: int, expect: int, bucket_reads: bool = False, node: Optional[int] = None) -> None:
    """A fresh manager restores on every rank: step ``expect``, bitwise; no byte of the bucket's
    data files read (unless ``bucket_reads``: then some)."""
    target = blank(rank)
    dist.barrier()
    READS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with manager(base, rank, node) as mgr:
            got = mgr.restore(None, target)
    read = data_read()
    assert got == expect, (rank, got, expect)
    assert_bitwise_equal(target, state(rank, expect))
    reads = [0] * 4
    dist.all_gather_object(reads, read)
    if bucket_reads:
        assert sum(reads) > 0, reads
    else:
        assert reads == [0, 0, 0, 0], f"bytes read from the bucket's data files by rank: {reads}"


def whole_after_losing(base: str, node: int) -> List[int]:
    """The saves the other node's disks hold whole (every rank's copy: its own, or held for it)."""
    own = [set(committed(os.path.join(node_dir(base, r // 2), f"rank{r}"))) for r in range(4)]
    held = [set(committed(held_dir(base, peer_of(r), r))) for r in range(4)]
    return sorted(set.intersection(*[(held[r] if r // 2 == node else own[r]) for r in range(4)]))


def claim_size(step_dir: str, size: int) -> None:
    """Make a committed copy claim ``size`` bytes for its first data file: its manifest says so,
    and its commit marker vouches for that manifest (a peer that lies about a copy)."""
    import json

    from async_ckpt.format.manifest import marker_bytes

    path = os.path.join(step_dir, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    name = sorted(n for n in m["files"] if n.endswith(".distcp"))[0]
    m["files"][name] = {"crc32c": m["files"][name]["crc32c"], "size": size}
    raw = json.dumps(m, indent=1, sort_keys=True).encode()
    with open(path, "wb") as f:
        f.write(raw)
    with open(os.path.join(step_dir, "COMMITTED"), "wb") as f:
        f.write(marker_bytes(int(m["step"]), raw))


def run_check(name: str, fn: Any) -> bool:
    rank = dist.get_rank()
    try:
        fn()
        print(f"{name} RANK {rank} OK", flush=True)
        return True
    except Exception as exc:  # noqa: BLE001 - reported, the test fails on it
        print(f"{name} RANK {rank} FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}", flush=True)
        return False


# ---- modes -----------------------------------------------------------------------------------------

def lost(base: str) -> None:
    rank = dist.get_rank()

    def saved() -> None:
        with manager(base, rank) as mgr:
            assert mgr.peers is not None and mgr.peers.topology.dests == (peer_of(rank),), mgr.peers
            save_steps(mgr, rank, list(range(1, 8)))
            sent = [t for t in mgr.peers.transfers if not t.problems and t.sent_bytes]
            assert sent, list(mgr.peers.transfers)
        dist.barrier()
        # each rank's newest copies are on its own disk and on its peer's, committed
        assert committed(os.path.join(node_dir(base, rank // 2), f"rank{rank}")) == [6, 7]
        # the newest is held (an older one whose turn came after a newer save was not sent)
        assert committed(held_dir(base, peer_of(rank), rank))[-1] == 7, committed(held_dir(base, peer_of(rank), rank))
        assert committed(os.path.join(base, "bucket")) == [5]

    def node1_lost() -> None:
        lose_node(base, rank, 1)
        restore_counted(base, rank, 7)
        # the copies came home: node 1's ranks hold their step 7 again; the next saves replicate
        assert committed(os.path.join(node_dir(base, rank // 2), f"rank{rank}"))[-1] == 7
        with manager(base, rank) as mgr:
            mgr.restore(None, blank(rank))
            save_steps(mgr, rank, [8, 9])
        dist.barrier()
        assert committed(held_dir(base, peer_of(rank), rank))[-1] == 9

    def node0_lost() -> None:
        lose_node(base, rank, 0)
        restore_counted(base, rank, 9)

    def damaged_held() -> None:
        with manager(base, rank) as mgr:
            mgr.restore(None, blank(rank))
            save_steps(mgr, rank, [11, 12], each=True)
        lose_node(base, rank, 1)
        if rank == 0:  # the copy of rank 2's step 12 that rank 0 holds
            flip_data_byte(os.path.join(held_dir(base, 0, 2), "12"))
        restore_counted(base, rank, 11)

    def nothing_complete() -> None:
        lose_node(base, rank, 1)
        if rank == 0:
            flip_data_byte(os.path.join(held_dir(base, 0, 2), "11"))
        restore_counted(base, rank, 5, bucket_reads=True)

    def other_ranks() -> None:
        with manager(base, rank) as mgr:
            save_steps(mgr, rank, [13])
        # the job comes back with node 0's disk serving ranks 2 and 3, and ranks 0 and 1 on a new,
        # empty node: ranks 2 and 3 copy theirs from the copies held on that disk, ranks 0 and 1
        # get theirs from ranks 2 and 3, which see their directories
        swapped = 1 - rank // 2
        os.environ["GROUP_RANK"] = str(swapped)
        lose_node(base, rank, 1)
        restore_counted(base, rank, 13, node=swapped)
        assert committed(os.path.join(node_dir(base, swapped), f"rank{rank}")) == [13]
        os.environ["GROUP_RANK"] = str(rank // 2)

    def deleted() -> None:
        mine = os.path.join(node_dir(base, rank // 2), f"rank{rank}")
        with manager(base, rank) as mgr:
            save_steps(mgr, rank, [14])
            dist.barrier()
            assert 14 in committed(held_dir(base, peer_of(rank), rank)) and 14 in committed(mine)
            mgr.delete(14)
        dist.barrier()
        assert 14 not in committed(held_dir(base, peer_of(rank), rank)) and 14 not in committed(mine)
        restore_counted(base, rank, 13)  # a deleted step never comes back from a peer

    def oversized_held() -> None:
        with manager(base, rank) as mgr:
            save_steps(mgr, rank, [16], each=True)
        lose_node(base, rank, 1)
        if rank == 0:  # the copy of rank 2's step 16 that rank 0 holds claims a 1 TiB file
            claim_size(os.path.join(held_dir(base, 0, 2), "16"), 2**40)
        t0 = time.monotonic()
        restore_counted(base, rank, 13)  # refused at once: 16 is not complete, 13 is (from the peers)
        assert time.monotonic() - t0 < 60, time.monotonic() - t0
        if rank == 2:  # nothing of the refused copy is left in its local tier
            mine = os.path.join(node_dir(base, 1), "rank2")
            assert all(n.isdigit() or n.startswith(".async_ckpt") for n in os.listdir(mine)), os.listdir(mine)
            assert 16 not in committed(mine), committed(mine)

    def back_to_back() -> None:
        """Saves back to back (16 MiB per rank): after each one, whichever node is lost, some save
        is whole on the other node's disks (its own copies and the copies it holds), without
        waiting for replication (before: none ever was, so every restart read the bucket); and no
        transfer failed (retention deleting a step while it was sent)."""
        fresh = os.path.join(base, "back-to-back")
        big = {f"rank{rank}": torch.zeros(4 * 2**20)}
        missed = []
        with manager(fresh, rank, save_interval=1000) as mgr:
            assert mgr.save_async(1, big)
            mgr.join()  # the first save is replicated
            for s in range(2, 10):
                big[f"rank{rank}"].fill_(s)
                assert mgr.save_async(s, big)
                dist.barrier()
                if rank == 0:
                    for node in (0, 1):
                        whole = whole_after_losing(fresh, node)
                        if not whole:
                            missed.append((s, node))
                dist.barrier()
            mgr.join()
            # no copy failed: the owner's retention never deleted a step while it was being sent
            failed = [t for t in mgr.peers.transfers if t.problems]
            assert not failed, failed
        assert not missed, f"(save, lost node) with no save whole on the other node: {missed}"

    checks = [("SAVED", saved), ("NODE1 LOST", node1_lost), ("NODE0 LOST", node0_lost), ("DAMAGED HELD", damaged_held),
              ("NOTHING COMPLETE", nothing_complete), ("OTHER RANKS", other_ranks), ("DELETED", deleted),
              ("OVERSIZED HELD", oversized_held), ("BACK TO BACK", back_to_back)]
    for name, fn in checks:
        if not run_check(name, fn):
            break


def kill(base: str) -> None:
    rank = dist.get_rank()

    def killed() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr = manager(base, rank, dying=rank == 1)
        save_steps(mgr, rank, [1, 2], each=True)
        dist.barrier()
        assert mgr.save_async(3, state(rank, 3))
        gone = os.path.join(base, "rank1-gone")
        if rank == 1:  # its replication thread ends the process while it sends step 3 to rank 3
            time.sleep(120)
            raise AssertionError("rank 1 did not die")
        if rank == 3:  # its replication thread sees rank 1 go: replication stops, logged
            deadline = time.monotonic() + 60
            while mgr.peers.broken is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert mgr.peers.broken is not None, "rank 3's replication did not notice rank 1's death"
            open(gone, "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(gone) and time.monotonic() < deadline:
            time.sleep(0.05)
        # the survivors' next collective fails (a rank is gone) within the timeout, never a hang
        t0 = time.monotonic()
        try:
            mgr.save_async(4, state(rank, 4))
            mgr.join()
            raise AssertionError("a save went on without rank 1")
        except CheckpointError as exc:
            print(f"RAISED {time.monotonic() - t0:.1f} {type(exc).__name__}", flush=True)
        if rank == 3:  # nothing of rank 1's step 3 here, committed or not
            held = held_dir(base, 3, 1)
            assert committed(held) == [1, 2], committed(held)
            left = [n for n in os.listdir(held) if n.startswith(".tmp-3-") or n == "3"]
            assert not left, left
        print(f"KILLED RANK {rank} OK", flush=True)
        os._exit(0)  # the group is broken: no orderly shutdown

    run_check("KILLED", killed)


def after_kill(base: str) -> None:
    rank = dist.get_rank()

    def restored() -> None:
        lose_node(base, rank, 0)
        restore_counted(base, rank, 2)
        with manager(base, rank) as mgr:
            mgr.restore(None, blank(rank))
            save_steps(mgr, rank, [4])
        dist.barrier()
        assert committed(held_dir(base, peer_of(rank), rank))[-1] == 4

    run_check("AFTER KILL", restored)


def main() -> None:
    what, base = sys.argv[1], sys.argv[2]
    faulthandler.dump_traceback_later(float(os.environ.get("DIST_WORKER_TIMEOUT", "150")), exit=True)
    logging.basicConfig(level=logging.WARNING, format=f"[rank {os.environ.get('RANK')}] %(levelname)s %(message)s")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    {"lost": lost, "kill": kill, "after-kill": after_kill}[what](base)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
