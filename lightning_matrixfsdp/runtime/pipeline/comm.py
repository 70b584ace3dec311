"""Everything of the pipeline that calls torch.distributed: the ``(pp, dp)`` mesh, torch's
``PipelineStage`` and schedules (their point-to-point traffic), and the loss sent from the last stage.

Rank layout: the pipeline axis is outermost, ``global rank = pp_index * dp_world + dp_rank``
(a ``(pp, dp)`` or, with HSDP inside each stage, ``(pp, replicate, shard)`` DeviceMesh). Each
stage's data-parallel part (``dp`` or ``(replicate, shard)``) is the mesh ``matrix_shard`` shards
that stage over, so every matrix is owned whole inside its stage and the optimizer step is local.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.mesh.comm import expert_groups, mesh_info
from lightning_matrixfsdp.runtime.mesh.dims import ParallelDims
from lightning_matrixfsdp.runtime.mesh.info import MeshInfo
from lightning_matrixfsdp.runtime.options import check_timeout

__all__ = ["PipelineMesh", "SCHEDULES", "ScheduleKind", "broadcast_from_place", "make_schedule", "make_stage",
           "pipeline_mesh", "schedule_class", "stage_mesh_info"]


@dataclass(frozen=True)
class ScheduleKind:
    """One of torch's schedules: its class name, and how many stages a rank runs and in which order."""

    torch_name: str
    #: several stages per rank (torch's ``PipelineScheduleMulti``)
    multi: bool
    #: stage indices of a rank: "loop" (rank, rank + pp, ...) or "v" (rank, 2 pp - 1 - rank)
    order: str = "loop"
    #: the schedule splits each backward into an input part and a weight part (zero bubble)
    split_backward: bool = False


#: schedule name (the ``pipeline_schedule`` option) -> torch's class and its stage layout
SCHEDULES: dict[str, ScheduleKind] = {
    "GPipe": ScheduleKind("ScheduleGPipe", False),
    "1F1B": ScheduleKind("Schedule1F1B", False),
    "Interleaved1F1B": ScheduleKind("ScheduleInterleaved1F1B", True),
    "LoopedBFS": ScheduleKind("ScheduleLoopedBFS", True),
    "InterleavedZeroBubble": ScheduleKind("ScheduleInterleavedZeroBubble", True, split_backward=True),
    "ZBVZeroBubble": ScheduleKind("ScheduleZBVZeroBubble", True, "v", split_backward=True),
    "DualPipeV": ScheduleKind("ScheduleDualPipeV", True, "v", split_backward=True),
}


def schedule_class(name: str) -> type:
    """torch's schedule class for ``name``; refuses a name we do not know or this torch lacks."""
    import torch.distributed.pipelining as pipelining

    if name not in SCHEDULES:
        raise MatrixShardError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    cls = getattr(pipelining, SCHEDULES[name].torch_name, None)
    if cls is None:
        raise MatrixShardError(f"pipeline schedule {name!r} needs torch.distributed.pipelining."
                               f"{SCHEDULES[name].torch_name}, which torch {torch.__version__} does not have")
    return cls


@dataclass(frozen=True, eq=False)
class PipelineMesh:
    """This rank's place on the pipeline axis and the data-parallel mesh of its stage."""

    pp_size: int
    pp_rank: int
    #: the ranks that hold the same data-parallel place in every stage (what the schedule talks over)
    pp_group: Optional[dist.ProcessGroup]
    #: this stage's data-parallel mesh: 1-D ``(dp,)`` or 2-D ``(replicate, shard)`` (HSDP); None: one rank
    dp_mesh: Any
    #: the whole mesh
    device_mesh: Any = None
    #: the timeout its groups were created with (None: torch's default); each stage's expert groups take it too
    timeout: Optional[timedelta] = None

    @property
    def rank(self) -> int:
        """This rank's global rank."""
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of a stage (replicas x shard span)."""
        return self.dp_mesh.size() if self.dp_mesh is not None else 1

    @property
    def shard_size(self) -> int:
        """Ranks of a stage's shard group (the data-parallel size without HSDP)."""
        return self.dp_mesh.size(self.dp_mesh.ndim - 1) if self.dp_mesh is not None else 1

    def global_rank_of(self, pp_rank: int) -> int:
        """The global rank at pipeline place ``pp_rank`` with this rank's data-parallel place."""
        if self.pp_group is None:
            return 0
        return dist.get_global_rank(self.pp_group, pp_rank)


def pipeline_mesh(pp: int, shard_size: Optional[int] = None, device_type: str = "cpu",
                  timeout: Optional[timedelta] = None) -> PipelineMesh:
    """The ``(pp, dp)`` mesh of the world (``(pp, replicate, shard)`` with ``shard_size``: HSDP
    inside each stage), pipeline axis outermost. Collective: every rank calls it.

    ``timeout``: for every group of the mesh, the schedule's point-to-point traffic included (the
    strategies pass their ``timeout`` option). ``init_device_mesh`` gives its groups torch's default
    (30 minutes on gloo, 10 on NCCL), so a rank whose pipeline peer died or stalled would wait that
    long; with a value, the groups are created here with it and wrapped as a DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    timeout = check_timeout(timeout)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if pp < 1 or world % pp:
        raise MatrixShardError(f"pipeline_parallel_size={pp} must be a positive divisor of the world size {world}")
    dp = world // pp
    if shard_size is not None and (shard_size < 1 or dp % shard_size):
        raise MatrixShardError(f"shard_size={shard_size} must divide each stage's data-parallel size {dp} "
                               f"(world {world} / pipeline_parallel_size {pp})")
    if world == 1:
        return PipelineMesh(1, 0, None, None)
    hsdp = shard_size is not None and shard_size != dp
    shape, names = ((pp, dp // shard_size, shard_size), ("pp", "replicate", "shard")) if hsdp else \
        ((pp, dp), ("pp", "dp"))
    if timeout is None:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    else:
        mesh = _timed_mesh(device_type, shape, names, timeout)
    dp_mesh = mesh["replicate", "shard"] if hsdp else mesh["dp"]
    return PipelineMesh(pp, mesh["pp"].get_local_rank(), mesh["pp"].get_group(), dp_mesh, mesh, timeout)


def _timed_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...], timeout: timedelta) -> Any:
    """The DeviceMesh ``init_device_mesh`` would build, its groups created with ``timeout``: for
    each dimension, one group per line of ranks along it, every group on every rank in the same
    order (torch requires it)."""
    from torch.distributed.device_mesh import DeviceMesh

    layout = torch.arange(dist.get_world_size()).view(shape)
    rank = dist.get_rank()
    mine: list[dist.ProcessGroup] = []
    for dim in range(len(shape)):
        for ranks in layout.movedim(dim, -1).reshape(-1, shape[dim]).tolist():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine.append(group)
    return DeviceMesh.from_group(mine, device_type, mesh=layout, mesh_dim_names=names)


def stage_mesh_info(mesh: PipelineMesh, dims: ParallelDims) -> MeshInfo:
    """The ``MeshInfo`` each of this rank's stages is sharded over: its stage's data-parallel mesh,
    the run's record ``dims`` (pipeline axis included) and, with ``dims.expert > 1``, the
    expert-parallel groups of every stage (created on every rank in the same order, as torch
    requires, with the mesh's timeout; this rank keeps its stage's). Collective: every rank calls
    it once, with the same ``dims``."""
    import dataclasses

    experts = expert_groups(dims, mesh.timeout) if dims.expert > 1 else None
    return dataclasses.replace(mesh_info(mesh.dp_mesh), dims=dims, experts=experts)


def make_stage(module: nn.Module, index: int, num_stages: int, device: torch.device, mesh: PipelineMesh,
               input_meta: torch.Tensor, output_meta: torch.Tensor, parts: Any = None, v_order: bool = False) -> Any:
    """torch's ``PipelineStage`` for ``module`` with its input and output given (meta tensors of one
    micro-batch): no shape inference, which would run a forward of its own. ``parts``: a split
    backward's driver (split_backward.py): each backward part of a micro-batch runs inside
    ``parts.part(kind)``, kind ``"input"``, ``"weight"`` or ``"full"``. ``v_order``: a stage of a V
    schedule (two stages per rank), which must also run forward only (evaluation, prediction)."""
    from torch.distributed.pipelining import PipelineStage

    cls = PipelineStage if parts is None and not v_order else _our_stage_class()
    stage = cls(module, index, num_stages, device, input_args=input_meta, output_args=output_meta,
                group=mesh.pp_group)
    if parts is not None:
        stage.parts = parts
    return stage


@functools.lru_cache(maxsize=None)
def _our_stage_class() -> type:
    """torch's ``PipelineStage`` (its public methods, the same in torch 2.11 and 2.13) with: each
    backward part inside ``self.parts.part(kind)`` where ``parts`` is set; and, forward only, no
    input gradient handed between a rank's two stages of a V (torch's V schedules still run their
    backward actions without a loss, and its stage refuses to hand over gradients it has not got)."""
    from torch.distributed.pipelining import PipelineStage

    class OwnerShardedStage(PipelineStage):
        parts: Any = None

        def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> Any:
            if self.parts is None:
                return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                  last_backward=last_backward)
            whole = self.parts.input_part(bwd_chunk_id, full_backward)  # whole where a weight is used twice
            with self.parts.part("full" if whole else "input"):
                return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=whole,
                                                  last_backward=last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
            if self.parts is None:
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if self.parts.weight_done(bwd_chunk_id):
                return None
            with self.parts.part("weight"):
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

        def get_local_bwd_output(self, mb_index: int) -> Any:
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    return OwnerShardedStage


def make_schedule(name: str, stages: Sequence[Any], microbatches: int, loss_fn: Optional[Callable]) -> Any:
    """torch's schedule ``name`` over this rank's stages. ``scale_grads=False``: the loss function
    divides by the number of micro-batches itself (runner.py says why)."""
    cls = schedule_class(name)
    if SCHEDULES[name].multi:
        return cls(list(stages), n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def broadcast_from_place(value: Optional[torch.Tensor], mesh: PipelineMesh, place: int,
                         like: torch.Tensor) -> torch.Tensor:
    """``value`` (held by the rank at pipeline place ``place``) on every rank of this pipeline
    group, in ``like``'s shape and dtype (``value`` cast to it: every rank sends and receives alike)."""
    out = value.detach().to(like.dtype, copy=True) if value is not None else torch.empty_like(like)
    if mesh.pp_group is not None and mesh.pp_size > 1:
        dist.broadcast(out, src=mesh.global_rank_of(place), group=mesh.pp_group)
    return out

