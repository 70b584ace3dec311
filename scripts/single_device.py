"""One device, nothing to shard: `strategy="matrix_fsdp"` next to Lightning's single-device default.

    python scripts/single_device.py MODE OUT.json [--steps N] [--warmup N] [--small]
    MODE: auto (Lightning's SingleDeviceStrategy) or matrix_fsdp

The model of issue 22: the benchmark decoder at 0.84B parameters (hidden 2048, SwiGLU MLP
8192, 12 layers, 16 heads, vocabulary 8192, sequence 2048), batch 4, non-reentrant activation
checkpointing per block, bf16-mixed, `lightning_matrixfsdp.Muon`, gradient clipping 1.0.
Each step is timed between `torch.cuda.synchronize()` calls; the peak is
`torch.cuda.max_memory_allocated` over the measured steps. One MODE per process: run the
modes alternating (`scripts/single_device.sh`) so drift hits both alike.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.bench.config import ModelConfig
from lightning_matrixfsdp.bench.model import Decoder


CUDA = torch.cuda.is_available()  # the figures are GPU ones; CPU only checks the script runs


class Tokens(Dataset):
    def __init__(self, cfg: ModelConfig, n: int) -> None:
        self.cfg, self.n = cfg, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        t = torch.randint(0, self.cfg.vocab_size, (self.cfg.seq_len + 1,), generator=g)
        return t[:-1], t[1:]


class LitDecoder(LightningModule):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.model = Decoder(cfg)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(*batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return mf.Muon(self.parameters(), lr=0.02, adamw_lr=3e-4)


class StepTimer(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self._t = warmup, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if CUDA:
            torch.cuda.synchronize()
            if batch_idx == self.warmup:
                torch.cuda.reset_peak_memory_stats()
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if CUDA:
            torch.cuda.synchronize()
        if batch_idx >= self.warmup:
            self.times.append((time.perf_counter() - self._t) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["auto", "matrix_fsdp"])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a tiny model (a quick check of the script)")
    p.add_argument("--profile", help="write torch.profiler's op table of the measured steps to this file")
    a = p.parse_args()
    cfg = (ModelConfig(vocab_size=256, hidden=128, n_heads=4, mlp_hidden=256, n_layers=2, seq_len=64,
                       activation_checkpointing=True) if a.small else
           ModelConfig(vocab_size=8192, hidden=2048, n_heads=16, mlp_hidden=8192, n_layers=12, seq_len=2048,
                       activation_checkpointing=True))
    torch.manual_seed(0)
    model = LitDecoder(cfg)
    timer = StepTimer(a.warmup)
    strategy = mf.MatrixFSDPStrategy(log_plan=False) if a.mode == "matrix_fsdp" else "auto"
    trainer = Trainer(accelerator="gpu" if CUDA else "cpu", devices=1, strategy=strategy, precision="bf16-mixed",
                      max_steps=a.warmup + a.steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    data = DataLoader(Tokens(cfg, 4 * (a.warmup + a.steps)), batch_size=4)
    if a.profile:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if CUDA else [])
        with torch.profiler.profile(activities=acts) as prof:
            trainer.fit(model, data)
        sort = "cuda_time_total" if CUDA else "cpu_time_total"
        with open(a.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=70))
    else:
        trainer.fit(model, data)
    result = {"mode": a.mode, "median_ms": statistics.median(timer.times), "step_ms": timer.times,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0, "package": mf.__file__}
    with open(a.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k != "step_ms"}))


if __name__ == "__main__":
    main()
