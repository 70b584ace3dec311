"""What the Trainer and the Fabric strategies share, written once: ``MatrixFSDPAdapter``.

A mixin placed before Lightning's ``ModelParallelStrategy`` (the Trainer's or Fabric's):
the options as one ``MatrixFSDPConfig`` (the keyword form binds a signature generated
from the config), the attributes that read it, the mesh (one ``MeshInfo``, built in
``setup_environment`` from Lightning's device mesh), sharding a module with the config,
the plan log and the teardown. Each strategy file keeps only what differs.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, ClassVar, Optional

from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.strategies import ModelParallelStrategy as TrainerModelParallel
from torch import nn
from typing_extensions import override

from lightning_matrixfsdp.adapter import shard_module
from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer
from lightning_matrixfsdp.runtime import get_plan
from lightning_matrixfsdp.runtime.config import ADAPTER, MatrixFSDPConfig, bind_options, options_signature
from lightning_matrixfsdp.runtime.mesh import MeshInfo
from lightning_matrixfsdp.runtime.mesh_comm import mesh_info
from lightning_matrixfsdp.runtime.tags import sharded_roots
from lightning_matrixfsdp.runtime.waits import stop_waiter

__all__ = ["MatrixFSDPAdapter", "adapter_signature", "mesh_sizes"]

#: Attribute names that differ from the option's (``optimizer`` is a factory, not an optimizer).
_ATTRIBUTE = {"optimizer": "optimizer_factory"}


def adapter_signature(**defaults: Any) -> inspect.Signature:
    """A strategy's ``__init__`` signature: ``self``, every adapter option (with the strategy's
    own ``defaults`` where they differ from the config's), ``config``."""
    me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return options_signature(ADAPTER, first=[me], defaults=defaults)


def mesh_sizes(data_parallel: Any, tensor_parallel: Any, world: int, per_node: int) -> tuple[int, int]:
    """(data-parallel size, tensor-parallel size) for the options' values (``"auto"`` TP: the
    processes of a node; ``"auto"`` DP: the rest of the world), checked against the world."""
    tp = per_node if tensor_parallel == "auto" else int(tensor_parallel)
    if data_parallel == "auto":
        if world % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the world size {world}")
        return world // tp, tp
    dp = int(data_parallel)
    if dp * tp != world:
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} must equal the world size {world}")
    return dp, tp


class MatrixFSDPAdapter:
    """The shared half of ``MatrixFSDPStrategy`` and ``MatrixFSDPFabricStrategy`` (a mixin)."""

    #: The strategy's keyword signature (``adapter_signature``), also its ``__init__.__signature__``.
    options_signature: ClassVar[inspect.Signature]
    #: ``accumulation_no_sync`` when the config leaves it to the strategy (None).
    default_accumulation_no_sync: ClassVar[bool] = False
    config: MatrixFSDPConfig
    #: the groups of the sharded models (``setup_environment`` builds it)
    shard_mesh: Optional[MeshInfo] = None

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
        return {"num_replicas": world // tp, "rank": self.global_rank // tp}  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        """The mesh sizes (``mesh_sizes``: all ranks data parallel by default, unlike Lightning's
        "auto"), Lightning's ``(data_parallel, tensor_parallel)`` mesh, then the shard mesh: its
        data-parallel dimension, or ``shard_size``'s HSDP inside it; the TP group beside."""
        world = self.num_nodes * self.num_processes  # type: ignore[attr-defined]
        dp, tp = mesh_sizes(self.config.data_parallel_size, self.config.tensor_parallel_size, world,
                            self.num_processes)  # type: ignore[attr-defined]
        self._data_parallel_size, self._tensor_parallel_size = dp, tp
        super().setup_environment()  # type: ignore[misc]
        size = self.config.shard_size or dp
        if dp % size:
            raise ValueError(f"shard_size={size} must divide the data-parallel size {dp}"
                             + (f" (world {world} / tensor_parallel_size {tp})" if tp > 1 else ""))
        self.shard_mesh = mesh_info(self.device_mesh, self.config.shard_size, self.root_device,  # type: ignore[attr-defined]
                                   self.config.timeout)

    # ------------------------------------------------------------------ sharding
    def shard(self, module: nn.Module) -> None:
        """Activation checkpointing, then ``matrix_shard`` with the config on the shard mesh."""
        assert self.shard_mesh is not None, "setup_environment builds the mesh first"
        shard_module(module, self.config, self.shard_mesh, self.root_device)  # type: ignore[attr-defined]

    def log_plans(self, module: nn.Module) -> None:
        """The owner plan of every sharded model inside ``module`` (rank 0; ``log_plan``)."""
        if self.config.log_plan:
            for root in sharded_roots(module):
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
