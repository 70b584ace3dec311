"""Scaling study: measured bytes per rank per phase vs the analytic model, W = 2..8.

    python -m lightning_matrixfsdp.bench.scaling --world 2 3 4 6 8

For every world size W, W CPU gloo workers run the benchmark modes (one timed
step and one counted step) on a small model whose dimensions divide by 2, 3, 4,
6 and 8 (so FSDP2's shards carry no padding), and the measured bytes *sent* per
rank (max over ranks) are put next to this analytic model (docs/how-it-works.md#bandwidth
derives it):

- FSDP2 (any fsdp2_* mode): forward all-gathers every unit, `P (W-1)/W`;
  backward all-gathers them again and reduce-scatters the gradients,
  `2 P (W-1)/W`. Optimizer step: 0 for AdamW; gather-once all-gathers every
  matrix update, `M (W-1)/W`; stock `torch.optim.Muon` on DTensors has no closed
  form (DTensor picks redistributions inside every Newton-Schulz matmul), so
  only its measurement and its ratio to `M (W-1)/W` are shown.
- matrix_fsdp (owner layout; O_{B,r}: bytes of unit B resident on rank r, read
  from the run): materialize with p2p fanout, rank r sends `(W-1) O_r`
  (the busiest owner: `(W-1) max_r O_r = gamma P (W-1)/W`); with broadcast, `O_r`
  (injected once); with the padded all-gather, `(W-1) sum_B max_r O_{B,r}`.
  Reduction to owners: p2p/broadcast rank r sends `P - O_r`; padded
  reduce-scatter `(W-1) sum_B max_r O_{B,r}`. Backward re-materializes every
  unit but the root. Optimizer step: 0.

Here P is the bytes of all parameters and M of the Muon matrices.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .config import BenchConfig, ModelConfig, RunConfig, expand_modes
from .model import Decoder, is_matrix, unit_of

DEFAULT_MODES = ("matrix_fsdp_p2p", "matrix_fsdp_broadcast", "fsdp2_muon", "fsdp2_gather_once")
PHASES = ("forward", "backward", "optimizer_step")


def scaling_config(modes: Sequence[str], out_dir: str) -> BenchConfig:
    """Small model, dims divisible by every W in 2..8 (hidden 96, MLP 192, vocab 240)."""
    return BenchConfig(
        preset="scaling",
        model=ModelConfig(vocab_size=240, hidden=96, n_heads=4, mlp_hidden=192, n_layers=4, seq_len=16),
        run=RunConfig(modes=list(modes), warmup=0, steps=1, batch_size=1, dtype="float32", device="cpu",
                      out_dir=out_dir, plot=False, collective_timeout_s=300.0),
    )


def model_sizes(cfg: BenchConfig) -> dict[str, Any]:
    """Bytes per unit (P_B), in total (P) and of the Muon matrices (M), from a meta-device model."""
    with torch.device("meta"):
        model = Decoder(cfg.model)
    elem = 2 if cfg.run.dtype == "bfloat16" else 4
    units: dict[str, int] = {}
    matrices = 0
    for name, p in model.named_parameters():
        units[unit_of(name)] = units.get(unit_of(name), 0) + p.numel() * elem
        if is_matrix(name, p, cfg.optim.matrix_scope):
            matrices += p.numel() * elem
    return {"unit_bytes": units, "P": sum(units.values()), "M": matrices}


def analytic(mode: str, world: int, sizes: dict[str, Any], entry: dict[str, Any]) -> dict[str, float | None]:
    """Predicted max-over-ranks bytes sent per phase (None where there is no closed form)."""
    w, p, m = world, sizes["P"], sizes["M"]
    if mode.startswith("fsdp2_") or mode == "muon_fsdp2":
        opt: float | None = {"fsdp2_adamw": 0.0, "fsdp2_gather_once": m * (w - 1) / w}.get(mode)
        return {"forward": p * (w - 1) / w, "backward": 2 * p * (w - 1) / w, "optimizer_step": opt}
    if mode.startswith("matrix_fsdp_"):
        per_unit: dict[str, list[int]] = entry["balance"]["unit_bytes"]
        owned = [sum(per_unit[u][r] for u in per_unit) for r in range(w)]
        owned_no_root = [sum(per_unit[u][r] for u in per_unit if u != "root") for r in range(w)]
        if mode == "matrix_fsdp_padded_all_gather":
            pad = sum(max(v) for v in per_unit.values())
            pad_no_root = sum(max(v) for u, v in per_unit.items() if u != "root")
            return {"forward": (w - 1) * pad, "backward": (w - 1) * (pad_no_root + pad), "optimizer_step": 0.0}
        fan = (w - 1) if mode == "matrix_fsdp_p2p" else 1
        fwd = [fan * o for o in owned]
        bwd = [fan * o2 + (p - o) for o, o2 in zip(owned, owned_no_root)]
        return {"forward": max(fwd), "backward": max(bwd), "optimizer_step": 0.0}
    return {ph: None for ph in PHASES}


def rows_for(world: int, results: dict[str, Any], sizes: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for mode, entry in results["modes"].items():
        row: dict[str, Any] = {"world": world, "mode": mode, "status": entry["status"]}
        if entry["status"] != "ok":
            row["error"] = entry.get("error")
            rows.append(row)
            continue
        measured = {ph: entry["bytes"][ph]["max_sent"] for ph in PHASES}
        model = analytic(mode, world, sizes, entry)
        row.update(
            measured=measured,
            analytic=model,
            ratio={ph: (measured[ph] / model[ph] if model[ph] else None) for ph in PHASES},
            gamma_max=entry["balance"].get("gamma_max") if mode.startswith("matrix_fsdp_") else None,
            fsdp_model=sizes["P"] * (world - 1) / world,
            opt_over_gather_once=measured["optimizer_step"] / (sizes["M"] * (world - 1) / world) if world > 1 else None,
        )
        rows.append(row)
    return rows


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _kib(x: float | None) -> str:
    return "" if x is None else f"{x / 1024:.1f}"


def markdown(study: dict[str, Any]) -> str:
    s = study["sizes"]
    lines = [
        "# Bytes per rank per phase vs world size (CPU, gloo)",
        "",
        f"Model: {json.dumps(study['config']['model'])}; P = {s['P'] / 1024:.1f} KiB of parameters, "
        f"M = {s['M'] / 1024:.1f} KiB of Muon matrices (float32). KiB sent per rank, max over ranks, "
        "one counted step; analytic model in `bench/scaling.py`. 'opt / M(W-1)/W' compares the optimizer "
        "step with one all-gather of all matrices.",
        "",
        "| W | mode | fwd | fwd model | bwd | bwd model | opt step | opt model | opt / M(W-1)/W | gamma max |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in study["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['world']} | {r['mode']} | {r['status']}: {r.get('error')} |" + " |" * 8)
            continue
        me, an = r["measured"], r["analytic"]
        g = r.get("gamma_max")
        lines.append(
            f"| {r['world']} | {r['mode']} | {_kib(me['forward'])} | {_kib(an['forward'])} | {_kib(me['backward'])} | "
            f"{_kib(an['backward'])} | {_kib(me['optimizer_step'])} | {_kib(an['optimizer_step']) or 'n/a'} | "
            f"{_ratio(r['opt_over_gather_once'])} | {_ratio(g)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_matrixfsdp.bench.scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    ap.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES))
    ap.add_argument("--layers", type=int, default=None, help="override the number of blocks")
    ap.add_argument("--out", default="bench_out/scaling")
    args = ap.parse_args(argv)

    from .launch import spawn
    from .report import output_paths
    from .runner import run_benchmark

    out = Path(args.out)
    base = scaling_config(expand_modes(args.modes), str(out))
    if args.layers:
        base.model.n_layers = args.layers
    sizes = model_sizes(base)
    study: dict[str, Any] = {"config": base.to_dict(), "sizes": sizes, "rows": []}
    for w in args.world:
        cfg = copy.deepcopy(base)
        cfg.run.out_dir = str(out / f"w{w}")
        if w > 1:
            spawn(w, run_benchmark, (cfg,))
        else:
            run_benchmark(cfg)
        path = output_paths({"meta": {"world_size": w, "device": "cpu"}}, cfg)["json"]
        results = json.loads(path.read_text())
        study["rows"] += rows_for(w, results, sizes)
        print(f"[scaling] W={w} done", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(study, indent=1))
    text = markdown(study)
    (out / "scaling.md").write_text(text)
    print(text)
    print(f"[scaling] wrote {out / 'scaling.json'} and {out / 'scaling.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
