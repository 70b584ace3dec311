"""Tensor parallelism inside a node, owner sharding across the rest: the demo GPT on 4 CPU processes.

The world of 4 ranks is ``data_parallel 2 x tensor_parallel 2``. The model,
``lightning_matrixfsdp.demos.TensorParallelGPT``, applies a Llama-style plan to every block in
its ``configure_model`` (``parallelize_module`` on ``self.device_mesh["tensor_parallel"]``): the
MLP's first matrix colwise and its second rowwise (the activation stays split between them), the
fused attention matrices colwise/rowwise too. The demo's fused ``qkv`` keeps q, k and v one after
another, so a colwise split would hand a TP rank parts of q and k instead of whole heads; its
output is therefore gathered (``output_layouts=Replicate()``) before the heads are formed, and
the projection takes the full activation. A model with separate q/k/v (or head-interleaved rows)
would keep the attention split as the MLP does. Everything else (embeddings, norms, the head) is
replicated over the TP group. The same model runs from the command line with
``examples/tensor_parallel.yaml``.

The strategy then owner-shards every fragment over the 2 data-parallel ranks. Muon steps each
TP-split matrix whole on one TP rank (bit for bit the whole-matrix update) and nothing crosses
the data-parallel group in the step. At the end rank 0 prints the per-phase bytes of the last
step, the ``tp`` phase included.

    python examples/tensor_parallel.py            # 4 CPU processes, 20 steps
"""

from __future__ import annotations

import argparse
from functools import partial

from lightning.pytorch import Callback, Trainer, seed_everything

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.demos import GPT, ByteTextDataModule, TensorParallelGPT


class BytesReport(Callback):
    """Rank 0 prints the traffic of the run per phase (logical payload per rank, MiB)."""

    def on_train_end(self, trainer: Trainer, pl_module: GPT) -> None:
        stats = mf.get_comm_stats(pl_module)
        if trainer.is_global_zero:
            print(f"[tensor-parallel] last train loss {float(trainer.callback_metrics['train_loss']):.4f}")
            for phase, d in sorted(stats.items()):
                if d["sent"] or d["recv"]:
                    print(f"[tensor-parallel] {phase:>12}: sent {d['sent'] / 2**20:8.3f} MiB, "
                          f"received {d['recv'] / 2**20:8.3f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    seed_everything(42)
    model = TensorParallelGPT(d_model=64, n_layers=2, n_heads=4, max_seq_len=64, warmup_steps=2, dropout=0.0)
    data = ByteTextDataModule(seq_len=64, batch_size=4, max_bytes=200_000)
    strategy = mf.MatrixFSDPStrategy(tensor_parallel_size=args.tensor_parallel_size,
                                     optimizer=partial(mf.Muon, lr=0.02, adamw_lr=3e-3))
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=[BytesReport()])
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
