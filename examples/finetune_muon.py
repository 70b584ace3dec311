"""Example 2: fine-tune an existing LightningModule with Muon, without editing it.

``lightning.pytorch.demos.LightningTransformer`` was written for plain Lightning: it
trains with SGD and has no ``configure_model``. Here it is used as is; the strategy
shards it itself and its ``optimizer=`` option replaces the module's SGD with
``lightning_matrixfsdp.Muon``. Data: byte tokens of local text (offline).

    python examples/finetune_muon.py                      # 2 CPU processes, MatrixFSDP + Muon
    python examples/finetune_muon.py --strategy ddp       # baseline: stock DDP, the module's own SGD
    tensorboard --logdir runs
"""

from __future__ import annotations

import argparse
import functools
from typing import Optional

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import Strategy

import lightning_matrixfsdp
from lightning_matrixfsdp.demos import LocalTokenDataModule, OptimizerReport


def build_strategy(name: str, lr: float) -> "str | Strategy":
    """The only line that differs between the two runs is the strategy."""
    if name == "matrix_fsdp":
        return lightning_matrixfsdp.MatrixFSDPStrategy(optimizer=functools.partial(lightning_matrixfsdp.Muon, lr=lr))
    return name  # e.g. "ddp": Lightning's own strategy, the module keeps its SGD


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="matrix_fsdp", help="matrix_fsdp (default) or a Lightning strategy name")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--log-every-n-steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--data-dir", default=None, help="directory, file or glob of text; default: pydoc help topics")
    parser.add_argument("--save-dir", default="runs", help="TensorBoard log root")
    args = parser.parse_args(argv)

    seed_everything(42)
    data = LocalTokenDataModule(data_dir=args.data_dir, batch_size=args.batch_size)
    model = LightningTransformer(vocab_size=data.vocab_size)  # untouched: byte vocabulary of 256
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=build_strategy(args.strategy, args.lr),
        max_steps=args.max_steps,
        log_every_n_steps=args.log_every_n_steps,
        enable_checkpointing=False,
        logger=TensorBoardLogger(save_dir=args.save_dir, name="finetune_muon"),
        callbacks=[OptimizerReport()],  # prints which optimizer class actually stepped
    )
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
