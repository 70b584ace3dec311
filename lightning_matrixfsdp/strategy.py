"""``MatrixFSDPStrategy``: owner-sharded ZeRO-3 for the Lightning Trainer.

A subclass of ``ModelParallelStrategy`` that takes over what Lightning would do
wrongly with owner-shaped parameters (see ``docs/how-it-works.md``): the mesh and
data-parallel size, sharding unmodified modules, optimizer routing and
replacement, global-norm clipping, precision checks, the model summary,
checkpoints and observability.
"""

from __future__ import annotations

import logging
import types
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, Iterable, Mapping, Optional, Union

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

from lightning_matrixfsdp.adapter import (
    check_precision,
    clip_group,
    is_sharded,
    release_unfinished,
    replicas_after_step,
    set_gradient_sync,
    settle_replicas,
    shard_module,
    sync_buffers,
)
from lightning_matrixfsdp.checkpoint import (
    CheckpointError,
    KeyIndex,
    build_index,
    load_sharded,
    model_view,
    optimizer_class,
    sharded_optimizer_state_dict,
    write_checkpoint,
)
from lightning_matrixfsdp.model_compat import convert_sync_batchnorm, refuse_pruning
from lightning_matrixfsdp.optim.routing import clip_grad_norm_, full_params, route_optimizer
from lightning_matrixfsdp.param_groups import (
    full_finetuning_state, install_toggles, restore_finetuning_groups, uninstall_toggles)
from lightning_matrixfsdp.replacement import replace_optimizer
from lightning_matrixfsdp.runtime.collectives import DEFAULT_COLLECTIVE
from lightning_matrixfsdp.runtime.copies import shard_copies, track_copies
from lightning_matrixfsdp.runtime.join import EvalJoin
from lightning_matrixfsdp.runtime.options import check_bool, check_strategy_options
from lightning_matrixfsdp.runtime import get_plan, hsdp_mesh, scheduled_forwards, watch_lone_forwards
from lightning_matrixfsdp.runtime.tags import sharded_roots, state_of
from lightning_matrixfsdp.runtime.waits import stop_waiter
from lightning_matrixfsdp.telemetry import StepTelemetry

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


def _evenly_sampled(dataloader: object) -> bool:
    """True when torch's ``DistributedSampler`` (or a subclass, as Lightning's wrappers are)
    picks the batches: it pads or truncates to the same count on every rank."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = getattr(dataloader, "sampler", None)
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    return isinstance(sampler, DistributedSampler) or isinstance(getattr(batch_sampler, "sampler", None),
                                                                 DistributedSampler)


class _GlobalNormClip:
    """Precision-plugin mixin: clip by the global norm of owner-sharded gradients."""

    _mfsdp_clip_group: Any = None
    _mfsdp_clip_stats: Any = None  # the sharded model's CommStats: the all-reduce counts as "clip"

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        # every rank's full list (DDP's order): the clip combines the norms exactly as torch does
        clip_grad_norm_(full_params(optimizer), float(clip_val), group=self._mfsdp_clip_group,
                        stats=self._mfsdp_clip_stats)


class MatrixFSDPStrategy(ModelParallelStrategy):
    """Owner-sharded ZeRO-3 with exact matrix optimizers (Muon, Shampoo, SOAP).

    Args:
        wrap_policy: which modules become units (a set of module classes, their
            import paths, or ``callable(name, module) -> bool``); default: the
            children of every outermost ``nn.ModuleList``.
        planner: ``"role_greedy"``, ``"scope_greedy"`` or ``"cost_aware"``.
        collective: ``"p2p"``, ``"broadcast"`` or ``"padded_all_gather"``.
        matrix_filter: ``callable(fqn, param) -> bool``; 2D parameters it rejects
            go to the AdamW tail (e.g. embeddings and the LM head).
        param_dtype / reduce_dtype: compute dtype of the unsharded buffers and
            dtype of the gradient reduction; resident weights keep theirs.
        activation_checkpointing_policy: module classes (or a callable) whose
            forward is recomputed in backward (non-reentrant checkpointing).
        optimizer: ``callable(params) -> Optimizer`` replacing the module's own
            optimizer, e.g. ``functools.partial(lightning_matrixfsdp.Muon, lr=0.02)``.
        reshard_after_forward: free unit buffers after forward (ZeRO-3); ``False``
            keeps them until backward (ZeRO-2-like memory, less traffic).
        accumulation_no_sync: with ``accumulate_grad_batches > 1``, accumulate full
            gradients locally and reduce once per optimizer step.
        shard_size: HSDP; shard over groups of this many ranks, replicate across
            groups (default: shard over the whole world).
        prefetch: materialize the next unit while the current one computes
            (forward and backward); ``False`` saves one unit of memory.
        zero_missing_grads: for models whose ranks leave different parameters without
            a gradient in a step (mixture-of-experts routing); see ``matrix_shard``.
        save_distributed_checkpoint: directory of per-rank files (default) or one
            consolidated file.
        log_plan: log the owner plan at fit start (rank 0).
        verify_checkpoints: record a checksum of every file a checkpoint directory holds
            and verify them (and a consolidated file's own) on load; ``False`` skips
            both (sizes are still checked).
        reset_changed_roles: on load, restart the optimizer state of parameters whose
            role (matrix or tail) changed since the save, e.g. through another
            ``matrix_filter``, instead of raising ``CheckpointMismatchError``.
        replica_split: under HSDP (``shard_size`` below the world size), step each role
            on one replica only and send the updated weights to the others after the
            step (see ``matrix_shard`` and docs/multi-node.md); no effect without replicas.
        flatten_conv: make parameters of more than two dimensions (convolution kernels)
            matrix roles too, trained by ``Muon`` as their ``(shape[0], -1)`` matrix
            (``matrix_filter`` is then asked about them as well).
    """

    strategy_name = "matrix_fsdp"

    def __init__(
        self,
        wrap_policy: Any = None,
        planner: str = "role_greedy",
        collective: str = DEFAULT_COLLECTIVE,
        matrix_filter: Optional[Callable[[str, nn.Parameter], bool]] = None,
        param_dtype: Union[str, torch.dtype, None] = None,
        reduce_dtype: Union[str, torch.dtype, None] = None,
        activation_checkpointing_policy: Any = None,
        optimizer: Optional[OptimizerFactory] = None,
        reshard_after_forward: bool = True,
        accumulation_no_sync: bool = False,
        shard_size: Optional[int] = None,
        prefetch: bool = True,
        zero_missing_grads: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        tensor_parallel_size: int = 1,
        log_plan: bool = True,
        verify_checkpoints: bool = True,
        reset_changed_roles: bool = False,
        replica_split: bool = False,
        flatten_conv: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        # Every option is checked here, at construction, so a wrong one fails where it was written.
        opts = check_strategy_options(
            wrap_policy=wrap_policy, planner=planner, collective=collective, matrix_filter=matrix_filter,
            param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            activation_checkpointing_policy=activation_checkpointing_policy, optimizer=optimizer,
            reshard_after_forward=reshard_after_forward, accumulation_no_sync=accumulation_no_sync,
            shard_size=shard_size, prefetch=prefetch, zero_missing_grads=zero_missing_grads,
            save_distributed_checkpoint=save_distributed_checkpoint, process_group_backend=process_group_backend,
            timeout=timeout, tensor_parallel_size=tensor_parallel_size, log_plan=log_plan,
            replica_split=replica_split, flatten_conv=flatten_conv, broadcast_buffers=broadcast_buffers,
        )
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size="auto",
            save_distributed_checkpoint=opts["save_distributed_checkpoint"],
            process_group_backend=opts["process_group_backend"], timeout=opts["timeout"],
        )
        self.wrap_policy = opts["wrap_policy"]
        self.planner = opts["planner"]
        self.collective = opts["collective"]
        self.matrix_filter = opts["matrix_filter"]
        self.param_dtype = opts["param_dtype"]
        self.reduce_dtype = opts["reduce_dtype"]
        self.activation_checkpointing_policy = opts["activation_checkpointing_policy"]
        self.optimizer_factory = opts["optimizer"]
        self.reshard_after_forward = opts["reshard_after_forward"]
        self.accumulation_no_sync = opts["accumulation_no_sync"]
        self.shard_size = opts["shard_size"]
        self.prefetch = opts["prefetch"]
        self.zero_missing_grads = opts["zero_missing_grads"]
        self.replica_split = opts["replica_split"]
        self.flatten_conv = opts["flatten_conv"]
        self.broadcast_buffers = opts["broadcast_buffers"]
        self.timeout = opts["timeout"]  # also for the HSDP mesh's groups (runtime.mesh.hsdp_mesh)
        self.log_plan = opts["log_plan"]
        self._shard_mesh: Any = None
        self.verify_checkpoints = check_bool(verify_checkpoints, "verify_checkpoints")
        self.reset_changed_roles = check_bool(reset_changed_roles, "reset_changed_roles")
        self._telemetry = StepTelemetry()

    # ------------------------------------------------------------------ precision
    @property
    def precision_plugin(self):  # type: ignore[override]
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:  # type: ignore[override]
        if plugin is not None:
            check_precision(getattr(plugin, "precision", None), "MatrixFSDPStrategy")
            if not isinstance(plugin, _GlobalNormClip):
                cls = type(plugin)
                plugin.__class__ = type(f"MatrixFSDP{cls.__name__}", (_GlobalNormClip, cls), {})
        self._precision_plugin = plugin

    # ------------------------------------------------------------------ environment
    def _configure_launcher(self) -> None:
        """A launcher on every rank, as ``DDPStrategy`` has.

        ``ModelParallelStrategy`` configures none in processes it did not start itself (the
        children of its own launch, torchrun, SLURM), so they skip Lightning's
        ``OMP_NUM_THREADS`` setting: on CPU the children then ran with one thread per core
        and the ranks oversubscribed the machine (CHANGELOG, "Fixed", has the measured
        cost). The launcher starts no process where the environment already did.
        """
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        self._data_parallel_size, self._tensor_parallel_size = world, 1
        super().setup_environment()
        W = self.shard_size or world
        if world % W:
            raise ValueError(f"shard_size={W} must divide the world size {world}")
        if W == world:
            self._shard_mesh = self.device_mesh["data_parallel"]
        else:
            self._shard_mesh = hsdp_mesh(W, self.root_device, self.timeout)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._shard_mesh  # what configure_model sees as self.device_mesh
        track_copies(self.lightning_module)  # callbacks' setup copies it (weight averaging): sharded like it

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel rank: distinct batches per rank.
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: "Any") -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError("Found FSDP1-wrapped modules; MatrixFSDPStrategy needs the plain model.")
        refuse_pruning(trainer.callbacks)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.model = convert_sync_batchnorm(self.model, self._layer_sync if fitting else None, self.root_device)
        if self._is_sharded(module):  # sharded before (a second fit, a test after fit): rank 0's buffers, as DDP's setup
            sync_buffers(module)
        else:
            self.model = self.precision_plugin.convert_module(self.model)
            shard_module(
                module, mesh=self._shard_mesh, device=self.root_device,
                activation_checkpointing_policy=self.activation_checkpointing_policy,
                wrap_policy=self.wrap_policy, planner=self.planner, collective=self.collective,
                matrix_filter=self.matrix_filter, param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                reshard_after_forward=self.reshard_after_forward, prefetch=self.prefetch,
                zero_missing_grads=self.zero_missing_grads, replica_split=self.replica_split,
                flatten_conv=self.flatten_conv, broadcast_buffers=self.broadcast_buffers,
            )
        self.model_to_device()  # buffers and anything outside the shard
        watch_lone_forwards(module)  # a forward outside the steps (a hook's) must be joined by every rank
        shard_copies(module)
        self._install_clip_group()
        self._install_summary(trainer)
        install_toggles(module)  # toggle_optimizer over every rank's full param groups
        self.barrier()
        if self.log_plan:
            for plan in self._plans():
                rank_zero_info(str(plan))
        from lightning.fabric.utilities.optimizer import _optimizers_to_device

        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _is_sharded(self, module: nn.Module) -> bool:
        return is_sharded(module, "configure_model applied FSDP2/tensor parallelism; MatrixFSDPStrategy shards "
                                  "the model itself: remove fully_shard/parallelize_module, or call "
                                  "lightning_matrixfsdp.matrix_shard")

    def _sharded_roots(self) -> list[nn.Module]:
        assert self.lightning_module is not None
        return sharded_roots(self.lightning_module)

    def _plans(self) -> list:
        return [get_plan(m) for m in self._sharded_roots()]

    def _install_clip_group(self) -> None:
        plugin = self.precision_plugin
        if self._sharded_roots() and isinstance(plugin, _GlobalNormClip):
            assert self.lightning_module is not None
            plugin._mfsdp_clip_group, plugin._mfsdp_clip_stats = clip_group(self.lightning_module)

    def _install_summary(self, trainer: Any) -> None:
        from lightning.pytorch.callbacks import ModelSummary

        from lightning_matrixfsdp.summary import MatrixFSDPSummary

        for cb in trainer.callbacks:
            if isinstance(cb, ModelSummary):
                cb._summary = types.MethodType(
                    lambda self, t, m: MatrixFSDPSummary(m, max_depth=self._max_depth), cb)

    # ------------------------------------------------------------------ optimizers
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self.optimizer_factory is not None:
            assert self.lightning_module is not None
            params = [p for p in self.lightning_module.parameters() if p.requires_grad]
            new, self.lr_scheduler_configs = replace_optimizer(self.optimizer_factory, params, self.optimizers,
                                                               self.lr_scheduler_configs)
            self.optimizers = [new]
        for opt in self.optimizers:
            route_optimizer(opt)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Time the optimizer's own step (after the closure's forward/backward) and log traffic."""
        marks: dict[str, Any] = {}
        route_optimizer(optimizer)  # a group added since (add_param_group on a LightningOptimizer)

        def timed_closure() -> Any:
            out = closure()
            marks["start"] = StepTelemetry.clock(self.root_device)
            return out

        out = super().optimizer_step(optimizer, timed_closure, model, **kwargs)
        if self.lightning_module is not None:  # replica_split: updated weights on their way, after the step
            replicas_after_step(self.lightning_module, optimizer)
        if "start" in marks:
            self._telemetry.record_step(marks["start"], StepTelemetry.clock(self.root_device))
        if self.is_global_zero and self.lightning_module is not None:
            self._telemetry.log(self.lightning_module.trainer, self._sharded_roots())
        return out

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches: defer the reduction when ``accumulation_no_sync`` is on."""
        if not self.accumulation_no_sync:
            yield
            return
        assert self.lightning_module is not None
        set_gradient_sync(self.lightning_module, False)
        try:
            yield
        finally:
            set_gradient_sync(self.lightning_module, True)

    def on_test_start(self) -> None:
        """``replica_split``: evaluation and the end of fit see every replica's weights current
        (Lightning's own hooks here do nothing); a forward left without backward is released."""
        if self.lightning_module is not None:
            release_unfinished(self.lightning_module)
            settle_replicas(self.lightning_module)

    on_predict_start = on_train_end = on_test_start

    def on_validation_start(self) -> None:
        """Also, in fit: rank 0's buffers where DDP's first validation forward would broadcast them
        (here every rank is present, also when some have no validation batch)."""
        self.on_test_start()
        if self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            sync_buffers(self.lightning_module, only_if_due=True)

    def teardown(self) -> None:
        """Also end the helper thread of interruptible gloo waits: no thread of ours outlives ``fit``."""
        uninstall_toggles(self.lightning_module)
        super().teardown()
        stop_waiter()

    # ------------------------------------------------------------------ steps through the root unit
    def _through_root(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run a ``*_step`` method as the LightningModule's forward, so a sharded
        LightningModule's root unit materializes around it (Lightning calls steps
        directly, which would bypass module hooks)."""
        module = self.lightning_module
        assert module is not None
        with scheduled_forwards(module):  # every rank runs the steps: no lone-forward check
            return self._call_as_forward(module, name, *args, **kwargs)

    def _call_as_forward(self, module: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
        if state_of(module) is None:
            return getattr(module, name)(*args, **kwargs)
        had_own = "forward" in module.__dict__
        original = module.__dict__.get("forward")

        def redirected(*a: Any, **k: Any) -> Any:
            _restore()
            return getattr(module, name)(*a, **k)

        def _restore() -> None:
            if had_own:
                module.forward = original
            else:
                module.__dict__.pop("forward", None)

        module.forward = redirected
        try:
            return module(*args, **kwargs)
        finally:
            _restore()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        join = self._join()
        if join is not None and self._train_counts_may_differ:
            trainer = self.lightning_module.trainer  # type: ignore[union-attr]
            join.check_training_step(True, bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch))
        release_unfinished(self.lightning_module)  # the previous step's forward may have had no backward
        with self.precision_plugin.train_step_context():
            return self._through_root("training_step", *args, **kwargs)

    # ------------------------------------------------------------------ uneven inputs (runtime/join.py)
    _eval_join: Optional[EvalJoin] = None
    # Whether training batch counts can differ between ranks: not under torch's
    # DistributedSampler (Lightning's default), which gives every rank the same count. Only
    # then does each training step pay the check's small all-gather (a host sync on NCCL).
    _train_counts_may_differ: bool = True

    def _join(self) -> Optional[EvalJoin]:
        """The join of the sharded models (None on one rank or without one)."""
        roots = self._sharded_roots() if self.lightning_module is not None else []
        if not roots or self.world_size == 1:
            return None
        states = [state_of(r) for r in roots]
        if self._eval_join is None or self._eval_join.states != states:
            self._eval_join = EvalJoin(states)
        return self._eval_join

    def process_dataloader(self, dataloader: object) -> object:
        """Every dataloader goes through the join: a rank with no batch at all still follows the
        other ranks' evaluation steps, or takes part in the training check."""
        join = self._join()
        if join is None:
            return dataloader
        from lightning.pytorch.trainer.states import RunningStage

        stage = self.lightning_module.trainer.state.stage  # type: ignore[union-attr]
        training = stage == RunningStage.TRAINING
        if training:
            self._train_counts_may_differ = not _evenly_sampled(dataloader)
            if not self._train_counts_may_differ:
                return dataloader
        return join.wrap(dataloader, training=training)  # type: ignore[arg-type]

    def _joined_step(self, name: str, loop: Any, *args: Any, **kwargs: Any) -> Any:
        """An evaluation step under the join: ranks with fewer batches follow the others'
        remaining steps after their last (``loop``: the running loop, for its last-batch flag)."""
        join = self._join()
        if join is None:
            return self._through_root(name, *args, **kwargs)
        join.begin_step()
        out = self._through_root(name, *args, **kwargs)
        join.end_step(bool(loop.batch_progress.is_last_batch))
        return out

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        loop = trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == "fit" else trainer.validate_loop
        with self.precision_plugin.val_step_context():
            return self._joined_step("validation_step", loop, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        loop = self.lightning_module.trainer.test_loop  # type: ignore[union-attr]
        with self.precision_plugin.test_step_context():
            return self._joined_step("test_step", loop, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        loop = self.lightning_module.trainer.predict_loop  # type: ignore[union-attr]
        with self.precision_plugin.predict_step_context():
            return self._joined_step("predict_step", loop, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    # Lightning's checkpoint dump asks for the model's state, then each optimizer's, then saves:
    # the key index built for the first call serves the others, and the save lets it go.
    _checkpoint_index: Optional[KeyIndex] = None

    def _checkpoint_module(self) -> nn.Module:
        module = self.lightning_module
        if module is None:
            raise CheckpointError("the strategy has no LightningModule attached")
        return module

    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = self._checkpoint_module()
        self._checkpoint_index = build_index(module)
        return model_view(self._checkpoint_index)  # whole where owned; save_checkpoint writes the owners' data

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return sharded_optimizer_state_dict(self._checkpoint_module(), optimizer,
                                            full=not self._save_distributed_checkpoint, index=self._checkpoint_index)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        index, self._checkpoint_index = self._checkpoint_index, None
        module = self._checkpoint_module()
        full_finetuning_state(checkpoint, module.trainer.callbacks, module, self.optimizers)
        write_checkpoint(self._checkpoint_module(), checkpoint, filepath, full=not self._save_distributed_checkpoint,
                         optimizer_classes=[optimizer_class(o) for o in self.optimizers], index=index,
                         checksums=self.verify_checkpoints)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore model and optimizers in place and return the rest (loops, schedulers, callbacks,
        and the ``state_dict`` as this rank's view, which callbacks' ``on_load_checkpoint`` read)
        as ``ModelParallelStrategy.load_checkpoint`` does. ``fit`` refuses a weights-only source,
        as Lightning does under DDP; validate/test/predict load its weights."""
        module = self._checkpoint_module()
        fitting = getattr(module, "_trainer", None) is not None and module.trainer.state.fn == "fit"
        rest = load_sharded(module, checkpoint_path, self.optimizers,
                            strict=bool(getattr(module, "strict_loading", True)), weights_only=weights_only,
                            verify=self.verify_checkpoints, reset_changed_roles=self.reset_changed_roles,
                            resume=fitting,
                            before_optimizers=lambda ck: restore_finetuning_groups(ck, module.trainer, module,
                                                                                   self.optimizers),
                            with_state_dict=True)
        import lightning.pytorch as pl

        # A weights-only source outside fit, or a Fabric checkpoint (no loops in it): the rest starts fresh.
        rest = dict(rest or {})
        rest.setdefault("pytorch-lightning_version", pl.__version__)
        rest.setdefault("lr_schedulers", [])
        return rest

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint already restored the weights

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint already restored the optimizer states


def register(registry: Any = None) -> None:
    """Register ``"matrix_fsdp"`` with Lightning's strategy registry (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    registry = registry if registry is not None else StrategyRegistry
    if MatrixFSDPStrategy.strategy_name not in registry:
        registry.register(MatrixFSDPStrategy.strategy_name, MatrixFSDPStrategy,
                          description="Owner-sharded ZeRO-3 with exact matrix optimizers (lightning_matrixfsdp)")
