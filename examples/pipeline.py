"""Pipeline parallelism in Lightning: the demo GPT split into 2 stages on 2 CPU processes.

The contract (docs/pipeline-parallel.md, "Pipeline parallelism in Lightning: the contract"): the
LightningModule defines ``loss_fn(outputs, targets)`` and its steps compute the loss with
``lightning_matrixfsdp.forward_loss(self, inputs, targets)``, which is exactly
``self.loss_fn(self(inputs), targets)`` under DDP or one device. The demos' GPT does both::

    def loss_fn(self, logits, y):
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = forward_loss(self, *batch)
        self.log("train_loss", loss)
        return loss

With ``pipeline_parallel_size=2`` the strategy splits the model into two stages (embeddings and
the first blocks on rank 0, the last blocks, norm and head on rank 1), owner-shards each over its
own data-parallel ranks, and ``forward_loss`` runs torch's 1F1B schedule over 4 micro-batches
(forward and backward); the optimizer then steps each stage's matrices where they live. The same
run from the command line: ``examples/pipeline.yaml``.

    python examples/pipeline.py                    # 2 CPU processes, 10 steps
    python examples/pipeline.py --devices 4        # PP=2 x DP=2
"""

from __future__ import annotations

import argparse
from typing import Optional

from lightning.pytorch import Trainer, seed_everything

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.demos import GPT, ByteTextDataModule, OptimizerReport


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--schedule", default="1F1B", help="GPipe, 1F1B, Interleaved1F1B or LoopedBFS")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    seed_everything(42)
    model = GPT(d_model=64, n_layers=4, n_heads=4, max_seq_len=64, warmup_steps=2)
    data = ByteTextDataModule(seq_len=64, batch_size=8, max_bytes=200_000)  # 8 = 2 micro-batches x 4
    strategy = mf.MatrixFSDPStrategy(pipeline_parallel_size=args.pipeline_parallel_size,
                                     pipeline_schedule=args.schedule, pipeline_microbatches=4)
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      val_check_interval=args.steps, limit_val_batches=2, num_sanity_val_steps=0,
                      callbacks=[OptimizerReport()])
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        print(f"[pipeline] last train loss {float(trainer.callback_metrics['train_loss']):.4f}, "
              f"val loss {float(trainer.callback_metrics['val_loss']):.4f}")


if __name__ == "__main__":
    main()
