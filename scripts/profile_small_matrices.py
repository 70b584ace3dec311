"""Is batching same-shape matrices bitwise and worth it on this GPU? (not part of CI)

    python scripts/profile_small_matrices.py OUT_DIR

For shapes below the symmetric-product threshold: batched Newton-Schulz of 8 matrices
against the per-matrix loop (bitwise?), and a whole Muon step on a small model's owner set
(48 of 1024x1024, 24 of 4096x1024, 24 of 1024x4096): stock ``torch.optim.Muon``, our
default, our ``orthogonalizer="batched"``; with the entries differing from stock after
one step. Writes OUT_DIR/small_matrices.json.
"""
from __future__ import annotations

import sys

import torch

from lightning_matrixfsdp.bench.report import save_json
from lightning_matrixfsdp.bench.timing import median_ms
from lightning_matrixfsdp.optim.muon import Muon
from lightning_matrixfsdp.optim.orthogonalize import newton_schulz, newton_schulz_batched

SHAPES = [(128, 512), (512, 512), (1024, 1024), (1024, 4096), (4096, 1024), (2048, 2048), (2048, 8192)]
OWNER = [(1024, 1024)] * 48 + [(4096, 1024)] * 24 + [(1024, 4096)] * 24


def timed(fn, reps: int = 5) -> float:
    return median_ms(fn, torch.device("cuda"), reps, warmup=1)


def owner_set(seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02) for s in OWNER]
    for p in ps:
        p.grad = torch.randn(p.shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-3
    return ps


def main(out: str) -> None:
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "batched_vs_loop": []}
    for shape in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        gs = [torch.randn(shape, device="cuda", generator=gen) for _ in range(8)]
        loop = [newton_schulz(g, blocks=1) for g in gs]
        batched = newton_schulz_batched(gs)
        res["batched_vs_loop"].append({
            "shape": list(shape), "bitwise": all(torch.equal(a, b) for a, b in zip(loop, batched)),
            "loop_ms": timed(lambda: [newton_schulz(g, blocks=1) for g in gs]),
            "batched_ms": timed(lambda: newton_schulz_batched(gs))})
        print(res["batched_vs_loop"][-1], flush=True)
    ref = owner_set(1)
    torch.optim.Muon(ref, lr=0.02).step()
    steps, agree = {}, {}
    for name, kw in {"ours default": {}, "ours batched": {"orthogonalizer": "batched"}}.items():
        ps = owner_set(1)
        Muon(ps, lr=0.02, **kw).step()
        agree[name] = sum(int((a != b).sum()) for a, b in zip(ps, ref))
        opt = Muon(ps, lr=0.02, **kw)
        steps[name] = timed(opt.step)
    ps = owner_set(2)
    t = torch.optim.Muon(ps, lr=0.02)
    steps["torch.optim.Muon"] = timed(t.step)
    res["owner_step_ms"], res["entries_differing_from_stock"] = steps, agree
    save_json(out, "small_matrices.json", res, omit=("batched_vs_loop",))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "profile_out")
