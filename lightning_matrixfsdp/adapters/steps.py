"""How the Trainer's ``*_step`` calls run: through the root unit, and under the uneven-input join.

Lightning calls a LightningModule's steps directly, which would bypass the module hooks
that materialize a sharded LightningModule's root unit: :func:`call_as_forward` runs a
step as the module's forward instead. :class:`UnevenInputs` keeps the ranks in step when
their dataloaders give different batch counts (``runtime/join.py``'s ``EvalJoin`` over the
sharded models). Everything here takes modules and plain values, never the strategy.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from lightning_matrixfsdp.runtime import scheduled_forwards
from lightning_matrixfsdp.runtime.join import EvalJoin
from lightning_matrixfsdp.runtime.tags import sharded_roots, state_of

__all__ = ["UnevenInputs", "call_as_forward", "evenly_sampled"]


def call_as_forward(module: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``module.<name>(*args, **kwargs)`` as the module's forward, so a sharded LightningModule's
    root unit materializes around it; inside ``scheduled_forwards``: every rank runs the steps, so
    no lone-forward check."""
    with scheduled_forwards(module):
        if state_of(module) is None:
            return getattr(module, name)(*args, **kwargs)
        had_own = "forward" in module.__dict__
        original = module.__dict__.get("forward")

        def restore() -> None:
            if had_own:
                module.forward = original
            else:
                module.__dict__.pop("forward", None)

        def redirected(*a: Any, **k: Any) -> Any:
            restore()
            return getattr(module, name)(*a, **k)

        module.forward = redirected
        try:
            return module(*args, **kwargs)
        finally:
            restore()


def evenly_sampled(dataloader: object) -> bool:
    """True when torch's ``DistributedSampler`` (or a subclass, as Lightning's wrappers are)
    picks the batches: it pads or truncates to the same count on every rank."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = getattr(dataloader, "sampler", None)
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    return isinstance(sampler, DistributedSampler) or isinstance(getattr(batch_sampler, "sampler", None),
                                                                 DistributedSampler)


class UnevenInputs:
    """The join of one strategy's sharded models: evaluation steps followed by ranks without a
    batch, and the training check that every rank raises at the first uneven step."""

    def __init__(self) -> None:
        self._join: Optional[EvalJoin] = None
        #: Whether training batch counts can differ between ranks: not under torch's DistributedSampler
        #: (Lightning's default), which gives every rank the same count. Only then does each training
        #: step pay the check's small all-gather (a host sync on NCCL).
        self.train_counts_may_differ = True

    def join(self, module: Optional[nn.Module], world_size: int) -> Optional[EvalJoin]:
        """The join of the sharded models inside ``module`` (None on one rank or without one)."""
        roots = sharded_roots(module) if module is not None else []
        if not roots or world_size == 1:
            return None
        states = [state_of(r) for r in roots]
        if self._join is None or self._join.states != states:
            self._join = EvalJoin(states)
        return self._join

    def wrap(self, dataloader: object, module: Optional[nn.Module], world_size: int, training: bool) -> object:
        """Every dataloader goes through the join: a rank with no batch at all still follows the
        other ranks' evaluation steps, or takes part in the training check."""
        join = self.join(module, world_size)
        if join is None:
            return dataloader
        if training:
            self.train_counts_may_differ = not evenly_sampled(dataloader)
            if not self.train_counts_may_differ:
                return dataloader
        return join.wrap(dataloader, training=training)  # type: ignore[arg-type]

    def check_training_step(self, module: nn.Module, world_size: int, is_last_batch: Callable[[], bool]) -> None:
        """Before a training step: every rank raises at the first step where batch counts differ."""
        join = self.join(module, world_size)
        if join is not None and self.train_counts_may_differ:
            join.check_training_step(True, bool(is_last_batch()))

    def run_step(self, module: nn.Module, world_size: int, step: Callable[[], Any],
                 is_last_batch: Callable[[], bool]) -> Any:
        """An evaluation step under the join: ranks with fewer batches follow the others'
        remaining steps after their last (``is_last_batch``: the running loop's flag, read after)."""
        join = self.join(module, world_size)
        if join is None:
            return step()
        join.begin_step()
        out = step()
        join.end_step(bool(is_last_batch()))
        return out
