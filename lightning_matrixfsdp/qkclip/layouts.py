"""Which modules are attention layers QK-Clip knows, how many heads each has, and which rows of
which tensors belong to which head (pure: reads module attributes and whole row counts).

Three families:

* **Hugging Face attention with ``q_proj`` / ``k_proj``** (Llama, Mistral, Mixtral, Qwen2,
  Qwen3, Qwen3-MoE, ...): query head ``h`` is rows ``[h d, (h+1) d)`` of ``q_proj`` (weight and
  bias), key head ``g`` rows ``[g d, (g+1) d)`` of ``k_proj``. With a ``q_norm`` (``k_norm``)
  after the projection (Qwen3), the logits do not depend on the projection's scale (an
  RMSNorm divides it out), so the norm's weight is the target instead: per head where it has
  ``H d`` entries, else (one head's ``d`` entries, shared by all heads) the layer factor.
* **Hugging Face multi-head latent attention** (DeepSeek-V3, Kimi K2's architecture): per head,
  ``q_proj`` / ``q_b_proj`` rows ``[q_C (nope), q_R (rope)]`` and ``kv_b_proj`` rows ``[k_C (nope),
  v]``; the shared rotary key (in ``kv_a_proj_with_mqa``) is not a target.
* **The demos' GPT** (``lightning_matrixfsdp.demos.gpt.CausalSelfAttention``, recognized by its
  class name, not imported): one fused ``qkv`` matrix, rows ``[q, k, v]``, heads of
  ``d_model / n_heads``, causal, softmax scale ``d ** -0.5``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import nn

from lightning_matrixfsdp.qkclip.rule import Kind, LayerHeads

__all__ = ["AttentionLayout", "QKClipError", "Target", "find_attention"]

#: the demos' GPT attention, by (module, qualified name): the library does not import the demos
DEMO_GPT_ATTENTION = ("lightning_matrixfsdp.demos.gpt", "CausalSelfAttention")

RowsOf = Callable[[nn.Parameter], int]


class QKClipError(ValueError):
    """A model, an option or a call QK-Clip cannot serve; the message names the cause and the fix."""


@dataclass
class Target:
    """One tensor QK-Clip rescales: ``getattr(module, attr)``, each whole row's (kind, index)."""

    module: nn.Module
    attr: str
    fqn: str
    kinds: list[tuple[Kind, int]]

    @property
    def param(self) -> nn.Parameter:
        return getattr(self.module, self.attr)


@dataclass
class AttentionLayout:
    """One attention layer: its heads, its targets, where its logits are read (``seam``:
    ``"interface"`` for Hugging Face's attention functions, ``"qkv"`` for a fused projection's
    output), and the tensor whose tensor-parallel fragment says which query heads a rank computes
    (``q_source``, ``rows_per_head`` rows each)."""

    fqn: str
    module: nn.Module
    heads: LayerHeads
    seam: str
    q_source: Target
    rows_per_head: int
    targets: list[Target] = field(default_factory=list)
    #: the softmax scale where the seam does not pass one (the fused projection)
    scale: Optional[float] = None


def _per_head(rows: int, period: int, parts: list[tuple[int, Kind]]) -> list[tuple[Kind, int]]:
    """Rows of ``rows // period`` heads, each ``period`` rows split into ``parts`` (size, kind)."""
    one: list[Kind] = [kind for size, kind in parts for _ in range(size)]
    return [(one[r % period], r // period) if one[r % period] != Kind.NONE else (Kind.NONE, 0) for r in range(rows)]


def _linear_targets(fqn: str, lin: nn.Module, kinds: list[tuple[Kind, int]]) -> list[Target]:
    out = [Target(lin, "weight", f"{fqn}.weight", kinds)]
    if getattr(lin, "bias", None) is not None:
        out.append(Target(lin, "bias", f"{fqn}.bias", kinds))
    return out


def _check_rows(target: Target, rows_of: RowsOf) -> Target:
    have = rows_of(target.param)
    if have != len(target.kinds):
        raise QKClipError(f"QK-Clip: {target.fqn} has {have} rows where the attention's heads need "
                          f"{len(target.kinds)}; this layout is not one QK-Clip knows")
    return target


def _norm_target(fqn: str, name: str, norm: nn.Module, d: int, heads: int, kind: Kind, rows_of: RowsOf) -> Target:
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, nn.Parameter):
        raise QKClipError(f"QK-Clip: {fqn}.{name} normalizes without a learnable weight, so the logits are "
                          f"bounded by the normalization and no weight can lower them; leave QK-Clip off for this model")
    n = rows_of(weight)
    if n == d:  # one head's size, read by every head: the layer's factor
        kinds = [(Kind.LAYER, 0)] * d
    elif n == heads * d:
        kinds = [(kind, r // d) for r in range(n)]
    else:
        raise QKClipError(f"QK-Clip: {fqn}.{name}.weight has {n} entries; expected {d} (one head) or {heads * d}")
    return Target(norm, "weight", f"{fqn}.{name}.weight", kinds)


def _hf_heads(m: nn.Module) -> tuple[int, int]:
    cfg = getattr(m, "config", None)
    h = getattr(cfg, "num_attention_heads", None) or getattr(m, "num_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or h
    if getattr(m, "num_key_value_groups", None) and h:
        kv = h // int(m.num_key_value_groups)
    if not h:
        raise QKClipError(f"QK-Clip: cannot read the number of heads of {type(m).__name__}")
    return int(h), int(kv)


def _hf_standard(fqn: str, m: nn.Module, rows_of: RowsOf) -> AttentionLayout:
    h, kv = _hf_heads(m)
    d = int(getattr(m, "head_dim", 0) or rows_of(m.q_proj.weight) // h)
    targets: list[Target] = []
    for side, proj, norm_name, n, kind in (("q", m.q_proj, "q_norm", h, Kind.Q), ("k", m.k_proj, "k_norm", kv, Kind.K)):
        norm = getattr(m, norm_name, None)
        if norm is not None:
            targets.append(_norm_target(fqn, norm_name, norm, d, n, kind, rows_of))
        else:
            targets += _linear_targets(f"{fqn}.{side}_proj", proj, [(kind, r // d) for r in range(n * d)])
    q_source = _check_rows(Target(m.q_proj, "weight", f"{fqn}.q_proj.weight", [(Kind.Q, r // d) for r in range(h * d)]),
                           rows_of)
    return AttentionLayout(fqn, m, LayerHeads(h, kv), "interface", q_source, d,
                           [_check_rows(t, rows_of) for t in targets])


def _hf_mla(fqn: str, m: nn.Module, rows_of: RowsOf) -> AttentionLayout:
    h = int(getattr(m, "num_heads", 0) or m.config.num_attention_heads)
    nope, rope, v = int(m.qk_nope_head_dim), int(m.qk_rope_head_dim), int(m.v_head_dim)
    qname = "q_proj" if getattr(m, "q_proj", None) is not None else "q_b_proj"
    q_kinds = _per_head(h * (nope + rope), nope + rope, [(nope, Kind.Q), (rope, Kind.QR)])
    kv_kinds = _per_head(h * (nope + v), nope + v, [(nope, Kind.K), (v, Kind.NONE)])
    targets = _linear_targets(f"{fqn}.{qname}", getattr(m, qname), q_kinds)
    targets += _linear_targets(f"{fqn}.kv_b_proj", m.kv_b_proj, kv_kinds)
    q_source = _check_rows(Target(getattr(m, qname), "weight", f"{fqn}.{qname}.weight", q_kinds), rows_of)
    return AttentionLayout(fqn, m, LayerHeads(h, h), "interface", q_source, nope + rope,
                           [_check_rows(t, rows_of) for t in targets])


def _fused_qkv(fqn: str, m: nn.Module, rows_of: RowsOf) -> AttentionLayout:
    h = int(m.n_heads)
    c = rows_of(m.qkv.weight) // 3
    d = c // h
    kinds = [(Kind.Q, r // d) for r in range(c)] + [(Kind.K, r // d) for r in range(c)] + [(Kind.NONE, 0)] * c
    targets = [_check_rows(t, rows_of) for t in _linear_targets(f"{fqn}.qkv", m.qkv, kinds)]
    return AttentionLayout(fqn, m, LayerHeads(h, h), "qkv", targets[0], 3 * c, targets, scale=d ** -0.5)


def _is_demo_gpt(m: nn.Module) -> bool:
    return any((c.__module__, c.__qualname__) == DEMO_GPT_ATTENTION for c in type(m).__mro__)


def _is_hf(m: nn.Module) -> bool:
    return type(m).__module__.startswith("transformers.")


def find_attention(model: nn.Module, rows_of: RowsOf) -> list[AttentionLayout]:
    """Every attention layer of ``model`` QK-Clip knows, in module order; refuses a model with none."""
    out: list[AttentionLayout] = []
    for fqn, m in model.named_modules():
        if _is_demo_gpt(m):
            out.append(_fused_qkv(fqn, m, rows_of))
        elif _is_hf(m) and hasattr(m, "kv_b_proj") and hasattr(m, "qk_nope_head_dim"):
            out.append(_hf_mla(fqn, m, rows_of))
        elif _is_hf(m) and all(hasattr(getattr(m, n, None), "weight") for n in ("q_proj", "k_proj")):
            out.append(_hf_standard(fqn, m, rows_of))
    if not out:
        raise QKClipError(
            f"QK-Clip found no attention layer it knows in {type(model).__name__}. It serves Hugging Face "
            "attention modules with q_proj/k_proj (Llama, Mistral, Mixtral, Qwen2/3, Qwen3-MoE, ...) or multi-head "
            "latent attention (DeepSeek-V3), and the demos' GPT (lightning_matrixfsdp.demos.gpt)")
    return out
