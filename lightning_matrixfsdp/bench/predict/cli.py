"""`python -m lightning_matrixfsdp.bench predict`: the command line of the step-time predictor,
its calibration on the measured H200 runs, the comparison with the MatrixFSDP paper's
Table 3, and the report and plot of docs/benchmarks.md ("Predicted step times").

    python -m lightning_matrixfsdp.bench predict --model paper --cluster a100-ib --nodes 1 2 4 8
    python -m lightning_matrixfsdp.bench predict --model 7b --nodes 1 2 4 8 16 --json out.json
    python -m lightning_matrixfsdp.bench predict --calibration docs/results
    python -m lightning_matrixfsdp.bench predict --report OUT --plot docs/predict-scaling.png
    python -m lightning_matrixfsdp.bench predict --model 32b --cluster a100-ib --tp 1 2 4 8 --nodes 1 4 16
    python -m lightning_matrixfsdp.bench predict --tp-table
    python -m lightning_matrixfsdp.bench predict --model 7b --cluster a100-ib --gpus-per-node 8 --nodes 256 --pp 2 4 \
        --microbatches 8 --schedule InterleavedZeroBubble --virtual 2 --pp-weights regather
    python -m lightning_matrixfsdp.bench predict --pp-table
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_matrixfsdp.runtime.placement import RoleKind

from .cluster import CALIBRATION_SOURCES, CLUSTERS, H200_HBM_GBS, Cluster, ClusterError, cluster, h200
from .modes import AUTO_ALTERNATIVES, AUTO_MODES, MODES, SHAPES, ModelShape, PredictError, forward_flops, newton_schulz_flops, plan_for, \
    predict, predict_mode, shape_from_bench_config, stock_collectives, table
from .pipeline import INNER_MODES, PLACEMENTS, PP_SCHEDULES, WEIGHTS, predict_pp_mode
from .pp_table import compare, compare_markdown, pp_markdown
from .tp import TP_MODES, predict_tp, tp_markdown, tp_strong_markdown

# The six modes measured on H200 that the predictor models (the calibration's modes).
CALIBRATED_MODES = ("fsdp2_adamw", "fsdp2_muon", "fsdp2_gather_once", "zero1_owner", "ddp_muon", "matrix_fsdp")
MEASURED_NAME = {"matrix_fsdp": "matrix_fsdp_p2p"}
# The MatrixFSDP paper, Table 3 (8 x A100-80GB per node, InfiniBand, span = world, 16 layers
# per node): nodes -> (stock opt, MatrixFSDP opt, stock total, MatrixFSDP total), ms.
PAPER_TABLE3 = {1: (367, 87, 991, 725), 2: (1285, 89, 2612, 1489), 4: (3079, 91, 5788, 2689),
                8: (5064, 93, 10004, 4989)}
WEAK_LAYERS = {"paper": 16}
DEFAULT_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
CALIBRATION_FILE = "2026-11-30-h200-aa2fc35-calibration/calibration.json"


# ---------------------------------------------------------------- calibration
def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"calibration input {path} is missing")
    return json.loads(path.read_text())


def calibration_runs(results: Path) -> dict[str, dict[str, Any]]:
    """The measurements the calibration reads, by short name: the fields it uses of the files
    CALIBRATION_SOURCES names, copied into one small file (its ``sources`` names them too)."""
    return _load(results / CALIBRATION_FILE)


def calibrate(results: Path = DEFAULT_RESULTS) -> dict[str, float]:
    """Fit the constants of `CALIBRATION_SOURCES`, each on its own measurement."""
    runs = calibration_runs(Path(results))
    w1, w2 = runs["w1"], runs["w2"]
    shape = shape_from_bench_config(w1["config"])
    fwd = sorted(w1["modes"][MEASURED_NAME.get(m, m)]["time_ms"]["forward"] for m in CALIBRATED_MODES)
    median_fwd = (fwd[len(fwd) // 2] + fwd[(len(fwd) - 1) // 2]) / 2
    model_eff = forward_flops(shape) / (median_fwd * 1e-3) / (w1["meta"]["matmul_bf16_tflops"] * 1e12)

    def ns_eff(prefix: str) -> float:
        flops = secs = 0.0
        for row in runs["ortho"]["rows"]:
            if row["method"].startswith(prefix) and min(row["shape"]) >= 4096:
                flops, secs = flops + newton_schulz_flops(row["shape"], 5), secs + row["ms"] * 1e-3
        return flops / secs / (runs["ortho"]["matmul_bf16_tflops"] * 1e12)

    hbm = H200_HBM_GBS * 1e9
    adamw = w1["modes"]["fsdp2_adamw"]["time_ms"]["optimizer_step"] * 1e-3 * hbm / w1["meta"]["parameters"]
    # The profile stepped rank 0's owner set of the two-GPU plan: its matrices and AdamW tensors.
    mat = sum(s.numel for s in plan_for(shape, 2).shards() if s.owner == 0 and s.role is RoleKind.MATRIX)
    step = runs["profile"]["whole_step"]["ms"]
    rest_ms = step["torch.optim.Muon + AdamW"] - step["ns only (stock function)"]
    n_all = runs["profile"]["step_agreement"]["ours default"]["of"]
    muon = (rest_ms * 1e-3 * hbm - (n_all - mat) * adamw) / mat
    fit = dict(model_eff=model_eff, ns_eff_ours=ns_eff("newton_schulz (default"),
               ns_eff_stock=ns_eff("newton_schulz blocks=1"), muon_bpp=muon, adamw_bpp=adamw)
    # Host time per DTensor collective: stock Muon's measured two-GPU step minus the rest of its model.
    c = h200(1, 2, w2["meta"]["matmul_bf16_tflops"]).with_(dispatch_us=0.0, **fit)
    rest = predict_mode("fsdp2_muon", shape, c)["opt_ms"]
    measured = w2["modes"]["fsdp2_muon"]["time_ms"]["optimizer_step"]
    fit["dispatch_us"] = (measured - rest) * 1e3 / stock_collectives(shape, 2)
    return fit


# (run, mode) whose optimizer step a constant was fitted on; the one-GPU forwards are pooled for model_eff.
FITTED_STEPS = {("w1", "fsdp2_adamw"), ("w2", "fsdp2_muon")}


def fit_role(run: str, mode: str, phase: str) -> str:
    """Whether a calibration cell was fitted, contains a fitted phase, or is a check."""
    if run == "w1" and phase == "fwd_ms":
        return "fit (pooled: median of the six)"
    if (run, mode) in FITTED_STEPS and phase == "opt_ms":
        return "fit"
    if phase == "total_ms" and (run == "w1" or (run, mode) in FITTED_STEPS):
        return "contains a fitted phase"
    return "check"


def calibration_table(results: Path = DEFAULT_RESULTS, base: Cluster | None = None) -> list[dict[str, Any]]:
    """Predicted against measured, per run, mode and phase, each cell marked fit or check."""
    runs = calibration_runs(Path(results))
    rows = []
    for key, gpus in (("w1", 1), ("w2", 2)):
        run = runs[key]
        shape = shape_from_bench_config(run["config"])
        c = (base or h200()).with_(gpus_per_node=gpus, nodes=1, matmul_tflops=run["meta"]["matmul_bf16_tflops"])
        for mode in CALIBRATED_MODES:
            pred = predict_mode(mode, shape, c)
            meas = run["modes"][MEASURED_NAME.get(mode, mode)]
            t = meas["time_ms"]
            measured = {"fwd_ms": t["forward"], "bwd_ms": t["backward"], "opt_ms": t["optimizer_step"],
                        "total_ms": t["total"], "peak_gib": meas["memory"]["max_bytes"] / 2**30}
            for phase, value in measured.items():
                rows.append({"run": f"{gpus} x H200", "mode": mode, "phase": phase, "predicted": pred[phase],
                             "measured": value, "ratio": pred[phase] / value, "role": fit_role(key, mode, phase)})
    return rows


def calibration_markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| run | mode | fwd | bwd | opt | total | peak GiB |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    cells: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        mark = "" if r["role"] == "check" else (" (fit)" if r["role"].startswith("fit") else " (incl. fit)")
        cells.setdefault((r["run"], r["mode"]), []).append(
            f"{r['predicted']:.1f} / {r['measured']:.1f} = {r['ratio']:.2f}{mark}")
    for (run, mode), c in cells.items():
        out.append(f"| {run} | {mode} | " + " | ".join(c) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------- the paper and the sweeps
def paper_comparison(base: Cluster) -> list[dict[str, Any]]:
    """Predicted / published for every cell of the paper's Table 3 (ours: broadcast and p2p)."""
    rows = predict(SHAPES["paper"], base, sorted(PAPER_TABLE3), ("fsdp2_muon", "matrix_fsdp_broadcast", "matrix_fsdp"),
                   layers_per_node=WEAK_LAYERS["paper"])
    out = []
    for nodes, (s_opt, m_opt, s_tot, m_tot) in sorted(PAPER_TABLE3.items()):
        by = {r["mode"]: r for r in rows if r["nodes"] == nodes}
        stock, bc, p2p = by["fsdp2_muon"], by["matrix_fsdp_broadcast"], by["matrix_fsdp"]
        out.append({"nodes": nodes, "layers": stock["layers"],
                    "stock_opt": [stock["opt_ms"], s_opt], "ours_opt": [bc["opt_ms"], m_opt],
                    "stock_total": [stock["total_ms"], s_tot], "ours_total_broadcast": [bc["total_ms"], m_tot],
                    "ours_total_p2p": [p2p["total_ms"], m_tot]})
    return out


def paper_markdown(rows: list[dict[str, Any]]) -> str:
    keys = ("stock_opt", "ours_opt", "stock_total", "ours_total_broadcast", "ours_total_p2p")
    out = ["| nodes (span) | layers | stock opt | MatrixFSDP opt | stock total | MatrixFSDP total (broadcast) "
           "| MatrixFSDP total (p2p) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cells = [f"{r[k][0]:.0f} / {r[k][1]} = **{r[k][0] / r[k][1]:.2f}**" for k in keys]
        out.append(f"| {r['nodes']} ({8 * r['nodes']}) | {r['layers']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_report(out: Path, plot: Path | None = None, results: Path = DEFAULT_RESULTS) -> dict[str, Any]:
    """Everything docs/benchmarks.md's "Predicted step times" cites, as JSON and markdown in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    a100 = cluster("a100-ib")
    report: dict[str, Any] = {
        "fit": calibrate(results), "fit_sources": CALIBRATION_SOURCES, "calibration": calibration_table(results),
        "paper": {"a100-ib": paper_comparison(a100), "a100-ib8": paper_comparison(cluster("a100-ib8"))},
        "clusters": {name: cluster(name).to_dict() for name in CLUSTERS},
        "weak_hsdp": predict(SHAPES["paper"], a100, [1, 2, 4, 8, 16], ("fsdp2_adamw", "fsdp2_muon",
                             "matrix_fsdp_broadcast", "matrix_fsdp_hsdp", "matrix_fsdp_hsdp_split"),
                             layers_per_node=WEAK_LAYERS["paper"]),
        "7b": predict(SHAPES["7b"], a100, [1, 2, 4, 8, 16]),
        "32b": predict(SHAPES["32b"], a100, [1, 2, 4, 8, 16]),
        "models": {k: SHAPES[k].to_dict() for k in ("paper", "7b", "32b", "onenode")},
    }
    (out / "predict.json").write_text(json.dumps(report, indent=1))
    md = ["# Predicted step times", "", "## Calibration (predicted / measured)", "",
          calibration_markdown(report["calibration"]), "",
          "## The paper's Table 3 (predicted / published), a100-ib", "",
          paper_markdown(report["paper"]["a100-ib"]), "", "## Same, a100-ib8", "",
          paper_markdown(report["paper"]["a100-ib8"]), ""]
    for key in ("weak_hsdp", "7b", "32b"):
        md += [f"## {key}", "", table(report[key]), ""]
    (out / "predict.md").write_text("\n".join(md))
    if plot is not None:
        plot_scaling(report, plot)
    return report


def plot_scaling(report: dict[str, Any], path: Path) -> None:
    """Total ms per step against nodes: the weak-scaling sweep (with the paper's published
    totals), 7B and 32B, on a100-ib; one colour per mode across the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(MODES, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    panels = (("weak_hsdp", "weak scaling: 16 layers per node (paper shape, 2 NS steps)"),
              ("7b", "7B (32 layers, h 4096), fixed"), ("32b", "32B (64 layers, h 5120), fixed"))
    for ax, (key, title) in zip(axes, panels):
        rows = report[key]
        for mode in MODES:
            pts = [(r["nodes"], r["total_ms"]) for r in rows if r["mode"] == mode and r["fits"]]
            if pts:
                style = "-" if mode.startswith("matrix_fsdp") else "--"
                ax.plot(*zip(*pts), style, marker="o", color=colours[mode], label=mode)
        ax.set(xscale="log", yscale="log", xlabel="nodes (8 x A100-80GB each)", ylabel="predicted ms per step",
               title=title)
        others = [r["total_ms"] for r in rows if r["fits"] and r["mode"] != "matrix_fsdp"]
        if any(r["total_ms"] > 2 * max(others) for r in rows if r["mode"] == "matrix_fsdp"):
            ax.set_ylim(top=2 * max(others))  # the p2p fanout over nodes would flatten the rest
            ax.text(0.02, 0.97, "matrix_fsdp (p2p, span = world) leaves the chart above", transform=ax.transAxes,
                    fontsize=8, va="top")
        ax.set_xticks([1, 2, 4, 8, 16], labels=["1", "2", "4", "8", "16"])
        ax.grid(True, which="both", alpha=0.3)
    nodes = sorted(PAPER_TABLE3)
    axes[0].plot(nodes, [PAPER_TABLE3[n][2] for n in nodes], "kx", ms=9, label="paper: stock total (published)")
    axes[0].plot(nodes, [PAPER_TABLE3[n][3] for n in nodes], "k+", ms=11, label="paper: MatrixFSDP total (published)")
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=6, fontsize=8)
    fig.suptitle("Predicted step time per mode (a100-ib: 4 x HDR per node; configurations over 79 GiB omitted)")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    _palette_png(path)


def _palette_png(path: Path) -> None:
    """Rewrite a plot as a 64-colour palette PNG (a third of the size, as legible: docs/ keeps it)."""
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


# ---------------------------------------------------------------- command line
AUTO_MODELS, AUTO_CLUSTERS, AUTO_NODES = ("paper", "7b", "32b"), ("a100-ib", "h200"), (1, 2, 4, 8, 16)


def auto_comparison(models: Sequence[str] = AUTO_MODELS, clusters: Sequence[str] = AUTO_CLUSTERS,
                    nodes: Sequence[int] = AUTO_NODES) -> list[dict[str, Any]]:
    """Per (model, cluster, nodes, auto mode): auto's predicted total against the best of the
    explicit choices it picks among (``AUTO_ALTERNATIVES``); ``ratio`` = auto / best."""
    out = []
    for name in models:
        for cl in clusters:
            modes = [m for a in AUTO_MODES for m in (a, *AUTO_ALTERNATIVES[a])]
            rows = predict(SHAPES[name], cluster(cl), list(nodes), modes, layers_per_node=WEAK_LAYERS.get(name))
            by = {(r["mode"], r["nodes"]): r for r in rows}
            for k in nodes:
                for a in AUTO_MODES:
                    best = min(AUTO_ALTERNATIVES[a], key=lambda m: by[(m, k)]["total_ms"])
                    auto = by[(a, k)]
                    out.append({"model": name, "cluster": cl, "nodes": k, "mode": a, "chosen": auto["chosen"],
                                "auto_ms": auto["total_ms"], "best": best, "best_ms": by[(best, k)]["total_ms"],
                                "ratio": auto["total_ms"] / by[(best, k)]["total_ms"]})
    return out


def auto_markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as a markdown table (docs/benchmarks.md)."""
    lines = ["| model | cluster | nodes | auto mode | auto picks | auto ms | best explicit | best ms | auto / best |",
             "| --- | --- | ---: | --- | --- | ---: | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['cluster']} | {r['nodes']} | {r['mode']} | {r['chosen']} | "
                     f"{r['auto_ms']:.1f} | {r['best']} | {r['best_ms']:.1f} | {r['ratio']:.3f} |")
    return "\n".join(lines)


TP_MODELS, TP_SIZES, TP_GLOBAL_BATCH = ("7b", "32b"), (1, 2, 4, 8), 16


def tp_tables(models: Sequence[str] = TP_MODELS, nodes: Sequence[int] = AUTO_NODES) -> str:
    """The TP modes at T = 1, 2, 4, 8 on 1-16 nodes of 8 GPUs (a100-ib and h200 with 8 per node):
    one sequence per GPU; then one global batch of 16 sequences (one per TP group) on 2 T nodes."""
    out = []
    clusters = (cluster("a100-ib"), cluster("h200", gpus_per_node=8))
    for name in models:
        for cl in clusters:
            out += [f"{name}, {cl.name} ({cl.gpus_per_node} GPUs per node), one sequence per GPU: "
                    "total ms (optimizer-step ms) peak GiB", "",
                    tp_markdown(predict_tp(SHAPES[name], cl, list(nodes), TP_MODES, TP_SIZES)), ""]
    for name in models:
        for cl in clusters:
            rows = [r for t in TP_SIZES for r in predict_tp(SHAPES[name], cl, [TP_GLOBAL_BATCH * t // cl.gpus_per_node],
                                                            TP_MODES, (t,), per_group=True)]
            out += [f"{name}, {cl.name}, a global batch of {TP_GLOBAL_BATCH} sequences (one per TP group): "
                    "total ms (optimizer-step ms) peak GiB", "", tp_strong_markdown(rows), ""]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_matrixfsdp.bench predict", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="onenode", choices=sorted(SHAPES))
    p.add_argument("--cluster", default="h200", choices=sorted(CLUSTERS))
    p.add_argument("--nodes", type=int, nargs="+", default=[1])
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--modes", nargs="+", help=f"known: {', '.join(MODES + AUTO_MODES)}; with --tp: {', '.join(TP_MODES)}")
    p.add_argument("--tp", type=int, nargs="+", help="tensor-parallel sizes (inside a node): predict the TP modes")
    p.add_argument("--tp-batch", choices=("gpu", "group"), default="gpu",
                   help="with --tp: --batch sequences per GPU (default) or per TP group (TP adds GPUs to one batch)")
    p.add_argument("--shard-size", type=int, help="HSDP span W (default: GPUs per node)")
    p.add_argument("--planner", default="role_greedy")
    p.add_argument("--layers-per-node", type=int, help="weak scaling: layers = this x nodes")
    p.add_argument("--json", dest="json_path", help="also write the rows to this file")
    p.add_argument("--measure", action="store_true", help="probe the matmul rate on this machine's GPU")
    p.add_argument("--calibration", nargs="?", const=str(DEFAULT_RESULTS), help="predicted vs measured H200 runs")
    p.add_argument("--auto-table", action="store_true",
                   help="auto (the defaults) against the best explicit choice: paper, 7b, 32b on a100-ib, h200")
    p.add_argument("--tp-table", action="store_true",
                   help="the TP modes for 7b and 32b at T = 1, 2, 4, 8 on 1-16 nodes (a100-ib, h200 x 8)")
    p.add_argument("--pp", type=int, nargs="+", help="pipeline-parallel sizes: predict PP x owner sharding per stage")
    p.add_argument("--microbatches", type=int, default=1, help="with --pp: micro-batches of --batch per step")
    p.add_argument("--schedule", default="1F1B", help=f"with --pp: {', '.join(PP_SCHEDULES)}")
    p.add_argument("--virtual", type=int, default=1, help="with --pp: stages per rank (interleaved "
                   "schedules; 2 for ZBVZeroBubble and DualPipeV)")
    p.add_argument("--placement", default="across", choices=PLACEMENTS, help="with --pp: neighbouring stages on "
                   "other nodes (across) or on the same node (within)")
    p.add_argument("--pp-weights", default="keep", choices=WEIGHTS, help="with --pp: keep a stage's weights "
                   "materialized over the micro-batches (a what-if: our runtime regathers) or regather them per micro-batch "
                   "(the split-backward schedules: regather only)")
    p.add_argument("--stage-mode", default="matrix_fsdp_auto", choices=INNER_MODES, help="with --pp: the stage's sharding")
    p.add_argument("--pp-table", action="store_true", help="PP x owner sharding against owner sharding alone: "
                   "paper (128 layers), 7b, 32b on a100-ib, 8-256 nodes of 8 GPUs, 1 and 4 sequences per GPU")
    p.add_argument("--report", help="write the docs' JSON and markdown into this folder")
    p.add_argument("--plot", help="with --report: the PNG (needs the 'bench' extra: matplotlib)")
    m = p.add_argument_group("model shape")
    for flag, dest in (("--hidden", "hidden"), ("--mlp", "mlp"), ("--layers", "layers"), ("--heads", "heads"),
                       ("--kv-heads", "kv_heads"), ("--seq-len", "seq_len"), ("--vocab", "vocab"),
                       ("--batch", "batch"), ("--ns-steps", "ns_steps")):
        m.add_argument(flag, dest=dest, type=int)
    m.add_argument("--gated", action=argparse.BooleanOptionalAction, default=None)
    m.add_argument("--ac", action=argparse.BooleanOptionalAction, default=None)
    c = p.add_argument_group("cluster")
    for flag in ("matmul-tflops", "hbm-gbs", "intra-gbs", "intra-lat-us", "inter-gbs", "inter-lat-us", "dispatch-us",
                 "gpu-mem-gib"):
        c.add_argument(f"--{flag}", dest=flag.replace("-", "_"), type=float)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.report:
            write_report(Path(args.report), Path(args.plot) if args.plot else None)
            extra = f", {args.plot}" if args.plot else ""
            print(f"[predict] wrote {args.report}/predict.json and predict.md{extra}")
            return 0
        if args.auto_table:
            print(auto_markdown(auto_comparison()))
            return 0
        if args.tp_table:
            print(tp_tables())
            return 0
        if args.pp_table:
            print(compare_markdown(compare()))
            return 0
        if args.calibration:
            print(calibration_markdown(calibration_table(Path(args.calibration))))
            return 0
        shape = replace(SHAPES[args.model], **{k: getattr(args, k) for k in ModelShape.__dataclass_fields__
                                               if k != "name" and getattr(args, k, None) is not None})
        base = cluster(args.cluster)
        changes = {k: getattr(args, k) for k in Cluster.__dataclass_fields__
                   if k not in ("name", "nodes") and getattr(args, k, None) is not None}
        if args.measure:
            import torch

            from ..timing import matmul_tflops

            if not torch.cuda.is_available():
                raise ClusterError("--measure needs a CUDA GPU on this machine")
            changes["matmul_tflops"] = matmul_tflops(torch.device("cuda"))
        base = base.with_(**changes)
        modes = args.modes or list(TP_MODES if args.tp else MODES)
        if args.pp:
            if args.tp or args.modes or args.layers_per_node or args.shard_size:
                raise PredictError("--pp predicts PP x owner sharding (--stage-mode): drop --tp, --modes, "
                                   "--layers-per-node and --shard-size")
            rows = [predict_pp_mode(shape, base.with_(nodes=k), p, args.microbatches, args.schedule, args.virtual,
                                    args.placement, args.pp_weights, args.stage_mode, args.planner)
                    for p in args.pp for k in args.nodes]
            render = pp_markdown
        elif args.tp or any(m in TP_MODES for m in modes):
            if args.layers_per_node or args.shard_size:
                raise PredictError("--tp models a fixed depth over all GPUs: drop --layers-per-node and --shard-size")
            rows = predict_tp(shape, base, args.nodes, modes, args.tp or [1], args.planner, args.tp_batch == "group")
            render = tp_markdown
        else:
            weak = args.layers_per_node or (WEAK_LAYERS.get(args.model) if args.layers is None else None)
            rows = predict(shape, base, args.nodes, modes, args.shard_size, weak, args.planner)
            render = table
    except (PredictError, ClusterError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model {shape.name}: {json.dumps(shape.to_dict())}")
    print(f"cluster {base.name}: {json.dumps(base.to_dict())}")
    print(render(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"model": shape.to_dict(), "cluster": base.to_dict(),
                                                    "rows": rows}, indent=1))
    return 0
