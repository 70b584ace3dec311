"""``MeshInfo``: the one description of where a sharded model runs.

The shard group (owners of the roles), the replicate group (HSDP; ``None`` without
replicas), the tensor-parallel group (``parallelize_module``'s; size 1 without TP), this
rank's place in each, and the device collectives run on. Built once
(``mesh_comm.mesh_info``: from a DeviceMesh, Lightning's ``(data_parallel,
tensor_parallel)`` mesh, or ``shard_size``) and passed down as one object. Reading it
needs no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm import ShardGroup, comm_device

__all__ = ["MeshInfo"]


@dataclass(frozen=True, eq=False)
class MeshInfo:
    """The groups of one sharded model and this rank's place in them."""

    shard: ShardGroup
    replicate_group: Optional[dist.ProcessGroup] = None
    replicate_rank: int = 0
    replicate_size: int = 1
    #: tensor parallelism: the TP group of this rank (None: no TP), its size and this rank's place
    tp_group: Optional[dist.ProcessGroup] = None
    tp_size: int = 1
    tp_rank: int = 0
    #: the 1-D DeviceMesh of the TP group (``device_mesh["tensor_parallel"]``), where DTensors must live
    tp_mesh: Any = None
    #: where this rank's collectives want their tensors (``collectives.comm_device``)
    device: torch.device = torch.device("cpu")
    #: the DeviceMesh it came from (what a LightningModule's ``configure_model`` sees), if any
    device_mesh: Any = None

    @classmethod
    def of(cls, shard_group: Optional[dist.ProcessGroup], replicate_group: Optional[dist.ProcessGroup] = None,
           device_mesh: Any = None, tp_mesh: Any = None) -> "MeshInfo":
        """From the groups (``None`` shard group: one rank, or the world when initialized) and
        the TP mesh (None: no tensor parallelism)."""
        if shard_group is None and dist.is_available() and dist.is_initialized():
            shard_group = dist.group.WORLD
        shard = ShardGroup(shard_group)
        rep_rank, rep_size = 0, 1
        if replicate_group is not None:
            rep_rank, rep_size = dist.get_rank(replicate_group), dist.get_world_size(replicate_group)
        tp_group, tp_size, tp_rank = None, 1, 0
        if tp_mesh is not None and tp_mesh.size() > 1:
            tp_group, tp_size, tp_rank = tp_mesh.get_group(), tp_mesh.size(), tp_mesh.get_local_rank()
        else:
            tp_mesh = None
        return cls(shard, replicate_group, rep_rank, rep_size, tp_group, tp_size, tp_rank, tp_mesh,
                   device=comm_device(shard.group), device_mesh=device_mesh)

    @property
    def shard_group(self) -> Optional[dist.ProcessGroup]:
        return self.shard.group

    @property
    def shard_rank(self) -> int:
        return self.shard.rank

    @property
    def shard_size(self) -> int:
        return self.shard.size

    @property
    def dp_size(self) -> int:
        """Ranks a gradient is averaged over: shard span times replicas."""
        return self.shard.size * self.replicate_size

    @property
    def tp(self) -> ShardGroup:
        """The TP group as a ``ShardGroup`` (one rank without TP)."""
        return ShardGroup(self.tp_group)

    @property
    def hsdp(self) -> bool:
        """More than one replica of each shard rank."""
        return self.replicate_size > 1
