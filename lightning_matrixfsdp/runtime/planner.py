"""Planners: assign every role of every unit to an owner rank, and the complete plan.

All planners are deterministic (ties broken by rank index, then by unit order and
fqn), so every rank computes the same plan without communicating. Roles and their
costs are ``roles.py``'s; :data:`PLANNERS` is the one registry of planner names;
:func:`make_plan` returns the whole plan, the stepping replicas of ``replica_split``
included (``replicas.py``).
"""

from __future__ import annotations

from typing import Callable, Sequence

from lightning_matrixfsdp.runtime.placement import MatrixShard, Plan, RoleKind, UnitLayout, UnitSpec
from lightning_matrixfsdp.runtime.replicas import assign_steppers
from lightning_matrixfsdp.runtime.roles import Role, newton_schulz_flops, role_cost, unit_roles

__all__ = ["PLANNERS", "Role", "make_plan", "newton_schulz_flops", "role_cost", "unit_roles"]

#: A custom planner: ``(units, shard span) -> Plan``.
CustomPlanner = Callable[[Sequence[UnitSpec], int], Plan]


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
            stack = p.stack if kind_of[p.fqn] is RoleKind.MATRIX else None
            shards.append(MatrixShard(p.fqn, unit.fqn, tuple(p.shape), p.dtype, kind_of[p.fqn], o,
                                      offsets[o], p.requires_grad, stack))
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


#: The built-in planners by name, each ``(units, span, ns_steps, gamma_cap) -> Plan``: the one
#: list of planner names (``options.check_planner`` accepts these keys).
PLANNERS: dict[str, Callable[[Sequence[UnitSpec], int, int, float], Plan]] = {
    "role_greedy": lambda units, world, ns_steps, gamma_cap: _plan_role_greedy(units, world, ns_steps),
    "scope_greedy": lambda units, world, ns_steps, gamma_cap: _plan_scope_greedy(units, world, ns_steps),
    "cost_aware": _plan_cost_aware,
}


def make_plan(
    units: Sequence[UnitSpec],
    world: int,
    planner: str | CustomPlanner = "role_greedy",
    *,
    ns_steps: int = 5,
    gamma_cap: float = 2.0,
    replicate: int = 1,
    replica_split: bool = False,
) -> Plan:
    """The complete plan for ``units`` over a shard span of ``world`` ranks and ``replicate``
    replicas; with ``replica_split`` (and more than one replica) each role's stepping replica
    too (``Plan.steppers``)."""
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
    elif planner in PLANNERS:
        plan = PLANNERS[planner](units, world, ns_steps, gamma_cap)
    else:
        raise ValueError(f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)} or pass a callable")
    plan.replicate = replicate
    plan.options.setdefault("ns_steps", ns_steps)
    if replica_split and replicate > 1:
        plan.steppers, plan.replica_flops = assign_steppers(plan, units, replicate, ns_steps)
    return plan
