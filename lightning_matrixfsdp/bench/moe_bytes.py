"""What moves and what stays resident under expert parallelism, measured on CPU processes
(issue 30, section 4): a benchmark, not a timing.

    python -m lightning_matrixfsdp.bench.moe_bytes [--world 4] [--eps 2 4] [--steps 2] [--out DIR]

W gloo processes train the MoE decoder (``bench/moe_model.py``, preset ``tiny`` without
activation checkpointing, so each layer's tokens travel once per forward and once per backward)
a few steps in each mode: ours without expert parallelism (the stacks owner-sharded; the
option's ``expert_parallel_size=1``), ours at each EP, and stock DDP with ``torch.optim.Muon``
per expert (``--no-ddp`` drops it). Per mode and rank, per step (``bench/moe_measure.py``):

- **bytes sent and received**, split into expert weights, expert gradients, dense weights, dense
  gradients, tokens, and control messages. Ours: the runtime's ``materialize`` and ``reduce``
  phases are split by the plan (each unit's roles, expert stacks apart, under the owner
  collective's byte convention, times the unit's passes: one materialization in forward, one
  more in backward for every unit but the root, one reduction), and the split must add up to
  the measured phase exactly; ``experts`` (the replica sum) is expert gradients;
  ``ep_dispatch``/``ep_combine`` are tokens; what the dispatcher saw beyond the runtime's
  phases is control (agreement flags). DDP: its all-reduce, split by the gradients' bytes, and
  it must equal ``2 (W-1)/W`` times them (the all-reduce convention of ``bench/comm.py``);
- **the token formula** of docs/expert-parallel-dispatch.md, evaluated on the routing counts of
  every rank, beside the measured ``ep_dispatch`` and ``ep_combine`` in forward and backward;
- **resident bytes** of expert parameters, gradients and optimizer state from the storages,
  beside ``3 x P_experts / EP``, and of the dense part.

Writes ``moe_bytes.json`` (a few KB) and ``moe_bytes.md`` (the table) to ``--out`` (default
``bench_out/moe_bytes``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from .moe_measure import STEP_PHASES, measure_mode
from .moe_model import MOE_PRESETS, MoEConfig

__all__ = ["bench_config", "check", "compact", "markdown", "run_rank", "summarize", "token_formula"]

BATCH = 2
CATEGORIES = ("expert_weights", "expert_grads", "dense_weights", "dense_grads", "tokens", "control")


def bench_config(preset: str = "tiny") -> MoEConfig:
    """The preset without activation checkpointing (a recomputed layer would exchange its tokens
    again, which the formula below does not count)."""
    return dataclasses.replace(MOE_PRESETS[preset], activation_checkpointing=False)


def run_rank(cfg: MoEConfig, eps: tuple[int, ...], steps: int, ddp: bool = True) -> list[dict[str, Any]]:
    """Every mode on this rank (inside an initialized process group): no EP, each EP, DDP."""
    modes = [("ours", 1)] + [("ours", ep) for ep in eps if ep > 1] + ([("ddp", 1)] if ddp else [])
    return [measure_mode(name, cfg, ep, steps, BATCH) for name, ep in modes]


# ------------------------------------------------------------------ the token formula
def token_formula(routing: list[list], rank: int, ep: int, cfg: MoEConfig, elem: int = 4) -> dict[str, list[int]]:
    """docs/expert-parallel-dispatch.md's bytes for ``rank`` over the recorded layer calls:
    ``routing[r]`` is rank ``r``'s list of ``(layer, tokens per expert)``, call by call. Forward:
    dispatch ``S_out H b + (EP-1)(E/EP+3) 8`` sent, ``S_in H b + ...`` received; combine ``S_in H b``
    sent, ``S_out H b`` received; backward: each with sent and received swapped, no counts."""
    per = cfg.experts // ep
    place, first = rank % ep, rank - rank % ep
    mine = range(place * per, (place + 1) * per)
    s_out = s_in = 0
    calls = len(routing[rank])
    for i in range(calls):
        s_out += sum(c for e, c in enumerate(routing[rank][i][1]) if e not in mine)
        s_in += sum(routing[r][i][1][e] for r in range(first, first + ep) if r != rank for e in mine)
    row = cfg.hidden * elem
    counts = calls * (ep - 1) * (per + 3) * 8
    return {"fwd.ep_dispatch": [s_out * row + counts, s_in * row + counts], "fwd.ep_combine": [s_in * row, s_out * row],
            "bwd.ep_dispatch": [s_in * row, s_out * row], "bwd.ep_combine": [s_out * row, s_in * row],
            "S_out": [s_out, 0], "S_in": [s_in, 0]}


# ------------------------------------------------------------------ one rank's split
def _sum(d: dict[str, list[int]], keys: Optional[tuple[str, ...]] = None) -> list[int]:
    vals = [v for k, v in d.items() if keys is None or k in keys]
    return [sum(v[0] for v in vals), sum(v[1] for v in vals)]


def _plan_split(units: list[dict[str, Any]], phase: str) -> dict[str, list[int]]:
    """Plan-derived materialize/reduce bytes of one step phase, expert stacks (``e``) and dense (``d``)."""
    out = {"mat.e": [0, 0], "mat.d": [0, 0], "red.e": [0, 0], "red.d": [0, 0]}
    for u in units:
        mat_passes = 1 if phase == "fwd" else (0 if u["root"] or phase == "opt" else 1)
        red_passes = 1 if phase == "bwd" else 0
        for k in ("e", "d"):
            out[f"mat.{k}"][0] += mat_passes * u["mat_sent"][k]
            out[f"mat.{k}"][1] += mat_passes * u["mat_recv"][k]
            out[f"red.{k}"][0] += red_passes * u["red_sent"][k]
            out[f"red.{k}"][1] += red_passes * u["red_recv"][k]
    return out


def _rank_split(r: dict[str, Any], steps: int, world: int, grads: dict[str, int]) -> dict[str, Any]:
    """Over the ``steps`` steps, each category's [sent, received] on one rank, and the checks' inputs."""
    cats = {c: [0, 0] for c in CATEGORIES}
    checks: dict[str, Any] = {"attributed": True}

    def add(cat: str, v: list[int], scale: int = 1) -> None:
        cats[cat][0] += v[0] * scale
        cats[cat][1] += v[1] * scale

    for phase in STEP_PHASES:
        disp, rt = r["dispatcher"][phase], r["runtime"][phase]
        if "units" in r:
            plan = _plan_split(r["units"], phase)
            for what, key in (("materialize", "mat"), ("reduce", "red")):
                want = [plan[f"{key}.e"][i] + plan[f"{key}.d"][i] for i in (0, 1)]
                checks["attributed"] &= [steps * x for x in want] == rt.get(what, [0, 0])
                add("expert_weights" if key == "mat" else "expert_grads", plan[f"{key}.e"], steps)
                add("dense_weights" if key == "mat" else "dense_grads", plan[f"{key}.d"], steps)
            add("expert_grads", rt.get("experts", [0, 0]))
            add("tokens", _sum(rt, ("ep_dispatch", "ep_combine")))
            known = ("materialize", "reduce", "experts", "ep_dispatch", "ep_combine")
            unknown = {k: v for k, v in rt.items() if k not in known}
            if unknown:
                checks.setdefault("other_runtime", {})[phase] = unknown
            control = [a - b for a, b in zip(_sum(disp), _sum(rt))]
            add("control", control)
        else:  # DDP: one bucketed all-reduce of every gradient in backward
            red = disp.get("allreduce_", [0, 0])
            if phase == "bwd":
                want = steps * 2 * (world - 1) * (grads["expert"] + grads["dense"]) // world
                checks["allreduce_vs_convention"] = [red[0], want]
                share = grads["expert"] / (grads["expert"] + grads["dense"])
                e = [round(x * share) for x in red]
                add("expert_grads", e)
                add("dense_grads", [a - b for a, b in zip(red, e)])
            rest = [a - b for a, b in zip(_sum(disp), red)]
            add("control", rest)
        checks[f"{phase}_dispatcher"] = _sum(disp)
    return {"bytes": cats, "checks": checks}


# ------------------------------------------------------------------ all ranks
def summarize(per_rank: list[list[dict[str, Any]]], cfg: MoEConfig, steps: int) -> dict[str, Any]:
    """The compact result: per mode and rank, over all steps, the byte categories, the token
    formula beside the measurement, and the resident bytes beside ``3 x P_experts / EP``."""
    world = len(per_rank)
    p_experts = cfg.n_layers * cfg.experts * 3 * cfg.hidden * cfg.expert_mlp * 4  # fp32
    modes: dict[str, Any] = {}
    for m in range(len(per_rank[0])):
        rows = [per_rank[g][m] for g in range(world)]
        name, ep = rows[0]["mode"], rows[0]["ep"]
        routing = [r["routing"] for r in rows]
        out: dict[str, Any] = {"ep": ep, "ranks": []}
        for g, r in enumerate(rows):
            mem = r["memory"]
            grads = {"expert": mem["expert"][1], "dense": mem["dense"][1]}
            split = _rank_split(r, steps, world, grads)
            rank: dict[str, Any] = {"bytes": split["bytes"], "checks": split["checks"],
                                    "opt_bytes": _sum(r["dispatcher"]["opt"])}
            if ep > 1:
                want = token_formula(routing, g, ep, cfg)
                got = {f"{ph}.{k}": r["runtime"][ph].get(k, [0, 0]) for ph in ("fwd", "bwd")
                       for k in ("ep_dispatch", "ep_combine")}
                rank["tokens"] = {"S_out": want["S_out"][0], "S_in": want["S_in"][0], "measured": got,
                                  "formula": {k: want[k] for k in got}}
            rank["memory"] = mem
            out["ranks"].append(rank)
        out["losses"] = rows[0]["losses"]
        out["expert_target"] = 3 * p_experts // ep if name != "ddp_per_expert_muon" else 3 * p_experts
        if name == "ours_no_ep":
            out["expert_target"] = None  # owner-sharded: 3 x P_experts / W on average, per rank by the plan
            out["expert_target_total"] = 3 * p_experts
        modes[name] = out
    return {"world": world, "steps": steps, "batch": BATCH, "config": cfg.to_dict(), "P_experts": p_experts,
            "modes": modes}


def check(summary: dict[str, Any]) -> list[str]:
    """The consistency claims; returns what fails (empty: all hold). No expert-weight byte under
    EP; tokens equal to the formula; the split adds up; nothing moves in the optimizer step;
    expert resident bytes ``3 x P_experts / EP`` per rank (the sum over ranks ``3 x P_experts``
    without EP) with no storage beyond the tensors' own bytes."""
    bad = []
    for name, m in summary["modes"].items():
        total = 0
        for g, r in enumerate(m["ranks"]):
            where = f"{name} rank {g}"
            if r["opt_bytes"] != [0, 0]:
                bad.append(f"{where}: the optimizer step moved {r['opt_bytes']}")
            if not r["checks"].get("attributed", True):
                bad.append(f"{where}: the plan's split does not add up to the measured materialize/reduce")
            if "allreduce_vs_convention" in r["checks"]:
                got, want = r["checks"]["allreduce_vs_convention"]
                if abs(got - want) > 16 * summary["steps"]:  # one rounding per bucket and step
                    bad.append(f"{where}: DDP all-reduce {got} B, the convention gives {want} B")
            if m["ep"] > 1 and r["bytes"]["expert_weights"] != [0, 0]:
                bad.append(f"{where}: expert weights moved {r['bytes']['expert_weights']}")
            if "tokens" in r and r["tokens"]["measured"] != r["tokens"]["formula"]:
                bad.append(f"{where}: token bytes {r['tokens']['measured']} != formula {r['tokens']['formula']}")
            mem = r["memory"]
            if mem["storage"] != mem["logical"]:
                bad.append(f"{where}: storages of {mem['storage']} B behind tensors of {mem['logical']} B")
            if m["expert_target"] is not None and sum(mem["expert"]) != m["expert_target"]:
                bad.append(f"{where}: expert resident {sum(mem['expert'])} B, 3 x P_experts / EP = {m['expert_target']} B")
            total += sum(mem["expert"])
        if m.get("expert_target_total") is not None and total != m["expert_target_total"]:
            bad.append(f"{name}: expert resident over all ranks {total} B, 3 x P_experts = {m['expert_target_total']} B")
    return bad


def compact(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary for a file of a few KB: per rank the categories, every collective's bytes per step
    phase as the dispatcher saw them (``phases``: fwd, bwd, opt), the memory and the measured token
    bytes, with the formula's agreement and the split's as flags (``check`` ran on the full one)."""
    out = {k: v for k, v in summary.items() if k != "modes"}
    out["modes"] = {}
    for name, m in summary["modes"].items():
        ranks = []
        for r in m["ranks"]:
            row = {"bytes": r["bytes"], "memory": r["memory"], "opt_bytes": r["opt_bytes"],
                   "phases": {p: r["checks"][f"{p}_dispatcher"] for p in STEP_PHASES},
                   "split_adds_up": r["checks"].get("attributed", True)}
            if "tokens" in r:
                t = r["tokens"]
                row["tokens"] = {"S_out": t["S_out"], "S_in": t["S_in"], "measured": t["measured"],
                                 "equals_formula": t["measured"] == t["formula"]}
            ranks.append(row)
        out["modes"][name] = {**{k: v for k, v in m.items() if k != "ranks"},
                              "losses": [round(x, 5) for x in m["losses"]], "ranks": ranks}
    return out


def markdown(summary: dict[str, Any]) -> str:
    """One row per mode: per-rank means per step (sent), the resident bytes, and the checks."""
    kib = 1024
    lines = ["| mode | expert weights | expert grads | dense weights | dense grads | tokens (formula) | control "
             "| opt step | expert resident per rank (target) | dense resident per rank |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    steps = summary["steps"]
    for name, m in summary["modes"].items():
        ranks = m["ranks"]
        n = len(ranks)

        def mean(cat: str) -> str:
            return f"{sum(r['bytes'][cat][0] for r in ranks) / n / steps / kib:.1f}"

        tok = mean("tokens")
        if m["ep"] > 1:
            formula = sum(v[0] for r in ranks for v in r["tokens"]["formula"].values()) / n / steps / kib
            tok += f" ({formula:.1f})"
        res = [sum(r["memory"]["expert"]) / kib for r in ranks]
        dense = [sum(r["memory"]["dense"]) / kib for r in ranks]
        target = m["expert_target"]
        tgt = f"{target / kib:.0f}" if target is not None else f"sum {m['expert_target_total'] / kib:.0f}"
        span = (lambda xs: f"{min(xs):.0f}" if min(xs) == max(xs) else f"{min(xs):.0f}-{max(xs):.0f}")
        opt = sum(r["opt_bytes"][0] for r in ranks)
        lines.append(f"| {name} | {mean('expert_weights')} | {mean('expert_grads')} | {mean('dense_weights')} | "
                     f"{mean('dense_grads')} | {tok} | {mean('control')} | {opt} | {span(res)} ({tgt}) | "
                     f"{span(dense)} |")
    lines.append("")
    lines.append(f"KiB sent per rank per step (mean over {summary['world']} ranks; received is symmetric over the "
                 "ranks), resident KiB after a step (parameters + gradients + optimizer state), "
                 f"P_experts = {summary['P_experts'] / kib:.0f} KiB.")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the command line
def _worker(cfg: MoEConfig, eps: tuple[int, ...], steps: int, ddp: bool, out_dir: str) -> None:
    dist.init_process_group("gloo")
    try:
        mine = run_rank(cfg, eps, steps, ddp)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if dist.get_rank() == 0:
            summary = summarize(everyone, cfg, steps)
            summary["failed_checks"] = check(summary)
            summary["meta"] = _meta()
            table = markdown(summary)
            path = Path(out_dir)
            path.mkdir(parents=True, exist_ok=True)
            (path / "moe_bytes.json").write_text(json.dumps(compact(summary), separators=(",", ":")))
            (path / "moe_bytes.md").write_text(table)
            print(table)
            print("checks:", "all hold" if not summary["failed_checks"] else summary["failed_checks"])
    finally:
        dist.destroy_process_group()


def _meta() -> dict[str, Any]:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        rev = ""
    return {"date": time.strftime("%Y-%m-%d"), "revision": rev, "torch": torch.__version__,
            "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo"}


def main(argv: Optional[list[str]] = None) -> None:
    from .launch import spawn

    p = argparse.ArgumentParser(prog="python -m lightning_matrixfsdp.bench.moe_bytes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--eps", type=int, nargs="+", default=[2, 4], help="expert-parallel sizes besides no EP")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--preset", default="tiny", choices=sorted(MOE_PRESETS))
    p.add_argument("--no-ddp", dest="ddp", action="store_false")
    p.add_argument("--out", default="bench_out/moe_bytes")
    a = p.parse_args(argv)
    cfg = bench_config(a.preset)
    bad = [ep for ep in a.eps if ep < 1 or a.world % ep or cfg.experts % ep]
    if bad:
        raise SystemExit(f"--eps {bad}: each EP must divide the world size {a.world} and the {cfg.experts} experts")
    spawn(a.world, _worker, (cfg, tuple(a.eps), a.steps, a.ddp, a.out))


if __name__ == "__main__":
    main()
