"""Which parallel styles a pipeline composes with, checked before anything is built (pure).

Each stage is owner-sharded over its own data-parallel ranks (HSDP inside a stage included).
Expert parallelism composes per stage: the stage's data-parallel ranks split its experts
(``expert_parallel_size`` consecutive ones form an expert-parallel group, tokens move only
inside the stage), so ``expert_parallel_size`` must divide a stage's data-parallel size, which
the run's :class:`~lightning_matrixfsdp.runtime.mesh.dims.ParallelDims` record (with the
pipeline axis) refuses otherwise. Tensor parallelism inside a stage is refused for now: a stage
would need a ``(data_parallel, tensor_parallel)`` mesh of its own and a ``parallelize_module``
plan applied to a piece of the model, neither of which ``build_pipeline`` builds.
"""

from __future__ import annotations

from typing import Any

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.mesh.dims import ParallelDims

__all__ = ["check_no_tensor_parallel", "option_of", "stage_dims"]


def option_of(shard_options: dict[str, Any], name: str, default: Any) -> Any:
    """``name`` as given to ``build_pipeline``: a keyword, else the ``config``'s field, else ``default``."""
    if shard_options.get(name) is not None:
        return shard_options[name]
    config = shard_options.get("config")
    return getattr(config, name, default) if config is not None else default


def check_no_tensor_parallel(pp: int, shard_options: dict[str, Any]) -> None:
    """Refuse tensor parallelism with a pipeline (a keyword or the config's ``tensor_parallel_size``)."""
    tp = option_of(shard_options, "tensor_parallel_size", 1)
    if tp == "auto" or (isinstance(tp, int) and tp > 1):
        raise MatrixShardError(
            f"pipeline_parallel_size={pp} with tensor_parallel_size={tp}: pipeline_parallel_size with "
            "tensor_parallel_size is not supported yet (a stage is owner-sharded over its data-parallel ranks "
            "only); use tensor_parallel_size=1 with pipeline parallelism, or pipeline_parallel_size=1 with "
            "tensor parallelism")


def stage_dims(pp: int, dp: int, shard: int, expert_parallel: int) -> ParallelDims:
    """The run's record: ``pp`` stages of ``dp`` data-parallel ranks each, shard groups of ``shard``
    ranks (HSDP: ``dp / shard`` replicas), ``expert_parallel`` ranks splitting each stage's experts.
    Refuses ``expert_parallel_size`` not dividing a stage's data-parallel size, naming both."""
    return ParallelDims(world=pp * dp, shard=shard, replicate=dp // shard, expert=expert_parallel, pipeline=pp,
                        where=f"pipeline_parallel_size={pp} x {dp} data-parallel ranks per stage")
