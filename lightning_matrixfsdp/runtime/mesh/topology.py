"""``collective="auto"`` and ``replica_split="auto"``: the choice from the topology (pure).

Given what every rank reported about itself (:class:`RankPlace`: host name, and the
launcher's ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` where set), :func:`node_ids` says which
node each global rank is on, or refuses a report that contradicts itself. :func:`choose`
then picks the options from the shard group's ranks, their nodes and the replicate size.
Nothing here communicates (``topology_comm`` gathers the reports), so every rank that
holds the same reports makes the same choice.

The rule (figures: docs/benchmarks.md, "auto against the explicit choices"):

- ``collective``: ``p2p`` when the shard group lies inside one node (the owners' sends go
  over the intra-node links, where p2p is within 1.3% of broadcast in every predicted
  cell); ``broadcast`` when it spans nodes (p2p's busiest owner then sends one copy per
  rank over the inter-node fabric: 2.5-40x slower predicted; NCCL pipelines a broadcast).
- ``replica_split``: on under HSDP (more than one replica), off otherwise (where it is a
  no-op). The predictor puts it at or ahead of plain HSDP in every cell with replicas and
  it lowers the peak memory (each role's optimizer state held once), so the rule needs no
  model or cluster facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from lightning_matrixfsdp.runtime.errors import MatrixShardError

__all__ = ["AUTO", "Choice", "RankPlace", "TopologyError", "choose", "choose_collective", "choose_replica_split",
           "node_ids"]

AUTO = "auto"


class TopologyError(MatrixShardError):
    """The ranks' reports of where they run contradict each other (raised on every rank)."""


@dataclass(frozen=True)
class RankPlace:
    """What one rank says about where it runs (``LOCAL_WORLD_SIZE``/``GROUP_RANK``: None when unset)."""

    rank: int
    host: str
    local_world_size: Optional[int] = None
    group_rank: Optional[int] = None
    world: int = 1


@dataclass(frozen=True)
class Choice:
    """The resolved options and why (one line each, printed with the plan)."""

    collective: str
    replica_split: bool
    collective_reason: str
    replica_split_reason: str


def node_ids(places: Sequence[RankPlace]) -> dict[int, int]:
    """Global rank -> node id. From ``LOCAL_WORLD_SIZE`` when every rank has it (node =
    rank // local world size, so one machine can stand for several nodes), else from the
    host names (in order of first appearance). Raises :class:`TopologyError` when the
    reports disagree: some ranks with the variable and some without, different values, a
    ``GROUP_RANK`` other than rank // local world size, a local world size that does not
    divide the world, or one launcher node on two hosts."""
    places = sorted(places, key=lambda p: p.rank)
    with_lws = [p for p in places if p.local_world_size is not None]
    if with_lws and len(with_lws) != len(places):
        missing = [p.rank for p in places if p.local_world_size is None]
        raise TopologyError(f"inconsistent topology: LOCAL_WORLD_SIZE is set on some ranks and not on ranks {missing}; "
                            "launch every rank the same way (torchrun sets it on all), or unset it everywhere")
    if not with_lws:
        order: dict[str, int] = {}
        return {p.rank: order.setdefault(p.host, len(order)) for p in places}
    sizes = sorted({p.local_world_size for p in places})  # type: ignore[type-var]
    if len(sizes) > 1 or sizes[0] < 1:
        raise TopologyError(f"inconsistent topology: LOCAL_WORLD_SIZE differs between ranks ({sizes}); nodes of "
                            "different sizes cannot be told apart from it: set it to the same value on every rank")
    lws = sizes[0]
    if any(p.world % lws for p in places):
        raise TopologyError(f"inconsistent topology: LOCAL_WORLD_SIZE={lws} does not divide the world size "
                            f"{places[0].world}; every node must run LOCAL_WORLD_SIZE ranks")
    nodes = {p.rank: p.rank // lws for p in places}
    hosts: dict[int, str] = {}
    for p in places:
        if p.group_rank is not None and p.group_rank != nodes[p.rank]:
            raise TopologyError(f"inconsistent topology: rank {p.rank} has GROUP_RANK={p.group_rank} but "
                                f"LOCAL_WORLD_SIZE={lws} puts it on node {nodes[p.rank]}")
        if hosts.setdefault(nodes[p.rank], p.host) != p.host:
            raise TopologyError(f"inconsistent topology: LOCAL_WORLD_SIZE={lws} puts rank {p.rank} (host {p.host!r}) "
                                f"on node {nodes[p.rank]} with host {hosts[nodes[p.rank]]!r}; one node cannot span "
                                "two hosts")
    return nodes


def choose_collective(shard_ranks: Sequence[int], nodes: Mapping[int, int]) -> tuple[str, str]:
    """``(collective, reason)`` for a shard group of ``shard_ranks`` (global ranks)."""
    if len(shard_ranks) <= 1:
        return "p2p", "auto: a shard group of one rank (no owner traffic)"
    spanned = sorted({nodes[r] for r in shard_ranks})
    if len(spanned) == 1:
        return "p2p", f"auto: the shard group ({len(shard_ranks)} ranks) lies inside node {spanned[0]}"
    return "broadcast", (f"auto: the shard group ({len(shard_ranks)} ranks) spans {len(spanned)} nodes; "
                         "broadcast pipelines what p2p would send once per rank across them")


def choose_replica_split(replicate_size: int) -> tuple[bool, str]:
    """``(replica_split, reason)`` for ``replicate_size`` replicas."""
    if replicate_size > 1:
        return True, f"auto: HSDP with {replicate_size} replicas (predicted at or ahead of plain HSDP, less memory)"
    return False, "auto: no replicas (nothing to split)"


def choose(collective: str, replica_split: Union[bool, str], shard_ranks: Sequence[int],
           nodes: Optional[Mapping[int, int]], replicate_size: int) -> Choice:
    """Resolve the two options (explicit values pass through unchanged). ``nodes`` is
    needed only when ``collective`` is ``"auto"`` and the shard group has several ranks."""
    if collective == AUTO:
        if len(shard_ranks) > 1 and nodes is None:
            raise ValueError("collective='auto' over several ranks needs their nodes")
        coll, coll_why = choose_collective(shard_ranks, nodes or {})
    else:
        coll, coll_why = collective, "explicit"
    if replica_split == AUTO:
        split, split_why = choose_replica_split(replicate_size)
    else:
        split, split_why = bool(replica_split), "explicit"
    return Choice(coll, split, coll_why, split_why)
