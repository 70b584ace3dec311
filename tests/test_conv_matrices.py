"""``flatten_conv=True``: convolution kernels are matrix roles, trained by Muon as their
``(out, -1)`` matrix, bitwise equal to DDP with ``torch.optim.Muon`` on those flattened
views (the oracle below, written plainly: a 2-D parameter sharing each kernel's storage)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.equiv import full_params, make_sharded_optimizer
from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS, allreduce_mean_grads


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 1, bias=False), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)


def _worker(rank: int, world: int, steps: int) -> dict:
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.tags import state_of

    model = conv_net()
    ref = copy.deepcopy(model)
    mf.matrix_shard(model, flatten_conv=True)
    kinds = {s.fqn: s.role.value for s in state_of(model).plan.shards()}
    loads = list(state_of(model).plan.loads_flops)
    ours = make_sharded_optimizer(model, "ours")

    # the oracle: DDP, torch.optim.Muon on 2-D views of the kernels (same storage), AdamW on the rest
    views = {n: nn.Parameter(p.data.view(p.shape[0], -1)) for n, p in ref.named_parameters() if p.ndim > 2}
    mats = [p for p in ref.parameters() if p.ndim == 2] + list(views.values())
    rest = [p for p in ref.parameters() if p.ndim < 2]
    oracle = [torch.optim.Muon(mats, **MUON_DEFAULTS), torch.optim.AdamW(rest, **ADAMW_DEFAULTS)]

    for step in range(steps):
        x, y = batch(step, rank)
        nn.functional.cross_entropy(model(x), y).backward()
        for opt in ours:
            opt.step()
            opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        allreduce_mean_grads(ref)
        for n, p in ref.named_parameters():
            if n in views:
                views[n].grad = p.grad.view(views[n].shape)
        for opt in oracle:
            opt.step()
            opt.zero_grad()
        ref.zero_grad()
    got = full_params(model)
    diff = {n: (got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()}
    moved = {n: (p.detach() - q.detach()).abs().max().item() for (n, p), q in zip(ref.named_parameters(),
                                                                                  conv_net().parameters())}

    # Shampoo keeps 2-D matrices only: a flattened kernel's owner gets an error that names the option
    shampoo_error = None
    try:
        opt = mf.route_optimizer(mf.Shampoo(list(model.parameters()), lr=0.01))
        x, y = batch(99, rank)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    except ValueError as e:
        shampoo_error = str(e)
    dist.barrier()
    return {"kinds": kinds, "diff": diff, "moved": moved, "loads": loads, "shampoo_error": shampoo_error}


@pytest.mark.parametrize("world", [2, 3])
def test_flattened_kernels_equal_ddp_muon_on_their_views(world, dist_pools):
    results = dist_pools(world).run(_worker, 3, timeout=240)
    kinds = results[0]["kinds"]
    kernels = [n for n, k in kinds.items() if n.endswith("weight") and n.split(".")[0] in ("0", "3", "6")]
    assert len(kernels) == 3 and all(kinds[n] == "matrix" for n in kernels), kinds
    for r in results:
        assert all(v == 0.0 for v in r["diff"].values()), r["diff"]  # bitwise
        assert all(r["moved"][n] > 0 for n in kernels)  # the kernels did train
    # every rank owns some optimizer work: the kernels spread the Newton-Schulz FLOPs
    assert all(f > 0 for f in results[0]["loads"])
    errors = [r["shampoo_error"] for r in results if r["shampoo_error"]]
    assert errors and all("flatten_conv=True" in e and "only Muon" in e for e in errors)


def _kinds_worker(rank: int, world: int) -> dict:
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.tags import state_of

    model = conv_net()
    mf.matrix_shard(model)
    return {s.fqn: s.role.value for s in state_of(model).plan.shards()}


def test_without_the_option_kernels_stay_on_adamw(dist_pools):
    kinds = dist_pools(2).run(_kinds_worker, timeout=120)[0]
    assert kinds["0.weight"] != "matrix" and kinds["10.weight"] == "matrix"


def test_the_option_is_a_bool():
    import lightning_matrixfsdp as mf

    with pytest.raises(mf.MatrixShardError, match="flatten_conv"):
        mf.MatrixFSDPStrategy(flatten_conv="yes")
