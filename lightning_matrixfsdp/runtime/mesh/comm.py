"""Device meshes and their process groups: the communication that builds a ``MeshInfo``.

:func:`build_mesh` builds every group of a run from its :class:`ParallelDims` record (the
strategies call it once per process, in ``setup_environment``): the ``(data_parallel,
tensor_parallel)`` DeviceMesh the strategies expose, the shard and replicate groups inside its
data-parallel part, the tensor-parallel group, and with ``expert_parallel_size > 1`` the
expert-parallel groups (:func:`expert_groups`, also reached by ``matrix_shard`` when it was given
a mesh of another origin). ``hsdp_mesh`` creates the ``(replicate, shard)`` groups;
:func:`mesh_info` describes the groups of a given mesh (a DeviceMesh of ours, Lightning's
``(data_parallel, tensor_parallel)`` mesh, or one built from ``shard_size``) as one
:class:`MeshInfo`. Every process-group creation of the package is here.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import comm_device
from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.mesh.dims import ParallelDims
from lightning_matrixfsdp.runtime.mesh.info import ExpertGroups, MeshInfo
from lightning_matrixfsdp.runtime.options import check_timeout

__all__ = ["build_hsdp_mesh", "build_mesh", "dims_of", "expert_groups", "hsdp_mesh", "is_tp_mesh", "mesh_info",
           "shard_and_replicate_groups", "shard_mesh"]

#: Lightning's ``ModelParallelStrategy`` mesh dimensions.
DATA_PARALLEL, TENSOR_PARALLEL = "data_parallel", "tensor_parallel"


def hsdp_mesh(shard_size: int, device: Optional[torch.device] = None, timeout: Optional[timedelta] = None) -> Any:
    """A ``(replicate, shard)`` DeviceMesh with shard groups of ``shard_size`` consecutive ranks
    (HSDP), on ``device``'s type (default: where communication runs).

    ``timeout``: for the collectives of its groups. ``init_device_mesh`` gives its groups
    torch's default timeout, not the one the world group was created with, so a hang in
    the shard or replicate group would outlast the user's ``timeout``; with a value, the
    groups are created here with it (``new_group`` on every rank for every group, as
    torch requires) and wrapped as a DeviceMesh.
    """
    return build_hsdp_mesh(shard_size, device, check_timeout(timeout))  # a wrong type fails alone, at once


def build_hsdp_mesh(shard_size: int, device: Optional[torch.device], timeout: Optional[timedelta]) -> Any:
    """``hsdp_mesh`` for a ``timeout`` checked already (the strategies' option)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not dist.is_initialized():
        raise MatrixShardError("shard_size needs an initialized process group")
    world = dist.get_world_size()
    if shard_size < 1 or world % shard_size:
        raise MatrixShardError(f"shard_size={shard_size} must be a positive divisor of the world size {world}")
    device_type = torch.device(device).type if device is not None else comm_device().type
    names = ("replicate", "shard")
    if timeout is None:
        return init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=names)
    layout = torch.arange(world).view(world // shard_size, shard_size)
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for name, rows in (("shard", layout), ("replicate", layout.T)):
        for ranks in rows.tolist():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[name] = group
    return DeviceMesh.from_group([mine["replicate"], mine["shard"]], device_type, mesh=layout, mesh_dim_names=names)


def shard_and_replicate_groups(mesh: Any) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """(shard group, replicate group) from a DeviceMesh or None."""
    if mesh is None:
        return (dist.group.WORLD if dist.is_initialized() else None), None
    names = tuple(mesh.mesh_dim_names or ())
    if TENSOR_PARALLEL in names:  # Lightning's (data_parallel, tensor_parallel) mesh: shard over its DP part
        mesh = mesh[DATA_PARALLEL]
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise MatrixShardError(f"mesh must be 1-D (shard) or 2-D (replicate, shard); got {mesh.ndim}-D")


def is_tp_mesh(mesh: Any) -> bool:
    """Whether ``mesh`` is Lightning's mesh with a tensor-parallel dimension above 1 (no communication)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return mesh is not None and TENSOR_PARALLEL in names and mesh[TENSOR_PARALLEL].size() > 1


def warn_if_tp_spans_nodes(tp_ranks: list[int]) -> None:
    """Warn when the launcher says (``LOCAL_WORLD_SIZE``) that the TP group spans nodes: its
    traffic (every layer's activations, the optimizer's fragments) then crosses the slow links."""
    lws = os.environ.get("LOCAL_WORLD_SIZE", "")
    if lws.isdigit() and int(lws) > 0 and len({r // int(lws) for r in tp_ranks}) > 1:
        warnings.warn(f"the tensor-parallel group {tp_ranks} spans nodes (LOCAL_WORLD_SIZE={lws}); tensor "
                      "parallelism belongs inside a node: use tensor_parallel_size <= the processes per node",
                      UserWarning, stacklevel=3)


def _tp_mesh_info(mesh: Any, shard_size: Optional[int], timeout: Optional[timedelta]) -> MeshInfo:
    """Lightning's ``(data_parallel, tensor_parallel)`` mesh with T > 1: the shard group is this
    rank's data-parallel column, or with ``shard_size=W`` a run of ``W`` consecutive members of it
    (the replicate group links the runs); the TP group is the mesh's own."""
    names = tuple(mesh.mesh_dim_names)
    if names != (DATA_PARALLEL, TENSOR_PARALLEL):
        raise MatrixShardError(f"a tensor-parallel mesh must have the dimensions {(DATA_PARALLEL, TENSOR_PARALLEL)} "
                               f"in that order (Lightning's); got {names}")
    warn_if_tp_spans_nodes(mesh[TENSOR_PARALLEL].mesh.flatten().tolist())
    dp = mesh[DATA_PARALLEL]
    d = dp.size()
    w = shard_size or d
    if w < 1 or d % w:
        raise MatrixShardError(f"shard_size={shard_size} must be a positive divisor of the data-parallel size {d} "
                               f"(world {mesh.size()} = data_parallel {d} x tensor_parallel "
                               f"{mesh[TENSOR_PARALLEL].size()})")
    if w == d:
        return MeshInfo.of(dp.get_group(), None, device_mesh=mesh, tp_mesh=mesh[TENSOR_PARALLEL])
    layout = mesh.mesh  # (D, T) global ranks
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for t in range(layout.shape[1]):  # every rank creates every group, in the same order (torch requires it)
        grid = layout[:, t].reshape(d // w, w)
        for name, rows in (("shard", grid), ("replicate", grid.T)):
            for ranks in rows.tolist():
                group = dist.new_group(ranks, timeout=timeout) if timeout is not None else dist.new_group(ranks)
                if rank in ranks:
                    mine[name] = group
    return MeshInfo.of(mine["shard"], mine["replicate"], device_mesh=mesh, tp_mesh=mesh[TENSOR_PARALLEL])


def mesh_info(mesh: Any = None, shard_size: Optional[int] = None, device: Optional[torch.device] = None,
              timeout: Optional[timedelta] = None) -> MeshInfo:
    """The :class:`MeshInfo` of ``mesh`` (a DeviceMesh, or None: the world), or of the HSDP mesh
    of ``shard_size`` built here (``device``'s type, groups with ``timeout``). A shard size equal
    to the world of a Lightning mesh keeps that mesh's data-parallel dimension. A Lightning mesh
    with a tensor-parallel dimension above 1: sharded over its data-parallel part (HSDP inside it
    with ``shard_size``), the TP group beside."""
    if is_tp_mesh(mesh):
        return _tp_mesh_info(mesh, shard_size, timeout)
    if shard_size is not None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        lightning = mesh is not None and DATA_PARALLEL in tuple(mesh.mesh_dim_names or ())
        if not (lightning and shard_size == world):
            mesh = build_hsdp_mesh(shard_size, device, timeout)
    if mesh is not None and DATA_PARALLEL in tuple(mesh.mesh_dim_names or ()):
        mesh = mesh[DATA_PARALLEL]  # what configure_model sees as self.device_mesh
    shard_group, replicate_group = shard_and_replicate_groups(mesh)
    return MeshInfo.of(shard_group, replicate_group, device_mesh=mesh)


def shard_mesh(group: dist.ProcessGroup, ranks: list[int]) -> Any:
    """The shard group (global ``ranks``, in shard-rank order) as a 1-D DeviceMesh ``("shard",)``: a
    split expert stack's block is then a ``Shard(0)`` DTensor chunk of the whole stack, which is how
    checkpoints hand it to DCP (wrapping the existing group: nothing is created)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, comm_device(group).type, mesh=torch.tensor(ranks), mesh_dim_names=("shard",))


# ---------------------------------------------------------------------- from the record
def build_mesh(dims: ParallelDims, device: Optional[torch.device] = None,
               timeout: Optional[timedelta] = None) -> MeshInfo:
    """Every process group of a run of ``dims`` (on ``device``'s type; HSDP groups with ``timeout``),
    as one :class:`MeshInfo` carrying the record: the ``(data_parallel, tensor_parallel)`` DeviceMesh
    (what Lightning's ``ModelParallelStrategy`` would build for these sizes, built here from the
    record instead), the shard/replicate/TP groups of :func:`mesh_info`, and the expert-parallel
    groups. Collective: every rank calls it with the same record."""
    from torch.distributed.device_mesh import init_device_mesh

    if dims.pipeline > 1:
        raise MatrixShardError(f"pipeline_parallel_size={dims.pipeline}: pipeline stages are not built yet")
    device_type = torch.device(device).type if device is not None else comm_device().type
    world_mesh = init_device_mesh(device_type, (dims.data_parallel, dims.tensor),
                                  mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
    info = mesh_info(world_mesh, dims.shard if dims.replicate > 1 else None, device, timeout)
    experts = expert_groups(dims, timeout) if dims.expert > 1 else None
    return dataclasses.replace(info, dims=dims, world_mesh=world_mesh, experts=experts)


def dims_of(mesh: MeshInfo, expert_parallel: int = 1) -> ParallelDims:
    """The record of a mesh built elsewhere (a DeviceMesh or ``MeshInfo`` given to ``matrix_shard``):
    its groups' sizes with ``expert_parallel``, checked as the strategies' are (no communication)."""
    if mesh.dims is not None and mesh.dims.expert == expert_parallel:
        return mesh.dims
    return ParallelDims(world=mesh.dp_size * mesh.tp_size, shard=mesh.shard_size, replicate=mesh.replicate_size,
                        tensor=mesh.tp_size, expert=expert_parallel)


def expert_groups(dims: ParallelDims, timeout: Optional[timedelta] = None) -> ExpertGroups:
    """Create every expert-parallel and expert-replica group of ``dims`` (``ParallelDims.groups``:
    ``"ep"``, then ``"ep_replica"`` when there is more than one copy of each expert, then with
    pipeline parallelism ``"dp"``, each stage's data-parallel ranks; every rank creates every group
    of every stage in the same order, as torch requires) and return this rank's. The groups stay
    inside a pipeline stage: each stage splits its own experts over its own ranks.

    ``timeout``: for the collectives of these groups (the strategies' option; None: torch's
    default, 30 minutes on gloo), so a token exchange whose peer stalled or died ends as soon as
    the other groups' collectives would."""
    rank = dist.get_rank()
    mine: dict[str, Optional[dist.ProcessGroup]] = {"ep": None, "ep_replica": None, "dp": None}
    names = ("ep", "ep_replica") if dims.data_parallel > dims.expert else ("ep",)
    for name in names + (("dp",) if dims.pipeline > 1 else ()):
        for ranks in dims.groups(name):
            group = dist.new_group(ranks, timeout=timeout) if timeout is not None else dist.new_group(ranks)
            if rank in ranks:
                mine[name] = group
    stage = next(ranks for ranks in dims.groups("dp") if rank in ranks)
    place, ep = stage.index(rank), dims.expert  # this rank's place among its stage's data-parallel ranks
    return ExpertGroups(mine["ep"], place % ep, ep, mine["ep_replica"], place // ep, dims.data_parallel // ep,
                        dims.data_parallel, tuple(stage) if dims.pipeline > 1 else (), mine["dp"])
