"""Resuming the demo GPT with a larger max_steps extends its LR schedule (2 processes, matrix_fsdp).

A run saved at ``max_steps=N`` and resumed with ``max_steps=2N`` must follow the warmup-cosine
schedule over 2N steps from step N on. Without ``fit_schedules_to_trainer`` the scheduler's
restored state kept the schedule's old length and every step after the resume ran at the
cosine floor. The oracle is the schedule's formula written out here.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest


N = 4
LR, WARMUP, MIN_RATIO = 0.02, 2, 0.1


def expected_lr(step: int, total: int) -> float:
    """Linear warmup over WARMUP steps, then cosine from LR down to MIN_RATIO * LR at ``total``."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / (total - WARMUP))
    return LR * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def resume_worker(rank: int, world: int, root: str) -> dict:
    import torch
    from lightning.pytorch import Callback, Trainer

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.demos import GPT, ByteTextDataModule

    class LRs(Callback):
        """The LR each optimizer step runs with, by global step."""

        def __init__(self) -> None:
            self.lrs: dict[int, float] = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.lrs[trainer.global_step] = optimizer.param_groups[0]["lr"]

    def fit(max_steps: int, ckpt_path=None) -> tuple[Trainer, dict[int, float]]:
        torch.manual_seed(0)
        model = GPT(max_seq_len=16, d_model=32, n_layers=1, n_heads=2, lr=LR, warmup_steps=WARMUP,
                    min_lr_ratio=MIN_RATIO, lr_schedule="cosine")
        data = ByteTextDataModule(seq_len=16, batch_size=2, max_bytes=40_000)
        rec = LRs()
        trainer = Trainer(strategy=mf.MatrixFSDPStrategy(log_plan=False), accelerator="cpu", devices=world,
                          max_steps=max_steps, callbacks=[rec], logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                          default_root_dir=root)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return trainer, rec.lrs

    first, lrs_first = fit(N)
    first.save_checkpoint(Path(root) / "n.ckpt")
    resumed, lrs_resumed = fit(2 * N, Path(root) / "n.ckpt")
    return {"first": lrs_first, "resumed": lrs_resumed, "steps": resumed.global_step,
            "total": resumed.lr_scheduler_configs[0].scheduler.lr_lambdas[0].total_steps}


def test_resume_with_larger_max_steps_follows_the_longer_schedule(tmp_path: Path, dist_pools) -> None:
    res = dist_pools(2).run(resume_worker, str(tmp_path), timeout=300)
    for r in res:
        assert sorted(r["first"]) == list(range(N))
        assert sorted(r["resumed"]) == list(range(N, 2 * N)), r["resumed"]  # it resumed, not restarted
        assert r["steps"] == 2 * N and r["total"] == 2 * N
        for step, lr in r["first"].items():
            assert lr == pytest.approx(expected_lr(step, N), rel=1e-12), (step, lr)
        for step, lr in r["resumed"].items():
            assert lr == pytest.approx(expected_lr(step, 2 * N), rel=1e-12), (step, lr, r["resumed"])
        # the first resumed step is halfway down the longer cosine, far above the old floor
        assert r["resumed"][N] > 2 * MIN_RATIO * LR
