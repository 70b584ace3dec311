"""``MatrixFSDPConfig``: every option of ``matrix_shard`` and the two strategies, checked once.

The one list of options. ``matrix_shard``, ``MatrixFSDPStrategy`` and
``MatrixFSDPFabricStrategy`` take a config (``config=``) or the same options as keywords;
the keyword forms build a config, through a signature generated here from the fields
(so it stays introspectable: LightningCLI and jsonargparse read it). A config is frozen
and normalized when built (``__post_init__``, with ``options.py``'s checks, whose errors
name the option and the value): nothing below the place an option enters checks it again.

Which entry point reads a field is its ``where`` metadata: ``SHARD`` (``matrix_shard``),
``ADAPTER`` (the strategies only: optimizer, checkpoints, process group) or both. What it
does is its ``doc`` metadata, written once: the strategies' docstrings get their ``Args:``
from it (``options_docstring``; so LightningCLI's ``--help`` and ``--print_config`` comments
show it), and docs/user-guide.md's options table repeats it word for word (tests/test_docs.py).
"""

from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
import inspect
import operator
import re
import textwrap
from typing import Any, Callable, Iterable, Mapping, Optional, Union, get_type_hints

import torch
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.experts.stacks import ExpertStackError, check_expert_stacks
from lightning_matrixfsdp.runtime.mesh.dims import ParallelDims
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

__all__ = ["ADAPTER", "CONFIG_DOC", "SHARD", "MatrixFSDPConfig", "bind_options", "option_docs", "options_docstring",
           "options_signature", "plain_text"]

SHARD, ADAPTER = "shard", "adapter"
OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


def _opt(default: Any, check: Callable[[Any, str], Any], *where: str, doc: str) -> Any:
    """A field: its default, its check, the entry points that read it, and what it does (``doc``,
    Markdown: the row of docs/user-guide.md's options table, the strategies' ``Args:``)."""
    return field(default=default, metadata={"check": check, "where": where or (SHARD, ADAPTER), "doc": doc})


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
    """``expert_stacks``: patterns frozen into a sorted tuple of (pattern, blocks) (runtime/experts/stacks.py)."""
    try:
        return check_expert_stacks(value, name)
    except ExpertStackError as err:
        raise MatrixShardError(str(err)) from None


def _adapter_default_bool(value: Any, name: str) -> Optional[bool]:
    """``None``: the adapter's own default (``accumulation_no_sync``: off for the Trainer, on for Fabric)."""
    return None if value is None else check_bool(value, name)


def check_pipeline_schedule(value: Any) -> str:
    """``pipeline_schedule``: one of torch's schedules by name (runtime/pipeline/comm.py's ``SCHEDULES``)."""
    from lightning_matrixfsdp.runtime.pipeline.comm import SCHEDULES

    if not isinstance(value, str) or value not in SCHEDULES:
        raise MatrixShardError(f"pipeline_schedule={value!r} is not accepted; choose one of {', '.join(SCHEDULES)}")
    return value


def check_pipeline_split(value: Any) -> Optional[tuple[str, ...]]:
    """``pipeline_split``: None, or module names (a list or tuple of non-empty strings, frozen as a tuple)."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or \
            not all(isinstance(v, str) and v for v in value) or not value:
        raise MatrixShardError(f"pipeline_split={value!r} is not accepted; pass None or a list of module names, "
                               'the first block of each stage after the first (e.g. ["blocks.2"])')
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class MatrixFSDPConfig:
    """Every option of ``matrix_shard`` and the strategies, the one list of them: each field's
    ``doc`` says what it does (docs/user-guide.md, "Strategy options", shows the same words).

    Checked and normalized at construction (dtype names to dtypes, policy classes and import
    paths to a frozenset of classes); a wrong value raises ``MatrixShardError`` naming the
    option and the value. ``matrix_shard`` reads the shard options and ignores the adapters'
    (``activation_checkpointing_policy``, ``optimizer``, checkpoints, process group). Derive a
    changed copy with ``dataclasses.replace(config, ...)`` (checked again).
    """

    # Order: the strategies' positional order (their keyword signatures are generated from it).
    wrap_policy: Any = _opt(None, _policy_set(check_wrap_policy), doc="which modules become units")
    planner: str = _opt("role_greedy", _named(check_planner), doc="how owners are chosen")
    collective: str = _opt("auto", _named(check_collective), doc=(
        'how data moves between owners and the other ranks: `"auto"` picks `"p2p"` when the shard group lies '
        'inside one node, `"broadcast"` when it spans nodes'))
    matrix_filter: Optional[Callable[[str, nn.Parameter], bool]] = _opt(None, _named(check_matrix_filter), doc=(
        "which 2D parameters are placed as matrices rather than in the AdamW tail; `None`: every 2D parameter "
        "(which update each gets is the optimizer's choice: `Muon(model)` applies the Muon recipe under every "
        "strategy, [moe.md](moe.md#the-muon-recipe-build-the-optimizer-from-the-module))"))
    param_dtype: Union[str, torch.dtype, None] = _opt(None, check_dtype, doc=(
        "dtype of the materialized parameters used in forward/backward"))
    reduce_dtype: Union[str, torch.dtype, None] = _opt(None, check_dtype, doc=(
        "dtype in which gradients are summed onto their owners"))
    activation_checkpointing_policy: Any = _opt(None, _policy_set(check_checkpointing_policy), ADAPTER, doc=(
        "modules whose forward is recomputed in backward"))
    optimizer: Optional[OptimizerFactory] = _opt(None, _named(check_optimizer_factory), ADAPTER, doc=(
        "a factory `params -> Optimizer` that replaces the module's optimizer"))
    reshard_after_forward: bool = _opt(True, check_bool, doc="free each unit's full parameters after its forward")
    accumulation_no_sync: Optional[bool] = _opt(None, _adapter_default_bool, ADAPTER, doc=(
        "skip the gradient reduction on non-final micro-batches"))
    shard_size: Optional[int] = _opt(None, lambda v, n: check_positive_int(v, n, optional=True), doc=(
        "HSDP: shard over groups of this many ranks, replicate across groups"))
    prefetch: bool = _opt(True, check_bool, doc=(
        "materialize the next unit while the current one computes; `False` lowers peak memory by one unit"))
    zero_missing_grads: bool = _opt(False, check_bool, doc=(
        "for models whose ranks leave *different* parameters without a gradient in a step (mixture-of-experts "
        "routing); see [Limitations](#limitations)"))
    save_distributed_checkpoint: bool = _opt(True, check_bool, ADAPTER, doc=(
        "checkpoint as a directory of per-rank files (`True`) or one file (`False`)"))
    process_group_backend: Optional[str] = _opt(None, _named(check_backend), ADAPTER, doc="`torch.distributed` backend")
    timeout: Optional[timedelta] = _opt(default_pg_timeout, _named(check_timeout), ADAPTER, doc=(
        "timeout of collective operations"))
    #: 1 by default, unlike Lightning's "auto": a model without a parallelize plan would be
    #: replicated over the TP ranks
    tensor_parallel_size: Union[int, str] = _opt(1, _parallel_size, ADAPTER, doc=(
        'ranks `parallelize_module` splits a matrix over (a positive int, or `"auto"`: the processes of a node); '
        "see [tensor-parallel.md](tensor-parallel.md)"))
    data_parallel_size: Union[int, str] = _opt("auto", _parallel_size, ADAPTER, doc=(
        'the rest of the world (`"auto"`: world / `tensor_parallel_size`)'))
    log_plan: bool = _opt(True, check_bool, ADAPTER, doc="print the owner plan on rank 0 at setup")
    verify_checkpoints: bool = _opt(True, check_bool, ADAPTER, doc=(
        "record checksums of checkpoint files on save and verify them on load "
        "([checkpointing.md](checkpointing.md#damaged-files-checksums))"))
    reset_changed_roles: bool = _opt(False, check_bool, ADAPTER, doc=(
        "on load, restart the optimizer state of parameters whose role changed since the save instead of raising "
        "([checkpointing.md](checkpointing.md#role-changes-another-matrix_filter))"))
    replica_split: Union[bool, str] = _opt("auto", check_bool_or_auto, doc=(
        '`"auto"`: on under HSDP (more than one replica), off otherwise; `True`/`False` force it. HSDP: step each '
        "role on one replica only and send the updated weights to the others after the step; see "
        "[multi-node.md](multi-node.md#replica_split-one-replica-steps-each-role)"))
    flatten_conv: bool = _opt(False, check_bool, doc=(
        "parameters of more than two dimensions (convolution kernels) become matrix roles too; `Muon` trains each "
        "as its `(shape[0], -1)` matrix; see [Convolutional "
        "networks](#convolutional-networks-and-other-small-models)"))
    broadcast_buffers: bool = _opt(True, check_bool, doc=(
        "as DDP's option of that name: rank 0's buffers (BatchNorm statistics) on every rank before each training "
        "forward; `False` keeps each rank's own"))
    ns_steps: int = _opt(5, check_positive_int, SHARD, doc=(
        "Newton-Schulz iterations assumed by the planner's cost model when it estimates optimizer work per "
        "matrix. It does not configure the optimizer; set it to your optimizer's `ns_steps`"))
    async_save: bool = _opt(False, check_bool, ADAPTER, doc=(
        "save checkpoint directories in the background: a save stalls training only for the copy of this rank's "
        "share to reused host buffers ([checkpointing.md](checkpointing.md#asynchronous-saves))"))
    expert_stacks: Any = _opt(None, _expert_stacks, doc=(
        "your own mixture-of-experts parameters `[E, m, n]` that are stacks of E matrices (fqn glob patterns, a "
        'dict `{pattern: blocks}` for fused projections, `{pattern: {"blocks": ..., "transposed": bool, '
        '"interleaved": bool}}` for experts stored `[E, in, out]` or with interleaved gate/up, or a callable); '
        "Hugging Face experts modules (GPT-OSS included) and `GroupedExperts` are declared automatically; each "
        "stack is stepped as E independent matrices ([moe.md](moe.md#expert-stacks))"))
    expert_parallel_size: int = _opt(1, check_positive_int, doc=(
        "expert parallelism: each rank keeps `E/EP` experts of every experts module (Hugging Face's, or declared "
        "with `parallelize_experts`) for good, and the tokens travel to them; attention, routers and dense "
        "matrices stay owner-sharded; must divide the world (with `pipeline_parallel_size`: each stage's ranks) "
        "and each `E` ([moe.md](moe.md#expert-parallelism))"))
    split_stacks: bool = _opt(True, check_bool, doc=(
        "the planner may split an expert stack into contiguous blocks of experts, one per owner, when the stack "
        "whole would be more than an even share of its unit ([moe.md](moe.md#split-expert-stacks)); `False` keeps "
        "every stack whole on one owner"))
    # ---- pipeline parallelism (issue 38; docs/pipeline-parallel.md): the strategies only
    pipeline_parallel_size: int = _opt(1, check_positive_int, ADAPTER, doc=(
        "pipeline parallelism: the model is split into this many stages, one per group of `world / PP` ranks "
        "(the pipeline axis outermost), each stage owner-sharded over its own ranks; the LightningModule's steps "
        "call `lightning_matrixfsdp.forward_loss` ([pipeline-parallel.md](pipeline-parallel.md"
        "#pipeline-parallelism-in-lightning-the-contract))"))
    pipeline_microbatches: Optional[int] = _opt(None, lambda v, n: check_positive_int(v, n, optional=True), ADAPTER,
                                                doc=("micro-batches each batch is cut into under pipeline "
                                                     "parallelism (`None`: `2 * pipeline_parallel_size`); must "
                                                     "divide the batch size"))
    pipeline_schedule: str = _opt("1F1B", _named(check_pipeline_schedule), ADAPTER, doc=(
        "torch's pipeline schedule by name: `\"GPipe\"`, `\"1F1B\"`, `\"Interleaved1F1B\"`, `\"LoopedBFS\"`, "
        "and the split-backward `\"InterleavedZeroBubble\"`, `\"ZBVZeroBubble\"`, `\"DualPipeV\"` (all but the "
        "first two: two stages per rank)"))
    pipeline_split: Optional[list[str]] = _opt(None, _named(check_pipeline_split), ADAPTER, doc=(
        "the first block of each stage after the first (module names inside the pipelined model, e.g. "
        "`[\"blocks.2\"]`); `None`: stages balanced by parameter count"))

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name), f.name))
        if self.async_save and not self.save_distributed_checkpoint:
            raise MatrixShardError("async_save=True writes checkpoint directories in the background; it does not "
                                   "apply to save_distributed_checkpoint=False (one file gathered on rank 0): set "
                                   "save_distributed_checkpoint=True or async_save=False")
        self._check_sizes()

    def _check_sizes(self) -> None:
        """The sizes that cannot go together whatever the world (the rest waits for the world: the
        strategies build the ``ParallelDims`` record before the launch)."""
        ep, tp, dp = self.expert_parallel_size, self.tensor_parallel_size, self.data_parallel_size
        if ep > 1 and tp != "auto" and tp > 1:
            raise MatrixShardError(f"expert_parallel_size={ep} with tensor parallelism (tensor_parallel_size={tp}) "
                                   "is not supported yet; use one of them")
        pp = self.pipeline_parallel_size
        # pipeline parallelism: one block of checks (with expert parallelism each stage splits its own
        # experts over its ranks: the strategies check the sizes against the world)
        if pp > 1 and tp != "auto" and tp > 1:
            raise MatrixShardError(f"pipeline_parallel_size={pp} with tensor_parallel_size={tp} is not supported "
                                   "yet; use one of them")
        if pp > 1 and dp != "auto":
            raise MatrixShardError(f"pipeline_parallel_size={pp} with data_parallel_size={dp}: under pipeline "
                                   "parallelism each stage's data-parallel size is world / pipeline_parallel_size; "
                                   'leave data_parallel_size="auto"')
        if dp != "auto":  # shard_size and expert_parallel_size split the data-parallel ranks
            ParallelDims.from_options(dp, 1, data_parallel=dp, shard_size=self.shard_size, expert_parallel=ep,
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


#: What the ``config`` parameter of the strategies is (Markdown, as the options' ``doc``).
CONFIG_DOC = ("all of the above as one `MatrixFSDPConfig` instead of keywords (not both); see "
              "[One options object](#one-options-object-matrixfsdpconfig)")


def option_docs() -> dict[str, str]:
    """``{option: what it does}`` (Markdown), every field of the config in field order."""
    return {f.name: f.metadata["doc"] for f in fields(MatrixFSDPConfig)}


def _link(match: "re.Match[str]") -> str:
    text, target = match.group(1), match.group(2)
    page, _, anchor = target.partition("#")
    where = f"docs/{page or 'user-guide.md'}" + (f"#{anchor}" if anchor else "")
    return where if text == page else f"{text} ({where})"


def plain_text(markdown: str) -> str:
    """A description as ``--help`` shows it: links as the page they lead to (``docs/...``), no
    backticks or emphasis."""
    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", _link, markdown)
    text = re.sub(r"(?<![\w*])\*(\w[^*`]*?)\*(?![\w*])", r"\1", text)  # *emphasis*
    return text.replace("`", "")


def options_docstring(where: str, notes: Optional[Mapping[str, str]] = None) -> str:
    """The Google-style ``Args:`` section of an entry point that takes the options ``where``, in
    its signature's order, then ``config``; ``notes`` adds a sentence to an option's text (what it
    means for that entry point). jsonargparse reads it for LightningCLI's ``--help`` and the
    comments of ``--print_config``."""
    docs = {**option_docs(), "config": CONFIG_DOC}
    lines = ["Args:"]
    for name in (*MatrixFSDPConfig.names(where), "config"):
        text = plain_text(docs[name]) + (f". {notes[name]}" if notes and name in notes else "")
        lines += textwrap.wrap(f"{name}: {text}", 100, initial_indent="    ", subsequent_indent="        ",
                               break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines)


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
