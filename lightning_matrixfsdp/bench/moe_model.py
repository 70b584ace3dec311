"""A mixture-of-experts decoder in plain torch, for the one-GPU MoE benchmark
(``scripts/gpu_moe_bench.py``; no transformers needed).

Each block is the benchmark decoder's attention (``bench/model.py``) and an MoE MLP: a router
``[E, H]``, top-k of its logits softmaxed over the chosen k (Mixtral's rule), and ``E``
experts stored as 3-D stacks in the Hugging Face layout, ``gate_up_proj [E, 2I, H]`` (gate and
up as contiguous halves) and ``down_proj [E, H, I]``. Tokens are sorted by expert and each
expert runs on its own contiguous slice (one host sync per layer for the counts); the same
code runs on CPU and GPU, so every mode of the benchmark computes the same forward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .model import Attention, Block, Decoder

__all__ = ["MOE_PRESETS", "EXPERT_STACKS", "MoEConfig", "MoEDecoder", "count_moe_parameters", "is_muon_param"]

#: the strategy's ``expert_stacks`` option for this model: gate_up as its two halves, down whole
EXPERT_STACKS = {"*.mlp.experts.gate_up_proj": 2, "*.mlp.experts.down_proj": None}


def is_muon_param(fqn: str, p: Tensor) -> bool:
    """The benchmark's Muon rule, the same in every mode (the strategy's ``matrix_filter``):
    every matrix and expert stack except the embedding and the head."""
    return p.ndim >= 2 and not fqn.endswith(("embed.weight", "head.weight"))


@dataclass(frozen=True)
class MoEConfig:
    """Shape of the MoE decoder."""

    vocab_size: int
    hidden: int
    n_heads: int
    n_layers: int
    experts: int
    top_k: int
    expert_mlp: int
    seq_len: int
    activation_checkpointing: bool = True
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, experts={self.experts}]")
        ModelConfig(hidden=self.hidden, n_heads=self.n_heads)  # its head checks

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


MOE_PRESETS = {
    # seconds on a CPU: checks that the benchmark runs
    "tiny": MoEConfig(vocab_size=256, hidden=64, n_heads=4, n_layers=2, experts=4, top_k=2, expert_mlp=96, seq_len=32),
    # one H200: 1.88B parameters (1.61B in 8 experts x 8 layers), top-2, 0.47B active per token
    "h200": MoEConfig(vocab_size=32000, hidden=2048, n_heads=16, n_layers=8, experts=8, top_k=2, expert_mlp=4096,
                      seq_len=2048),
}


def count_moe_parameters(cfg: MoEConfig) -> dict[str, int]:
    """Closed form: total and expert parameters."""
    h, i = cfg.hidden, cfg.expert_mlp
    experts = cfg.n_layers * cfg.experts * 3 * h * i
    block = 4 * h * h + cfg.experts * h + 2 * h
    return {"total": cfg.n_layers * block + experts + 2 * cfg.vocab_size * h + h, "experts": experts}


class Experts(nn.Module):
    """E gated experts as two 3-D stacks (the Hugging Face layout)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.experts, 2 * cfg.expert_mlp, cfg.hidden))
        self.down_proj = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.expert_mlp))

    def forward(self, x: Tensor, top_idx: Tensor, top_w: Tensor) -> Tensor:
        """``x [T, H]``, the router's choices ``top_idx [T, k]`` and weights ``top_w [T, k]``."""
        k = top_idx.shape[1]
        flat = top_idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token = order // k
        outs = []
        for e, xe in enumerate(x[token].split(counts)):
            if counts[e] == 0:
                continue
            gate, up = F.linear(xe, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        y = torch.cat(outs) * top_w.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


class MoEMLP(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        logits = self.router(flat)
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top_logits.float(), dim=-1)
        return self.experts(flat, top_idx, weights).reshape(b, s, h)


class MoEBlock(Block):
    """The benchmark decoder's pre-norm block (its forward and activation checkpointing) with
    the gated MLP replaced by the MoE layer."""

    def __init__(self, cfg: MoEConfig) -> None:
        nn.Module.__init__(self)  # Block's own __init__ would build a dense MLP only to drop it
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.attn = Attention(ModelConfig(hidden=cfg.hidden, n_heads=cfg.n_heads))
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.mlp = MoEMLP(cfg)
        self.activation_checkpointing = cfg.activation_checkpointing


class MoEDecoder(Decoder):
    """The benchmark decoder (embedding -> blocks -> final norm -> untied head, the mean
    cross-entropy) with MoE blocks; ``cfg`` is a :class:`MoEConfig`."""

    block_type = MoEBlock

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic given the ambient RNG state; residual projections scaled with depth."""
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=self.cfg.init_std)
        for block in self.blocks:
            for w in (block.attn.wo.weight, block.mlp.experts.down_proj):
                w.mul_(1.0 / math.sqrt(2 * self.cfg.n_layers))
