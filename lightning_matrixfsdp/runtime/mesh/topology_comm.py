"""Where the ranks run, gathered once for the ``"auto"`` options (``topology``'s choice).

:func:`resolve` runs in ``matrix_shard`` after the mesh is known and before any other
collective of the runtime. Only ``collective="auto"`` over a shard group of several ranks
communicates: one object gather of :class:`~topology.RankPlace` over the shard group (every
rank then chooses from the same reports), then one over the replicate group, so that a
shard group whose reports contradict themselves, or replicas whose shard groups chose
differently (nodes of different sizes), fail on every rank with the same message instead
of leaving the others waiting in a later collective.

``LOCAL_WORLD_SIZE`` (torchrun sets it) decides the nodes when every rank has it; setting
it by hand simulates node boundaries on one machine (the tests use 4 processes with 2).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Optional

import torch.distributed as dist

from lightning_matrixfsdp.runtime.mesh.info import MeshInfo
from lightning_matrixfsdp.runtime.comm.small import gather_objects
from lightning_matrixfsdp.runtime.mesh.topology import AUTO, Choice, RankPlace, TopologyError, choose, node_ids

__all__ = ["local_place", "resolve"]

log = logging.getLogger(__name__)


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        raise TopologyError(f"{name}={value!r} is not an integer") from None


def local_place() -> RankPlace:
    """This rank's report: global rank, host name, the launcher's local world size and node rank, world size."""
    live = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if live else (0, 1)
    return RankPlace(rank, socket.gethostname(), _env_int("LOCAL_WORLD_SIZE"), _env_int("GROUP_RANK"), world)


def _shard_choice(collective: str, replica_split: object, mesh: MeshInfo) -> Choice:
    ranks = list(mesh.shard.global_ranks)
    nodes = None
    if collective == AUTO and len(ranks) > 1:
        try:
            mine: object = local_place()
        except TopologyError as e:  # gathered, not raised alone: the others would wait in the gather
            mine = str(e)
        places = gather_objects(mine, mesh.shard_group)
        bad = next((p for p in places if isinstance(p, str)), None)
        if bad is not None:
            raise TopologyError(bad)
        nodes = node_ids(places)  # type: ignore[arg-type]
    return choose(collective, replica_split, ranks, nodes, mesh.replicate_size)  # type: ignore[arg-type]


def resolve(collective: str, replica_split: object, mesh: MeshInfo) -> Choice:
    """The options ``"auto"`` resolved alike on every rank of the mesh (explicit values unchanged)."""
    if collective != AUTO and replica_split != AUTO:
        return choose(collective, replica_split, list(mesh.shard.global_ranks), None, mesh.replicate_size)  # type: ignore[arg-type]
    try:
        outcome: object = _shard_choice(collective, replica_split, mesh)
    except TopologyError as e:  # every rank of this shard group has it; tell the replicas before raising
        outcome = str(e)
    if collective == AUTO and mesh.replicate_group is not None:
        others = gather_objects(outcome, mesh.replicate_group)
        failed = next((o for o in others if isinstance(o, str)), None)
        if failed is not None:
            outcome = failed
        elif len({o.collective for o in others}) > 1:  # type: ignore[union-attr]
            picks = ", ".join(f"replica {k}: {o.collective}" for k, o in enumerate(others))  # type: ignore[union-attr]
            outcome = (f"inconsistent topology: the shard groups of different replicas chose different collectives "
                       f"({picks}); nodes of different sizes put some shard groups across nodes and others inside "
                       "one. Pass collective= explicitly, or use a shard_size that divides every node's size")
    if isinstance(outcome, str):
        raise TopologyError(outcome)
    log.info("MatrixFSDP: collective=%s (%s); replica_split=%s (%s)", outcome.collective, outcome.collective_reason,
             outcome.replica_split, outcome.replica_split_reason)
    return outcome
