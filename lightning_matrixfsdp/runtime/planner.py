"""Planners: assign every role of every unit to an owner rank, and the complete plan.

All planners are deterministic (ties broken by rank index, then by unit order and
fqn), so every rank computes the same plan without communicating. Roles and their
costs are ``roles.py``'s; :data:`PLANNERS` is the one registry of planner names;
:func:`make_plan` returns the whole plan, the stepping replicas of ``replica_split``
included (``replicas/assign.py``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from lightning_matrixfsdp.runtime.placement import MatrixShard, Plan, RoleKind, UnitLayout, UnitSpec
from lightning_matrixfsdp.runtime.replicas.assign import assign_steppers
from lightning_matrixfsdp.runtime.roles import Role, newton_schulz_flops, role_cost, unit_roles
from lightning_matrixfsdp.runtime.experts.split import Splits, block_roles, check_splits, choose_splits

__all__ = ["PLANNERS", "Role", "make_plan", "newton_schulz_flops", "role_cost", "unit_roles"]

#: A custom planner: ``(units, shard span) -> Plan``.
CustomPlanner = Callable[[Sequence[UnitSpec], int], Plan]


def _largest_first(roles: list[Role]) -> list[Role]:
    return sorted(roles, key=lambda r: (-r.nbytes, r.unit_index, r.key))


def _lightest(loads: list[int]) -> int:
    return min(range(len(loads)), key=lambda r: (loads[r], r))


def _assign(roles: list[Role], world: int, loads_b: list[int], loads_f: list[int],
            fixed: Sequence[tuple[int, Role]] = ()) -> dict[str, int]:
    """Each role to the rank with the least resident bytes so far, largest first; the ``fixed``
    (rank, role) pairs (a split stack's blocks, each on its own rank) are counted first."""
    for r, role in fixed:
        loads_b[r] += role.nbytes
        loads_f[r] += role.flops
    owners: dict[str, int] = {}
    for role in _largest_first(roles):
        r = _lightest(loads_b)
        owners[role.key] = r
        loads_b[r] += role.nbytes
        loads_f[r] += role.flops
    return owners


def _layouts(units: Sequence[UnitSpec], roles: list[list[Role]], owners: dict[str, int], world: int,
             splits: Optional[Splits] = None) -> list[UnitLayout]:
    splits = splits or {}
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
            if p.fqn in splits:  # one entry per block of experts, block r on rank r
                start = 0
                for o, count in enumerate(splits[p.fqn]):
                    piece = MatrixShard(p.fqn, unit.fqn, tuple(p.shape), p.dtype, RoleKind.MATRIX, o, offsets[o],
                                        p.requires_grad, p.stack, (start, start + count))
                    shards.append(piece)
                    offsets[o] += piece.numel
                    start += count
                continue
            o = owner_of[p.fqn]
            stack = p.stack if kind_of[p.fqn] is RoleKind.MATRIX else None
            shards.append(MatrixShard(p.fqn, unit.fqn, tuple(p.shape), p.dtype, kind_of[p.fqn], o,
                                      offsets[o], p.requires_grad, stack))
            offsets[o] += p.numel
        layouts.append(UnitLayout(unit.fqn, world, tuple(shards)))
    return layouts


def _roles(units: Sequence[UnitSpec], world: int, ns_steps: int, split: bool
           ) -> tuple[list[list[Role]], list[list[tuple[int, Role]]], Splits]:
    """Every unit's roles to assign, its split stacks' blocks (rank, role) and the splits."""
    roles = [unit_roles(i, u, ns_steps) for i, u in enumerate(units)]
    splits = choose_splits(roles, world) if split else {}
    fixed = [block_roles(rs, splits, ns_steps) for rs in roles]
    return [[r for r in rs if r.key not in splits] for rs in roles], fixed, splits


def _plan_role_greedy(units: Sequence[UnitSpec], world: int, ns_steps: int, split: bool = False) -> Plan:
    roles, fixed, splits = _roles(units, world, ns_steps, split)
    loads_b, loads_f = [0] * world, [0] * world
    owners: dict[str, int] = {}
    for unit_roles_, blocks in zip(roles, fixed):  # unit by unit, loads carried across units
        owners.update(_assign(unit_roles_, world, loads_b, loads_f, blocks))
    return Plan(world, "role_greedy", _layouts(units, roles, owners, world, splits), loads_b, loads_f)


def _plan_scope_greedy(units: Sequence[UnitSpec], world: int, ns_steps: int, split: bool = False) -> Plan:
    roles, fixed, splits = _roles(units, world, ns_steps, split)
    loads_b, loads_f = [0] * world, [0] * world
    owners = _assign([r for rs in roles for r in rs], world, loads_b, loads_f, [b for bs in fixed for b in bs])
    return Plan(world, "scope_greedy", _layouts(units, roles, owners, world, splits), loads_b, loads_f)


def _score(plan: Plan) -> float:
    return max(plan.memory_imbalance, plan.compute_imbalance)


def _plan_cost_aware(units: Sequence[UnitSpec], world: int, ns_steps: int, gamma_cap: float,
                     split: bool = False) -> Plan:
    """The scope plan if it balances better and keeps every unit's gamma under the cap."""
    role = _plan_role_greedy(units, world, ns_steps, split)
    scope = _plan_scope_greedy(units, world, ns_steps, split)
    cap = max(gamma_cap, role.max_gamma)
    chosen = scope if (_score(scope) < _score(role) and scope.max_gamma <= cap) else role
    chosen.options["chosen"] = chosen.planner
    chosen.planner = "cost_aware"
    return chosen


#: The built-in planners by name, each ``(units, span, ns_steps, gamma_cap, split_stacks) -> Plan``: the
#: one list of planner names (``options.check_planner`` accepts these keys).
PLANNERS: dict[str, Callable[[Sequence[UnitSpec], int, int, float, bool], Plan]] = {
    "role_greedy": lambda units, world, ns_steps, gamma_cap, split: _plan_role_greedy(units, world, ns_steps, split),
    "scope_greedy": lambda units, world, ns_steps, gamma_cap, split: _plan_scope_greedy(units, world, ns_steps,
                                                                                        split),
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
    split_stacks: bool = False,
) -> Plan:
    """The complete plan for ``units`` over a shard span of ``world`` ranks and ``replicate``
    replicas; with ``replica_split`` (and more than one replica) each role's stepping replica
    too (``Plan.steppers``). ``split_stacks``: the built-in planners may split an expert stack
    into contiguous blocks of experts, block ``r`` owned by rank ``r`` (``experts/split.py``);
    the caller says whether the run can serve split stacks at all."""
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
        plan = PLANNERS[planner](units, world, ns_steps, gamma_cap, split_stacks)
    else:
        raise ValueError(f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)} or pass a callable")
    check_splits(plan, units, split_stacks)  # a custom planner's splits too
    plan.replicate = replicate
    plan.options.setdefault("ns_steps", ns_steps)
    if replica_split and replicate > 1:
        plan.steppers, plan.replica_flops = assign_steppers(plan, units, replicate, ns_steps)
    return plan
