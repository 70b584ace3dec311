"""One GPU, an MoE decoder: `strategy="matrix_fsdp"` with the package's Muon beside plain
Lightning with a per-expert Muon written plainly (issue 30, section 4).

    python scripts/gpu_moe_bench.py [--preset h200|tiny] [--out DIR] [--steps N] [--warmup N] [--rounds R]

The model is `bench/moe_model.py` (plain torch, no transformers): preset `h200` is 1.88B
parameters, 8 layers of hidden 2048, 8 experts of intermediate 4096 per layer (1.61B),
top-2, stored as the 3-D stacks `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`; batch 4
x 2048 tokens, bf16-mixed, activation checkpointing. `--preset tiny` runs on a CPU in
seconds (a check that the script works; its figures mean nothing).

Parts, each in its own child process so each starts with a clean device:

- `train plain`: Lightning's default single-device strategy; the optimizer is
  `torch.optim.Muon` on every 2-D matrix of the blocks and on every expert's gate, up and down
  as separate 2-D parameters that are views of the stacks (`bench/moe_modes.PerExpertMuon`, the
  multi-GPU benchmarks' baseline), AdamW on the embedding, head and norms.
- `train ours`: `MatrixFSDPStrategy(expert_stacks=...)` with `lightning_matrixfsdp.Muon`: the
  stacks are declared (gate_up as its two halves) and stepped per expert.
- `experts`: the experts' optimizer step alone on the same stack shapes (fp32 weights and
  gradients, as under bf16-mixed): ours, the plain per-expert `torch.optim.Muon`, the
  Newton-Schulz matmuls alone (five iterations of `X X^T`, `A A`, `B X` in bf16 per expert
  matrix, torch's sequence), and the FLOP floor (`5 (4 m^2 n + 2 m^3)` per matrix over the
  bf16 rate of an 8192^3 matmul measured in the same process).

Training steps are timed between `synchronize()` calls: forward and backward up to
`on_before_optimizer_step`, then the optimizer step to `on_train_batch_end`; medians over
the measured steps (and over rounds); the peak is `torch.cuda.max_memory_allocated` over
the measured steps. Writes `OUT/gpu_moe_bench.json` (OUT: `--out`, else `$OUT`, else
`bench_out/moe`) and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lightning_matrixfsdp.bench.moe_modes import ADAMW_LR, LR, WD, PerExpertMuon


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- part: train
def train(mode: str, preset: str, steps: int, warmup: int, precision: str = "bf16-mixed", profile: int = 0) -> dict:
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, Dataset

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.bench.moe_model import EXPERT_STACKS, MOE_PRESETS, MoEDecoder, is_muon_param

    cfg = MOE_PRESETS[preset]
    batch = 4 if preset == "h200" else 2

    class Steps(Dataset):
        """Only drives the loop: each step's tokens come from its index (``training_step``), so the
        two modes see the same batches whatever sampler the strategy puts on the loader."""

        def __len__(self) -> int:
            return warmup + steps

        def __getitem__(self, i: int) -> int:
            return i

    class Lit(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = MoEDecoder(cfg)

        def training_step(self, b, i):
            t = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(i))
            t = t.to(self.device)
            loss = self.model(t[:, :-1], t[:, 1:])
            losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            if mode == "ours":
                return mf.Muon(self, lr=LR, adamw_lr=ADAMW_LR, weight_decay=WD)  # groups from the module
            return PerExpertMuon(self.model)

    class Timer(Callback):
        def __init__(self) -> None:
            self.rows: list[tuple[float, float]] = []
            self.t0 = self.t1 = 0.0

        def on_train_batch_start(self, trainer, pl_module, b, i) -> None:
            _sync()
            if i == warmup and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            if profile and i == warmup + steps - profile:  # the last ``profile`` steps, under the profiler
                self.prof = torch.profiler.profile(activities=_activities())
                self.prof.__enter__()
            self.t0 = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            _sync()
            self.t1 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, b, i) -> None:
            _sync()
            if i >= warmup and not (profile and i >= warmup + steps - profile):  # profiled steps: not timed
                self.rows.append(((self.t1 - self.t0) * 1e3, (time.perf_counter() - self.t1) * 1e3))

    losses: list[float] = []
    torch.manual_seed(0)
    module = Lit()
    timer = Timer()
    strategy = (mf.MatrixFSDPStrategy(expert_stacks=EXPERT_STACKS, matrix_filter=is_muon_param, log_plan=False)
                if mode == "ours" else "auto")
    trainer = Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1, strategy=strategy,
                      precision=precision, max_steps=warmup + steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(module, DataLoader(Steps(), batch_size=None))
    prof = getattr(timer, "prof", None)
    tables = {}
    if prof is not None:
        prof.__exit__(None, None, None)
        cuda = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        tables = {"by_self_device_time": prof.key_averages().table(sort_by=cuda, row_limit=30, max_name_column_width=70),
                  "by_self_cpu_time": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                                                max_name_column_width=70)}
    fb = [r[0] for r in timer.rows]
    opt = [r[1] for r in timer.rows]
    return {"mode": mode, "fwd_bwd_ms": statistics.median(fb), "opt_ms": statistics.median(opt),
            "total_ms": statistics.median(a + b for a, b in timer.rows), "step_ms": [a + b for a, b in timer.rows],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "losses": losses, "muon_matrices": _muon_matrices(trainer.optimizers[0], module.model),
            "fwd_bwd_rows_ms": fb, "profile": tables}


def _activities() -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _muon_matrices(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> int | None:
    """How many 2-D matrices the optimizer orthogonalizes (a stack counts each expert's blocks)."""
    if isinstance(optimizer, PerExpertMuon):
        return optimizer.matrices
    try:
        from lightning_matrixfsdp.optim.tail import is_matrix_role
        from lightning_matrixfsdp.runtime.tags import stack_of
    except ImportError:
        return None
    n = 0
    for p in model.parameters():
        s = stack_of(p)
        n += s.num_experts * len(s.blocks) if s is not None else int(is_matrix_role(p))
    return n


# ---------------------------------------------------------------- part: the experts' step alone
def experts(preset: str, reps: int) -> dict:
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.bench.moe_model import MOE_PRESETS
    from lightning_matrixfsdp.bench.timing import matmul_tflops, median_ms, ns_matmuls
    from lightning_matrixfsdp.runtime.experts.stacks import ExpertStack
    from lightning_matrixfsdp.runtime.tags import tag_stack

    cfg, dev = MOE_PRESETS[preset], _device()
    e, h, i = cfg.experts, cfg.hidden, cfg.expert_mlp
    torch.manual_seed(0)

    def stacks() -> list[torch.nn.Parameter]:
        out = []
        for _ in range(cfg.n_layers):
            for shape in ((e, 2 * i, h), (e, h, i)):
                p = torch.nn.Parameter(torch.randn(shape, device=dev) * 0.02)
                p.grad = torch.randn(shape, device=dev) * 1e-3
                out.append(p)
        return out

    blocks = {(e, 2 * i, h): (i, i), (e, h, i): (h,)}
    ours_params = stacks()
    for p in ours_params:
        tag_stack(p, ExpertStack(e, blocks[tuple(p.shape)]))
    ours = mf.Muon([{"params": ours_params, "role": "matrix"}], lr=LR, weight_decay=WD)  # stacks: per expert
    ours_ms = median_ms(ours.step, dev, reps)
    del ours, ours_params
    plain_params = stacks()
    views = []
    for p in plain_params:
        for k in range(e):
            start = 0
            for rows in blocks[tuple(p.shape)]:
                v = torch.nn.Parameter(p.data[k, start:start + rows])
                v.grad = p.grad[k, start:start + rows]
                views.append(v)
                start += rows
    plain = torch.optim.Muon(views, lr=LR, weight_decay=WD)
    plain_ms = median_ms(plain.step, dev, reps)
    del plain, views, plain_params
    shapes = [(i, h)] * (2 * e * cfg.n_layers) + [(h, i)] * (e * cfg.n_layers)
    mats = [torch.randn(min(s), max(s), device=dev, dtype=torch.bfloat16) for s in shapes]
    mats = [x / x.norm() for x in mats]  # the iteration's input scale (the values do not change the time)
    ns_ms = median_ms(lambda: ns_matmuls(mats), dev, reps)
    flops = sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)
    rate = matmul_tflops(dev, 8192 if dev.type == "cuda" else 256)
    floor_ms = flops / (rate * 1e12) * 1e3
    return {"matrices": len(shapes), "ns_tflop": flops / 1e12, "matmul_tflops": rate, "floor_ms": floor_ms,
            "ns_matmuls_ms": ns_ms, "ours_ms": ours_ms, "plain_ms": plain_ms, "ours_over_floor": ours_ms / floor_ms,
            "ours_over_ns_matmuls": ours_ms / ns_ms, "plain_over_floor": plain_ms / floor_ms,
            "plain_over_ours": plain_ms / ours_ms}


# ---------------------------------------------------------------- driver
def _child(args: argparse.Namespace, part: list[str], path: Path) -> dict:
    cmd = [sys.executable, __file__, "--preset", args.preset, "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--precision", args.precision, "--profile", str(args.profile), "--part", *part,
           "--json", str(path)]
    subprocess.run(cmd, check=True, timeout=args.part_timeout)
    return json.loads(path.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="h200", choices=["h200", "tiny"])
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out/moe")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="train plain, ours in turn this many times")
    p.add_argument("--precision", default="bf16-mixed", help="the Trainer's precision (both modes)")
    p.add_argument("--part-timeout", type=float, default=240.0)
    p.add_argument("--profile", type=int, default=0, help="profile the last N of the steps (not timed; in the JSON)")
    p.add_argument("--no-experts", action="store_true", help="skip the experts' step part")
    p.add_argument("--part", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part:  # a child: one part, its JSON, nothing else
        if args.part[0] == "train":
            res = train(args.part[1], args.preset, args.steps, args.warmup, args.precision, args.profile)
        else:
            res = experts(args.preset, args.steps)
        Path(args.json).write_text(json.dumps(res))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from lightning_matrixfsdp.bench.moe_model import MOE_PRESETS, count_moe_parameters

    runs: dict[str, list[dict]] = {"plain": [], "ours": []}
    for k in range(args.rounds):
        for mode in ("plain", "ours"):
            runs[mode].append(_child(args, ["train", mode], out / f"train_{mode}_{k}.json"))
    exp = None if args.no_experts else _child(args, ["experts"], out / "experts.json")
    train_rows = {m: {"total_ms": statistics.median(r["total_ms"] for r in rs),
                      "fwd_bwd_ms": statistics.median(r["fwd_bwd_ms"] for r in rs),
                      "opt_ms": statistics.median(r["opt_ms"] for r in rs),
                      "peak_gib": max((r["peak_gib"] or 0.0) for r in rs) or None,
                      "muon_matrices": rs[0]["muon_matrices"], "losses": rs[0]["losses"],
                      "rounds_total_ms": [r["total_ms"] for r in rs]} for m, rs in runs.items()}
    o, pl = train_rows["ours"], train_rows["plain"]
    result = {
        "preset": args.preset, "config": MOE_PRESETS[args.preset].to_dict(),
        "parameters": count_moe_parameters(MOE_PRESETS[args.preset]),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "precision": args.precision, "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds,
        "train": train_rows,
        "ratios": {"total_ours_over_plain": o["total_ms"] / pl["total_ms"],
                   "opt_ours_over_plain": o["opt_ms"] / pl["opt_ms"],
                   "fwd_bwd_ours_over_plain": o["fwd_bwd_ms"] / pl["fwd_bwd_ms"],
                   "peak_ours_over_plain": (o["peak_gib"] / pl["peak_gib"]) if o["peak_gib"] and pl["peak_gib"]
                   else None},
        "expert_step": exp,
    }
    (out / "gpu_moe_bench.json").write_text(json.dumps(result, indent=1))
    print(f"[gpu_moe_bench] {result['device']}, preset {args.preset}: {result['parameters']['total'] / 1e9:.2f}B "
          f"parameters ({result['parameters']['experts'] / 1e9:.2f}B in experts)")
    for m, r in train_rows.items():
        peak = f"{r['peak_gib']:.2f} GiB" if r["peak_gib"] else "n/a"
        print(f"  {m:5s}: step {r['total_ms']:.1f} ms (fwd+bwd {r['fwd_bwd_ms']:.1f}, opt {r['opt_ms']:.1f}), "
              f"peak {peak}, {r['muon_matrices']} Muon matrices, last loss {r['losses'][-1]:.4f}")
    print("  ours / plain: " + ", ".join(f"{k} {v:.3f}" for k, v in result["ratios"].items() if v is not None))
    if exp is None:
        print(f"  wrote {out / 'gpu_moe_bench.json'}")
        return
    print(f"  expert step alone ({exp['matrices']} matrices, {exp['ns_tflop']:.1f} TFLOP of Newton-Schulz at "
          f"{exp['matmul_tflops']:.0f} TFLOP/s): ours {exp['ours_ms']:.1f} ms = {exp['ours_over_floor']:.3f}x the "
          f"FLOP floor {exp['floor_ms']:.1f} ms ({exp['ours_over_ns_matmuls']:.3f}x the NS matmuls alone, "
          f"{exp['ns_matmuls_ms']:.1f} ms); plain per-expert torch.optim.Muon {exp['plain_ms']:.1f} ms "
          f"= {exp['plain_over_floor']:.3f}x")
    print(f"  wrote {out / 'gpu_moe_bench.json'}")


if __name__ == "__main__":
    main()
