"""zero_missing_grads on CUDA + NCCL against DDP with zero gradients (not part of CI).

    torchrun --nproc-per-node N scripts/gpu_zero_missing.py OUT_DIR

The CPU tests check the option bitwise on gloo. On CUDA the autograd engine runs
gradient accumulation on the device's own thread; this runs the tests' tiny model with
two experts per block, routed differently on each rank (and, every third step, expert 1
unused everywhere), in float64 on the GPUs, next to the plainly written DDP oracle of
the tests, and writes the per-step losses and the largest parameter difference after
five steps to OUT_DIR/gpu_zero_missing.json (a gradient arriving after its unit reduced
would raise).
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from equiv import make_sharded_optimizer, route_by_rank  # noqa: E402
from models import TinyLM, batch_for, lm_loss  # noqa: E402
from oracle import allreduce_mean_grads, oracle_optimizers  # noqa: E402

import lightning_matrixfsdp as mf  # noqa: E402
from lightning_matrixfsdp.bench.report import save_json  # noqa: E402


def main(out: str) -> None:
    cuda = torch.cuda.is_available()  # without CUDA (a local try-out): CPU and gloo
    # gloo next to NCCL: the tests' oracle all-reduces its "used" flags as CPU tensors
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    oracle = TinyLM(experts=2).to(device)
    sharded = mf.matrix_shard(copy.deepcopy(oracle), device=device, zero_missing_grads=True)
    o_opts, s_opts = oracle_optimizers(oracle), make_sharded_optimizer(sharded, "ours")
    losses, worst_loss = [], 0.0
    for step in range(5):
        for m in (oracle, sharded):
            for i, blk in enumerate(m.blocks):
                blk.route = route_by_rank(step, rank, i)
        idx = batch_for(step, rank).to(device)
        lo, ls = lm_loss(oracle(idx), idx), lm_loss(sharded(idx), idx)
        lo.backward()
        ls.backward()
        allreduce_mean_grads(oracle, zero_missing=True)
        for o in o_opts + s_opts:
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append([lo.item(), ls.item()])
        worst_loss = max(worst_loss, abs(lo.item() - ls.item()))
    worst_param = 0.0
    o_params = dict(oracle.named_parameters())
    for name, p in sharded.named_parameters():  # each owner checks its own resident tensors
        if p._mfsdp_owned:
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
