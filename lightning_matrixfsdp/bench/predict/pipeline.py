"""The predictor's pipeline-parallel modes: ``PP`` stages times owner sharding inside each stage.

``world = PP x D``: each of the ``PP`` stages (``v`` model chunks per rank under the interleaved
schedules, ``PP v`` chunks in all, chunk ``k`` on rank ``k mod PP``) is owner-sharded over its
own data-parallel group of ``D`` ranks with the collective ``collective="auto"`` picks for that
group (HSDP inside the stage with ``inner="matrix_fsdp_hsdp_auto"``); each matrix is whole on one
owner of its stage, so the optimizer step stays local. One pipeline replica runs ``m``
micro-batches of ``batch`` sequences per step (global batch ``D m batch``).

Time of one step (`pipe_seconds`): the busiest rank's work for every micro-batch but the first,
plus the first micro-batch's (with the stage's exposed communication), plus the schedule's idle
time (`bubble`) at the mean chunk's forward / input-gradient / weight-gradient durations, plus
the other ranks' exposed first materialization (each delays the fill); then the optimizer step
of the busiest owner. Weights are either kept materialized from the first forward to the last
backward and their gradients reduced once (``weights="keep"``, as torch's pipelining runs FSDP:
no reshard and no gradient sync between micro-batches) or materialized and reduced per
micro-batch (``"regather"``: less memory, ``m`` times the bytes; what our runtime runs, and the only
policy of the split-backward schedules, whose input and weight parts each materialize the stage and
whose reductions follow the weight part: :mod:`.split_schedules`). Between stages each micro-batch
sends ``batch x seq x hidden`` bf16 activations forward and as many gradient bytes back, counted
on every chunk and not overlapped (an upper bound), over NVLink or the GPU's share of its node's
NICs as the placement puts neighbouring stages. The facts behind each schedule's idle time and
in-flight micro-batches are in `bubble` and `in_flight`; docs/pipeline-parallel.md explains them.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from lightning_matrixfsdp.runtime.placement import Plan, RoleKind, UnitSpec
from lightning_matrixfsdp.runtime.planner import make_plan

from .cluster import GIB, Cluster
from .comm import pipeline, split_exchange, unit_comm
from .modes import auto_mode, elementwise, owner_work, passes, predict_mode
from .shape import ELEM, ModelShape, PredictError, block_flops, unit_specs
from .split_schedules import V_SCHEDULES, split_parts, split_share, v_bubble, v_in_flight

__all__ = ["PLACEMENTS", "PP_SCHEDULES", "SPLIT_SCHEDULES", "WEIGHTS", "activation_bytes_per_microbatch", "bubble", "bubble_fraction",
           "check_pipeline", "chunk_blocks", "in_flight", "predict_pp_mode", "stage_view"]

PP_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                  "ZBVZeroBubble", "DualPipeV")
#: torch schedules the predictor refuses, and why (none at present)
NOT_MODELLED: dict[str, str] = {}
#: schedules that split each backward into an input and a weight part (runtime/pipeline/split_backward.py)
SPLIT_SCHEDULES = ("InterleavedZeroBubble",) + V_SCHEDULES
#: what the DualPipeV rows leave out, shown with them
DUALPIPEV_NOTE = ("no overlap: torch (and our runtime) runs each forward + backward pair one after the other, so its "
                  "gain, hiding MoE all-to-alls behind compute, is not modelled")
PLACEMENTS = ("across", "within")  # neighbouring stages on other nodes / on the same node
WEIGHTS = ("keep", "regather")
INNER_MODES = ("matrix_fsdp_auto", "matrix_fsdp_hsdp_auto")
_INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble")


# ---------------------------------------------------------------- schedules
def check_pipeline(schedule: str, pp: int, m: int, v: int = 1) -> None:
    """Refuse what torch's schedule class refuses (or what is not modelled), naming the fix."""
    if schedule in NOT_MODELLED:
        raise PredictError(f"schedule {schedule!r} is not modelled: {NOT_MODELLED[schedule]}")
    if schedule not in PP_SCHEDULES:
        raise PredictError(f"unknown schedule {schedule!r}; known: {', '.join(PP_SCHEDULES)}")
    if pp < 1 or m < 1 or v < 1:
        raise PredictError(f"PP={pp}, micro-batches={m} and virtual stages={v} must be >= 1")
    if schedule in _INTERLEAVED:
        if v < 2:
            raise PredictError(f"{schedule} runs several stages per rank: pass virtual stages v >= 2, got {v}")
        rounds = max(1, m // pp)
        if m % rounds:
            raise PredictError(f"{schedule} needs the micro-batches ({m}) to be a multiple of the rounds "
                               f"max(1, m // PP) = {rounds}, as torch requires")
    elif schedule == "LoopedBFS":
        if v < 2:
            raise PredictError(f"LoopedBFS runs several stages per rank: pass virtual stages v >= 2, got {v}")
        if m < pp:
            raise PredictError(f"LoopedBFS is modelled from PP micro-batches on (its idle time grows below): "
                               f"m={m} < PP={pp}")
    elif schedule in V_SCHEDULES:
        if v != 2:
            raise PredictError(f"{schedule} runs exactly two stages per rank (a V): virtual stages must be 2, got {v}")
        if schedule == "DualPipeV" and m < 2 * pp:
            raise PredictError(f"DualPipeV needs at least as many micro-batches as stages: m={m} < 2 PP = {2 * pp}, "
                               "as torch requires")
    elif v != 1:
        raise PredictError(f"{schedule} runs one stage per rank: virtual stages must be 1, got {v}")


def bubble(schedule: str, pp: int, f: float, b: float, w: float, m: int = 0) -> float:
    """Idle time of a rank over the step, in the durations of one chunk and one micro-batch:
    forward ``f``, input gradient ``b``, weight gradient ``w`` (a full backward is ``b + w``).

    - GPipe, 1F1B, Interleaved1F1B and LoopedBFS (``m >= PP``): ``(PP-1)(f + b + w)``. The
      first micro-batch needs ``PP-1`` chunk forwards before the last rank starts, and the last backward ``PP-1`` chunk
      backwards to reach rank 0; nothing fills those slots. Over ``m v`` chunk passes per rank
      that is the bubble fraction ``(PP-1) / (v m + PP-1)`` (``v = 1``: ``(PP-1) / (m + PP-1)``).
      1F1B has GPipe's idle time; it only holds fewer micro-batches.
    - InterleavedZeroBubble (the zero-bubble paper's schedule with 1F1B's memory):
      ``(PP-1) max(b, f + b - w)``. Weight gradients wait for nothing downstream, so they fill
      the slots, leaving the paper's ``f + b - w`` per boundary; but the last micro-batch's input
      gradient still walks back through ``PP-1`` ranks one ``b`` at a time, which no weight
      gradient can shorten. (Checked against a plain simulation of torch's own action order,
      tests/test_predict_pp.py.)
    - ZBVZeroBubble and DualPipeV (two stages per rank in a V, ``m`` needed): simulated on their
      action order (:mod:`.split_schedules`, checked against torch's in tests/test_predict_pp_split.py)."""
    if schedule in V_SCHEDULES:
        if m < 1:
            raise PredictError(f"{schedule}'s idle time is simulated for a number of micro-batches: pass m >= 1")
        return v_bubble(schedule, pp, m, f, b, w)
    if pp <= 1:
        return 0.0
    if schedule == "InterleavedZeroBubble":
        return (pp - 1) * max(b, f + b - w)
    return (pp - 1) * (f + b + w)


def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0,
                    w: float = 1.0) -> float:
    """Idle share of a step of equal chunks: ``bubble / (m v (f + b + w) + bubble)``."""
    idle = bubble(schedule, pp, f, b, w, m)
    return idle / (m * v * (f + b + w) + idle)


def in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> int:
    """Chunk activations rank ``rank`` holds at its peak (forward done, weight gradient not yet):
    GPipe all ``m``; LoopedBFS all ``m v``; 1F1B ``min(m, PP - rank)`` (its warm-up forwards plus
    one); Interleaved1F1B ``(v-1) R + 2 (PP-1-rank) + 1`` (torch's warm-up, ``R`` micro-batches per round: ``PP`` when
    ``PP`` divides ``m``); InterleavedZeroBubble ``(v-1) R + PP`` on every rank; never more than ``m v``;
    the V schedules: counted on their action order (ZBV ``2 PP``, DualPipeV ``2 PP + 1`` once ``m``
    fills the V). (Each checked against torch's own action order, tests/test_predict_pp*.py.)"""
    if schedule in V_SCHEDULES:
        return v_in_flight(schedule, pp, m, rank)
    per_round = m // max(1, m // pp)  # torch runs the micro-batches in rounds of about PP
    if schedule == "GPipe":
        n = m
    elif schedule == "LoopedBFS":  # breadth-first: every micro-batch's forward on a stage before a backward
        n = m * v
    elif schedule == "1F1B":
        n = pp - rank
    elif schedule == "Interleaved1F1B":
        n = (v - 1) * per_round + 2 * (pp - 1 - rank) + 1
    else:
        n = (v - 1) * per_round + pp
    return min(n, m * v)


# ---------------------------------------------------------------- the split and the stages
def _block_cost(shape: ModelShape) -> tuple[float, float]:
    """(forward+backward FLOPs of one block, of the head) for the split."""
    blk = block_flops(shape) * (4 if shape.ac else 3)
    return blk, 3 * 2 * shape.batch * shape.seq_len * shape.vocab * shape.hidden


def chunk_blocks(shape: ModelShape, chunks: int) -> list[int]:
    """Blocks per chunk, balancing forward+backward FLOPs: the last chunk carries the head (the
    embedding lookup counts as none), so it gets fewer blocks; the rest are spread evenly, earlier
    chunks taking the remainder. Every chunk gets at least one block."""
    if chunks > shape.layers:
        raise PredictError(f"model {shape.name!r}: {chunks} pipeline chunks (PP x v) exceed its {shape.layers} "
                           f"layers; every chunk needs a block")
    if chunks == 1:
        return [shape.layers]
    blk, head = _block_cost(shape)
    target = (shape.layers * blk + head) / chunks
    last = min(max(1, round((target - head) / blk)), shape.layers - (chunks - 1))
    rest, extra = divmod(shape.layers - last, chunks - 1)
    return [rest + (i < extra) for i in range(chunks - 1)] + [last]


@functools.lru_cache(maxsize=256)
def chunk_units(shape: ModelShape, lo: int, hi: int, first: bool, last: bool) -> tuple[UnitSpec, ...]:
    """The units of the chunk of blocks ``lo..hi-1``: its blocks, after a root unit holding the
    embedding (first chunk) and the final norm and head (last chunk); the whole model's units when
    it is both (no pipeline)."""
    units = unit_specs(shape)
    if first and last:
        return units
    blocks = units[1:] if shape.vocab else units
    root = [p for p in units[0].params if (first and p.fqn == "embed.weight") or (last and p.fqn != "embed.weight")] \
        if shape.vocab else []
    return ((UnitSpec("", tuple(root)),) if root else ()) + tuple(blocks[lo:hi])


@functools.lru_cache(maxsize=256)
def chunk_plan(shape: ModelShape, lo: int, hi: int, first: bool, last: bool, span: int, planner: str) -> Plan:
    return make_plan(list(chunk_units(shape, lo, hi, first, last)), span, planner, ns_steps=shape.ns_steps)


def stage_view(c: Cluster, pp: int, placement: str) -> tuple[Cluster, bool]:
    """(the cluster one stage's DP group sees, whether neighbouring stages sit on other nodes).
    ``across``: a stage is ``D`` consecutive ranks (whole nodes, or a part of one); ``within``:
    every node holds all stages, ``g / PP`` GPUs each, and a stage's group spans the nodes with
    ``1 / PP`` of each node's NICs."""
    if placement not in PLACEMENTS:
        raise PredictError(f"unknown placement {placement!r}; known: {', '.join(PLACEMENTS)}")
    g, d = c.gpus_per_node, c.world // pp
    if pp < 1 or c.world % pp:
        raise PredictError(f"PP={pp} does not divide the world size {c.world} ({c.nodes} nodes x {g} GPUs)")
    if placement == "within":
        if g % pp:
            raise PredictError(f"placement 'within' puts all {pp} stages on each node: PP must divide the "
                               f"{g} GPUs per node (or use placement 'across')")
        return c.with_(gpus_per_node=g // pp, inter_gbs=c.inter_gbs / pp), False
    if d >= g:
        if d % g:
            raise PredictError(f"placement 'across': a stage of D={d} ranks must be whole nodes of {g} GPUs")
        return c.with_(nodes=d // g), pp > 1
    if g % d:
        raise PredictError(f"placement 'across': a stage of D={d} ranks must divide a node's {g} GPUs")
    return c.with_(gpus_per_node=d, nodes=1), c.nodes > 1


def activation_bytes_per_microbatch(shape: ModelShape) -> int:
    """Bytes one boundary carries per micro-batch and direction: ``batch x seq x hidden`` bf16."""
    return shape.batch * shape.seq_len * shape.hidden * ELEM


def p2p_seconds(shape: ModelShape, c: Cluster, pp: int, placement: str, crosses: bool) -> float:
    """One boundary's transfer of one micro-batch: NVLink, or across nodes each of the (at most
    ``min(D, g)``) GPUs of a node that cross at once gets its share of the node's NICs."""
    if pp <= 1:
        return 0.0
    nbytes = activation_bytes_per_microbatch(shape)
    if not crosses:
        return nbytes / (c.intra_gbs * 1e9) + c.intra_lat_us * 1e-6
    share = c.inter_gbs / min(c.world // pp, c.gpus_per_node)
    return nbytes / (share * 1e9) + (c.intra_lat_us + c.inter_lat_us) * 1e-6


# ---------------------------------------------------------------- one chunk, one rank
@functools.lru_cache(maxsize=512)  # shared by the schedules, weights policies and micro-batch counts of a sweep
def _chunk(shape: ModelShape, c: Cluster, view: Cluster, lo: int, hi: int, first: bool, last: bool, inner: str,
           planner: str) -> dict[str, Any]:
    """One chunk on one micro-batch: pure compute ``f``, ``b`` (input gradient), ``w`` (weight
    gradient), the passes with the stage's collectives (``F1``: forward with the materialization,
    ``B1``: backward with the reduction), the owners' step work and the resident bytes (cached:
    read it, never change it)."""
    chosen, _ = auto_mode(inner, view)
    span = view.gpus_per_node if inner == "matrix_fsdp_hsdp_auto" else view.world
    replicas = view.world // span
    units = chunk_units(shape, lo, hi, first, last)
    plan = chunk_plan(shape, lo, hi, first, last, span, planner)
    rate = c.matmul_tflops * 1e12 * c.model_eff
    tokens = shape.batch * shape.seq_len
    head = 2 * tokens * shape.vocab * shape.hidden
    has_head = any(p.fqn == "head.weight" for u in units if not u.fqn for p in u.params)
    cf = [(block_flops(shape) if u.fqn else (head if has_head else 0.0)) / rate for u in units]
    cb = [f * (3 if shape.ac and u.fqn else 2) for f, u in zip(cf, units)]
    mats = sum(p.numel for p in unit_specs(shape)[-1].params if p.is_matrix)
    w = ((hi - lo) * 2 * tokens * mats + (head if has_head else 0.0)) / rate  # weight gradients: one matmul each
    fwd, bwd = passes(chosen, plan, shape, view, cf, cb, replicas, units)
    work = owner_work(plan, units, shape, replicas, chosen == "matrix_fsdp_hsdp_split")
    w_unit = [(2 * tokens * mats if u.fqn else (head if has_head else 0.0)) / rate for u in units]
    inp, wgt = _split_costs(chosen, plan, shape, view, replicas, units, [x - y for x, y in zip(cb, w_unit)], w_unit)
    return {"f": sum(cf), "b": sum(cb) - w, "w": w, "F1": fwd, "B1": bwd, "I1": inp, "Wp": wgt, "work": work,
            "span": span,
            "replicas": replicas, "chosen": chosen, "plan": plan, "blocks": hi - lo, "head": has_head,
            "unit_bytes": [sum(p.nbytes for p in u.params) for u in units]}


def _split_costs(chosen: str, plan: Plan, shape: ModelShape, view: Cluster, replicas: int,
                 units: tuple[UnitSpec, ...], cb_in: list[float], w_unit: list[float]) -> tuple[float, float]:
    """(input part, weight part) of a split backward of one chunk and micro-batch
    (:func:`.split_schedules.split_parts`), with the stage mode's materializations and reductions."""
    span = plan.world
    link = [max(unit_comm(chosen, lay, view)) for lay in plan.units]
    copy = [2 * max(lay.owned_bytes(r) for r in range(span)) / (view.hbm_gbs * 1e9) if span > 1 else 0.0
            for lay in plan.units]
    rep = None
    if replicas > 1:
        rep = split_exchange(plan, shape, view, replicas, units)[0] if chosen == "matrix_fsdp_hsdp_split" else \
            [[view.replica_all_reduce(lay.owned_bytes(r), replicas) for r in range(span)] for lay in plan.units]
    n = len(units)
    chain = pipeline([0.0] * n, [0.0] * n, link, rep=rep)  # the reductions, nothing left to hide them
    return split_parts(cb_in, w_unit, copy, link, [not u.fqn for u in units], chain, pipeline)


def _sum_work(chunks: list[dict[str, Any]]) -> list[tuple[float, int, int, int, int]]:
    """Per DP position: the owners' work summed over a rank's chunks."""
    return [tuple(sum(x) for x in zip(*col)) for col in zip(*(ch["work"] for ch in chunks))]  # type: ignore[misc]


def _activations(shape: ModelShape, chunks: list[dict[str, Any]], held: int, v: int) -> float:
    """Peak activation bytes of a rank holding ``held`` chunk activations (as :func:`.shape.activation_bytes`
    counts one micro-batch: block checkpoints, one block's working set, logits with loss and gradient)."""
    bs, h = shape.batch * shape.seq_len, shape.hidden
    work = bs * (10 * h + (4 if shape.gated else 2) * shape.mlp) * ELEM
    saved = held * max(ch["blocks"] * (bs * h * ELEM if shape.ac else work) for ch in chunks)
    logits = -(-held // v) * bs * shape.vocab * (ELEM + 8) if any(ch["head"] for ch in chunks) else 0
    return saved + (work if shape.ac else 0) + logits


def _rank(shape: ModelShape, c: Cluster, chunks: list[dict[str, Any]], m: int, tau: float, weights: str,
          held: int, v: int, split: tuple[float, ...]) -> dict[str, float]:
    """One pipeline rank: per-micro-batch work (steady ``W``, first ``W1``), exposed first
    materialization, optimizer step and peak bytes of its busiest DP position. ``split``: per
    chunk, the share of micro-batches whose backward runs as an input and a weight part."""
    keep = weights == "keep"
    first = sum(ch["F1"] + s * (ch["I1"] + ch["Wp"]) + (1 - s) * ch["B1"] + 2 * tau for ch, s in zip(chunks, split))
    steady = sum(ch["f"] + ch["b"] + ch["w"] + 2 * tau for ch in chunks) if keep else first
    exposed = sum(ch["F1"] - ch["f"] for ch in chunks) if keep else 0.0
    ns_rate = c.matmul_tflops * 1e12 * c.ns_eff_ours
    work = _sum_work(chunks)
    opt = max(f / ns_rate + elementwise(c, mat, adam) for f, mat, adam, _, _ in work)
    static = max(held_b + state for _, _, _, held_b, state in work)
    if chunks[0]["span"] <= 1:
        buffers = 0.0
    elif keep and m > 1:  # the whole chunk materialized and its gradient accumulated unsharded
        buffers = 2.0 * sum(sum(ch["unit_bytes"]) for ch in chunks)
    elif any(split):  # a weight part materializes its whole chunk and leaves its full gradient to reduce
        buffers = 2.0 * max(sum(ch["unit_bytes"]) for ch in chunks)
    else:
        buffers = 2.0 * max(b for ch in chunks for b in ch["unit_bytes"])
    peak = static + max(_activations(shape, chunks, held, v) + buffers, 0.0)
    owners = [j for j, x in enumerate(work) if x[1] > 0]
    return {"W": steady, "W1": first, "E": exposed, "opt": opt, "peak": peak, "ns": max(x[0] for x in work),
            "idle": 1 - len(owners) / len(work)}


def _rank_chunks(schedule: str, pp: int, v: int, r: int) -> list[int]:
    """The chunks rank ``r`` runs: ``r, r + PP, ...`` in loop order, ``r`` and ``2 PP - 1 - r`` in a V."""
    return [r, 2 * pp - 1 - r] if schedule in V_SCHEDULES else list(range(r, pp * v, pp))


def _split_shares(schedule: str, pp: int, m: int, v: int, r: int) -> tuple[float, ...]:
    """Per chunk of rank ``r``: the share of micro-batches whose backward runs split (none on stage 0,
    whose weight part torch runs as a whole backward; DualPipeV's steady pairs run whole backwards)."""
    if schedule in V_SCHEDULES:
        return split_share(schedule, pp, m, r)
    if schedule == "InterleavedZeroBubble":
        return tuple(0.0 if k == 0 else 1.0 for k in _rank_chunks(schedule, pp, v, r))
    return (0.0,) * v


# ---------------------------------------------------------------- rows
def predict_pp_mode(shape: ModelShape, c: Cluster, pp: int, m: int = 1, schedule: str = "1F1B", v: int = 1,
                    placement: str = "across", weights: str = "keep", inner: str = "matrix_fsdp_auto",
                    planner: str = "role_greedy") -> dict[str, Any]:
    """One row: the step of ``PP`` stages x owner sharding over each stage's ``D = world / PP``
    ranks, ``m`` micro-batches of ``batch`` sequences per pipeline replica. At ``PP = m = 1`` it is
    ``predict_mode(inner)`` to the last digit (tests/test_predict_pp.py checks it)."""
    check_pipeline(schedule, pp, m, v)
    if weights not in WEIGHTS:
        raise PredictError(f"unknown weights policy {weights!r}; known: {', '.join(WEIGHTS)}")
    if weights == "keep" and schedule in SPLIT_SCHEDULES:
        raise PredictError(f"{schedule} splits each backward into an input and a weight part, and our runtime "
                           "materializes a stage's weights for each part and reduces after each weight part "
                           "(runtime/pipeline/split_backward.py): weights='keep' is not how it runs; use 'regather'")
    if inner not in INNER_MODES:
        raise PredictError(f"unknown stage mode {inner!r}; known: {', '.join(INNER_MODES)}")
    view, crosses = stage_view(c, pp, placement)
    counts = chunk_blocks(shape, pp * v)
    bounds = [sum(counts[:k]) for k in range(pp * v + 1)]
    n = pp * v
    chunks = [_chunk(shape, c, view, bounds[k], bounds[k + 1], k == 0, k == n - 1, inner, planner) for k in range(n)]
    tau = p2p_seconds(shape, c, pp, placement, crosses)
    ranks = [_rank(shape, c, [chunks[k] for k in _rank_chunks(schedule, pp, v, r)], m, tau, weights,
                   in_flight(schedule, pp, m, v, r), v, _split_shares(schedule, pp, m, v, r)) for r in range(pp)]
    busiest = max(range(pp), key=lambda r: ranks[r]["W1"])
    mean = [sum(ch[k] for ch in chunks) / n for k in ("f", "b", "w")]
    idle = bubble(schedule, pp, mean[0] + tau, mean[1] + tau, mean[2], m)
    pipe = (m - 1) * max(r["W"] for r in ranks) + ranks[busiest]["W1"] + idle \
        + sum(r["E"] for i, r in enumerate(ranks) if i != busiest)
    opt = max(r["opt"] for r in ranks)
    act = activation_bytes_per_microbatch(shape)
    row: dict[str, Any] = {
        "mode": f"pp_{inner}", "schedule": schedule, "pp": pp, "dp": view.world, "v": v, "microbatches": m,
        "placement": placement, "weights": weights, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
        "world": c.world, "span": chunks[0]["span"], "replicas": chunks[0]["replicas"], "chosen": chunks[0]["chosen"],
        "global_batch": view.world * m * shape.batch, "blocks_per_chunk": counts,
        "p2p_bytes_per_microbatch": act if pp > 1 else 0, "p2p_bytes_per_step": 2 * v * m * act if pp > 1 else 0,
        "p2p_link": ("inter-node" if crosses else "NVLink") if pp > 1 else "none", "p2p_ms": tau * 1e3,
        "note": DUALPIPEV_NOTE if schedule == "DualPipeV" else "", "bubble_ms": idle * 1e3, "bubble_frac": bubble_fraction(schedule, pp, m, v, *mean) if pp > 1 else 0.0,
        "idle_owner_frac": max(r["idle"] for r in ranks), "busiest_ns_tflop": max(r["ns"] for r in ranks) / 1e12,
        "max_gamma": round(max(ch["plan"].max_gamma for ch in chunks), 3),
        "pipe_ms": pipe * 1e3, "opt_ms": opt * 1e3, "total_ms": (pipe + opt) * 1e3,
        "peak_gib": max(r["peak"] for r in ranks) / GIB,
    }
    row["fits"] = row["peak_gib"] <= c.gpu_mem_gib
    return row


def owner_alone(shape: ModelShape, c: Cluster, seqs: int, inner: str = "matrix_fsdp_auto",
                planner: str = "role_greedy") -> dict[str, Any]:
    """Owner sharding without PP at ``seqs`` sequences of ``batch`` per GPU and step: one pass of
    ``seqs batch`` sequences, or ``seqs`` accumulated passes of ``batch`` (each materializing and
    reducing, as ZeRO-3 without no-sync does) when the single pass does not fit; the faster that fits."""
    one = predict_mode(inner, replace(shape, batch=shape.batch * seqs), c, planner=planner)
    acc = predict_mode(inner, shape, c, planner=planner)
    acc = {**acc, "total_ms": seqs * (acc["fwd_ms"] + acc["bwd_ms"]) + acc["opt_ms"], "accumulation": seqs}
    pick = one if one["fits"] or not acc["fits"] else acc
    if pick is one:
        pick = {**one, "accumulation": 1}
    return {**pick, "pipe_ms": pick["total_ms"] - pick["opt_ms"], "global_batch": c.world * seqs * shape.batch}
