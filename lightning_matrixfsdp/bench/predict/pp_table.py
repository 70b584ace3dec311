"""When does PP x owner sharding beat owner sharding alone? The sweep behind
``python -m lightning_matrixfsdp.bench predict --pp-table`` and docs/pipeline-parallel.md.

Both sides train the same global batch: ``seqs`` sequences of ``batch`` per GPU and step. Owner
sharding alone runs them as one pass or as accumulated passes (`owner_alone`); PP runs each
pipeline replica's ``PP seqs`` sequences as that many micro-batches of ``batch``. For each
configuration the fastest choice that fits in GPU memory is taken on each side: the stage mode
(``collective="auto"`` over the stage, or HSDP inside it), the schedule, the placement of the
stages and the weights policy; PP sizes are the powers of two that divide the world and leave a
block per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .cluster import Cluster, cluster
from .pipeline import INNER_MODES, PLACEMENTS, WEIGHTS, owner_alone, predict_pp_mode
from .shape import SHAPES, ModelShape, PredictError

__all__ = ["PP_CHOICES", "PP_MODELS", "PP_NODES", "best_pp", "best_pp_both", "compare", "compare_markdown", "pp_markdown"]

PP_MODELS, PP_NODES, PP_SEQS = ("paper", "7b", "32b"), (8, 16, 32, 64, 128, 256), (1, 4)
#: (schedule, virtual stages per rank) the sweep tries
PP_CHOICES = (("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2))
#: the paper's block at its largest published depth (8 nodes x 16 layers), held fixed: weak scaling to
#: 256 nodes would be a 4096-layer, 819B-parameter model
FIXED_LAYERS = {"paper": 128}


def _sizes(shape: ModelShape, c: Cluster, largest: int) -> list[int]:
    out, p = [], 2
    while p <= largest and c.world % p == 0 and p <= shape.layers:
        out.append(p)
        p *= 2
    return out


def best_pp(shape: ModelShape, c: Cluster, seqs: int, largest: int = 16,
            choices: Sequence[tuple[str, int]] = PP_CHOICES, weights: Sequence[str] = WEIGHTS) -> dict[str, Any] | None:
    """The fastest PP row that fits (``None`` if none does) at ``seqs`` sequences per GPU."""
    return best_pp_both(shape, c, seqs, largest, choices, weights)[0]


def best_pp_both(shape: ModelShape, c: Cluster, seqs: int, largest: int = 16,
                 choices: Sequence[tuple[str, int]] = PP_CHOICES, weights: Sequence[str] = WEIGHTS
                 ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the fastest PP row that fits, the fastest that fits as our runtime runs it: ``regather``,
    each micro-batch reduced) in one sweep; ``None`` where none fits."""
    best = run = None
    for pp in _sizes(shape, c, largest):
        for schedule, v in choices:
            if pp * v > shape.layers:
                continue
            for placement in PLACEMENTS:
                for policy in weights:
                    for inner in INNER_MODES:
                        try:
                            row = predict_pp_mode(shape, c, pp, pp * seqs, schedule, v, placement, policy, inner)
                        except PredictError:  # a placement, stage mode or weights policy this case cannot take
                            continue
                        if row["fits"] and (best is None or row["total_ms"] < best["total_ms"]):
                            best = row
                        if row["fits"] and policy == "regather" and (run is None or row["total_ms"] < run["total_ms"]):
                            run = row
    return best, run


def compare(models: Sequence[str] = PP_MODELS, clusters: Sequence[str] = ("a100-ib",),
            nodes: Sequence[int] = PP_NODES, seqs: Sequence[int] = PP_SEQS, largest: int = 16) -> list[dict[str, Any]]:
    """Per (model, cluster, nodes, sequences per GPU): owner sharding alone against the best PP."""
    out = []
    for name in models:
        for cl in clusters:
            base = cluster(cl, gpus_per_node=8)
            for k in nodes:
                c = base.with_(nodes=k)
                shape = replace(SHAPES[name], layers=FIXED_LAYERS.get(name, SHAPES[name].layers))
                for a in seqs:
                    alone = [owner_alone(shape, c, a, inner) for inner in INNER_MODES]
                    fit = [r for r in alone if r["fits"]] or alone
                    ref = min(fit, key=lambda r: r["total_ms"])
                    pp, run = best_pp_both(shape, c, a, largest)
                    out.append({"model": name, "cluster": cl, "nodes": k, "layers": shape.layers, "seqs": a,
                                "global_batch": ref["global_batch"], "alone": ref, "pp": pp, "pp_run": run,
                                "speedup": ref["total_ms"] / pp["total_ms"] if pp else None,
                                "speedup_run": ref["total_ms"] / run["total_ms"] if run else None})
    return out


def _label(row: dict[str, Any]) -> str:
    """``schedule (v)``, with DualPipeV's missing overlap said where it is shown."""
    return f"{row['schedule']} ({row['v']}{', no overlap' if row['schedule'] == 'DualPipeV' else ''})"


def _ratio(x: float) -> str:
    return f"**{x:.2f}**" if x > 1 else f"{x:.2f}"


def compare_markdown(rows: list[dict[str, Any]]) -> str:
    """One line per comparison: alone ms (mode), best PP ms (PP x D, schedule, placement, weights),
    its bubble, peak GiB and the speed-up (alone / PP; above 1: PP wins); then the best PP as our
    runtime runs it (``regather``): its ms, PP x D and schedule, and alone / that."""
    lines = ["| model | cluster | nodes | layers | seq/GPU | alone ms | alone mode | alone GiB | best PP ms "
             "| PP x D | schedule (v) | placement, weights | bubble | PP GiB | alone / PP "
             "| as run ms | as run: PP x D, schedule (v) | alone / as run |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: "
             "| ---: | --- | ---: |"]
    for r in rows:
        a, p = r["alone"], r["pp"]
        acc = f" x{a['accumulation']} acc" if a.get("accumulation", 1) > 1 else ""
        head = (f"| {r['model']} | {r['cluster']} | {r['nodes']} | {r['layers']} | {r['seqs']} | {a['total_ms']:.0f} | "
                f"{a.get('chosen', a['mode'])}{acc} | {a['peak_gib']:.1f}{'' if a['fits'] else ' no fit'} | ")
        q = r.get("pp_run")
        tail = (f" {q['total_ms']:.0f} | {q['pp']} x {q['dp']}, {_label(q)} | {_ratio(r['speedup_run'])} |" if q
                else " no fit | | |")
        if p is None:
            lines.append(head + "no fit | | | | | |" + tail)
            continue
        lines.append(head + f"{p['total_ms']:.0f} | {p['pp']} x {p['dp']} | {_label(p)} | "
                     f"{p['placement']}, {p['weights']}, {p['chosen']} | {p['bubble_frac']:.2f} | {p['peak_gib']:.1f} | "
                     f"{_ratio(r['speedup'])} |" + tail)
    return "\n".join(lines)


def pp_markdown(rows: list[dict[str, Any]]) -> str:
    """Rows of `predict_pp_mode` as a table (the command line's ``--pp``)."""
    lines = ["| nodes | PP x D | schedule (v) | m | placement | weights | stage mode | pipe ms | bubble ms "
             "| bubble | p2p ms/mb | opt ms | total ms | idle owners | peak GiB | fits |",
             "| ---: | --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['nodes']} | {r['pp']} x {r['dp']} | {_label(r)} | {r['microbatches']} | "
                     f"{r['placement']} | {r['weights']} | {r['chosen']} | {r['pipe_ms']:.1f} | {r['bubble_ms']:.1f} | "
                     f"{r['bubble_frac']:.3f} | {r['p2p_ms']:.2f} | {r['opt_ms']:.1f} | {r['total_ms']:.1f} | "
                     f"{r['idle_owner_frac']:.2f} | {r['peak_gib']:.2f} | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)
