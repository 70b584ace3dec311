"""The predictor's workload: a decoder's shape, its parameters as the planner sees them,
its FLOPs per pass and its activation memory (formulas: :mod:`.predict`'s docstring)."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from lightning_matrixfsdp.runtime.placement import ParamSpec, Plan, UnitSpec
from lightning_matrixfsdp.runtime.planner import make_plan

__all__ = ["ELEM", "SHAPES", "ModelShape", "PredictError", "activation_bytes", "all_params", "backward_flops",
           "block_flops", "forward_flops", "plan_for", "shape_from_bench_config", "unit_specs"]

ELEM = 2  # bf16 weights, gradients and optimizer state in every mode


class PredictError(ValueError):
    """A prediction that cannot be made: unknown mode, bad shape, span not dividing the world."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder: ``layers`` blocks (attention q/k/v/o, MLP gate/up/down or up/down) plus an
    untied embedding and head of ``vocab`` rows (``vocab=0``: blocks only)."""

    name: str
    hidden: int
    mlp: int
    layers: int
    heads: int
    seq_len: int
    vocab: int
    kv_heads: int | None = None
    batch: int = 1
    gated: bool = True
    ac: bool = True
    ns_steps: int = 5

    def __post_init__(self) -> None:
        for key in ("hidden", "mlp", "layers", "heads", "seq_len", "batch", "ns_steps"):
            if int(getattr(self, key)) < 1:
                raise PredictError(f"model {self.name!r}: {key} must be >= 1, got {getattr(self, key)}")
        if self.vocab < 0:
            raise PredictError(f"model {self.name!r}: vocab must be >= 0, got {self.vocab}")
        if self.hidden % self.heads:
            raise PredictError(f"model {self.name!r}: hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise PredictError(f"model {self.name!r}: kv_heads={self.kv_heads} must divide heads={self.heads}")

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * (self.kv_heads or self.heads)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SHAPES: dict[str, ModelShape] = {
    # The measured 4.56B model of docs/benchmarks.md (bench preset onenode).
    "onenode": ModelShape("onenode", 4096, 16384, 16, 32, 4096, 32000),
    # The MatrixFSDP paper's weak-scaling block (Table 3): 16 layers per node; its parameter
    # counts (3.2B per 16 layers) are blocks of 4h^2 + 2hf, so no gate and no vocabulary.
    "paper": ModelShape("paper", 4096, 16384, 16, 32, 4096, 0, gated=False, ns_steps=2),
    "7b": ModelShape("7b", 4096, 11008, 32, 32, 4096, 32000),
    "32b": ModelShape("32b", 5120, 27648, 64, 40, 4096, 152064, kv_heads=8),
}


def shape_from_bench_config(cfg: dict[str, Any]) -> ModelShape:
    """The shape of a bench run from its JSON ``config`` (bench/config.py's fields)."""
    m, o, r = cfg["model"], cfg["optim"], cfg["run"]
    return ModelShape(cfg.get("preset", "bench"), m["hidden"], m["mlp_hidden"], m["n_layers"], m["n_heads"],
                      m["seq_len"], m["vocab_size"], batch=r["batch_size"], ac=m["activation_checkpointing"],
                      ns_steps=o["ns_steps"])


# ---------------------------------------------------------------- parameters, plan, FLOPs
@functools.lru_cache(maxsize=64)
def unit_specs(shape: ModelShape) -> tuple[UnitSpec, ...]:
    """The bench decoder's units (root first, then one per block) with the bench's matrix rule."""
    h, f, kv, dt = shape.hidden, shape.mlp, shape.kv_dim, "bfloat16"
    units = []
    if shape.vocab:
        units.append(UnitSpec("", (ParamSpec("embed.weight", (shape.vocab, h), dt, False),
                                   ParamSpec("norm.weight", (h,), dt, False),
                                   ParamSpec("head.weight", (shape.vocab, h), dt, False))))
    for i in range(shape.layers):
        p = f"blocks.{i}."
        mats = [("attn.wq", (h, h)), ("attn.wk", (kv, h)), ("attn.wv", (kv, h)), ("attn.wo", (h, h))]
        mats += ([("mlp.gate", (f, h))] if shape.gated else []) + [("mlp.up", (f, h)), ("mlp.down", (h, f))]
        params = [ParamSpec(p + "attn_norm.weight", (h,), dt, False)]
        params += [ParamSpec(p + n + ".weight", s, dt, True) for n, s in mats[:4]]
        params += [ParamSpec(p + "mlp_norm.weight", (h,), dt, False)]
        params += [ParamSpec(p + n + ".weight", s, dt, True) for n, s in mats[4:]]
        units.append(UnitSpec(f"blocks.{i}", tuple(params)))
    return tuple(units)


def all_params(shape: ModelShape) -> list[ParamSpec]:
    return [p for u in unit_specs(shape) for p in u.params]


@functools.lru_cache(maxsize=64)
def plan_for(shape: ModelShape, span: int, planner: str = "role_greedy") -> Plan:
    return make_plan(list(unit_specs(shape)), span, planner, ns_steps=shape.ns_steps)


def block_flops(shape: ModelShape) -> float:
    """Forward FLOPs of one block: its matmuls plus causal attention (half of QK^T and AV)."""
    tokens = shape.batch * shape.seq_len
    mats = sum(p.numel for p in unit_specs(shape)[-1].params if p.is_matrix)
    return 2 * tokens * mats + 2 * shape.batch * shape.seq_len ** 2 * shape.hidden


def forward_flops(shape: ModelShape) -> float:
    return shape.layers * block_flops(shape) + 2 * shape.batch * shape.seq_len * shape.vocab * shape.hidden


def backward_flops(shape: ModelShape) -> float:
    """Twice the forward, plus the blocks' recomputation under activation checkpointing."""
    return 2 * forward_flops(shape) + (shape.layers * block_flops(shape) if shape.ac else 0)


def activation_bytes(shape: ModelShape) -> float:
    """Saved and working activations: checkpoints of every block, one block's working set
    (h-sized tensors: ~10, f-sized: 4 gated / 2 plain), bf16 logits with float32 loss and grad."""
    bs, h = shape.batch * shape.seq_len, shape.hidden
    work = bs * (10 * h + (4 if shape.gated else 2) * shape.mlp) * ELEM
    saved = shape.layers * (bs * h * ELEM if shape.ac else work)
    return saved + (work if shape.ac else 0) + bs * shape.vocab * (ELEM + 8)
