"""Refuse ``torch.nn.utils.prune`` on a sharded parameter, at the prune call, with the reason.

Pruning reparametrizes a weight: the parameter is registered again as ``weight_orig``, a
``weight_mask`` buffer is computed from the whole weight, and a forward pre-hook assigns
``weight = weight_orig * weight_mask`` as a plain tensor. Under owner sharding the weight is
whole on its owner only (an empty placeholder elsewhere between forwards), so every rank but
the owner would compute its mask from nothing, and the unit's materialization, which registers
the full weight as ``weight`` again, would make torch's hook fail later with a bare
``TypeError: cannot assign 'torch.FloatTensor' as parameter 'weight'``.

The check is one process-wide parameter-registration hook (PyTorch's public
``register_module_parameter_registration_hook``), installed by the first ``matrix_shard``: it
raises when a sharded parameter is registered as ``<name>_orig`` beside itself, which is what
every pruning method of ``torch.nn.utils.prune`` does first, before it changes the module.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.tags import shard_of

_handle: Optional[Any] = None


def _refuse_reparametrization(module: nn.Module, name: str, param: nn.Parameter) -> None:
    shard = shard_of(param)
    if shard is None or not name.endswith("_orig") or module._parameters.get(name[:-len("_orig")]) is not param:
        return
    raise MatrixShardError(
        f"pruning {shard.fqn!r} (torch.nn.utils.prune, e.g. Lightning's ModelPruning callback) is not supported "
        f"under matrix_fsdp: pruning computes a mask from the whole weight and registers it as "
        f"{name[:-len('_orig')]!r} = {name!r} * mask, but a sharded weight is whole on its owner rank only and an "
        "empty placeholder on the others between forwards. Prune with strategy='ddp', or prune the trained "
        "weights after consolidating the checkpoint (python -m lightning_matrixfsdp.consolidate)")


def install_prune_guard() -> None:
    """Install the process-wide check once (idempotent)."""
    global _handle
    if _handle is None:
        _handle = nn.modules.module.register_module_parameter_registration_hook(_refuse_reparametrization)
