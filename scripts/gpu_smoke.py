"""GPU smoke test of the Lightning path (not part of CI): fit, checkpoint, resume, eval.

    python scripts/gpu_smoke.py OUT_DIR          # run on a machine with 2 GPUs

Trains the demo GPT with ``MatrixFSDPStrategy`` on every visible GPU in bf16-mixed,
saves a distributed checkpoint, resumes from it in a second Trainer, validates, and
writes a JSON verdict (losses, owner bytes, optimizer class, the optimizer-step times the
strategy logged from CUDA events) to OUT_DIR/gpu_smoke.json.
"""
from __future__ import annotations

import csv
import math
import os
import sys

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.bench.report import save_json
from lightning_matrixfsdp.demos import GPT, ByteTextDataModule


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    devices = torch.cuda.device_count()
    common = dict(accelerator="gpu", devices=devices, precision="bf16-mixed", logger=False,
                  enable_progress_bar=False, enable_model_summary=True, limit_val_batches=2,
                  default_root_dir="/tmp/gpu_smoke_root")
    data = ByteTextDataModule(seq_len=256, batch_size=8)
    model = GPT(d_model=256, n_layers=4, n_heads=8, max_seq_len=256)
    first = dict(common, logger=CSVLogger("/tmp/gpu_smoke_root", name="csv"), log_every_n_steps=5)
    t1 = Trainer(strategy=mf.MatrixFSDPStrategy(), max_steps=20, enable_checkpointing=False, **first)
    t1.fit(model, datamodule=data)
    opt_ms = []  # the strategy's optimizer-step timing (CUDA events), logged every 5 steps
    if t1.is_global_zero:
        with open(os.path.join(t1.logger.log_dir, "metrics.csv")) as f:
            opt_ms = [float(r["matrix_fsdp/optimizer_step_ms"]) for r in csv.DictReader(f)
                      if r.get("matrix_fsdp/optimizer_step_ms")]
    ckpt = "/tmp/gpu_smoke_root/step20"
    t1.save_checkpoint(ckpt)
    loss1 = float(t1.callback_metrics.get("train_loss", float("nan")))
    model2 = GPT(d_model=256, n_layers=4, n_heads=8, max_seq_len=256)
    t2 = Trainer(strategy=mf.MatrixFSDPStrategy(collective="broadcast"), max_steps=30,
                 enable_checkpointing=False, **common)
    t2.fit(model2, datamodule=data, ckpt_path=ckpt)
    loss2 = float(t2.callback_metrics.get("train_loss", float("nan")))
    val = t2.validate(model2, datamodule=data, verbose=False)
    stats = mf.get_comm_stats(model2)
    verdict = {
        "devices": devices, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "loss_after_20": loss1, "loss_after_30_resumed": loss2, "val": val,
        "resumed_global_step": t2.global_step, "optimizer": type(t2.optimizers[0]).__name__,
        "optimizer_step_bytes": stats["optimizer_step"], "materialize_bytes": stats["materialize"],
        "logged_optimizer_step_ms": opt_ms,
        "ok": math.isfinite(loss1) and math.isfinite(loss2) and t2.global_step == 30
        and len(opt_ms) == 4 and all(0 < t < 1e4 for t in opt_ms),
    }
    if t2.is_global_zero:
        save_json(out, "gpu_smoke.json", verdict)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_smoke_out")
