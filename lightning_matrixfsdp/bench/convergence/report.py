"""The convergence benchmark's report: per-cell summary over seeds, the fast-vs-default
verdict, markdown tables and loss curves, from the run JSONs under ``OUT/runs``.

Kept apart from :mod:`.convergence` (which trains) so that ``--report-only`` and the
tests read results without the training code.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

#: The orthogonalizers of the benchmark's grid; the first is the default.
ORTHOGONALIZERS = ("newton_schulz", "fast", "polar_express", "gram_polar_express")
DEFAULT = "newton_schulz"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: a reader (or a timeout) never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def load_runs(out: str | Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((Path(out) / "runs").glob("*.json"))]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (orthogonalizer, lr): final validation loss over seeds, mean and spread."""
    cells: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["spec"]["orthogonalizer"], r["spec"]["lr"]), []).append(r)
    rows = []
    for (name, lr), rs in cells.items():
        vals = [r["final_val_loss"] for r in rs]
        rows.append({"orthogonalizer": name, "lr": lr, "seeds": sorted(r["spec"]["seed"] for r in rs),
                     "val_mean": statistics.fmean(vals), "val_std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                     "val_min": min(vals), "val_max": max(vals),
                     "train_mean": statistics.fmean(r["final_train_loss"] for r in rs),
                     "wall_s": statistics.fmean(r["wall_s"] for r in rs), "finite": all(r["finite"] for r in rs)})
    order = {n: i for i, n in enumerate(ORTHOGONALIZERS)}
    return sorted(rows, key=lambda r: (-r["lr"], order.get(r["orthogonalizer"], 99)))


def verdict(rows: list[dict[str, Any]]) -> str:
    """Is ``fast`` within the default's seed spread at the default's best learning rate?"""
    default = [r for r in rows if r["orthogonalizer"] == DEFAULT and len(r["seeds"]) > 1]
    if not default:
        return "no multi-seed run of the default yet"
    best = min(default, key=lambda r: r["val_mean"])
    fast = [r for r in rows if r["orthogonalizer"] == "fast" and r["lr"] == best["lr"]]
    if not fast:
        return f"default's best lr {best['lr']:g}: no fast run at it yet"
    diff = fast[0]["val_mean"] - best["val_mean"]
    spread = max(best["val_max"] - best["val_mean"], best["val_mean"] - best["val_min"])
    ok = diff <= spread
    return (f"default's best lr (of those with several seeds) is {best['lr']:g}; fast - default = {diff:+.4f} "
            f"(default's seed spread +-{spread:.4f}): {'within the spread or better' if ok else 'WORSE'}")


def timing_markdown(timing: dict[str, Any]) -> str:
    """The timing pass alone: optimizer-step ms per model, and each one relative to the default."""
    lines = [f"Optimizer step, median of {timing.get('rounds', 1)} rounds x {timing['steps']} steps, "
             f"{timing['device']}", "", "| model | orthogonalizer | opt step ms | / default | rounds (ms) |",
             "| --- | --- | ---: | ---: | --- |"]
    for label, model in timing["models"].items():
        base = model["rows"].get(DEFAULT, {}).get("opt_ms")
        for name, row in model["rows"].items():
            rel = f"{row['opt_ms'] / base:.3f}" if base else ""
            rounds = ", ".join(f"{v:.2f}" for v in row.get("opt_ms_rounds", [row["opt_ms"]]))
            lines.append(f"| {label} | {name} | {row['opt_ms']:.2f} | {rel} | {rounds} |")
    return "\n".join(lines)


def to_markdown(rows: list[dict[str, Any]], timing: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    lines = [f"Model: {meta.get('params', '?'):,} parameters ({meta.get('arch', '')}); "
             f"corpus: {meta.get('corpus', '?')}; device: {meta.get('device', '?')}, "
             f"torch {meta.get('torch', '?')}", ""]
    t_rows = (timing or {}).get("models", {})
    labels = list(t_rows)
    head = "| orthogonalizer | lr | seeds | final val loss (mean +- std) | min - max | final train loss | "
    head += " | ".join(f"opt step ms ({k})" for k in labels) + (" | " if labels else "") + "run wall s |"
    lines += [head, "| --- | ---: | ---: | ---: | ---: | ---: | " + "---: | " * len(labels) + "---: |"]
    for r in rows:
        ms = " | ".join(f"{t_rows[k]['rows'][r['orthogonalizer']]['opt_ms']:.2f}"
                        if r["orthogonalizer"] in t_rows[k]["rows"] else "" for k in labels)
        flag = "" if r["finite"] else " (non-finite)"
        lines.append(f"| {r['orthogonalizer']} | {r['lr']:g} | {len(r['seeds'])} | {r['val_mean']:.4f} +- "
                     f"{r['val_std']:.4f}{flag} | {r['val_min']:.4f} - {r['val_max']:.4f} | {r['train_mean']:.4f} | "
                     + ms + (" | " if labels else "") + f"{r['wall_s']:.0f} |")
    if t_rows:
        per_model = [f"{k}: " + ", ".join(f"{n} {v['fwd_bwd_ms']:.1f}" for n, v in t["rows"].items())
                     for k, t in t_rows.items()]
        lines += ["", "Forward+backward ms (timing pass): " + "; ".join(per_model)]
    lines += ["", verdict(rows)]
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path, smooth: int = 25) -> list[tuple[float, str]]:
    """Train loss (moving average, mean over seeds, min-max band) and validation points, one panel
    per lr; returns the (lr, orthogonalizer) curves drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = sorted({r["spec"]["lr"] for r in runs}, reverse=True)
    fig, axes = plt.subplots(1, len(lrs), figsize=(6 * len(lrs), 4.5), squeeze=False)
    names = [n for n in ORTHOGONALIZERS if any(r["spec"]["orthogonalizer"] == n for r in runs)]
    names += sorted({r["spec"]["orthogonalizer"] for r in runs} - set(names))  # variants (name@k, fast~x)
    palette = ["black", "tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:gray"]
    colors = {n: palette[i % len(palette)] for i, n in enumerate(names)}
    drawn: list[tuple[float, str]] = []
    for ax, lr in zip(axes[0], lrs):
        for name in names:
            rs = [r for r in runs if r["spec"]["lr"] == lr and r["spec"]["orthogonalizer"] == name]
            if not rs:
                continue
            curves = torch.tensor([r["train_loss"] for r in rs])
            k = max(1, min(smooth, curves.size(1)))
            sm = torch.nn.functional.avg_pool1d(curves[:, None], k, stride=1)[:, 0]
            steps = torch.arange(sm.size(1)) + k
            c = colors.get(name)
            ax.plot(steps, sm.mean(0), color=c, label=f"{name} ({len(rs)} seeds)", lw=1.2)
            drawn.append((lr, name))
            if len(rs) > 1:
                ax.fill_between(steps, sm.min(0).values, sm.max(0).values, color=c, alpha=0.15)
            val = torch.tensor([r["val_loss"] for r in rs])
            ax.plot(val[0, :, 0], val[:, :, 1].mean(0), "o", color=c, ms=4)
        ax.set_title(f"lr {lr:g} (lines: train, moving avg {smooth}; dots: validation)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/byte)")
        ax.legend(fontsize=8)
        finals = [r["final_val_loss"] for r in runs if r["spec"]["lr"] == lr]
        ax.set_ylim(min(finals) - 0.1, min(finals) + 1.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def write_report(out: str | Path) -> str:
    """``convergence.md``, ``summary.json`` and (with matplotlib) ``convergence.png`` from ``OUT``."""
    out = Path(out)
    runs = load_runs(out)
    if not runs:
        raise FileNotFoundError(f"no run results under {out / 'runs'}")
    timing_path = out / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else None
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    s = runs[0]["spec"]
    meta.update(params=runs[0]["params"], device=runs[0]["device"], torch=runs[0]["torch"],
                arch=f"d_model {s['d_model']}, {s['n_layers']} layers, seq {s['seq_len']}, batch {s['batch_size']}, "
                     f"{s['steps']} steps")
    rows = summarize(runs)
    md = to_markdown(rows, timing, meta)
    (out / "convergence.md").write_text(md + "\n")
    write_json(out / "summary.json", {"meta": meta, "rows": rows, "timing": timing, "verdict": verdict(rows)})
    try:
        plot(runs, out / "convergence.png")
    except ImportError:
        md += "\n\n(no plot: matplotlib is not installed; pip install 'lightning-matrixfsdp[bench]' and rerun " \
              "with --report-only)"
    return md
