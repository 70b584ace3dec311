"""The demos' learning-rate schedule (linear warmup, then cosine decay) and its length on resume.

A resumed run restores every scheduler's saved state, and for ``LambdaLR`` that state
includes the attributes of a callable-object lambda: here the schedule's length. A run
resumed with a larger ``max_steps`` would keep the old length and sit at the cosine
floor. :func:`fit_schedules_to_trainer`, called once the checkpoint is restored, sets
the length to the resumed trainer's step count again.
"""

from __future__ import annotations

import math
from typing import Any, Union

import torch
from lightning.pytorch import Trainer


class WarmupCosine:
    """LR multiplier: linear warmup, then cosine decay to ``min_ratio`` at ``total_steps``.

    A callable object rather than a lambda so LambdaLR can put it in a checkpoint.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float, cosine: bool) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio
        self.cosine = cosine

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if not self.cosine:
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, trainer: Trainer, warmup_steps: int, lr_schedule: str, min_lr_ratio: float
) -> Union[torch.optim.Optimizer, dict[str, Any]]:
    """``configure_optimizers``' return value: the optimizer with a per-step schedule over the whole run."""
    if lr_schedule == "constant" and warmup_steps <= 0:
        return optimizer
    total = int(trainer.estimated_stepping_batches)
    fn = WarmupCosine(max(0, warmup_steps), total, min_lr_ratio, cosine=lr_schedule == "cosine")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit_schedules_to_trainer(trainer: Trainer) -> None:
    """Give every :class:`WarmupCosine` the trainer's step count, keeping the restored position.

    Call it from ``on_train_start`` (after Lightning restored the checkpoint). On a fresh run
    it changes nothing. On a resumed run with another ``max_steps`` the schedule then spans
    the new run, and the current learning rates are recomputed as ``LambdaLR.step()`` would:
    ``base_lr * fn(last_epoch)``.
    """
    total = int(trainer.estimated_stepping_batches)
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        fns = getattr(scheduler, "lr_lambdas", None)
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) or not fns:
            continue
        stale = [fn for fn in fns if isinstance(fn, WarmupCosine) and fn.total_steps != total]
        if not stale:
            continue
        for fn in stale:
            fn.total_steps = total
        for group, base_lr, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, fns):
            group["lr"] = base_lr * fn(scheduler.last_epoch)
