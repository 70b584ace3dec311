"""Tensor parallelism's part in ``matrix_shard``: its contribution at each named step.

The owners come from the global shapes (the planner sees whole matrices); once the plan is
made, every parameter's TP layout is read from its DTensor (refusing what cannot be served)
and each split matrix gets the TP rank that steps it whole (``tp/plan.py``), noted for the
printout. ``shard.build_runtime`` then agrees on it over the TP group and runs the plan at
this rank's fragment shapes; once the units are built, each fragment is tagged with its stepper.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_matrixfsdp.runtime.comm.core import CommStats
from lightning_matrixfsdp.runtime.mesh.info import MeshInfo
from lightning_matrixfsdp.runtime.placement import Plan, PlanNote
from lightning_matrixfsdp.runtime.tags import tag_tp, tag_tp_shape
from lightning_matrixfsdp.runtime.tp.layout import read_layout
from lightning_matrixfsdp.runtime.tp.plan import TPPlan, assign_tp_steppers
from lightning_matrixfsdp.runtime.tp.step_comm import TPFragment

__all__ = ["TensorParallelStyle"]


class TensorParallelStyle:
    """A mesh whose tensor-parallel group has more than one rank."""

    name = "tensor_parallel"

    def __init__(self, mesh: MeshInfo, stats: CommStats) -> None:
        self.mesh = mesh
        self.stats = stats
        #: every parameter's TP layout and the split matrices' steppers (``contribute``)
        self.tp_plan: Optional[TPPlan] = None

    def after_collect(self, collected: Any) -> None:
        """Nothing: the walk classifies the global (DTensor) shapes as they are."""

    def contribute(self, plan: Plan, collected: Any, ns_steps: int) -> None:
        """Every parameter's TP layout and the split matrices' TP steppers, noted for the printout."""
        matrix = {p.fqn: p.is_matrix for u in collected.specs for p in u.params}
        layouts = {fqn: read_layout(fqn, p, self.mesh.tp_mesh, self.mesh.tp_size, matrix[fqn])
                   for fqn, p in collected.params.items()}
        self.tp_plan = assign_tp_steppers(plan, layouts, self.mesh.tp_size, ns_steps)
        plan.notes.append(PlanNote("tensor_parallel", (self.tp_plan.describe(),)))

    def install(self, state: Any) -> None:
        """Each resident fragment tagged with its matrix's global shape and, for a split matrix, the
        TP rank that steps it whole (the optimizers and checkpoints read the tags)."""
        assert self.tp_plan is not None, "contribute runs first"
        for sp in state.params:
            layout = self.tp_plan.layouts[sp.shard.fqn]
            if layout.split:
                tag_tp_shape(sp.resident, layout.global_shape)
            if sp.shard.fqn in self.tp_plan.steppers:
                tag_tp(sp.resident, TPFragment(layout, self.mesh.tp, self.tp_plan.steppers[sp.shard.fqn], self.stats))
