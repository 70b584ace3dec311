"""The owner-sharded ZeRO-3 runtime."""
from lightning_matrixfsdp.runtime.placement import MatrixShard, Plan, RoleKind, UnitLayout
from lightning_matrixfsdp.runtime.shard import (
    MatrixShardError,
    get_comm_stats,
    get_plan,
    hsdp_mesh,
    is_matrix_sharded,
    matrix_shard,
    set_requires_gradient_sync,
)

__all__ = ["MatrixShard", "MatrixShardError", "Plan", "RoleKind", "UnitLayout", "get_comm_stats", "get_plan",
           "hsdp_mesh", "is_matrix_sharded", "matrix_shard", "set_requires_gradient_sync"]
