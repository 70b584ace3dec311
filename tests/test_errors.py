"""Bad input gets a clear error, never a hang."""
import copy

import pytest
import torch
from torch import nn

import lightning_matrixfsdp as mf
from helpers.models import TinyLM


def test_invalid_planner_and_collective_names():
    with pytest.raises(ValueError, match="unknown planner 'fastest'.*role_greedy"):
        mf.matrix_shard(TinyLM(), planner="fastest")
    with pytest.raises(ValueError, match="unknown collective 'nccl_magic'.*p2p"):
        mf.matrix_shard(TinyLM(), collective="nccl_magic")


def test_already_sharded_by_us():
    m = mf.matrix_shard(TinyLM())
    with pytest.raises(ValueError, match="already sharded by matrix_shard"):
        mf.matrix_shard(m)


def test_mixed_devices_and_partial_meta():
    m = TinyLM()
    with torch.device("meta"):
        m.head = nn.Linear(32, 64, bias=False)
    with pytest.raises(ValueError, match="meta device"):
        mf.matrix_shard(m)


def test_tied_weights_across_units_are_refused():
    m = TinyLM()
    m.blocks[1].fc.weight = m.blocks[0].fc.weight
    with pytest.raises(ValueError, match="tied weights must live in one unit"):
        mf.matrix_shard(m)


def test_not_a_module():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        mf.matrix_shard(torch.zeros(3))


def _fsdp2_and_dtensor_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    msgs = {}
    mesh = init_device_mesh("cpu", (world,))
    m = TinyLM()
    for blk in m.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(m, mesh=mesh)
    try:
        mf.matrix_shard(m)
    except ValueError as e:
        msgs["fsdp2"] = str(e)
    tp = nn.Linear(8, 8)
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Shard(0)]))
    try:
        mf.matrix_shard(tp)
    except ValueError as e:
        msgs["dtensor"] = str(e)
    return msgs


def test_fsdp2_wrapped_and_tensor_parallel_models_are_refused(dist_pools):
    msgs = dist_pools(2).run(_fsdp2_and_dtensor_worker)[0]
    assert "already wrapped by FSDP" in msgs.get("fsdp2", ""), msgs
    assert "tensor parallel" in msgs.get("dtensor", ""), msgs


def _mismatch_worker(rank, world, kind):
    torch.manual_seed(0)
    model = TinyLM(layers=3 if (kind == "model" and rank == 1) else 2)
    collective = "broadcast" if (kind == "collective" and rank == 2) else "p2p"
    try:
        mf.matrix_shard(model, collective=collective)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind,expect", [
    ("model", "unit #2: '' vs 'blocks.2'"),
    ("collective", "collective: 'p2p' vs 'broadcast'"),
])
def test_plan_mismatch_between_ranks_raises_on_every_rank(kind, expect, dist_pools):
    msgs = dist_pools(3).run(_mismatch_worker, kind, timeout=120)
    for m in msgs:
        assert "plan mismatch" in m and expect in m, m
