"""Orthogonalizer micro-benchmark: time, achieved rate and accuracy per matrix shape.

    python -m lightning_matrixfsdp.bench.orthogonalizers --shapes 4096x4096 4096x16384 16384x4096

Measures the bf16 matmul rate of this GPU (the ceiling behind the Newton-Schulz
FLOP floor), then for each shape times ``torch.optim.Muon``'s Newton-Schulz (our
bitwise copy), the batched variant, Polar Express and the Gram-space iterations
(``gram_polar_express``, and ``gram_newton_schulz``: the default's quintic in Gram space,
which ``fast`` once ran), ``fast`` (four fitted quintics, alone and batched), and reports
each one's distance to the exact polar factor (float64 SVD) and its
update RMS relative to the stock iteration's on a gradient-like matrix: at the same
learning rate, a ratio above 1 is a larger step.  Output: JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

import torch

from lightning_matrixfsdp.optim.fast import fast_newton_schulz, fast_newton_schulz_batched
from lightning_matrixfsdp.optim.orthogonalize import (
    DEFAULT_NS_COEFFICIENTS,
    gram_newton_schulz,
    gram_polar_express,
    newton_schulz,
    newton_schulz_batched,
    polar_error,
    polar_factor,
    polar_express,
)
from lightning_matrixfsdp.runtime.planner import newton_schulz_flops

from .timing import matmul_tflops, median_ms

COEFFS = DEFAULT_NS_COEFFICIENTS  # torch.optim.Muon's


def gradient_like(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Low-rank-plus-noise, like real gradients (a decaying spectrum)."""
    m, n = shape
    g = torch.Generator(device=device).manual_seed(0)
    r = min(m, n)
    u = torch.randn(m, r, device=device, generator=g) / r ** 0.5
    v = torch.randn(r, n, device=device, generator=g) / r ** 0.5
    s = torch.logspace(0, -3, r, device=device)
    return (u * s) @ v + 1e-3 * torch.randn(m, n, device=device, generator=g)


def run(shapes: list[tuple[int, int]], device: torch.device, reps: int, batch: int) -> dict:
    rate = matmul_tflops(device) if device.type == "cuda" else float("nan")
    rows = []
    for shape in shapes:
        x = gradient_like(shape, device)
        xs = [x.clone() for _ in range(batch)]
        flops = newton_schulz_flops(shape, 5)
        methods: dict[str, tuple[Callable[[], object], Callable[[], torch.Tensor]]] = {
            "newton_schulz blocks=1 (torch.optim.Muon's ops)": (
                lambda: newton_schulz(x, COEFFS, 5, 1e-7, blocks=1), lambda: newton_schulz(x, COEFFS, 5, 1e-7, blocks=1)),
            "newton_schulz (default: symmetric blocks on CUDA)": (
                lambda: newton_schulz(x, COEFFS, 5, 1e-7), lambda: newton_schulz(x, COEFFS, 5, 1e-7)),
            f"batched x{batch} (per matrix)": (lambda: newton_schulz_batched(xs, COEFFS, 5, 1e-7),
                                               lambda: newton_schulz_batched(xs[:1], COEFFS, 5, 1e-7)[0]),
            "fast (4 fitted quintics)": (lambda: fast_newton_schulz(x), lambda: fast_newton_schulz(x)),
            f"fast batched x{batch} (per matrix)": (lambda: fast_newton_schulz_batched(xs),
                                                    lambda: fast_newton_schulz_batched(xs[:1])[0]),
            "polar_express 5": (lambda: polar_express(x, 5), lambda: polar_express(x, 5)),
            "polar_express 4": (lambda: polar_express(x, 4), lambda: polar_express(x, 4)),
            "gram_polar_express 5": (lambda: gram_polar_express(x, 5), lambda: gram_polar_express(x, 5)),
            "gram_newton_schulz 5": (lambda: gram_newton_schulz(x), lambda: gram_newton_schulz(x)),
        }
        stock = newton_schulz(x, COEFFS, 5, 1e-7, blocks=1)
        stock_rms = stock.float().pow(2).mean().sqrt()
        polar = polar_factor(x)  # one SVD per shape
        for name, (timed, result) in methods.items():
            ms = median_ms(timed, device, reps)
            if "batched" in name:
                ms /= batch
            out = result()
            err = polar_error(out.float(), x, polar=polar)
            rows.append({"shape": list(shape), "method": name, "ms": ms,
                         "bitwise_stock": bool(torch.equal(out, stock)),
                         "ns_equivalent_tflops": flops / (ms * 1e-3) / 1e12,
                         "floor_ms": flops / (rate * 1e12) * 1e3 if rate == rate else None,
                         "polar_error": err,
                         "rms_vs_stock": float(out.float().pow(2).mean().sqrt() / stock_rms)})
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "matmul_bf16_tflops": rate, "rows": rows}


def to_markdown(res: dict) -> str:
    lines = [f"bf16 matmul rate (8192^3): {res['matmul_bf16_tflops']:.0f} TFLOP/s on {res['device']}, "
             f"torch {res['torch']}", "",
             "| shape | method | ms / matrix | NS-5 FLOP floor ms | time / floor | NS-equivalent TFLOP/s | "
             "polar error | RMS / stock | bitwise = stock |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in res["rows"]:
        floor = r["floor_ms"]
        ratio = f"{r['ms'] / floor:.2f}" if floor else "n/a"
        fl = f"{floor:.2f}" if floor else "n/a"
        lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['method']} | {r['ms']:.2f} | {fl} | {ratio} | "
                     f"{r['ns_equivalent_tflops']:.0f} | {r['polar_error']:.3f} | "
                     f"{r.get('rms_vs_stock', float('nan')):.3f} | {'yes' if r['bitwise_stock'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x16384", "16384x4096", "2048x2048",
                                                     "2048x8192", "1024x1024", "1024x4096"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    res = run(shapes, device, args.reps, args.batch)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "orthogonalizers.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = to_markdown(res)
    with open(os.path.join(args.out, "orthogonalizers.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
