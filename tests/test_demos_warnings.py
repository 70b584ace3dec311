"""Ordinary runs of the demos and the bench print no warning that this package's own code causes."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest



def test_finetune_demo_data_gives_no_validation_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningTransformer has no validation_step; its data module must not offer a val_dataloader."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos import LightningTransformer
    from lightning.pytorch.demos.transformer import _REQUESTS_AVAILABLE

    from lightning_matrixfsdp.demos import LocalTokenDataModule

    if not _REQUESTS_AVAILABLE:
        pytest.skip("LightningTransformer.prepare_data imports requests even offline; not installed")
    monkeypatch.chdir(tmp_path)  # the data module writes its offline stand-in under ./data
    data = LocalTokenDataModule(batch_size=2, max_bytes=20_000, cache_bytes=4096)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LightningTransformer(vocab_size=data.vocab_size), datamodule=data)
    assert trainer.global_step == 2
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "val_dataloader" in m or "validation_step" in m], messages


def _bench_ddp_worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_matrixfsdp.bench.config import BenchConfig
    from lightning_matrixfsdp.bench.modes import ModeContext, apply_ddp

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))  # a buffer to (not) sync
    ctx = ModeContext(cfg=BenchConfig(), device=torch.device("cpu"), group=dist.group.WORLD,
                      mesh=init_device_mesh("cpu", (world,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = apply_ddp(model, ctx)
    sync = getattr(ddp, "forward_sync_buffers", None)
    return {"warnings": [str(w.message) for w in caught], "sync": ddp.broadcast_buffers if sync is None else sync}


def test_bench_ddp_baseline_builds_without_deprecation_warning(dist_pools) -> None:
    for r in dist_pools(2).run(_bench_ddp_worker, timeout=120):
        assert not [m for m in r["warnings"] if "broadcast_buffers" in m], r["warnings"]
        assert r["sync"] is False  # still no buffer broadcast before each forward
