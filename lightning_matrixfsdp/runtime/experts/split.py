"""Split expert stacks: when a stack's experts go to several owners, and what each block costs. Pure.

A stack ``[E, m, n]`` placed whole is one role on one owner. When a unit's roles placed whole
leave its busiest owner well above an even share (resident bytes or Newton-Schulz FLOPs, each
stack priced per expert), the planner *splits* the fewest of its largest stacks that bring it
within 1.25 times the even share (or come closest): rank ``r`` of the shard group owns the contiguous experts of ``torch.chunk``'s ``r``-th
chunk (``chunk_sizes(E, W)``: ``ceil(E / W)`` experts each, the last ranks fewer).
A stack is split only when every rank gets at least one expert. That layout is the one a
``Shard(0)`` DTensor over the shard group has, which is how checkpoints store each owner's
block as a chunk of the global ``[E, ...]`` tensor (as expert parallelism stores its slices).
The other roles are then assigned around the blocks (``planner.py``).
"""

from __future__ import annotations

from typing import Sequence

from lightning_matrixfsdp.runtime.placement import ParamSpec, Plan, RoleKind, UnitSpec
from lightning_matrixfsdp.runtime.roles import Role, role_cost

__all__ = ["Splits", "block_roles", "check_splits", "choose_splits", "chunk_sizes"]

#: fqn -> number of experts of each rank's block (rank order)
Splits = dict[str, tuple[int, ...]]


def chunk_sizes(n: int, parts: int) -> tuple[int, ...]:
    """``torch.chunk``'s sizes of ``n`` rows in ``parts`` (empty chunks padded): DTensor's ``Shard``
    (the same as ``tp.chunk_sizes``, which this pure module cannot import: ``tp`` imports the
    options, which import the planners)."""
    step = -(-n // parts) if n else 0
    return tuple(max(0, min(step, n - i * step)) for i in range(parts))


def _splittable(role: Role, world: int) -> bool:
    p = role.params[0]
    return (world > 1 and role.kind is RoleKind.MATRIX and p.stack is not None and len(p.shape) == 3
            and min(chunk_sizes(int(p.shape[0]), world)) > 0)


#: A unit whose busiest owner would hold more than this times the even share (bytes or Newton-Schulz
#: FLOPs) with its stacks whole gets a stack split.
IMBALANCE = 1.25


def _unit_gamma(unit: Sequence[Role], split: set[str], world: int) -> float:
    """Busiest owner over the even share (the worse of bytes and FLOPs) of one unit placed alone:
    the ``split`` stacks' blocks on their ranks, every other role whole, largest first, on the
    lightest rank (the planners' greedy)."""
    loads_b, loads_f = [0] * world, [0] * world
    for r in unit:
        if r.key in split:
            e = int(r.params[0].shape[0])
            for rank, count in enumerate(chunk_sizes(e, world)):
                loads_b[rank] += r.nbytes * count // e
                loads_f[rank] += r.flops * count // e
    for r in sorted((r for r in unit if r.key not in split), key=lambda r: (-r.nbytes, r.key)):
        k = min(range(world), key=lambda i: (loads_b[i], i))
        loads_b[k] += r.nbytes
        loads_f[k] += r.flops
    return max(max(loads) * world / sum(loads) for loads in (loads_b, loads_f) if sum(loads) > 0)


def choose_splits(roles: Sequence[Sequence[Role]], world: int) -> Splits:
    """The stacks to split (every unit's roles given). Per unit, its stacks largest first (bytes, then
    FLOPs, then name): split the fewest of them that bring the busiest owner within
    :data:`IMBALANCE` times the even share, or, where no number does, the number that comes closest
    (none when splitting does not help)."""
    out: Splits = {}
    for unit in roles:
        candidates = sorted((r for r in unit if _splittable(r, world)), key=lambda r: (-r.nbytes, -r.flops, r.key))
        if not candidates:
            continue
        gammas = [_unit_gamma(unit, {r.key for r in candidates[:k]}, world) for k in range(len(candidates) + 1)]
        within = [k for k, g in enumerate(gammas) if g <= IMBALANCE]
        k = within[0] if within else min(range(len(gammas)), key=lambda i: (gammas[i], i))
        for r in candidates[:k]:
            out[r.key] = chunk_sizes(int(r.params[0].shape[0]), world)
    return out


def block_roles(unit: Sequence[Role], splits: Splits, ns_steps: int = 5) -> list[tuple[int, Role]]:
    """(rank, role) of every block of the unit's split stacks, priced per expert."""
    out = []
    for role in unit:
        sizes = splits.get(role.key)
        if sizes is None:
            continue
        p = role.params[0]
        for rank, count in enumerate(sizes):
            block = ParamSpec(p.fqn, (count, *p.shape[1:]), p.dtype, True, p.requires_grad, p.stack)
            b, f = role_cost(RoleKind.MATRIX, [block], ns_steps)
            out.append((rank, Role(role.unit_index, RoleKind.MATRIX, (block,), b, f)))
    return out


def check_splits(plan: Plan, units: Sequence[UnitSpec], allowed: bool) -> None:
    """Refuse a plan (a custom planner's) whose split stacks this run cannot serve: splits where
    ``allowed`` is off, a split of a parameter that is no expert stack, or blocks that are not
    ``chunk_sizes(E, W)`` on ranks ``0..W-1`` in order (a ``ValueError``, as the planners' other
    refusals). Pure: the same verdict on every rank."""
    specs = {p.fqn: p for u in units for p in u.params}
    for fqn, blocks in plan.split_stacks.items():
        if not allowed:
            raise ValueError(f"the plan splits the expert stack {fqn!r} into blocks, which this run cannot "
                                   "serve (split_stacks=False, tensor parallelism, replica_split or HSDP "
                                   "replicas: docs/moe.md); keep the stack whole")
        p = specs.get(fqn)
        if p is None or p.stack is None or len(p.shape) != 3:
            raise ValueError(f"the plan splits {fqn!r} into expert blocks, but it is not a declared expert stack")
        expected = chunk_sizes(int(p.shape[0]), plan.world)
        got = tuple(b - a for a, b, _ in blocks)
        starts = [a for a, _, _ in blocks]
        if (tuple(o for _, _, o in blocks) != tuple(range(plan.world)) or got != expected or min(expected) < 1
                or starts != [sum(expected[:r]) for r in range(plan.world)]):
            raise ValueError(
                f"the plan splits the expert stack {fqn!r} into the blocks {list(blocks)} ((start, stop, owner)); a "
                f"split stack must give rank r the r-th of torch.chunk's {plan.world} chunks of its "
                f"{p.shape[0]} experts ({list(expected)} experts, every rank at least one)")
