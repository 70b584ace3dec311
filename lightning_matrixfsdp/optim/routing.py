"""Owner routing: any torch optimizer steps exactly the resident parameters a rank owns.

``route_optimizer`` edits ``param_groups`` in place (LR schedulers hold a reference
to the optimizer object, so it must not be replaced): non-owned placeholders are
dropped, group order and hyper-parameters are kept, so a scheduler's per-group
values still line up.  Groups added later (``BaseFinetuning`` unfreezing a module)
are routed the same way, and parameters the optimizer held before routing are not
added again, so every rank has the param groups the unsharded optimizer would have.  Nothing here communicates except the global-norm clip,
whose one scalar all-reduce is ``collectives.all_reduce_norm``.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.collectives import CommStats, all_reduce_norm, comm_device
from lightning_matrixfsdp.runtime.tags import find_state, is_owned

__all__ = ["clip_grad_norm_", "is_owned", "is_routed", "route_optimizer"]

_ROUTED = "_mfsdp_routed"
_DROPPED = "_mfsdp_dropped"  # id -> weakref of each placeholder routing removed


def route_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Keep only owned, non-empty parameters in each param group (in place, idempotent).

    Later ``add_param_group`` calls are routed too (see ``_routed_add_param_group``).
    """
    for group in optimizer.param_groups:
        group["params"] = _keep(optimizer, group["params"])
    if not is_routed(optimizer):
        optimizer.add_param_group = _routed_add_param_group(optimizer)  # type: ignore[method-assign]
    setattr(optimizer, _ROUTED, True)
    return optimizer


def _keep(optimizer: torch.optim.Optimizer, params: Iterable[Any]) -> list[Any]:
    """The owned, non-empty ``params`` (tensors, or torch's ``(name, tensor)`` pairs); the others
    lose their state and are remembered as dropped."""
    dropped: dict[int, Any] = optimizer.__dict__.setdefault(_DROPPED, {})
    kept = []
    for item in params:
        p = _tensor(item)
        if is_owned(p) and p.numel() > 0:
            kept.append(item)
        else:
            optimizer.state.pop(p, None)
            dropped[id(p)] = weakref.ref(p)
    return kept


def _tensor(item: Any) -> torch.Tensor:
    return item[1] if isinstance(item, tuple) else item


def _routed_add_param_group(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer.add_param_group`` for a routed optimizer.

    A new group keeps only what this rank owns (possibly nothing: the group still exists,
    so every rank has the same groups for schedulers and checkpoints). Placeholders that
    routing removed earlier are skipped, and a group made only of them is not added:
    the unsharded optimizer still holds those parameters, and ``BaseFinetuning``, which
    compares the new parameters with the optimizer's, adds no group there.
    """
    add = optimizer.add_param_group

    def add_param_group(param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        if isinstance(params, set):  # torch's own error
            return add(param_group)
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        dropped = optimizer.__dict__.get(_DROPPED, {})
        fresh = [x for x in params if not (id(_tensor(x)) in dropped and dropped[id(_tensor(x))]() is _tensor(x))]
        if params and not fresh:
            return None
        return add({**param_group, "params": _keep(optimizer, fresh)})

    return add_param_group


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
    ``group`` is the shard group. When ``parameters`` is a module that ``matrix_shard``
    sharded, the default is that module's shard group (under HSDP the replicas hold equal
    gradients, and summing over the world would count each of them once per replica),
    or the whole world under ``replica_split`` (each gradient then lives on one rank of
    the world); otherwise the whole world. The all-reduce is counted under the ``clip`` phase of
    ``stats`` (default: the sharded module's).
    """
    if isinstance(parameters, torch.nn.Module):
        state = find_state(parameters)
        if state is not None:
            stats = state.stats if stats is None else stats
            if group is None:
                # replica_split: each gradient lives on one rank of the whole world
                group = None if state.plan.replica_split else state.sg.group
        parameters = list(parameters.parameters())
    grads = _owned_grads(list(parameters))
    norm_type = float(norm_type)
    local, maximum = _partial_norm(grads, norm_type, grads[0].device if grads else comm_device(group))
    total = _total_norm(all_reduce_norm(local, maximum=maximum, group=group, stats=stats), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot "
            "be clipped; pass error_if_nonfinite=False to scale the gradients by it anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


# What each rank contributes to the global norm, and how the ranks' pieces combine (sum, or
# maximum): the same total as ``torch.nn.utils.clip_grad_norm_`` over the full gradients,
# which takes each tensor's norm and then the norm of those norms.  Partial sums are in
# float64: the owners' pieces are added in another order than a single-device norm would
# use, and float64 keeps that from showing in float32.  A maximum drops NaN inside the
# all-reduce, so the NaN travels as a flag of its own.
def _partial_norm(grads: list[torch.Tensor], p: float, device: torch.device) -> tuple[torch.Tensor, bool]:
    f64 = dict(dtype=torch.float64, device=device)
    if p == math.inf or p == -math.inf:
        mags = [g.detach().abs().max() if p > 0 else g.detach().abs().min() for g in grads]
        if mags:
            best = torch.stack([m.double() for m in mags])
            value = best.max() if p > 0 else -best.min()  # -min: combined by maximum as well
            nan = torch.stack([g.detach().isnan().any() for g in grads]).any().double()
        else:
            value = torch.tensor(0.0 if p > 0 else -math.inf, **f64)
            nan = torch.zeros((), **f64)
        return torch.stack([value.to(device), nan.to(device), torch.tensor(float(bool(grads)), **f64)]), True
    if p == 0:  # torch: the number of tensors with a non-zero (or NaN) entry
        count = (torch.stack([(g.detach() != 0).any() for g in grads]).sum().double() if grads
                 else torch.zeros((), **f64))
        return count.to(device).reshape(1), False
    value = (torch.stack([_magnitudes(g).pow(p).sum() for g in grads]).sum() if grads
             else torch.zeros((), **f64))
    if p > 0:
        return value.reshape(1), False
    return torch.stack([value.to(device), torch.tensor(float(len(grads)), **f64)]), False


def _magnitudes(g: torch.Tensor) -> torch.Tensor:
    """``|g|`` elementwise in float64; a complex gradient's moduli (``.double()`` would drop the imaginary part)."""
    x = g.detach()
    return torch.view_as_real(x).double().pow(2).sum(-1).sqrt() if x.is_complex() else x.double().abs()


def _total_norm(combined: torch.Tensor, p: float) -> torch.Tensor:
    # torch.where instead of Python branches: no host synchronization on an accelerator.
    if p == math.inf or p == -math.inf:
        value, nan, any_grad = combined[0], combined[1], combined[2]
        value = value if p > 0 else -value
        value = torch.where(any_grad > 0, value, torch.zeros_like(value))  # no gradient anywhere: 0, as torch
        return torch.where(nan > 0, torch.full_like(value, math.nan), value).float()
    if p == 0:
        return combined[0].float()
    total = combined[0] ** (1.0 / p)
    if p < 0:
        total = torch.where(combined[1] > 0, total, torch.zeros_like(total))
    return total.float()
