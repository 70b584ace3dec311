"""Which role each parameter gets, and why: where it is placed, and which update the recipe gives it.

Two questions, two functions, both pure (no communication, no tensors moved):

- :func:`classify`: the *placement* role ``matrix_shard`` gives each parameter (a matrix role
  kept whole on one owner, or a piece of its unit's packed tail). It depends only on shapes and
  the strategy's explicit options, never on a default that would change the optimizer's math:
  every 2-D parameter is a matrix role, so whatever optimizer the user builds can step it whole.
- :func:`recipe_roles`: the *Muon recipe* (embeddings, the output head and per-expert biases on
  AdamW; expert stacks stepped per expert; the other matrices on Muon). The optimizer applies
  it when it is built from the module (``Muon(model)``, ``optim/groups.param_groups``), under
  every strategy alike; bare ``parameters()`` go by shape everywhere (docs/decisions.md, "Same
  code, same math").

``shard.collect`` asks both once per model; the plan printout shows every parameter's
placement and recipe role with the rule that decided each (:func:`describe_roles`).
The placement rules, in order:

1. a declared expert stack (``experts/stacks.py``: automatic for known layouts, or the
   ``expert_stacks`` option) is a matrix role stepped per expert, unless an explicit
   ``matrix_filter`` rejects it; ``flatten_conv=True`` with a declared stack is refused
   (flattening would orthogonalize E experts as one matrix);
2. fewer than two dimensions: tail;
3. more than two dimensions, not a stack: a matrix role as its ``(shape[0], -1)`` matrix
   under ``flatten_conv`` (and the filter), else the tail, with a warning naming it
   (a 3-D parameter never goes to AdamW silently);
4. two dimensions: an explicit ``matrix_filter`` decides; without one, a matrix role.

The recipe (:func:`recipe_roles`): a declared stack is a matrix stepped per expert; fewer or
more than two dimensions: AdamW; ``nn.Embedding`` weights and the output head (Hugging Face
``get_output_embeddings()``, or the last ``nn.Linear`` projecting to an embedding's vocabulary;
a head tied to an embedding is that embedding) and the per-expert biases ``[E, out]`` of Hugging
Face experts modules: AdamW; every other 2-D parameter: Muon.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_matrixfsdp.runtime.experts.stacks import (
    ExpertStack,
    ExpertStackError,
    check_expert_stacks,
    declared_stacks,
    expert_biases,
)
from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.tags import recipe_of, tag_stack

__all__ = ["RoleChoice", "UndeclaredStackWarning", "classify", "describe_roles", "recipe_roles", "recipe_tail",
           "tag_expert_stacks"]


class UndeclaredStackWarning(UserWarning):
    """A parameter of more than two dimensions that is neither a declared expert stack nor
    flattened (``flatten_conv``): it trains with the AdamW tail."""


@dataclass(frozen=True)
class RoleChoice:
    """One parameter's role and the rule that chose it."""

    is_matrix: bool
    stack: Optional[ExpertStack]
    reason: str
    #: decided by an explicit strategy option (``matrix_filter``, ``flatten_conv``), which the
    #: recipe recorded for ``Muon(model)`` follows too
    explicit: bool = False

    @property
    def role(self) -> str:
        if not self.is_matrix:
            return "adamw"
        return "stack" if self.stack is not None else "matrix"


def _output_head(module: nn.Module) -> tuple[Optional[nn.Parameter], str]:
    """The output head's weight and how it was found, or (None, "")."""
    get = getattr(module, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except Exception:  # noqa: BLE001 - a model's own method failing means: no known head
            head = None
        weight = getattr(head, "weight", None)
        if isinstance(weight, nn.Parameter):
            return weight, "output head (get_output_embeddings())"
    vocab = {m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)}
    last = None
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.out_features in vocab:
            last = m
    if last is not None:
        return last.weight, "output head (the last nn.Linear projecting to an embedding's vocabulary)"
    return None, ""


def recipe_tail(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> why the Muon recipe keeps it on AdamW: embeddings and the output head."""
    out: dict[int, str] = {}
    head, why = _output_head(module)
    if head is not None:
        out[id(head)] = why
    for m in module.modules():
        if isinstance(m, nn.Embedding) and isinstance(m.weight, nn.Parameter):
            prior = out.get(id(m.weight))
            out[id(m.weight)] = f"{prior}, tied to an nn.Embedding" if prior else "nn.Embedding weight"
    return out


def classify(module: nn.Module, config: Any) -> dict[str, RoleChoice]:
    """fqn (first name of each parameter) -> its :class:`RoleChoice`, from ``config``'s
    ``matrix_filter``, ``flatten_conv`` and ``expert_stacks``. Refuses ``flatten_conv`` with a
    declared stack and a stack declaration that does not fit; warns once per undeclared
    parameter of more than two dimensions."""
    try:
        stacks = declared_stacks(module, config.expert_stacks)
    except ExpertStackError as err:
        raise MatrixShardError(str(err)) from None
    if stacks and config.flatten_conv:
        fqn, (stack, why) = next(iter(sorted(stacks.items())))
        raise MatrixShardError(
            f"flatten_conv=True would orthogonalize the expert stack {fqn!r} ({stack.describe()}; {why}) as one "
            f"flattened matrix, mixing its experts; expert stacks are stepped per expert without flatten_conv: set "
            f"flatten_conv=False ({len(stacks)} declared stack(s) in this model)")
    filt = config.matrix_filter
    out: dict[str, RoleChoice] = {}
    undeclared = []
    for fqn, p in module.named_parameters():
        if fqn in stacks:
            stack, why = stacks[fqn]
            if filt is not None and not filt(fqn, p):
                out[fqn] = RoleChoice(False, None, f"expert stack ({why}) rejected by matrix_filter", True)
            else:
                out[fqn] = RoleChoice(True, stack, f"expert stack, {stack.describe()} ({why})", filt is not None)
        elif p.ndim < 2:
            out[fqn] = RoleChoice(False, None, f"{p.ndim}-D")
        elif p.ndim > 2:
            if not config.flatten_conv:
                undeclared.append(f"{fqn} {tuple(p.shape)}")
                out[fqn] = RoleChoice(False, None, f"{p.ndim}-D, neither a declared expert stack nor flattened "
                                                   "(warned)")
            elif filt is not None and not filt(fqn, p):
                out[fqn] = RoleChoice(False, None, f"{p.ndim}-D, rejected by matrix_filter", True)
            else:
                out[fqn] = RoleChoice(True, None, "flatten_conv: its (shape[0], -1) matrix", True)
        elif filt is not None:
            ok = bool(filt(fqn, p))
            out[fqn] = RoleChoice(ok, None, f"matrix_filter {'accepts' if ok else 'rejects'} it", True)
        else:
            out[fqn] = RoleChoice(True, None, "2-D")
    if undeclared:
        warnings.warn(
            f"{len(undeclared)} parameter(s) of more than two dimensions are neither declared expert stacks nor "
            f"flattened, so they train with AdamW, not as matrices: {', '.join(undeclared[:8])}"
            f"{' ...' if len(undeclared) > 8 else ''}. Declare a stack of expert matrices [E, m, n] with "
            "expert_stacks={'<fqn pattern>': blocks} (docs/moe.md), or set flatten_conv=True for convolution "
            "kernels", UndeclaredStackWarning, stacklevel=4)
    return out


def recipe_roles(module: nn.Module, expert_stacks: Any = None,
                 placement: Optional[dict[str, RoleChoice]] = None) -> dict[str, RoleChoice]:
    """fqn (first name of each parameter) -> its role under the Muon recipe, and why: what an
    optimizer built from the module (``Muon(model)``) steps with the matrix optimizer. Reads only
    the module's structure and whole shapes, so it answers alike on a plain model under any
    strategy; a model ``matrix_shard`` sharded answers with the record it left on each parameter
    (:func:`lightning_matrixfsdp.runtime.tags.recipe_of`), computed before its tensors moved.
    ``placement``: :func:`classify`'s roles; where an explicit strategy option decided one
    (``matrix_filter``, ``flatten_conv``), the recipe follows it (an option of this strategy only)."""
    named = list(module.named_parameters())
    recorded = {fqn: recipe_of(p) for fqn, p in named}
    if named and all(r is not None for r in recorded.values()):
        return recorded  # type: ignore[return-value]
    try:
        stacks = declared_stacks(module, check_expert_stacks(expert_stacks))
    except ExpertStackError as err:
        raise MatrixShardError(str(err)) from None
    tail = recipe_tail(module)
    biases = expert_biases(module)
    out: dict[str, RoleChoice] = {}
    for fqn, p in named:
        if recorded[fqn] is not None:
            out[fqn] = recorded[fqn]
        elif placement is not None and placement[fqn].explicit:
            out[fqn] = placement[fqn]
        elif fqn in stacks:
            stack, why = stacks[fqn]
            out[fqn] = RoleChoice(True, stack, f"expert stack, each expert a matrix: {stack.describe()} ({why})")
        elif p.ndim != 2:
            out[fqn] = RoleChoice(False, None, f"{p.ndim}-D")
        elif fqn in biases:
            out[fqn] = RoleChoice(False, None, f"Muon recipe: {biases[fqn]}")
        elif id(p) in tail:
            out[fqn] = RoleChoice(False, None, f"Muon recipe: {tail[id(p)]}")
        else:
            out[fqn] = RoleChoice(True, None, "2-D")
    return out


def tag_expert_stacks(module: nn.Module, expert_stacks: Any = None) -> dict[str, ExpertStack]:
    """Tag the layout of the expert stacks of an unsharded model (plain DDP, one device): how this
    library's optimizers cut each into its experts where a param group routes it to the matrix
    part (``Muon(model)`` / ``optim.groups.param_groups`` tag and route them; ``matrix_shard``
    tags them itself). ``expert_stacks``: the option's forms. Returns fqn -> stack."""
    try:
        stacks = declared_stacks(module, check_expert_stacks(expert_stacks))
    except ExpertStackError as err:
        raise MatrixShardError(str(err)) from None
    params = dict(module.named_parameters())
    for fqn, (stack, _) in stacks.items():
        tag_stack(params[fqn], stack)
    return {fqn: stack for fqn, (stack, _) in stacks.items()}


_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def optimizer_of(choice: RoleChoice) -> str:
    """"muon" or "adamw": the update a role choice gives (a stack: Muon per expert)."""
    return "muon" if choice.is_matrix else "adamw"


def describe_roles(roles: dict[str, RoleChoice], recipe: dict[str, RoleChoice]) -> list[list[Any]]:
    """Every parameter's placement role and update, and why, as rows ``[fqn pattern, count,
    placement, why, with Muon(model), why, with bare parameters]``: fqns that differ only in their
    layer indices (``layers.*.``) and agree on everything else are one row. ``recipe``: the
    :func:`recipe_roles` of the same model. Bare parameters go by shape (2-D: the matrix
    optimizer) unless the placement was decided by ``matrix_filter`` or ``flatten_conv``."""
    rows: dict[tuple[str, ...], int] = {}
    for fqn, choice in roles.items():
        r = recipe[fqn]
        bare = bare_update(choice)
        key = (_INDEX.sub("*", fqn), choice.role, choice.reason, optimizer_of(r), r.reason, bare)
        rows[key] = rows.get(key, 0) + 1
    return [[key[0], n, *key[1:]] for key, n in rows.items()]


def bare_update(choice: RoleChoice) -> str:
    """The update bare ``parameters()`` give a parameter with this placement: the matrix optimizer
    for a matrix role that is not a stack (a 2-D parameter, or a kernel ``flatten_conv`` made a
    matrix), AdamW for the tail and for expert stacks (a plain run's optimizer cannot tell a stack
    from any 3-D tensor, so neither does ours: stacks need ``Muon(model)``)."""
    return "muon" if choice.is_matrix and choice.stack is None else "adamw"
