"""The predictor's communication: one unit's materialization (or reduction) per mode,
``replica_split``'s exchange, and the FSDP-style overlap of a pass over the units."""

from __future__ import annotations

from lightning_matrixfsdp.runtime.placement import Plan, UnitLayout, UnitSpec
from lightning_matrixfsdp.runtime.replicas.comm import CHUNK_BYTES, chain_end
from lightning_matrixfsdp.runtime.replicas.assign import assign_steppers

from .cluster import Cluster
from .shape import ModelShape, unit_specs

__all__ = ["pipeline", "split_exchange", "unit_comm"]


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


def split_exchange(plan: Plan, shape: ModelShape, c: Cluster, replicas: int, units: tuple[UnitSpec, ...] | None = None
                   ) -> tuple[list[list[float]], list[list[float]]]:
    """Seconds per unit and per GPU (replica k, shard rank r) of ``replica_split``'s exchange
    (runtime/replicas/comm.py): the backward's reduction chain and the broadcast of the updated
    weights after the step. The chain runs in replica order ``0 -> ... -> m`` (``chain_end``), in
    chunks of ``CHUNK_BYTES``: a GPU sends every role once except where it steps the role and the
    chain ends there, receives it on replicas ``1 .. m``, and the stepper receives one more copy (the
    final sum or the last replica's part) where the chain does not end on it. The broadcast moves
    each byte of the GPU's owned roles once through its share of the NICs."""
    steppers = assign_steppers(plan, list(units or unit_specs(shape)), replicas, shape.ns_steps)[0]
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
