"""Where expert parallelism enters a model: the *seams*, the modules whose forward runs the experts.

Three seams are known:

- ``"topk"``: a Hugging Face experts module (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 in our
  pinned transformers): ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
  over stacked parameters ``[E, ...]``. Found by its signature, nothing to declare.
- ``"gptoss"``: Hugging Face's GPT-OSS experts module, ``forward(hidden_states, router_indices,
  routing_weights)``, transposed stacks with biases (``gptoss_seam.py``). Found by its signature.
- ``"grouped"``: a torchtitan-shaped ``GroupedExperts`` (``forward(x, num_tokens_per_expert)``,
  ``x`` sorted by expert, stacked ``w1/w2/w3``), declared by :func:`parallelize_experts` in
  ``configure_model`` (the parallel style).

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

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.gptoss_seam import GPTOSS, install_gptoss_forward, is_gptoss_experts

__all__ = ["ExpertSeam", "parallelize_experts", "find_seams", "install_forward", "joinable_seams",
           "set_exchange_announce", "exchange_without_tokens"]

TOPK, GROUPED = "topk", "grouped"
_STYLE = "_mfsdp_expert_style"  # a module mark: set by parallelize_experts, read by find_seams
# marks of an installed seam, for the uneven-evaluation join (runtime/join.py): the callback told
# before each token exchange of a joined step, and the exchange run with no token of this rank's
_ANNOUNCE, _NO_TOKENS = "_mfsdp_ep_announce", "_mfsdp_ep_no_tokens"
_HF_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


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
    names = _arg_names(type(module).forward)
    if len(names) != 2:
        raise MatrixShardError(f"parallelize_experts: {type(module).__name__}.forward takes {names}; the grouped "
                               "seam is forward(x, num_tokens_per_expert)")
    object.__setattr__(module, _STYLE, GROUPED)
    return module


@dataclass(eq=False)
class ExpertSeam:
    """One experts module: its name, kind, number of experts and stacked parameter names."""

    fqn: str
    module: nn.Module
    kind: str
    num_experts: int
    names: tuple[str, ...]


def _arg_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _kind(module: nn.Module) -> Optional[str]:
    style = module.__dict__.get(_STYLE)
    if style is not None:
        return style
    stacked = any(p is not None and p.ndim == 3 for p in module._parameters.values())
    if stacked and is_gptoss_experts(module, _arg_names(type(module).forward)):
        return GPTOSS  # GPT-OSS's own signature and computation (gptoss_seam.py)
    return TOPK if stacked and _arg_names(type(module).forward) == _HF_ARGS else None


def find_seams(root: nn.Module, strict: bool = True) -> list[ExpertSeam]:
    """Every experts module under ``root``, in module order, with its stacked parameters
    checked (each parameter registered on the module must be stacked over its experts).
    ``strict=False`` leaves out a module that fails the check instead of refusing it (the
    routing statistics of a model without expert parallelism, which splits nothing)."""
    seams = []
    for fqn, m in root.named_modules():
        kind = _kind(m)
        if kind is None:
            continue
        try:
            seams.append(_seam(fqn, m, kind))
        except MatrixShardError:
            if strict:
                raise
    return seams


def _seam(fqn: str, m: nn.Module, kind: str) -> ExpertSeam:
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
    return ExpertSeam(fqn, m, kind, int(e), tuple(params))


def install_forward(seam: ExpertSeam, dispatch: Callable[..., torch.Tensor], group: Any,
                    fused: Optional[Callable[..., torch.Tensor]] = None) -> None:
    """Replace the seam's forward (an instance attribute, the class stays) by the expert-parallel
    one: ``dispatch`` (``expert_parallel_forward``) moves the tokens and calls back the
    module's own computation on this rank's experts, here an expert-major ``x`` with ``counts``.
    ``fused(x, counts, gate_up_proj, down_proj, act_fn)``: the computation of the Mixtral layout
    (exactly ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, an ``act_fn``; a grouped GEMM
    where torch has one), used for the modules in that layout instead of their own loop."""
    module, e = seam.module, seam.num_experts
    exchange, dispatch = dispatch, _announced(module, dispatch)
    if seam.kind == GPTOSS:
        local = install_gptoss_forward(module, e, dispatch, group)
    elif seam.kind == TOPK and fused is not None and _mixtral_layout(module):
        def local(x: torch.Tensor, counts: Any) -> torch.Tensor:
            return fused(x, [int(c) for c in counts], module.gate_up_proj, module.down_proj, module.act_fn)

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
            return dispatch(hidden_states, top_k_index, top_k_weights, e, local, group)
    elif seam.kind == TOPK:
        own = type(module).forward
        own = getattr(own, "__wrapped__", own)  # transformers' implementation switch: its eager loop

        def local(x: torch.Tensor, counts: Any) -> torch.Tensor:
            # every row to one local expert with weight 1: the module's own per-expert computation
            ids = _expert_ids(counts, x.device)
            return own(module, x, ids[:, None], torch.ones(ids.shape[0], 1, dtype=x.dtype, device=x.device))

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
            return dispatch(hidden_states, top_k_index, top_k_weights, e, local, group)
    else:
        own = type(module).forward

        def local(x: torch.Tensor, counts: Any) -> torch.Tensor:
            return own(module, x, _counts(counts, x.device))

        def forward(x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
            ids = _expert_ids(num_tokens_per_expert, x.device)
            return dispatch(x, ids[:, None], torch.ones(ids.shape[0], 1, dtype=x.dtype, device=x.device), e, local,
                            group)
    if seam.kind != GPTOSS:  # the GPT-OSS seam installed its own forward
        module.forward = forward  # type: ignore[method-assign]
    object.__setattr__(module, _NO_TOKENS, lambda h, dtype, device: exchange(
        torch.zeros(0, h, dtype=dtype, device=device), torch.zeros(0, 1, dtype=torch.long, device=device),
        torch.zeros(0, 1, dtype=dtype, device=device), e, local, group))


def _announced(module: nn.Module, dispatch: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``dispatch``, telling the join's callback (if one is set) before the exchange."""
    def run(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        announce = module.__dict__.get(_ANNOUNCE)
        if announce is not None:
            announce(hidden)
        return dispatch(hidden, *args)
    return run


def joinable_seams(root: nn.Module) -> list[nn.Module]:
    """The experts modules under ``root`` whose forward ``install_forward`` replaced, in module order."""
    return [m for m in root.modules() if _NO_TOKENS in m.__dict__]


def set_exchange_announce(module: nn.Module, announce: Optional[Callable[[torch.Tensor], None]]) -> None:
    """``announce(hidden)`` runs before each token exchange of ``module`` (None: nothing runs)."""
    if announce is None:
        module.__dict__.pop(_ANNOUNCE, None)
    else:
        object.__setattr__(module, _ANNOUNCE, announce)


def exchange_without_tokens(module: nn.Module, hidden_size: int, dtype: torch.dtype) -> None:
    """Take part in ``module``'s token exchange with no token of this rank's own (collective, as the
    seam's forward): this rank's experts still compute the tokens the other ranks send them, and the
    results go back. No autograd graph is kept."""
    device = next(module.parameters()).device
    with torch.no_grad():
        module.__dict__[_NO_TOKENS](hidden_size, dtype, device)


def _mixtral_layout(module: nn.Module) -> bool:
    names = {n for n, p in module._parameters.items() if p is not None}
    gu, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    return (names == {"gate_up_proj", "down_proj"} and callable(getattr(module, "act_fn", None))
            and not getattr(module, "is_transposed", False) and gu.ndim == 3 and down.ndim == 3
            and gu.shape[1] == 2 * down.shape[2] and gu.shape[2] == down.shape[1])


def _counts(counts: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(counts, dtype=torch.int64, device=device)


def _expert_ids(counts: Any, device: torch.device) -> torch.Tensor:
    """Row ``i`` of an expert-major batch -> its expert's index (``counts[e]`` rows of expert ``e``)."""
    c = _counts(counts, device)
    return torch.repeat_interleave(torch.arange(c.numel(), device=device), c)
