"""zero_missing_grads on CUDA + NCCL against DDP with zero gradients (not part of CI).

    torchrun --nproc-per-node N scripts/gpu_zero_missing.py OUT_DIR

The CPU tests check the option bitwise on gloo. On CUDA the autograd engine runs
gradient accumulation on the device's own thread; this runs a tiny decoder with two
experts per block, routed differently on each rank (and, every third step, expert 1
unused everywhere), in float64 on the GPUs, next to a plainly written DDP oracle (below:
every rank holds the whole model, a missing gradient counts as zeros, gradients are
averaged, ``torch.optim.Muon`` on 2D weights, ``torch.optim.AdamW`` on the rest), and
writes the per-step losses and the largest parameter difference after five steps to
OUT_DIR/gpu_zero_missing.json (a gradient arriving after its unit reduced would raise).
Without CUDA it runs on CPU with gloo (a local try-out).
"""
from __future__ import annotations

import copy
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.bench.report import save_json
from lightning_matrixfsdp.runtime.tags import is_owned

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 16, 2
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
ADAMW = dict(lr=0.02, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


class Block(nn.Module):
    """Attention, then the experts ``route`` picks (None: all), then the MLP."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))
        self.route: Optional[int] = 0
        self.ln2, self.fc, self.out = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(D, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D))
        for expert in self.experts if self.route is None else [self.experts[self.route]]:
            x = x + expert(x)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ExpertLM(nn.Module):
    def __init__(self, experts: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.02)
        self.blocks = nn.ModuleList(Block(experts) for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def batch_for(step: int, rank: int) -> torch.Tensor:
    """Distinct, reproducible tokens per (step, rank)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))


def route_by_rank(step: int, rank: int, block: int) -> Optional[int]:
    """Rank 0 runs every expert, the others one each (changing with step and block); every
    third step every rank runs expert 0 only, so expert 1 is unused everywhere."""
    if step % 3 == 2:
        return 0
    return None if rank == 0 else (rank + step + block) % 2


def oracle_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW)]


def oracle_average_grads(model: nn.Module) -> None:
    """DDP with every parameter counted as used: zeros for a missing gradient, then the mean."""
    world = dist.get_world_size()
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        p.grad = g / world


def sharded_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    opt = mf.Muon(model.parameters(), adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
                  adamw_weight_decay=ADAMW["weight_decay"], **MUON)
    return mf.route_optimizer(opt)


def main(out: str) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    oracle = ExpertLM().to(device)
    sharded = mf.matrix_shard(copy.deepcopy(oracle), device=device, zero_missing_grads=True)
    o_opts, s_opts = oracle_optimizers(oracle), [sharded_optimizer(sharded)]
    losses, worst_loss = [], 0.0
    for step in range(5):
        for m in (oracle, sharded):
            for i, blk in enumerate(m.blocks):
                blk.route = route_by_rank(step, rank, i)
        idx = batch_for(step, rank).to(device)
        lo, ls = lm_loss(oracle(idx), idx), lm_loss(sharded(idx), idx)
        lo.backward()
        ls.backward()
        oracle_average_grads(oracle)
        for o in o_opts + s_opts:
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append([lo.item(), ls.item()])
        worst_loss = max(worst_loss, abs(lo.item() - ls.item()))
    worst_param = 0.0
    o_params = dict(oracle.named_parameters())
    for name, p in sharded.named_parameters():  # each owner checks its own resident tensors
        if is_owned(p):
            worst_param = max(worst_param, (p.data - o_params[name].data).abs().max().item())
    result = torch.tensor([worst_loss, worst_param], device=device)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    verdict = {"world": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
               "torch": torch.__version__,
               "losses_oracle_ours_rank0": losses, "max_loss_diff": result[0].item(),
               "max_param_diff": result[1].item(), "ok": bool(result.max().item() < 1e-9)}
    if rank == 0:
        save_json(out, "gpu_zero_missing.json", verdict)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpu_zero_missing_out")
