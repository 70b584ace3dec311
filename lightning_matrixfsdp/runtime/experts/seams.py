"""Where expert parallelism enters a model: the *seams*, the modules whose forward runs the experts.

Three families of seams are known, one :class:`~seam_family.SeamFamily` each, in the one table
:data:`FAMILIES` (adding a model family means adding one entry there):

- ``"topk"``: a Hugging Face experts module (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 in our
  pinned transformers): ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
  over stacked parameters ``[E, ...]``. Found by its signature, nothing to declare.
- ``"gptoss"``: Hugging Face's GPT-OSS experts module, ``forward(hidden_states, router_indices,
  routing_weights)``, transposed stacks with biases (``experts/gptoss.py``). Found by its signature.
- ``"grouped"``: a torchtitan-shaped ``GroupedExperts`` (``forward(x, num_tokens_per_expert)``,
  ``x`` sorted by expert, stacked ``w1/w2/w3``), declared by :func:`parallelize_experts` in
  ``configure_model`` (the parallel style).

A module's family is the first entry of :data:`FAMILIES` that matches it; a module no family
matches is no seam (its parameters stay dense).

Under ``expert_parallel_size > 1`` ``matrix_shard`` keeps each seam's experts
``[r E/EP, (r+1) E/EP)`` on expert-parallel rank ``r`` and replaces the seam's forward by one
that sends each token to its expert's rank (``expert_dispatch.expert_parallel_forward``) and
runs the module's own expert computation there on the local experts. Nothing here communicates
itself (the dispatch it is given does).

For uneven evaluation (``runtime/join.py``) an installed seam also tells a callback before each
exchange (:func:`set_exchange_announce`) and can run its exchange with no token of this rank's
own (:func:`exchange_without_tokens`), so a rank without a batch still serves its experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.experts.gptoss import GPTOSS_SEAM
from lightning_matrixfsdp.runtime.experts.seam_family import (InstalledSeam, SeamFamily, arg_names, counts_tensor,
                                                      eager_local, expert_ids, install, installed, own_forward,
                                                      set_announce, stacked)

__all__ = ["FAMILIES", "ExpertSeam", "GroupedSeam", "HfTopKSeam", "family_of", "parallelize_experts", "find_seams",
           "install_forward", "joinable_seams", "set_exchange_announce", "exchange_without_tokens"]

TOPK, GROUPED = "topk", "grouped"
_STYLE = "_mfsdp_expert_style"  # a module mark: set by parallelize_experts, read by GroupedSeam.matches
_HF_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


class HfTopKSeam(SeamFamily):
    """A Hugging Face experts module (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3): ``forward(hidden_states,
    top_k_index, top_k_weights)`` and at least one stacked 3-D parameter. On the local experts: the
    given ``fused`` computation for the Mixtral layout (fused gate/up), else the module's own loop."""

    name = TOPK

    def matches(self, module: nn.Module, args: tuple[str, ...]) -> bool:
        return stacked(module) and args == _HF_ARGS

    def local(self, module: nn.Module, fused: Optional[Callable[..., torch.Tensor]]) -> Callable[..., torch.Tensor]:
        if fused is not None and _mixtral_layout(module):
            return functools.partial(_fused_local, fused, module)
        return functools.partial(eager_local, own_forward(module), module)

    def forward(self, seam: InstalledSeam, hidden_states: torch.Tensor,  # type: ignore[override]
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return seam.dispatch(hidden_states, top_k_index, top_k_weights)


class GroupedSeam(SeamFamily):
    """A torchtitan-shaped ``GroupedExperts`` declared by :func:`parallelize_experts`:
    ``forward(x sorted by expert, num_tokens_per_expert)``; on the local experts, its own forward."""

    name = GROUPED

    def matches(self, module: nn.Module, args: tuple[str, ...]) -> bool:
        return module.__dict__.get(_STYLE) is not None

    def local(self, module: nn.Module, fused: Optional[Callable[..., torch.Tensor]]) -> Callable[..., torch.Tensor]:
        return functools.partial(_grouped_local, type(module).forward, module)

    def forward(self, seam: InstalledSeam, x: torch.Tensor,  # type: ignore[override]
                num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        ids = expert_ids(num_tokens_per_expert, x.device)
        return seam.dispatch(x, ids[:, None], torch.ones(ids.shape[0], 1, dtype=x.dtype, device=x.device))


def _fused_local(fused: Callable[..., torch.Tensor], module: nn.Module, x: torch.Tensor, counts: Any) -> torch.Tensor:
    return fused(x, [int(c) for c in counts], module.gate_up_proj, module.down_proj, module.act_fn)


def _grouped_local(own: Callable[..., torch.Tensor], module: nn.Module, x: torch.Tensor, counts: Any) -> torch.Tensor:
    return own(module, x, counts_tensor(counts, x.device))


#: every known family, in the order a module is matched against them (a declared style first)
FAMILIES: tuple[SeamFamily, ...] = (GroupedSeam(), GPTOSS_SEAM, HfTopKSeam())


def family_of(module: nn.Module) -> Optional[SeamFamily]:
    """The first family of :data:`FAMILIES` that ``module`` belongs to, or None (not an experts module)."""
    args = arg_names(type(module).forward)
    return next((f for f in FAMILIES if f.matches(module, args)), None)


def parallelize_experts(module: nn.Module) -> nn.Module:
    """The parallel style for a torchtitan-shaped experts module (``GroupedExperts``): every
    parameter stacked ``[E, ...]`` over ``E = module.num_experts`` experts, and
    ``forward(x [N, H] sorted by expert, num_tokens_per_expert [E]) -> [N, H]`` computing expert
    ``e`` on its ``num_tokens_per_expert[e]`` rows for any number of experts (the stacks'
    leading size). Call it in ``configure_model`` (or before ``matrix_shard``) on each such
    module; under ``expert_parallel_size=EP`` each rank then keeps ``E/EP`` experts and the rows
    travel to them. Without expert parallelism it changes nothing. Returns ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_experts expects an nn.Module, got {type(module).__name__}")
    names = arg_names(type(module).forward)
    if len(names) != 2:
        raise MatrixShardError(f"parallelize_experts: {type(module).__name__}.forward takes {names}; the grouped "
                               "seam is forward(x, num_tokens_per_expert)")
    object.__setattr__(module, _STYLE, GROUPED)
    return module


@dataclass(eq=False)
class ExpertSeam:
    """One experts module: its name, family, number of experts and stacked parameter names."""

    fqn: str
    module: nn.Module
    family: SeamFamily
    num_experts: int
    names: tuple[str, ...]

    @property
    def kind(self) -> str:
        """The family's name: ``"topk"``, ``"gptoss"`` or ``"grouped"``."""
        return self.family.name


def find_seams(root: nn.Module, strict: bool = True) -> list[ExpertSeam]:
    """Every experts module under ``root``, in module order, with its stacked parameters
    checked (each parameter registered on the module must be stacked over its experts).
    ``strict=False`` leaves out a module that fails the check instead of refusing it (the
    routing statistics of a model without expert parallelism, which splits nothing)."""
    seams = []
    for fqn, m in root.named_modules():
        family = family_of(m)
        if family is None:
            continue
        try:
            seams.append(_seam(fqn, m, family))
        except MatrixShardError:
            if strict:
                raise
    return seams


def _seam(fqn: str, m: nn.Module, family: SeamFamily) -> ExpertSeam:
    params = {n: p for n, p in m._parameters.items() if p is not None}
    first3 = next((p for p in params.values() if p.ndim == 3), None)
    e = getattr(m, "num_experts", None)
    if not isinstance(e, int) or isinstance(e, bool):
        e = first3.shape[0] if first3 is not None else None
    if not params or e is None:
        raise MatrixShardError(f"experts module {fqn or '<root>'!r} ({type(m).__name__}) holds no stacked "
                               "parameter [num_experts, ...] to split over the expert-parallel ranks")
    for n, p in params.items():
        if p.ndim < 1 or p.shape[0] != e:
            raise MatrixShardError(
                f"parameter {fqn + '.' + n if fqn else n!r} of the experts module {type(m).__name__} has shape "
                f"{tuple(p.shape)}, not stacked over its {e} experts (leading size {e}); expert parallelism "
                "splits every parameter of an experts module by expert")
    return ExpertSeam(fqn, m, family, int(e), tuple(params))


def install_forward(seam: ExpertSeam, dispatch: Callable[..., torch.Tensor], group: Any,
                    fused: Optional[Callable[..., torch.Tensor]] = None) -> None:
    """Replace the seam's forward (an instance attribute, the class stays) by its family's
    expert-parallel one: ``dispatch`` (``expert_parallel_forward``) moves the tokens and calls back the
    module's own computation on this rank's experts, here an expert-major ``x`` with ``counts``.
    ``fused(x, counts, gate_up_proj, down_proj, act_fn)``: the computation of the Mixtral layout
    (exactly ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, an ``act_fn``; a grouped GEMM
    where torch has one), used for the modules in that layout instead of their own loop.
    ``seam_family.uninstall(seam.module)`` gives the module its own forward back."""
    install(seam.family, seam.module, seam.num_experts, dispatch, group, fused)


def joinable_seams(root: nn.Module) -> list[nn.Module]:
    """The experts modules under ``root`` whose forward ``install_forward`` replaced, in module order."""
    return [m for m in root.modules() if installed(m) is not None]


def set_exchange_announce(module: nn.Module, announce: Optional[Callable[[torch.Tensor], None]]) -> None:
    """``announce(hidden)`` runs before each token exchange of ``module`` (None: nothing runs)."""
    set_announce(module, announce)


def exchange_without_tokens(module: nn.Module, hidden_size: int, dtype: torch.dtype) -> None:
    """Take part in ``module``'s token exchange with no token of this rank's own (collective, as the
    seam's forward): this rank's experts still compute the tokens the other ranks send them, and the
    results go back. No autograd graph is kept."""
    device = next(module.parameters()).device
    with torch.no_grad():
        installed(module).without_tokens(hidden_size, dtype, device)  # type: ignore[union-attr]


def _mixtral_layout(module: nn.Module) -> bool:
    names = {n for n, p in module._parameters.items() if p is not None}
    gu, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    return (names == {"gate_up_proj", "down_proj"} and callable(getattr(module, "act_fn", None))
            and not getattr(module, "is_transposed", False) and gu.ndim == 3 and down.ndim == 3
            and gu.shape[1] == 2 * down.shape[2] and gu.shape[2] == down.shape[1])
