"""Root state of a sharded model: units, plan, groups, counters, end-of-backward callback."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.collectives import CommStats, GradientReducer, ShardGroup
from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.placement import Plan
from lightning_matrixfsdp.runtime.unit import Unit

#: Transitional: only the old ``runtime/checkpoint.py`` still reads it; marks go through ``tags``.
STATE_ATTR = "_mfsdp_state"


class MatrixFSDPState:
    """Everything ``matrix_shard`` attaches to the root module."""

    def __init__(
        self,
        root: nn.Module,
        plan: Plan,
        reducer: GradientReducer,
        options: dict[str, Any],
    ) -> None:
        self.root = root
        self.plan = plan
        self.reducer = reducer
        self.sg: ShardGroup = reducer.sg
        self.replicate_group: Optional[dist.ProcessGroup] = reducer.replicate_group
        self.replicate_size = reducer.replicate_size
        self.dp_size = reducer.dp_size
        self.stats: CommStats = reducer.stats
        self.options = options
        self.units: list[Unit] = []
        self.in_backward = False
        self.prefetch = bool(options.get("prefetch", True))
        self.zero_missing_grads = bool(options.get("zero_missing_grads", False))
        self._forward_order: list[Unit] = []  # last iteration's, used for prefetching
        self._order_now: list[Unit] = []
        self._pending_reduces: list[Callable[[], None]] = []

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
        """Record the order in which units run forward (the prefetch schedule)."""
        if not self.in_backward and torch.is_grad_enabled() and unit not in self._order_now:
            self._order_now.append(unit)

    def next_to_forward(self, unit: Unit) -> Optional[Unit]:
        order = self._forward_order
        if not self.prefetch or unit not in order:
            return None
        i = order.index(unit) + 1
        return order[i] if i < len(order) else None

    def next_to_backward(self, unit: Unit) -> Optional[Unit]:
        """Backward visits the inner units in reverse forward order (the root, which
        wraps them all, gets its gradients first)."""
        order = [u for u in self._forward_order if u.module is not self.root]
        if not self.prefetch or not order:
            return None
        if unit.module is self.root:
            return order[-1]
        if unit not in order:
            return None
        i = order.index(unit)
        return order[i - 1] if i > 0 else None

    def defer_reduce(self, finish: Callable[[], None]) -> None:
        """Keep one reduction in flight: finish the previous before queuing the next."""
        self.drain_reduces()
        self._pending_reduces.append(finish)

    def drain_reduces(self) -> None:
        while self._pending_reduces:
            self._pending_reduces.pop(0)()

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
            self.drain_reduces()
            for unit in self.units:
                if unit.is_materialized or unit._pending_unshard is not None:
                    unit.reshard()
                unit.reset_iteration()
            if self._order_now:
                self._forward_order, self._order_now = self._order_now, []
        finally:
            self.in_backward = False

    def set_requires_gradient_sync(self, value: bool) -> None:
        for u in self.units:
            u.requires_gradient_sync = value
