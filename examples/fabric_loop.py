"""A Lightning Fabric training loop under ``strategy="matrix_fsdp"``: two CPU processes.

    python examples/fabric_loop.py                 # 2 processes on CPU, a few seconds
    python examples/fabric_loop.py --devices 3 --steps 20

Shows the setup order (model first, then the optimizer on its parameters), gradient
accumulation with ``fabric.no_backward_sync``, global-norm clipping, and a checkpoint
saved with ``fabric.save`` and loaded back with ``fabric.load`` (the Trainer's format:
``Trainer(strategy="matrix_fsdp").fit(..., ckpt_path=...)`` can resume it as well).
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

import lightning_matrixfsdp as mf  # registers "matrix_fsdp" with Fabric


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(self.norm(x))))


class TinyLM(nn.Module):
    """A next-token MLP language model: embedding, residual blocks, head."""

    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))  # each block becomes a unit
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def batch(step: int, rank: int, vocab: int = 64) -> torch.Tensor:
    """Synthetic token sequences, distinct per rank: a repeating pattern the model can learn."""
    g = torch.Generator().manual_seed(step * 100 + rank)
    start = torch.randint(0, vocab, (8, 1), generator=g)
    return (start + torch.arange(17)) % vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--checkpoint", default=None, help="where to save (default: a temporary directory)")
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy="matrix_fsdp", precision="32-true")
    fabric.launch()
    fabric.seed_everything(0)

    # 1. the model first: matrix_fsdp shards it (each matrix whole on one owner rank) ...
    model = fabric.setup_module(TinyLM())
    # 2. ... then the optimizer, built from the module: Muon on the matrices, AdamW on the embeddings,
    #    the head and the rest (the Muon recipe, the same under every strategy) ...
    optimizer = mf.Muon(model, lr=0.02)
    # 3. ... then set it up: each rank keeps the parameters it owns.
    optimizer = fabric.setup_optimizers(optimizer)

    for step in range(args.steps):
        for micro in range(args.accumulate):
            idx = batch(step * args.accumulate + micro, fabric.global_rank)
            # non-final micro-batches keep their gradients local; the last one reduces to the owners
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                logits = model(idx[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
                fabric.backward(loss / args.accumulate)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # global norm over the owners
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {norm.item():.3f}")

    tmp = None
    if args.checkpoint is None:
        tmp = fabric.broadcast(tempfile.mkdtemp(prefix="fabric_loop_") if fabric.global_rank == 0 else None)
    path = args.checkpoint or os.path.join(tmp, "last.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": args.steps})

    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)  # restores the model and optimizer in place, at any world size
    fabric.print(f"saved and reloaded {path} at step {state['step']}")
    if tmp is not None:
        fabric.barrier()
        if fabric.global_rank == 0:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
