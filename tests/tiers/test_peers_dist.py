"""Peer copies of the local tier (issue 38) with 4 ranks as 2 nodes of 2: a lost node restores
from its peers, not the bucket (the scenarios are in tests/workers/peer_worker.py).

One module fixture runs the workers' jobs once: ``lost`` (one job of 4 ranks, each scenario with
fresh managers, as after a restart), then ``kill`` (rank 1 dies mid-transfer) and ``after-kill``
(the next job). The ranks are started without torchrun (which would end the others when one
dies), with torchrun's environment: ``LOCAL_WORLD_SIZE=2`` and ``GROUP_RANK`` = the node.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import pytest

from ..support.faulty_fs import DIE_STATUS
from ..support.launch import finish, start_ranks

pytestmark = pytest.mark.slow

TIMEOUT = 300


def _job(mode: str, base: str, env: Optional[Dict[int, Dict[str, str]]] = None) -> List[Tuple[int, str]]:
    """Run ``mode`` on 4 ranks (ranks 2r and 2r+1 on node r, ``env``: more variables by rank);
    each rank's (exit status, output)."""
    procs = start_ranks(4, "peer_worker.py", mode, base, env={"DIST_WORKER_TIMEOUT": "240"},
                        rank_env=lambda r: {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2",
                                            "GROUP_RANK": str(r // 2), **(env or {}).get(r, {})})
    return [finish(p, TIMEOUT) for p in procs]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Dict[str, List[Tuple[int, str]]]:
    lost, killed = tmp_path_factory.mktemp("lost"), tmp_path_factory.mktemp("kill")
    out = {"lost": _job("lost", str(lost))}
    # rank 1 dies at its first read of its step 3's data (its replication thread sending it to rank 3)
    out["kill"] = _job("kill", str(killed), {1: {"PEER_DIE_READ": "/rank1/3/:1"}})
    out["after-kill"] = _job("after-kill", str(killed))
    for name, ranks in out.items():
        (tmp_path_factory.getbasetemp() / f"peers-{name}.log").write_text(
            "\n".join(f"==== rank {r} (exit {rc})\n{text}" for r, (rc, text) in enumerate(ranks)))
    return out


def _passed(jobs, job: str, check: str, ranks=range(4)) -> None:
    for r in ranks:
        rc, text = jobs[job][r]
        if f"{check} RANK {r} OK" not in text:
            pytest.fail(f"{job}: {check} did not pass on rank {r} (exit {rc}):\n{text[-4000:]}")


def test_every_rank_saves_its_local_copy_to_its_peer_on_the_other_node(jobs):
    _passed(jobs, "lost", "SAVED")


def test_a_lost_node_restores_the_newest_local_step_from_its_peers_with_no_bucket_read(jobs):
    _passed(jobs, "lost", "NODE1 LOST")  # and then replicates again
    _passed(jobs, "lost", "NODE0 LOST")


def test_a_node_that_comes_back_as_other_ranks_restores_from_its_own_disk_and_its_peers(jobs):
    _passed(jobs, "lost", "OTHER RANKS")


def test_delete_removes_the_copies_peers_hold_so_the_step_never_comes_back(jobs):
    _passed(jobs, "lost", "DELETED")


def test_a_damaged_held_copy_falls_back_to_the_next_step_every_rank_can_get_then_the_bucket(jobs):
    _passed(jobs, "lost", "DAMAGED HELD")
    _passed(jobs, "lost", "NOTHING COMPLETE")


def test_a_held_copy_claiming_more_bytes_than_the_disk_holds_is_refused_at_once(jobs):
    """A peer's copy whose manifest claims a 1 TiB file: the receiver refuses it at once (it wrote
    zeros until close() gave up), leaves nothing behind, and the restore falls back to the newest
    step every rank can get (13, from the peers)."""
    _passed(jobs, "lost", "OVERSIZED HELD")


def test_under_back_to_back_saves_a_lost_node_always_has_a_whole_save_on_the_other(jobs):
    """Saves back to back, 16 MiB per rank: after each, whichever node is lost, the other node's
    disks hold some save whole (before: the ranks replicated different saves and the owners'
    retention dropped what the peers held, so none ever was)."""
    _passed(jobs, "lost", "BACK TO BACK")


def test_a_peer_killed_mid_transfer_leaves_nothing_committed_and_the_next_save_replicates(jobs):
    rc, text = jobs["kill"][1]
    assert rc == DIE_STATUS, f"rank 1 did not die mid-transfer (exit {rc}):\n{text[-4000:]}"
    _passed(jobs, "kill", "KILLED", ranks=(0, 2, 3))
    assert "peer copies stopped at step 3" in jobs["kill"][3][1]  # logged by the survivor
    for r in (0, 2, 3):
        assert "RAISED" in jobs["kill"][r][1]  # its next save raised instead of waiting for rank 1
    _passed(jobs, "after-kill", "AFTER KILL")
