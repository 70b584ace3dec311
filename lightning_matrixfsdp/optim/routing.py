"""Owner routing: any torch optimizer steps exactly the resident parameters a rank owns.

``route_optimizer`` edits ``param_groups`` in place (LR schedulers hold a reference
to the optimizer object, so it must not be replaced): non-owned placeholders are
dropped, group order and hyper-parameters are kept, so a scheduler's per-group
values still line up.  Groups added later (``add_param_group``, e.g. by a fine-tuning
callback) are routed as they arrive.  Each group's parameters as the user gave them
stay on record (:func:`full_param_groups`): code that must see the same lists on every
rank (Lightning's ``toggle_optimizer``, the clip's parameter order) reads them there.
Nothing here communicates except the global-norm clip (``small_comm.all_reduce_norm``).
"""

from __future__ import annotations

import math
import warnings
import zlib
from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_matrixfsdp.optim.tail import TailOptimizer
from lightning_matrixfsdp.runtime.comm import CommStats, comm_device
from lightning_matrixfsdp.runtime.small_comm import all_reduce_norm
from lightning_matrixfsdp.runtime.tags import find_state, is_owned, shard_of, tp_of, tp_shape_of

__all__ = ["clip_grad_norm_", "full_param_groups", "full_params", "is_owned", "route_optimizer"]

# Per param group: (its parameters as given, the routed list object that replaced them). A
# record is valid while the group still holds that very list (``load_state_dict`` keeps it; a
# group assigned anew, as ``BaseFinetuning`` does on resume, is routed again).
_FULL = "_mfsdp_full_groups"
_ADD = "_mfsdp_routes_added_groups"


def _held(p: torch.Tensor) -> bool:
    return is_owned(p) and p.numel() > 0


def route_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Keep only owned, non-empty parameters in each param group (in place, idempotent), and
    route every group added later with ``add_param_group`` the same way."""
    records: list[Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]] = getattr(optimizer, _FULL, [])
    routed = []
    for i, group in enumerate(optimizer.param_groups):
        rec = records[i] if i < len(records) else None
        if rec is not None and group["params"] is rec[1]:
            routed.append(rec)
            continue
        full = list(group["params"])
        kept = [p for p in full if _held(p)]
        keep = {id(p) for p in kept}
        for p in full:
            if id(p) not in keep:
                optimizer.state.pop(p, None)
        group["params"] = kept
        routed.append((full, kept))
    _warn_if_fragments_stepped_alone(optimizer, routed)
    records[:] = routed  # in place: Lightning's optimizer wrappers copy the attribute once
    setattr(optimizer, _FULL, records)
    if not getattr(optimizer, _ADD, False):
        add = optimizer.add_param_group  # the bound method of the optimizer's class

        def add_param_group(param_group: dict[str, Any]) -> None:
            params = param_group.get("params")
            if isinstance(params, (list, tuple)) and params:
                # Parameters the unsharded optimizer already holds (placeholders that routing
                # took out of this rank's lists) are skipped, and a group made only of them is
                # not added: BaseFinetuning filters new parameters against the optimizer's
                # (routed) lists, and under DDP it would add no group for them.
                held = {id(p) for ps in full_param_groups(optimizer) for p in ps}
                fresh = [x for x in params if id(x[1] if isinstance(x, tuple) else x) not in held]
                if not fresh:
                    return
                param_group = {**param_group, "params": fresh}
            add(param_group)
            route_optimizer(optimizer)

        optimizer.add_param_group = add_param_group  # type: ignore[method-assign]
        setattr(optimizer, _ADD, True)
    return optimizer


def _warn_if_fragments_stepped_alone(optimizer: torch.optim.Optimizer, routed: list) -> None:
    """An optimizer of another package holding fragments of TP-split matrices steps each fragment as
    a tensor of its own: exact for elementwise optimizers (AdamW, SGD), blockwise for matrix ones."""
    if isinstance(optimizer, TailOptimizer) or getattr(optimizer, "_mfsdp_tp_warned", False):
        return
    if any(tp_of(p) is not None for _, kept in routed for p in kept):
        setattr(optimizer, "_mfsdp_tp_warned", True)
        warnings.warn(
            f"{type(optimizer).__name__} holds fragments of tensor-parallel matrices and steps each fragment "
            "alone: exact for elementwise optimizers (AdamW, SGD), but a matrix optimizer (torch.optim.Muon) would "
            "orthogonalize each fragment separately. Use lightning_matrixfsdp.Muon, Shampoo or SOAP, which step "
            "every split matrix whole", UserWarning, stacklevel=3)


def full_param_groups(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """Each param group's parameters as the user gave them, non-owned placeholders included:
    the same lists on every rank (a group not routed yet is returned as it is)."""
    records = getattr(optimizer, _FULL, [])
    out = []
    for i, group in enumerate(optimizer.param_groups):
        rec = records[i] if i < len(records) else None
        out.append(list(rec[0]) if rec is not None and group["params"] is rec[1] else list(group["params"]))
    return out


def full_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """:func:`full_param_groups` flattened in group order: what DDP's clipping iterates."""
    return [p for ps in full_param_groups(optimizer) for p in ps]


def _owned_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None and _held(p)]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Union[Iterable[torch.Tensor], torch.nn.Module],
    max_norm: float,
    norm_type: float = 2.0,
    group: Optional[dist.ProcessGroup] = None,
    error_if_nonfinite: bool = False,
    stats: Optional[CommStats] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Clip owner-sharded gradients by their *global* norm, as ``torch.nn.utils.clip_grad_norm_``
    over the full gradients (DDP's clipping) would.

    Each gradient lives whole on one rank of the shard group. When every rank passes the same
    parameters (a module, ``module.parameters()``, an optimizer's :func:`full_params`), each
    owner takes the norm of each gradient it holds as torch does, one all-reduce brings every
    rank all of them, and every rank combines them in the list's order as torch does: total and
    clipped gradients are bitwise torch's where the gradients share one dtype (several dtypes
    are combined per dtype, in first-seen order). Lists that differ between ranks (each rank's
    routed optimizer parameters) have no common order: the owners' float64 partial sums are
    added instead, the same norm up to float32 rounding. A four-number all-reduce first tells
    the two cases apart; the exact case reads which gradients exist on the host (one device
    synchronization on an accelerator). Tensors without placement marks count as whole on
    every rank (one copy enters the norm; every rank scales its own).

    ``group`` is the shard group. When ``parameters`` is a module that ``matrix_shard``
    sharded, the default is that module's shard group (under HSDP the replicas hold equal
    gradients, and summing over the world would count each of them once per replica),
    or the whole world under ``replica_split`` (each gradient then lives on one rank of
    the world); otherwise the whole world. The all-reduces are counted under the ``clip`` phase of
    ``stats`` (default: the sharded module's).
    """
    if isinstance(parameters, torch.nn.Module):
        state = find_state(parameters)
        if state is not None:
            stats = state.stats if stats is None else stats
            if group is None:
                group = state.norm_group  # the world under replica_split (one rank holds each gradient)
            if tp_group is None:
                tp_group = state.mesh.tp_group
        parameters = list(parameters.parameters())
    params = list(parameters)
    norm_type = float(norm_type)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        return _clip_tensor_parallel(params, float(max_norm), norm_type, group, tp_group, error_if_nonfinite, stats)
    if _alone(group):
        # One rank holds every gradient whole (one device, or HSDP's replicas of a one-rank shard
        # group, whose gradients are equal): this is torch's own clipping, its fused kernels included.
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    grads = _owned_grads(params)
    exact = _same_everywhere(params, group, stats)
    if exact:
        total = _exact_total(params, norm_type, group, stats)
    else:
        local, maximum = _partial_norm(grads, norm_type, grads[0].device if grads else comm_device(group))
        total = _total_norm(all_reduce_norm(local, maximum=maximum, group=group, stats=stats), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot "
            "be clipped; pass error_if_nonfinite=False to scale the gradients by it anyway")
    if exact:  # torch's own scaling step (a float32 factor multiplies lower-precision gradients as it is)
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None and _held(p)], max_norm, total)
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _clip_tensor_parallel(params: list[torch.Tensor], max_norm: float, norm_type: float,
                          group: Optional[dist.ProcessGroup], tp_group: dist.ProcessGroup,
                          error_if_nonfinite: bool, stats: Optional[CommStats]) -> torch.Tensor:
    """The global norm of a tensor-parallel model: every TP rank adds its fragments of split
    gradients, TP rank 0 alone the TP-replicated ones (each once); the owners' float64 pieces
    are combined over the norm group and then over the TP group (once when the norm group is
    the world already). The same norm as torch's over the whole gradients up to float32 rounding."""
    first = dist.get_rank(tp_group) == 0
    grads = _owned_grads(params)
    mine = [p.grad for p in params if p.grad is not None and _held(p) and (first or tp_shape_of(p) is not None)]
    local, maximum = _partial_norm(mine, norm_type, grads[0].device if grads else comm_device(group))
    combined = all_reduce_norm(local, maximum=maximum, group=group, stats=stats)
    if dist.get_world_size(group) < dist.get_world_size():
        combined = all_reduce_norm(combined, maximum=maximum, group=tp_group, stats=stats)
    total = _total_norm(combined, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so "
                           "it cannot be clipped; pass error_if_nonfinite=False to scale the gradients by it anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _alone(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether the norm group is one rank (or there is no process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_world_size(group) == 1


def _same_everywhere(params: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup],
                     stats: Optional[CommStats]) -> bool:
    """Whether every rank of ``group`` passed the same list (length and names; a crc32 of the
    names, exact in float64): one all-reduce of (n, -n, h, -h) by maximum."""
    names = "\0".join(s.fqn if (s := shard_of(p)) is not None else str(tuple(p.shape)) for p in params)
    key = [float(len(params)), float(zlib.crc32(names.encode()))]
    mine = torch.tensor(key + [-k for k in key], dtype=torch.float64)
    got = all_reduce_norm(mine, maximum=True, group=group, stats=stats).tolist()
    return got[0] == -got[2] and got[1] == -got[3]


def _exact_total(params: Sequence[torch.Tensor], p: float, group: Optional[dist.ProcessGroup],
                 stats: Optional[CommStats]) -> torch.Tensor:
    """torch's total norm over the full gradients of ``params`` (the same list on every rank):
    row 0 carries each gradient's norm from its one holder (float64 holds any float norm exactly,
    and adding the other ranks' zeros keeps it), row 1 whether it exists."""
    device = comm_device(group)
    first = dist.get_rank(group) == 0 if dist.is_available() and dist.is_initialized() else True
    mine = [(i, t.grad) for i, t in enumerate(params) if t.grad is not None
            and (_held(t) if shard_of(t) is not None else first)]
    local = torch.zeros(2, len(params), dtype=torch.float64, device=device)
    if mine:
        at = torch.tensor([i for i, _ in mine], device=device)
        local[0, at] = torch.stack([torch.linalg.vector_norm(g, p).to(device, torch.float64) for _, g in mine])
        local[1, at] = 1.0
    both = all_reduce_norm(local, maximum=False, group=group, stats=stats).view(2, len(params))
    present = [i for i, flag in enumerate(both[1].tolist()) if flag > 0]
    if not present:
        return torch.tensor(0.0)  # as torch, which has no gradient to take a device from
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in present:  # torch groups the norms by dtype before it stacks them
        by_dtype.setdefault(params[i].dtype, []).append(i)
    home = params[present[0]].device
    norms = torch.cat([both[0, idx].to(home, dtype) for dtype, idx in by_dtype.items()])
    return torch.linalg.vector_norm(norms, p)


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
