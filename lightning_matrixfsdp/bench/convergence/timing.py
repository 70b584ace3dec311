"""The convergence benchmark's timing pass: each orthogonalizer's optimizer step alone on
one device, on the trained model and on wider ones."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from .run import RunSpec, build, device_name, lm_loss

__all__ = ["time_optimizer", "timing_pass"]


def time_optimizer(spec: RunSpec, device: torch.device, steps: int, warmup: int = 5) -> dict[str, float]:
    """Median ms of the optimizer step (and of forward+backward) over ``steps`` steps, alone."""
    model, opt, _ = build(spec, device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (spec.batch_size, spec.seq_len + 1), generator=gen).to(device)
    fb, st = [], []
    for i in range(warmup + steps):
        t = [time.perf_counter()]
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if device.type == "cuda" else []
        if ev:
            ev[0].record()
        loss = lm_loss(model, x[:, :-1], x[:, 1:], device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        if ev:
            ev[1].record()
        t.append(time.perf_counter())
        opt.step()
        if ev:
            ev[2].record()
            torch.cuda.synchronize(device)
        t.append(time.perf_counter())
        if i >= warmup:
            if ev:
                fb.append(ev[0].elapsed_time(ev[1]))
                st.append(ev[1].elapsed_time(ev[2]))
            else:
                fb.append(1e3 * (t[1] - t[0]))
                st.append(1e3 * (t[2] - t[1]))
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"opt_ms": statistics.median(st), "fwd_bwd_ms": statistics.median(fb)}


def timing_pass(base: RunSpec, orthogonalizers: list[str], device: torch.device, steps: int,
                large_d_models: list[int], rounds: int = 1) -> dict[str, Any]:
    """Each orthogonalizer's optimizer step on the trained model and on wider 2-layer ones.

    With ``rounds > 1`` the orthogonalizers take turns ``rounds`` times and each row is the
    median over rounds (``opt_ms_rounds`` keeps them all): a drift of the machine while
    one of them is measured then shows up as spread instead of as a difference.
    """
    out: dict[str, Any] = {"device": device_name(device), "steps": steps, "rounds": rounds, "models": {}}
    models = {"trained": base}
    for d in large_d_models:
        models[f"d_model {d}"] = replace(base, d_model=d, n_layers=2, n_heads=max(1, d // 128), batch_size=4)
    for label, spec in models.items():
        per_round: dict[str, list[dict[str, float]]] = {name: [] for name in orthogonalizers}
        for _ in range(rounds):
            for name in orthogonalizers:
                per_round[name].append(time_optimizer(replace(spec, orthogonalizer=name), device, steps))
        rows = {name: {"opt_ms": statistics.median(r["opt_ms"] for r in rs),
                       "fwd_bwd_ms": statistics.median(r["fwd_bwd_ms"] for r in rs),
                       "opt_ms_rounds": [r["opt_ms"] for r in rs]}
                for name, rs in per_round.items()}
        out["models"][label] = {"d_model": spec.d_model, "n_layers": spec.n_layers, "rows": rows}
    return out
