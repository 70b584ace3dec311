"""The GPT-OSS seam of expert parallelism: ``GptOssExperts``, whose forward differs from Mixtral's.

Hugging Face's GPT-OSS experts module takes ``forward(hidden_states [T, H], router_indices [T, k],
routing_weights [T, k])`` (not ``top_k_index``/``top_k_weights``), stores its experts transposed
with biases (``gate_up_proj [E, H, 2I]`` and ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``
and ``down_proj_bias [E, H]``: every parameter stacked over its experts) and runs a clamped
SwiGLU (its ``alpha`` and ``limit``) on gate and up interleaved. ``expert_seams.find_seams``
recognizes it by its family here (:class:`GptOssSeam`, the seam kind :data:`GPTOSS`), and under
``expert_parallel_size > 1`` its installed forward (``seam_family.install``) is one that
sends each token to its expert's rank (``expert_dispatch.expert_parallel_forward``) and there runs
the module's own per-expert computation (its eager loop: the same clamp, activation and biases)
on this rank's experts, each row once with weight 1; the router's weights are applied when the
results come back, as the module applies them. On CUDA, for Hugging Face's ``GptOssExperts`` in
bfloat16 with sizes that are multiples of 8 (``expert_dispatch.grouped_mm_available``), that
computation is :func:`gptoss_experts_forward` instead: the same arithmetic with one grouped GEMM
per projection rather than a Python loop over the experts. Nothing here communicates.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.experts.dispatch import grouped_mm_available
from lightning_matrixfsdp.runtime.experts.seam_family import InstalledSeam, SeamFamily, eager_local, install, own_forward

__all__ = ["GPTOSS", "GPTOSS_SEAM", "GptOssSeam", "GroupedMatmul", "gptoss_experts_forward", "gptoss_gate", "install_gptoss_forward",
           "is_gptoss_experts", "per_expert_mm"]

GPTOSS = "gptoss"
_ARGS = ("hidden_states", "router_indices", "routing_weights")
_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")

#: ``mm(x [S, K], w [E, K, N], offs=offs [E] int32) -> [S, N]``: row group ``e`` of ``x`` (rows
#: ``offs[e-1]:offs[e]``) times ``w[e]``. ``torch.nn.functional.grouped_mm`` or :func:`per_expert_mm`.
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def is_gptoss_experts(module: nn.Module, arg_names: tuple[str, ...]) -> bool:
    """Whether ``module`` (whose forward takes ``arg_names`` after ``self``) is a GPT-OSS-shaped
    experts module: that signature and at least one stacked 3-D parameter."""
    return arg_names == _ARGS and any(p is not None and p.ndim == 3 for p in module._parameters.values())


def per_expert_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The :data:`GroupedMatmul` as a loop of plain matmuls (any device and dtype): what
    ``F.grouped_mm`` computes, one expert at a time."""
    ends = offs.tolist()
    return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip([0] + ends[:-1], ends))])


def gptoss_gate(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU on gate and up interleaved along the last dimension (gate
    ``[..., ::2]``, up ``[..., 1::2]``): ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)``
    with ``g = min(gate, limit)``, in the operation order of Hugging Face's module."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gptoss_experts_forward(x: torch.Tensor, counts: Sequence[int], gate_up_proj: torch.Tensor,
                           gate_up_proj_bias: torch.Tensor, down_proj: torch.Tensor, down_proj_bias: torch.Tensor,
                           alpha: float, limit: float, *, mm: Optional[GroupedMatmul] = None) -> torch.Tensor:
    """GPT-OSS's experts on expert-major rows (``counts[e]`` rows for local expert ``e``): for
    expert ``e``, ``gptoss_gate(x @ gate_up_proj[e] + gate_up_proj_bias[e]) @ down_proj[e] +
    down_proj_bias[e]``, the module's eager loop with every router weight 1. ``gate_up_proj``
    ``[E, H, 2I]`` and ``down_proj [E, I, H]`` are already ``x @ W`` (no transpose); ``mm``
    (default ``F.grouped_mm``) does both projections for all experts at once. Each row's bias
    is ``onehot(expert) @ bias``: exact (one nonzero term), and its backward is one matmul that
    sums each expert's rows with float accumulation, as the loop's bias gradient does (a gather's
    backward, ``bias[ids]`` or ``F.embedding``, may accumulate in bfloat16 on CUDA)."""
    if len(counts) != gate_up_proj.shape[0] or any(p.shape[0] != len(counts) for p in
                                                   (gate_up_proj_bias, down_proj, down_proj_bias)):
        raise MatrixShardError(f"gptoss_experts_forward: {len(counts)} counts for gate_up_proj "
                               f"{tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)}: one count per "
                               "local expert")
    mm = F.grouped_mm if mm is None else mm
    c = torch.as_tensor(counts, dtype=torch.int64)
    # int32 offsets (grouped_mm refuses int64); the counts live on the host, one copy over
    offs = torch.cumsum(c, 0).to(device=x.device, dtype=torch.int32)
    experts = torch.arange(len(counts), device=x.device)
    ids = torch.repeat_interleave(experts, c.to(x.device), output_size=int(c.sum()))
    onehot = (ids[:, None] == experts).to(gate_up_proj_bias.dtype)  # [S, E], 0 and 1 exactly; no sync
    gate_up = mm(x, gate_up_proj, offs=offs) + onehot @ gate_up_proj_bias
    return mm(gptoss_gate(gate_up, alpha, limit), down_proj, offs=offs) + onehot @ down_proj_bias


def _grouped_ready(module: nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's ``GptOssExperts`` as :func:`gptoss_experts_forward`
    computes it: that class name (whose math this is), the four parameters, numeric alpha/limit."""
    names = tuple(n for n, p in module._parameters.items() if p is not None)
    return (type(module).__name__ == "GptOssExperts" and sorted(names) == sorted(_PARAMS)
            and all(isinstance(getattr(module, a, None), (int, float)) for a in ("alpha", "limit")))


class GptOssSeam(SeamFamily):
    """Hugging Face's GPT-OSS experts: ``forward(hidden_states, router_indices, routing_weights)``
    and at least one stacked 3-D parameter. On the local experts: the module's own eager loop (local
    indices, weight 1), or :func:`gptoss_experts_forward` with ``F.grouped_mm`` where
    ``grouped_mm_available`` holds (Hugging Face's ``GptOssExperts`` only)."""

    name = GPTOSS

    def matches(self, module: nn.Module, args: tuple[str, ...]) -> bool:
        return is_gptoss_experts(module, args)

    def local(self, module: nn.Module, fused: Optional[Callable[..., torch.Tensor]]) -> Callable[..., torch.Tensor]:
        return functools.partial(_local, own_forward(module), module, _grouped_ready(module))

    def forward(self, seam: InstalledSeam, hidden_states: torch.Tensor,  # type: ignore[override]
                router_indices: Optional[torch.Tensor] = None,
                routing_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        if router_indices is None or routing_weights is None:
            raise MatrixShardError(f"{type(seam.module).__name__} under expert parallelism needs router_indices and "
                                   "routing_weights (the router's top-k choices) to send each token to its expert")
        return seam.dispatch(hidden_states, router_indices, routing_weights)


def _local(own: Callable[..., torch.Tensor], module: nn.Module, grouped: bool, x: torch.Tensor,
           counts: Any) -> torch.Tensor:
    if grouped:
        params = [getattr(module, n) for n in _PARAMS]
        if grouped_mm_available(x, *params):
            return gptoss_experts_forward(x, [int(c) for c in counts], *params, float(module.alpha),
                                          float(module.limit))
    return eager_local(own, module, x, counts)


#: the family's entry in ``expert_seams.FAMILIES``
GPTOSS_SEAM = GptOssSeam()


def install_gptoss_forward(module: nn.Module, num_experts: int, dispatch: Callable[..., torch.Tensor],
                           group: Any) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """Install :data:`GPTOSS_SEAM` on ``module`` (``seam_family.install``) and return its local
    computation (what the uneven-evaluation join runs with no token of this rank's own)."""
    return install(GPTOSS_SEAM, module, num_experts, dispatch, group).local
