"""Attribute and compare the owner's optimizer step on one GPU (not part of CI).

    python scripts/profile_owner_step.py OUT_DIR

Builds the matrices one owner holds in the 2-GPU one-node benchmark (32 of 4096x4096,
16 of 16384x4096, 8 of 4096x16384, bf16, plus one 32000x4096 AdamW tensor) and measures:

* per shape, Newton-Schulz as ``torch.optim.Muon`` runs it and ours with 1-4 symmetric
  row blocks, Polar Express and the Gram-space iteration: time, whether the result is
  bitwise the stock one, the largest difference, the distance to the exact polar factor;
* the one-launch Triton mirror against per-block ``copy_``;
* the whole owner step, rounds interleaved: ``torch.optim.Muon`` + ``AdamW`` against our
  ``Muon`` with 1-4 symmetric row blocks, and the opt-in ``fast`` path;
* after one step from the same state, how many parameter entries differ from the stock
  optimizer's for each of our configurations.

Writes OUT_DIR/owner_step_profile.json.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import lightning_matrixfsdp.optim.orthogonalize as ortho
from lightning_matrixfsdp.bench.orthogonalizers import gradient_like
from lightning_matrixfsdp.bench.report import save_json
from lightning_matrixfsdp.bench.timing import matmul_tflops, median_ms
from lightning_matrixfsdp.optim.muon import Muon
from lightning_matrixfsdp.runtime.planner import newton_schulz_flops

COEFFS = ortho.DEFAULT_NS_COEFFICIENTS  # torch.optim.Muon's
OWNER_SHAPES = [(4096, 4096)] * 32 + [(16384, 4096)] * 16 + [(4096, 16384)] * 8


CUDA = torch.device("cuda")


def timed(fn: Callable[[], object], reps: int = 5, warmup: int = 2) -> float:
    return median_ms(fn, CUDA, reps, warmup)


def per_shape(rate: float) -> list[dict]:
    rows = []
    for shape in [(4096, 4096), (4096, 16384), (16384, 4096)]:
        g = gradient_like(shape, torch.device("cuda")).bfloat16()
        floor = newton_schulz_flops(shape, 5) / (rate * 1e12) * 1e3
        ref = _zeropower_via_newtonschulz(g.clone(), COEFFS, 5, 1e-7)
        variants: dict[str, Callable[[], torch.Tensor]] = {
            "torch.optim.Muon": lambda: _zeropower_via_newtonschulz(g.clone(), COEFFS, 5, 1e-7)}
        for blocks in (1, 2, 3, 4):
            variants[f"ns blocks={blocks}"] = lambda b=blocks: ortho.newton_schulz(g.clone(), COEFFS, 5, 1e-7, b)
        for blocks in (1, 2, 3, 4):
            variants[f"polar_express blocks={blocks}"] = lambda b=blocks: ortho.polar_express(g.clone(), blocks=b)
            if max(shape) >= 4 * min(shape):
                variants[f"gram_polar_express blocks={blocks}"] = (
                    lambda b=blocks: ortho.gram_polar_express(g.clone(), blocks=b))
        for name, fn in variants.items():
            out = fn()
            ms = timed(fn, reps=7)
            rows.append({"shape": list(shape), "variant": name, "ms": ms, "over_floor": ms / floor,
                         "bitwise_stock": bool(torch.equal(out, ref)),
                         "max_abs_diff_stock": float((out.float() - ref.float()).abs().max()),
                         "polar_error": ortho.polar_error(out.float(), g.float())})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def mirror_check() -> dict:
    """The one-launch Triton mirror (3 blocks of 4096) against torch's per-block copies."""
    from lightning_matrixfsdp.optim import transpose
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    edges = [0, 1280, 2816, 4096]
    kernel, plain = a.clone(), a.clone()
    transpose.mirror_lower_blocks_(kernel, edges)

    def per_block() -> None:
        for r0, r1 in zip(edges[:-2], edges[1:-1]):
            plain[r1:, r0:r1].copy_(plain[r0:r1, r1:].T)

    per_block()
    return {"triton": transpose.HAS_TRITON, "equal": bool(torch.equal(kernel, plain)),
            "kernel_us": timed(lambda: transpose.mirror_lower_blocks_(kernel, edges), reps=20) * 1e3,
            "torch_copy_us": timed(per_block, reps=20) * 1e3}


def owner_set(seed: int = 0) -> tuple[list[torch.nn.Parameter], torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mats = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
            for s in OWNER_SHAPES]
    emb = torch.nn.Parameter(torch.randn(32000, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
    emb._mfsdp_role = "tail"  # as the runtime tags it: AdamW in our Muon, not Newton-Schulz
    for p in mats + [emb]:
        p.grad = torch.randn(p.shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-3
    return mats, emb


CONFIGS = {
    "ours blocks=1": dict(symmetric_blocks=1),
    "ours blocks=2": dict(symmetric_blocks=2),
    "ours blocks=3": dict(symmetric_blocks=3),
    "ours blocks=4": dict(symmetric_blocks=4),
    "ours default": dict(),
    "ours fast blocks=1": dict(orthogonalizer="fast", symmetric_blocks=1),
    "ours fast default": dict(orthogonalizer="fast"),
}


def whole_step(rate: float, rounds: int = 3) -> dict:
    mats, emb = owner_set()
    flops = sum(newton_schulz_flops(s, 5) for s in OWNER_SHAPES)
    steps: dict[str, Callable[[], object]] = {}
    t_muon = torch.optim.Muon(mats, lr=0.02)
    t_adam = torch.optim.AdamW([emb], lr=0.02, weight_decay=0.1)
    steps["torch.optim.Muon + AdamW"] = lambda: (t_muon.step(), t_adam.step())
    for name, kw in CONFIGS.items():
        steps[name] = Muon(mats + [emb], lr=0.02, **kw).step
    steps["ns only (stock function)"] = lambda: [_zeropower_via_newtonschulz(p.grad, COEFFS, 5, 1e-7) for p in mats]
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            times[name].append(timed(fn, reps=3, warmup=1))
            print(name, round(times[name][-1], 1), flush=True)
    floor = flops / (rate * 1e12) * 1e3
    res = {"ns_flops": flops, "floor_ms": floor, "ms": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
           "all_rounds_ms": times}
    res["over_floor"] = {k: v / floor for k, v in res["ms"].items()}
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    del steps, t_muon, t_adam, mats, emb
    torch.cuda.empty_cache()
    res["peak_gib_all_optimizers"] = peak
    return res


def step_agreement() -> dict:
    """One step from the same state: entries of our parameters that differ from stock."""
    mats, emb = owner_set(1)
    torch.optim.Muon(mats, lr=0.02).step()
    torch.optim.AdamW([emb], lr=0.02, weight_decay=0.1).step()
    stock = [p.detach().clone() for p in mats + [emb]]
    del mats, emb
    out = {}
    for name, kw in CONFIGS.items():
        mats, emb = owner_set(1)
        Muon(mats + [emb], lr=0.02, **kw).step()
        ours = mats + [emb]
        diff = sum(int((a != b).sum()) for a, b in zip(ours, stock))
        worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ours, stock))
        out[name] = {"differing_entries": diff, "of": sum(p.numel() for p in stock), "max_abs_diff": worst}
        print(name, out[name], flush=True)
        del mats, emb, ours
    return out


def main(out: str) -> None:
    torch.manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cuda": torch.version.cuda, "matmul_tflops_start": matmul_tflops(CUDA)}
    rate = res["matmul_tflops_start"]
    res["mirror"] = mirror_check()
    print(res["mirror"], flush=True)
    res["per_shape"] = per_shape(rate)
    res["whole_step"] = whole_step(rate)
    res["step_agreement"] = step_agreement()
    res["matmul_tflops_end"] = matmul_tflops(CUDA)
    save_json(out, "owner_step_profile.json", res, omit=("per_shape",))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "profile_out")
