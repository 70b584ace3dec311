"""``MatrixFSDPConfig``: every option of ``matrix_shard`` and the two strategies, checked once.

The one list of options. ``matrix_shard``, ``MatrixFSDPStrategy`` and
``MatrixFSDPFabricStrategy`` take a config (``config=``) or the same options as keywords;
the keyword forms build a config, through a signature generated here from the fields
(so it stays introspectable: LightningCLI and jsonargparse read it). A config is frozen
and normalized when built (``__post_init__``, with ``options.py``'s checks, whose errors
name the option and the value): nothing below the place an option enters checks it again.

Which entry point reads a field is its ``where`` metadata: ``SHARD`` (``matrix_shard``),
``ADAPTER`` (the strategies only: optimizer, checkpoints, process group) or both.
"""

from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
import inspect
import operator
from typing import Any, Callable, Iterable, Mapping, Optional, Union, get_type_hints

import torch
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.experts import ExpertStackError, check_expert_stacks
from lightning_matrixfsdp.runtime.mesh import parallel_sizes
from lightning_matrixfsdp.runtime.options import (
    check_backend,
    check_bool,
    check_bool_or_auto,
    check_checkpointing_policy,
    check_collective,
    check_dtype,
    check_matrix_filter,
    check_optimizer_factory,
    check_planner,
    check_positive_int,
    check_timeout,
    check_wrap_policy,
)

__all__ = ["ADAPTER", "SHARD", "MatrixFSDPConfig", "bind_options", "options_signature"]

SHARD, ADAPTER = "shard", "adapter"
OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


def _opt(default: Any, check: Callable[[Any, str], Any], *where: str) -> Any:
    return field(default=default, metadata={"check": check, "where": where or (SHARD, ADAPTER)})


def _named(check: Callable[[Any], Any]) -> Callable[[Any, str], Any]:
    return lambda value, name: check(value)


def _policy_set(check: Callable[[Any], Any]) -> Callable[[Any, str], Any]:
    """A set of module classes frozen (the config is hashable and immutable all through)."""
    def run(value: Any, name: str) -> Any:
        out = check(value)
        return frozenset(out) if isinstance(out, set) else out
    return run


def _parallel_size(value: Any, name: str) -> Union[int, str]:
    """A mesh dimension's size: a positive int or ``"auto"`` (Lightning's meaning, resolved at setup)."""
    if value == "auto" and isinstance(value, str):
        return value
    try:  # ints and integer-like scalars (numpy), as shard_size takes them; not bools, floats or strings
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 1:
        raise MatrixShardError(
            f"{name}={value!r} ({type(value).__name__}) is not accepted; pass a positive int or \"auto\" "
            "(tensor_parallel_size: the ranks one parallelize_module plan splits a matrix over, inside a node; "
            "data_parallel_size: the rest of the world)")
    return n


def _expert_stacks(value: Any, name: str) -> Any:
    """``expert_stacks``: patterns frozen into a sorted tuple of (pattern, blocks) (runtime/experts.py)."""
    try:
        return check_expert_stacks(value, name)
    except ExpertStackError as err:
        raise MatrixShardError(str(err)) from None


def _adapter_default_bool(value: Any, name: str) -> Optional[bool]:
    """``None``: the adapter's own default (``accumulation_no_sync``: off for the Trainer, on for Fabric)."""
    return None if value is None else check_bool(value, name)


@dataclass(frozen=True, kw_only=True)
class MatrixFSDPConfig:
    """Every option of ``matrix_shard`` and the strategies (docs/user-guide.md, "Strategy options",
    says what each does: the one list of them).

    Checked and normalized at construction (dtype names to dtypes, policy classes and import
    paths to a frozenset of classes); a wrong value raises ``MatrixShardError`` naming the
    option and the value. ``matrix_shard`` reads the shard options and ignores the adapters'
    (``activation_checkpointing_policy``, ``optimizer``, checkpoints, process group). Derive a
    changed copy with ``dataclasses.replace(config, ...)`` (checked again).
    """

    # Order: the strategies' positional order (their keyword signatures are generated from it).
    wrap_policy: Any = _opt(None, _policy_set(check_wrap_policy))
    planner: str = _opt("role_greedy", _named(check_planner))
    collective: str = _opt("auto", _named(check_collective))
    matrix_filter: Optional[Callable[[str, nn.Parameter], bool]] = _opt(None, _named(check_matrix_filter))
    param_dtype: Union[str, torch.dtype, None] = _opt(None, check_dtype)
    reduce_dtype: Union[str, torch.dtype, None] = _opt(None, check_dtype)
    activation_checkpointing_policy: Any = _opt(None, _policy_set(check_checkpointing_policy), ADAPTER)
    optimizer: Optional[OptimizerFactory] = _opt(None, _named(check_optimizer_factory), ADAPTER)
    reshard_after_forward: bool = _opt(True, check_bool)
    accumulation_no_sync: Optional[bool] = _opt(None, _adapter_default_bool, ADAPTER)
    shard_size: Optional[int] = _opt(None, lambda v, n: check_positive_int(v, n, optional=True))
    prefetch: bool = _opt(True, check_bool)
    zero_missing_grads: bool = _opt(False, check_bool)
    save_distributed_checkpoint: bool = _opt(True, check_bool, ADAPTER)
    process_group_backend: Optional[str] = _opt(None, _named(check_backend), ADAPTER)
    timeout: Optional[timedelta] = _opt(default_pg_timeout, _named(check_timeout), ADAPTER)
    #: 1: no tensor parallelism (the default, unlike Lightning's "auto": a model without a
    #: parallelize plan would be replicated over the TP ranks); "auto": the processes of a node
    tensor_parallel_size: Union[int, str] = _opt(1, _parallel_size, ADAPTER)
    #: "auto": the world divided by the tensor-parallel size
    data_parallel_size: Union[int, str] = _opt("auto", _parallel_size, ADAPTER)
    log_plan: bool = _opt(True, check_bool, ADAPTER)
    verify_checkpoints: bool = _opt(True, check_bool, ADAPTER)
    reset_changed_roles: bool = _opt(False, check_bool, ADAPTER)
    replica_split: Union[bool, str] = _opt("auto", check_bool_or_auto)
    flatten_conv: bool = _opt(False, check_bool)
    broadcast_buffers: bool = _opt(True, check_bool)
    ns_steps: int = _opt(5, check_positive_int, SHARD)
    async_save: bool = _opt(False, check_bool, ADAPTER)
    #: the user's expert stacks, beside the automatic ones (runtime/experts.py: patterns, a
    #: dict {pattern: blocks}, or a callable (fqn, param) -> ExpertStack | bool | None)
    expert_stacks: Any = _opt(None, _expert_stacks)
    #: expert parallelism: each declared expert stack split over groups of this many data-parallel
    #: ranks, every rank keeping its ``E / EP`` experts (docs/moe.md); 1: off
    expert_parallel_size: int = _opt(1, check_positive_int)
    #: the planner may split an expert stack into contiguous blocks of experts on different owners
    #: when the stack whole would unbalance its unit (runtime/stack_split.py; docs/moe.md)
    split_stacks: bool = _opt(True, check_bool)

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name), f.name))
        if self.async_save and not self.save_distributed_checkpoint:
            raise MatrixShardError("async_save=True writes checkpoint directories in the background; it does not "
                                   "apply to save_distributed_checkpoint=False (one file gathered on rank 0): set "
                                   "save_distributed_checkpoint=True or async_save=False")
        self._check_sizes()

    def _check_sizes(self) -> None:
        """The sizes that cannot go together whatever the world (the rest waits for the world:
        ``mesh.parallel_sizes``, called by the strategies before the launch)."""
        ep, tp, dp = self.expert_parallel_size, self.tensor_parallel_size, self.data_parallel_size
        if ep > 1 and tp != "auto" and tp > 1:
            raise MatrixShardError(f"expert_parallel_size={ep} with tensor parallelism (tensor_parallel_size={tp}) "
                                   "is not supported yet; use one of them")
        if dp != "auto":  # shard_size and expert_parallel_size split the data-parallel ranks
            parallel_sizes(dp, 1, data_parallel=dp, shard_size=self.shard_size, expert_parallel=ep,
                           where=f"data_parallel_size={dp}")

    @classmethod
    def names(cls, where: str) -> tuple[str, ...]:
        """The options ``where`` (:data:`SHARD` or :data:`ADAPTER`) takes, in field order."""
        return tuple(f.name for f in fields(cls) if where in f.metadata["where"])

    def updated(self, **changes: Any) -> "MatrixFSDPConfig":
        """A copy with ``changes`` (checked)."""
        return replace(self, **changes)


def options_signature(where: str, *, first: Iterable[inspect.Parameter] = (), keyword_only: bool = False,
                      defaults: Optional[Mapping[str, Any]] = None) -> inspect.Signature:
    """The keyword signature of an entry point that takes the options ``where`` (its
    parameters ``first``, then the options with the config's types and defaults, or
    ``defaults``' where the entry point has its own, then ``config``)."""
    hints = get_type_hints(MatrixFSDPConfig)
    kind = inspect.Parameter.KEYWORD_ONLY if keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
    by_name = {f.name: f for f in fields(MatrixFSDPConfig)}
    params = list(first)
    for name in MatrixFSDPConfig.names(where):
        default = (defaults or {}).get(name, by_name[name].default)
        params.append(inspect.Parameter(name, kind, default=default, annotation=hints[name]))
    params.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation=Optional[MatrixFSDPConfig]))
    return inspect.Signature(params)


def bind_options(signature: inspect.Signature, who: str, args: tuple, kwargs: dict[str, Any]) -> MatrixFSDPConfig:
    """The config a keyword-form call means: ``config=`` as given, or one built from the options
    passed (positionally or by keyword; unknown ones refused as Python refuses them)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{who}: {e}") from None
    options = dict(bound.arguments)
    config = options.pop("config", None)
    if config is None:
        return MatrixFSDPConfig(**options)
    if not isinstance(config, MatrixFSDPConfig):
        raise TypeError(f"{who}(config=...) takes a MatrixFSDPConfig, got {type(config).__name__}")
    if options:
        raise TypeError(f"{who}: pass the options either as config=MatrixFSDPConfig(...) or as keywords, not both "
                        f"(got config= and {', '.join(sorted(options))}=); use config.updated({next(iter(options))}"
                        "=...) to change one")
    return config
