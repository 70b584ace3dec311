"""``ParallelDims``: the one record of a run's parallel sizes, checked together when it is built.

Five axes split the world, outermost first::

    pipeline (pp)  x  replicate  x  shard  x  tensor (tp)        expert (ep) splits replicate x shard again

``pipeline``: the stages (size 1 until pipeline parallelism lands); ``replicate`` x ``shard``: the
data-parallel ranks of a stage (HSDP: ``shard_size`` consecutive ranks own the roles, the replicas
repeat them); ``tensor``: the ranks ``parallelize_module`` splits a matrix over (innermost, so a
TP group is consecutive ranks, inside a node); ``expert``: ``expert_parallel_size`` consecutive
data-parallel ranks split every experts module. Global rank of a place::

    rank = ((pp * replicate + r) * shard + s) * tensor + t        (pp outermost: rank // (world // pipeline))

A record is pure (no process group, no device): built where the world size is known (the
strategies, before the launch and again on every rank; ``matrix_shard``, from its mesh), it
refuses every size that cannot be built as a :class:`MatrixShardError` naming the option, its
value and where the world size came from. ``mesh/comm.py`` builds every process group from it,
by the rank lists :meth:`ParallelDims.groups` gives per axis name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_matrixfsdp.runtime.errors import MatrixShardError

__all__ = ["AXES", "ParallelDims"]

#: The mesh axes, outermost first, by the names the groups are looked up with.
AXES = ("pp", "replicate", "shard", "tp")


def _positive(value: Any, option: str, at: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MatrixShardError(f"{option}={value!r} must be a positive int{at}")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Every parallel size of one run (module docstring); checked at construction."""

    #: processes in the run
    world: int
    #: ranks of a shard group (``shard_size``; the data-parallel size without HSDP)
    shard: int
    #: HSDP replicas of each shard group
    replicate: int = 1
    #: tensor-parallel size
    tensor: int = 1
    #: expert-parallel size: consecutive data-parallel ranks that split each experts module
    expert: int = 1
    #: pipeline stages (1: no pipeline parallelism)
    pipeline: int = 1
    #: where the world size came from (``"devices=2 x num_nodes=1"``), for the messages
    where: str = ""

    def __post_init__(self) -> None:
        for name, option in (("world", "world size"), ("shard", "shard_size"), ("replicate", "replicas"),
                             ("tensor", "tensor_parallel_size"), ("expert", "expert_parallel_size"),
                             ("pipeline", "pipeline_parallel_size")):
            _positive(getattr(self, name), option, self._at)
        at = self._at
        if self.world % self.pipeline:
            raise MatrixShardError(f"pipeline_parallel_size={self.pipeline} must divide the world size "
                                   f"{self.world}{at}")
        stage = self.world // self.pipeline
        if stage % self.tensor:
            raise MatrixShardError(f"tensor_parallel_size={self.tensor} must divide the world size {self._stage}{at}")
        dp = stage // self.tensor
        beside = self._beside_of(self.world, self.pipeline, self.tensor, at)
        if dp % self.shard:
            raise MatrixShardError(f"shard_size={self.shard} must divide the data-parallel size {dp}{beside}; pick a "
                                   "divisor of it (or leave shard_size unset: one shard group over every rank)")
        if self.replicate * self.shard != dp:
            raise MatrixShardError(f"{self.replicate} replicas x shard_size={self.shard} must equal the data-parallel "
                                   f"size {dp}{beside}")
        if self.expert > 1 and self.tensor > 1:
            raise MatrixShardError(f"expert_parallel_size={self.expert} with tensor parallelism (tensor_parallel_size="
                                   f"{self.tensor}{at}) is not supported yet; use one of them")
        if dp % self.expert:
            raise MatrixShardError(f"expert_parallel_size={self.expert} must divide the data-parallel world size "
                                   f"{dp}{beside}; use a divisor of it, or a world whose size is a multiple of "
                                   f"{self.expert}")

    # ------------------------------------------------------------------ construction from the options
    @classmethod
    def from_options(cls, world: int, per_node: int = 1, *, data_parallel: Any = "auto", tensor_parallel: Any = 1,
                     shard_size: Optional[int] = None, expert_parallel: int = 1, pipeline_parallel: int = 1,
                     where: str = "") -> "ParallelDims":
        """The record of ``world`` processes (``per_node`` on each node) for the options' values
        (``"auto"`` TP: the processes of a node; ``"auto"`` DP: the rest of a pipeline stage)."""
        at = f" ({where})" if where else ""
        pp = _positive(pipeline_parallel, "pipeline_parallel_size", at)
        if world % pp:
            raise MatrixShardError(f"pipeline_parallel_size={pp} must divide the world size {world}{at}")
        stage = world // pp
        tp = per_node if tensor_parallel == "auto" else int(tensor_parallel)
        where_stage = str(world) if pp == 1 else f"{stage} of a pipeline stage (world {world} / {pp} stages)"
        if data_parallel == "auto":
            if stage % tp:
                raise MatrixShardError(f"tensor_parallel_size={tp} must divide the world size {where_stage}{at}")
            dp = stage // tp
        else:
            dp = int(data_parallel)
            if dp * tp != stage:
                raise MatrixShardError(f"data_parallel_size={dp} x tensor_parallel_size={tp} must equal the world "
                                       f"size {where_stage}{at}")
        shard = dp if shard_size is None else int(shard_size)
        if shard < 1 or dp % shard:  # named here: shard_size cannot make a whole number of replicas
            raise MatrixShardError(f"shard_size={shard} must divide the data-parallel size {dp}"
                                   f"{cls._beside_of(world, pp, tp, at)}; pick a divisor of it (or leave shard_size "
                                   "unset: one shard group over every rank)")
        return cls(world=world, shard=shard, replicate=dp // shard, tensor=tp, expert=int(expert_parallel),
                   pipeline=pp, where=where)

    # ------------------------------------------------------------------ sizes
    @property
    def data_parallel(self) -> int:
        """Ranks a batch is split over in one pipeline stage: replicas x shard span."""
        return self.replicate * self.shard

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (its data x tensor block)."""
        return self.world // self.pipeline

    @property
    def shape(self) -> dict[str, int]:
        """``{axis: size}`` of the mesh, outermost first (:data:`AXES`)."""
        return dict(zip(AXES, (self.pipeline, self.replicate, self.shard, self.tensor)))

    @property
    def active(self) -> tuple[str, ...]:
        """The axes above size 1, outermost first (the dimensions a mesh of this run needs)."""
        return tuple(name for name, size in self.shape.items() if size > 1)

    def layout(self) -> torch.Tensor:
        """Global ranks laid out ``(pp, replicate, shard, tp)``: ``layout()[p, r, s, t]`` is that place's rank."""
        return torch.arange(self.world).view(*self.shape.values())

    def groups(self, name: str) -> list[list[int]]:
        """Every group of the axis ``name`` as global rank lists, in creation order (every rank must
        create every group in the same order): the :data:`AXES`, ``"dp"`` (replicate x shard), ``"ep"``
        (``expert`` consecutive data-parallel ranks) and ``"ep_replica"`` (the ranks that hold the same
        experts)."""
        grid = self.layout()
        if name in AXES:
            axis = AXES.index(name)
            return grid.movedim(axis, -1).reshape(-1, grid.shape[axis]).tolist()
        dp = grid.permute(0, 3, 1, 2).reshape(self.pipeline * self.tensor, self.data_parallel)  # (stage column, dp)
        if name == "dp":
            return dp.tolist()
        blocks = dp.reshape(-1, self.data_parallel // self.expert, self.expert)
        if name == "ep":
            return blocks.reshape(-1, self.expert).tolist()
        if name == "ep_replica":
            return blocks.transpose(1, 2).reshape(-1, self.data_parallel // self.expert).tolist()
        raise KeyError(f"no parallel axis {name!r}; known: {(*AXES, 'dp', 'ep', 'ep_replica')}")

    def check_experts(self, num_experts: int, fqn: str) -> None:
        """Refuse an experts module whose ``num_experts`` the expert-parallel size cannot split evenly
        (known once the model is: ``matrix_shard`` asks for each experts module)."""
        if num_experts % self.expert:
            raise MatrixShardError(f"expert_parallel_size={self.expert} does not divide the {num_experts} experts of "
                                   f"{fqn!r}; each rank of an expert-parallel group must hold the same number")

    def describe(self) -> str:
        """One line for logs: every axis and its size."""
        return " x ".join(f"{k}={v}" for k, v in self.shape.items()) + f" (world {self.world}, ep={self.expert})"

    # ------------------------------------------------------------------ message parts
    @property
    def _at(self) -> str:
        return f" ({self.where})" if self.where else ""

    @property
    def _stage(self) -> str:
        return (str(self.world) if self.pipeline == 1
                else f"{self.stage_size} of a pipeline stage (world {self.world} / {self.pipeline} stages)")

    @staticmethod
    def _beside_of(world: int, pp: int, tp: int, at: str) -> str:
        """What the data-parallel size was derived from, for a message."""
        parts = ([f"pipeline_parallel_size {pp}"] if pp > 1 else []) + ([f"tensor_parallel_size {tp}"] if tp > 1
                                                                          else [])
        return f" (world {world}{at} / {' / '.join(parts)})" if parts else at
