"""The experts' Muon step alone, variant by variant, against torch.optim.Muon and the FLOP floor
(issue 30, section 4).

    python scripts/gpu_expert_step.py [--preset h200] [--out DIR] [--reps N] [--variants A B ...]
        [--layers L --experts E --hidden H --mlp I] [--profile NAME ...]

The stacks are those of ``bench/moe_model.py``'s preset (``h200``: 8 layers of
``gate_up_proj [8, 8192, 2048]`` declared as two (4096, 2048) blocks and ``down_proj
[8, 2048, 4096]``), fp32 weights and gradients as under bf16-mixed. Each variant is a set of
module switches and ``Muon`` options (see ``VARIANTS``); for each one, in one process:

- bitwise: two steps of ours against two steps of ``torch.optim.Muon`` on every expert's gate,
  up and down as separate 2-D parameters (views of a copy of the stacks): the number of weight
  entries that differ and the largest difference;
- time: the median of ``--reps`` steps (CUDA events), the host's time to issue one step, and
  the GPU's time alone (the step queued behind ~60 ms of matmuls, so no host gap counts).

Also measured in the same process: the Newton-Schulz matmuls alone (torch's three products per
iteration, matrix by matrix, and batched per stack), the FLOP floor (``steps (4 m^2 n + 2 m^3)``
per matrix over the bf16 rate of an 8192^3 matmul), and, for ``--profile`` variants, the GPU
time per kernel name (torch.profiler, top rows). On a CPU, pass small ``--hidden``/``--mlp``
(multiples of 512) to check the script; its figures mean nothing there. Writes
``OUT/gpu_expert_step.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_matrixfsdp.bench.moe_model import MOE_PRESETS  # noqa: E402
from lightning_matrixfsdp.bench.timing import matmul_tflops, median_ms, ns_matmuls  # noqa: E402
from lightning_matrixfsdp.optim import iteration, muon, symmetric  # noqa: E402
from lightning_matrixfsdp.runtime.experts.stacks import ExpertStack  # noqa: E402
from lightning_matrixfsdp.runtime.tags import tag_stack  # noqa: E402

LR, WD = 0.02, 0.1

#: name -> (module switches, Muon options). "current" is the step as at 52ea310 (pieces cast and
#: stacked one by one, plain batched products); the others view the stack whole.
VARIANTS: dict[str, tuple[dict, dict]] = {
    "current": ({"STACK_WHOLE": False, "BATCH_SYMMETRIC_BLOCKS": 1, "ACCUMULATE_IN_PLACE": False}, {}),
    "whole": ({"STACK_WHOLE": True, "FUSED_UPDATE": False, "BATCH_SYMMETRIC_BLOCKS": 1}, {}),
    "whole_fused": ({"STACK_WHOLE": True, "FUSED_UPDATE": True, "BATCH_SYMMETRIC_BLOCKS": 1}, {}),
    "whole_fused_ns0": ({"STACK_WHOLE": True, "FUSED_UPDATE": True}, {"ns_steps": 0}),
    "sym3_strided": ({"STACK_WHOLE": True, "FUSED_UPDATE": False, "ACCUMULATE_IN_PLACE": False},
                     {"symmetric_blocks": 3}),
    "sym3_acc": ({"STACK_WHOLE": True, "FUSED_UPDATE": False, "ACCUMULATE_IN_PLACE": True}, {"symmetric_blocks": 3}),
    "sym2_all": ({"STACK_WHOLE": True, "FUSED_UPDATE": True, "ACCUMULATE_IN_PLACE": True}, {"symmetric_blocks": 2}),
    "sym3_all": ({"STACK_WHOLE": True, "FUSED_UPDATE": True, "ACCUMULATE_IN_PLACE": True}, {"symmetric_blocks": 3}),
    "sym4_all": ({"STACK_WHOLE": True, "FUSED_UPDATE": True, "ACCUMULATE_IN_PLACE": True}, {"symmetric_blocks": 4}),
    "sym8_all": ({"STACK_WHOLE": True, "FUSED_UPDATE": True, "ACCUMULATE_IN_PLACE": True}, {"symmetric_blocks": 8}),
    "sym4_colmajor": ({"STACK_WHOLE": True, "BATCH_ROW_MAJOR": False}, {"symmetric_blocks": 4}),
    "sym4_nofuse": ({"STACK_WHOLE": True, "FUSED_UPDATE": False}, {"symmetric_blocks": 4}),
    "no_mirror_copies": ({"MIRROR_COPIES": False}, {}),
    "default": ({}, {}),
}
_SWITCHES = {"STACK_WHOLE": muon, "FUSED_UPDATE": muon, "BATCH_SYMMETRIC_BLOCKS": symmetric,
             "ACCUMULATE_IN_PLACE": symmetric, "BATCH_ROW_MAJOR": iteration, "MIRROR_COPIES": symmetric}


def _set_switches(values: dict) -> dict:
    old = {k: getattr(_SWITCHES[k], k) for k in _SWITCHES}
    for k, v in values.items():
        setattr(_SWITCHES[k], k, v)
    return old


class Problem:
    """The stacks' initial weights and two gradients, and torch.optim.Muon's weights after two steps."""

    def __init__(self, layers: int, e: int, h: int, i: int, dev: torch.device) -> None:
        gen = torch.Generator(device=dev).manual_seed(0)
        self.shapes = [(e, 2 * i, h), (e, h, i)] * layers
        self.blocks = {(e, 2 * i, h): (i, i), (e, h, i): (h,)}
        self.w0 = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in self.shapes]
        self.grads = [[torch.randn(s, device=dev, generator=gen) * 1e-3 for s in self.shapes] for _ in range(2)]
        self.ref = self._reference()

    def pieces(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for k in range(t.shape[0]):
            start = 0
            for rows in self.blocks[tuple(t.shape)]:
                out.append(t[k, start:start + rows])
                start += rows
        return out

    def _reference(self) -> list[torch.Tensor]:
        stacks = [w.clone() for w in self.w0]
        views = [torch.nn.Parameter(v) for s in stacks for v in self.pieces(s)]
        opt = torch.optim.Muon(views, lr=LR, weight_decay=WD)
        for grads in self.grads:
            for v, g in zip(views, [g for gs in grads for g in self.pieces(gs)]):
                v.grad = g
            opt.step()
        return [v.detach() for v in views]

    def ours(self, options: dict) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
        params = []
        for w in self.w0:
            p = torch.nn.Parameter(w.clone())
            tag_stack(p, ExpertStack(w.shape[0], self.blocks[tuple(w.shape)]))
            params.append(p)
        return params, muon.Muon([{"params": params, "role": "matrix"}], lr=LR, weight_decay=WD, **options)

    def check(self, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> dict:
        for grads in self.grads:
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
        ours = [v for p in params for v in self.pieces(p.detach())]
        differ = sum(int((a != b).sum()) for a, b in zip(ours, self.ref))
        worst = max(float((a - b).abs().max()) for a, b in zip(ours, self.ref))
        return {"differ": differ, "max_abs_diff": worst, "entries": sum(a.numel() for a in ours)}


def _ns_batched(stacks: list[torch.Tensor], steps: int = 5) -> None:
    a, b, c = 3.4445, -4.7750, 2.0315
    for x in stacks:
        for _ in range(steps):
            g = torch.bmm(x, x.mT)
            y = torch.baddbmm(g, g, g, beta=b, alpha=c)
            x = torch.baddbmm(x, y, x, beta=a)


def _dense_check(dev: torch.device, size: int, reps: int) -> dict:
    """Single large matrices (the dense path's symmetric products): our ``newton_schulz`` with its
    automatic blocks against torch.optim.Muon's own iteration, bits and time."""
    from torch.optim._muon import _zeropower_via_newtonschulz as stock

    from lightning_matrixfsdp.optim.orthogonalize import newton_schulz

    coefficients, out = (3.4445, -4.7750, 2.0315), {}
    for shape in [(size, size), (size, 2 * size), (2 * size, size)]:
        g = torch.randn(shape, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
        ours, ref = newton_schulz(g, coefficients, 5, 1e-7), stock(g, coefficients, 5, 1e-7)
        out[str(shape)] = {"differ": int((ours != ref).sum()),
                           "ours_ms": median_ms(lambda: newton_schulz(g, coefficients, 5, 1e-7), dev, reps),
                           "stock_ms": median_ms(lambda: stock(g, coefficients, 5, 1e-7), dev, reps)}
    return out


def _profile(step, dev: torch.device, top: int = 14) -> list[list]:
    """GPU milliseconds per kernel name over two steps, per step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize(dev)
    per: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:70]
            per[name] += ev.device_time_total / 1e3 / 2
            count[name] += 1
    rows = sorted(per.items(), key=lambda kv: -kv[1])
    total = sum(per.values())
    spans = [(ev.time_range.start, ev.time_range.end) for ev in prof.events()
             if ev.device_type == torch.autograd.DeviceType.CUDA]
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3 / 2 if spans else 0.0
    return ([["TOTAL", round(total, 2), 0], ["SPAN first kernel start to last end", round(span, 2), 0]]
            + [[n, round(ms, 2), count[n] // 2] for n, ms in rows[:top]])


def _cpu_ms(step, dev: torch.device) -> float:
    """Milliseconds the host takes to issue one step (no synchronization inside)."""
    out = []
    for _ in range(3):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        step()
        out.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize(dev)
    return sorted(out)[1]


def _gpu_ms(step, dev: torch.device, reps: int = 5) -> float:
    """Milliseconds of GPU work in one step without the host's issue time: a queue of matmuls
    (about 60 ms) runs first, so the host has issued the whole step before the GPU reaches it."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(dev)
        for _ in range(40):
            a @ a
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize(dev)
        out.append(start.elapsed_time(end))
    return sorted(out)[len(out) // 2]


def _gpu_clock() -> list[float] | None:
    """nvidia-smi's SM clock (MHz), power (W) and temperature (C) now, or None without it."""
    import subprocess

    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
        return [float(v) for v in line.splitlines()[0].split(",")]
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _sustained(step, dev: torch.device, flops: float, rounds: int = 7) -> dict:
    """The step beside the floor at the matmul rate the GPU sustains in the same state: ``rounds``
    of [8192^3 matmuls carrying the step's Newton-Schulz FLOPs, timed as one block; one step,
    timed], back to back after one untimed round; medians. The burst rate of ``matmul_tflops``
    (10 matmuls on a cool GPU) is above what a 100 ms stretch of matmuls keeps up once the
    clocks settle under load; this floor is the same FLOPs in the best-shaped GEMM, measured
    alternately with the step. The SM clock, power and temperature are read mid-block."""
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    count = max(1, round(flops / (2 * n ** 3)))

    def timed(fn) -> tuple[float, list[float] | None]:
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        clock = _gpu_clock()  # the host issued the block; the GPU is still in it
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end), clock

    def matmuls() -> None:
        for _ in range(count):
            torch.mm(a, a, out=c)

    floors, steps, clocks = [], [], []
    for r in range(rounds + 1):
        g, g_clock = timed(matmuls)
        s, s_clock = timed(step)
        if r:
            floors.append(g * flops / (count * 2 * n ** 3))
            steps.append(s)
            clocks.append({"matmuls": g_clock, "step": s_clock})
    floor, ms = sorted(floors)[len(floors) // 2], sorted(steps)[len(steps) // 2]
    return {"floor_ms": floor, "step_ms": ms, "over_floor": ms / floor, "matmul_tflops": flops / (floor * 1e-3) / 1e12,
            "rounds": rounds, "floors_ms": floors, "steps_ms": steps, "clock_mhz_w_c": clocks}


def _batch_check(dev: torch.device, shapes: list[tuple[int, int]], blocks: list[int], reps: int) -> dict:
    """Stacks of 8 same-shape matrices: the batched iteration with symmetric blocks against
    torch.optim.Muon's per-matrix iteration (bits) and the plain batched one (time)."""
    from torch.optim._muon import _zeropower_via_newtonschulz as stock

    from lightning_matrixfsdp.optim.orthogonalize import newton_schulz_batched

    coefficients, out = (3.4445, -4.7750, 2.0315), {}
    for shape in shapes:
        gen = torch.Generator(device=dev).manual_seed(2)
        gs = [torch.randn(shape, device=dev, generator=gen) for _ in range(8)]
        ref = [stock(g, coefficients, 5, 1e-7) for g in gs]
        row = {"plain_ms": median_ms(lambda: newton_schulz_batched(gs, coefficients, 5, 1e-7, 1), dev, reps)}
        for b in blocks:
            ours = newton_schulz_batched(gs, coefficients, 5, 1e-7, b)
            row[f"b{b}_differ"] = sum(int((o != r).sum()) for o, r in zip(ours, ref))
            row[f"b{b}_ms"] = median_ms(lambda: newton_schulz_batched(gs, coefficients, 5, 1e-7, b), dev, reps)
        out[str(shape)] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="h200", choices=sorted(MOE_PRESETS))
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out/expert_step")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--profile", nargs="*", default=[])
    p.add_argument("--sustained", nargs="*", default=[],
                   help="variants also measured alternately with matmuls of the same FLOPs (see _sustained)")
    p.add_argument("--layers", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--mlp", type=int)
    p.add_argument("--dense", type=int, default=0, help="also check single matrices of this size and twice it")
    p.add_argument("--batch-check", action="store_true", help="also check batched symmetric blocks on other shapes")
    p.add_argument("--batch-shapes", action="store_true", help="batch_shapes=True (batching off CPU's default)")
    args = p.parse_args()
    cfg = MOE_PRESETS[args.preset]
    layers, e = args.layers or cfg.n_layers, args.experts or cfg.experts
    h, i = args.hidden or cfg.hidden, args.mlp or cfg.expert_mlp
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "layers": layers, "experts": e, "hidden": h, "mlp": i}
    path = out_dir / "gpu_expert_step.json"

    def save() -> None:
        path.write_text(json.dumps(res, indent=1))

    res["matmul_tflops"] = matmul_tflops(dev, 8192 if dev.type == "cuda" else 256)
    mats = [(min(i, h), max(i, h))] * (3 * e * layers)
    flops = sum(5 * (4 * m * m * n + 2 * m ** 3) for m, n in mats)
    res["ns_tflop"] = flops / 1e12
    res["floor_ms"] = flops / (res["matmul_tflops"] * 1e12) * 1e3
    x = [torch.randn(m, n, device=dev, dtype=torch.bfloat16) for m, n in mats]
    x = [t / t.norm() for t in x]
    res["ns_matmuls_ms"] = median_ms(lambda: ns_matmuls(x), dev, args.reps)
    per = max(1, muon.BATCH_MAX_ELEMENTS // (mats[0][0] * mats[0][1]))
    xb = [torch.stack(x[k:k + per]) for k in range(0, len(x), per)]
    del x
    res["ns_batched_matmuls_ms"] = median_ms(lambda: _ns_batched(xb), dev, args.reps)
    del xb
    save()
    if args.dense:
        res["dense"] = _dense_check(dev, args.dense, args.reps)
        save()
    if args.batch_check and dev.type == "cuda":
        shapes = [(2048, 2048), (2048, 8192), (8192, 2048), (2048, 5632), (3072, 8192), (1024, 4096), (1536, 4096)]
        res["batch_check"] = _batch_check(dev, shapes, [3, 4], args.reps)
        save()
    problem = Problem(layers, e, h, i, dev)
    res["variants"] = {}
    for name in args.variants:
        switches, options = VARIANTS[name]
        old = _set_switches(switches)
        try:
            params, opt = problem.ours({**options, **({"batch_shapes": True} if args.batch_shapes else {})})
            row = problem.check(params, opt)
            row["ms"] = median_ms(opt.step, dev, args.reps)
            if dev.type == "cuda":
                row["host_ms"] = _cpu_ms(opt.step, dev)
                row["gpu_only_ms"] = _gpu_ms(opt.step, dev)
            row["over_floor"] = row["ms"] / res["floor_ms"]
            if name in args.sustained and dev.type == "cuda":
                row["sustained"] = _sustained(opt.step, dev, flops)
            if name in args.profile and dev.type == "cuda":
                row["profile"] = _profile(opt.step, dev)
            del params, opt
        finally:
            _set_switches(old)
        res["variants"][name] = row
        if "sustained" in row:
            print(f"[gpu_expert_step] {name}, alternating with matmuls: {row['sustained']['step_ms']:.1f} ms = "
                  f"{row['sustained']['over_floor']:.3f}x the floor at the sustained rate "
                  f"({row['sustained']['matmul_tflops']:.0f} TFLOP/s)", flush=True)
        print(f"[gpu_expert_step] {name}: {row['ms']:.1f} ms = {row['over_floor']:.3f}x floor; "
              f"{row['differ']} of {row['entries']} entries differ from torch.optim.Muon "
              f"(max {row['max_abs_diff']:.3g})", flush=True)
        save()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"[gpu_expert_step] {res['device']}: floor {res['floor_ms']:.1f} ms ({res['ns_tflop']:.1f} TFLOP at "
          f"{res['matmul_tflops']:.0f} TFLOP/s), NS matmuls {res['ns_matmuls_ms']:.1f} ms, batched "
          f"{res['ns_batched_matmuls_ms']:.1f} ms; wrote {path}")


if __name__ == "__main__":
    main()
