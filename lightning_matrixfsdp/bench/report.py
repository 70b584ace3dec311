"""Turn the results dict into files: JSON (complete), markdown (the table), PNG (optional:
the ``bench`` extra).

The JSON is rewritten after every mode so an interrupted run keeps what it
measured; the markdown and the plot are written at the end.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from .config import BenchConfig

MiB = 1024**2
GiB = 1024**3

#: What to install for the plot (matplotlib is not a core dependency).
PLOT_REQUIREMENT = "lightning-matrixfsdp[bench]"
_NO_PLOT = (f"the benchmark plot needs matplotlib, which is not installed: pip install '{PLOT_REQUIREMENT}', "
            "or pass --no-plot")


def check_plot_available() -> None:
    """Raise ImportError naming the extra when the plot is asked for and matplotlib is missing.

    Called before any mode runs, so a long benchmark does not fail at its end.
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(_NO_PLOT)


def save_json(out_dir: str | Path, name: str, result: dict[str, Any], omit: tuple[str, ...] = ()) -> Path:
    """Write ``result`` to ``out_dir/name`` and print it without the (long) ``omit`` keys;
    the GPU scripts' common ending."""
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k not in omit}, indent=1, default=str), flush=True)
    return path


def output_paths(results: dict[str, Any], cfg: BenchConfig) -> dict[str, Path]:
    out = Path(cfg.run.out_dir)
    stem = f"bench_{cfg.preset}_w{results['meta']['world_size']}_{results['meta']['device']}"
    return {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}


def write_outputs(results: dict[str, Any], cfg: BenchConfig, final: bool) -> dict[str, Path]:
    paths = output_paths(results, cfg)
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    paths["json"].write_text(json.dumps(results, indent=1, sort_keys=False, default=str))
    if final:
        text = markdown(results)
        paths["md"].write_text(text)
        print(text, flush=True)
        if cfg.run.plot and plot(results, paths["png"]):
            print(f"[bench] plot: {paths['png']}", flush=True)
        print(f"[bench] wrote {paths['json']} and {paths['md']}", flush=True)
    return paths


def _ms(x: float | None) -> str:
    return "" if x is None else (f"{x:.1f}" if x >= 10 else f"{x:.2f}")


def _bytes(x: int | float | None) -> str:
    if x is None:
        return "n/a"
    if x >= GiB:
        return f"{x / GiB:.2f} GiB"
    if x >= MiB:
        return f"{x / MiB:.1f} MiB"
    if x >= 1024:
        return f"{x / 1024:.1f} KiB"
    return f"{int(x)} B"


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def markdown(results: dict[str, Any]) -> str:
    """The side-by-side table plus byte and balance details and failure messages."""
    meta, cfg = results["meta"], results["config"]
    m, r = cfg["model"], cfg["run"]
    lines = [
        f"# lightning_matrixfsdp benchmark: preset `{cfg['preset']}`",
        "",
        f"{meta['date_utc']}, {meta['world_size']} x {meta.get('gpu', meta['device'])}, backend {meta['backend']}, "
        f"torch {meta['torch']}, dtype {meta['dtype']}, git {str(meta.get('git_revision'))[:12]}",
        "",
        f"Model: hidden {m['hidden']}, heads {m['n_heads']}, gated MLP {m['mlp_hidden']}, layers {m['n_layers']}, "
        f"seq {m['seq_len']}, vocab {m['vocab_size']}, AC {m['activation_checkpointing']}, "
        f"{meta['parameters'] / 1e6:.2f}M parameters; batch {r['batch_size']}/rank; "
        f"{r['warmup']} warm-up + {r['steps']} measured steps, median of the per-step max over ranks.",
        "",
        "| mode | status | zero_grad ms | fwd ms | bwd ms | opt ms | total ms | peak mem/rank | "
        "fwd sent | bwd sent | opt sent | mem max/avg | NS max/avg | gamma max | last loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    failures = []
    for name, e in results["modes"].items():
        if e["status"] != "ok":
            lines.append(f"| {name} | {e['status']} |" + " |" * 13)
            failures.append(f"- `{name}` ({e['status']}): {e.get('error')}")
            continue
        t, b, bal = e["time_ms"], e.get("bytes", {}), e.get("balance", {})
        sent = [(_bytes(b[p]["max_sent"]) if p in b else "") for p in ("forward", "backward", "optimizer_step")]
        lines.append(
            f"| {name} | ok | {_ms(t['zero_grad'])} | {_ms(t['forward'])} | {_ms(t['backward'])} | "
            f"{_ms(t['optimizer_step'])} | {_ms(t['total'])} | {_bytes(e['memory']['max_bytes'])} | "
            f"{sent[0]} | {sent[1]} | {sent[2]} | {_ratio(bal.get('param_bytes_max_over_avg'))} | "
            f"{_ratio(bal.get('ns_flops_max_over_avg'))} | {_ratio(bal.get('gamma_max'))} | {e['losses'][-1]:.5f} |"
        )
    mem_kind = next((e["memory"]["kind"] for e in results["modes"].values() if e["status"] == "ok"), "n/a")
    lines += [
        "",
        f"Peak memory: `{mem_kind}` (max over ranks). Bytes: sent per rank in one extra counted step, max over ranks, "
        "by time phase (collectives of every kind, counted at the dispatcher; see `bench/comm.py` for the convention). "
        "mem max/avg: resident parameter bytes, busiest rank over mean; NS max/avg: Newton-Schulz FLOPs a rank "
        "runs alone (owner modes), busiest over mean; gamma: per-unit busiest owner over an even share.",
    ]
    lines += floor_section(results)
    state_rows = [
        f"| {name} | {_bytes(max(e['state_bytes']['params']))} | {_bytes(max(e['state_bytes']['grads']))} | "
        f"{_bytes(max(e['state_bytes']['optimizer']))} |"
        for name, e in results["modes"].items()
        if e["status"] == "ok"
    ]
    if state_rows:
        lines += ["", "State kept per rank between steps (max over ranks):", "",
                  "| mode | params | grads | optimizer state |", "| --- | ---: | ---: | ---: |", *state_rows]
    if failures:
        lines += ["", "Not run or failed:", "", *failures]
    for name, e in results["modes"].items():
        text = e.get("info", {}).get("plan_text") if e["status"] == "ok" else None
        if text:
            lines += ["", f"Plan of `{name}`:", "", "```", text.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def floor_section(results: dict[str, Any]) -> list[str]:
    """Owner modes' optimizer step against the busiest owner's Newton-Schulz FLOP floor."""
    rate = results["meta"].get("matmul_bf16_tflops")
    rows = []
    for name, e in results["modes"].items():
        flops = e.get("balance", {}).get("ns_flops") if e["status"] == "ok" else None
        if not rate or not flops or max(flops) == 0:
            continue
        floor = max(flops) / (rate * 1e12) * 1e3
        opt = e["time_ms"]["optimizer_step"]
        rows.append(f"| {name} | {max(flops) / 1e9:,.0f} | {floor:.1f} | {opt:.1f} | {opt / floor:.3f} |")
    if not rows:
        return []
    return ["", f"Optimizer step against the busiest owner's Newton-Schulz FLOP floor (FLOPs / the {rate:.0f} "
            "TFLOP/s bf16 rate of an 8192^3 matmul measured in this run):", "",
            "| mode | NS GFLOP (busiest owner) | floor ms | opt ms | opt / floor |",
            "| --- | ---: | ---: | ---: | ---: |", *rows]


def plot(results: dict[str, Any], path: Path) -> bool:
    """Stacked phase times per mode (False: no mode succeeded); ImportError naming the extra
    when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(_NO_PLOT) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {k: v for k, v in results["modes"].items() if v["status"] == "ok"}
    if not ok:
        return False
    phases = ("zero_grad", "forward", "backward", "optimizer_step")
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(ok)), 4))
    bottom = [0.0] * len(ok)
    for phase in phases:
        vals = [v["time_ms"][phase] for v in ok.values()]
        ax.bar(list(ok), vals, bottom=bottom, label=phase)
        bottom = [b + x for b, x in zip(bottom, vals)]
    ax.set_ylabel("ms per step (median, max over ranks)")
    ax.set_title(f"preset {results['config']['preset']}, {results['meta']['world_size']} ranks")
    ax.legend()
    plt.xticks(rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
