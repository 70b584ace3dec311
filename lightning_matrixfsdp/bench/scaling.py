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

HSDP rows (``--split R,W``, world ``R W``): ``matrix_hsdp`` and ``matrix_hsdp_split``
(``replica_split``) with shard span W and R replicas, rank g = k W + s (replica k,
shard rank s). With O_s the bytes shard rank s owns (of which T_s trainable) and
S_{k,s} those of them replica k steps (read from the run's plan), inside the shard
group as above, plus across replicas: unsplit, the ring all-reduce of the owned
gradients in backward, `2 (R-1)/R T_s`; split, the reduction chain to the stepper in
backward (runtime/replicas/comm.py: every replica sends each role once, except its
stepper where the chain ends, i.e. a stepper among the last two replicas), at most
`T_s`, and the broadcast of the updated weights, counted in the next forward (the
runtime starts it there), `S_{k,s}` (a broadcast's root counts its payload once). At
R = 2 that is `T_s - S_{k,s}` and `S_{k,s}`, the ring all-reduce's total. The optimizer
state held over all ranks drops by R.
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

from lightning_matrixfsdp.runtime.placement import dtype_bytes, numel_of

from .config import BenchConfig, ModelConfig, RunConfig, expand_modes
from .model import Decoder, is_matrix, unit_of

DEFAULT_MODES = ("matrix_fsdp_p2p", "matrix_fsdp_broadcast", "fsdp2_muon", "fsdp2_gather_once")
#: (R, W) of the replica_split rows (issue 13): replicas x shard span
DEFAULT_SPLIT = ((2, 2), (4, 1), (2, 4), (4, 2))
HSDP_MODES = ("matrix_hsdp", "matrix_hsdp_split")
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


def analytic_hsdp(mode: str, replicas: int, span: int, sizes: dict[str, Any], entry: dict[str, Any]
                  ) -> dict[str, float | None]:
    """Predicted max-over-ranks bytes sent per phase of the HSDP modes (module docstring)."""
    R, W, p = replicas, span, sizes["P"]
    plan = entry["info"]["plan"]
    steppers = plan.get("steppers") or {}
    owned, owned_no_root, train = [0] * W, [0] * W, [0] * W
    stepped = [[0] * W for _ in range(R)]
    chained = [[0] * W for _ in range(R)]  # what replica k sends in the reduction chain
    for unit in plan["units"]:
        for sh in unit["shards"]:
            b, o = numel_of(sh["shape"]) * dtype_bytes(sh["dtype"]), sh["owner"]
            owned[o] += b
            owned_no_root[o] += b if unit["fqn"] else 0
            if sh["requires_grad"]:
                train[o] += b
                if steppers:
                    st = steppers[sh["fqn"]]
                    stepped[st][o] += b
                    for k in range(R):  # everyone sends once but the stepper where the chain ends
                        chained[k][o] += 0 if k == st >= R - 2 else b
    fwd, bwd = [], []
    for g in range(R * W):
        k, s = divmod(g, W)
        f = (W - 1) * owned[s]
        b = (W - 1) * owned_no_root[s] + (p - owned[s])
        if mode == "matrix_hsdp_split":
            f += stepped[k][s]
            b += chained[k][s]
        else:
            b += 2 * (R - 1) / R * train[s]
        fwd.append(f)
        bwd.append(b)
    return {"forward": max(fwd), "backward": max(bwd), "optimizer_step": 0.0}


def split_rows_for(replicas: int, span: int, results: dict[str, Any], sizes: dict[str, Any]) -> list[dict[str, Any]]:
    """The HSDP rows of one (R, W) run: bytes against the model, optimizer state per rank."""
    rows = []
    for mode, entry in results["modes"].items():
        row: dict[str, Any] = {"R": replicas, "W": span, "mode": mode, "status": entry["status"]}
        if entry["status"] != "ok":
            row["error"] = entry.get("error")
            rows.append(row)
            continue
        measured = {ph: entry["bytes"][ph]["max_sent"] for ph in PHASES}
        model = analytic_hsdp(mode, replicas, span, sizes, entry)
        state = entry["state_bytes"]["optimizer"]
        row.update(measured=measured, analytic=model,
                   ratio={ph: (measured[ph] / model[ph] if model[ph] else None) for ph in PHASES},
                   optimizer_state=state, optimizer_state_mean=sum(state) / len(state))
        rows.append(row)
    return rows


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


def split_markdown(study: dict[str, Any]) -> str:
    rows = study.get("split_rows") or []
    if not rows:
        return ""
    lines = [
        "",
        "## HSDP with and without `replica_split`",
        "",
        "R replicas x shard span W (world R W). KiB sent per rank, max over ranks, one counted step; the "
        "replica broadcast of the updated weights is counted in the forward that starts it. Optimizer state: "
        "KiB per rank, mean over ranks, and the unsplit mode's over the split mode's.",
        "",
        "| R | W | mode | fwd | fwd model | bwd | bwd model | opt step | opt state/rank | state drop |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    unsplit = {(r["R"], r["W"]): r.get("optimizer_state_mean") for r in rows if r["mode"] == "matrix_hsdp"}
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['R']} | {r['W']} | {r['mode']} | {r['status']}: {r.get('error')} |" + " |" * 6)
            continue
        me, an = r["measured"], r["analytic"]
        base = unsplit.get((r["R"], r["W"]))
        drop = _ratio(base / r["optimizer_state_mean"]) if base and r["mode"] != "matrix_hsdp" else ""
        lines.append(
            f"| {r['R']} | {r['W']} | {r['mode']} | {_kib(me['forward'])} | {_kib(an['forward'])} | "
            f"{_kib(me['backward'])} | {_kib(an['backward'])} | {_kib(me['optimizer_step'])} | "
            f"{_kib(r['optimizer_state_mean'])} | {drop} |")
    return "\n".join(lines) + "\n"


def _pair(text: str) -> tuple[int, int]:
    try:
        r, w = (int(x) for x in text.lower().replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--split takes R,W pairs such as 2,2; got {text!r}") from None
    return r, w


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_matrixfsdp.bench.scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="*", default=[2, 3, 4, 6, 8])
    ap.add_argument("--split", type=_pair, nargs="*", default=[],
                    help="R,W pairs: HSDP rows with and without replica_split (e.g. "
                         + " ".join(f"{r},{w}" for r, w in DEFAULT_SPLIT) + ")")
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
    for r, w in args.split:
        cfg = copy.deepcopy(base)
        cfg.run.modes = list(HSDP_MODES)
        cfg.run.hsdp_shard_size = w
        cfg.run.out_dir = str(out / f"r{r}w{w}")
        spawn(r * w, run_benchmark, (cfg,))
        path = output_paths({"meta": {"world_size": r * w, "device": "cpu"}}, cfg)["json"]
        study.setdefault("split_rows", []).extend(split_rows_for(r, w, json.loads(path.read_text()), sizes))
        print(f"[scaling] R={r} W={w} done", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(study, indent=1))
    text = (markdown(study) if study["rows"] else "# Bytes per rank per phase (CPU, gloo)\n") + split_markdown(study)
    (out / "scaling.md").write_text(text)
    print(text)
    print(f"[scaling] wrote {out / 'scaling.json'} and {out / 'scaling.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
