"""Measure on one GPU what the owner step's CUDA defaults are chosen from (not part of CI).

    python scripts/tune_owner_step.py OUT_DIR [momentum,blocks,kernels,trace,step]

1. Symmetric row blocks: for model-like shapes in both orientations, Newton-Schulz
   with 1-8 uniform row blocks: median time and whether the result is bitwise the
   1-block result (torch.optim.Muon's op sequence).
2. The fused momentum kernel (``optim/fused.py``) against torch's two lerps: bitwise
   for bf16/fp16/fp32 and several momentum values (also with Triton's multiply-add
   contraction off, to see which the stock kernel matches), and time.
3. The benchmark owner's whole step (``profile_owner_step.owner_set``), weight decay 0
   as in the benchmark: stock, ours with torch's lerps, ours as shipped, ours with
   the fastest bitwise block count of part 1 per shape; and after one step from the
   same state, the entries that differ from stock.
4. (kernels) The in-place division against torch's ``div_``; mirror and transpose
   kernels with other tiles and warp counts.
5. (trace) One step of ours under the profiler: kernel time by category against wall time.

Writes OUT_DIR/tune_owner_step.json.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
import triton
from profile_owner_step import OWNER_SHAPES, owner_set, timed

import lightning_matrixfsdp.optim.muon as muon_module
from lightning_matrixfsdp.bench.orthogonalizers import gradient_like
from lightning_matrixfsdp.bench.report import save_json
from lightning_matrixfsdp.bench.timing import matmul_tflops
from lightning_matrixfsdp.optim import fused
from lightning_matrixfsdp.optim.muon import Muon
from lightning_matrixfsdp.optim.orthogonalize import newton_schulz
from lightning_matrixfsdp.runtime.planner import newton_schulz_flops

CUDA = torch.device("cuda")
SHAPES = [(4096, 4096), (4096, 16384), (16384, 4096), (4096, 11008), (5120, 5120), (5120, 13824),
          (13824, 5120), (8192, 8192), (8192, 28672), (28672, 8192)]


def blocks_sweep(rate: float) -> list[dict]:
    rows = []
    for shape in SHAPES:
        g = gradient_like(shape, CUDA).bfloat16()
        ref = newton_schulz(g.clone(), blocks=1)
        floor = newton_schulz_flops(shape, 5) / (rate * 1e12) * 1e3
        fns = {b: (lambda b=b: newton_schulz(g.clone(), blocks=b)) for b in range(1, 9)}
        times: dict[int, list[float]] = {b: [] for b in fns}
        for _ in range(3):  # interleaved rounds against clock drift
            for b, fn in fns.items():
                times[b].append(timed(fn, reps=5, warmup=1))
        for b, fn in fns.items():
            out = fn()
            ms = sorted(times[b])[1]
            rows.append({"shape": list(shape), "blocks": b, "ms": ms, "over_floor": ms / floor,
                         "bitwise_blocks1": bool(torch.equal(out, ref)),
                         "differing": int((out != ref).sum())})
            print(json.dumps(rows[-1]), flush=True)
        del g, ref
    return rows


def _torch_momentum(g: torch.Tensor, b: torch.Tensor, mom: float) -> torch.Tensor:
    b.lerp_(g, 1 - mom)
    return g.lerp(b, mom)


def momentum_check() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants: dict[str, Callable[..., torch.Tensor]] = {
        "shipped": lambda g, b, m: fused.momentum_update(g, b, m, True),
        "no_contraction": lambda g, b, m: fused._fused_momentum(g, b, m, enable_fp_fusion=False)}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for mom in (0.95, 0.9, 0.99, 0.5, 0.3, 0.0):
            g = torch.randn(4096, 4097, device="cuda", generator=gen).to(dtype)
            b0 = torch.randn(4096, 4097, device="cuda", generator=gen).to(dtype) * 3
            ref_b = b0.clone()
            ref_u = _torch_momentum(g, ref_b, mom)
            row = {"dtype": str(dtype), "momentum": mom}
            for name, fn in variants.items():
                b = b0.clone()
                try:
                    u = fn(g, b, mom)
                except Exception as exc:  # e.g. a compile option this Triton does not take
                    row[name] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                row[name] = {"buf_differing": int((b != ref_b).sum()), "update_differing": int((u != ref_u).sum())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for shape in [(4096, 4096), (4096, 16384)]:
        g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        b = torch.zeros_like(g)
        rows.append({"shape": list(shape), "dtype": "bf16", "momentum": 0.95,
                     "torch_us": timed(lambda: _torch_momentum(g, b, 0.95), reps=20) * 1e3,
                     "fused_us": timed(lambda: fused.momentum_update(g, b, 0.95, True), reps=20) * 1e3})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def kernels_check() -> dict:
    """divide_ against torch's div_ (bitwise, time); mirror and transpose tile/warp variants."""
    from lightning_matrixfsdp.optim import transpose
    res: dict = {"divide": [], "mirror": [], "transpose": []}
    gen = torch.Generator(device="cuda").manual_seed(1)
    for shape in [(4096, 4097), (4096, 16384)]:
        x = torch.randn(shape, device="cuda", generator=gen).bfloat16() * 7
        for view in ("plain", "transposed"):
            v = x if view == "plain" else x.T
            n = v.norm().clamp(min=1e-7)
            ref, ours = v.clone().div_(n), fused.divide_(v.clone(), n)
            row = {"shape": list(v.shape), "view": view, "differing": int((ref != ours).sum()),
                   "torch_us": timed(lambda: v.div_(n).mul_(n), reps=10) * 1e3,
                   "ours_plus_mul_us": timed(lambda: fused.divide_(v, n).mul_(n), reps=10) * 1e3}
            res["divide"].append(row)
            print(json.dumps(row), flush=True)
    for m, edges in [(4096, [0, 1280, 2816, 4096]), (8192, [0, 2048, 4096, 6144, 8192])]:
        a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        plain = a.clone()
        for r0, r1 in zip(edges[:-2], edges[1:-1]):
            plain[r1:, r0:r1].copy_(plain[r0:r1, r1:].T)
        interior = edges[1:-1] + [m] * (transpose.MAX_BLOCKS - 1 - (len(edges) - 2))
        for tile in (32, 64, 128):
            for warps in (2, 4, 8):
                grid = (triton.cdiv(m, tile), triton.cdiv(m, tile))
                b = a.clone()

                def run(b=b, grid=grid, tile=tile, warps=warps) -> None:
                    transpose._mirror_kernel[grid](b, m, b.stride(0), *interior, TILE=tile, num_warps=warps)
                run()
                row = {"m": m, "edges": edges, "tile": tile, "warps": warps, "equal": bool(torch.equal(b, plain)),
                       "us": timed(run, reps=20) * 1e3}
                res["mirror"].append(row)
                print(json.dumps(row), flush=True)
        row = {"m": m, "edges": edges, "shipped_us": timed(lambda: transpose.mirror_lower_blocks_(a, edges), reps=20) * 1e3}
        res["mirror"].append(row)
        print(json.dumps(row), flush=True)
    src = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    for tile in (32, 64, 128):
        for warps in (2, 4, 8):
            dst = torch.empty(4096, 16384, device="cuda", dtype=torch.bfloat16)
            grid = (triton.cdiv(4096, tile), triton.cdiv(16384, tile))

            def run(dst=dst, grid=grid, tile=tile, warps=warps) -> None:
                transpose._transpose_kernel[grid](src, dst, 4096, 16384, TILE=tile, num_warps=warps)
            run()
            row = {"shape": [16384, 4096], "tile": tile, "warps": warps, "equal": bool(torch.equal(dst, src.T)),
                   "us": timed(run, reps=20) * 1e3}
            res["transpose"].append(row)
            print(json.dumps(row), flush=True)
    return res


def best_blocks(sweep: list[dict]) -> dict[tuple[int, int], int]:
    best: dict[tuple[int, int], tuple[float, int]] = {}
    for r in sweep:
        key = tuple(r["shape"])
        if r["bitwise_blocks1"] and (key not in best or r["ms"] < best[key][0]):
            best[key] = (r["ms"], r["blocks"])
    return {k: v[1] for k, v in best.items()}


def _ours(mats: list, emb: torch.nn.Parameter, fused_momentum: bool, per_shape: dict | None) -> Callable[[], None]:
    if per_shape is None:
        opt = Muon(mats + [emb], lr=0.02, weight_decay=0.0)
    else:
        groups: dict[tuple[int, int], list] = {}
        for p in mats:
            groups.setdefault(tuple(p.shape), []).append(p)
        opt = Muon([{"params": ps, "symmetric_blocks": per_shape.get(s)} for s, ps in groups.items()]
                   + [{"params": [emb]}], lr=0.02, weight_decay=0.0)

    def step() -> None:
        muon_module.FUSED_MOMENTUM = fused_momentum
        opt.step()
        muon_module.FUSED_MOMENTUM = True
    return step


def whole_step(rate: float, per_shape: dict, rounds: int = 3) -> dict:
    configs = {"ours, torch lerps": (False, None), "ours default": (True, None)}
    if per_shape:
        configs["ours default, best bitwise blocks per shape"] = (True, per_shape)
    mats, emb = owner_set()
    steps: dict[str, Callable[[], object]] = {}
    t_muon = torch.optim.Muon(mats, lr=0.02, weight_decay=0.0)
    t_adam = torch.optim.AdamW([emb], lr=0.02, weight_decay=0.0)
    steps["torch.optim.Muon + AdamW"] = lambda: (t_muon.step(), t_adam.step())
    for name, (fm, ps) in configs.items():
        steps[name] = _ours(mats, emb, fm, ps)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            times[name].append(timed(fn, reps=3, warmup=1))
            print(name, round(times[name][-1], 1), flush=True)
    floor = sum(newton_schulz_flops(s, 5) for s in OWNER_SHAPES) / (rate * 1e12) * 1e3
    res = {"floor_ms": floor, "ms": {k: sorted(v)[len(v) // 2] for k, v in times.items()}, "all_rounds_ms": times}
    res["over_floor"] = {k: v / floor for k, v in res["ms"].items()}
    del steps, t_muon, t_adam, mats, emb
    torch.cuda.empty_cache()
    agreement = {}
    mats, emb = owner_set(1)
    torch.optim.Muon(mats, lr=0.02, weight_decay=0.0).step()
    torch.optim.AdamW([emb], lr=0.02, weight_decay=0.0).step()
    stock = [p.detach().clone() for p in mats + [emb]]
    del mats, emb
    for name, (fm, ps) in configs.items():
        mats, emb = owner_set(1)
        _ours(mats, emb, fm, ps)()
        agreement[name] = sum(int((a != b).sum()) for a, b in zip(mats + [emb], stock))
        print(name, "differing entries", agreement[name], flush=True)
        del mats, emb
    res["differing_entries_vs_stock"] = agreement
    return res


def _category(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "gemm"
    if "triton" in low or low.startswith(("_momentum", "_divide", "_mirror", "_transpose")):
        return "triton"
    if "reduce" in low or "norm" in low:
        return "reduction"
    return "other elementwise"


def _idle(prof) -> dict:
    """GPU idle time between the first and last kernel, by the kernels around each gap."""
    from torch.autograd import DeviceType
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    if not spans:
        return {}
    gaps: dict[str, list[float]] = {}
    busy_until, last = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > busy_until + 1:  # microseconds
            key = f"{_category(last)} -> {_category(name)}: {last[:40]} -> {name[:40]}"
            gaps.setdefault(key, []).append(start - busy_until)
        if end > busy_until:
            busy_until, last = end, name
    total = sum(sum(v) for v in gaps.values()) / 1e3
    top = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"span_ms": (busy_until - spans[0][0]) / 1e3, "idle_ms": total,
            "top": [[k, len(v), sum(v) / 1e3] for k, v in top]}


def trace_step() -> dict:
    """Kernel time of one owner step by category, against its wall time (the rest is gaps)."""
    from torch.profiler import ProfilerActivity, profile
    mats, emb = owner_set()
    step = _ours(mats, emb, True, None)
    step()
    torch.cuda.synchronize()
    wall = timed(step, reps=3, warmup=0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            kernels[e.key] = kernels.get(e.key, 0.0) + us / 1e3
    by_cat: dict[str, float] = {}
    for name, ms in kernels.items():
        by_cat[_category(name)] = by_cat.get(_category(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    res = {"wall_ms": wall, "kernel_ms": sum(kernels.values()), "by_category_ms": by_cat,
           "top_kernels_ms": [[k[:120], v] for k, v in top], "idle": _idle(prof)}
    print(json.dumps(res, indent=1), flush=True)
    del mats, emb, step
    torch.cuda.empty_cache()
    return res


def main(out: str, parts: set[str]) -> None:
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "matmul_tflops_start": matmul_tflops(CUDA)}
    rate = res["matmul_tflops_start"]
    if "momentum" in parts:
        res["momentum"] = momentum_check()
    if "kernels" in parts:
        res["kernels"] = kernels_check()
    per_shape: dict = {}
    if "blocks" in parts:
        res["blocks_sweep"] = blocks_sweep(rate)
        per_shape = best_blocks(res["blocks_sweep"])
        res["best_bitwise_blocks"] = {f"{m}x{n}": b for (m, n), b in per_shape.items()}
        print(res["best_bitwise_blocks"], flush=True)
    if "trace" in parts:
        res["trace"] = trace_step()
    if "step" in parts:
        res["whole_step"] = whole_step(rate, per_shape)
    res["matmul_tflops_end"] = matmul_tflops(CUDA)
    save_json(out, "tune_owner_step.json", res, omit=("blocks_sweep", "momentum"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tune_out",
         set(sys.argv[2].split(",")) if len(sys.argv) > 2 else {"momentum", "blocks", "trace", "step"})
