"""What the Trainer does to a module under DDP that the Trainer strategy must do, or refuse, too.

- ``Trainer(sync_batchnorm=True)``: ``DDPStrategy`` converts every BatchNorm layer to
  ``torch.nn.SyncBatchNorm`` when fitting; ``ModelParallelStrategy``, our base class, does not, so
  the flag would be ignored silently. :func:`convert_sync_batchnorm` converts before sharding
  (the converted layers keep the parameter objects, which sharding then places), and refuses the
  CPU as DDP does: torch's SyncBatchNorm computes its statistics with GPU kernels only.
- ``ModelPruning``: :func:`refuse_pruning` refuses it at setup, before any step, with the reason
  (``runtime/prune_guard.py`` refuses ``torch.nn.utils.prune`` itself at the prune call).

Modules, callbacks and plain values in, never the strategy object.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_matrixfsdp.runtime.tags import sharded_roots

__all__ = ["convert_sync_batchnorm", "refuse_pruning"]


def convert_sync_batchnorm(model: nn.Module, layer_sync: Optional[Any], device: torch.device) -> nn.Module:
    """``layer_sync.apply(model)`` (Lightning's ``TorchSyncBatchNorm``) when given, as ``DDPStrategy``
    does when fitting; returns the model to use."""
    if layer_sync is None:
        return model
    plain = [n for n, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)]
    if plain and sharded_roots(model):
        raise MisconfigurationException(
            f"sync_batchnorm=True cannot convert {plain[0]!r} and the other BatchNorm layers: configure_model "
            "sharded the model before the strategy could convert them; call "
            "torch.nn.SyncBatchNorm.convert_sync_batchnorm(self) in configure_model before matrix_shard")
    model = layer_sync.apply(model)
    if device.type == "cpu" and any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        raise MisconfigurationException(
            "sync_batchnorm=True on the CPU: torch.nn.SyncBatchNorm computes its statistics with GPU kernels "
            "only, so its forward refuses CPU tensors (DDP refuses it on the CPU too: 'SyncBatchNorm layers only "
            "work with GPU modules'); train on GPUs, or drop sync_batchnorm=True (matrix_fsdp then broadcasts rank "
            "0's BatchNorm statistics before each forward, as DDP does, with broadcast_buffers=True)")
    return model


def refuse_pruning(callbacks: Iterable[Any]) -> None:
    """Raise at once if a ``ModelPruning`` callback is configured: pruning is not supported."""
    from lightning.pytorch.callbacks import ModelPruning

    for cb in callbacks:
        if isinstance(cb, ModelPruning):
            raise MisconfigurationException(
                f"{type(cb).__name__} is not supported by strategy='matrix_fsdp': torch.nn.utils.prune replaces each "
                "pruned weight by weight_orig * weight_mask and computes the mask from the whole weight, but a "
                "sharded weight is whole on its owner rank only and an empty placeholder on the others between "
                "forwards (its lottery-ticket reset and its checkpoint hook also rewrite weights in place on "
                "every rank). Prune with strategy='ddp', or prune the trained weights after consolidating the "
                "checkpoint (python -m lightning_matrixfsdp.consolidate)")
