"""Checks on the model handed to ``matrix_shard``, before anything is changed."""

from __future__ import annotations

from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.tags import state_of


def check_model(module: nn.Module, tensor_parallel: bool = False) -> None:
    """Refuse a model ``matrix_shard`` cannot take: sharded already (by us or by FSDP),
    holding DTensors without a tensor-parallel mesh (``tp.read_layout`` checks them with one),
    an embedding with sparse gradients, or spread over several devices."""
    for name, m in module.named_modules():
        if state_of(m) is not None:
            raise MatrixShardError(
                f"module {name or '<root>'!r} is already sharded by matrix_shard; shard a model once"
            )
        cls = type(m)
        if any(c.__name__ in ("FSDPModule", "FullyShardedDataParallel") for c in cls.__mro__):
            raise MatrixShardError(
                f"module {name or '<root>'!r} is already wrapped by FSDP ({cls.__name__}); "
                "matrix_shard replaces FSDP: pass the plain, unwrapped model"
            )
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()  # type: ignore[assignment]
    for name, p in module.named_parameters():
        if DTensor and isinstance(p, DTensor) and not tensor_parallel:
            raise MatrixShardError(
                f"parameter {name!r} is a DTensor (tensor parallel or FSDP2), but the mesh has no tensor-parallel "
                "dimension: for tensor parallelism pass Lightning's (data_parallel, tensor_parallel) mesh "
                "(MatrixFSDPStrategy(tensor_parallel_size=T) gives configure_model one), else a plain model")
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            raise MatrixShardError(
                f"parameter {(name + '.weight') if name else 'weight'!r} belongs to {type(m).__name__}(sparse=True) "
                "and would get sparse gradients, which matrix_fsdp cannot reduce to the parameter's owner (it sums "
                "dense gradients, and every forward materializes the full weight anyway, so a sparse gradient "
                f"would save nothing); build it with sparse=False (and an optimizer for dense gradients, e.g. Adam "
                "instead of SparseAdam), or train this model with DDP")
    params = list(module.parameters())
    devices = {p.device for p in params if not p.is_meta}
    n_meta = sum(p.is_meta for p in params)
    if n_meta and n_meta != len(params):
        raise MatrixShardError(
            f"{n_meta} of {len(params)} parameters are on the meta device and the rest on "
            f"{sorted(map(str, devices))}; build the whole model on one device (or all on meta)"
        )
    if len(devices) > 1:
        raise MatrixShardError(
            f"parameters live on mixed devices {sorted(map(str, devices))}; move the model to one device "
            "(or build it on the meta device) before matrix_shard"
        )
