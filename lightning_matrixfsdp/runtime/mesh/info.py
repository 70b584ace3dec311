"""``MeshInfo``: the one description of where a sharded model runs.

The shard group (owners of the roles), the replicate group (HSDP; ``None`` without
replicas), the tensor-parallel group (``parallelize_module``'s; size 1 without TP), this
rank's place in each, and the device collectives run on. Built once
(``mesh_comm.mesh_info``: from a DeviceMesh, Lightning's ``(data_parallel,
tensor_parallel)`` mesh, or ``shard_size``) and passed down as one object. Reading it
needs no communication.

:func:`parallel_sizes` checks the options' sizes against a world size before any process
exists (the strategies call it when Lightning knows the devices and nodes, before the launch,
and again on every rank before the process group): a size that cannot divide the world is
refused there, naming the option, instead of on every rank after the launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import ShardGroup, comm_device
from lightning_matrixfsdp.runtime.errors import MatrixShardError

__all__ = ["MeshInfo", "parallel_sizes"]


def parallel_sizes(world: int, per_node: int, *, data_parallel: Any = "auto", tensor_parallel: Any = 1,
                   shard_size: Optional[int] = None, expert_parallel: int = 1, where: str = "") -> tuple[int, int]:
    """(data-parallel size, tensor-parallel size) of ``world`` processes (``per_node`` on each node) for
    the options' values (``"auto"`` TP: the processes of a node; ``"auto"`` DP: the rest of the world).
    Refuses, as :class:`MatrixShardError` naming the option, every size that cannot divide what it
    splits: TP the world, DP x TP not the world, ``shard_size`` the data-parallel size, expert
    parallelism the data-parallel size or together with TP. ``where`` (e.g. "devices=2 x num_nodes=1")
    says where the world size came from. Pure: no process group."""
    at = f" ({where})" if where else ""
    tp = per_node if tensor_parallel == "auto" else int(tensor_parallel)
    if data_parallel == "auto":
        if world % tp:
            raise MatrixShardError(f"tensor_parallel_size={tp} must divide the world size {world}{at}")
        dp = world // tp
    else:
        dp = int(data_parallel)
        if dp * tp != world:
            raise MatrixShardError(f"data_parallel_size={dp} x tensor_parallel_size={tp} must equal the world size "
                                   f"{world}{at}")
    beside = f" (world {world}{at} / tensor_parallel_size {tp})" if tp > 1 else at
    if shard_size is not None and dp % shard_size:
        raise MatrixShardError(f"shard_size={shard_size} must divide the data-parallel size {dp}{beside}; pick a "
                               "divisor of it (or leave shard_size unset: one shard group over every rank)")
    if expert_parallel > 1 and tp > 1:
        raise MatrixShardError(f"expert_parallel_size={expert_parallel} with tensor parallelism (tensor_parallel_size="
                               f"{tp}{at}) is not supported yet; use one of them")
    if dp % expert_parallel:
        raise MatrixShardError(f"expert_parallel_size={expert_parallel} must divide the data-parallel world size "
                               f"{dp}{beside}; use a divisor of it, or a world whose size is a multiple of "
                               f"{expert_parallel}")
    return dp, tp


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
