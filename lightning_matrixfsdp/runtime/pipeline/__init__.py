"""Pipeline parallelism under owner sharding (issue 38): the model split into stages (split.py,
families.py), each stage owner-sharded over its own data-parallel ranks, driven by torch's
``torch.distributed.pipelining`` schedules (comm.py, runner.py). docs/pipeline-parallel.md."""

from lightning_matrixfsdp.runtime.pipeline.comm import SCHEDULES, PipelineMesh, pipeline_mesh
from lightning_matrixfsdp.runtime.pipeline.families import FAMILIES, StageModule, family_of
from lightning_matrixfsdp.runtime.pipeline.runner import PipelineRun, build_pipeline, stage_indices
from lightning_matrixfsdp.runtime.pipeline.split import StagePlan, StageSpan, plan_stages

__all__ = ["FAMILIES", "PipelineMesh", "PipelineRun", "SCHEDULES", "StageModule", "StagePlan", "StageSpan",
           "build_pipeline", "family_of", "pipeline_mesh", "plan_stages", "stage_indices"]
