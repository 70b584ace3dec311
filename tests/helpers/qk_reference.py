"""A plain QK-Clip reference for the tests: tiny models, each attention's q and k recomputed from
its captured inputs, the logits written out in full with einsum, and Kimi K2's rule applied to
the weights by hand, head by head (nothing of ``lightning_matrixfsdp.qkclip`` is used here).

The rule (Kimi K2 report, sec. 2.1): per head h, ``S_h = max over the step's batch of
scale * q_i . k_j`` (the softmax's scale included); ``gamma_h = min(1, tau / S_h)`` where S_h
exceeds tau; q and k rows of head h times ``sqrt(gamma_h)``; MLA: ``q_C``, ``k_C`` times
``sqrt(gamma_h)``, ``q_R`` times ``gamma_h``, the shared ``k_R`` left alone. Our decisions,
written out here too: a key head shared by a group of query heads takes the group's smallest
gamma; a q_norm / k_norm weight shared by all heads takes the layer's smallest gamma and the
projection before it is left alone.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

VOCAB, SEQ = 64, 16


def build(name: str, **kw: Any) -> nn.Module:
    """A tiny float32 model (dropout off)."""
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=2 * SEQ, **kw))
    if name == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            max_position_embeddings=2 * SEQ, **kw))
    if name == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                num_local_experts=2, num_experts_per_tok=1,
                                                max_position_embeddings=2 * SEQ, **kw))
    if name == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                                  moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=8, num_experts=2,
                                                  num_experts_per_tok=1, max_position_embeddings=2 * SEQ, **kw))
    if name == "mla":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM(DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=8, first_k_dense_replace=2, rope_interleave=False, max_position_embeddings=2 * SEQ, **kw))
    if name == "gpt":
        from lightning_matrixfsdp.demos.gpt import GPT

        return GPT(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4, **kw)
    raise ValueError(name)


def logits_of(model: nn.Module, x: torch.Tensor, **kw: Any) -> torch.Tensor:
    out = model(x, **kw)
    return out if isinstance(out, torch.Tensor) else out.logits


def attention_modules(model: nn.Module) -> list[nn.Module]:
    names = ("Attention", "CausalSelfAttention")
    return [m for m in model.modules() if type(m).__name__.endswith(names) and not isinstance(m, nn.ModuleList)]


class Capture:
    """Every forward's inputs of every attention module (a pre-hook with keyword arguments)."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[nn.Module, list[tuple[tuple, dict]]] = {m: [] for m in attention_modules(model)}
        self.handles = [m.register_forward_pre_hook(self._hook(m), with_kwargs=True) for m in self.calls]

    def _hook(self, m: nn.Module) -> Any:
        def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
            self.calls[m].append((args, dict(kwargs)))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


@torch.no_grad()
def q_and_k(m: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Query ``[B, H, T, d]``, key ``[B, KV, S, d]`` and the softmax scale of one forward of ``m``."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    b, t, _ = hidden.shape
    if hasattr(m, "qkv"):  # the demos' GPT: fused [q, k, v], no rotary embedding
        c = hidden.shape[-1]
        q, k, _ = m.qkv(hidden).split(c, dim=2)
        h = m.n_heads
        return (q.view(b, t, h, c // h).transpose(1, 2), k.view(b, t, h, c // h).transpose(1, 2), (c // h) ** -0.5)
    cos, sin = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    if hasattr(m, "kv_b_proj"):  # multi-head latent attention
        qs = m.q_proj(hidden) if getattr(m, "q_proj", None) is not None else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(hidden)))
        qs = qs.view(b, t, -1, m.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = qs.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        k_pass, k_rot = m.kv_a_proj_with_mqa(hidden).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = m.kv_b_proj(m.kv_a_layernorm(k_pass)).view(b, t, -1, m.qk_nope_head_dim + m.v_head_dim).transpose(1, 2)
        k_pass = kv[..., :m.qk_nope_head_dim]
        q_rot, k_rot = _rope(q_rot, cos, sin), _rope(k_rot.view(b, 1, t, m.qk_rope_head_dim), cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(*k_pass.shape[:-1], -1)), dim=-1)
        return q, k, m.scaling
    d = m.head_dim
    q = m.q_proj(hidden).view(b, t, -1, d)
    k = m.k_proj(hidden).view(b, t, -1, d)
    if hasattr(m, "q_norm"):
        q, k = m.q_norm(q), m.k_norm(k)
    return _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin), m.scaling


def head_maxima(q: torch.Tensor, k: torch.Tensor, scale: float, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Every logit written out (einsum), causal (and key padding), max per head over the batch."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    s = torch.einsum("bhtd,bhsd->bhts", q.double(), k.double()) * scale
    t, n = s.shape[-2], s.shape[-1]
    allowed = torch.ones(t, n, dtype=torch.bool).tril(n - t)
    allowed = allowed.expand(s.shape[0], 1, t, n)
    if key_valid is not None:
        allowed = allowed & key_valid.bool()[:, None, None, :]
    return s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


def step_maxima(capture: Capture, key_valid: list[torch.Tensor | None] | None = None) -> dict[nn.Module, torch.Tensor]:
    """Each attention module's per-head maximum over all the forwards captured."""
    out = {}
    for m, calls in capture.calls.items():
        per = [head_maxima(*q_and_k(m, a, kw), None if key_valid is None else key_valid[i])
               for i, (a, kw) in enumerate(calls)]
        out[m] = torch.stack(per).amax(0)
    return out


def gammas(maxima: torch.Tensor, tau: float) -> list[float]:
    return [tau / s if s > tau else 1.0 for s in maxima.tolist()]


@torch.no_grad()
def clip_by_hand(m: nn.Module, maxima: torch.Tensor, tau: float) -> None:
    """Kimi K2's rule on one attention module, head by head, in place."""
    g = gammas(maxima, tau)
    h = len(g)
    if hasattr(m, "qkv"):
        c = m.qkv.weight.shape[0] // 3
        d = c // h
        for i in range(h):
            for t in [m.qkv.weight] + ([m.qkv.bias] if m.qkv.bias is not None else []):
                t[i * d:(i + 1) * d] *= math.sqrt(g[i])          # q of head i
                t[c + i * d:c + (i + 1) * d] *= math.sqrt(g[i])  # k of head i
        return
    if hasattr(m, "kv_b_proj"):
        nope, rope, v = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        qw = m.q_proj.weight if getattr(m, "q_proj", None) is not None else m.q_b_proj.weight
        for i in range(h):
            base = i * (nope + rope)
            qw[base:base + nope] *= math.sqrt(g[i])        # q_C
            qw[base + nope:base + nope + rope] *= g[i]     # q_R
            m.kv_b_proj.weight[i * (nope + v):i * (nope + v) + nope] *= math.sqrt(g[i])  # k_C; v and k_R untouched
        return
    d = m.head_dim
    if hasattr(m, "q_norm"):  # shared by every head, after the projections: the layer's smallest gamma
        m.q_norm.weight *= math.sqrt(min(g))
        m.k_norm.weight *= math.sqrt(min(g))
        return
    kv = m.k_proj.weight.shape[0] // d
    rep = h // kv
    for i in range(h):
        for t in [m.q_proj.weight] + ([m.q_proj.bias] if m.q_proj.bias is not None else []):
            t[i * d:(i + 1) * d] *= math.sqrt(g[i])
    for j in range(kv):
        group = min(g[j * rep:(j + 1) * rep])  # a key head shared by `rep` query heads
        for t in [m.k_proj.weight] + ([m.k_proj.bias] if m.k_proj.bias is not None else []):
            t[j * d:(j + 1) * d] *= math.sqrt(group)
