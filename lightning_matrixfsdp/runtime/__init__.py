"""The owner-sharded ZeRO-3 runtime: its public API.

``matrix_shard`` (shard.py) shards a model; ``hsdp_mesh`` (mesh.py) builds the
``(replicate, shard)`` mesh for HSDP; the queries (queries.py) read a sharded model's
plan and traffic and switch gradient synchronization.  The errors a training run can
raise (errors.py) are importable from here too.
"""
from lightning_matrixfsdp.runtime.errors import CollectiveInterrupted, RankDivergenceError, UnevenInputsError
from lightning_matrixfsdp.runtime.mesh import hsdp_mesh
from lightning_matrixfsdp.runtime.options import MatrixShardError
from lightning_matrixfsdp.runtime.placement import MatrixShard, Plan, RoleKind, UnitLayout
from lightning_matrixfsdp.runtime.queries import (
    get_comm_stats,
    get_plan,
    is_matrix_sharded,
    set_requires_gradient_sync,
    start_replica_sync,
    sync_replicas,
)
from lightning_matrixfsdp.runtime.shard import matrix_shard

__all__ = ["CollectiveInterrupted", "MatrixShard", "MatrixShardError", "Plan", "RankDivergenceError", "RoleKind",
           "UnevenInputsError", "UnitLayout", "get_comm_stats", "get_plan", "hsdp_mesh", "is_matrix_sharded", "matrix_shard",
           "set_requires_gradient_sync", "start_replica_sync", "sync_replicas"]
