"""The MoE predictor: step time and memory of three ways to train a mixture-of-experts model
with Muon under expert parallelism (``python -m lightning_matrixfsdp.bench predict moe``).

``world = N`` GPUs, each with its own ``b x s`` tokens; the expert-parallel group (``EP``
consecutive ranks) splits each layer's ``E`` experts, ``E / EP`` per rank; ``EDP = N / EP``
ranks (stride ``EP``) hold the same experts. The dense part (attention, router, shared experts,
dense MLPs, embedding and head) is sharded over all ``N``. Modes:

- ``ours``: experts whole on their EP rank, never gathered; dense part owner-sharded by the real
  planner with the collective ``collective="auto"`` picks. Expert gradients all-reduced over
  EDP under the backward; every rank steps its ``E / EP`` experts (no collective in the step).
- ``ours_split``: the same, but each expert is reduced to one EDP replica that steps it and
  sends it back before its layer's next forward (``replica_split``'s pattern, applied to experts).
- ``fsdp2_ep``: FSDP2 over ``N`` for the dense part and over EDP for the experts (each expert
  matrix in row bands, all-gathered in forward and backward, reduce-scattered), stock
  ``torch.optim.Muon`` per matrix on those DTensors: its Newton-Schulz as `stock_matrix_work`
  models it, the experts' collectives over EDP.
- ``distmuon``: the same FSDP2 passes, with the batched distributed Muon of torchtitan's
  FlexShard / dion design: matrices of one shape in batches of the group size, one all-to-all
  gives each rank one whole matrix, Newton-Schulz, one all-to-all back. An expert stack sharded on
  its expert dimension (``E / EP`` divisible by EDP) is stepped locally per expert; otherwise
  (row bands) the stacks go through the all-to-all path over EDP.

Common to all: the token all-to-all (dispatch and combine, each ``T k H`` bytes, ``(EP-1)/EP``
of it off the rank) twice in forward, twice in backward and twice again in the recomputation
under activation checkpointing, on the critical path (not overlapped); uniform routing.
Collective costs are :class:`.cluster.Cluster`'s; `edp_ring` is a ring over a strided group.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lightning_matrixfsdp.runtime.placement import Plan, RoleKind
from lightning_matrixfsdp.runtime.planner import make_plan, newton_schulz_flops

from .cluster import CLUSTERS, GIB, Cluster, ClusterError, cluster
from .modes import auto_mode, elementwise, stock_matrix_work
from .comm import pipeline, unit_comm
from .moe_shape import (
    MOE_SHAPES, MoEShape, activation_bytes, dense_units, expert_matrices, expert_numel, head_flops, layer_flops,
    moe_layers, parameter_counts, token_payload,
)
from .shape import ELEM, PredictError

__all__ = ["MOE_MODES", "a2a_seconds", "dense_plan", "edp_all_reduce", "edp_ring", "moe_markdown", "predict_moe",
           "predict_moe_mode"]

MOE_MODES: tuple[str, ...] = ("ours", "ours_split", "fsdp2_ep", "distmuon")


# ---------------------------------------------------------------- collectives over EP and EDP groups
def a2a_seconds(c: Cluster, payload: float, ep: int) -> float:
    """One all-to-all over ``ep`` consecutive ranks where each rank holds ``payload`` bytes split
    evenly over the group: the off-node part through the GPU's share of its node's NICs, the
    on-node part over NVLink, concurrently."""
    if ep <= 1:
        return 0.0
    g = min(ep, c.gpus_per_node)
    intra = payload * (g - 1) / ep / (c.intra_gbs * 1e9)
    inter = payload * (ep - g) / ep / (c.inter_gbs / c.gpus_per_node * 1e9)
    return max(intra, inter) + c.latency(ep)


def edp_ring(c: Cluster, nbytes: float, ep: int, edp: int) -> float:
    """A ring all-gather (or reduce-scatter) of ``nbytes`` in all over the ``edp`` ranks at stride
    ``ep``, every GPU in its own ring at once: a node's NICs carry one crossing per ring that
    leaves it (``min(g, ep)`` rings per node), its NVLink the rest."""
    if edp <= 1:
        return 0.0
    g = c.gpus_per_node
    per_node = max(1, g // ep) if ep < g else 1
    nodes = -(-edp // per_node)
    moved = nbytes * (edp - 1) / edp
    t = moved / (c.intra_gbs * 1e9)
    if nodes > 1:
        t = max(t, min(g, ep) * moved / (c.inter_gbs * 1e9))
    return t + (c.intra_lat_us + (nodes - 1) * c.inter_lat_us) * 1e-6


def edp_all_reduce(c: Cluster, nbytes: float, ep: int, edp: int) -> float:
    """A ring all-reduce over the same strided group: two passes, one latency."""
    if edp <= 1:
        return 0.0
    return 2 * edp_ring(c, nbytes, ep, edp) - edp_ring(c, 0.0, ep, edp)


# ---------------------------------------------------------------- the layout of one configuration
def _layout(s: MoEShape, c: Cluster, ep: int | str | None) -> tuple[int, int]:
    """(EP, EDP); EP defaults to one node's GPUs (at most E), ``"world"`` is as wide as E and N allow."""
    n = c.world
    if ep == "world":
        ep = math.gcd(s.experts, n)
    ep = ep or min(s.experts, c.gpus_per_node, n)
    if not isinstance(ep, int):
        raise PredictError(f"expert-parallel size must be an integer or 'world', got {ep!r}")
    if ep < 1 or n % ep:
        raise PredictError(f"expert-parallel size EP={ep} must divide the world size {n} "
                           f"({c.nodes} nodes x {c.gpus_per_node} GPUs)")
    if s.experts % ep:
        raise PredictError(f"model {s.name!r}: EP={ep} must divide the number of experts {s.experts}")
    return ep, n // ep


@functools.lru_cache(maxsize=32)
def dense_plan(s: MoEShape, span: int) -> Plan:
    return make_plan(list(dense_units(s)), span, "role_greedy", ns_steps=s.ns_steps)


def _expert_ns(s: MoEShape) -> float:
    return float(sum(newton_schulz_flops(m, s.ns_steps) for m in expert_matrices(s)))


def _dense_owner_work(plan: Plan, s: MoEShape) -> list[tuple[float, int, int, int]]:
    """Per rank: (NS FLOPs, matrix elements, AdamW elements, bytes held incl. optimizer state)."""
    out = []
    for r in range(plan.world):
        f = mat = adam = held = 0
        for sh in plan.shards():
            if sh.owner != r:
                continue
            if sh.role is RoleKind.MATRIX:
                f, mat, held = f + newton_schulz_flops(sh.shape, s.ns_steps), mat + sh.numel, held + 3 * sh.nbytes
            else:
                adam, held = adam + sh.numel, held + 4 * sh.nbytes
        out.append((f, mat, adam, held))
    return out


def _dense_totals(s: MoEShape) -> tuple[list[tuple[int, ...]], int, int]:
    params = [p for u in dense_units(s) for p in u.params]
    return [p.shape for p in params if p.is_matrix], sum(p.numel for p in params if p.is_matrix), \
        sum(p.numel for p in params if not p.is_matrix)


# ---------------------------------------------------------------- one row
def predict_moe_mode(mode: str, s: MoEShape, c: Cluster, ep: int | str | None = None) -> dict[str, Any]:
    """Forward, backward and optimizer-step ms, their components, bytes moved per GPU per step and
    the peak memory of the busiest GPU for ``mode`` on ``c``."""
    if mode not in MOE_MODES:
        raise PredictError(f"unknown MoE mode {mode!r}; known: {', '.join(MOE_MODES)}")
    ep, edp = _layout(s, c, ep)
    n, units, plan = c.world, dense_units(s), dense_plan(s, c.world)
    ours = mode.startswith("ours")
    rate = c.matmul_tflops * 1e12 * c.model_eff
    n_moe, local = moe_layers(s), s.experts // ep
    exp_layer_bytes = local * expert_numel(s) * ELEM  # one layer's experts on one EP rank
    # compute and the token all-to-all, per unit (root first, then the layers)
    cf = [head_flops(s) / rate] + [layer_flops(s, i) / rate for i in range(s.layers)]
    cb = [cf[0] * 2] + [f * (3 if s.ac else 2) for f in cf[1:]]
    a2a_one = a2a_seconds(c, token_payload(s), ep)
    n_fwd, n_bwd = 2, 2 + (2 if s.ac else 0)
    is_moe = [False] + [i >= s.dense_layers for i in range(s.layers)]
    af = [a2a_one * n_fwd if m else 0.0 for m in is_moe]
    ab = [a2a_one * n_bwd if m else 0.0 for m in is_moe]
    # the dense part's weights: owner fanout (ours) or FSDP2's all-gather, per unit
    coll = auto_mode("matrix_fsdp_auto", c)[0] if ours else "fsdp2_muon"
    dense_link = [max(unit_comm(coll, lay, c)) for lay in plan.units]
    busiest = [max(lay.owned_bytes(r) for r in range(n)) if ours else lay.nbytes for lay in plan.units]
    copy = [2 * b / (c.hbm_gbs * 1e9) if n > 1 else 0.0 for b in busiest]
    # the experts' weights: FSDP2 gathers them over EDP (and copies them out); ours reduces their
    # gradients over EDP. Either runs on the same link as the unit's dense collective, after it.
    ring = edp_ring(c, exp_layer_bytes, ep, edp)
    exp_copy = 2 * exp_layer_bytes / (c.hbm_gbs * 1e9) if edp > 1 and not ours else 0.0
    if mode == "ours":  # all-reduce under the backward; every replica steps
        exp_f, exp_b, exp_r, passes_ = 0.0, 0.0, edp_all_reduce(c, exp_layer_bytes, ep, edp), 2
    elif mode == "ours_split":  # reduce to the stepper; the stepped experts come back in the next forward
        exp_f, exp_b, exp_r, passes_ = ring, 0.0, ring, 2
    else:  # FSDP2: gathered in forward and again in backward, reduce-scattered
        exp_f, exp_b, exp_r, passes_ = ring, ring, ring, 3
    mat_f = [d + (exp_f if m else 0.0) for d, m in zip(dense_link, is_moe)]
    mat_b = [(d + (exp_b if m else 0.0)) if u.fqn else 0.0 for d, m, u in zip(dense_link, is_moe, units)]
    red_b = [d + (exp_r if m else 0.0) for d, m in zip(dense_link, is_moe)]
    exp_bytes = passes_ * exp_layer_bytes * (edp - 1) / edp * n_moe
    fwd = pipeline([x + y + z + (exp_copy if m else 0.0) for x, y, z, m in zip(cf, copy, af, is_moe)], mat_f,
                   [0.0] * len(units))
    order = list(range(len(units)))[::-1]
    bwd = pipeline([cb[u] + ab[u] + (copy[u] + (exp_copy if is_moe[u] else 0.0) if units[u].fqn else 0.0)
                    for u in order], [mat_b[u] for u in order], [red_b[u] for u in order])
    opt, ns_flops, opt_bytes, static, temp = _step(mode, s, c, plan, ep, edp)
    dense_bytes = sum(lay.nbytes for lay in plan.units) * (n - 1) / n
    dense_bytes = dense_bytes * 2 + sum(lay.nbytes for lay, u in zip(plan.units, units) if u.fqn) * (n - 1) / n
    buffers = 2 * max(lay.nbytes for lay in plan.units) if n > 1 else 0.0
    if not ours and edp > 1:
        buffers += 2 * exp_layer_bytes
    peak = static + max(activation_bytes(s) + buffers, temp)
    compute = sum(cf) + sum(cb[u] for u in range(len(units)))
    a2a_ms = (sum(af) + sum(ab)) * 1e3
    counts = parameter_counts(s)
    row = {"mode": mode, "model": s.name, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "world": n, "ep": ep,
           "edp": edp, "parameters": counts["total"], "compute_ms": compute * 1e3, "a2a_ms": a2a_ms,
           "a2a_bytes": token_payload(s) * (ep - 1) / ep * (n_fwd + n_bwd) * n_moe,
           "dense_weight_bytes": dense_bytes, "expert_weight_bytes": exp_bytes,
           "opt_ns_tflop": ns_flops / 1e12, "opt_comm_bytes": opt_bytes,
           "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3, "opt_ms": opt * 1e3, "total_ms": (fwd + bwd + opt) * 1e3,
           "peak_gib": peak / GIB}
    row["fits"] = row["peak_gib"] <= c.gpu_mem_gib
    return row


def _step(mode: str, s: MoEShape, c: Cluster, plan: Plan, ep: int, edp: int
          ) -> tuple[float, float, float, float, float]:
    """(opt seconds, busiest GPU's NS FLOPs, bytes it sends in the step, static bytes, temporary
    bytes) of the optimizer step of one GPU, the busiest."""
    n, n_moe, local = c.world, moe_layers(s), s.experts // ep
    e_numel = expert_numel(s)
    ns_ours = c.matmul_tflops * 1e12 * c.ns_eff_ours
    ns_stock = c.matmul_tflops * 1e12 * c.ns_eff_stock
    if mode.startswith("ours"):
        stepped = n_moe * local if mode == "ours" else math.ceil(n_moe * local / edp)
        held = n_moe * local * e_numel * ELEM * 2 + stepped * e_numel * ELEM  # weights, grads; momentum
        e_flops, e_elems = stepped * _expert_ns(s), stepped * e_numel
        work = _dense_owner_work(plan, s)
        opt = max(f / ns_ours + elementwise(c, m, a) for f, m, a, _ in work) + e_flops / ns_ours \
            + elementwise(c, e_elems, 0)
        busy = max(range(n), key=lambda r: work[r][0])
        return opt, work[busy][0] + e_flops, 0.0, max(h for *_, h in work) + held, 0.0
    mats, m_elems, rest = _dense_totals(s)
    e_all = n_moe * local * e_numel  # one EP rank's expert elements, sharded over EDP
    opt = elementwise(c, m_elems / n + e_all / edp, rest / n)
    static = (3 * (m_elems / n + e_all / edp) + 4 * rest / n) * ELEM
    flops = sent = temp = 0.0
    if mode == "fsdp2_ep":
        jobs = [(m, n, False) for m in mats]
        jobs += [(m, edp, True) for m in expert_matrices(s) for _ in range(n_moe * local)]
        for shape, span, expert in jobs:
            f, colls = stock_matrix_work(shape, s.ns_steps, span)
            flops += f
            opt += f / ns_stock
            for kind, b in colls:
                t = (edp_ring(c, b, ep, span) * (2 if kind == "all_reduce" else 1)) if expert \
                    else getattr(c, kind)(b, span)
                opt += t + c.dispatch_us * 1e-6
                sent += b * (span - 1) / span * (2 if kind == "all_reduce" else 1)
        temp = 3 * max(a * b for a, b in mats + list(expert_matrices(s))) * ELEM
        return opt, flops, sent, static, temp
    # distmuon: batches of one shape over the group; one whole matrix (or stack) per rank per batch
    groups: dict[tuple[int, int], int] = {}
    for m in mats:
        groups[m] = groups.get(m, 0) + 1
    for shape, count in groups.items():
        batches = math.ceil(count / n)
        f = batches * newton_schulz_flops(shape, s.ns_steps)
        flops += f
        nbytes = shape[0] * shape[1] * ELEM
        opt += f / ns_ours + batches * 2 * (a2a_seconds(c, nbytes, n) if n > 1 else 0.0)
        sent += batches * 2 * nbytes * (n - 1) / n
        temp = max(temp, 2 * nbytes)
    if local % edp == 0:  # Shard(0) over the experts: whole experts per rank, stepped locally
        f = n_moe * local // edp * _expert_ns(s)
        flops, opt = flops + f, opt + f / ns_ours
    else:  # row bands: stacks [E/EP, m, n] of one shape in batches of EDP, one stack per rank
        for shape in set(expert_matrices(s)):
            count = n_moe * sum(m == shape for m in expert_matrices(s))
            batches = math.ceil(count / edp)
            f = batches * local * newton_schulz_flops(shape, s.ns_steps)
            stack = local * shape[0] * shape[1] * ELEM
            flops, opt = flops + f, opt + f / ns_ours + batches * 2 * edp_ring(c, stack, ep, edp)
            sent += batches * 2 * stack * (edp - 1) / edp
            temp = max(temp, 2 * stack)
    return opt, flops, sent, static, temp


# ---------------------------------------------------------------- sweeps, table, command line
def predict_moe(s: MoEShape, base: Cluster, nodes: Sequence[int], modes: Sequence[str] = MOE_MODES,
                ep: int | str | None = None) -> list[dict[str, Any]]:
    """One row per (nodes, mode)."""
    return [predict_moe_mode(m, s, base.with_(nodes=k), ep) for k in nodes for m in modes]


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


def moe_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (docs/moe-predictions.md)."""
    out = ["| model | nodes | EP x EDP | mode | compute ms | a2a ms | fwd ms | bwd ms | opt ms | total ms "
           "| token a2a GiB | dense weights GiB | expert weights GiB | opt NS TFLOP | opt sent GiB | peak GiB |",
           "| --- | ---: | --- | --- |" + " ---: |" * 12]
    for r in rows:
        out.append(f"| {r['model']} | {r['nodes']} | {r['ep']} x {r['edp']} | {r['mode']} | {r['compute_ms']:.0f} | "
                   f"{r['a2a_ms']:.0f} | {r['fwd_ms']:.0f} | {r['bwd_ms']:.0f} | {r['opt_ms']:.0f} | "
                   f"**{r['total_ms']:.0f}** | {_gib(r['a2a_bytes'])} | {_gib(r['dense_weight_bytes'])} | "
                   f"{_gib(r['expert_weight_bytes'])} | {r['opt_ns_tflop']:.1f} | {_gib(r['opt_comm_bytes'])} | "
                   f"{r['peak_gib']:.1f} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_matrixfsdp.bench predict moe --model mixtral-8x7b --nodes 1 2 4 8 16``"""
    p = argparse.ArgumentParser(prog="python -m lightning_matrixfsdp.bench predict moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=sorted(MOE_SHAPES), choices=sorted(MOE_SHAPES))
    p.add_argument("--cluster", default="h200", choices=sorted(CLUSTERS))
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--ep", type=lambda v: v if v == "world" else int(v),
                   help="expert-parallel size, or 'world' (as wide as experts and GPUs allow); "
                        "default: min(experts, GPUs per node)")
    p.add_argument("--modes", nargs="+", default=list(MOE_MODES), choices=MOE_MODES)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    try:
        base = cluster(args.cluster, gpus_per_node=args.gpus_per_node)
        rows = []
        for name in args.model:
            s = replace(MOE_SHAPES[name], **{k: getattr(args, k) for k in ("seq_len", "batch")
                                             if getattr(args, k) is not None})
            rows += predict_moe(s, base, args.nodes, args.modes, args.ep)
    except (PredictError, ClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"cluster {base.name}: {json.dumps(base.to_dict())}")
    print(moe_markdown(rows))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"cluster": base.to_dict(), "models": {k: MOE_SHAPES[k].to_dict() for k in args.model},
                       "rows": rows}, f, indent=1)
    return 0
