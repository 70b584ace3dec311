"""Expert parallelism's communication outside the token dispatch (``experts/dispatch_comm.py`` moves tokens).

The groups themselves (``ExpertGroups``: the expert-parallel groups of ``EP`` consecutive
data-parallel ranks, and the expert-replica groups linking the ranks that hold the same
experts) are built with every other group from the run's ``ParallelDims`` record
(``mesh/comm.py``); here: this rank's group as a DeviceMesh (:func:`expert_mesh`), every rank's slice of global rank 0's expert stacks when sharding
(:func:`rank0_slices`), and the gradient sum over the expert replicas at the end of
backward (:func:`start_replica_sum`). The optimizer step uses none of them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, PendingOp, comm_device, nbytes
from lightning_matrixfsdp.runtime.mesh.info import ExpertGroups

__all__ = ["ExpertGroups", "expert_mesh", "rank0_slices", "start_replica_sum"]


def expert_mesh(groups: ExpertGroups) -> object:
    """This rank's expert-parallel group as a 1-D DeviceMesh ``("expert",)``: a local expert slice
    is then a ``Shard(0)`` DTensor chunk of its whole stack, which is how checkpoints hand it to DCP
    (wrapping the existing group: nothing is created)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(groups.ep_group, comm_device(groups.ep_group).type,
                                 mesh=torch.tensor(groups.ep_ranks), mesh_dim_names=("expert",))


def rank0_slices(full: Optional[torch.Tensor], shape: Sequence[int], dtype: torch.dtype, groups: ExpertGroups,
                 stats: CommStats) -> torch.Tensor:
    """This rank's experts of the stage's first rank's stack ``full`` (``[E, ...]``; only
    ``groups.source``'s is read: global rank 0 without pipeline parallelism): one scatter over the
    stage (the world without pipeline parallelism), the rank at stage place ``g`` receiving experts
    ``[(g % EP) * E/EP, (g % EP + 1) * E/EP)``, as DDP gives every rank rank 0's parameters when it
    wraps a model (counted under ``init_sync``). Returns the slice on the communication device."""
    device = comm_device()
    count = shape[0] // groups.ep_size
    out = torch.empty((count, *shape[1:]), dtype=dtype, device=device)
    source = dist.get_rank() == groups.source
    pieces = None
    if source:
        src = full.detach().to(device)
        pieces = [src[(g % groups.ep_size) * count:(g % groups.ep_size + 1) * count].contiguous()
                  for g in range(len(groups.stage))]
    dist.scatter(out, pieces, src=groups.source, group=groups.stage_group)
    sent = sum(nbytes(p) for g, p in enumerate(pieces) if g != 0) if pieces is not None else 0
    stats.add("init_sync", sent, 0 if source else nbytes(out))
    return out


def start_replica_sum(grads: Sequence[torch.Tensor], groups: ExpertGroups, stats: CommStats) -> PendingOp:
    """Sum each expert gradient in place over the ranks holding the same experts (one
    all-reduce per tensor, all in flight at once; nothing without expert replicas). Counted
    under ``experts``: sent = received = the local expert gradient bytes."""
    if groups.replica_size == 1 or not grads:
        return PendingOp()
    works = [dist.all_reduce(g, op=dist.ReduceOp.SUM, group=groups.replica_group, async_op=True) for g in grads]
    size = sum(nbytes(g) for g in grads)
    stats.add("experts", size, size, calls=len(grads))
    return PendingOp(works=works, blocking=grads[0].device.type == "cpu",
                     what="the expert gradients' sum over the expert replicas")
