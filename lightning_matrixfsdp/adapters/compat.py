"""Lightning features the Trainer strategy patches or refuses.

What the Trainer does to a module under DDP that the Trainer strategy must do, or refuse, too:

- ``Trainer(sync_batchnorm=True)``: ``DDPStrategy`` converts every BatchNorm layer to
  ``torch.nn.SyncBatchNorm`` when fitting; ``ModelParallelStrategy``, our base class, does not, so
  the flag would be ignored silently. :func:`convert_sync_batchnorm` converts before sharding
  (the converted layers keep the parameter objects, which sharding then places), and refuses the
  CPU as DDP does: torch's SyncBatchNorm computes its statistics with GPU kernels only.
- ``ModelPruning``: :func:`refuse_pruning` refuses it at setup, before any step, with the reason
  (``runtime/prune_guard.py`` refuses ``torch.nn.utils.prune`` itself at the prune call).
- Asynchronous saves (``async_save=True``): the saver (``checkpoint/async_save.py``) publishes a
  checkpoint after the save returned. Lightning acts on checkpoint paths right after a save:
  ``ModelCheckpoint`` deletes the checkpoint that left the top k (``Strategy.remove_checkpoint``)
  and points the ``save_last="link"`` link at the new one. :func:`defer_links` defers the link
  until the pending save is published (and drops it if it fails), so a crash in between never
  leaves a link to a directory that does not exist. Lightning's own ``AsyncCheckpointIO`` would
  call the strategy's collective save from a thread: :func:`refuse_async_checkpoint_io`.

Modules, callbacks and plain values in, never the strategy object.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer
from lightning_matrixfsdp.runtime.tags import sharded_roots

__all__ = ["convert_sync_batchnorm", "defer_links", "refuse_async_checkpoint_io", "refuse_pruning"]


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


# ---------------------------------------------------------------- asynchronous saves
def refuse_async_checkpoint_io(plugin: Any, who: str) -> None:
    """Lightning's ``AsyncCheckpointIO`` plugin is not a way to save this strategy's checkpoints."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    if isinstance(plugin, AsyncCheckpointIO):
        raise ValueError(
            f"{who} does not take Lightning's AsyncCheckpointIO plugin: it would run the strategy's collective "
            f"save from a thread. Use {who}(async_save=True) instead (it saves in the background, safely) and "
            "remove AsyncCheckpointIO from the Trainer's plugins")


class _Rank0Trainer:
    """What ``ModelCheckpoint._link_checkpoint`` asks of the trainer, for rank 0's deferred part."""

    is_global_zero = True

    class strategy:  # noqa: N801 - mirrors ``trainer.strategy``
        @staticmethod
        def barrier(*args: Any, **kwargs: Any) -> None:
            pass


def defer_links(callbacks: Iterable[Any], saver: AsyncCheckpointer, is_global_zero: bool) -> None:
    """Make every ``ModelCheckpoint``'s ``save_last="link"`` link wait for the pending save's publish
    (rank 0 makes the link then; every rank still meets the callback's barrier now)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    link: Callable[..., None] = ModelCheckpoint._link_checkpoint

    def deferred(trainer: Any, filepath: str, linkpath: str) -> None:
        fn: Optional[Callable[[], None]] = (lambda: link(_Rank0Trainer, filepath, linkpath)) if is_global_zero \
            else None
        saver.after_publish(fn)
        trainer.strategy.barrier()

    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint) and "_link_checkpoint" not in vars(cb):
            cb._link_checkpoint = deferred  # an instance attribute shadows the static method
