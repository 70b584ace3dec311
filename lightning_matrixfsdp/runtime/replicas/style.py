"""``replica_split``'s part in ``matrix_shard``: its contribution at each named step.

The planner assigns each role the replica that steps it (``plan.steppers``, which the
printout reads); the runtime then reduces each gradient to its stepping replica only (the
exchange handed to the gradient reducer) and, once the units are built, sends the updated
weights to the other replicas after each step (``ReplicaSync``, wired into every unit).
"""

from __future__ import annotations

from typing import Any

from lightning_matrixfsdp.runtime.comm.core import CommStats
from lightning_matrixfsdp.runtime.mesh.info import MeshInfo
from lightning_matrixfsdp.runtime.placement import Plan
from lightning_matrixfsdp.runtime.replicas.comm import ReplicaExchange
from lightning_matrixfsdp.runtime.replicas.sync import ReplicaSync

__all__ = ["ReplicaSplitStyle"]


class ReplicaSplitStyle:
    """A plan whose roles are each stepped by one HSDP replica (``plan.replica_split``)."""

    name = "replica_split"

    def __init__(self, mesh: MeshInfo, stats: CommStats) -> None:
        #: the transfers over the replicate group (the reducer sends each gradient to its stepper with it)
        self.exchange = ReplicaExchange(mesh.replicate_group, stats)

    def after_collect(self, collected: Any) -> None:
        """Nothing: the roles are the same on every replica."""

    def contribute(self, plan: Plan, collected: Any, ns_steps: int) -> None:
        """Nothing more: the planner chose the stepping replicas (``plan.steppers``), printed from the plan."""

    def install(self, state: Any) -> None:
        """Every unit's weights sent from their stepping replicas after each step, the root's first."""
        first = next(i for i, u in enumerate(state.units) if u.module is state.root)
        state.replicas = ReplicaSync([u.params for u in state.units], state.plan.steppers, self.exchange, first=first)
        for unit in state.units:
            unit.replicas = state.replicas
