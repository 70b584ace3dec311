"""Owner routing: any torch optimizer steps exactly the resident parameters a rank owns.

``route_optimizer`` edits ``param_groups`` in place (LR schedulers hold a reference
to the optimizer object, so it must not be replaced): non-owned placeholders are
dropped, group order and hyper-parameters are kept, so a scheduler's per-group
values still line up.  Nothing here communicates except the global-norm clip,
whose one scalar all-reduce is ``collectives.all_reduce_norm``.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.collectives import CommStats, all_reduce_norm, comm_device
from lightning_matrixfsdp.runtime.tags import find_state, is_owned

__all__ = ["clip_grad_norm_", "is_owned", "is_routed", "route_optimizer"]

_ROUTED = "_mfsdp_routed"


def route_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Keep only owned, non-empty parameters in each param group (in place, idempotent)."""
    for group in optimizer.param_groups:
        kept = [p for p in group["params"] if is_owned(p) and p.numel() > 0]
        dropped = [p for p in group["params"] if not (is_owned(p) and p.numel() > 0)]
        for p in dropped:
            optimizer.state.pop(p, None)
        group["params"] = kept
    setattr(optimizer, _ROUTED, True)
    return optimizer


def is_routed(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, _ROUTED, False))


def _owned_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None and is_owned(p) and p.numel() > 0]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Union[Iterable[torch.Tensor], torch.nn.Module],
    max_norm: float,
    norm_type: float = 2.0,
    group: Optional[dist.ProcessGroup] = None,
    error_if_nonfinite: bool = False,
    stats: Optional[CommStats] = None,
) -> torch.Tensor:
    """Clip owner-sharded gradients by their *global* norm (one scalar all-reduce).

    Each gradient lives on exactly one rank of the shard group, so summing the
    owners' partial sums over the shard group gives the norm DDP would see.
    Pass ``group`` for the shard group (default: the whole world; replicas of HSDP
    hold equal gradients, so use the shard group there).  The all-reduce is counted
    under the ``clip`` phase of ``stats`` (default: the sharded model's when
    ``parameters`` is a module that ``matrix_shard`` sharded).
    """
    if isinstance(parameters, torch.nn.Module):
        if stats is None:
            state = find_state(parameters)
            stats = state.stats if state is not None else None
        parameters = list(parameters.parameters())
    grads = _owned_grads(list(parameters))
    norm_type = float(norm_type)
    device = grads[0].device if grads else comm_device(group)
    # Partial sums in float64: the owners' pieces are added in another order than a
    # single-device norm would use, and float64 keeps that from showing in float32.
    if norm_type == math.inf:
        local = (torch.stack([g.detach().abs().max().double() for g in grads]).max() if grads
                 else torch.zeros((), dtype=torch.float64, device=device))
    else:
        local = (torch.stack([g.detach().double().abs().pow(norm_type).sum() for g in grads]).sum() if grads
                 else torch.zeros((), dtype=torch.float64, device=device))
    total = all_reduce_norm(local, maximum=norm_type == math.inf, group=group, stats=stats)
    total = (total[0] if norm_type == math.inf else total[0] ** (1.0 / norm_type)).float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total
