"""Owner routing: any torch optimizer steps exactly the resident parameters a rank owns.

``route_optimizer`` edits ``param_groups`` in place (LR schedulers hold a reference
to the optimizer object, so it must not be replaced): non-owned placeholders are
dropped, group order and hyper-parameters are kept, so a scheduler's per-group
values still line up.  Groups added later (``add_param_group``, e.g. by a fine-tuning
callback) are routed as they arrive.  Each group's parameters as the user gave them
stay on record (:func:`full_param_groups`): code that must see the same lists on every
rank (Lightning's ``toggle_optimizer``, the clip's parameter order) reads them there.
Nothing here communicates; the global norms of owner-sharded gradients are in ``norms.py``.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from lightning_matrixfsdp.optim.tail import TailOptimizer
from lightning_matrixfsdp.runtime.tags import is_owned, tp_of

__all__ = ["full_param_groups", "full_params", "held", "is_owned", "route_optimizer"]

# Per param group: (its parameters as given, the routed list object that replaced them). A
# record is valid while the group still holds that very list (``load_state_dict`` keeps it; a
# group assigned anew, as ``BaseFinetuning`` does on resume, is routed again).
_FULL = "_mfsdp_full_groups"
_ADD = "_mfsdp_routes_added_groups"


def held(p: torch.Tensor) -> bool:
    """Whether this rank holds ``p`` (owned and not an empty placeholder)."""
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
        kept = [p for p in full if held(p)]
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
