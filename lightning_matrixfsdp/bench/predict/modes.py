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

This module is the modes; the workload (shape, parameters, FLOPs, activations) is
:mod:`.shape`, the per-unit communication and the overlap of a pass
:mod:`.comm`, the command line and calibration :mod:`.cli`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_matrixfsdp.runtime.placement import Plan, RoleKind, UnitSpec
from lightning_matrixfsdp.runtime.planner import newton_schulz_flops
from lightning_matrixfsdp.runtime.replicas.assign import assign_steppers
from lightning_matrixfsdp.runtime.mesh.topology import choose

from ..baselines import assign_owners
from .cluster import GIB, Cluster
from .comm import pipeline, split_exchange, unit_comm
from .shape import ELEM, ModelShape, PredictError, activation_bytes, all_params, block_flops, plan_for, unit_specs
# Their import path before predict_shape.py (the command line, tests and scripts use it):
from .shape import SHAPES, backward_flops, forward_flops, shape_from_bench_config  # noqa: F401

MODES: tuple[str, ...] = (
    "fsdp2_adamw", "fsdp2_muon", "fsdp2_gather_once", "zero1_owner", "ddp_muon",
    "matrix_fsdp", "matrix_fsdp_broadcast", "matrix_fsdp_hsdp", "matrix_fsdp_hsdp_split",
)
HSDP_MODES = ("matrix_fsdp_hsdp", "matrix_fsdp_hsdp_split", "matrix_fsdp_hsdp_auto")
#: the defaults (``collective="auto"``, ``replica_split="auto"``): each row is the explicit mode the
#: runtime's own chooser (``runtime.topology.choose``) picks for the cluster's topology, labelled auto
AUTO_MODES = ("matrix_fsdp_auto", "matrix_fsdp_hsdp_auto")
#: the explicit choices auto picks among, per auto mode (tests/test_predict.py compares them)
AUTO_ALTERNATIVES = {"matrix_fsdp_auto": ("matrix_fsdp", "matrix_fsdp_broadcast"),
                     "matrix_fsdp_hsdp_auto": ("matrix_fsdp_hsdp", "matrix_fsdp_hsdp_split")}
DDP_BUCKET = 25 * 2**20


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


# ---------------------------------------------------------------- the modes
def _spans(mode: str, c: Cluster, shard_size: int | None) -> tuple[int, int]:
    if mode not in MODES + AUTO_MODES:
        raise PredictError(f"unknown mode {mode!r}; known: {', '.join(MODES + AUTO_MODES)}")
    if mode not in HSDP_MODES:
        return c.world, 1
    w = shard_size or c.gpus_per_node
    if w < 1 or c.world % w:
        raise PredictError(f"shard size W={w} does not divide the world size {c.world} "
                           f"({c.nodes} nodes x {c.gpus_per_node} GPUs)")
    return w, c.world // w


def owner_work(plan: Plan, units: tuple[UnitSpec, ...], shape: ModelShape, replicas: int,
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


def elementwise(c: Cluster, matrix_elems: float, adamw_elems: float) -> float:
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
    opt = max(f / ns_stock + elementwise(c, mat, adam) for f, mat, adam in per)
    if mode == "zero1_owner":
        opt += sum(c.broadcast(p.nbytes, n) for p in params)  # each parameter from its owner
    static = 2 * p_bytes + max((mat + 2 * adam) * ELEM for _, mat, adam in per)
    return sum(cf), bwd, opt, static, 0.0


def passes(mode: str, plan: Plan, shape: ModelShape, c: Cluster, cf: list[float], cb: list[float],
            replicas: int, units: tuple[UnitSpec, ...] | None = None) -> tuple[float, float]:
    """(fwd, bwd) seconds of a sharded mode: `pipeline` over the plan's units (``units``: the
    plan's own, default the whole model's; a pipeline stage passes its part)."""
    units, span = units or unit_specs(shape), plan.world
    split = mode == "matrix_fsdp_hsdp_split"
    unit_link = [max(unit_comm(mode, lay, c)) for lay in plan.units]
    busiest = [lay.nbytes if mode.startswith("fsdp2") else max(lay.owned_bytes(r) for r in range(span))
               for lay in plan.units]
    copy = [2 * b / (c.hbm_gbs * 1e9) if span > 1 else 0.0 for b in busiest]  # materialized bytes copied once
    ready = [0.0] * len(units)
    if split:
        rep, back = split_exchange(plan, shape, c, replicas, units)
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


def _step(mode: str, plan: Plan, shape: ModelShape, c: Cluster, replicas: int) -> tuple[float, float, float]:
    """(opt seconds, static bytes, temporary bytes) of a sharded mode's busiest rank."""
    n, params = plan.world, all_params(shape)
    p_bytes = sum(p.nbytes for p in params)
    m_elems = sum(p.numel for p in params if p.is_matrix)
    rest_elems = sum(p.numel for p in params) - m_elems
    ns_stock = c.matmul_tflops * 1e12 * c.ns_eff_stock
    if mode == "fsdp2_adamw":
        return elementwise(c, 0, (m_elems + rest_elems) / n), 4 * p_bytes / n, p_bytes / n  # foreach temporary
    if mode.startswith("fsdp2"):
        opt = elementwise(c, m_elems / n, rest_elems / n)
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
    work = owner_work(plan, unit_specs(shape), shape, replicas, mode == "matrix_fsdp_hsdp_split")
    ns_ours = c.matmul_tflops * 1e12 * c.ns_eff_ours
    opt = max(f / ns_ours + elementwise(c, mat, adam) for f, mat, adam, _, _ in work)
    return opt, max(held + state for _, _, _, held, state in work), 0.0


def auto_mode(mode: str, c: Cluster, shard_size: int | None = None) -> tuple[str, str]:
    """The explicit mode an auto mode resolves to on ``c`` (shard group 0: ranks ``0..span-1``,
    node ``rank // gpus_per_node``), and the chooser's reason."""
    span, replicas = _spans(mode, c, shard_size)
    ch = choose("auto", "auto", list(range(span)), {r: r // c.gpus_per_node for r in range(span)}, replicas)
    if mode == "matrix_fsdp_auto":
        return ("matrix_fsdp_broadcast" if ch.collective == "broadcast" else "matrix_fsdp"), ch.collective_reason
    if ch.collective != "p2p":  # the HSDP rows model p2p inside the shard group only
        raise PredictError(f"{mode}: the shard span W={span} crosses nodes; the HSDP rows model p2p inside one")
    return ("matrix_fsdp_hsdp_split" if ch.replica_split else "matrix_fsdp_hsdp"), ch.replica_split_reason


def predict_mode(mode: str, shape: ModelShape, c: Cluster, shard_size: int | None = None,
                 planner: str = "role_greedy") -> dict[str, Any]:
    """One row: fwd/bwd/opt/total ms and peak GiB of the busiest rank for ``mode`` on ``c``."""
    if mode in AUTO_MODES:
        chosen, reason = auto_mode(mode, c, shard_size)
        return {**predict_mode(chosen, shape, c, shard_size, planner), "mode": mode, "chosen": chosen,
                "reason": reason}
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
        fwd, bwd = passes(mode, plan, shape, c, cf, cb, replicas)
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
