"""The MoE predictor's workload: a mixture-of-experts decoder's shape, its dense parameters as
the planner sees them, its experts, FLOPs per layer, token all-to-all payload and activations
(the modes are :mod:`.moe`).

A layer is attention (grouped-query, or DeepSeek's low-rank "MLA" projections), a router
``[E, H]``, ``E`` routed experts of ``gate [I, H]``, ``up [I, H]``, ``down [H, I]`` of which
each token uses ``top_k``, and optionally shared experts (one gated MLP of ``S I`` columns, as
DeepSeek stores them). The first ``dense_layers`` layers have a dense gated MLP instead. A fused
``gate_up_proj [E, 2I, H]`` counts as two ``[I, H]`` matrices: it is orthogonalized as its halves.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from lightning_matrixfsdp.runtime.placement import ParamSpec, UnitSpec

from .shape import ELEM, PredictError

__all__ = ["MOE_SHAPES", "MoEShape", "activation_bytes", "dense_units", "expert_matrices", "layer_flops",
           "moe_layers", "parameter_counts", "token_payload"]

_DT = "bfloat16"


@dataclass(frozen=True)
class MoEShape:
    """One MoE decoder; ``batch`` sequences of ``seq_len`` tokens per GPU. ``kv_lora_rank > 0``
    selects MLA attention (``head_dim`` the no-rope q/k part, ``rope_dim`` and ``v_head_dim``)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_mlp: int
    shared_experts: int = 0
    dense_layers: int = 0
    dense_mlp: int = 0
    vocab: int = 32000
    seq_len: int = 4096
    batch: int = 1
    kv_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0
    ac: bool = True
    ns_steps: int = 5

    def __post_init__(self) -> None:
        for key in ("hidden", "layers", "heads", "kv_heads", "head_dim", "experts", "top_k", "expert_mlp",
                    "seq_len", "batch", "ns_steps"):
            if int(getattr(self, key)) < 1:
                raise PredictError(f"MoE model {self.name!r}: {key} must be >= 1, got {getattr(self, key)}")
        if self.top_k > self.experts:
            raise PredictError(f"MoE model {self.name!r}: top_k={self.top_k} exceeds experts={self.experts}")
        if not 0 <= self.dense_layers < self.layers:
            raise PredictError(f"MoE model {self.name!r}: dense_layers={self.dense_layers} must be in "
                               f"[0, layers={self.layers})")
        if self.dense_layers and self.dense_mlp < 1:
            raise PredictError(f"MoE model {self.name!r}: dense_layers need dense_mlp >= 1")
        if self.heads % self.kv_heads:
            raise PredictError(f"MoE model {self.name!r}: kv_heads={self.kv_heads} must divide heads={self.heads}")
        if self.kv_lora_rank and self.v_head_dim < 1:
            raise PredictError(f"MoE model {self.name!r}: MLA attention (kv_lora_rank > 0) needs v_head_dim >= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def qk_dim(self) -> int:
        """Per-head query/key width (MLA: the no-rope part plus the rope part)."""
        return self.head_dim + self.rope_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim


MOE_SHAPES: dict[str, MoEShape] = {
    # Mixtral-8x7B's published configuration: 32 layers, hidden 4096, 32 query / 8 KV heads of
    # 128, 8 experts of intermediate 14336, top-2, vocabulary 32000 (46.7B parameters).
    "mixtral-8x7b": MoEShape("mixtral-8x7b", 4096, 32, 32, 8, 128, experts=8, top_k=2, expert_mlp=14336),
    # DeepSeek-V3's architecture at its "lite" size (the published Moonlight-16B-A3B configuration,
    # trained with Muon): 27 layers, hidden 2048, 16 MLA heads (q/k 128 + 64 rope, v 128, KV rank
    # 512, no query low rank), 64 routed experts of intermediate 1408, top-6, 2 shared experts,
    # the first layer dense (intermediate 11264), vocabulary 163840.
    "deepseek-v3-lite": MoEShape("deepseek-v3-lite", 2048, 27, 16, 16, 128, experts=64, top_k=6, expert_mlp=1408,
                                 shared_experts=2, dense_layers=1, dense_mlp=11264, vocab=163840,
                                 kv_lora_rank=512, rope_dim=64, v_head_dim=128),
}


def moe_layers(s: MoEShape) -> int:
    return s.layers - s.dense_layers


def _attention(s: MoEShape) -> list[tuple[str, tuple[int, ...]]]:
    h = s.hidden
    if s.kv_lora_rank:
        return [("attn.q_proj", (s.heads * s.qk_dim, h)), ("attn.kv_a_proj", (s.kv_lora_rank + s.rope_dim, h)),
                ("attn.kv_b_proj", (s.heads * (s.head_dim + s.v_dim), s.kv_lora_rank)),
                ("attn.o_proj", (h, s.heads * s.v_dim))]
    return [("attn.q_proj", (s.heads * s.head_dim, h)), ("attn.k_proj", (s.kv_heads * s.head_dim, h)),
            ("attn.v_proj", (s.kv_heads * s.head_dim, h)), ("attn.o_proj", (h, s.heads * s.head_dim))]


def _mlp(prefix: str, width: int, h: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(prefix + ".gate_proj", (width, h)), (prefix + ".up_proj", (width, h)), (prefix + ".down_proj", (h, width))]


@functools.lru_cache(maxsize=64)
def dense_units(s: MoEShape) -> tuple[UnitSpec, ...]:
    """What stays owner-sharded (or FSDP-sharded) over the whole world: the root (embedding, final
    norm, head: AdamW) and per layer its norms, attention, router, shared experts or dense MLP."""
    h = s.hidden
    units = [UnitSpec("", (ParamSpec("embed.weight", (s.vocab, h), _DT, False),
                           ParamSpec("norm.weight", (h,), _DT, False),
                           ParamSpec("head.weight", (s.vocab, h), _DT, False)))]
    for i in range(s.layers):
        p = f"layers.{i}."
        mats = _attention(s)
        if i < s.dense_layers:
            mats += _mlp("mlp", s.dense_mlp, h)
        else:
            mats += [("mlp.router", (s.experts, h))]
            if s.shared_experts:
                mats += _mlp("mlp.shared", s.shared_experts * s.expert_mlp, h)
        params = [ParamSpec(p + "attn_norm.weight", (h,), _DT, False),
                  ParamSpec(p + "mlp_norm.weight", (h,), _DT, False)]
        if s.kv_lora_rank:
            params.append(ParamSpec(p + "attn.kv_norm.weight", (s.kv_lora_rank,), _DT, False))
        params += [ParamSpec(p + n + ".weight", shape, _DT, True) for n, shape in mats]
        units.append(UnitSpec(f"layers.{i}", tuple(params)))
    return tuple(units)


def expert_matrices(s: MoEShape) -> tuple[tuple[int, int], ...]:
    """One expert's matrices as its optimizer sees them: gate, up (the halves of gate_up), down."""
    return ((s.expert_mlp, s.hidden), (s.expert_mlp, s.hidden), (s.hidden, s.expert_mlp))


def expert_numel(s: MoEShape) -> int:
    return sum(m * n for m, n in expert_matrices(s))


def parameter_counts(s: MoEShape) -> dict[str, int]:
    """Total, dense (everything but the routed experts), routed-expert and active-per-token parameters."""
    dense = sum(p.numel for u in dense_units(s) for p in u.params)
    experts = moe_layers(s) * s.experts * expert_numel(s)
    return {"total": dense + experts, "dense": dense, "experts": experts,
            "active": dense + moe_layers(s) * s.top_k * expert_numel(s)}


def layer_flops(s: MoEShape, layer: int) -> float:
    """Forward FLOPs of one layer on one GPU's tokens: its dense matmuls, causal attention (half
    of ``QK^T`` and ``AV``) and, on an MoE layer, ``top_k`` experts per token (uniform routing)."""
    t = s.tokens
    mats = sum(p.numel for p in dense_units(s)[layer + 1].params if p.is_matrix)
    attn = s.batch * s.seq_len ** 2 * s.heads * (s.qk_dim + s.v_dim)
    experts = 2 * t * s.top_k * expert_numel(s) if layer >= s.dense_layers else 0
    return 2 * t * mats + attn + experts


def head_flops(s: MoEShape) -> float:
    return 2 * s.tokens * s.vocab * s.hidden


def token_payload(s: MoEShape) -> int:
    """Bytes one GPU dispatches in one token all-to-all of one MoE layer (its own share included):
    each token's hidden state once per chosen expert."""
    return s.tokens * s.top_k * s.hidden * ELEM


def activation_bytes(s: MoEShape) -> float:
    """Checkpoints of every layer, one layer's working set (h-sized tensors ~10, the dense or
    shared MLP's 4 of its width, the dispatched tokens in and out and an expert's 3 of ``I`` per
    routed copy), bf16 logits with float32 loss and grad."""
    t, h = s.tokens, s.hidden
    widest = max(s.dense_mlp, s.shared_experts * s.expert_mlp)
    work = t * (10 * h + 4 * widest + s.top_k * (2 * h + 3 * s.expert_mlp)) * ELEM
    saved = s.layers * (t * h * ELEM if s.ac else work)
    return saved + (work if s.ac else 0) + t * s.vocab * (ELEM + 8)
