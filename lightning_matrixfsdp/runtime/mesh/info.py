"""``MeshInfo``: the one description of where a sharded model runs.

The shard group (owners of the roles), the replicate group (HSDP; ``None`` without
replicas), the tensor-parallel group (``parallelize_module``'s; size 1 without TP), this
rank's place in each, and the device collectives run on. Built once
(``mesh_comm.mesh_info``: from a DeviceMesh, Lightning's ``(data_parallel,
tensor_parallel)`` mesh, or ``shard_size``) and passed down as one object. Reading it
needs no communication.

The sizes behind it are one :class:`~.dims.ParallelDims` record (``dims``), checked before any
group exists; the groups are looked up by axis name with :meth:`MeshInfo.group`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import ShardGroup, comm_device
from lightning_matrixfsdp.runtime.mesh.dims import ParallelDims

__all__ = ["ExpertGroups", "MeshInfo"]


@dataclass(frozen=True, eq=False)
class ExpertGroups:
    """This rank's expert-parallel group (the ranks that split the experts of a stack) and its
    expert-replica group (the ranks that hold the same experts), over the ``dp_size`` data-parallel
    ranks of its pipeline stage (the world without pipeline parallelism): the rank at place ``i``
    of its stage (``stage_ranks[i]``) is in the stage's expert-parallel group ``i // EP`` at place
    ``i % EP``, and in its replica group ``i % EP`` at place ``i // EP`` (``ParallelDims.groups``'s
    ``"ep"`` and ``"ep_replica"``)."""

    ep_group: Optional[dist.ProcessGroup]
    ep_rank: int
    ep_size: int
    replica_group: Optional[dist.ProcessGroup]
    replica_rank: int
    replica_size: int
    dp_size: int
    #: global ranks of this rank's stage, in data-parallel order (empty: the world, ``range(dp_size)``)
    stage_ranks: tuple[int, ...] = ()
    #: the group of ``stage_ranks`` (None: the world): where the experts' agreement and first values travel
    stage_group: Optional[dist.ProcessGroup] = None

    @property
    def stage(self) -> tuple[int, ...]:
        """Global ranks of this rank's stage (the data-parallel ranks the experts are split over)."""
        return self.stage_ranks or tuple(range(self.dp_size))

    @property
    def source(self) -> int:
        """The global rank whose experts every rank of the stage starts from (global rank 0 without
        pipeline parallelism, as DDP's first values)."""
        return self.stage[0]

    @property
    def ep_ranks(self) -> list[int]:
        """Global ranks of this rank's expert-parallel group."""
        first = self.replica_rank * self.ep_size
        return list(self.stage[first:first + self.ep_size])


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
    #: the sizes of every axis (``ParallelDims``); None where the mesh came from elsewhere (``matrix_shard``
    #: derives it from the groups' sizes)
    dims: Optional[ParallelDims] = None
    #: the whole run's ``(data_parallel, tensor_parallel)`` DeviceMesh the strategies expose as ``device_mesh``
    world_mesh: Any = None
    #: the expert-parallel groups (``expert_parallel_size > 1``), built from ``dims`` (``mesh_comm``)
    experts: Optional[ExpertGroups] = None

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

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        """This rank's process group of the axis ``name``: ``"shard"``, ``"replicate"``, ``"tp"``,
        ``"ep"``, ``"ep_replica"`` (None where the axis has one rank or was not built)."""
        experts = self.experts
        groups = {"shard": self.shard_group, "replicate": self.replicate_group, "tp": self.tp_group,
                  "ep": experts.ep_group if experts is not None else None,
                  "ep_replica": experts.replica_group if experts is not None else None}
        if name not in groups:
            raise KeyError(f"no process group {name!r}; known: {tuple(groups)}")
        return groups[name]

    @property
    def hsdp(self) -> bool:
        """More than one replica of each shard rank."""
        return self.replicate_size > 1
