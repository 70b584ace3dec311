"""The Trainer's ``optimizer=`` replacement: the new optimizer, and the module's LR schedulers on it.

``MatrixFSDPStrategy(optimizer=...)`` trains an unmodified module with another optimizer
(the fine-tuning route): the one optimizer of ``configure_optimizers`` is replaced, and
its LR schedulers are carried over to the replacement. Everything here takes optimizers,
parameters and Lightning's scheduler configs, never the strategy.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_matrixfsdp.adapter import build_replacement, replacement_note

__all__ = ["replace_optimizer"]


def replace_optimizer(factory: Callable[[Iterable[nn.Parameter]], Optimizer], params: Sequence[nn.Parameter],
                      optimizers: Sequence[Optimizer], configs: Sequence[Any],
                      who: str = "MatrixFSDPStrategy") -> tuple[Optimizer, list[Any]]:
    """(the optimizer ``factory`` builds over ``params`` in place of the one in ``optimizers``,
    the scheduler ``configs`` that now drive it)."""
    if len(optimizers) > 1:
        raise MisconfigurationException(
            f"{who}(optimizer=...) replaces one optimizer, but configure_optimizers returned "
            f"{len(optimizers)}; drop the strategy's optimizer option or return a single optimizer"
        )
    old = optimizers[0] if optimizers else None
    try:
        new = build_replacement(factory, params, 1, who)
    except TypeError as e:
        raise MisconfigurationException(str(e)) from None
    movable = [cfg for cfg in configs if old is not None and hasattr(cfg.scheduler, "base_lrs")
               and len(old.param_groups) == len(new.param_groups)]
    for cfg in configs:
        if cfg not in movable:
            rank_zero_warn(f"{who}(optimizer=...): dropping LR scheduler "
                           f"{type(cfg.scheduler).__name__}, which cannot follow the replacement optimizer's "
                           "param groups")
    if movable:
        assert old is not None
        # Schedulers wrap their optimizer's step() when built, to check the call order; one
        # moved to ``new`` would warn that step() "has been overridden". Building one on ``new``
        # (before the rescale below: it sets each LR to its initial value times 1) installs it.
        torch.optim.lr_scheduler.LambdaLR(new, lambda _: 1.0)
        # Keep the schedule's shape (its factor so far) on the new optimizer's own learning rates.
        for go, gn in zip(old.param_groups, new.param_groups):
            factor = go["lr"] / go.get("initial_lr", go["lr"]) if go.get("initial_lr") else 1.0
            gn["initial_lr"] = gn["lr"]
            gn["lr"] = gn["lr"] * factor
    kept = []
    for cfg in movable:
        sched = cfg.scheduler
        sched.optimizer = new
        sched.base_lrs = [g["initial_lr"] for g in new.param_groups]
        if hasattr(sched, "_last_lr"):
            sched._last_lr = [g["lr"] for g in new.param_groups]
        rank_zero_warn(f"{who}(optimizer=...): LR scheduler {type(sched).__name__} now drives "
                       f"{type(new).__name__}, rescaled to its learning rates", category=UserWarning)
        kept.append(cfg)
    rank_zero_info(f"{who}: {replacement_note(new, old)}")
    return new, kept
