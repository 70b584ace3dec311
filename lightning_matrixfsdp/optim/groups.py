"""Which update each parameter gets: the optimizer's param groups decide, under every strategy.

The Muon recipe (embeddings, the output head and per-expert biases on AdamW; expert stacks
stepped per expert; every other matrix on Muon) is applied by building the optimizer from the
module: ``Muon(model, ...)``, or ``Muon(param_groups(model), ...)`` to add per-group options.
Each group then carries ``"role": "matrix"`` or ``"role": "adamw"``, which the step follows.
A group without a role (bare ``model.parameters()``) goes by shape: 2-D tensors on the matrix
optimizer, everything else on AdamW - the same under DDP, one device, Lightning's FSDP and
``matrix_fsdp``, because nothing here reads how the strategy placed a tensor. The two
exceptions are the strategy's explicit options ``matrix_filter`` (a 2-D parameter it rejects
is trained by AdamW) and ``flatten_conv`` (a kernel it accepts is a matrix).

:func:`routing_line` is the one-line account each optimizer logs when it is built.
Nothing here communicates.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from torch import Tensor, nn

from lightning_matrixfsdp.runtime.classify import recipe_roles
from lightning_matrixfsdp.runtime.placement import RoleKind
from lightning_matrixfsdp.runtime.tags import role_of, shard_of, stack_of, tag_stack

__all__ = ["ROLES", "check_role", "param_groups", "routes_to_matrix", "routing_line"]

log = logging.getLogger("lightning_matrixfsdp.roles")

#: the values of a param group's ``"role"`` key (absent: by shape)
ROLES = ("matrix", "adamw")


def param_groups(module: nn.Module, *, matrix: Optional[Mapping[str, Any]] = None,
                 adamw: Optional[Mapping[str, Any]] = None, expert_stacks: Any = None) -> list[dict[str, Any]]:
    """The Muon recipe as param groups of all of ``module``'s parameters (frozen ones too, as
    ``module.parameters()`` gives them; they are skipped while they have no gradient): ``{"params": [...],
    "role": "matrix", **matrix}`` then ``{"params": [...], "role": "adamw", **adamw}`` (an empty
    group is left out). ``matrix`` / ``adamw``: per-group options (e.g. ``{"weight_decay": 0}``).
    ``expert_stacks``: the user's own stacks, in the strategy option's forms (docs/moe.md).

    The same groups on a plain model under any strategy and on a model ``matrix_shard`` sharded
    (which recorded the recipe before its tensors moved). Expert stacks of a plain model are
    tagged so the optimizer steps each expert as its own matrix."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"param_groups expects an nn.Module, got {type(module).__name__}")
    roles = recipe_roles(module, expert_stacks)
    mats: list[Tensor] = []
    rest: list[Tensor] = []
    for fqn, p in module.named_parameters():
        choice = roles[fqn]
        if choice.stack is not None and stack_of(p) is None:
            tag_stack(p, choice.stack)  # a plain model: the optimizer cuts the stack into its experts
        (mats if choice.is_matrix else rest).append(p)
    groups = []
    if mats:
        groups.append({**(matrix or {}), "params": mats, "role": "matrix"})
    if rest:
        groups.append({**(adamw or {}), "params": rest, "role": "adamw"})
    return groups


def check_role(group: Mapping[str, Any], who: str) -> None:
    """Raise ValueError for a ``"role"`` other than :data:`ROLES` (or absent)."""
    role = group.get("role")
    if role is not None and role not in ROLES:
        raise ValueError(f"{who}: a param group's role must be one of {ROLES} or absent (by shape), got {role!r}")


def routes_to_matrix(p: Tensor, group: Mapping[str, Any]) -> bool:
    """Whether ``p`` of ``group`` goes to the matrix optimizer: the group's ``role`` if it has one;
    else the strategy's explicit placement (``matrix_filter`` / ``flatten_conv``: its role tag);
    else its shape, 2-D. An expert stack without a ``"matrix"`` group goes to AdamW, as any 3-D
    tensor does in a plain run (build the optimizer from the module to step it per expert)."""
    role = group.get("role")
    if role is not None:
        return role == "matrix"
    tag = role_of(p)
    if tag is not None:
        return tag is RoleKind.MATRIX and stack_of(p) is None
    return p.ndim == 2


def routing_line(who: str, groups: Iterable[Mapping[str, Any]], names: Optional[Mapping[int, str]] = None) -> str:
    """One line: how many tensors each update gets and why (``names``: id -> fqn, to name the
    recipe's 2-D tensors on AdamW)."""
    grouped = ungrouped = 0
    n_matrix = n_stack = n_adamw = n_adamw_2d = 0
    named_2d: list[str] = []
    for group in groups:
        by_role = group.get("role") is not None
        for p in group["params"]:
            grouped += by_role
            ungrouped += not by_role
            if routes_to_matrix(p, group):
                n_stack += stack_of(p) is not None and group.get("role") == "matrix"
                n_matrix += 1
            else:
                n_adamw += 1
                two_d = _whole_ndim(p) == 2
                n_adamw_2d += two_d
                if two_d and names and id(p) in names and len(named_2d) < 4:
                    named_2d.append(names[id(p)])
    stacks = f" ({n_stack} expert stacks, each expert a matrix)" if n_stack else ""
    flat = f" ({n_adamw_2d} of them 2-D{': ' + ', '.join(named_2d) if named_2d else ''}" \
           f"{' ...' if n_adamw_2d > len(named_2d) and named_2d else ''})" if n_adamw_2d else ""
    if ungrouped and not grouped:
        how = ("bare parameters, by shape: every 2-D tensor on the matrix optimizer, embeddings and output head "
               "included; build it from the module, e.g. Muon(model), for the Muon recipe")
    elif grouped and not ungrouped:
        how = "param groups with roles (the Muon recipe when built from the module)"
    else:
        how = "groups with roles as they say, the others by shape"
    return f"{who}: {n_matrix} tensors on the matrix optimizer{stacks}, {n_adamw} on AdamW{flat}; {how}"


def _whole_ndim(p: Tensor) -> int:
    """Dimensions of the whole parameter (a sharded placeholder records its shape in its tags)."""
    shard = shard_of(p)
    return len(shard.shape) if shard is not None else p.ndim
