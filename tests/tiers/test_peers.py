"""Peer copies of the local tier (issue 38), in one process: the option's checks, who sends to
whom, and which save a restore brings home from where. The exchanges between ranks are in
tests/tiers/test_peers_dist.py."""

from __future__ import annotations

import pytest

from async_ckpt import CheckpointManager, InvalidArgumentError
from async_ckpt.format import step_names
from async_ckpt.jobs.peer_inventory import Seen, complete_saves
from async_ckpt.ranks.topology import ring


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_local_replicas_must_be_an_int_of_at_least_one(tmp_path, bad):
    with pytest.raises(InvalidArgumentError, match="local_replicas must be an int >= 1"):
        CheckpointManager(str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"), local_replicas=bad)


def test_local_replicas_needs_a_local_dir(tmp_path):
    with pytest.raises(InvalidArgumentError, match="pass local_dir= too"):
        CheckpointManager(str(tmp_path / "ckpt"), local_replicas=2)


def test_local_replicas_needs_several_ranks(tmp_path):
    with pytest.raises(InvalidArgumentError, match="needs several ranks"):
        CheckpointManager(str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"), local_replicas=2)
    assert not (tmp_path / "local").exists()  # refused before anything was made
    with CheckpointManager(str(tmp_path / "ckpt"), local_dir=str(tmp_path / "local"), local_replicas=1) as mgr:
        assert mgr.peers is None


def test_held_and_rank_directory_names_round_trip_and_are_not_steps():
    assert step_names.rank_dir_name(3) == "rank3" and step_names.rank_of_dir("/x/rank3/") == 3
    assert step_names.held_dir_name(12) == "held-rank12" and step_names.rank_of_held_dir("a/held-rank12") == 12
    for name in ("held-rank12", "rank3"):
        assert step_names.parse(name) is None
    assert step_names.rank_of_dir("held-rank1") is None and step_names.rank_of_held_dir("rank1") is None
    assert step_names.rank_of_dir("rank") is None and step_names.rank_of_held_dir("held-rankx") is None


def test_ring_sends_each_rank_to_the_same_local_rank_of_the_next_nodes():
    two = [[0, 1], [2, 3]]
    assert ring(two, 2) == {0: [2], 1: [3], 2: [0], 3: [1]}
    assert ring(two, 3) == {0: [2], 1: [3], 2: [0], 3: [1]}  # no more nodes than there are
    three = [[0, 1], [2, 3], [4, 5]]
    assert ring(three, 2) == {0: [2], 1: [3], 2: [4], 3: [5], 4: [0], 5: [1]}
    assert ring(three, 3) == {0: [2, 4], 1: [3, 5], 2: [4, 0], 3: [5, 1], 4: [0, 2], 5: [1, 3]}
    assert ring([[0, 1, 2], [3]], 2) == {0: [3], 1: [3], 2: [3], 3: [0]}  # uneven nodes: modulo their size
    assert ring([[0, 1]], 2) == {0: [], 1: []}


def seen(owner, step, sid, t, where, own=False, nbytes=100):
    return Seen(owner, step, sid, t, nbytes, where, own)


def two_nodes(steps):
    """4 ranks on 2 nodes; each rank holds its own copies and its peer's (rank +- 2), for ``steps``."""
    inv = [[] for _ in range(4)]
    for s, t in steps:
        for r in range(4):
            inv[r].append(seen(r, s, f"run.{s}", t, f"/n{r // 2}/rank{r}", own=True))
            p = (r + 2) % 4
            inv[r].append(seen(p, s, f"run.{s}", t, f"/n{r // 2}/rank{r}/held-rank{p}"))
    return inv


def test_a_lost_node_gets_its_newest_copies_from_the_ranks_that_hold_them():
    inv = two_nodes([(6, 6.0), (7, 7.0)])
    inv[2], inv[3] = [], []  # node 1 came back empty
    got = complete_saves(inv, 4)
    assert [(c.step, c.save_id) for c in got] == [(7, "run.7"), (6, "run.6")]
    assert [(m.owner, m.sender, m.where) for m in got[0].moves] == [
        (2, 0, "/n0/rank0/held-rank2"), (3, 1, "/n0/rank1/held-rank3")]


def test_nothing_moves_when_every_rank_holds_its_copy():
    got = complete_saves(two_nodes([(7, 7.0)]), 4)
    assert len(got) == 1 and got[0].moves == ()


def test_a_save_some_rank_cannot_get_is_not_complete():
    inv = two_nodes([(6, 6.0), (7, 7.0)])
    inv[2], inv[3] = [], []
    inv[0] = [c for c in inv[0] if not (c.owner == 2 and c.step == 7)]  # rank 2's step 7 is nowhere
    assert [c.step for c in complete_saves(inv, 4)] == [6]
    assert [c.step for c in complete_saves(inv, 4, step=7)] == []
    assert [c.step for c in complete_saves(inv, 4, step=6)] == [6]


def test_copies_of_two_saves_of_one_step_do_not_make_it_complete():
    inv = two_nodes([(7, 7.0)])
    inv[2], inv[3] = [], []
    inv[0] = [seen(c.owner, c.step, "other.1", c.commit_time, c.where, c.own) if c.owner == 2 else c for c in inv[0]]
    assert complete_saves(inv, 4) == []


def test_copies_without_a_save_id_never_count():
    inv = [[seen(r, 3, "", 3.0, f"/n/rank{r}", own=True)] for r in range(2)]
    assert complete_saves(inv, 2) == []


def test_a_rank_that_sees_its_copy_on_its_own_disk_copies_it_home():
    # a node came back as other ranks: rank 0 now runs where rank 2's copies and the copies rank 2
    # held for rank 0 are; rank 2 runs on an empty node
    inv = [[seen(2, 5, "r.5", 5.0, "/n1/rank2"), seen(0, 5, "r.5", 5.0, "/n1/rank2/held-rank0")],
           [seen(1, 5, "r.5", 5.0, "/n0/rank1", own=True)], [], [seen(3, 5, "r.5", 5.0, "/n0/rank3", own=True)]]
    got = complete_saves(inv, 4)
    assert [(m.owner, m.sender, m.where) for m in got[0].moves] == [(0, 0, "/n1/rank2/held-rank0"),
                                                                   (2, 0, "/n1/rank2")]


def test_senders_are_balanced_by_bytes_over_the_ranks_that_hold_copies():
    # ranks 0 and 1 share a local_dir: each sees both held copies; they send one each
    shared = [seen(2, 5, "r.5", 5.0, "/n0/rank0/held-rank2", nbytes=1000),
              seen(3, 5, "r.5", 5.0, "/n0/rank1/held-rank3", nbytes=1000)]
    inv = [[seen(0, 5, "r.5", 5.0, "/n0/rank0", own=True)] + shared,
           [seen(1, 5, "r.5", 5.0, "/n0/rank1", own=True)] + shared, [], []]
    moves = complete_saves(inv, 4)[0].moves
    assert sorted(m.sender for m in moves) == [0, 1]


def test_newest_commit_first():
    inv = two_nodes([(9, 1.0), (3, 2.0)])  # step 3 was saved after step 9 (a roll back)
    assert [c.step for c in complete_saves(inv, 4)] == [3, 9]
