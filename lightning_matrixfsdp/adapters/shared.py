"""What the Trainer and the Fabric strategies share, written once: the mixin and the helpers.

``MatrixFSDPAdapter`` is a mixin placed before Lightning's ``ModelParallelStrategy`` (the
Trainer's or Fabric's): the options as one ``MatrixFSDPConfig`` (the keyword form binds a
signature generated from the config), the attributes that read it, the mesh (one
``ParallelDims`` record of the sizes, checked before the launch; one ``MeshInfo`` of every
group, built from it in ``setup_environment``, whose ``(data_parallel, tensor_parallel)``
DeviceMesh is the strategy's ``device_mesh``), sharding a
module with the config, the plan log and the teardown. Each strategy file
(``trainer.py``, ``fabric.py``) keeps only what differs.

The free functions below are the steps both adapters call: refusing models sharded by
someone else, activation checkpointing and sharding, the group that the global-norm clip
reduces over, the optimizer checks, the no-sync switch and the ``replica_split`` transfers
after a step. What they ask of the runtime goes through its public functions
(``lightning_matrixfsdp.runtime``), never its state object. They take modules, optimizers,
options and plain values, never a strategy object, so neither adapter depends on the other.
"""

from __future__ import annotations

import dataclasses

import functools
import inspect
import sys
from typing import Any, Callable, ClassVar, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.strategies import ModelParallelStrategy as TrainerModelParallel
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer
from lightning_matrixfsdp.optim.norms import clip_grad_norm_
from lightning_matrixfsdp.optim.routing import route_optimizer
from lightning_matrixfsdp.runtime import (
    get_plan, matrix_shard, norm_groups, set_requires_gradient_sync, start_replica_sync, wait_replicas)
from lightning_matrixfsdp.runtime.config import (
    ADAPTER, MatrixFSDPConfig, bind_options, options_docstring, options_signature)
from lightning_matrixfsdp.runtime.views.copies import copies_of
from lightning_matrixfsdp.runtime.mesh.comm import build_mesh
from lightning_matrixfsdp.runtime.mesh.dims import ParallelDims
from lightning_matrixfsdp.runtime.mesh.info import MeshInfo
from lightning_matrixfsdp.runtime.comm.small import any_rank
from lightning_matrixfsdp.runtime.queries import by_stage
from lightning_matrixfsdp.runtime.tags import is_stage, sharded_roots
from lightning_matrixfsdp.runtime.comm.waits import stop_waiter
from lightning_matrixfsdp.runtime.pipeline import PipelineMesh, pipeline_mesh
from lightning_matrixfsdp.adapters.pipeline import check_pipeline_world

__all__ = [
    "MatrixFSDPAdapter", "SETUP_ORDER", "adapter_docstring", "adapter_signature", "apply_activation_checkpointing",
    "build_replacement", "check_optimizers_follow", "check_precision", "clip_gradients_norm", "clip_group", "is_sharded", "mesh_sizes",
    "replacement_note", "replicas_after_step", "route_optimizers", "set_gradient_sync", "shard_module",
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


def clip_group(module: nn.Module) -> tuple[Optional[dist.ProcessGroup], Any]:
    """(group, traffic stats) of the first sharded model inside ``module`` ((None, None) without
    one): the global norm sums the owners' pieces over the shard group (HSDP replicas hold equal
    gradients), or over the world under ``replica_split`` (one replica holds each gradient). The
    clip finds the TP group itself, from the parameters' TP fragments."""
    groups = norm_groups(module)
    return (None, None) if groups is None else (groups.group, groups.stats)


def clip_gradients_norm(module: nn.Module, parameters: Iterable[torch.Tensor], max_norm: Union[float, int],
                        norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip ``parameters`` by the global norm of the owner-sharded gradients of ``module``."""
    group, stats = clip_group(module)
    return clip_grad_norm_(list(parameters), float(max_norm), norm_type=float(norm_type), group=group,
                           error_if_nonfinite=error_if_nonfinite, stats=stats)


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
    micro-batches accumulate full gradients locally). Not pipeline stages: their schedule reduces
    every micro-batch (``runtime/pipeline/runner.py`` says why), exact either way."""
    for root in sharded_roots(module):
        if not is_stage(root):
            set_requires_gradient_sync(root, value)


def replicas_after_step(module: nn.Module, optimizer: Optimizer) -> None:
    """``replica_split``: ``optimizer.step()`` just returned; start sending the weights it updated
    on the stepping replicas to the others (waited for before each unit's next materialization,
    or at once when ``module`` has sharded copies: weight averaging reads every replica's
    weights right after the step)."""
    for root in sharded_roots(module):
        start_replica_sync(root, optimizer)
        if copies_of(module):
            wait_replicas(root)


# ---------------------------------------------------------------- the mixin
#: Attribute names that differ from the option's (``optimizer`` is a factory, not an optimizer).
_ATTRIBUTE = {"optimizer": "optimizer_factory"}


def adapter_signature(**defaults: Any) -> inspect.Signature:
    """A strategy's ``__init__`` signature: ``self``, every adapter option (with the strategy's
    own ``defaults`` where they differ from the config's), ``config``."""
    me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return options_signature(ADAPTER, first=[me], defaults=defaults)


def adapter_docstring(doc: Optional[str], **notes: str) -> str:
    """A strategy's docstring: the text written for it, then the ``Args:`` of its options,
    generated from the config's descriptions (``notes``: a sentence added to an option's
    text, what it means for this strategy). LightningCLI's ``--help`` shows them."""
    return inspect.cleandoc(doc or "") + "\n\n" + options_docstring(ADAPTER, notes)


def mesh_sizes(data_parallel: Any, tensor_parallel: Any, world: int, per_node: int) -> tuple[int, int]:
    """(data-parallel size, tensor-parallel size) for the options' values (``"auto"`` TP: the
    processes of a node; ``"auto"`` DP: the rest of the world), checked against the world (the
    ``ParallelDims`` record's sizes)."""
    dims = ParallelDims.from_options(world, per_node, data_parallel=data_parallel, tensor_parallel=tensor_parallel)
    return dims.data_parallel, dims.tensor


class MatrixFSDPAdapter:
    """The shared half of ``MatrixFSDPStrategy`` and ``MatrixFSDPFabricStrategy`` (a mixin)."""

    #: The strategy's keyword signature (``adapter_signature``), also its ``__init__.__signature__``.
    options_signature: ClassVar[inspect.Signature]
    #: ``accumulation_no_sync`` when the config leaves it to the strategy (None).
    default_accumulation_no_sync: ClassVar[bool] = False
    config: MatrixFSDPConfig
    #: the groups of the sharded models (``setup_environment`` builds it)
    shard_mesh: Optional[MeshInfo] = None
    #: the pipeline's mesh under ``pipeline_parallel_size > 1`` (``setup_environment`` builds it)
    pipeline_mesh: Optional[PipelineMesh] = None
    #: ``precision="64-true"`` trains in float64 (Lightning refuses it for ``ModelParallelStrategy``:
    #: ``double_precision.py`` lets the connectors accept it for these strategies)
    serves_double_precision: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        sig = self.options_signature
        unbound = sig.replace(parameters=list(sig.parameters.values())[1:])  # without self
        self.config = bind_options(unbound, type(self).__name__, args, kwargs)
        #: the background saver of ``async_save=True`` (None: saves are synchronous)
        self.async_saver: Optional[AsyncCheckpointer] = AsyncCheckpointer() if self.config.async_save else None
        super().__init__(  # type: ignore[call-arg]
            data_parallel_size="auto", tensor_parallel_size="auto", **self.parent_options(),
            save_distributed_checkpoint=self.config.save_distributed_checkpoint,
            process_group_backend=self.config.process_group_backend, timeout=self.config.timeout)

    def parent_options(self) -> dict[str, Any]:
        """Keywords Lightning's ``ModelParallelStrategy`` needs beside the shared ones."""
        return {}

    @property
    def accumulation_no_sync(self) -> bool:
        value = self.config.accumulation_no_sync
        return self.default_accumulation_no_sync if value is None else value

    # ------------------------------------------------------------------ environment
    @property
    def tensor_parallel(self) -> bool:
        """Whether the mesh has a tensor-parallel dimension above 1 (known after ``setup_environment``)."""
        return self.shard_mesh is not None and self.shard_mesh.tp_size > 1

    def data_parallel_sampler(self) -> dict[str, Any]:
        """The sampler's replicas and rank: the data-parallel rank, so the ranks of one TP group
        read the same batches (every rank its own without TP)."""
        tp = self.shard_mesh.tp_size if self.shard_mesh is not None else 1
        world = self.num_nodes * self.num_processes  # type: ignore[attr-defined]
        places = world // (tp * self.config.pipeline_parallel_size)  # the stages of one place read one batch
        return {"num_replicas": places, "rank": self.global_rank // tp % places}  # type: ignore[attr-defined]

    def check_world(self) -> ParallelDims:
        """The ``ParallelDims`` record of this run's world (devices x nodes): every parallel size checked
        against it at construction. Called when Lightning has the devices and nodes and configures the
        launcher, so a size that cannot divide the world is refused in ``Trainer(...)`` /
        ``Fabric(...)``, before any process starts; and again on every rank before the process group,
        so a strategy that got through raises the same error on each."""
        nodes, per_node = self.num_nodes, self.num_processes  # type: ignore[attr-defined]
        where = f"devices={per_node} x num_nodes={nodes}"
        dims = ParallelDims.from_options(nodes * per_node, per_node, data_parallel=self.config.data_parallel_size,
                                         tensor_parallel=self.config.tensor_parallel_size,
                                         shard_size=self.config.shard_size,
                                         expert_parallel=self.config.expert_parallel_size, where=where)
        check_pipeline_world(self.config, nodes * per_node, dims.tensor, where)  # pipeline_parallel_size
        return dims

    @override
    def _configure_launcher(self) -> None:
        self.check_world()  # before the launch: Lightning knows the devices and nodes now
        super()._configure_launcher()  # type: ignore[misc]

    def start_process_group(self) -> None:
        """Lightning's device setup and process group, without its device mesh (each adapter: the
        steps of its ``ModelParallelStrategy.setup_environment`` before the mesh)."""
        raise NotImplementedError

    @override
    def setup_environment(self) -> None:
        """The sizes (``check_world``: all ranks data parallel by default, unlike Lightning's "auto"),
        the process group, then every group of the run built from the record (``build_mesh``): the
        ``(data_parallel, tensor_parallel)`` DeviceMesh Lightning would build (``device_mesh``), the
        shard mesh inside its data-parallel part (HSDP with ``shard_size``), the TP group beside, the
        expert-parallel groups."""
        dims = self.check_world()
        self.start_process_group()
        if self.config.pipeline_parallel_size > 1:
            # only the world's (data_parallel, tensor_parallel) DeviceMesh (``device_mesh``, what
            # configure_model sees): each stage builds its own shard, replica and expert groups
            dims = dataclasses.replace(dims, shard=dims.data_parallel, replicate=1, expert=1)
        self.shard_mesh = build_mesh(dims, self.root_device, self.config.timeout)  # type: ignore[attr-defined]
        if self.config.pipeline_parallel_size > 1:  # the (pp, dp) mesh, pipeline axis outermost
            self.pipeline_mesh = pipeline_mesh(self.config.pipeline_parallel_size, self.config.shard_size,
                                               self.root_device.type, self.config.timeout)  # type: ignore[attr-defined]

    @property
    def device_mesh(self) -> Any:
        """The run's ``(data_parallel, tensor_parallel)`` DeviceMesh, built from the mesh record (in
        place of the one Lightning's ``setup_environment`` builds)."""
        if self.shard_mesh is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self.shard_mesh.world_mesh

    # ------------------------------------------------------------------ sharding
    def shard(self, module: nn.Module) -> None:
        """Activation checkpointing, then ``matrix_shard`` with the config on the shard mesh."""
        assert self.shard_mesh is not None, "setup_environment builds the mesh first"
        shard_module(module, self.config, self.shard_mesh, self.root_device)  # type: ignore[attr-defined]

    def log_plans(self, module: nn.Module) -> None:
        """The owner plan of every sharded model inside ``module`` (rank 0; ``log_plan``)."""
        if self.config.log_plan:
            roots = sharded_roots(module)
            stages = by_stage(roots, lambda r: str(get_plan(r)))  # pipelined: every stage's, gathered
            for index, text in stages.items():
                rank_zero_info(f"pipeline stage {index}: {text}")
            for root in roots if not stages else ():
                rank_zero_info(str(get_plan(root)))

    # ------------------------------------------------------------------ asynchronous saves
    def wait_checkpoints(self) -> None:
        """Complete the pending asynchronous save (``async_save=True``) and raise its failure, on
        every rank. Collective; nothing to do for synchronous saves."""
        if self.async_saver is not None:
            self.async_saver.wait()

    @override
    def teardown(self) -> None:
        """Also complete a pending asynchronous save and end the helper thread of interruptible gloo
        waits: no thread of ours outlives the run. A save's failure is raised unless the run is
        already ending with an error (then it only goes to stderr, beside that error)."""
        ending_with_error = sys.exc_info()[0] is not None  # teardown inside Lightning's exception handler
        try:
            if self.async_saver is not None:
                self.async_saver.close()
        except Exception as e:
            if not ending_with_error:
                raise
            print(f"lightning_matrixfsdp: {e}", file=sys.stderr)
        finally:
            super().teardown()  # type: ignore[misc]
            stop_waiter()


def _option_attribute(name: str) -> property:
    return property(lambda self: getattr(self.config, name), doc=f"The ``{name}`` option (``self.config``).")


# The options as read-only attributes (``strategy.planner``, ``strategy.optimizer_factory``, ...), except
# where Lightning's strategies have an attribute of that name already (``process_group_backend``).
for _name in MatrixFSDPConfig.names(ADAPTER):
    _attr = _ATTRIBUTE.get(_name, _name)
    if not hasattr(MatrixFSDPAdapter, _attr) and not any(hasattr(c, _attr) for c in (TrainerModelParallel,
                                                                                     FabricModelParallel)):
        setattr(MatrixFSDPAdapter, _attr, _option_attribute(_name))
