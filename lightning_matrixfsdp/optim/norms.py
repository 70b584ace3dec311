"""Global norms of owner-sharded gradients: the clip (``clip_grad_norm_``) and the
per-parameter norms Lightning users log (``grad_norm``), each what torch or Lightning
computes over the full gradients under DDP.

Each gradient lives whole on one rank of the shard group; its owner takes its norm and
small all-reduces (``small_comm.all_reduce_norm``) bring every rank all of them.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_matrixfsdp.optim.routing import held
from lightning_matrixfsdp.runtime.comm.core import CommStats, comm_device
from lightning_matrixfsdp.runtime.comm.small import all_reduce_norm
from lightning_matrixfsdp.runtime import norm_groups, tp_group_of
from lightning_matrixfsdp.runtime.tags import expert_slice_of, shard_of, tp_shape_of

__all__ = ["clip_grad_norm_", "clip_grad_norm_pipeline_", "grad_norm"]


def _owned_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None and held(p)]


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
    ``stats`` (default: the sharded module's). ``tp_group`` (tensor parallelism): default the
    sharded module's, or for a list the group of its TP-split parameters (their fragments carry
    it; a list without one is clipped as without tensor parallelism).
    """
    if isinstance(parameters, torch.nn.Module):
        groups = norm_groups(parameters)
        if groups is not None:
            stats = groups.stats if stats is None else stats
            if group is None:
                group = groups.group  # the world under replica_split (one rank holds each gradient)
            if tp_group is None:
                tp_group = groups.tp_group
        parameters = list(parameters.parameters())
    params = list(parameters)
    if tp_group is None:  # a list: the TP fragments among the parameters carry their group
        tp_group = tp_group_of(params)
    norm_type = float(norm_type)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        return _clip_tensor_parallel(params, float(max_norm), norm_type, group, tp_group, error_if_nonfinite, stats)
    if any(expert_slice_of(p) is not None for p in params):
        return _clip_expert_parallel(params, float(max_norm), norm_type, group, error_if_nonfinite, stats)
    if _alone(group):
        # One rank holds every gradient whole (one device, or HSDP's replicas of a one-rank shard
        # group, whose gradients are equal): this is torch's own clipping, its fused kernels included.
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    grads = _owned_grads(params)
    split = [p for p in params if _split(p)]
    if split and norm_type == 0:  # the same list on every rank holding blocks: refused on every rank
        raise ValueError(f"clip_grad_norm_(norm_type=0) counts the gradients with a non-zero entry, but "
                         f"{shard_of(split[0]).fqn!r} is an expert stack split into blocks on several owners, each "
                         "counted on its own; use another norm_type, or split_stacks=False")
    # a split stack's blocks live on several owners: their pieces are added, not their norms
    exact = _same_everywhere(params, group, stats) and not split
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
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None and held(p)], max_norm, total)
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
    mine = [p.grad for p in params if p.grad is not None and held(p) and (first or tp_shape_of(p) is not None)]
    local, maximum = _partial_norm(mine, norm_type, grads[0].device if grads else comm_device(group))
    combined = all_reduce_norm(local, maximum=maximum, group=group, stats=stats)
    if dist.get_world_size(group) < dist.get_world_size():
        combined = all_reduce_norm(combined, maximum=maximum, group=tp_group, stats=stats)
    return _scale_by(grads, _total_norm(combined, norm_type), max_norm, norm_type, error_if_nonfinite)


def _clip_expert_parallel(params: list[torch.Tensor], max_norm: float, norm_type: float,
                          group: Optional[dist.ProcessGroup], error_if_nonfinite: bool,
                          stats: Optional[CommStats]) -> torch.Tensor:
    """The global norm with expert parallelism: each expert counted once. The owners' pieces of
    the other gradients are combined over the norm group, the local experts' over the world, where
    only the first expert-parallel group contributes (the others hold equal copies). The same norm
    as torch's over the whole gradients up to float32 rounding; every rank scales what it holds."""
    grads = _owned_grads(params)
    others = [p.grad for p in params if p.grad is not None and held(p) and expert_slice_of(p) is None]
    experts = [p.grad for p in params if p.grad is not None and (s := expert_slice_of(p)) is not None
               and s.first_replica]
    device = grads[0].device if grads else comm_device(group)
    local, maximum = _partial_norm(others, norm_type, device)
    if _alone(group):
        combined = local.to(comm_device(None))
    else:
        combined = all_reduce_norm(local, maximum=maximum, group=group, stats=stats)
    mine, _ = _partial_norm(experts, norm_type, device)
    combined = _combine(combined, all_reduce_norm(mine, maximum=maximum, group=None, stats=stats), norm_type)
    # in the gradients' dtype, as torch returns it (float64 gradients keep a float64 coefficient)
    total = _total_norm(combined, norm_type, grads[0].dtype if grads else torch.float32)
    return _scale_by(grads, total, max_norm, norm_type, error_if_nonfinite)


@torch.no_grad()
def clip_grad_norm_pipeline_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                             group: Optional[dist.ProcessGroup], pp_group: Optional[dist.ProcessGroup],
                             error_if_nonfinite: bool = False, stats: Optional[CommStats] = None) -> torch.Tensor:
    """Pipeline parallelism: clip by the global norm over every stage, each parameter counted once.
    Each rank adds the pieces of the gradients it owns in its stages; they are summed over the
    stage's norm ``group`` (its shard group), then over ``pp_group`` (one rank of each stage; every
    parameter lives in one stage). ``group=None`` is the world (a stage's norm group under HSDP's
    ``replica_split``, where one replica holds each gradient): that sum already has every stage's
    pieces once, so ``pp_group`` is not summed over again. The same norm as torch's over the unsplit model's gradients up
    to float32 rounding (the order of the sums differs); every rank scales what it holds."""
    grads = _owned_grads(list(params))
    device = grads[0].device if grads else comm_device(group)
    local, maximum = _partial_norm(grads, float(norm_type), device)
    combined = local.to(comm_device(group)) if _alone(group) else all_reduce_norm(local, maximum=maximum,
                                                                                  group=group, stats=stats)
    if group is not None:  # the world (None: HSDP's replica_split) already summed every stage's pieces once
        combined = all_reduce_norm(combined, maximum=maximum, group=pp_group, stats=stats)
    total = _total_norm(combined, float(norm_type), grads[0].dtype if grads else torch.float32)
    return _scale_by(grads, total, float(max_norm), float(norm_type), error_if_nonfinite)


def _scale_by(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float, norm_type: float,
              error_if_nonfinite: bool) -> torch.Tensor:
    """Scale ``grads`` by ``max_norm / total`` (at most 1), after refusing a non-finite total if asked."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so "
                           "it cannot be clipped; pass error_if_nonfinite=False to scale the gradients by it anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _combine(a: torch.Tensor, b: torch.Tensor, p: float) -> torch.Tensor:
    """Two groups' combined pieces (``_partial_norm``'s layout) as one."""
    if p == math.inf or p == -math.inf:
        return torch.stack([torch.maximum(a[0], b[0]), torch.maximum(a[1], b[1]), torch.maximum(a[2], b[2])])
    return a + b


@torch.no_grad()
def grad_norm(module: torch.nn.Module, norm_type: Union[float, int, str], group_separator: str = "/",
              group: Optional[dist.ProcessGroup] = None) -> dict[str, torch.Tensor]:
    """Lightning's ``lightning.pytorch.utilities.grad_norm`` for an owner-sharded module: each
    parameter's gradient norm and their total, from the *full* gradients, the same dict on
    every rank (what DDP logs). Collective: call it on every rank, as from
    ``on_before_optimizer_step``.

    Lightning's own function reads each rank's local gradients, which here are whole on
    their owner and empty elsewhere, so rank 0 would log zeros for what it does not own.
    The keys, the per-parameter norms (``grad.norm(norm_type)`` taken by the owner, in the
    gradient's dtype) and the total are Lightning's. ``group`` as in :func:`clip_grad_norm_`.
    With tensor parallelism each norm is the whole gradient's: the T fragments' partial norms
    are combined in float64 (equal to the whole gradient's norm up to float32 rounding);
    TP-replicated gradients keep their owner's ``grad.norm(norm_type)``.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    groups = norm_groups(module)
    if group is None and groups is not None:
        group = groups.group
    named = list(module.named_parameters())
    if groups is not None and groups.tp_size > 1:
        present, each = _each_norm_tensor_parallel([p for _, p in named], norm_type, group, groups.tp_group,
                                                   groups.stats)
        values = {i: each[i].to(named[i][1].device, named[i][1].dtype) for i in present}
    elif any(_split(p) for _, p in named):
        present, each = _each_norm_split([p for _, p in named], norm_type, group,
                                         groups.stats if groups is not None else None)
        values = {i: each[i].to(named[i][1].device, named[i][1].dtype) for i in present}
    elif any(expert_slice_of(p) is not None for _, p in named):
        present, each = _each_norm_expert_parallel([p for _, p in named], norm_type, group,
                                                   groups.stats if groups is not None else None)
        values = {i: each[i].to(named[i][1].device, named[i][1].dtype) for i in present}
    elif _alone(group):
        present = [i for i, (_, p) in enumerate(named) if p.grad is not None]
        values = {i: named[i][1].grad.norm(norm_type) for i in present}
    else:
        present, each = _each_norm([p for _, p in named], lambda g: g.norm(norm_type), group,
                                   groups.stats if groups is not None else None)
        values = {i: each[i].to(named[i][1].device, named[i][1].dtype) for i in present}
    norms = {f"grad_{norm_type}_norm{group_separator}{named[i][0]}": values[i] for i in present}
    if norms:  # as Lightning: the norm of the per-parameter norms, on the host
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


def _split(p: torch.Tensor) -> bool:
    """Whether ``p`` is a block of an expert stack split over several owners (``runtime/experts/split.py``)."""
    s = shard_of(p)
    return s is not None and s.experts is not None


def _each_norm_split(params: Sequence[torch.Tensor], p: float, group: Optional[dist.ProcessGroup],
                     stats: Optional[CommStats]) -> tuple[list[int], torch.Tensor]:
    """:func:`_each_norm` with split expert stacks: the norm of each whole stack from its owners'
    blocks (``sum |g|^p`` in float64, or ``max |g|``, added or maximized over the shard group, each
    expert once: every block on one owner); the other gradients' norms from their owners as usual."""
    inf = math.isinf(p)
    split = [_split(t) for t in params]
    present, each = _each_norm(params, lambda t, i: t.grad.norm(p), group, stats, keep=lambda i: not split[i])
    device = each.device
    local = torch.zeros(2, len(params), dtype=torch.float64, device=device)
    for i, t in enumerate(params):
        if split[i] and t.grad is not None and held(t):
            local[0, i] = (t.grad.detach().abs().max().double() if inf else _magnitudes(t.grad).pow(p).sum()).to(device)
            local[1, i] = 1.0
    both = all_reduce_norm(local.flatten(), maximum=inf, group=group, stats=stats).view(2, len(params))
    norms = each.clone()
    at = [i for i, s in enumerate(split) if s]
    idx = torch.tensor(at, dtype=torch.long, device=device)
    norms[idx] = both[0, idx] if inf else both[0, idx].pow(1.0 / p)
    found = [i for i in at if both[1, i].item() > 0]
    return sorted(set(present) | set(found)), norms


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


def _each_norm(params: Sequence[torch.Tensor], norm: Callable[..., torch.Tensor],
               group: Optional[dist.ProcessGroup], stats: Optional[CommStats],
               keep: Optional[Callable[[int], bool]] = None) -> tuple[list[int], torch.Tensor]:
    """``norm(grad)`` of every full gradient of ``params`` (the same list on every rank), on
    every rank: the indices that have a gradient somewhere, and a float64 row of the norms.
    Row 0 of one all-reduce carries each norm from its one holder (float64 holds any float
    norm exactly, and adding the other ranks' zeros keeps it), row 1 whether it exists.
    ``keep(i)``: whether this rank contributes parameter ``i`` at all (then ``norm(param, i)``)."""
    device = comm_device(group)
    first = dist.get_rank(group) == 0 if dist.is_available() and dist.is_initialized() else True
    mine = [(i, t) for i, t in enumerate(params) if t.grad is not None
            and (held(t) if shard_of(t) is not None else first) and (keep is None or keep(i))]
    local = torch.zeros(2, len(params), dtype=torch.float64, device=device)
    if mine:
        at = torch.tensor([i for i, _ in mine], device=device)
        values = [norm(t.grad) if keep is None else norm(t, i) for i, t in mine]
        local[0, at] = torch.stack([v.to(device, torch.float64) for v in values])
        local[1, at] = 1.0
    both = all_reduce_norm(local, maximum=False, group=group, stats=stats).view(2, len(params))
    return [i for i, flag in enumerate(both[1].tolist()) if flag > 0], both[0]


def _each_norm_tensor_parallel(params: Sequence[torch.Tensor], p: float, group: Optional[dist.ProcessGroup],
                               tp_group: dist.ProcessGroup, stats: Optional[CommStats]) -> tuple[list[int], torch.Tensor]:
    """:func:`_each_norm` of a tensor-parallel model: the norm of each *whole* gradient, on every
    rank. The owner of a split gradient's fragment sends its partial (``sum |g|^p`` in float64, or
    ``max |g|`` for the infinity norm), which the TP group adds (or takes the maximum of); a
    TP-replicated gradient's norm comes from TP rank 0 alone (the TP ranks hold equal copies)."""
    inf = math.isinf(p)
    split = [tp_shape_of(t) is not None for t in params]

    def part(t: torch.Tensor, i: int) -> torch.Tensor:
        if not split[i] or inf:
            return t.grad.norm(p)
        return _magnitudes(t.grad).pow(p).sum()

    first = dist.get_rank(tp_group) == 0
    present, each = _each_norm(params, part, group, stats, keep=lambda i: split[i] or first)
    flags = torch.zeros(len(params), dtype=torch.float64, device=each.device)
    flags[present] = 1.0
    both = torch.stack([each, flags])
    if dist.get_world_size(group) < dist.get_world_size():  # the norm group is not the world already
        both = all_reduce_norm(both.flatten(), maximum=inf, group=tp_group, stats=stats).view(2, len(params))
    norms = both[0].clone()
    if not inf:
        at = torch.tensor([i for i, s in enumerate(split) if s], dtype=torch.long, device=norms.device)
        norms[at] = norms[at].pow(1.0 / p)
    return [i for i, flag in enumerate(both[1].tolist()) if flag > 0], norms


def _each_norm_expert_parallel(params: Sequence[torch.Tensor], p: float, group: Optional[dist.ProcessGroup],
                               stats: Optional[CommStats]) -> tuple[list[int], torch.Tensor]:
    """:func:`_each_norm` with expert parallelism: the norm of each whole expert stack from the
    first expert-parallel group's slices (``sum |g|^p`` in float64, or ``max |g|``, added or
    maximized over the world); the other gradients' norms from their owners as usual."""
    inf = math.isinf(p)
    slices = [expert_slice_of(t) for t in params]
    present, each = _each_norm(params, lambda t, i: t.grad.norm(p), group, stats, keep=lambda i: slices[i] is None)
    device = each.device
    local = torch.zeros(2, len(params), dtype=torch.float64, device=device)
    for i, (t, s) in enumerate(zip(params, slices)):
        if s is not None and s.first_replica and t.grad is not None:
            local[0, i] = (t.grad.detach().abs().max().double() if inf else _magnitudes(t.grad).pow(p).sum()).to(device)
            local[1, i] = 1.0
    both = all_reduce_norm(local.flatten(), maximum=inf, group=None, stats=stats).view(2, len(params))
    norms = each.clone()
    at = [i for i, s in enumerate(slices) if s is not None]
    if at:
        idx = torch.tensor(at, dtype=torch.long, device=device)
        norms[idx] = both[0, idx] if inf else both[0, idx].pow(1.0 / p)
    found = [i for i in at if both[1, i].item() > 0]
    return sorted(set(present) | set(found)), norms


def _exact_total(params: Sequence[torch.Tensor], p: float, group: Optional[dist.ProcessGroup],
                 stats: Optional[CommStats]) -> torch.Tensor:
    """torch's total norm over the full gradients of ``params`` (the same list on every rank)."""
    present, each = _each_norm(params, lambda g: torch.linalg.vector_norm(g, p), group, stats)
    if not present:
        return torch.tensor(0.0)  # as torch, which has no gradient to take a device from
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in present:  # torch groups the norms by dtype before it stacks them
        by_dtype.setdefault(params[i].dtype, []).append(i)
    home = params[present[0]].device
    norms = torch.cat([each[idx].to(home, dtype) for dtype, idx in by_dtype.items()])
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


def _total_norm(combined: torch.Tensor, p: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # torch.where instead of Python branches: no host synchronization on an accelerator.
    if p == math.inf or p == -math.inf:
        value, nan, any_grad = combined[0], combined[1], combined[2]
        value = value if p > 0 else -value
        value = torch.where(any_grad > 0, value, torch.zeros_like(value))  # no gradient anywhere: 0, as torch
        return torch.where(nan > 0, torch.full_like(value, math.nan), value).to(dtype)
    if p == 0:
        return combined[0].to(dtype)
    total = combined[0] ** (1.0 / p)
    if p < 0:
        total = torch.where(combined[1] > 0, total, torch.zeros_like(total))
    return total.to(dtype)
