"""Two GPUs, the MoE decoder: ours with `expert_parallel_size=2` beside stock FSDP2
(`fully_shard`) with a per-expert `torch.optim.Muon` (issue 30, section 4).

    python scripts/gpu_moe_ep2.py [--preset h200|tiny] [--nproc 2] [--steps N] [--warmup N] [--out DIR]

The model is `bench/moe_model.py`'s decoder (preset `h200`: 1.88B parameters, 8 layers, 8
experts of intermediate 4096, top-2, activation checkpointing; batch 4 x 2048 tokens per GPU),
its experts modules with the Hugging Face experts signature so expert parallelism finds them
(`bench/moe_modes.py`). The two modes (`bench/moe_modes.py`):

- `ours_ep2`: `matrix_shard(expert_parallel_size=2)`; each GPU keeps 4 experts of every layer and
  the tokens travel to them; the dense part owner-sharded; the package's `Muon`;
- `fsdp2_per_expert_muon`: `fully_shard` on each block and the root; the stacks are sharded on the
  expert dimension (each GPU's shard is 4 whole experts), gathered in forward and backward,
  their gradients reduce-scattered; `torch.optim.Muon` per expert on the local shard (gate and up
  as matrices of their own), and on the dense DTensor matrices directly.

Both run under `torch.autocast(bfloat16)` with fp32 weights, gradients and optimizer state (the
same recipe in both). Each mode runs in fresh processes (`--nproc`, gloo on CPU, NCCL on GPU).
Per mode: the median step time (forward + backward, then the optimizer step, between device
synchronizations) over the measured steps, the peak `max_memory_allocated` per rank over them,
then one more step with every collective counted per phase (`bench/comm.py`; and, for ours, the
runtime's own phases). Writes `OUT/gpu_moe_ep2.json` (OUT: `--out`, else `$OUT`, else
`bench_out/moe_ep2`). `--preset tiny --nproc 2` runs on a CPU in seconds (a check that the
script works; its figures mean nothing).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("ours", "fsdp2")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(mode: str, preset: str, steps: int, warmup: int, batch: int, out: str) -> None:
    from lightning_matrixfsdp.bench.comm import CommCounter
    from lightning_matrixfsdp.bench.launch import resolve_device
    from lightning_matrixfsdp.bench.moe_model import MOE_PRESETS
    from lightning_matrixfsdp.bench.moe_modes import build_mode

    device = resolve_device("auto")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            **({"device_id": device} if device.type == "cuda" else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MOE_PRESETS[preset]
    if preset == "tiny":
        cfg = dataclasses.replace(cfg, activation_checkpointing=False)
    m = build_mode(mode, cfg, device, ep=world)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def tokens(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * i + rank)
        return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g).to(device)

    rows, losses = [], []
    for i in range(warmup + steps + 1):
        t = tokens(i)
        counted = i == warmup + steps
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if counted and device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        m.optimizer.zero_grad()
        if m.stats_fn is not None:
            m.stats_fn()
        _sync(device)
        t0 = time.perf_counter()
        phases = {}
        counter = CommCounter() if counted else None  # only the last step counts: the mode slows every op

        def phase(name: str) -> None:
            if counter is not None:
                counter.phase = name

        with torch.compiler.set_stance("force_eager"), (counter or contextlib.nullcontext()):
            phase("fwd")
            with amp:
                loss = m.model(t[:, :-1], t[:, 1:])
            phases["fwd"] = m.stats_fn() if m.stats_fn is not None else {}
            phase("bwd")
            loss.backward()
            _sync(device)
            t1 = time.perf_counter()
            phases["bwd"] = m.stats_fn() if m.stats_fn is not None else {}
            phase("opt")
            m.optimizer.step()
            _sync(device)
            phases["opt"] = m.stats_fn() if m.stats_fn is not None else {}
        t2 = time.perf_counter()
        losses.append(float(loss.detach()))
        if warmup <= i < warmup + steps:
            rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3))
        if counter is not None:
            bytes_ = {p: {"sent": v["sent"], "recv": v["recv"], "ops": {k: [o["sent"], o["recv"]] for k, o in
                                                                        v["ops"].items()}}
                      for p, v in counter.totals().items()}
            runtime = {p: {k: [v["sent"], v["recv"]] for k, v in s.items() if v["sent"] or v["recv"]}
                       for p, s in phases.items()}
    mine = {"rank": rank, "fwd_bwd_ms": statistics.median(r[0] for r in rows),
            "opt_ms": statistics.median(r[1] for r in rows), "step_ms": statistics.median(a + b for a, b in rows),
            "peak_gib": peak / 2**30 if device.type == "cuda" else None, "bytes": bytes_, "runtime_bytes": runtime,
            "losses": losses}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        result = {"mode": m.name, "world": world, "device": str(device), "preset": preset, "batch_per_rank": batch,
                  "config": cfg.to_dict(), "ranks": everyone,
                  "step_ms_max_rank": max(r["step_ms"] for r in everyone)}
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"gpu_moe_ep2_{mode}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


def main() -> None:
    from lightning_matrixfsdp.bench.launch import spawn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="h200", choices=["h200", "tiny"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (default: 4 for h200, 2 for tiny)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out/moe_ep2")
    a = p.parse_args()
    batch = a.batch or (4 if a.preset == "h200" else 2)
    summary: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "modes": {}}
    for mode in a.modes:
        try:
            spawn(a.nproc, _run, (mode, a.preset, a.steps, a.warmup, batch, a.out))
            res = json.loads((Path(a.out) / f"gpu_moe_ep2_{mode}.json").read_text())
            summary["modes"][res["mode"]] = res
        except Exception as exc:  # a failed mode is reported, the other still runs
            summary["modes"][mode] = {"failed": f"{type(exc).__name__}: {exc}"[:2000]}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_moe_ep2.json").write_text(json.dumps(summary, indent=1))
    for name, res in summary["modes"].items():
        if "failed" in res:
            print(f"{name}: FAILED {res['failed'][:300]}")
            continue
        sent = {ph: max(r["bytes"].get(ph, {}).get("sent", 0) for r in res["ranks"]) / 2**20
                for ph in ("fwd", "bwd", "opt")}
        peak = [r["peak_gib"] for r in res["ranks"]]
        print(f"{name}: step {res['step_ms_max_rank']:.1f} ms (slowest rank), peak GiB {peak}, "
              f"MiB sent max over ranks {', '.join(f'{k} {v:.1f}' for k, v in sent.items())}")


if __name__ == "__main__":
    main()
