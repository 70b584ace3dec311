"""The marks ``matrix_shard`` leaves on user objects, and the one place that reads them.

A sharded model keeps the user's own ``nn.Parameter`` objects, so optimizers built
afterwards over ``module.parameters()`` see ordinary parameters.  What they need to
know about each one (its role, whether this rank owns it, its global shape) travels
as attributes on the parameter; the root module carries the runtime state the same
way.  Optimizers, the strategy, checkpointing and the summary read these marks only
through the functions below, so the attribute names are a detail of this file.

An *untagged* tensor (a plain model, or a test that builds an optimizer by hand)
reads as owned, with its local shape, and with no role: callers fall back to their
own rule (Muon: ``ndim == 2``).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from torch import nn

from lightning_matrixfsdp.runtime.experts.stacks import ExpertStack
from lightning_matrixfsdp.runtime.placement import MatrixShard, RoleKind

_SHARD = "_mfsdp_shard"
_ROLE = "_mfsdp_role"  # a string, so tests and scripts can tag a plain tensor by hand
_OWNED = "_mfsdp_owned"
_STATE = "_mfsdp_state"
_VIEW = "_mfsdp_view"
_TP = "_mfsdp_tp"
_TP_SHAPE = "_mfsdp_tp_shape"
_EXPERTS = "_mfsdp_expert_slice"
_STACK = "_mfsdp_stack"
_RECIPE = "_mfsdp_recipe"


# ---------------------------------------------------------------------- parameters
def tag_param(p: Any, shard: MatrixShard, owned: bool) -> None:
    """Mark a resident parameter with its placement (called once, by ``ShardedParam``)."""
    setattr(p, _SHARD, shard)
    setattr(p, _ROLE, shard.role.value)
    setattr(p, _OWNED, bool(owned))
    stack = getattr(shard, "stack", None)
    if stack is not None:
        tag_stack(p, stack)


def tag_role(p: Any, role: RoleKind) -> None:
    """Mark a parameter that has no placement (a local expert slice) with its role, so the
    optimizers route it as classified (a per-expert bias ``[E/EP, out]`` is 2-D, yet tail)."""
    setattr(p, _ROLE, RoleKind(role).value)


def tag_stack(p: Any, stack: Optional[ExpertStack]) -> None:
    """Mark ``p`` as an expert stack (None removes the mark). The optimizers step a marked
    tensor as ``p.shape[0]`` independent matrices (``p[e]``, or ``p[e].T`` for a stack stored
    transposed), each split into ``stack.blocks`` rows, whatever ``p.shape[0]`` is (a local slice of the experts
    carries the whole stack's declaration)."""
    if stack is None:
        if _STACK in getattr(p, "__dict__", {}):
            delattr(p, _STACK)
        return
    if not isinstance(stack, ExpertStack):
        raise TypeError(f"tag_stack takes an ExpertStack or None, got {type(stack).__name__}")
    setattr(p, _STACK, stack)


def stack_of(p: Any) -> Optional[ExpertStack]:
    """The expert-stack declaration of ``p``, or None (an ordinary parameter)."""
    return getattr(p, _STACK, None)


def tag_recipe(p: Any, choice: Any) -> None:
    """Record a parameter's role under the Muon recipe (a ``classify.RoleChoice``), decided on the
    whole model before ``matrix_shard`` moved its tensors; an optimizer built from the sharded
    module reads it (placeholders no longer show the whole shape). Kept by ``untag_param``: the
    recipe does not depend on the placement."""
    setattr(p, _RECIPE, choice)


def recipe_of(p: Any) -> Optional[Any]:
    """The ``RoleChoice`` :func:`tag_recipe` recorded, or None (a plain parameter)."""
    return getattr(p, _RECIPE, None)


def tag_tp(p: Any, fragment: Any) -> None:
    """Mark a resident parameter as one TP rank's fragment of a split matrix (a
    ``tp_comm.TPFragment``: its layout, the TP group, the rank that steps it whole)."""
    setattr(p, _TP, fragment)


def tag_tp_shape(p: Any, shape: tuple[int, ...]) -> None:
    """Mark a resident TP fragment with the whole parameter's shape (summaries count it)."""
    setattr(p, _TP_SHAPE, tuple(shape))


def tp_shape_of(p: Any) -> Optional[tuple[int, ...]]:
    """The whole shape of a TP-split parameter's fragment, or None (whole on this rank, or replicated)."""
    return getattr(p, _TP_SHAPE, None)


def tp_of(p: Any) -> Optional[Any]:
    """The ``TPFragment`` of a TP-split parameter, or None (whole on this rank, or replicated)."""
    return getattr(p, _TP, None)


def untag_param(p: Any) -> None:
    """Remove the placement marks (``full_model``: the parameter reads as a plain one, also in
    a pickle taken meanwhile; ``tag_param`` puts them back)."""
    for name in (_SHARD, _ROLE, _OWNED, _STACK):
        if name in getattr(p, "__dict__", {}):
            delattr(p, name)


def untag_tp(p: Any) -> tuple[Any, Any]:
    """Remove the TP marks (``full_model``: the whole tensor is no fragment, and a pickle taken
    meanwhile must not hold the TP group); returns them for :func:`retag_tp`."""
    marks = (getattr(p, _TP, None), getattr(p, _TP_SHAPE, None))
    for name in (_TP, _TP_SHAPE):
        if name in getattr(p, "__dict__", {}):
            delattr(p, name)
    return marks


def retag_tp(p: Any, marks: tuple[Any, Any]) -> None:
    """Put back what :func:`untag_tp` removed."""
    if marks[0] is not None:
        tag_tp(p, marks[0])
    if marks[1] is not None:
        tag_tp_shape(p, marks[1])


def shard_of(p: Any) -> Optional[MatrixShard]:
    """The placement record of a sharded parameter, or None for a plain tensor."""
    return getattr(p, _SHARD, None)


def role_of(p: Any) -> Optional[RoleKind]:
    """The parameter's role (matrix or tail), or None when untagged."""
    role = getattr(p, _ROLE, None)
    return None if role is None else RoleKind(role)


def tag_unowned(p: Any) -> None:
    """Mark ``p`` as held by no one here (another pipeline stage's parameter, an empty placeholder)."""
    setattr(p, _OWNED, False)


def is_owned(p: Any) -> bool:
    """True where this rank holds the full tensor (every untagged tensor)."""
    return bool(getattr(p, _OWNED, True))


def global_numel(p: Any) -> int:
    """Elements of the whole parameter, not of this rank's (possibly empty) tensor."""
    whole = getattr(p, _TP_SHAPE, None)
    if whole is not None:  # a tensor-parallel fragment: the whole parameter over the TP group
        n = 1
        for s in whole:
            n *= int(s)
        return n
    experts = getattr(p, _EXPERTS, None)
    if experts is not None:  # this rank's experts of a stack: the whole stack over the expert-parallel group
        return experts.global_numel
    shard = shard_of(p)
    if shard is None:
        return p.numel()
    n = 1
    for s in shard.shape:  # the whole shape (a split stack's entry counts only its block in ``numel``)
        n *= int(s)
    return n


def tag_expert_slice(p: Any, expert_slice: Any) -> None:
    """Mark a parameter as this rank's slice of an expert stack under expert parallelism (an
    ``expert_parallel.ExpertSlice``): local, never materialized nor reduced to an owner."""
    setattr(p, _EXPERTS, expert_slice)


def expert_slice_of(p: Any) -> Optional[Any]:
    """The ``ExpertSlice`` of an expert-parallel parameter, or None."""
    return getattr(p, _EXPERTS, None)


def tag_view(t: Any, key: str) -> Any:
    """Mark a ``state_dict`` tensor as this rank's view of the model tensor ``key``: the whole
    tensor where this rank owns it, an empty placeholder elsewhere (checkpoints write the
    owners' data wherever such a tensor sits in the checkpoint). Returns ``t``."""
    setattr(t, _VIEW, key)
    return t


def view_key(t: Any) -> Optional[str]:
    """The model key a tensor was marked with by ``tag_view``, or None."""
    return getattr(t, _VIEW, None)


# ---------------------------------------------------------------------- modules
# The state is typed ``Any`` here: its module imports (through the units and parameters)
# this one, and the tags stay at the bottom of the import graph.
def attach_state(module: nn.Module, state: Any) -> None:
    """Attach the runtime state (a ``MatrixFSDPState``) to the root ``matrix_shard`` sharded."""
    # object.__setattr__: the state is not an nn.Module attribute (no registration).
    object.__setattr__(module, _STATE, state)


def detach_state(module: nn.Module) -> None:
    """Remove the runtime state from ``module`` (``attach_state`` puts it back; a copy of a
    sharded root is no root)."""
    module.__dict__.pop(_STATE, None)


def state_of(module: nn.Module) -> Optional[Any]:
    """The runtime state attached to exactly this module, if any."""
    return getattr(module, _STATE, None)


def find_state(module: nn.Module) -> Optional[Any]:
    """The state of ``module`` or of the first sharded module inside it."""
    for m in module.modules():
        st = state_of(m)
        if st is not None:
            return st
    return None


def sharded_roots(module: nn.Module) -> list[nn.Module]:
    """Every module under ``module`` (itself included) that ``matrix_shard`` sharded; for a model
    split into pipeline stages (:func:`attach_pipeline`), this rank's stages, which are no
    submodules of it (they hold its modules under the whole model's names), in stage order."""
    roots: list[nn.Module] = []
    for m in module.modules():
        run = pipeline_of(m)
        found = [m] if state_of(m) is not None else []
        found += list(run.stages) if run is not None else []
        roots += [r for r in found if all(r is not seen for seen in roots)]
    return roots


def pipelines_in(module: nn.Module) -> list[Any]:
    """The ``PipelineRun`` of every pipelined model under ``module`` (itself included)."""
    return [run for m in module.modules() if (run := pipeline_of(m)) is not None]


def stage_index(root: nn.Module) -> Optional[int]:
    """The pipeline stage ``root`` is, where it is one this rank runs (one of :func:`sharded_roots`'s
    under pipeline parallelism: its ranks are its stage's, not the world's); else None."""
    for run in list(_PIPELINES.values()):
        for stage, index in zip(run.stages, run.stage_indices):
            if stage is root:
                return int(index)
    return None


def is_stage(root: nn.Module) -> bool:
    """True where ``root`` is a pipeline stage this rank runs (:func:`stage_index`)."""
    return stage_index(root) is not None


# ---------------------------------------------------------------------- pipelines
# model -> the PipelineRun built from it; weak, so a model's copy or pickle carries no process group
_PIPELINES: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def attach_pipeline(model: nn.Module, run: Any) -> None:
    """Record that ``model`` (the whole model) was split into pipeline stages and that this rank
    runs ``run``'s (a ``PipelineRun``): checkpoints of ``model``, or of a module holding it, read
    this rank's stages as its sharded roots, under the whole model's names."""
    _PIPELINES[model] = run


def pipeline_of(model: nn.Module) -> Optional[Any]:
    """The ``PipelineRun`` :func:`attach_pipeline` recorded for exactly this module, or None."""
    try:
        return _PIPELINES.get(model)
    except TypeError:  # an unhashable module
        return None
