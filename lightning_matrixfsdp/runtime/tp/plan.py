"""The tensor-parallel half of a plan, pure: which TP rank steps each split matrix, and the
owner layout of one TP rank's fragments.

The owner plan is made once from the *global* shapes and costs (``planner.make_plan``), so it
is the same on every TP rank: all T fragments of a matrix live on the same data-parallel
owner. :func:`assign_tp_steppers` then picks, for each TP-split matrix, the one TP rank of its
owner that gathers the T fragments and runs the whole-matrix update, balancing Newton-Schulz
FLOPs over the TP ranks of each owner (largest first, ties by rank, unit order and name: the
same answer on every rank without communicating). :func:`localize` gives the plan this TP
rank's data-parallel group runs its collectives by: the same owners, local shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from lightning_matrixfsdp.runtime.placement import MatrixShard, Plan, RoleKind, UnitLayout
from lightning_matrixfsdp.runtime.roles import newton_schulz_flops
from lightning_matrixfsdp.runtime.tp.layout import TPLayout

__all__ = ["TPPlan", "assign_tp_steppers", "localize"]


@dataclass
class TPPlan:
    """Every parameter's TP layout and every split matrix's stepping TP rank."""

    tp_size: int
    layouts: dict[str, TPLayout] = field(default_factory=dict)
    steppers: dict[str, int] = field(default_factory=dict)
    #: optimizer FLOPs per (data-parallel owner, TP rank) under that assignment
    flops: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"tp_size": self.tp_size, "layouts": {k: v.to_dict() for k, v in sorted(self.layouts.items())},
                "steppers": dict(sorted(self.steppers.items()))}

    def describe(self) -> str:
        split = sum(1 for v in self.layouts.values() if v.split)
        # every TP rank named with its load (4 significant digits: small models' loads are not all 0.000)
        per = "; ".join(f"owner {o}: " + ", ".join(f"tp{t} {f / 1e9:.4g}" for t, f in enumerate(row))
                        for o, row in enumerate(self.flops))
        return (f"tensor parallel: T={self.tp_size}, {split} split parameters, {len(self.steppers)} split matrices "
                f"stepped whole on one TP rank; Newton-Schulz GFLOP of the split matrices per TP rank: {per}")


def assign_tp_steppers(plan: Plan, layouts: Mapping[str, TPLayout], tp_size: int, ns_steps: int = 5) -> TPPlan:
    """The TP stepper of every trainable, TP-split matrix role of ``plan`` (a global plan)."""
    roles = []
    for ui, unit in enumerate(plan.units):
        for s in unit.shards:
            lay = layouts.get(s.fqn)
            if s.role is RoleKind.MATRIX and s.requires_grad and lay is not None and lay.split:
                roles.append((-newton_schulz_flops(s.shape, ns_steps, s.stack), ui, s.fqn, s.owner))
    loads = [[0] * tp_size for _ in range(plan.world)]
    steppers: dict[str, int] = {}
    for neg_flops, _, fqn, owner in sorted(roles):
        row = loads[owner]
        t = min(range(tp_size), key=lambda r: (row[r], r))
        steppers[fqn] = t
        row[t] += -neg_flops
    return TPPlan(tp_size, dict(layouts), steppers, loads)


def localize(plan: Plan, layouts: Mapping[str, TPLayout], tp_rank: int) -> Plan:
    """``plan`` with every parameter at its local (fragment) shape on TP rank ``tp_rank`` and the
    owner segments laid out again: the layout this rank's data-parallel group moves."""
    units = []
    for unit in plan.units:
        offsets = [0] * unit.world
        shards = []
        for s in unit.shards:
            lay = layouts.get(s.fqn)
            shape = lay.local_shape(tp_rank) if lay is not None else s.shape
            local = MatrixShard(s.fqn, s.unit, tuple(shape), s.dtype, s.role, s.owner, offsets[s.owner],
                                s.requires_grad, s.stack)
            offsets[s.owner] += local.numel
            shards.append(local)
        units.append(UnitLayout(unit.fqn, unit.world, tuple(shards)))
    return Plan(plan.world, plan.planner, units, list(plan.loads_bytes), list(plan.loads_flops), plan.replicate,
                dict(plan.options), dict(plan.steppers), [list(r) for r in plan.replica_flops], list(plan.notes),
                list(plan.roles))
