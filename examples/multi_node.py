"""Multi-node training with HSDP: shard within a node, replicate across nodes.

One process per device, started by ``torchrun`` (on every node) or by ``srun`` (SLURM);
Lightning reads the launcher's environment (``TorchElasticEnvironment`` or
``SLURMEnvironment``) and the strategy builds a ``(replicate, shard)`` mesh of
``(world // shard_size, shard_size)`` ranks. Shard groups are blocks of consecutive
global ranks, so with ``--shard-size`` equal to the processes per node each shard
group is one node and the replicas sit on different nodes.

At the end every rank reports its shard group, its replica group and the bytes it
moved per optimizer step; rank 0 prints them as a table and checks the HSDP claim
that a rank sends to its replicas exactly the gradients it owns (nothing else).

    # one machine, pretending to be two nodes (see examples/multi_node.sh)
    bash examples/multi_node.sh

    # two real nodes with 8 GPUs each: run on every node, NODE_RANK = 0 or 1
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \
        --master-addr $HEAD_NODE --master-port 29500 \
        examples/multi_node.py --num-nodes 2 --devices 8 --shard-size 8

    # SLURM: see examples/slurm_matrix_fsdp.sbatch
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.demos import GPT, ByteTextDataModule

REPORT_PREFIX = "[multi-node]"


class HSDPReport(Callback):
    """Per-rank traffic after training: materialize, reduce and replicate bytes per step."""

    def __init__(self, check: bool = True) -> None:
        self.check = check
        self.ok: Optional[bool] = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        mesh = pl_module.device_mesh  # the strategy's shard mesh: 1-D, or 2-D (replicate, shard)
        plan = mf.get_plan(pl_module)
        stats = mf.get_comm_stats(pl_module)
        steps = max(1, trainer.global_step * trainer.accumulate_grad_batches)  # backward passes
        # Gradients travel in the reduce dtype (default: the compute dtype, default: the weight's).
        dtype = getattr(strategy, "reduce_dtype", None) or getattr(strategy, "param_dtype", None)
        owned = sum(p.numel() * (torch.empty((), dtype=dtype).element_size() if dtype else p.element_size())
                    for p in pl_module.parameters() if p.requires_grad)  # non-owners hold empty tensors
        if mesh.ndim == 2:
            shard_ranks = mesh["shard"].mesh.tolist()
            replica_ranks = mesh["replicate"].mesh.tolist()
        else:
            shard_ranks, replica_ranks = mesh.mesh.tolist(), [dist.get_rank()]
        row = {
            "rank": trainer.global_rank,
            "node": trainer.node_rank,
            "shard_group": shard_ranks,
            "replicas": replica_ranks,
            "owned_grad_MB": owned / 2**20,
            "materialize_MB": stats["materialize"]["sent"] / steps / 2**20,
            "reduce_MB": stats["reduce"]["sent"] / steps / 2**20,
            "replicate_MB": stats["replicate"]["sent"] / steps / 2**20,
            "optimizer_step_MB": stats["optimizer_step"]["sent"] / 2**20,
            "replicate_is_owned": (stats["replicate"]["sent"] == steps * owned) if plan.replicate > 1
            else stats["replicate"]["sent"] == 0,
        }
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        self.ok = all(r["replicate_is_owned"] and r["optimizer_step_MB"] == 0 for r in rows)
        if trainer.global_rank == 0:
            print(f"\n{REPORT_PREFIX} span W={plan.world}, replicas R={plan.replicate}, world={dist.get_world_size()}, "
                  f"nodes={trainer.num_nodes}; bytes sent per step (MB):")
            print(f"{REPORT_PREFIX} rank node shard_group replicas  owned_grad materialize  reduce replicate opt_step")
            for r in rows:
                print(f"{REPORT_PREFIX} {r['rank']:>4} {r['node']:>4} {str(r['shard_group']):>11} "
                      f"{str(r['replicas']):>8} {r['owned_grad_MB']:>11.3f} {r['materialize_MB']:>11.3f} "
                      f"{r['reduce_MB']:>7.3f} {r['replicate_MB']:>9.3f} {r['optimizer_step_MB']:>8.1f}")
            verdict = "OK" if self.ok else "MISMATCH"
            print(f"{REPORT_PREFIX} replicate traffic == owned gradients on every rank, "
                  f"optimizer step moved 0 bytes: {verdict}", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-nodes", type=int, default=int(os.environ.get("NNODES", 1)),
                   help="nodes in the job (torchrun --nnodes / SLURM --nodes)")
    p.add_argument("--devices", type=int, default=None,
                   help="processes per node (torchrun --nproc-per-node / SLURM --ntasks-per-node); "
                        "default: LOCAL_WORLD_SIZE, else 1")
    p.add_argument("--accelerator", default="auto", help="auto, cpu or gpu")
    p.add_argument("--shard-size", type=int, default=None,
                   help="shard span W (default: processes per node, so one shard group per node)")
    p.add_argument("--planner", default="role_greedy")
    p.add_argument("--collective", default="auto", help="auto (p2p inside a node, broadcast across), p2p, broadcast")
    p.add_argument("--replica-split", default="off", choices=("auto", "on", "off"),
                   help="off here by default: the check below counts plain HSDP's replicate all-reduce")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--data-dir", default=None, help="directory, file or glob of text; default: pydoc help topics")
    p.add_argument("--save-dir", default="runs", help="TensorBoard log root")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="do not fail when the replicate traffic differs from the owned gradients")
    args = p.parse_args(argv)

    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    shard_size = args.shard_size or devices
    seed_everything(42)
    model = GPT(vocab_size=256, max_seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers,
                n_heads=4, lr=0.02, adamw_lr=3e-3, warmup_steps=2)
    data = ByteTextDataModule(data_dir=args.data_dir, seq_len=args.seq_len, batch_size=args.batch_size)
    report = HSDPReport()
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=devices,
        num_nodes=args.num_nodes,
        strategy=mf.MatrixFSDPStrategy(shard_size=shard_size, planner=args.planner, collective=args.collective,
                                       replica_split={"on": True, "off": False}.get(args.replica_split, "auto")),
        precision=args.precision,
        max_steps=args.max_steps,
        limit_val_batches=0,
        log_every_n_steps=min(5, args.max_steps),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=TensorBoardLogger(save_dir=args.save_dir, name="multi_node"),
        callbacks=[report],
    )
    trainer.fit(model, datamodule=data)
    # Lightning leaves the process group up after fit; tear it (and the mesh's sub-groups)
    # down before the interpreter exits, so no communication thread outlives it.
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if (report.ok or not args.check) else 1


if __name__ == "__main__":
    sys.exit(main())
