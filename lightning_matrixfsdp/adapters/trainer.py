"""``MatrixFSDPStrategy``: owner-sharded ZeRO-3 for the Lightning Trainer.

A thin adapter over ``ModelParallelStrategy``: what it shares with the Fabric strategy
(options, mesh, sharding, teardown) is ``shared.py``'s; here it takes over what
Lightning would do wrongly with owner-shaped parameters (see ``docs/how-it-works.md``),
each through a helper of this folder: the steps (``steps.py``: through the root unit, the
uneven-input join), the optimizer (``replacement.py``, routing), the global-norm clip
(``clipping.py``), Lightning features patched or refused (``compat.py``), param groups
(``param_groups.py``), checkpoints, the model summary and metrics (``telemetry.py``).
"""

from __future__ import annotations

import types
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Generator, Optional

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_matrixfsdp.adapters.clipping import install_clip_group, with_global_norm_clip
from lightning_matrixfsdp.adapters.compat import (
    convert_sync_batchnorm, defer_links, refuse_async_checkpoint_io, refuse_pruning)
from lightning_matrixfsdp.adapters.param_groups import (
    full_finetuning_state, install_toggles, restore_finetuning_groups, uninstall_toggles)
from lightning_matrixfsdp.adapters.pipeline import (
    check_pipelined_trainer, pipeline_of, predicting_loader, setup_pipeline)
from lightning_matrixfsdp.adapters.replacement import replace_optimizer
from lightning_matrixfsdp.adapters.shared import (
    MatrixFSDPAdapter,
    adapter_docstring,
    adapter_signature,
    apply_activation_checkpointing,
    is_sharded,
    replicas_after_step,
    set_gradient_sync,
)
from lightning_matrixfsdp.adapters.steps import UnevenInputs, call_as_forward
from lightning_matrixfsdp.adapters.telemetry import StepTelemetry
from lightning_matrixfsdp.checkpoint import (
    CheckpointError,
    KeyIndex,
    build_index,
    load_sharded,
    meta_init,
    model_view,
    optimizer_class,
    sharded_optimizer_state_dict,
    write_checkpoint,
)
from lightning_matrixfsdp.checkpoint.agree import agree
from lightning_matrixfsdp.optim.routing import route_optimizer
from lightning_matrixfsdp.runtime import (
    broadcast_buffers, release_unfinished, settle_replicas, skip_buffer_broadcast, watch_lone_forwards)
from lightning_matrixfsdp.runtime.views.copies import shard_copies, track_copies
from lightning_matrixfsdp.runtime.tags import sharded_roots


class MatrixFSDPStrategy(MatrixFSDPAdapter, ModelParallelStrategy):
    """Owner-sharded ZeRO-3 with exact matrix optimizers (Muon, Shampoo, SOAP).

    The options (keywords, or one ``MatrixFSDPConfig`` as ``config=``) are listed once, with
    their defaults and what each does, in ``MatrixFSDPConfig`` (docs/user-guide.md, "Strategy
    options", shows the same list); the checks of their values are the config's too.
    """

    __doc__ = adapter_docstring(__doc__)  # the options' Args: (LightningCLI's --help reads them)
    strategy_name = "matrix_fsdp"
    options_signature = adapter_signature(accumulation_no_sync=False)
    default_accumulation_no_sync = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # the options: docs/user-guide.md
        super().__init__(*args, **kwargs)
        self._telemetry = StepTelemetry()
        self._uneven = UnevenInputs()

    __init__.__signature__ = options_signature  # type: ignore[attr-defined]  # what LightningCLI reads

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision_plugin(self):  # type: ignore[override]
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:  # type: ignore[override]
        ModelParallelStrategy.precision_plugin.fset(self, with_global_norm_clip(plugin, "MatrixFSDPStrategy"))

    # ------------------------------------------------------------------ environment
    @override
    def _configure_launcher(self) -> None:
        """A launcher on every rank, as ``DDPStrategy`` has.

        ``ModelParallelStrategy`` configures none in processes it did not start itself (the
        children of its own launch, torchrun, SLURM), so they skip Lightning's
        ``OMP_NUM_THREADS`` setting: on CPU the children then ran with one thread per core
        and the ranks oversubscribed the machine (CHANGELOG, "Fixed", has the measured
        cost). The launcher starts no process where the environment already did. Every parallel
        size is checked against the world first (``check_world``): refused here, before the launch.
        """
        self.check_world()
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def start_process_group(self) -> None:
        self._setup_distributed()  # the device, the seed, the ranks, the process group (not Lightning's mesh)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.lightning_module is not None and self.shard_mesh is not None
        self.lightning_module._device_mesh = self.shard_mesh.device_mesh  # configure_model's self.device_mesh
        track_copies(self.lightning_module)  # callbacks' setup copies it (weight averaging): sharded like it
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:  # rank 0 makes the log directories: its failure is raised on every rank
            agree(_start_loggers, trainer.loggers)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The data-parallel rank: distinct batches per data-parallel rank, the same inside a TP group.
        return self.data_parallel_sampler()

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # As the Fabric strategy's module_init_context: parameters on the meta device, buffers real.
        with (meta_init() if empty_init else nullcontext()), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Any) -> None:
        # Not ModelParallelStrategy.setup: it requires configure_model (we shard unmodified modules),
        # materializes meta modules itself (matrix_shard does, owners only) and converts the precision
        # of an already sharded model again; Strategy.setup converts before the SyncBatchNorm
        # conversion. The order below is theirs with those steps replaced.
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        sharded = self._is_sharded(module) or pipeline_of(module) is not None  # refuses FSDP1 / DTensor models
        refuse_pruning(trainer.callbacks)
        if self.async_saver is not None:
            defer_links(trainer.callbacks, self.async_saver, self.is_global_zero)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.model = convert_sync_batchnorm(self.model, self._layer_sync if fitting else None, self.root_device)
        if sharded:  # sharded before (a second fit, a test after fit): rank 0's buffers, as DDP's setup
            broadcast_buffers(module)
        else:
            self.model = self.precision_plugin.convert_module(self.model)
            if self.pipeline_mesh is not None:  # pipeline_parallel_size > 1: this rank's stages only
                check_pipelined_trainer(module, trainer)
                session = setup_pipeline(module, self.config, self.pipeline_mesh, self.root_device,
                                         lambda: trainer.accumulate_grad_batches, apply_activation_checkpointing)
                if self.config.log_plan:
                    rank_zero_info(session.run.plan.describe())
            else:
                self.shard(module)
        self.model_to_device()  # buffers and anything outside the shard
        watch_lone_forwards(module)  # a forward outside the steps (a hook's) must be joined by every rank
        shard_copies(module)
        install_clip_group(self.precision_plugin, module)
        self._install_summary(trainer)
        install_toggles(module)  # toggle_optimizer over every rank's full param groups
        self.barrier()
        self.log_plans(module)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _is_sharded(self, module: nn.Module) -> bool:
        return is_sharded(module, "configure_model applied FSDP2/tensor parallelism; MatrixFSDPStrategy shards "
                                  "the model itself: remove fully_shard (and parallelize_module, unless "
                                  "tensor_parallel_size > 1), or call lightning_matrixfsdp.matrix_shard",
                          tensor_parallel=self.tensor_parallel)

    def _install_summary(self, trainer: Any) -> None:
        from lightning.pytorch.callbacks import ModelSummary

        from lightning_matrixfsdp.adapters.telemetry import MatrixFSDPSummary

        for cb in trainer.callbacks:
            if isinstance(cb, ModelSummary):
                cb._summary = types.MethodType(
                    lambda self, t, m: MatrixFSDPSummary(m, max_depth=self._max_depth), cb)

    # ------------------------------------------------------------------ optimizers
    @override
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

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Time the optimizer's own step (after the closure's forward/backward) and log traffic."""
        route_optimizer(optimizer)  # a group added since (add_param_group on a LightningOptimizer)
        session = pipeline_of(self.lightning_module)
        if session is not None:  # tied weights across stages: summed after the closure's backward, before the clip
            closure = session.then_before_step(closure)
        out = super().optimizer_step(optimizer, self._telemetry.timed_closure(closure, self.root_device), model,
                                     **kwargs)
        if session is not None:  # the stepped tied weights to the last stage's copies
            session.after_step()
        module = self.lightning_module
        if module is not None:  # replica_split: updated weights on their way, after the step
            for root in [module] if session is None else session.run.stages:  # pipelined: this rank's stages
                replicas_after_step(root, optimizer)
            if self.async_saver is not None:  # once: the first save's host buffer, in the background
                self.async_saver.reserve(module, self.optimizers)
        self._telemetry.end_step(self.root_device)
        if module is not None:  # every rank: the experts' counts are summed over the world at a log step
            self._telemetry.log(module.trainer, self._sharded_roots(), self.is_global_zero)
        return out

    @override
    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Under pipeline parallelism the schedule ran the backward inside ``forward_loss``: only
        the hooks around it run here (``on_before_backward``, ``on_after_backward``)."""
        session = pipeline_of(self.lightning_module)
        if session is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        session.take_backward()
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    @override
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

    @override
    def on_test_start(self) -> None:
        """``replica_split``: evaluation and the end of fit see every replica's weights current
        (Lightning's own hooks here do nothing); a forward left without backward is released."""
        module = self.lightning_module
        if module is not None:
            session = pipeline_of(module)  # pipelined: this rank's stages (not submodules of the module)
            for root in [module] if session is None else session.run.stages:
                release_unfinished(root)
                settle_replicas(root)

    on_predict_start = on_test_start

    @override
    def on_validation_start(self) -> None:
        """Also, in fit: rank 0's buffers where DDP's first validation forward would broadcast them
        (here every rank is present, also when some have no validation batch)."""
        self.on_test_start()
        if self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            broadcast_buffers(self.lightning_module, only_if_due=True)

    @override
    def on_train_end(self) -> None:
        """As ``on_test_start``; and the end of ``fit`` sees completed checkpoints only (``async_save``;
        this hook runs after the callbacks')."""
        self.on_test_start()
        self.wait_checkpoints()

    @override
    def teardown(self) -> None:
        uninstall_toggles(self.lightning_module)
        super().teardown()

    # ------------------------------------------------------------------ steps (steps.py)
    def _sharded_roots(self) -> list[nn.Module]:
        return sharded_roots(self.lightning_module) if self.lightning_module is not None else []

    @property
    def _train_counts_may_differ(self) -> bool:
        """Whether each training step checks for uneven batch counts (``steps.UnevenInputs``)."""
        return self._uneven.train_counts_may_differ

    @override
    def process_dataloader(self, dataloader: object) -> object:
        training = self.lightning_module is not None and \
            self.lightning_module.trainer.state.stage == RunningStage.TRAINING
        loader = self._uneven.wrap(dataloader, self.lightning_module, self.world_size, training)
        return predicting_loader(loader, self.lightning_module)  # pipelined: a place without batches is heard

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        self._uneven.check_training_step(
            module, self.world_size, lambda: module.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        release_unfinished(module)  # the previous step's forward may have had no backward
        with self.precision_plugin.train_step_context():
            out = call_as_forward(module, "training_step", *args, **kwargs)
        if not module.automatic_optimization:
            # As Lightning's DDP, which marks a manual step's forward as run without gradient
            # sync (the backward is the user's): the next forward keeps each rank's buffers.
            skip_buffer_broadcast(module)
        return out

    def _joined_step(self, name: str, loop: Any, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        return self._uneven.run_step(module, self.world_size, lambda: call_as_forward(module, name, *args, **kwargs),
                                     lambda: loop.batch_progress.is_last_batch)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        loop = trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == "fit" else trainer.validate_loop
        with self.precision_plugin.val_step_context():
            return self._joined_step("validation_step", loop, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        loop = self.lightning_module.trainer.test_loop  # type: ignore[union-attr]
        with self.precision_plugin.test_step_context():
            return self._joined_step("test_step", loop, *args, **kwargs)

    @override
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

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        module = self._checkpoint_module()
        self._checkpoint_index = build_index(module)
        return model_view(self._checkpoint_index)  # whole where owned; save_checkpoint writes the owners' data

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return sharded_optimizer_state_dict(self._checkpoint_module(), optimizer,
                                            full=not self.config.save_distributed_checkpoint, index=self._checkpoint_index)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        index, self._checkpoint_index = self._checkpoint_index, None
        module = self._checkpoint_module()
        full_finetuning_state(checkpoint, module.trainer.callbacks, module, self.optimizers)
        if self.async_saver is not None:
            self.async_saver.save(module, checkpoint, filepath, [optimizer_class(o) for o in self.optimizers],
                                  index=index, checksums=self.verify_checkpoints)
            return
        write_checkpoint(self._checkpoint_module(), checkpoint, filepath, full=not self.config.save_distributed_checkpoint,
                         optimizer_classes=[optimizer_class(o) for o in self.optimizers], index=index,
                         checksums=self.verify_checkpoints)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore model and optimizers in place and return the rest (loops, schedulers, callbacks,
        and the ``state_dict`` as this rank's view, which callbacks' ``on_load_checkpoint`` read)
        as ``ModelParallelStrategy.load_checkpoint`` does. ``fit`` refuses a weights-only source,
        as Lightning does under DDP; validate/test/predict load its weights."""
        self.wait_checkpoints()  # a resume reads completed checkpoints only
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

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """With ``async_save``, once the pending save is published (a crash in between keeps it)."""
        if self.async_saver is None:
            return super().remove_checkpoint(filepath)
        remove = self.checkpoint_io.remove_checkpoint
        self.async_saver.after_publish((lambda: remove(filepath)) if self.is_global_zero else None)

    @property
    @override
    def checkpoint_io(self) -> Any:  # type: ignore[override]
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:  # type: ignore[override]
        refuse_async_checkpoint_io(io, type(self).__name__)
        ModelParallelStrategy.checkpoint_io.fset(self, io)


def _start_loggers(loggers: list[Any]) -> None:
    """What Lightning's setup does on rank 0 only, then waits in a barrier (a failure there, e.g. an
    unwritable log directory, left the other ranks to die in it): create each logger's experiment,
    Weights & Biases first as Lightning orders them. Lightning then finds them created."""
    for logger in sorted(loggers, key=lambda lg: type(lg).__name__ != "WandbLogger"):
        if hasattr(logger, "experiment"):
            _ = logger.experiment


def register(registry: Any = None) -> None:
    """Register ``"matrix_fsdp"`` with Lightning's strategy registry (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    registry = registry if registry is not None else StrategyRegistry
    if MatrixFSDPStrategy.strategy_name not in registry:
        registry.register(MatrixFSDPStrategy.strategy_name, MatrixFSDPStrategy,
                          description="Owner-sharded ZeRO-3 with exact matrix optimizers (lightning_matrixfsdp)")
