"""The cost model: a role (one matrix, or one unit's packed tail) and what it costs.

A role's resident bytes are its parameters plus, when trainable, gradients and
optimizer state (Muon keeps one momentum buffer, AdamW two moments); a matrix role's
optimizer FLOPs are those of Newton-Schulz. Pure: the planners (``planner.py``) and
the stepping-replica assignment (``replicas/assign.py``) both price roles here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_matrixfsdp.runtime.experts.stacks import ExpertStack
from lightning_matrixfsdp.runtime.placement import ParamSpec, RoleKind, UnitSpec

__all__ = ["Role", "newton_schulz_flops", "role_cost", "unit_roles"]


def newton_schulz_flops(shape: Sequence[int], steps: int = 5, stack: Optional[ExpertStack] = None) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on an m x n matrix (m <= n).

    Each iteration forms ``A = X X^T`` (2 m^2 n), ``B = b A + c A A`` (2 m^3) and
    ``X' = a X + B X`` (2 m^2 n). A shape of more than two dimensions (a convolution
    kernel under ``flatten_conv``) counts as its ``(shape[0], prod(rest))`` matrix. An expert
    ``stack`` ``[E, m, n]`` counts each of its ``shape[0]`` experts, each as its row blocks: E
    separate iterations per block, not one on a flattened matrix (a stack stored transposed,
    ``[E, in, out]``, counts its ``(out_j, in)`` blocks: ``ExpertStack.matrix_shapes``).
    """
    if stack is not None and len(shape) == 3:
        return int(shape[0]) * sum(newton_schulz_flops(m, steps) for m in stack.matrix_shapes(tuple(shape)))
    if len(shape) < 2:
        return 0
    rows = int(shape[0])
    cols = 1
    for s in shape[1:]:
        cols *= int(s)
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m ** 3)


@dataclass(frozen=True)
class Role:
    """A unit of ownership: one matrix, or one unit's packed tail."""

    unit_index: int
    kind: RoleKind
    params: tuple[ParamSpec, ...]
    nbytes: int
    flops: int

    @property
    def key(self) -> str:
        return self.params[0].fqn


def role_cost(kind: RoleKind, params: Sequence[ParamSpec], ns_steps: int = 5) -> tuple[int, int]:
    """(resident bytes, optimizer FLOPs per step) of a role."""
    nbytes = 0
    flops = 0
    for p in params:
        if not p.requires_grad:
            nbytes += p.nbytes
            continue
        if kind is RoleKind.MATRIX and not p.recipe_adamw:
            nbytes += 3 * p.nbytes  # param, grad, momentum
            flops += newton_schulz_flops(p.shape, ns_steps, p.stack)
        else:
            nbytes += 4 * p.nbytes  # param, grad, exp_avg, exp_avg_sq
            flops += 12 * p.numel  # AdamW's elementwise update
    return nbytes, flops


def unit_roles(unit_index: int, unit: UnitSpec, ns_steps: int = 5) -> list[Role]:
    """Split a unit into its matrix roles and its tail.

    The tail packs the small (0-D/1-D) parameters into one role.  A 2D+ parameter
    kept off the matrix path (an embedding or LM head sent to AdamW by
    ``matrix_filter``) is a tail role of its own: packing it with the rest would
    hand one rank most of the unit (gamma near W) and make it the busiest sender.
    """
    roles: list[Role] = []
    tail: list[ParamSpec] = []
    for p in unit.params:
        if p.is_matrix:
            b, f = role_cost(RoleKind.MATRIX, [p], ns_steps)
            roles.append(Role(unit_index, RoleKind.MATRIX, (p,), b, f))
        elif len(p.shape) >= 2:
            b, f = role_cost(RoleKind.TAIL, [p], ns_steps)
            roles.append(Role(unit_index, RoleKind.TAIL, (p,), b, f))
        else:
            tail.append(p)
    if tail:
        b, f = role_cost(RoleKind.TAIL, tail, ns_steps)
        roles.append(Role(unit_index, RoleKind.TAIL, tuple(tail), b, f))
    return roles
