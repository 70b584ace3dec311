"""A small decoder LM for the tests: token embedding, attention, MLP, LayerNorm, untied head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, heads: int, experts: int = 0) -> None:
        super().__init__()
        # Mixture-of-experts stand-in: ``route`` picks the one expert this block runs, or
        # None for all (set per step and per rank by the tests: data-dependent unused
        # parameters).
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts)) if experts else None
        self.route = 0
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        if self.experts is not None:
            chosen = self.experts if self.route is None else [self.experts[self.route]]
            for expert in chosen:
                x = x + expert(x)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """Options switch on the edge cases the runtime must survive."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 16, *,
                 tied: bool = False, checkpointing: bool = False, call_twice: bool = False,
                 extra_branch: bool = False, experts: int = 0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, experts) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        self.checkpointing = checkpointing
        self.call_twice = call_twice
        self.branch = nn.Linear(d, d) if extra_branch else None
        self.use_branch = True

    def reset_parameters(self) -> None:
        """Initializes this module's own parameter (meta-device materialization calls it)."""
        torch.nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for i, blk in enumerate(self.blocks):
            x = checkpoint(blk, x, use_reentrant=False) if self.checkpointing else blk(x)
            if self.call_twice and i == 0:
                x = blk(x)
        if self.branch is not None and self.use_branch:
            x = x + self.branch(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def batch_for(step: int, rank: int, vocab: int = 64, batch: int = 2, seq: int = 16) -> torch.Tensor:
    """Distinct, reproducible data per (step, rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (batch, seq), generator=g)


class GroupedExperts(nn.Module):
    """torchtitan's shape: stacked ``w1``/``w2``/``w3``, rows sorted by expert with their counts."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) / dim ** 0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, n in enumerate(num_tokens_per_expert.tolist()):
            xe = x[start:start + n]
            start += n
            outs.append((F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)) @ self.w2[e].T)
        return torch.cat(outs)


class GroupedMoE(nn.Module):
    """A top-2 MoE block in torchtitan's shape around :class:`GroupedExperts`: router, tokens sorted
    by expert, experts, unsorted. ``skew``: the router always picks experts 0 and 1 (a bias of +-5,
    no weight), so every token goes to the first expert-parallel place."""

    def __init__(self, dim: int, experts: int, skew: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=skew)
        if skew:
            with torch.no_grad():
                self.router.weight.zero_()
                self.router.bias.copy_(torch.tensor([5.0, 5.0] + [-5.0] * (experts - 2)))
        self.experts = GroupedExperts(dim, 2 * dim, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.norm(x).reshape(-1, x.shape[-1])
        weights, index = torch.topk(torch.softmax(self.router(flat), dim=-1), 2, dim=-1)
        order = torch.argsort(index.reshape(-1), stable=True)
        counts = torch.bincount(index.reshape(-1), minlength=self.experts.num_experts)
        y_sorted = self.experts(flat.repeat_interleave(2, dim=0)[order], counts)
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        return x + (y.view(-1, 2, x.shape[-1]) * weights[..., None]).sum(1).view_as(x)
