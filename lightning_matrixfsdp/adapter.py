"""What the Trainer and the Fabric adapters share.

Both adapters (``strategy.py`` for the Trainer, ``fabric.py`` for Fabric) take the
same options and drive the same runtime; the steps they have in common live here:
refusing models sharded by someone else, activation checkpointing and sharding,
the group that the global-norm clip reduces over, the optimizer checks, and the
no-sync switch. Everything here takes modules, optimizers, options and plain
values, never a strategy object, so neither adapter depends on the other.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_matrixfsdp.adapter_comm import any_rank
from lightning_matrixfsdp.optim.norms import clip_grad_norm_
from lightning_matrixfsdp.optim.routing import route_optimizer
from lightning_matrixfsdp.runtime import matrix_shard, set_requires_gradient_sync, start_replica_sync
from lightning_matrixfsdp.runtime.config import MatrixFSDPConfig
from lightning_matrixfsdp.runtime.copies import copies_of
from lightning_matrixfsdp.runtime.mesh import MeshInfo
from lightning_matrixfsdp.runtime.tags import sharded_roots, state_of

__all__ = [
    "SETUP_ORDER", "apply_activation_checkpointing", "build_replacement", "check_optimizers_follow",
    "check_precision", "clip_gradients_norm", "clip_group", "is_sharded", "release_unfinished", "replicas_after_step",
    "route_optimizers", "set_gradient_sync", "settle_replicas", "shard_module", "sync_buffers",
]

#: How to set up a model and its optimizer under owner sharding, for error messages.
SETUP_ORDER = ("model = fabric.setup_module(model); optimizer = <Optimizer>(model.parameters(), ...); "
               "optimizer = fabric.setup_optimizers(optimizer)")


def check_precision(precision: Optional[str], who: str) -> None:
    """Refuse the precision settings the owner-sharded runtime cannot serve."""
    if precision == "16-mixed":
        raise ValueError(
            "precision='16-mixed' needs a gradient scaler whose inf checks span the owner shards; "
            f"{who} does not provide one. Use precision='bf16-mixed' or 'bf16-true'."
        )


def is_sharded(module: nn.Module, hint: str, tensor_parallel: bool = False) -> bool:
    """True if ``module`` holds a model that ``matrix_shard`` sharded already; refuses FSDP1
    wrappers and DTensor parameters (FSDP2, or tensor parallelism without ``tensor_parallel``:
    with it, ``matrix_shard`` checks their placements), saying ``hint`` on how to fix it."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError("Found FSDP1-wrapped modules; matrix_fsdp needs the plain model.")
    if not tensor_parallel and any(isinstance(p, DTensor) for p in module.parameters()):
        raise TypeError(f"the model holds DTensor parameters (FSDP2 or tensor parallelism); {hint}")
    return bool(sharded_roots(module))


def apply_activation_checkpointing(module: nn.Module, policy: Any) -> None:
    """Recompute the forward of the submodules ``policy`` picks (a set of module classes or
    ``callable(module) -> bool``) in backward, with non-reentrant checkpointing."""
    if not policy:
        return
    pick = (lambda m: isinstance(m, tuple(policy))) if isinstance(policy, (set, frozenset)) else (lambda m: policy(m))
    from torch.utils.checkpoint import checkpoint

    for m in module.modules():
        if m is not module and pick(m):
            forward = m.forward

            @functools.wraps(forward)
            def run(*args: Any, __f: Callable[..., Any] = forward, **kwargs: Any) -> Any:
                return checkpoint(__f, *args, use_reentrant=False, **kwargs)

            m.forward = run


def shard_module(module: nn.Module, config: MatrixFSDPConfig, mesh: MeshInfo, device: torch.device) -> None:
    """Activation checkpointing, then ``matrix_shard`` with the adapter's config on its mesh."""
    apply_activation_checkpointing(module, config.activation_checkpointing_policy)
    matrix_shard(module, config=config, mesh=mesh, device=device)


def clip_group(module: nn.Module) -> tuple[Optional[dist.ProcessGroup], Any, Optional[dist.ProcessGroup]]:
    """(group, traffic stats, TP group) of the first sharded model inside ``module``: the global norm
    sums the owners' pieces over the shard group (HSDP replicas hold equal gradients), or over the
    world under ``replica_split`` (one replica holds each gradient), and over the TP group (None
    without tensor parallelism)."""
    roots = sharded_roots(module)
    if not roots:
        return None, None, None
    state = state_of(roots[0])
    return state.norm_group, state.stats, state.mesh.tp_group


def clip_gradients_norm(module: nn.Module, parameters: Iterable[torch.Tensor], max_norm: Union[float, int],
                        norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip ``parameters`` by the global norm of the owner-sharded gradients of ``module``."""
    group, stats, tp_group = clip_group(module)
    return clip_grad_norm_(list(parameters), float(max_norm), norm_type=float(norm_type), group=group,
                           error_if_nonfinite=error_if_nonfinite, stats=stats, tp_group=tp_group)


def build_replacement(factory: Callable[[Iterable[nn.Parameter]], Optimizer], params: Sequence[nn.Parameter],
                      n_given: int, who: str) -> Optimizer:
    """The optimizer the ``optimizer=`` option builds over ``params``, in place of the one
    optimizer the user gave (``n_given`` of them); checked to be an ``Optimizer``."""
    if n_given > 1:
        raise ValueError(
            f"{who}(optimizer=...) replaces one optimizer, but {n_given} were given; drop the strategy's "
            "optimizer option or use a single optimizer")
    new = factory(params)
    if not isinstance(new, Optimizer):
        raise TypeError(f"the optimizer factory of {who}(optimizer=...) returned {type(new).__name__}, "
                        "not a torch.optim.Optimizer")
    return new


def replacement_note(new: Optimizer, old: Optional[Optimizer]) -> str:
    """The status line for an ``optimizer=`` replacement, also when the classes are the same."""
    name = type(new).__name__
    if old is None:
        return f"training with {name} from optimizer= (the module returned no optimizer)"
    if type(old) is type(new):
        return f"training with the {name} built by optimizer=; the module's own {name} is not used"
    return f"training with {name} from optimizer= instead of the module's {type(old).__name__}"


def check_optimizers_follow(modules: Sequence[nn.Module], optimizers: Sequence[Optimizer]) -> None:
    """Refuse optimizers holding tensors that are not parameters of the sharded ``modules``
    (built before sharding on a meta-device model, or over a model that was not set up).
    Every rank of the world raises the same error: the verdict is agreed first."""
    own = {id(p) for m in modules for p in m.parameters()}
    bad: Optional[tuple[int, int, tuple[int, ...]]] = None
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) not in own and bad is None:
                    bad = (i, g, tuple(p.shape))
    if any_rank(bad is not None):
        where = (f"optimizer {bad[0]}, param group {bad[1]}, a tensor of shape {bad[2]}" if bad is not None
                 else "on another rank")
        raise RuntimeError(
            f"an optimizer references tensors that are not parameters of a sharded model ({where}): it was "
            f"built before the model was sharded (on the meta device), or over a model that was not set up. "
            f"Set up the model "
            f"first, then build the optimizer on its parameters: {SETUP_ORDER}")


def route_optimizers(optimizers: Iterable[Optimizer]) -> None:
    """Keep only the parameters each rank owns in every optimizer (in place)."""
    for opt in optimizers:
        route_optimizer(opt)


def set_gradient_sync(module: nn.Module, value: bool) -> None:
    """Switch gradient reduction of every sharded model inside ``module`` (``False``: no-sync
    micro-batches accumulate full gradients locally)."""
    for root in sharded_roots(module):
        set_requires_gradient_sync(root, value)


def replicas_after_step(module: nn.Module, optimizer: Optimizer) -> None:
    """``replica_split``: ``optimizer.step()`` just returned; start sending the weights it updated
    on the stepping replicas to the others (waited for before each unit's next materialization,
    or at once when ``module`` has sharded copies: weight averaging reads every replica's
    weights right after the step)."""
    for root in sharded_roots(module):
        start_replica_sync(root, optimizer)
        if copies_of(module):
            state_of(root).wait_replicas()


def release_unfinished(module: nn.Module) -> None:
    """Before a step: release the units a forward without backward left materialized
    (``StochasticWeightAveraging``'s BatchNorm epoch skips backward)."""
    for root in sharded_roots(module):
        state_of(root).release_unfinished()


def settle_replicas(module: nn.Module) -> None:
    """``replica_split``: before evaluation and at the end of training, when every step taken has
    been started: every replica holds the current weights and nothing is left to send (so an
    evaluation forward, which some ranks may skip under the uneven-inputs join, sends nothing)."""
    for root in sharded_roots(module):
        state_of(root).settle_replicas(clear=True)


def sync_buffers(module: nn.Module, only_if_due: bool = False) -> None:
    """Every sharded model inside ``module`` takes global rank 0's buffers (collective; nothing with
    ``broadcast_buffers=False``). ``only_if_due``: only where DDP's next forward would broadcast."""
    for root in sharded_roots(module):
        state_of(root).broadcast_buffers(only_if_due)
