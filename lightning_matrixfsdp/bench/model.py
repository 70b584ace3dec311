"""The decoder-only transformer that every benchmark mode trains.

Kept deliberately plain (separate q/k/v/o and gate/up/down weights, RMSNorm with
no biases, untied embedding and head) so its 2D weights are exactly the matrices
the Muon cost model counts, and so it shards the same way under FSDP2, DDP and
our owner layout. Blocks live in an `nn.ModuleList` (the default unit boundary).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables, computed per forward so the model has no buffers to sync."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rotary embedding on (batch, heads, seq, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention through F.scaled_dot_product_attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.hidden // cfg.n_heads
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, h = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, h))


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block.

    Activation checkpointing is applied *inside* forward, so hooks that a
    sharding wrapper puts on the block's __call__ stay outside the checkpointed
    region (the torchtitan arrangement) and the re-forward in backward finds the
    parameters already materialized.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.mlp = GatedMLP(cfg)
        self.activation_checkpointing = cfg.activation_checkpointing

    def _body(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._body, x, cos, sin, use_reentrant=False)
        return self._body(x, cos, sin)


class Decoder(nn.Module):
    """Token embedding -> blocks -> final norm -> untied LM head; returns the mean CE loss.

    ``block_type`` builds each block from ``cfg`` (the MoE decoder swaps in its MoE block)."""

    block_type: type[nn.Module] = Block

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(self.block_type(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init given the ambient RNG state (identical across modes)."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        # Scale residual projections down with depth (GPT-2 style) so deep presets stay stable.
        for block in self.blocks:
            for w in (block.attn.wo.weight, block.mlp.down.weight):
                w.mul_(1.0 / math.sqrt(2 * self.cfg.n_layers))

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        x = self.embed(tokens)
        cos, sin = rotary_tables(tokens.shape[1], self.cfg.hidden // self.cfg.n_heads, self.cfg.rope_theta, x.device, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def is_matrix(fqn: str, param: Tensor, scope: str = "blocks") -> bool:
    """Which parameters Muon treats as matrices; the same rule for every mode.

    `fqn` is relative to the Decoder (no DDP "module." prefix).
    """
    if param.ndim != 2:
        return False
    return scope == "all_2d" or fqn.startswith("blocks.")


def unit_of(fqn: str) -> str:
    """The unit a parameter belongs to: `blocks.<i>` or `root` (the leftovers)."""
    parts = fqn.split(".")
    if len(parts) > 2 and parts[0] == "blocks":
        return f"blocks.{parts[1]}"
    return "root"


def count_parameters(cfg: ModelConfig) -> int:
    """Closed-form parameter count (checks presets without building them)."""
    h, f, v, n = cfg.hidden, cfg.mlp_hidden, cfg.vocab_size, cfg.n_layers
    block = 4 * h * h + 3 * h * f + 2 * h
    return n * block + 2 * v * h + h


def make_batch(cfg: ModelConfig, batch_size: int, seed: int, rank: int, step: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Random token batch, distinct per rank and step, identical across modes."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    data = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
    data = data.to(device)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
