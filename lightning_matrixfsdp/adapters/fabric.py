"""``MatrixFSDPFabricStrategy``: owner-sharded ZeRO-3 for Lightning Fabric.

``Fabric(strategy="matrix_fsdp")`` after ``import lightning_matrixfsdp``. The same
runtime and options (``MatrixFSDPConfig``) as the Trainer's ``MatrixFSDPStrategy``; what
both strategies share (the mixin and the helpers) is ``shared.py``'s. Order of setup (see ``docs/fabric.md``)::

    model = fabric.setup_module(model)                   # shards the model
    optimizer = lightning_matrixfsdp.Muon(model.parameters(), lr=0.02)
    optimizer = fabric.setup_optimizers(optimizer)      # keeps what this rank owns

``fabric.setup(model, optimizer)`` works too when the optimizer holds the model's own
parameters (the runtime keeps the parameter objects); an optimizer built on a
meta-device model is refused with the order above. Checkpoints use the Trainer's
format: ``fabric.save`` / ``fabric.load`` and ``Trainer(ckpt_path=...)`` read each
other's, at any world size.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from typing import Any, Callable, Mapping, Optional, Union

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_matrixfsdp.adapters.shared import (
    SETUP_ORDER,
    MatrixFSDPAdapter,
    adapter_docstring,
    adapter_signature,
    apply_activation_checkpointing,
    build_replacement,
    check_optimizers_follow,
    check_precision,
    clip_gradients_norm,
    clip_group,
    is_sharded,
    replacement_note,
    replicas_after_step,
    route_optimizers,
    set_gradient_sync,
)
from lightning_matrixfsdp.checkpoint import load_sharded, meta_init, save_sharded
from lightning_matrixfsdp.adapters.pipeline import holds_pipeline, pipeline_of, setup_pipeline
from lightning_matrixfsdp.optim.norms import clip_grad_norm_pipeline_
from lightning_matrixfsdp.optim.routing import full_params
from lightning_matrixfsdp.runtime import is_matrix_sharded
from lightning_matrixfsdp.runtime.comm.small import gather_ints
from lightning_matrixfsdp.runtime.errors import MatrixShardError

__all__ = ["MatrixFSDPFabricStrategy", "register_fabric"]

#: Keys of the Trainer's checkpoint layout that ``fabric.load`` restores itself (model and
#: optimizers) and does not hand back.
_RESTORED_KEYS = ("state_dict", "optimizer_states", "matrix_fsdp_layout")


def _not_used(module: nn.Module, mesh: Any) -> nn.Module:  # ModelParallelStrategy wants a parallelize_fn
    raise AssertionError("MatrixFSDPFabricStrategy shards in setup_module")


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class _NoSync(AbstractContextManager):
    """Defer the gradient reduction of every sharded model inside ``module`` while active."""

    def __init__(self, module: nn.Module, enabled: bool) -> None:
        self._module = module
        self._enabled = enabled

    def __enter__(self) -> None:
        if self._enabled:
            set_gradient_sync(self._module, False)

    def __exit__(self, *exc: Any) -> None:
        if self._enabled:
            set_gradient_sync(self._module, True)


class _OwnerBackwardSyncControl(_BackwardSyncControl):
    def __init__(self, active: bool) -> None:
        self.active = active

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return _NoSync(module, enabled and self.active)


class MatrixFSDPFabricStrategy(MatrixFSDPAdapter, ModelParallelStrategy):
    """Owner-sharded ZeRO-3 with exact matrix optimizers, for Fabric.

    Takes the options of :class:`~lightning_matrixfsdp.MatrixFSDPStrategy` (listed once in
    ``MatrixFSDPConfig``), with two Fabric meanings, said in the Args below: ``optimizer``
    and ``accumulation_no_sync`` (default ``True`` here).
    """

    __doc__ = adapter_docstring(
        __doc__,
        optimizer="Under Fabric, setup_optimizers (or setup) returns the factory's optimizer over the given "
                  "optimizer's parameters instead of the given one",
        accumulation_no_sync="Under Fabric (default True): fabric.no_backward_sync defers the reduction to the "
                             "last micro-batch, as FSDP does (every rank then holds its full local gradients "
                             "until then); False makes it a no-op, so each micro-batch reduces to the owners and "
                             "the memory stays sharded")
    strategy_name = "matrix_fsdp"
    options_signature = adapter_signature(accumulation_no_sync=True)
    default_accumulation_no_sync = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # the options: docs/user-guide.md
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _OwnerBackwardSyncControl(self.accumulation_no_sync)
        self._modules: list[nn.Module] = []  # the models set up so far (optimizers must follow them)

    __init__.__signature__ = options_signature  # type: ignore[attr-defined]

    @override
    def parent_options(self) -> dict[str, Any]:
        return {"parallelize_fn": _not_used}

    @override
    def start_process_group(self) -> None:
        ParallelStrategy.setup_environment(self)  # the device
        self._setup_distributed()  # the seed, the ranks, the process group (not Lightning's mesh)

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision(self) -> Precision:
        return super().precision  # a setter of our own needs the property redefined

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        if precision is not None:
            check_precision(getattr(precision, "precision", None), type(self).__name__)
        ModelParallelStrategy.precision.fset(self, precision)

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        # ModelParallelStrategy enters torch.device("meta"): buffers too, so one computed in __init__
        # and absent from every checkpoint (a rotary inv_freq) would be garbage after sharding.
        # Parameters alone go to the meta device; setup_module gives each owner its tensors.
        stack = ExitStack()
        if empty_init:
            stack.enter_context(meta_init())
        stack.enter_context(self.precision.module_init_context())
        return stack

    # ------------------------------------------------------------------ setup
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        hint = ("matrix_fsdp shards the model itself: remove fully_shard/parallelize_module, or call "
                "lightning_matrixfsdp.matrix_shard on the plain model")
        if self.pipeline_mesh is not None and pipeline_of(module) is None:  # pipeline_parallel_size > 1
            session = setup_pipeline(module, self.config, self.pipeline_mesh, self.root_device, lambda: 1,
                                     apply_activation_checkpointing)
            if self.config.log_plan:  # the split, as the Trainer's strategy prints it
                rank_zero_info(session.run.plan.describe())
        elif not is_sharded(module, hint, tensor_parallel=self.tensor_parallel):
            self.shard(module)
        module.to(self.root_device)  # buffers and anything outside the shard
        self._modules.append(module)
        self.log_plans(module)
        return module

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The data-parallel place (as the Trainer's strategy): the stages of one place, and the ranks
        # of one TP group, read the same batches (Lightning's counts every rank of the world mesh).
        return self.data_parallel_sampler()

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Under pipeline parallelism: every rank's loader must give as many batches (``setup_dataloaders``)."""
        if self.pipeline_mesh is not None:
            check_even_batches(dataloader)
        return super().process_dataloader(dataloader)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if not self._modules:
            raise RuntimeError(f"set up the model before its optimizer: {SETUP_ORDER}")
        check_optimizers_follow(self._modules, [optimizer])
        if self.optimizer_factory is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            old = optimizer
            optimizer = build_replacement(self.optimizer_factory, params, 1, type(self).__name__)
            rank_zero_info(f"{type(self).__name__}: {replacement_note(optimizer, old)}")
        route_optimizers([optimizer])
        return optimizer

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, *optimizers)``: works when the optimizers hold the model's own
        parameters (sharding keeps the parameter objects); otherwise raises with the order to use."""
        if self.optimizer_factory is not None and scheduler is not None:
            raise ValueError(
                f"{type(self).__name__}(optimizer=...) replaces the optimizer, so a scheduler built on the given one "
                f"would drive nothing; build the scheduler on the optimizer fabric.setup_optimizers returns: "
                f"{SETUP_ORDER}")
        module = self.setup_module(module)
        check_optimizers_follow([module], optimizers)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The step, then (``replica_split``) the updated weights start towards the other replicas."""
        route_optimizers([getattr(optimizer, "optimizer", optimizer)])  # a group added through a wrapper
        sessions = [s for m in self._modules if (s := pipeline_of(m)) is not None]
        for session in sessions:  # tied weights across stages: summed (if no clip did it), stepped, copied back
            session.before_step()
        out = super().optimizer_step(optimizer, **kwargs)
        for session in sessions:
            session.after_step()
        for module in self._modules:  # pipelined: this rank's stages (not submodules of the module)
            session = pipeline_of(module)
            for root in [module] if session is None else session.run.stages:
                replicas_after_step(root, getattr(optimizer, "optimizer", optimizer))
        if self.async_saver is not None and len(self._modules) == 1:  # once: the first save's host buffer
            self.async_saver.reserve(self._modules[0], [optimizer])
        return out

    # ------------------------------------------------------------------ gradients
    @override
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """Under pipeline parallelism the schedule ran the backward inside ``forward_loss``: the
        loss must be the one it returned (a scaled copy would scale nothing); the hooks run."""
        sessions = [s for m in self._modules if (s := pipeline_of(m)) is not None]
        # the model whose forward_loss ran this step (several models set up: not necessarily the first)
        session = next((s for s in sessions if s.pending is not None), sessions[0] if sessions else None)
        if session is None:
            return super().backward(tensor, module, *args, **kwargs)
        session.take_backward(tensor)
        self.precision.pre_backward(tensor, module)
        self.precision.post_backward(tensor, module)

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip by the global norm, as DDP's clip over the optimizer's parameters (every rank's
        full list, in group order: the norms combine exactly as torch combines them)."""
        self.precision.unscale_gradients(optimizer)
        session = pipeline_of(module)
        if session is not None:  # each stage's owners, then over the stages
            session.before_step()  # a tied weight counted once: its head copy's gradient joins the embedding's
            group, stats = clip_group(session.run.stages[0])
            return clip_grad_norm_pipeline_(full_params(optimizer), max_norm, norm_type, group=group,
                                            pp_group=session.run.pp_group, error_if_nonfinite=error_if_nonfinite,
                                            stats=stats)
        return clip_gradients_norm(module, full_params(optimizer), max_norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def _split_state(state: Mapping[str, Any], verb: str) -> tuple[nn.Module, list[Optimizer], list[str]]:
        """(the one sharded model, the optimizers in state order, the other keys)."""
        models = [k for k, v in state.items()
                  if isinstance(v, nn.Module) and (is_matrix_sharded(v) or holds_pipeline(v))]
        if len(models) != 1:
            found = f"found {len(models)} ({', '.join(map(repr, models))})" if models else "found none"
            raise ValueError(
                f"fabric.{verb} needs exactly one model set up by matrix_fsdp in the state, {found}; pass it as "
                f"state={{'model': model, 'optimizer': optimizer, ...}} (one model per checkpoint)")
        optimizers = [v for v in state.values() if isinstance(v, Optimizer)]
        others = [k for k, v in state.items() if k != models[0] and not isinstance(v, Optimizer)]
        return state[models[0]], optimizers, others

    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """The Trainer's checkpoint format: the model as ``state_dict``, the optimizers (in state
        order) as ``optimizer_states``, everything else in ``meta.pt`` (or the file)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        if filter:
            raise NotImplementedError(f"{type(self).__name__} does not save filtered checkpoints (filter="
                                      f"{sorted(filter)}); save the whole state")
        module, optimizers, others = self._split_state(state, "save")
        clash = [k for k in others if k in _RESTORED_KEYS]
        if clash:
            raise ValueError(f"fabric.save: the state keys {clash} are reserved by the checkpoint layout; rename them")
        extra = {k: (state[k].state_dict() if _is_stateful(state[k]) else state[k]) for k in others}
        if self.async_saver is not None:  # returns once the state is in host memory
            self.async_saver.save_sharded(module, path, optimizers, extra=extra, checksums=self.verify_checkpoints)
            return
        save_sharded(module, path, optimizers, full=not self.config.save_distributed_checkpoint, extra=extra,
                     checksums=self.verify_checkpoints)

    @override
    def load_checkpoint(self, path: _PATH, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore the model and optimizers in place (any world size, Trainer or Fabric
        checkpoint), then the other requested keys; returns what was not requested."""
        self.wait_checkpoints()  # reads completed checkpoints only (async_save)
        if not state:
            raise ValueError(f"{type(self).__name__}.load_checkpoint needs the model in the state: "
                             "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})")
        if isinstance(state, Optimizer):
            raise NotImplementedError("loading an optimizer alone is not supported; pass {'model': model, "
                                      "'optimizer': optimizer}")
        if isinstance(state, nn.Module):
            load_sharded(state, path, (), strict=strict, weights_only=weights_only, verify=self.verify_checkpoints)
            return {}
        module, optimizers, others = self._split_state(state, "load")
        meta = load_sharded(module, path, optimizers, strict=strict, weights_only=weights_only,
                            verify=self.verify_checkpoints, reset_changed_roles=self.reset_changed_roles)
        rest = {k: v for k, v in (meta or {}).items() if k not in _RESTORED_KEYS}
        missing = [k for k in others if k not in rest]
        if strict and missing:
            raise KeyError(f"checkpoint {path} holds no {missing[0]!r} (requested in the state); the model and "
                           "optimizers were restored; pass strict=False to skip missing keys")
        for k in others:
            if k in rest:
                value = rest.pop(k)
                if _is_stateful(state[k]):
                    state[k].load_state_dict(value)
                else:
                    state[k] = value
        return rest

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="Owner-sharded ZeRO-3 with exact "
                                       "matrix optimizers (lightning_matrixfsdp)")


def register_fabric(registry: Any = None) -> None:
    """Register ``"matrix_fsdp"`` with Fabric's strategy registry (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    MatrixFSDPFabricStrategy.register_strategies(registry if registry is not None else STRATEGY_REGISTRY)


def check_even_batches(dataloader: Any) -> None:
    """Refuse, on every rank, dataloaders whose lengths differ between ranks (one all-gather over
    the world, at ``setup_dataloaders``). Under pipeline parallelism each batch's schedule runs on
    the ranks of a pipeline group together, and Fabric's loop has no join: a rank whose loader
    ended leaves the others waiting in their next step until the process-group timeout. A loader
    without a length (an iterable dataset) cannot be checked here (docs/pipeline-parallel.md)."""
    try:
        mine = len(dataloader)
    except TypeError:
        mine = -1
    counts = [c for (c,) in gather_ints([mine], None, "the dataloaders' lengths under pipeline parallelism")]
    if len({c for c in counts if c >= 0}) > 1:
        said = ", ".join(f"rank {r}: {c if c >= 0 else 'no length'}" for r, c in enumerate(counts))
        raise MatrixShardError(
            f"under pipeline parallelism every rank's dataloader must give the same number of batches ({said}): "
            "the stages of a batch run together, and Fabric's loop has no join, so the ranks with a batch more "
            "would wait for ranks that left the loop until the process-group timeout. Give every rank as many "
            "batches: setup_dataloaders(..., use_distributed_sampler=True) (a DistributedSampler pads to equal "
            "counts), or a per-place dataset whose size is the same on every place")
