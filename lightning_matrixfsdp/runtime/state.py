"""Root state of a sharded model: units, plan, groups, counters, end-of-backward callback."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.collectives import CommStats, ShardGroup
from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.placement import Plan
from lightning_matrixfsdp.runtime.unit import Unit

STATE_ATTR = "_mfsdp_state"


class MatrixFSDPState:
    """Everything ``matrix_shard`` attaches to the root module."""

    def __init__(
        self,
        root: nn.Module,
        plan: Plan,
        shard_group: ShardGroup,
        replicate_group: Optional[dist.ProcessGroup],
        stats: CommStats,
        options: dict[str, Any],
    ) -> None:
        self.root = root
        self.plan = plan
        self.sg = shard_group
        self.replicate_group = replicate_group
        self.replicate_size = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.dp_size = self.sg.size * self.replicate_size
        self.stats = stats
        self.options = options
        self.units: list[Unit] = []
        self.in_backward = False

    # ------------------------------------------------------------------ queries
    @property
    def params(self) -> list[ShardedParam]:
        return [p for u in self.units for p in u.params]

    def param_by_fqn(self) -> dict[str, ShardedParam]:
        return {p.shard.fqn: p for p in self.params}

    @property
    def rank(self) -> int:
        return self.sg.rank

    # ------------------------------------------------------------------ lifecycle hooks
    def on_pre_forward(self, unit: Unit) -> None:
        """Called by every unit's pre-forward (room for lazy checks)."""

    def on_backward_start(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Flush units whose gradients did not all arrive; same order on every rank."""
        try:
            for unit in self.units:
                if unit._forward_calls > 0 and not unit._reduced:
                    unit.post_backward(flush=True)
            for unit in self.units:
                if unit.is_materialized:
                    unit.reshard()
                unit.reset_iteration()
        finally:
            self.in_backward = False

    # ------------------------------------------------------------------ gradient helpers
    def globally_used(self, used: list[bool]) -> list[bool]:
        """Which parameters got a gradient on at least one rank (DDP leaves the rest None)."""
        if self.dp_size == 1:
            return used
        device = self.units[0].params[0].device if self.units and self.units[0].params else torch.device("cpu")
        t = torch.tensor([int(u) for u in used], dtype=torch.int32, device=device)
        if self.sg.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.sg.group)
        if self.replicate_group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.replicate_group)
        return [bool(x) for x in t.tolist()]

    def replicate_reduce(self, grad: torch.Tensor) -> None:
        """HSDP: sum an owner's (already divided) gradient across replicas."""
        if self.replicate_group is None or self.replicate_size == 1:
            return
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.replicate_group)
        b = grad.numel() * grad.element_size()
        self.stats.add("replicate", b, b)

    def set_requires_gradient_sync(self, value: bool) -> None:
        for u in self.units:
            u.requires_gradient_sync = value
