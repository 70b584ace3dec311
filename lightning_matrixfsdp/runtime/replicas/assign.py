"""``replica_split``: which replica steps each role (a pure, deterministic assignment).

Under HSDP every replica's owner of a role holds the same gradient after the replica
sum, so without ``replica_split`` all ``R`` of them run the same optimizer update and
hold the same optimizer state. With it, each role is stepped by exactly one replica,
its *stepper*: the others get no gradient for it (their optimizers skip it and hold no
state), and receive the updated weights afterwards (``runtime/replicas/sync.py``).

Shard rank ``r`` owns the same roles in every replica, so the assignment is made per
shard rank: its roles are spread over the ``R`` replicas by the planner's cost model,
optimizer FLOPs first (Newton-Schulz for a matrix, AdamW's per-element cost for the
rest), largest role first, each to the replica with the smallest load so far; ties go
by resident bytes, then by replica index, and roles are ordered by unit order and name.
No tensors and no process group: every rank computes the same result.
"""

from __future__ import annotations

from typing import Sequence

from lightning_matrixfsdp.runtime.placement import ParamSpec, Plan, UnitSpec
from lightning_matrixfsdp.runtime.roles import role_cost, unit_roles

__all__ = ["assign_steppers"]


def assign_steppers(plan: Plan, units: Sequence[UnitSpec], replicas: int,
                    ns_steps: int = 5) -> tuple[dict[str, int], list[list[int]]]:
    """``(steppers, flops)``: the stepping replica of every parameter (by fqn; all
    parameters of a role share it) and the optimizer FLOPs per step of each
    ``(replica, shard rank)`` under that assignment."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    owners = plan.owners
    # per shard rank: (flops, bytes, unit index, key, params) of every role it owns
    per_rank: list[list[tuple[int, int, int, str, tuple[ParamSpec, ...]]]] = [[] for _ in range(plan.world)]
    for i, unit in enumerate(units):
        for role in unit_roles(i, unit, ns_steps):
            # A custom planner may split a role over owners: each owner's part is a role here.
            by_owner: dict[int, list[ParamSpec]] = {}
            for p in role.params:
                by_owner.setdefault(owners[p.fqn], []).append(p)
            for owner, params in sorted(by_owner.items()):
                nbytes, flops = role_cost(role.kind, params, ns_steps)
                per_rank[owner].append((flops, nbytes, i, params[0].fqn, tuple(params)))
    steppers: dict[str, int] = {}
    flops_of = [[0] * plan.world for _ in range(replicas)]
    for rank, roles in enumerate(per_rank):
        loads_f = [0] * replicas
        loads_b = [0] * replicas
        for flops, nbytes, _, _, params in sorted(roles, key=lambda t: (-t[0], -t[1], t[2], t[3])):
            k = min(range(replicas), key=lambda j: (loads_f[j], loads_b[j], j))
            loads_f[k] += flops
            loads_b[k] += nbytes
            flops_of[k][rank] += flops
            for p in params:
                steppers[p.fqn] = k
    return steppers, flops_of
