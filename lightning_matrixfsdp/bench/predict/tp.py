"""The predictor's tensor-parallel modes: data parallelism over ``D`` ranks times tensor
parallelism over ``T`` GPUs of one node (``world = D T``), for three Muon steps:

- ``matrix_fsdp_tp`` (ours): owner sharding over the DP group of the TP-local fragments,
  every fragment of a matrix on the same DP owner (planned from global shapes); the step
  gathers each owned matrix's ``T`` fragments to one TP rank of the owner's TP group
  (matrices balanced over the group by Newton-Schulz FLOPs), orthogonalizes it whole there
  and scatters the slices back. No DP bytes in the step; the DP collective of the passes
  is the one ``collective="auto"`` picks for the DP group.
- ``fsdp2_muon_tp``: FSDP2 over DP on TP fragments with ``torch.optim.Muon``: per matrix the
  DP shards of the fragments are all-gathered over TP (an exact step needs the whole
  matrix), then stock DTensor Newton-Schulz on the DP-sharded whole matrix as
  ``fsdp2_muon`` is modelled, run again by every TP rank.
- ``megatron_dup_tp``: Megatron-Core's ``duplicated`` TP mode on a ZeRO-1 DP layout
  (modelled as ``zero1_owner``): each matrix has one DP owner; its TP group all-gathers the
  fragments and every TP rank runs the whole Newton-Schulz; the owner broadcasts its
  updated fragment over DP.

By default the global batch is that of ``world`` GPUs with ``batch`` sequences each: a TP
group runs ``T batch`` sequences, so every GPU does the FLOPs of the non-TP modes, and
activations per GPU are those of ``batch`` sequences (sequence parallelism). With
``per_group`` a TP group runs ``batch`` sequences (global batch ``D batch``): each GPU does a
``T``-th of the FLOPs and holds a ``T``-th of the activations. Forward and backward add
the same TP activation collectives in all three modes (`tp_activation_seconds`), not
overlapped with compute. DP collectives run on `dp_view`: ``g/T`` DP ranks per node, ``T``
DP groups sharing the node's NICs. At ``T = 1`` every mode is its non-TP row
(``TP_BASE``) to the last digit (tests/test_predict.py checks it).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from lightning_matrixfsdp.runtime.placement import Plan, RoleKind, UnitLayout
from lightning_matrixfsdp.runtime.planner import newton_schulz_flops

from ..baselines import assign_owners
from .cluster import GIB, Cluster
from .modes import DDP_BUCKET, auto_mode, elementwise, passes, stock_matrix_work
from .shape import (
    ELEM,
    ModelShape,
    PredictError,
    activation_bytes,
    all_params,
    block_flops,
    plan_for,
    unit_specs,
)

__all__ = ["TP_BASE", "TP_MODES", "dp_view", "local_shape", "predict_tp", "predict_tp_mode", "tp_activation_seconds",
           "tp_markdown", "tp_strong_markdown"]

TP_MODES: tuple[str, ...] = ("matrix_fsdp_tp", "fsdp2_muon_tp", "megatron_dup_tp")
#: the non-TP mode each TP mode is at T = 1
TP_BASE = {"matrix_fsdp_tp": "matrix_fsdp_auto", "fsdp2_muon_tp": "fsdp2_muon", "megatron_dup_tp": "zero1_owner"}
#: Megatron-style plan: column-parallel (output rows split) and row-parallel (input columns split)
_COLWISE = ("attn.wq", "attn.wk", "attn.wv", "mlp.gate", "mlp.up", "embed", "head")
_ROWWISE = ("attn.wo", "mlp.down")


def _check(shape: ModelShape, c: Cluster, tp: int) -> None:
    if tp < 1 or c.gpus_per_node % tp:
        raise PredictError(f"tensor-parallel size T={tp} must divide the GPUs per node ({c.gpus_per_node}): "
                           f"the TP group is modelled inside one node")
    kv = shape.kv_heads or shape.heads
    if shape.heads % tp or kv % tp:
        raise PredictError(f"model {shape.name!r}: T={tp} must divide heads={shape.heads} and kv_heads={kv} "
                           f"(each TP rank holds whole heads)")


def local_shape(fqn: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape one TP rank holds: colwise tensors split on dim 0 (the vocabulary padded to a
    multiple of T), rowwise on dim 1, the rest (norm weights) replicated."""
    name = fqn.rsplit(".weight", 1)[0].split(".", 2)[-1] if fqn.startswith("blocks.") else fqn.split(".")[0]
    if name in _COLWISE:
        return (-(-shape[0] // tp),) + tuple(shape[1:])
    if name in _ROWWISE:
        return (shape[0], -(-shape[1] // tp))
    return tuple(shape)


@functools.lru_cache(maxsize=64)
def local_plan(shape: ModelShape, dp: int, tp: int, planner: str = "role_greedy") -> Plan:
    """The DP plan of the TP-local fragments: owners from the plan of the whole matrices over
    ``dp`` ranks (the same owner for all T fragments), shapes those of one TP rank."""
    plan = plan_for(shape, dp, planner)
    units = [UnitLayout(u.fqn, u.world, tuple(replace(s, shape=local_shape(s.fqn, s.shape, tp)) for s in u.shards))
             for u in plan.units]
    return replace(plan, units=units)


def dp_view(c: Cluster, tp: int) -> Cluster:
    """The cluster one DP group sees: ``g/T`` of its ranks per node, ``1/T`` of the node's NICs."""
    return c.with_(gpus_per_node=c.gpus_per_node // tp, inter_gbs=c.inter_gbs / tp)


def tp_activation_seconds(shape: ModelShape, c: Cluster, tp: int, per_group: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one block's TP activation collectives; the root unit has
    half as many. Sequence parallelism: per block an all-gather before and a reduce-scatter
    after attention and MLP, each of the TP group's activations (``T b s h``; ``b s h`` when
    ``batch`` counts per TP group); the backward mirrors them, and recomputes the forward's
    under activation checkpointing."""
    one = c.all_gather((1 if per_group else tp) * shape.batch * shape.seq_len * shape.hidden * ELEM, tp)
    return 4 * one, 4 * one * (2 if shape.ac else 1)


def _compute(shape: ModelShape, c: Cluster, tp: int, per_group: bool) -> tuple[list[float], list[float]]:
    """Per-unit forward and backward seconds of one GPU: the non-TP FLOPs (a ``T``-th of them
    when ``batch`` counts per TP group) plus the TP collectives."""
    rate = c.matmul_tflops * 1e12 * c.model_eff * (tp if per_group else 1)
    head = 2 * shape.batch * shape.seq_len * shape.vocab * shape.hidden
    fa, ba = tp_activation_seconds(shape, c, tp, per_group)
    units = unit_specs(shape)
    cf = [(block_flops(shape) if u.fqn else head) / rate for u in units]
    cb = [f * (3 if shape.ac and u.fqn else 2) for f, u in zip(cf, units)]
    cf = [f + (fa if u.fqn else fa / 2) for f, u in zip(cf, units)]
    cb = [b + (ba if u.fqn else fa / 2) for b, u in zip(cb, units)]  # the root is not recomputed
    return cf, cb


# ---------------------------------------------------------------- the optimizer steps
def _ours_step(plan: Plan, shape: ModelShape, c: Cluster, tp: int) -> tuple[float, float, float, float]:
    """(seconds, static bytes, temporary bytes, TP bytes of the busiest GPU) of ours: per DP owner,
    its matrices spread over its TP group by Newton-Schulz FLOPs (largest first, to the least
    loaded), each gathered whole there (the stepper receives ``(T-1)/T`` of it, every other
    rank sends its ``1/T``) and its slices scattered back the same way."""
    ns_rate = c.matmul_tflops * 1e12 * c.ns_eff_ours
    whole = {s.fqn: s for s in plan_for(shape, plan.world).shards()}
    compute, link, static, temp, moved = 0.0, 0.0, 0.0, 0.0, 0.0
    for r in range(plan.world):
        mats = [s for s in plan.shards() if s.owner == r and s.role is RoleKind.MATRIX]
        flops = [newton_schulz_flops(whole[s.fqn].shape, shape.ns_steps) for s in mats]
        stepper = assign_owners(flops, tp, "greedy")
        held = sum(2 * s.nbytes for s in plan.shards() if s.owner == r)
        adam = sum(s.numel for s in plan.shards() if s.owner == r and s.role is not RoleKind.MATRIX)
        tails = sum(2 * s.nbytes for s in plan.shards() if s.owner == r and s.role is not RoleKind.MATRIX)
        for t in range(tp):
            mine = [i for i, st in enumerate(stepper) if st == t]
            f = sum(flops[i] for i in mine)
            mat = sum(whole[mats[i].fqn].numel for i in mine)
            compute = max(compute, f / ns_rate + elementwise(c, mat, adam))
            recv = sum(whole[mats[i].fqn].nbytes - mats[i].nbytes for i in mine)
            sent = sum(mats[i].nbytes for i, st in enumerate(stepper) if st != t)
            moved = max(moved, 2 * (recv + sent))
            phase = max(recv, sent) / (c.intra_gbs * 1e9) + len(mats) * c.latency(tp)
            link = max(link, 2 * phase)  # the gather, then the scatter back
            static = max(static, held + tails + sum(whole[mats[i].fqn].nbytes for i in mine))
            if tp > 1 and mine:
                temp = max(temp, 2 * max(whole[mats[i].fqn].nbytes for i in mine))  # gathered gradient, update
    return compute + link, static, temp, moved


def _stock_step(plan: Plan, shape: ModelShape, c: Cluster, dp_c: Cluster, tp: int) -> tuple[float, float, float]:
    """(seconds, static bytes, temporary bytes) of FSDP2 + TP with torch.optim.Muon."""
    n, local = plan.world, {s.fqn: s for s in plan.shards()}
    params = all_params(shape)  # the non-TP model's order, so that T = 1 sums alike
    m_elems = sum(local[p.fqn].numel for p in params if p.is_matrix)
    rest = sum(local[p.fqn].numel for p in params) - m_elems
    ns_rate = c.matmul_tflops * 1e12 * c.ns_eff_stock
    opt = elementwise(c, m_elems / n, rest / n)
    whole = [p for p in params if p.is_matrix]
    for p in whole:
        f, colls = stock_matrix_work(p.shape, shape.ns_steps, n)
        opt += f / ns_rate + sum(getattr(dp_c, k)(b, n) + c.dispatch_us * 1e-6 for k, b in colls)
        if tp > 1:  # the DP shards of the T fragments, gathered into a DP shard of the whole matrix
            opt += c.all_gather(p.nbytes / n, tp) + c.dispatch_us * 1e-6
    temp = 2 * max(p.nbytes for p in whole) / n if tp > 1 else 0.0
    return opt, (3 * m_elems + 4 * rest) * ELEM / n, temp


def _duplicated(plan: Plan, shape: ModelShape, c: Cluster, dp_c: Cluster, tp: int, cf: list[float],
                cb: list[float]) -> tuple[float, float, float, float, float]:
    """(fwd, bwd, opt, static, temp) of Megatron-style duplicated TP on ZeRO-1 (as ``_replicated``):
    fragments replicated over DP, their gradients all-reduced there under the backward."""
    n, local = plan.world, {s.fqn: s for s in plan.shards()}
    params = all_params(shape)  # the non-TP model's order, so that T = 1 assigns and sums alike
    frag = [local[p.fqn] for p in params]
    p_bytes = sum(s.nbytes for s in frag)
    bwd = max(sum(cb), dp_c.all_reduce(p_bytes, n)) + dp_c.all_reduce(min(DDP_BUCKET, p_bytes), n)
    owners = assign_owners([s.nbytes for s in frag], n, "greedy")
    per = [[0.0, 0, 0, 0.0] for _ in range(n)]  # NS FLOPs, matrix and AdamW elements, TP all-gathers
    for p, s, o in zip(params, frag, owners):
        if p.is_matrix:
            per[o][0] += newton_schulz_flops(p.shape, shape.ns_steps)
            per[o][1] += s.numel
            per[o][3] += c.all_gather(p.nbytes, tp)
        else:
            per[o][2] += s.numel
    ns_rate = c.matmul_tflops * 1e12 * c.ns_eff_stock
    opt = max(f / ns_rate + elementwise(c, mat, adam) + g for f, mat, adam, g in per)
    opt += sum(dp_c.broadcast(s.nbytes, n) for s in frag)  # each updated fragment from its DP owner
    static = 2 * p_bytes + max((mat + 2 * adam) * ELEM for _, mat, adam, _ in per)
    temp = 3 * max(p.nbytes for p in params if p.is_matrix) if tp > 1 else 0.0  # gathered matrix, NS workspace
    return sum(cf), bwd, opt, static, temp


# ---------------------------------------------------------------- rows
def predict_tp_mode(mode: str, shape: ModelShape, c: Cluster, tp: int = 1, planner: str = "role_greedy",
                    per_group: bool = False) -> dict[str, Any]:
    """One row: fwd/bwd/opt/total ms and peak GiB of the busiest GPU for a TP mode on ``c``;
    ``batch`` sequences per GPU (global batch ``world batch``), or with ``per_group`` per TP
    group (global batch ``D batch``: TP adds GPUs to the same batch)."""
    if mode not in TP_MODES:
        raise PredictError(f"unknown TP mode {mode!r}; known: {', '.join(TP_MODES)}")
    _check(shape, c, tp)
    dp, dp_c = c.world // tp, dp_view(c, tp)
    plan = local_plan(shape, dp, tp, planner)
    cf, cb = _compute(shape, c, tp, per_group)
    row: dict[str, Any] = {"mode": mode, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "world": c.world,
                           "tp": tp, "dp": dp, "global_batch": (dp if per_group else c.world) * shape.batch, "span": dp, "replicas": 1, "max_gamma": round(plan.max_gamma, 3)}
    temp, buffers = 0.0, 2 * max(u.nbytes for u in plan.units) if dp > 1 else 0.0
    if mode == "megatron_dup_tp":
        fwd, bwd, opt, static, temp = _duplicated(plan, shape, c, dp_c, tp, cf, cb)
        buffers = 0.0
    elif mode == "fsdp2_muon_tp":
        fwd, bwd = passes("fsdp2_muon", plan, shape, dp_c, cf, cb, 1)
        opt, static, temp = _stock_step(plan, shape, c, dp_c, tp)
    else:
        chosen, _ = auto_mode("matrix_fsdp_auto", dp_c)
        fwd, bwd = passes(chosen, plan, shape, dp_c, cf, cb, 1)
        opt, static, temp, moved = _ours_step(plan, shape, c, tp)
        row.update(chosen=chosen, step_tp_bytes=moved, step_dp_bytes=0)
    acts = activation_bytes(shape) / (tp if per_group else 1)  # sequence parallel: a T-th of the group's
    peak = static + max(acts + buffers, temp)
    row.update(fwd_ms=fwd * 1e3, bwd_ms=bwd * 1e3, opt_ms=opt * 1e3, total_ms=(fwd + bwd + opt) * 1e3,
               peak_gib=peak / GIB)
    row["fits"] = row["peak_gib"] <= c.gpu_mem_gib
    return row


def predict_tp(shape: ModelShape, base: Cluster, nodes: list[int], modes: list[str] | tuple[str, ...] = TP_MODES,
               tps: list[int] | tuple[int, ...] = (1,), planner: str = "role_greedy",
               per_group: bool = False) -> list[dict[str, Any]]:
    """One row per (T, nodes, mode)."""
    for m in modes:
        if m not in TP_MODES:
            raise PredictError(f"unknown TP mode {m!r}; known: {', '.join(TP_MODES)}")
    for t in tps:
        _check(shape, base, t)
    return [predict_tp_mode(m, shape, base.with_(nodes=k), t, planner, per_group) for t in tps for k in nodes
            for m in modes]


def tp_markdown(rows: list[dict[str, Any]]) -> str:
    """Per (mode, T) a line, per node count a cell: total ms (optimizer-step ms) peak GiB."""
    nodes = sorted({r["nodes"] for r in rows})
    head = ["| mode | T | " + " | ".join(f"{n} node{'s' if n > 1 else ''}" for n in nodes) + " |",
            "| --- | ---: | " + " | ".join("---:" for _ in nodes) + " |"]
    cells: dict[tuple[str, int], dict[int, str]] = {}
    for r in rows:
        fit = "" if r["fits"] else " no fit"
        cells.setdefault((r["mode"], r["tp"]), {})[r["nodes"]] = \
            f"{r['total_ms']:.0f} ({r['opt_ms']:.0f}) {r['peak_gib']:.1f}{fit}"
    order = sorted(cells, key=lambda k: (TP_MODES.index(k[0]), k[1]))
    return "\n".join(head + [f"| {m} | {t} | " + " | ".join(cells[(m, t)].get(n, "") for n in nodes) + " |"
                             for m, t in order])


def tp_strong_markdown(rows: list[dict[str, Any]]) -> str:
    """Rows of one global batch at several (T, nodes): per mode a line, per (T, nodes) a cell."""
    cols = sorted({(r["tp"], r["nodes"]) for r in rows})
    head = ["| mode | " + " | ".join(f"T={t}, {n} node{'s' if n > 1 else ''}" for t, n in cols) + " |",
            "| --- | " + " | ".join("---:" for _ in cols) + " |"]
    cells: dict[str, dict[tuple[int, int], str]] = {}
    for r in rows:
        fit = "" if r["fits"] else " no fit"
        cells.setdefault(r["mode"], {})[(r["tp"], r["nodes"])] = \
            f"{r['total_ms']:.0f} ({r['opt_ms']:.0f}) {r['peak_gib']:.1f}{fit}"
    return "\n".join(head + [f"| {m} | " + " | ".join(cells[m].get(k, "") for k in cols) + " |"
                             for m in TP_MODES if m in cells])
