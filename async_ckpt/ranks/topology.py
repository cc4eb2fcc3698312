"""Where the ranks are and who holds whose local copies (``local_replicas=``): :func:`peer_topology`.

The ranks are grouped into nodes (torchrun's ``GROUP_RANK`` when every rank has it, else the
host name), nodes ordered by their lowest rank. The ``i``-th rank of node ``n`` sends each of
its local copies to the ``i``-th rank (modulo that node's size) of each of the next
``local_replicas - 1`` nodes, a ring over the nodes (:func:`ring`): every local copy is on
``local_replicas`` nodes, so losing fewer nodes than that loses no rank's copy. What is sent,
when, and where it is kept: :mod:`async_ckpt.jobs.peers`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import InvalidArgumentError, warn_user
from ..options import PeerOptions
from .exchange import Exchange, checkpoint_group


@dataclass(frozen=True)
class Topology:
    """Where the ranks are and who holds whose copies.

    Attributes:
        rank: this rank (in the manager's group).
        world_size: the ranks of the manager's group.
        nodes: the ranks of each node, nodes ordered by their lowest rank.
        replicas: nodes that hold each local copy (the owner's included): ``local_replicas``,
            or the number of nodes when there are fewer.
        dests: the ranks this rank sends its local copies to.
        sources: the ranks whose local copies this rank holds.
        group: the gloo group of the replication thread and of restores' transfers.
    """

    rank: int
    world_size: int
    nodes: Tuple[Tuple[int, ...], ...]
    replicas: int
    dests: Tuple[int, ...]
    sources: Tuple[int, ...]
    group: Any


def ring(nodes: Sequence[Sequence[int]], replicas: int) -> Dict[int, List[int]]:
    """Who sends its local copies to whom: the ``i``-th rank of node ``n`` to the ``i``-th rank
    (modulo the node's size) of nodes ``n+1 .. n+replicas-1`` (modulo the number of nodes).

    Args:
        nodes: the ranks of each node, in node order.
        replicas: nodes holding each copy, the owner's included.

    Returns:
        rank -> the ranks it sends to.
    """
    n = len(nodes)
    out: Dict[int, List[int]] = {}
    for ni, node in enumerate(nodes):
        for i, r in enumerate(node):
            dests = []
            for k in range(1, min(replicas, n)):
                other = nodes[(ni + k) % n]
                dests.append(other[i % len(other)])
            out[r] = dests
    return out


def node_of() -> Tuple[Optional[int], str]:
    """This process's node: torchrun's ``GROUP_RANK`` (None when not set) and the host name."""
    raw = os.environ.get("GROUP_RANK")
    try:
        group_rank = int(raw) if raw is not None else None
    except ValueError:
        group_rank = None
    return group_rank, socket.gethostname()


def peer_topology(options: PeerOptions, exchange: Exchange) -> Optional[Topology]:
    """The peers of this rank, and the replication group (collective, on every rank of the
    manager's group, at construction, before anything that may fail on one rank only).

    Args:
        options: the peer copies' options (``local_replicas``, ``process_group``, ``collective_timeout_s``).
        exchange: the manager's exchange.

    Returns:
        The topology; None when ``local_replicas`` is 1, or the ranks are on one node (warned).

    Raises:
        InvalidArgumentError: ``local_replicas`` > 1 in a single process, or the ranks were
            given different ``local_replicas`` (on every rank).
    """
    want = options.local_replicas
    if want <= 1:
        return None
    if exchange.world_size <= 1:
        raise InvalidArgumentError(f"local_replicas={want} keeps copies of each rank's local copy on other nodes: it "
                                   f"needs several ranks (torch.distributed initialised with more than one process); "
                                   f"pass local_replicas=1 in a single process")
    gathered = exchange.gather_objects((want, *node_of()))
    asked = sorted({g[0] for g in gathered})
    if len(asked) > 1:
        raise InvalidArgumentError(f"the ranks were given different local_replicas ({asked}): pass the same value on "
                                   f"every rank")
    by_group = all(g[1] is not None for g in gathered)
    keys = [g[1] if by_group else g[2] for g in gathered]
    members: Dict[Any, List[int]] = {}
    for r, k in enumerate(keys):
        members.setdefault(k, []).append(r)
    nodes = tuple(tuple(m) for m in sorted(members.values(), key=lambda m: m[0]))
    replicas = min(want, len(nodes))
    if replicas <= 1:
        if exchange.is_primary:
            warn_user(f"local_replicas={want}: all {exchange.world_size} ranks are on one node "
                      f"({'GROUP_RANK' if by_group else 'host'} {keys[0]}): no peer copies are kept (a lost node "
                      f"restores from the checkpoint path)")
        return None
    if replicas < want and exchange.is_primary:
        warn_user(f"local_replicas={want}: the ranks are on {len(nodes)} nodes: each local copy is kept on "
                  f"{replicas} nodes")
    group = checkpoint_group(options.process_group, options.collective_timeout_s)
    sends = ring(nodes, replicas)
    rank = exchange.rank
    return Topology(rank, exchange.world_size, nodes, replicas, tuple(sends[rank]),
                    tuple(sorted(r for r, ds in sends.items() if rank in ds)), group)

