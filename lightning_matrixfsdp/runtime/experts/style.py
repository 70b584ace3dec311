"""Expert parallelism's part in ``matrix_shard``: its contribution at each named step.

``matrix_shard`` asks every parallel style the same three things (``shard.py``'s ``Style``):
after the roles are known (here: keep this rank's experts of rank 0's stacks, a local slice
that is not a stack being AdamW tail), once the plan is made (here: the note of what every
rank holds of its experts, outside the roles, for the printout's figures), and once the
runtime is built (here: the end-of-backward gradient sums attached to the state).
"""

from __future__ import annotations

from typing import Any

from lightning_matrixfsdp.runtime.experts.parallel import ExpertParallel
from lightning_matrixfsdp.runtime.placement import Plan, RoleKind
from lightning_matrixfsdp.runtime.tags import tag_role

__all__ = ["ExpertParallelStyle"]


class ExpertParallelStyle:
    """``expert_parallel_size > 1``: the experts prepared before the walk (``prepare_experts``)."""

    name = "expert_parallel"

    def __init__(self, experts: ExpertParallel) -> None:
        self.experts = experts

    def after_collect(self, collected: Any) -> None:
        """This rank's experts, the declared stacks as the whole tensors were classified."""
        self.experts.split({fqn: r.stack for fqn, r in collected.roles.items() if r.is_matrix})
        for fqn, p in self.experts.params.items():  # a local slice that is not a stack (GPT-OSS's expert biases)
            if not collected.roles[fqn].is_matrix:
                tag_role(p, RoleKind.TAIL)

    def contribute(self, plan: Plan, collected: Any, ns_steps: int) -> None:
        """The local experts in the printout's table, and which rank holds which (priced by the update
        ``Muon(model)`` gives them: the recipe, where a per-expert bias is no matrix)."""
        plan.notes.append(self.experts.note({f: r.is_matrix for f, r in collected.recipe.items()}, ns_steps))

    def install(self, state: Any) -> None:
        state.attach_experts(self.experts)
