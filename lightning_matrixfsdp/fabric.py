"""``MatrixFSDPFabricStrategy``: owner-sharded ZeRO-3 for Lightning Fabric.

``Fabric(strategy="matrix_fsdp")`` after ``import lightning_matrixfsdp``. The same
runtime and options as the Trainer's ``MatrixFSDPStrategy``; what both adapters do
alike is in ``adapter.py``. Order of setup (see ``docs/fabric.md``)::

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

from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

from lightning_matrixfsdp.adapter import (
    SETUP_ORDER,
    build_replacement,
    check_optimizers_follow,
    check_precision,
    clip_gradients_norm,
    is_sharded,
    replacement_note,
    replicas_after_step,
    route_optimizers,
    set_gradient_sync,
    shard_module,
)
from lightning_matrixfsdp.optim.routing import full_params
from lightning_matrixfsdp.checkpoint import load_sharded, save_sharded
from lightning_matrixfsdp.runtime import get_plan, hsdp_mesh, is_matrix_sharded
from lightning_matrixfsdp.runtime.collectives import DEFAULT_COLLECTIVE
from lightning_matrixfsdp.runtime.options import check_bool, check_strategy_options
from lightning_matrixfsdp.runtime.tags import sharded_roots
from lightning_matrixfsdp.runtime.waits import stop_waiter

__all__ = ["MatrixFSDPFabricStrategy", "register_fabric"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]

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


class MatrixFSDPFabricStrategy(ModelParallelStrategy):
    """Owner-sharded ZeRO-3 with exact matrix optimizers, for Fabric.

    Takes the options of :class:`~lightning_matrixfsdp.MatrixFSDPStrategy` (see there),
    with two Fabric meanings:

    * ``optimizer``: ``setup_optimizers`` (or ``setup``) returns the factory's optimizer
      over the given optimizer's parameters instead of the given one.
    * ``accumulation_no_sync`` (default ``True`` here): ``fabric.no_backward_sync`` defers
      the reduction to the last micro-batch, as FSDP does (every rank then holds its full
      local gradients until then); ``False`` makes it a no-op, so each micro-batch reduces
      to the owners and the memory stays sharded.
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
        accumulation_no_sync: bool = True,
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
            parallelize_fn=_not_used, data_parallel_size="auto", tensor_parallel_size="auto",
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
        self.verify_checkpoints = check_bool(verify_checkpoints, "verify_checkpoints")
        self.reset_changed_roles = check_bool(reset_changed_roles, "reset_changed_roles")
        self._backward_sync_control = _OwnerBackwardSyncControl(self.accumulation_no_sync)
        self._shard_mesh: Any = None
        self._modules: list[nn.Module] = []  # the models set up so far (optimizers must follow them)

    # ------------------------------------------------------------------ precision
    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        if precision is not None:
            check_precision(getattr(precision, "precision", None), type(self).__name__)
        self._precision = precision

    # ------------------------------------------------------------------ environment
    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        self._data_parallel_size, self._tensor_parallel_size = world, 1
        super().setup_environment()
        size = self.shard_size or world
        if world % size:
            raise ValueError(f"shard_size={size} must divide the world size {world}")
        if size == world:
            self._shard_mesh = self.device_mesh["data_parallel"]
        else:
            self._shard_mesh = hsdp_mesh(size, self.root_device, self.timeout)

    # ------------------------------------------------------------------ setup
    def setup_module(self, module: nn.Module) -> nn.Module:
        hint = ("matrix_fsdp shards the model itself: remove fully_shard/parallelize_module, or call "
                "lightning_matrixfsdp.matrix_shard on the plain model")
        if not is_sharded(module, hint):
            shard_module(
                module, mesh=self._shard_mesh, device=self.root_device,
                activation_checkpointing_policy=self.activation_checkpointing_policy,
                wrap_policy=self.wrap_policy, planner=self.planner, collective=self.collective,
                matrix_filter=self.matrix_filter, param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                reshard_after_forward=self.reshard_after_forward, prefetch=self.prefetch,
                zero_missing_grads=self.zero_missing_grads, replica_split=self.replica_split,
                flatten_conv=self.flatten_conv, broadcast_buffers=self.broadcast_buffers,
            )
        module.to(self.root_device)  # buffers and anything outside the shard
        self._modules.append(module)
        if self.log_plan:
            for root in sharded_roots(module):
                rank_zero_info(str(get_plan(root)))
        return module

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

    def teardown(self) -> None:
        """Also end the helper thread of interruptible gloo waits (no thread of ours outlives the run)."""
        super().teardown()
        stop_waiter()

    def module_to_device(self, module: nn.Module) -> None:
        pass  # setup_module places the shards

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The step, then (``replica_split``) the updated weights start towards the other replicas."""
        route_optimizers([getattr(optimizer, "optimizer", optimizer)])  # a group added through a wrapper
        out = super().optimizer_step(optimizer, **kwargs)
        for module in self._modules:
            replicas_after_step(module, getattr(optimizer, "optimizer", optimizer))
        return out

    # ------------------------------------------------------------------ gradients
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip by the global norm, as DDP's clip over the optimizer's parameters (every rank's
        full list, in group order: the norms combine exactly as torch combines them)."""
        self.precision.unscale_gradients(optimizer)
        return clip_gradients_norm(module, full_params(optimizer), max_norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def _split_state(state: Mapping[str, Any], verb: str) -> tuple[nn.Module, list[Optimizer], list[str]]:
        """(the one sharded model, the optimizers in state order, the other keys)."""
        models = [k for k, v in state.items() if isinstance(v, nn.Module) and is_matrix_sharded(v)]
        if len(models) != 1:
            found = f"found {len(models)} ({', '.join(map(repr, models))})" if models else "found none"
            raise ValueError(
                f"fabric.{verb} needs exactly one model set up by matrix_fsdp in the state, {found}; pass it as "
                f"state={{'model': model, 'optimizer': optimizer, ...}} (one model per checkpoint)")
        optimizers = [v for v in state.values() if isinstance(v, Optimizer)]
        others = [k for k, v in state.items() if k != models[0] and not isinstance(v, Optimizer)]
        return state[models[0]], optimizers, others

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
        save_sharded(module, path, optimizers, full=not self._save_distributed_checkpoint, extra=extra,
                     checksums=self.verify_checkpoints)

    def load_checkpoint(self, path: _PATH, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore the model and optimizers in place (any world size, Trainer or Fabric
        checkpoint), then the other requested keys; returns what was not requested."""
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
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="Owner-sharded ZeRO-3 with exact "
                                       "matrix optimizers (lightning_matrixfsdp)")


def register_fabric(registry: Any = None) -> None:
    """Register ``"matrix_fsdp"`` with Fabric's strategy registry (idempotent)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    MatrixFSDPFabricStrategy.register_strategies(registry if registry is not None else STRATEGY_REGISTRY)
