"""Analytic step-time and memory model of every benchmark mode (`python -m lightning_matrixfsdp.bench predict`).

From a model shape, the plan of the real planner (`runtime.planner.make_plan`, and
`runtime.replicas.assign_steppers` for ``replica_split``) and a `Cluster`, it predicts
forward, backward and optimizer-step milliseconds and the peak memory of the busiest
rank for one training step (batch ``batch`` sequences per rank). The formulas
(docs/benchmarks.md, "Predicted step times", explains them and what they leave out):

- compute: forward FLOPs ``L (2 T M_block + 2 b s^2 h) + 2 T V h`` (``T = b s`` tokens,
  ``M_block`` the block's matrix parameters, causal attention counted at half); backward
  twice that, plus one more forward of the blocks under activation checkpointing; run at
  ``matmul_tflops * model_eff``.
- per unit, compute and the unit's collectives overlap: a unit costs
  ``max(compute, intra-node link time, inter-node link time)``; the first
  materialization of the forward and the last reduction of the backward are exposed.
- optimizer: Newton-Schulz FLOPs (`newton_schulz_flops`) of the busiest rank at
  ``matmul_tflops * ns_eff``, elementwise work at HBM bandwidth, and the mode's own
  optimizer-step collectives (stock Muon's DTensor collectives, measured op by op; the
  gather-once all-gathers; ZeRO-1's parameter broadcasts), not overlapped.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_matrixfsdp.runtime.placement import ParamSpec, Plan, RoleKind, UnitLayout, UnitSpec
from lightning_matrixfsdp.runtime.planner import make_plan, newton_schulz_flops
from lightning_matrixfsdp.runtime.replica_comm import CHUNK_BYTES, chain_end
from lightning_matrixfsdp.runtime.replicas import assign_steppers

from .baselines import assign_owners
from .cluster import GIB, Cluster

MODES: tuple[str, ...] = (
    "fsdp2_adamw", "fsdp2_muon", "fsdp2_gather_once", "zero1_owner", "ddp_muon",
    "matrix_fsdp", "matrix_fsdp_broadcast", "matrix_fsdp_hsdp", "matrix_fsdp_hsdp_split",
)
HSDP_MODES = ("matrix_fsdp_hsdp", "matrix_fsdp_hsdp_split")
ELEM = 2  # bf16 weights, gradients and optimizer state in every mode
DDP_BUCKET = 25 * 2**20


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


def stock_matrix_work(shape: tuple[int, ...], steps: int, span: int) -> tuple[float, list[tuple[str, int]]]:
    """(local FLOPs, collectives) of torch.optim.Muon's Newton-Schulz on one FSDP2 ``Shard(0)``
    DTensor, as DTensor runs it (recorded op by op on torch 2.13): a matrix with rows <= cols
    all-gathers X, X X^T and X again per iteration and computes 1/W of every product; a tall one
    is transposed (sharded on the contracted dimension): two all-reduces of the m x m Gram
    matrix per iteration, and ``B = bA + cAA`` is computed whole on every rank."""
    m, n = sorted(shape)
    if span <= 1:
        return float(newton_schulz_flops(shape, steps)), []
    colls: list[tuple[str, int]] = [("all_reduce", 4)]  # the norm
    if shape[0] <= shape[1]:
        per = [("all_gather", m * n * ELEM), ("all_gather", m * m * ELEM), ("all_gather", m * n * ELEM)]
        flops = steps * (4 * m * m * n + 2 * m ** 3) / span
    else:
        per = [("all_reduce", m * m * ELEM)] * 2
        flops = steps * (4 * m * m * n / span + 2 * m ** 3)
    return flops, colls + per * steps


def stock_collectives(shape: ModelShape, span: int) -> int:
    return sum(len(stock_matrix_work(p.shape, shape.ns_steps, span)[1]) for p in all_params(shape) if p.is_matrix)


# ---------------------------------------------------------------- communication per unit
def _p2p(layout: UnitLayout, c: Cluster) -> tuple[float, float]:
    """(intra, inter) seconds of an owner fanout (or the mirrored reduction to owners): every
    owner sends its segment to each peer, so a node's NICs carry each off-node byte once per
    receiving GPU (no ring to share it); NCCL may route through any of the node's NICs."""
    w, g = layout.world, min(c.gpus_per_node, layout.world)
    owned = [layout.owned_bytes(r) for r in range(w)]
    node_sum = [sum(owned[n * g:(n + 1) * g]) for n in range(-(-w // g))]
    intra = max(max(o * (g - 1), node_sum[r // g] - o) for r, o in enumerate(owned)) / (c.intra_gbs * 1e9)
    inter = 0.0
    if w > g:
        total = sum(owned)
        inter = max(max(s * (w - g), g * (total - s)) for s in node_sum)
        inter = inter / (c.inter_gbs * 1e9) + c.latency(w) - c.latency(g)
    return intra + c.latency(g), inter


def _roles(layout: UnitLayout) -> list[int]:
    """Bytes of each role as the runtime moves it: one per 2D+ tensor, one packed tail per owner."""
    sizes = [s.nbytes for s in layout.shards if len(s.shape) >= 2]
    tails: dict[int, int] = {}
    for s in layout.shards:
        if len(s.shape) < 2:
            tails[s.owner] = tails.get(s.owner, 0) + s.nbytes
    return sizes + list(tails.values())


def _split(c: Cluster, seconds: float, span: int) -> tuple[float, float]:
    return (seconds, 0.0) if span <= c.gpus_per_node else (0.0, seconds)


def unit_comm(mode: str, layout: UnitLayout, c: Cluster) -> tuple[float, float]:
    """(intra, inter) seconds of one materialization (= one reduction) of a unit."""
    span = layout.world
    if span <= 1:
        return 0.0, 0.0
    if mode.startswith("fsdp2"):
        return _split(c, c.all_gather(layout.nbytes, span), span)
    if mode == "matrix_fsdp_broadcast":
        return _split(c, sum(c.broadcast(b, span) for b in _roles(layout)), span)
    return _p2p(layout, c)


def pipeline(compute: list[float], mat: list[float], red: list[float], ready: list[float] | None = None,
             rep: list[list[float]] | None = None) -> float:
    """Seconds of one pass over units in order, FSDP-style: unit k+1's materialization
    (``mat``) is issued when unit k starts computing and not before ``ready[k+1]``; unit k
    computes once its own has arrived; its reduction (``red``) follows its compute on the
    same link; under HSDP each shard rank then runs its replica collective (``rep[k][r]``)
    on its own stream, in unit order. The pass ends when compute, link and streams are idle."""
    n = len(compute)
    ready = ready or [0.0] * n
    link = ready[0] + mat[0]
    arrived = [link] + [0.0] * (n - 1)
    comp = 0.0
    streams = [0.0] * len(rep[0]) if rep else []
    for k in range(n):
        start = max(comp, arrived[k])
        if k + 1 < n:
            link = max(link, start, ready[k + 1]) + mat[k + 1]
            arrived[k + 1] = link
        comp = start + compute[k]
        if red[k]:
            link = max(link, comp) + red[k]
        if rep:
            streams = [max(t, link) + x for t, x in zip(streams, rep[k])]
    return max([comp, link] + streams)


# ---------------------------------------------------------------- the modes
def _spans(mode: str, c: Cluster, shard_size: int | None) -> tuple[int, int]:
    if mode not in MODES:
        raise PredictError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if mode not in HSDP_MODES:
        return c.world, 1
    w = shard_size or c.gpus_per_node
    if w < 1 or c.world % w:
        raise PredictError(f"shard size W={w} does not divide the world size {c.world} "
                           f"({c.nodes} nodes x {c.gpus_per_node} GPUs)")
    return w, c.world // w


def _owner_work(plan: Plan, units: tuple[UnitSpec, ...], shape: ModelShape, replicas: int,
                split: bool) -> list[tuple[float, int, int, int, int]]:
    """Per (replica, shard rank) stepping the optimizer: (NS FLOPs, matrix elements, AdamW
    elements, parameter bytes held, optimizer-state bytes held)."""
    steppers = assign_steppers(plan, units, replicas, shape.ns_steps)[0] if split else {}
    out = []
    for k in range(replicas if split else 1):
        for r in range(plan.world):
            f = mat = adam = held = state = 0
            for s in plan.shards():
                if s.owner != r:
                    continue
                held += 2 * s.nbytes  # weight and gradient
                if steppers.get(s.fqn, k) != k:
                    continue
                if s.role is RoleKind.MATRIX:
                    f, mat, state = f + newton_schulz_flops(s.shape, shape.ns_steps), mat + s.numel, state + s.nbytes
                else:
                    adam, state = adam + s.numel, state + 2 * s.nbytes
            out.append((f, mat, adam, held, state))
    return out


def _elementwise(c: Cluster, matrix_elems: float, adamw_elems: float) -> float:
    """Seconds of the optimizer's elementwise work (momentum, AdamW) at HBM bandwidth."""
    return (matrix_elems * c.muon_bpp + adamw_elems * c.adamw_bpp) / (c.hbm_gbs * 1e9)


def _replicated(mode: str, shape: ModelShape, c: Cluster, cf: list[float],
                cb: list[float]) -> tuple[float, float, float, float, float]:
    """(fwd, bwd, opt, static bytes, temporary bytes) of DDP Muon and ZeRO-1 owner placement:
    full replicas, the gradient all-reduce overlapping the whole backward."""
    n, params = c.world, all_params(shape)
    p_bytes = sum(p.nbytes for p in params)
    ns_stock = c.matmul_tflops * 1e12 * c.ns_eff_stock
    bwd = max(sum(cb), c.all_reduce(p_bytes, n)) + c.all_reduce(min(DDP_BUCKET, p_bytes), n)
    owners = assign_owners([p.nbytes for p in params], n, "greedy") if mode == "zero1_owner" else [0] * len(params)
    per = [[0.0, 0, 0] for _ in range(n)]  # NS FLOPs, matrix elements, AdamW elements stepped by each rank
    for p, o in zip(params, owners):
        if p.is_matrix:
            per[o][0] += newton_schulz_flops(p.shape, shape.ns_steps)
            per[o][1] += p.numel
        else:
            per[o][2] += p.numel
    opt = max(f / ns_stock + _elementwise(c, mat, adam) for f, mat, adam in per)
    if mode == "zero1_owner":
        opt += sum(c.broadcast(p.nbytes, n) for p in params)  # each parameter from its owner
    static = 2 * p_bytes + max((mat + 2 * adam) * ELEM for _, mat, adam in per)
    return sum(cf), bwd, opt, static, 0.0


def _passes(mode: str, plan: Plan, shape: ModelShape, c: Cluster, cf: list[float], cb: list[float],
            replicas: int) -> tuple[float, float]:
    """(fwd, bwd) seconds of a sharded mode: `pipeline` over the plan's units."""
    units, span = unit_specs(shape), plan.world
    split = mode == "matrix_fsdp_hsdp_split"
    unit_link = [max(unit_comm(mode, lay, c)) for lay in plan.units]
    busiest = [lay.nbytes if mode.startswith("fsdp2") else max(lay.owned_bytes(r) for r in range(span))
               for lay in plan.units]
    copy = [2 * b / (c.hbm_gbs * 1e9) if span > 1 else 0.0 for b in busiest]  # materialized bytes copied once
    ready = [0.0] * len(units)
    if split:
        rep, back = _split_exchange(plan, shape, c, replicas)
        sent = [0.0] * len(back[0])  # the updated weights go back from the end of the step, unit by unit
        for u in range(len(units)):
            sent = [t + x for t, x in zip(sent, back[u])]
            ready[u] = max(sent)
    else:
        rep = [[c.replica_all_reduce(lay.owned_bytes(r), replicas) for r in range(span)] for lay in plan.units]
    fwd = pipeline([x + y for x, y in zip(cf, copy)], unit_link, [0.0] * len(units), ready)
    order = list(range(len(units)))[::-1]  # blocks last to first, then the root (embedding last)
    bwd = pipeline([cb[u] + (copy[u] if units[u].fqn else 0.0) for u in order],
                   [unit_link[u] if units[u].fqn else 0.0 for u in order], [unit_link[u] for u in order],
                   rep=[rep[u] for u in order] if replicas > 1 else None)
    return fwd, bwd


def _split_exchange(plan: Plan, shape: ModelShape, c: Cluster, replicas: int
                    ) -> tuple[list[list[float]], list[list[float]]]:
    """Seconds per unit and per GPU (replica k, shard rank r) of ``replica_split``'s exchange
    (runtime/replica_comm.py): the backward's reduction chain and the broadcast of the updated
    weights after the step. The chain runs in replica order ``0 -> ... -> m`` (``chain_end``), in
    chunks of ``CHUNK_BYTES``: a GPU sends every role once except where it steps the role and the
    chain ends there, receives it on replicas ``1 .. m``, and the stepper receives one more copy (the
    final sum or the last replica's part) where the chain does not end on it. The broadcast moves
    each byte of the GPU's owned roles once through its share of the NICs."""
    steppers = assign_steppers(plan, list(unit_specs(shape)), replicas, shape.ns_steps)[0]
    reduce, back = [], []
    for lay in plan.units:
        row_r, row_b = [], []
        for k in range(replicas):
            for r in range(plan.world):
                roles = [(s.nbytes, steppers[s.fqn]) for s in lay.shards if s.owner == r]
                total = sum(b for b, _ in roles)
                sent = recv = 0
                for b, st in roles:
                    m = chain_end(st, replicas)
                    sent += 0 if k == st == m else b
                    recv += b * ((1 <= k <= m) + (k == st and m != st) + (k == st and m < replicas - 1))
                chunks = sum(-(-b // CHUNK_BYTES) for b, _ in roles)
                row_r.append(c.replica_chain(recv, sent, replicas, min(CHUNK_BYTES, total), chunks) if total else 0.0)
                row_b.append(c.replica_broadcast(total, replicas) if total else 0.0)
        reduce.append(row_r)
        back.append(row_b)
    return reduce, back


def _step(mode: str, plan: Plan, shape: ModelShape, c: Cluster, replicas: int) -> tuple[float, float, float]:
    """(opt seconds, static bytes, temporary bytes) of a sharded mode's busiest rank."""
    n, params = plan.world, all_params(shape)
    p_bytes = sum(p.nbytes for p in params)
    m_elems = sum(p.numel for p in params if p.is_matrix)
    rest_elems = sum(p.numel for p in params) - m_elems
    ns_stock = c.matmul_tflops * 1e12 * c.ns_eff_stock
    if mode == "fsdp2_adamw":
        return _elementwise(c, 0, (m_elems + rest_elems) / n), 4 * p_bytes / n, p_bytes / n  # foreach temporary
    if mode.startswith("fsdp2"):
        opt = _elementwise(c, m_elems / n, rest_elems / n)
        static, temp = (3 * m_elems + 4 * rest_elems) * ELEM / n, 0.0
        mats = [p.shape for p in params if p.is_matrix]
        if mode == "fsdp2_muon":
            for s in mats:
                f, colls = stock_matrix_work(s, shape.ns_steps, n)
                opt += f / ns_stock + sum(getattr(c, k)(b, n) + c.dispatch_us * 1e-6 for k, b in colls)
        else:  # gather-once: one all-gather per matrix, every Newton-Schulz on every rank
            opt += sum(c.all_gather(s[0] * s[1] * ELEM, n) + c.dispatch_us * 1e-6 for s in mats)
            opt += sum(newton_schulz_flops(s, shape.ns_steps) for s in mats) / ns_stock
            temp = 3 * max(s[0] * s[1] for s in mats) * ELEM
        return opt, static, temp
    work = _owner_work(plan, unit_specs(shape), shape, replicas, mode == "matrix_fsdp_hsdp_split")
    ns_ours = c.matmul_tflops * 1e12 * c.ns_eff_ours
    opt = max(f / ns_ours + _elementwise(c, mat, adam) for f, mat, adam, _, _ in work)
    return opt, max(held + state for _, _, _, held, state in work), 0.0


def predict_mode(mode: str, shape: ModelShape, c: Cluster, shard_size: int | None = None,
                 planner: str = "role_greedy") -> dict[str, Any]:
    """One row: fwd/bwd/opt/total ms and peak GiB of the busiest rank for ``mode`` on ``c``."""
    span, replicas = _spans(mode, c, shard_size)
    units = unit_specs(shape)
    rate = c.matmul_tflops * 1e12 * c.model_eff
    head = 2 * shape.batch * shape.seq_len * shape.vocab * shape.hidden
    cf = [(block_flops(shape) if u.fqn else head) / rate for u in units]
    cb = [f * (3 if shape.ac and u.fqn else 2) for f, u in zip(cf, units)]
    row: dict[str, Any] = {"mode": mode, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "world": c.world,
                           "span": span, "replicas": replicas}
    if mode in ("zero1_owner", "ddp_muon"):
        fwd, bwd, opt, static, temp = _replicated(mode, shape, c, cf, cb)
        buffers = 0.0
    else:
        plan = plan_for(shape, span, planner)
        fwd, bwd = _passes(mode, plan, shape, c, cf, cb, replicas)
        opt, static, temp = _step(mode, plan, shape, c, replicas)
        buffers = 2 * max(sum(p.nbytes for p in u.params) for u in units) if span > 1 else 0.0
        row["max_gamma"] = round(plan.max_gamma, 3)
    peak = static + max(activation_bytes(shape) + buffers, temp)
    row.update(fwd_ms=fwd * 1e3, bwd_ms=bwd * 1e3, opt_ms=opt * 1e3, total_ms=(fwd + bwd + opt) * 1e3,
               peak_gib=peak / GIB)
    row["fits"] = row["peak_gib"] <= c.gpu_mem_gib
    return row


def predict(shape: ModelShape, base: Cluster, nodes: list[int], modes: list[str] | tuple[str, ...] = MODES,
            shard_size: int | None = None, layers_per_node: int | None = None,
            planner: str = "role_greedy") -> list[dict[str, Any]]:
    """One row per (mode, nodes); ``layers_per_node`` scales depth with the node count (weak scaling)."""
    for m in modes:
        _spans(m, base, shard_size)  # unknown modes fail before any work
    rows = []
    for k in nodes:
        c = base.with_(nodes=k)
        s = replace(shape, layers=layers_per_node * k) if layers_per_node else shape
        for m in modes:
            rows.append({**predict_mode(m, s, c, shard_size, planner), "layers": s.layers,
                         "parameters": sum(p.numel for p in all_params(s))})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    head = ("| mode | nodes | GPUs | span x replicas | layers | fwd ms | bwd ms | opt ms | total ms | peak GiB "
            "| fits |\n| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['nodes']} | {r['world']} | {r['span']} x {r['replicas']} | {r['layers']} | "
                     f"{r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} | {r['opt_ms']:.1f} | {r['total_ms']:.1f} | "
                     f"{r['peak_gib']:.2f} | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)
