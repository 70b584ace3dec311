"""Root state of a sharded model: plan, groups, stats, units, and the end-of-backward flush."""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.collectives import CommStats, GradientReducer, ShardGroup
from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.placement import Plan
from lightning_matrixfsdp.runtime.replica_sync import ReplicaSync
from lightning_matrixfsdp.runtime.schedule import Schedule
from lightning_matrixfsdp.runtime.unit import Unit


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
        self.prefetch = bool(options.get("prefetch", True))
        self.zero_missing_grads = bool(options.get("zero_missing_grads", False))
        self.schedule: Schedule[Unit] = Schedule(self.prefetch, self._end_of_backward)
        #: ``replica_split`` under HSDP: the weight transfers from each role's stepping replica
        self.replicas: Optional[ReplicaSync] = None

    # ------------------------------------------------------------------ queries
    @property
    def params(self) -> list[ShardedParam]:
        return [p for u in self.units for p in u.params]

    def param_by_fqn(self) -> dict[str, ShardedParam]:
        return {p.shard.fqn: p for p in self.params}

    @property
    def rank(self) -> int:
        return self.sg.rank

    @property
    def replica_rank(self) -> int:
        """This rank's replica index (its rank in the replicate group; 0 without HSDP)."""
        return dist.get_rank(self.replicate_group) if self.replicate_group is not None else 0

    # ------------------------------------------------------------------ building
    def add_unit(self, unit: Unit) -> None:
        """Register a unit (in the plan's order); the one wrapping the root module is the root unit."""
        self.units.append(unit)
        if unit.module is self.root:
            self.schedule.root = unit

    # ------------------------------------------------------------------ end of backward
    def _end_of_backward(self) -> None:
        """Flush units whose gradients did not all arrive; same order on every rank."""
        for unit in self.units:
            unit.flush()
        self.schedule.drain_reduces()
        for unit in self.units:
            unit.end_iteration()

    def describe_waiting(self) -> str:
        """Units that got some of their gradients but not all, for a divergence error."""
        return "; ".join(f"unit {u.fqn or '<root>'!r} got gradients except for {', '.join(missing)}"
                         for u in self.units if (missing := u.missing_gradients()))

    def materialize_for_peers(self, index: int) -> None:
        """Take part in materializing unit ``index`` for the other ranks, then release it at
        once (a rank following an evaluation step it has no batch for)."""
        unit = self.units[index]
        announce, self.schedule.announce = self.schedule.announce, None
        try:
            unit.unshard()
        finally:
            self.schedule.announce = announce
        unit.reshard()

    def release_unfinished(self) -> None:
        """Drop what a forward whose backward never ran left behind (Lightning skips backward in
        ``StochasticWeightAveraging``'s BatchNorm epoch; a custom loop may drop a loss): the
        root unit, never resharded between its forward and its backward, stayed materialized,
        and the units kept counting inputs that will never get gradients. Local (no
        communication); nothing while in backward."""
        if self.schedule.in_backward:
            return
        for unit in self.units:
            unit.end_iteration()

    def release_all(self) -> None:
        """Reshard every unit still materialized (local: no communication)."""
        for unit in self.units:
            if unit.is_materialized:
                unit.reshard()

    # ------------------------------------------------------------------ replica_split
    def start_replica_sync(self, only: Optional[set[int]] = None) -> None:
        """Send the weights the steppers may have updated (``only``: ids of resident parameters)."""
        if self.replicas is not None:
            self.replicas.start(only)

    def settle_replicas(self, clear: bool = False) -> None:
        """Every replica's weights equal now (see ``replica_sync.ReplicaSync.settle``)."""
        if self.replicas is not None:
            self.replicas.settle(clear)

    def wait_replicas(self, *_: Any) -> None:
        """Finish the transfers in flight (local); also the root's ``state_dict`` pre-hook."""
        if self.replicas is not None:
            self.replicas.wait_all()

    def before_root_forward(self, module: nn.Module, args: Any) -> None:
        """Root forward pre-hook (registered first): a forward reads current weights, so start
        the transfers nobody started since the reductions (a bare ``matrix_shard`` training loop);
        not in backward, where a forward is activation-checkpoint recomputation."""
        if self.replicas is not None and not self.schedule.in_backward:
            self.replicas.start()

    def set_requires_gradient_sync(self, value: bool) -> None:
        for u in self.units:
            u.requires_gradient_sync = value
