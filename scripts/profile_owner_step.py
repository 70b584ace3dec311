"""Attribute the owner's optimizer-step time on one GPU (not part of CI).

    python scripts/profile_owner_step.py OUT_DIR

Builds the matrices one owner holds in the 2-GPU one-node benchmark (32 of 4096x4096,
16 of 16384x4096, 8 of 4096x16384, bf16, plus one 32000x4096 AdamW tensor) and times,
as medians of back-to-back runs: our Muon step, torch.optim.Muon + AdamW, Newton-Schulz
alone over the same matrices, and the step with orthogonalization replaced by a copy
(the elementwise work). Writes OUT_DIR/owner_step_profile.json.
"""
from __future__ import annotations

import json
import os
import sys
from unittest import mock

import torch

from lightning_matrixfsdp.optim import muon as muon_mod
from lightning_matrixfsdp.optim.muon import Muon
from lightning_matrixfsdp.optim.orthogonalize import newton_schulz
from lightning_matrixfsdp.runtime.placement import newton_schulz_flops


def timed(fn, reps: int = 5) -> float:
    fn()
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def main(out: str) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [(4096, 4096)] * 32 + [(16384, 4096)] * 16 + [(4096, 16384)] * 8
    mats = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02) for s in shapes]
    emb = torch.nn.Parameter(torch.randn(32000, 4096, device=dev, dtype=torch.bfloat16) * 0.02)
    for p in mats + [emb]:
        p.grad = torch.randn_like(p) * 1e-3
    flops = sum(newton_schulz_flops(s, 5) for s in shapes)
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    rate = 2 * n ** 3 / (timed(lambda: a @ a) * 1e-3) / 1e12
    ours = Muon(mats + [emb], lr=0.02)
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "matmul_tflops": rate,
           "ns_flops": flops, "floor_ms": flops / (rate * 1e12) * 1e3}
    res["ours_step_ms"] = timed(ours.step)
    res["ns_only_ms"] = timed(lambda: [newton_schulz(p.grad) for p in mats])
    with mock.patch.object(muon_mod.Muon, "_orthogonalize", staticmethod(lambda g, u: [x.bfloat16() for x in u])):
        res["elementwise_only_ms"] = timed(ours.step)
    t_muon = torch.optim.Muon(mats, lr=0.02)
    t_adam = torch.optim.AdamW([emb], lr=0.02)
    res["torch_muon_adamw_ms"] = timed(lambda: (t_muon.step(), t_adam.step()))
    res["adamw_tail_ms"] = timed(t_adam.step)
    res["ns_sustained_x3_ms"] = timed(lambda: [newton_schulz(p.grad) for _ in range(3) for p in mats], reps=3) / 3
    res["ours_over_floor"] = res["ours_step_ms"] / res["floor_ms"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "owner_step_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "profile_out")
