"""The owner-sharded ZeRO-3 runtime: its public API.

``matrix_shard`` (shard.py) shards a model with a ``MatrixFSDPConfig`` (config.py);
``hsdp_mesh`` (mesh/comm.py) builds the ``(replicate, shard)`` mesh for HSDP, ``MeshInfo``
(mesh/info.py) describes the groups; ``parallelize_experts`` (experts/seams.py) is the parallel style of a
user's own experts module under ``expert_parallel_size``; the queries (queries.py) read a sharded model's
plan and traffic and switch gradient synchronization; ``full_model`` (views/full.py) gathers
the whole model on one rank for a while; a plain ``state_dict()`` that would be partial is
refused (views/state_dict.py), ``local_state_dict`` gives this rank's part on purpose.  The errors a training run can raise (errors.py)
are importable from here too.
"""
from lightning_matrixfsdp.runtime.errors import (
    CollectiveInterrupted,
    LoneForwardError,
    MatrixShardError,
    RankDivergenceError,
    UnevenInputsError,
)
from lightning_matrixfsdp.runtime.experts.seams import parallelize_experts
from lightning_matrixfsdp.runtime.views.full import full_model
from lightning_matrixfsdp.runtime.config import MatrixFSDPConfig
from lightning_matrixfsdp.runtime.mesh.info import MeshInfo
from lightning_matrixfsdp.runtime.mesh.comm import hsdp_mesh
from lightning_matrixfsdp.runtime.placement import MatrixShard, Plan, RoleKind, UnitLayout
from lightning_matrixfsdp.runtime.queries import (
    NormGroups,
    broadcast_buffers,
    follow_requires_grad,
    get_comm_stats,
    get_expert_stats,
    get_plan,
    is_matrix_sharded,
    is_sharded_root,
    norm_groups,
    release_unfinished,
    row_span,
    scheduled_forwards,
    set_requires_gradient_sync,
    settle_replicas,
    skip_buffer_broadcast,
    start_replica_sync,
    sync_replicas,
    tp_group_of,
    wait_replicas,
    watch_lone_forwards,
)
from lightning_matrixfsdp.runtime.shard import matrix_shard
from lightning_matrixfsdp.runtime.views.state_dict import PartialStateDictError, local_state_dict

__all__ = ["CollectiveInterrupted", "LoneForwardError", "MatrixFSDPConfig", "MatrixShard", "MatrixShardError",
           "MeshInfo", "PartialStateDictError", "Plan",
           "RankDivergenceError", "RoleKind", "UnevenInputsError", "UnitLayout", "full_model", "parallelize_experts", "get_comm_stats", "get_expert_stats",
           "get_plan", "hsdp_mesh", "is_matrix_sharded", "local_state_dict", "matrix_shard", "scheduled_forwards",
           "set_requires_gradient_sync", "start_replica_sync", "sync_replicas", "watch_lone_forwards",
           # what the adapters and optimizers ask of and do to a sharded model (queries.py)
           "NormGroups", "broadcast_buffers", "follow_requires_grad", "is_sharded_root", "norm_groups",
           "release_unfinished", "row_span", "settle_replicas", "skip_buffer_broadcast", "tp_group_of", "wait_replicas"]
