"""Expert parallelism: a Hugging Face Mixtral trained with Muon, each rank holding half the experts.

A tiny ``MixtralForCausalLM`` built from a config (nothing is downloaded), on 2 CPU processes,
with ``expert_parallel_size=2``: each rank keeps 2 of every layer's 4 experts for good (never
materialized, never reduced to an owner) and the tokens routed to the other 2 travel to the
rank that holds them and back. Attention, routers, embeddings and norms are owner-sharded as
usual. Muon steps every expert as matrices of its own (``gate``, ``up``, ``down``).

    pip install torch==2.13.0 -e ".[hf]"
    python examples/moe.py                      # the Trainer, 2 CPU processes, 20 steps
    python examples/moe.py --fabric             # the same model in a Fabric loop
    python examples/moe.py --devices 4 --expert-parallel-size 2   # 2 copies of each expert
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.demos import ByteTextDataModule, HFCausalLM, LossPrinter, OptimizerReport

LAYER = "transformers.models.mixtral.modeling_mixtral.MixtralDecoderLayer"
# output_router_logits: Hugging Face's load-balancing loss, times router_aux_loss_coef, in the loss (and
# logged as train_aux_loss by the Trainer path)
CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
              tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.02)


def trainer_run(args: argparse.Namespace) -> None:
    seed_everything(42)
    model = HFCausalLM(model_type="mixtral", config=dict(CONFIG, max_position_embeddings=args.seq_len), lr=args.lr)
    strategy = mf.MatrixFSDPStrategy(wrap_policy=LAYER, expert_parallel_size=args.expert_parallel_size)
    trainer = Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
        log_every_n_steps=args.print_every, limit_val_batches=2, val_check_interval=args.max_steps,
        check_val_every_n_epoch=None, num_sanity_val_steps=0, gradient_clip_val=1.0, enable_checkpointing=False,
        enable_progress_bar=False, logger=TensorBoardLogger(save_dir=args.save_dir, name="moe"),
        callbacks=[LossPrinter(every=args.print_every), OptimizerReport()],
    )
    trainer.fit(model, datamodule=ByteTextDataModule(seq_len=args.seq_len, batch_size=args.batch_size))


def fabric_run(args: argparse.Namespace) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    fabric = Fabric(accelerator="cpu", devices=args.devices, precision="32-true",
                    strategy=mf.MatrixFSDPFabricStrategy(wrap_policy=LAYER,
                                                         expert_parallel_size=args.expert_parallel_size))
    fabric.launch()
    fabric.seed_everything(0)
    config = MixtralConfig(vocab_size=256, use_cache=False, **dict(CONFIG, max_position_embeddings=args.seq_len))
    model = fabric.setup_module(MixtralForCausalLM(config))
    optimizer = fabric.setup_optimizers(mf.Muon(model, lr=args.lr, adamw_lr=3e-3))
    g = torch.Generator().manual_seed(fabric.global_rank)
    since = 0  # optimizer steps since the experts' load was last read
    for step in range(args.max_steps):
        for micro in range(2):  # gradient accumulation: the last micro-batch reduces
            ids = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=g)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                out = model(input_ids=ids, labels=ids)  # cross-entropy plus the load-balancing loss
                fabric.backward(out.loss / 2)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # each expert counted once
        optimizer.step()
        optimizer.zero_grad()
        since += 1
        if step % args.print_every == 0 or step == args.max_steps - 1:
            # the tokens per expert since the last read, over every rank (collective: every rank calls it)
            cv = mf.get_expert_stats(model, steps=since)["matrix_fsdp/experts/tokens_cv_max"]
            since = 0
            fabric.print(f"step {step:3d}  loss {out.loss.item():.4f}  aux {out.aux_loss.item():.4f}  "
                         f"grad norm {norm.item():.3f}  expert load cv {cv:.3f}")
    fabric.print(f"traffic: {mf.get_comm_stats(model)}")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--expert-parallel-size", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--print-every", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--save-dir", default="runs", help="TensorBoard log root (Trainer)")
    parser.add_argument("--fabric", action="store_true", help="a Fabric loop instead of the Trainer")
    args = parser.parse_args(argv)
    (fabric_run if args.fabric else trainer_run)(args)


if __name__ == "__main__":
    main()
