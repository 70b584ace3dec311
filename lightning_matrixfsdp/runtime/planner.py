"""Planners: assign every role of every unit to an owner rank.

All planners are deterministic (ties broken by rank index, then by unit order and
fqn), so every rank computes the same plan without communicating.  The cost model:
a role's resident bytes are its parameters plus, when trainable, gradients and
optimizer state (Muon keeps one momentum buffer, AdamW two moments); a matrix
role's optimizer FLOPs are those of Newton-Schulz.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from lightning_matrixfsdp.runtime.placement import (
    MatrixShard,
    ParamSpec,
    Plan,
    RoleKind,
    UnitLayout,
    UnitSpec,
)


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> int:
    """FLOPs of ``steps`` Newton-Schulz iterations on an m x n matrix (m <= n).

    Each iteration forms ``A = X X^T`` (2 m^2 n), ``B = b A + c A A`` (2 m^3) and
    ``X' = a X + B X`` (2 m^2 n). A shape of more than two dimensions (a convolution
    kernel under ``flatten_conv``) counts as its ``(shape[0], prod(rest))`` matrix.
    """
    if len(shape) < 2:
        return 0
    rows = int(shape[0])
    cols = 1
    for s in shape[1:]:
        cols *= int(s)
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m ** 3)


PLANNERS = ("role_greedy", "scope_greedy", "cost_aware")


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
        if kind is RoleKind.MATRIX:
            nbytes += 3 * p.nbytes  # param, grad, momentum
            flops += newton_schulz_flops(p.shape, ns_steps)
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


def _largest_first(roles: list[Role]) -> list[Role]:
    return sorted(roles, key=lambda r: (-r.nbytes, r.unit_index, r.key))


def _lightest(loads: list[int]) -> int:
    return min(range(len(loads)), key=lambda r: (loads[r], r))


def _assign(roles: list[Role], world: int, loads_b: list[int], loads_f: list[int]) -> dict[str, int]:
    owners: dict[str, int] = {}
    for role in _largest_first(roles):
        r = _lightest(loads_b)
        owners[role.key] = r
        loads_b[r] += role.nbytes
        loads_f[r] += role.flops
    return owners


def _layouts(units: Sequence[UnitSpec], roles: list[list[Role]], owners: dict[str, int], world: int) -> list[UnitLayout]:
    layouts = []
    for unit, unit_roles_ in zip(units, roles):
        owner_of = {}
        kind_of = {}
        for role in unit_roles_:
            for p in role.params:
                owner_of[p.fqn] = owners[role.key]
                kind_of[p.fqn] = role.kind
        offsets = [0] * world
        shards = []
        for p in unit.params:
            o = owner_of[p.fqn]
            shards.append(MatrixShard(p.fqn, unit.fqn, tuple(p.shape), p.dtype, kind_of[p.fqn], o,
                                      offsets[o], p.requires_grad))
            offsets[o] += p.numel
        layouts.append(UnitLayout(unit.fqn, world, tuple(shards)))
    return layouts


def _plan_role_greedy(units: Sequence[UnitSpec], world: int, ns_steps: int) -> Plan:
    roles = [unit_roles(i, u, ns_steps) for i, u in enumerate(units)]
    loads_b, loads_f = [0] * world, [0] * world
    owners: dict[str, int] = {}
    for unit_roles_ in roles:  # unit by unit, loads carried across units
        owners.update(_assign(unit_roles_, world, loads_b, loads_f))
    return Plan(world, "role_greedy", _layouts(units, roles, owners, world), loads_b, loads_f)


def _plan_scope_greedy(units: Sequence[UnitSpec], world: int, ns_steps: int) -> Plan:
    roles = [unit_roles(i, u, ns_steps) for i, u in enumerate(units)]
    loads_b, loads_f = [0] * world, [0] * world
    owners = _assign([r for rs in roles for r in rs], world, loads_b, loads_f)
    return Plan(world, "scope_greedy", _layouts(units, roles, owners, world), loads_b, loads_f)


def _score(plan: Plan) -> float:
    return max(plan.memory_imbalance, plan.compute_imbalance)


def _plan_cost_aware(units: Sequence[UnitSpec], world: int, ns_steps: int, gamma_cap: float) -> Plan:
    """The scope plan if it balances better and keeps every unit's gamma under the cap."""
    role = _plan_role_greedy(units, world, ns_steps)
    scope = _plan_scope_greedy(units, world, ns_steps)
    cap = max(gamma_cap, role.max_gamma)
    chosen = scope if (_score(scope) < _score(role) and scope.max_gamma <= cap) else role
    chosen.options["chosen"] = chosen.planner
    chosen.planner = "cost_aware"
    return chosen


def make_plan(
    units: Sequence[UnitSpec],
    world: int,
    planner: str | Callable[[Sequence[UnitSpec], int], Plan] = "role_greedy",
    *,
    ns_steps: int = 5,
    gamma_cap: float = 2.0,
    replicate: int = 1,
) -> Plan:
    """Build the plan for ``units`` over a shard span of ``world`` ranks."""
    if world < 1:
        raise ValueError(f"shard span must be >= 1, got {world}")
    seen: set[str] = set()
    for u in units:
        for p in u.params:
            if p.fqn in seen:
                raise ValueError(f"parameter {p.fqn!r} appears in more than one unit")
            seen.add(p.fqn)
    if callable(planner):
        plan = planner(units, world)
        if not isinstance(plan, Plan):
            raise TypeError(f"a custom planner must return a Plan, got {type(plan).__name__}")
    elif planner == "role_greedy":
        plan = _plan_role_greedy(units, world, ns_steps)
    elif planner == "scope_greedy":
        plan = _plan_scope_greedy(units, world, ns_steps)
    elif planner == "cost_aware":
        plan = _plan_cost_aware(units, world, ns_steps, gamma_cap)
    else:
        raise ValueError(f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)} or pass a callable")
    plan.replicate = replicate
    plan.options.setdefault("ns_steps", ns_steps)
    return plan
