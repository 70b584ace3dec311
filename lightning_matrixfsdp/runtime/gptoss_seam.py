"""The GPT-OSS seam of expert parallelism: ``GptOssExperts``, whose forward differs from Mixtral's.

Hugging Face's GPT-OSS experts module takes ``forward(hidden_states [T, H], router_indices [T, k],
routing_weights [T, k])`` (not ``top_k_index``/``top_k_weights``), stores its experts transposed
with biases (``gate_up_proj [E, H, 2I]`` and ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``
and ``down_proj_bias [E, H]``: every parameter stacked over its experts) and runs a clamped
SwiGLU (its ``alpha`` and ``limit``) on gate and up interleaved. ``expert_seams.find_seams``
recognizes it here (:func:`is_gptoss_experts`) as the seam kind :data:`GPTOSS`, and under
``expert_parallel_size > 1`` :func:`install_gptoss_forward` replaces its forward by one that
sends each token to its expert's rank (``expert_dispatch.expert_parallel_forward``) and there runs
the module's own per-expert computation (its eager loop: the same clamp, activation and biases)
on this rank's experts, each row once with weight 1; the router's weights are applied when the
results come back, as the module applies them. Nothing here communicates.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_matrixfsdp.runtime.options import MatrixShardError

__all__ = ["GPTOSS", "install_gptoss_forward", "is_gptoss_experts"]

GPTOSS = "gptoss"
_ARGS = ("hidden_states", "router_indices", "routing_weights")


def is_gptoss_experts(module: nn.Module, arg_names: tuple[str, ...]) -> bool:
    """Whether ``module`` (whose forward takes ``arg_names`` after ``self``) is a GPT-OSS-shaped
    experts module: that signature and at least one stacked 3-D parameter."""
    return arg_names == _ARGS and any(p is not None and p.ndim == 3 for p in module._parameters.values())


def install_gptoss_forward(module: nn.Module, num_experts: int, dispatch: Callable[..., torch.Tensor],
                           group: Any) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """Replace ``module``'s forward (an instance attribute) by the expert-parallel one and return the
    local computation (what the uneven-evaluation join runs with no token of this rank's own):
    ``dispatch`` (``expert_parallel_forward``) moves the rows to their experts' ranks and calls
    back the module's own eager loop on this rank's ``E/EP`` experts (local indices, weight 1)."""
    own = type(module).forward
    own = getattr(own, "__wrapped__", own)  # transformers' implementation switch: its eager loop

    def local(x: torch.Tensor, counts: Any) -> torch.Tensor:
        c = torch.as_tensor(counts, dtype=torch.int64, device=x.device)
        ids = torch.repeat_interleave(torch.arange(c.numel(), device=x.device), c)
        return own(module, x, ids[:, None], torch.ones(ids.shape[0], 1, dtype=x.dtype, device=x.device))

    def forward(hidden_states: torch.Tensor, router_indices: Optional[torch.Tensor] = None,
                routing_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        if router_indices is None or routing_weights is None:
            raise MatrixShardError(f"{type(module).__name__} under expert parallelism needs router_indices and "
                                   "routing_weights (the router's top-k choices) to send each token to its expert")
        return dispatch(hidden_states, router_indices, routing_weights, num_experts, local, group)

    module.forward = forward  # type: ignore[method-assign]
    return local
