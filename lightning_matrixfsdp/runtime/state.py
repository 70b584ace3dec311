"""Root state of a sharded model: plan, groups, stats, units, and the end-of-backward flush."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.comm.core import CommStats, ShardGroup
from lightning_matrixfsdp.runtime.comm.grads import GradientReducer
from lightning_matrixfsdp.runtime.mesh.info import MeshInfo
from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.pickling import RefusePickle
from lightning_matrixfsdp.runtime.placement import Plan
from lightning_matrixfsdp.runtime.replicas.sync import ReplicaSync
from lightning_matrixfsdp.runtime.schedule import Schedule
from lightning_matrixfsdp.runtime.views.state_dict import refuse_partial_part, refuse_partial_state_dict
from lightning_matrixfsdp.runtime.sync import BufferSync
from lightning_matrixfsdp.runtime.unit import Unit


class MatrixFSDPState(RefusePickle):
    """Everything ``matrix_shard`` attaches to the root module."""

    def __init__(self, root: nn.Module, plan: Plan, reducer: GradientReducer, mesh: MeshInfo, prefetch: bool) -> None:
        self.root = root
        self.plan = plan
        self.reducer = reducer
        self.mesh = mesh
        self.stats: CommStats = reducer.stats
        self.units: list[Unit] = []
        self.schedule: Schedule[Unit] = Schedule(prefetch, self._end_of_backward, self.abandon_iteration)
        #: ``replica_split`` under HSDP: the weight transfers from each role's stepping replica
        self.replicas: Optional[ReplicaSync] = None
        #: tensor parallelism: every parameter's TP layout and stepper (``tp_plan.TPPlan``; None without TP)
        self.tp_plan: Optional[Any] = None
        #: split expert stacks: the shard group as a 1-D DeviceMesh (checkpoints: each block a chunk)
        self.stack_mesh: Optional[Any] = None
        self._root_handles: list[Any] = []
        #: rank 0's buffers for every rank (``sync.BufferSync``; ``matrix_shard`` sets it)
        self.buffers: Optional[BufferSync] = None
        #: the sequence check of the buffer broadcast (``matrix_shard`` sets it where the check is on)
        self.buffer_check: Optional[Callable[[], None]] = None
        self.requires_gradient_sync = True
        #: a backward ran with the reduction off since the last one that reduced
        self._unsynced = False
        #: expert parallelism's local experts (``expert_parallel.ExpertParallel``; None without)
        self.experts: Optional[Any] = None
        #: tokens per expert of every experts module since the last report (``expert_stats.RoutingCounts``)
        self.routing: Optional[Any] = None
        #: ids of the parameters built on the meta device whose module has no ``reset_parameters``:
        #: uninitialized memory until a load writes them (``checkpoint_view.note_loaded``)
        self.uninitialized: set[int] = set()

    def _pickle_name(self) -> str:
        return "the runtime state on the root module"

    # ------------------------------------------------------------------ queries
    @property
    def params(self) -> list[ShardedParam]:
        return [p for u in self.units for p in u.params]

    def param_by_fqn(self) -> dict[str, ShardedParam]:
        return {p.shard.fqn: p for p in self.params}

    @property
    def sg(self) -> ShardGroup:
        return self.mesh.shard

    @property
    def replicate_group(self) -> Optional[dist.ProcessGroup]:
        return self.mesh.replicate_group

    @property
    def replicate_size(self) -> int:
        return self.mesh.replicate_size

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    @property
    def rank(self) -> int:
        return self.mesh.shard_rank

    @property
    def replica_rank(self) -> int:
        """This rank's replica index (its rank in the replicate group; 0 without HSDP)."""
        return self.mesh.replicate_rank

    @property
    def norm_group(self) -> Optional[dist.ProcessGroup]:
        """What a global-norm clip sums the owners' pieces over: the shard group (HSDP replicas
        hold equal gradients), or the world (None) under ``replica_split`` (one rank holds each)."""
        return None if self.plan.replica_split else self.mesh.shard_group

    # ------------------------------------------------------------------ building
    def add_unit(self, unit: Unit) -> None:
        """Register a unit (in the plan's order); the one wrapping the root module is the root unit."""
        self.units.append(unit)
        if unit.module is self.root:
            self.schedule.root = unit

    def attach_experts(self, experts: Any) -> None:
        """Expert parallelism's local experts: their gradients finish with every backward."""
        self.experts = experts

    def attach_routing(self, routing: Any) -> None:
        """The experts modules' routing counts; a forward inside backward (activation-checkpoint
        recomputation) is not counted again."""
        routing.in_backward = lambda: self.schedule.in_backward
        self.routing = routing

    # ------------------------------------------------------------------ end of backward
    def _end_of_backward(self) -> None:
        """Flush units whose gradients did not all arrive; same order on every rank."""
        for unit in self.units:
            unit.flush()
        self._reduce_unsynced()
        self.schedule.drain_reduces()
        if self.experts is not None:  # the local experts' gradients: summed over their replicas
            self.experts.finish_backward(self.requires_gradient_sync)
        for unit in self.units:
            unit.end_iteration()

    def abandon_iteration(self) -> None:
        """After a forward raised: every unit back to its resident parameters, with no
        materialization pending (a prefetch in flight is waited for: its peers issued it too)
        and no forward counted, so that nothing of the failed iteration reaches the next one."""
        for unit in self.units:
            unit.end_iteration()

    def _reduce_unsynced(self) -> None:
        """The first backward with the reduction on after some with it off also reduces the
        gradients those left on parameters it did not reduce (in unit order, as DDP does after
        ``no_sync``): one agreement on which exist anywhere, zeros where a rank has none."""
        if not all(u.requires_gradient_sync for u in self.units):
            self._unsynced = True
            return
        if not self._unsynced:
            return
        self._unsynced = False
        left = [(u, i) for u in self.units for i in range(len(u.params))]
        used, _ = self.reducer.globally_used([u.params[i].unsharded.grad is not None for u, i in left],
                                             "the flags of gradients left by backwards without reduction")
        for unit in self.units:
            indices = [i for (u, i), k in zip(left, used) if u is unit and k]
            if indices:
                unit.reduce_unsynced(indices)

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

    def follow_requires_grad(self) -> None:
        """Every unsharded parameter takes its resident's ``requires_grad`` now (local)."""
        for p in self.params:
            p.follow_requires_grad()

    def release_all(self) -> None:
        """Reshard every unit still materialized (local: no communication)."""
        for unit in self.units:
            if unit.is_materialized:
                unit.reshard()

    # ------------------------------------------------------------------ buffers
    def skip_buffer_broadcast(self) -> None:
        """The next forward keeps each rank's buffers (``queries.skip_buffer_broadcast``)."""
        if self.buffers is not None:
            self.buffers.due = False

    def broadcast_buffers(self, only_if_due: bool = False) -> None:
        """Every rank takes global rank 0's buffers now (collective; nothing with
        ``broadcast_buffers=False``). ``only_if_due``: only where DDP's next forward would
        broadcast (the Trainer's validation start); either way the next forward need not."""
        if self.buffers is not None:
            if only_if_due:
                self.buffers.sync_if_due()
            elif self.buffers.enabled:
                self.buffers.broadcast()
                self.buffers.due = False

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

    # ------------------------------------------------------------------ hooks
    def install_hooks(self) -> None:
        """Register the hooks on the modules (after ``remove_hooks``; the units install theirs
        when built): the units', then the root's own ahead of them (``replica_split``: the
        transfers start before the root unit materializes)."""
        for unit in self.units:
            unit.install_hooks()
        if self._root_handles:
            return
        # a partial state_dict() is refused (state_dict_guard); registered first, before the wait below; on
        # the submodules holding parameters too (a LightningModule's inner model, save_pretrained)
        self._root_handles = [self.root.register_state_dict_pre_hook(refuse_partial_state_dict)]
        self._root_handles += [m.register_state_dict_pre_hook(self.refuse_partial_part) for m in self.root.modules()
                               if m is not self.root and m._parameters]
        if self.replicas is not None:
            self.schedule.before_forward = lambda: self.before_root_forward(self.root, ())
            self._root_handles += [
                self.root.register_forward_pre_hook(self.before_root_forward, prepend=True),
                # root.state_dict() reads resident tensors: the transfers already started land first
                self.root.register_state_dict_pre_hook(self.wait_replicas),
            ]
        if self.buffers is not None:  # registered last with prepend: rank 0's buffers come first
            self._root_handles += self.buffers.install(self.schedule, lambda: self.requires_gradient_sync,
                                                       self.buffer_check)

    def refuse_partial_part(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """``state_dict`` pre-hook of the submodules holding parameters (``views/state_dict``)."""
        refuse_partial_part(self, module, prefix, keep_vars)

    def remove_hooks(self) -> None:
        """Remove every hook this state put on the modules (local): the model is then a plain
        module as far as torch is concerned (``full_model``)."""
        for unit in self.units:
            unit.remove_hooks()
        for h in self._root_handles:
            h.remove()
        self._root_handles = []

    def set_requires_gradient_sync(self, value: bool) -> None:
        self.requires_gradient_sync = value
        for u in self.units:
            u.requires_gradient_sync = value
