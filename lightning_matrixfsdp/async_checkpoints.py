"""Lightning's side of asynchronous saves (``async_save=True``): what must see completed checkpoints.

The saver (``checkpoint/async_save.py``) publishes a checkpoint after the save returned.
Lightning acts on checkpoint paths right after a save: ``ModelCheckpoint`` deletes the
checkpoint that left the top k (``Strategy.remove_checkpoint``) and points the
``save_last="link"`` link at the new one. Both are deferred here until the pending save
is published (and dropped if it fails), so a crash in between never leaves fewer
checkpoints than before, or a link to a directory that does not exist. Lightning's own
``AsyncCheckpointIO`` would call the strategy's collective save from a thread; it is refused.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer

__all__ = ["defer_links", "refuse_async_checkpoint_io"]


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
