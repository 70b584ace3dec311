"""Whether this rank holds a parameter whole: one rule for every way a rank holds less.

Between steps a rank of a sharded model may hold a parameter in part only:

* an *empty placeholder* ``(0, *shape[1:])`` of a role another rank of its shard group owns;
* its *tensor-parallel fragment* of a matrix the TP plan splits;
* its *expert-parallel slice* ``[E/EP, ...]`` of an expert stack (its own experts);
* its *block of experts* of a stack the planner split between owners.

(A pipeline stage, if one is ever served, would keep the other stages' parameters as marked
placeholders, as owners do, and fall under the first case.)

Each of these marks the parameter with the shape of the whole tensor it stands for
(``tags.py``: the placement record's shape, the TP fragment's whole shape, the expert slice's
whole stack shape). The rule is the same for all of them: **a resident tensor is whole exactly
when its shape is the whole shape its marks record**; an unmarked tensor is whole. Readers that
must not hand out part of the model (``views/state_dict``) ask only this module, so a new way of
holding less needs a mark, not a new check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_matrixfsdp.runtime.tags import expert_slice_of, is_owned, shard_of, tp_shape_of

__all__ = ["PartialTensor", "is_whole", "partial_kind", "partial_tensors", "whole_shape"]

PLACEHOLDER = "empty placeholder"
TP_FRAGMENT = "tensor-parallel fragment"
EXPERT_SLICE = "expert-parallel slice"
STACK_BLOCK = "block of a split expert stack"


@dataclass(frozen=True)
class PartialTensor:
    """One parameter this rank holds in part: its name, its resident and whole shapes, and why."""

    name: str
    shape: tuple[int, ...]
    whole: tuple[int, ...]
    kind: str  # one of the constants above
    detail: str = ""  # e.g. which experts an expert-parallel slice holds


def whole_shape(p: Any) -> tuple[int, ...]:
    """The shape of the whole tensor ``p`` stands for, as its marks record it (``p``'s own shape
    when unmarked)."""
    tp = tp_shape_of(p)
    if tp is not None:  # a TP-split parameter: the shape over the whole TP group
        return tuple(tp)
    experts = expert_slice_of(p)
    if experts is not None:  # this rank's experts: the whole stack over the expert-parallel group
        return tuple(experts.global_shape)
    shard = shard_of(p)
    if shard is not None:  # owner placement (a split stack's entry records the whole stack's shape)
        return tuple(shard.shape)
    return tuple(p.shape)


def is_whole(p: Any) -> bool:
    """Whether this rank's tensor of ``p`` is the whole tensor (the one rule above)."""
    return tuple(p.shape) == whole_shape(p)


def partial_kind(p: Any) -> Optional[str]:
    """None where ``p`` is whole here, else which way this rank holds part of it."""
    if is_whole(p):
        return None
    if not is_owned(p):
        return PLACEHOLDER
    if expert_slice_of(p) is not None:
        return EXPERT_SLICE
    if tp_shape_of(p) is not None:
        return TP_FRAGMENT
    shard = shard_of(p)
    if shard is not None and shard.experts is not None:
        return STACK_BLOCK
    return "part"  # marked with a whole shape it does not have, by a way not named above


def _detail(p: Any) -> str:
    s = expert_slice_of(p)
    if s is not None:
        return f"experts {s.first}-{s.first + s.count - 1} of {s.num_experts}"
    shard = shard_of(p)
    if shard is not None and shard.experts is not None and is_owned(p):
        return f"experts {shard.experts[0]}-{shard.experts[1] - 1} of {shard.shape[0]}"
    return ""


def partial_tensors(module: nn.Module, recurse: bool = True) -> list[PartialTensor]:
    """Every parameter of ``module`` (its own only, without ``recurse``) this rank holds in part,
    in ``named_parameters`` order. Local: it reads the marks, nothing else."""
    out = []
    for name, p in module.named_parameters(recurse=recurse):
        kind = partial_kind(p)
        if kind is not None:
            out.append(PartialTensor(name, tuple(p.shape), whole_shape(p), kind, _detail(p)))
    return out
