"""Owner-sharded ZeRO-3 for PyTorch Lightning with exact matrix optimizers."""
from lightning_matrixfsdp.optim.norms import clip_grad_norm_, grad_norm
from lightning_matrixfsdp.optim.routing import route_optimizer
from lightning_matrixfsdp.runtime import (
    CollectiveInterrupted,
    LoneForwardError,
    MatrixFSDPConfig,
    MatrixShard,
    MatrixShardError,
    PartialStateDictError,
    Plan,
    RankDivergenceError,
    UnevenInputsError,
    parallelize_experts,
    full_model,
    get_comm_stats,
    get_expert_stats,
    get_plan,
    hsdp_mesh,
    is_matrix_sharded,
    local_state_dict,
    matrix_shard,
    set_requires_gradient_sync,
)

from lightning_matrixfsdp.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointKeyError,
    CheckpointMismatchError,
    CheckpointNotResumableError,
    load_pretrained,
    load_sharded,
    load_weights,
    meta_init,
    save_sharded,
)
from lightning_matrixfsdp.adapters import (
    DirectoryCheckpointIO,
    MatrixFSDPFabricStrategy,
    MatrixFSDPStrategy,
    PretrainedWeights,
    QKClip,
    load_from_checkpoint,
    register,
    register_fabric,
)
from lightning_matrixfsdp.adapters.console import show_routing_lines
from lightning_matrixfsdp.adapters.pipeline import forward_loss, forward_outputs
from lightning_matrixfsdp.adapters.double_precision import install_double_precision
from lightning_matrixfsdp.adapters.from_checkpoint import install_directory_loading
from lightning_matrixfsdp.qkclip import QKClipError, QKClipper

__version__ = "0.1.0"

register()  # Trainer(strategy="matrix_fsdp") works once the package is imported
register_fabric()  # and Fabric(strategy="matrix_fsdp")
install_directory_loading()  # and MyModule.load_from_checkpoint(a checkpoint directory)
show_routing_lines()  # each optimizer's one-line account of which tensors it steps how, on rank zero
install_double_precision()  # and precision="64-true" with a strategy instance (and under Fabric)

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointKeyError", "CheckpointMismatchError",
           "CheckpointNotResumableError", "DirectoryCheckpointIO", "load_from_checkpoint", "load_pretrained", "load_sharded", "load_weights", "meta_init", "PretrainedWeights", "QKClip", "QKClipError", "QKClipper", "save_sharded",
           "MatrixFSDPConfig", "MatrixFSDPStrategy", "MatrixShard", "Muon", "SOAP", "Shampoo", "MatrixShardError", "Plan",
           "RankDivergenceError", "UnevenInputsError", "MatrixFSDPFabricStrategy", "CollectiveInterrupted",
           "LoneForwardError", "clip_grad_norm_", "forward_loss", "forward_outputs", "full_model", "parallelize_experts", "get_comm_stats", "get_expert_stats", "get_plan", "grad_norm",
           "hsdp_mesh", "is_matrix_sharded", "local_state_dict", "matrix_shard", "param_groups", "PartialStateDictError", "route_optimizer", "set_requires_gradient_sync"]

from lightning_matrixfsdp.optim.groups import param_groups
from lightning_matrixfsdp.optim.matrix_optimizers import SOAP, Shampoo
from lightning_matrixfsdp.optim.muon import Muon
