"""The mesh record (``ParallelDims``): every combination of the five axes, refused or accepted, in one table.

Pure and in process: no process group. Each row is (world, processes per node, options) and either
the words the refusal must hold (naming the option and its value) or the sizes the record must have,
written out by hand here: (pipeline, replicate, shard, tensor, expert).
"""
from __future__ import annotations

import pytest

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.mesh.dims import ParallelDims

W = "devices=D x num_nodes=N"  # the "where" every row passes; each refusal must repeat it

#: (world, per_node, options, expected: a refusal's words, or (pp, replicate, shard, tp, ep))
TABLE = [
    # accepted
    (1, 1, {}, (1, 1, 1, 1, 1)),
    (8, 8, {}, (1, 1, 8, 1, 1)),
    (8, 4, {"shard_size": 4}, (1, 2, 4, 1, 1)),
    (8, 4, {"tensor_parallel": 2}, (1, 1, 4, 2, 1)),
    (8, 4, {"tensor_parallel": "auto"}, (1, 1, 2, 4, 1)),
    (8, 4, {"tensor_parallel": 2, "shard_size": 2}, (1, 2, 2, 2, 1)),
    (8, 4, {"data_parallel": 4, "tensor_parallel": 2}, (1, 1, 4, 2, 1)),
    (8, 4, {"expert_parallel": 4}, (1, 1, 8, 1, 4)),
    (8, 4, {"expert_parallel": 4, "shard_size": 2}, (1, 4, 2, 1, 4)),
    (8, 4, {"expert_parallel": 2, "shard_size": 4}, (1, 2, 4, 1, 2)),
    (8, 4, {"pipeline_parallel": 2}, (2, 1, 4, 1, 1)),
    (8, 4, {"pipeline_parallel": 2, "tensor_parallel": 2}, (2, 1, 2, 2, 1)),
    (8, 4, {"pipeline_parallel": 2, "shard_size": 2, "expert_parallel": 2}, (2, 2, 2, 1, 2)),
    (16, 8, {"pipeline_parallel": 2, "tensor_parallel": 2, "shard_size": 2}, (2, 2, 2, 2, 1)),
    (4, 4, {"pipeline_parallel": 2, "expert_parallel": 2}, (2, 1, 2, 1, 2)),
    # refused: tensor parallelism
    (4, 4, {"tensor_parallel": 3}, "tensor_parallel_size=3 must divide the world size 4"),
    (6, 4, {"tensor_parallel": "auto"}, "tensor_parallel_size=4 must divide the world size 6"),
    (8, 4, {"pipeline_parallel": 2, "tensor_parallel": 3},
     "tensor_parallel_size=3 must divide the world size 4 of a pipeline stage (world 8 / 2 stages)"),
    # refused: data parallelism
    (4, 4, {"data_parallel": 3, "tensor_parallel": 2},
     "data_parallel_size=3 x tensor_parallel_size=2 must equal the world size 4"),
    (2, 2, {"data_parallel": 4}, "data_parallel_size=4 x tensor_parallel_size=1 must equal the world size 2"),
    # refused: shard_size (HSDP)
    (4, 4, {"shard_size": 3}, "shard_size=3 must divide the data-parallel size 4"),
    (2, 2, {"shard_size": 4}, "shard_size=4 must divide the data-parallel size 2"),
    (4, 4, {"shard_size": 3, "tensor_parallel": 2},
     "shard_size=3 must divide the data-parallel size 2 (world 4 (devices=D x num_nodes=N) / tensor_parallel_size 2)"),
    (8, 4, {"shard_size": 3, "pipeline_parallel": 2}, "shard_size=3 must divide the data-parallel size 4"),
    # refused: expert parallelism
    (2, 2, {"expert_parallel": 4}, "expert_parallel_size=4 must divide the data-parallel world size 2"),
    (6, 2, {"expert_parallel": 4}, "expert_parallel_size=4 must divide the data-parallel world size 6"),
    (4, 4, {"expert_parallel": 2, "tensor_parallel": 2}, "expert_parallel_size=2 with tensor parallelism"),
    (2, 2, {"expert_parallel": 2, "tensor_parallel": "auto"}, "expert_parallel_size=2 with tensor parallelism"),
    (8, 4, {"expert_parallel": 4, "pipeline_parallel": 4},
     "expert_parallel_size=4 must divide the data-parallel world size 2"),
    (3, 3, {"expert_parallel": 2, "shard_size": 3}, "expert_parallel_size=2 must divide"),
    (4, 4, {"pipeline_parallel": 2, "expert_parallel": 4},
     "expert_parallel_size=4 must divide the data-parallel world size 2 (world 4 (devices=D x num_nodes=N) / "
     "pipeline_parallel_size 2)"),
    # refused: pipeline parallelism
    (6, 6, {"pipeline_parallel": 4}, "pipeline_parallel_size=4 must divide the world size 6"),
    (4, 4, {"pipeline_parallel": 0}, "pipeline_parallel_size=0 must be a positive int"),
]


@pytest.mark.parametrize("world, per_node, options, expected", TABLE,
                         ids=[f"w{w}-" + "-".join(f"{k}={v}" for k, v in o.items()) for w, _, o, _ in TABLE])
def test_every_combination_of_the_five_axes(world, per_node, options, expected):
    build = lambda: ParallelDims.from_options(world, per_node, where=W, **options)  # noqa: E731
    if isinstance(expected, str):
        with pytest.raises(MatrixShardError) as err:
            build()
        assert expected in str(err.value), str(err.value)
        assert W in str(err.value), str(err.value)
        assert isinstance(err.value, ValueError)
    else:
        dims = build()
        assert (dims.pipeline, dims.replicate, dims.shard, dims.tensor, dims.expert) == expected
        assert dims.world == world


def test_a_record_built_directly_is_checked_too():
    with pytest.raises(MatrixShardError, match="2 replicas x shard_size=2 must equal the data-parallel size 8"):
        ParallelDims(world=8, shard=2, replicate=2)
    with pytest.raises(MatrixShardError, match="expert_parallel_size=3 must divide the data-parallel world size 4"):
        ParallelDims(world=4, shard=4, expert=3)
    with pytest.raises(MatrixShardError, match="tensor_parallel_size=0 must be a positive int"):
        ParallelDims(world=4, shard=4, tensor=0)


def test_groups_follow_the_layout_with_the_pipeline_axis_outermost():
    """Rank lists per axis, against the layout written out by hand: pp=2, replicate=2, shard=2, tp=2."""
    dims = ParallelDims.from_options(16, 8, tensor_parallel=2, shard_size=2, pipeline_parallel=2)
    assert dims.active == ("pp", "replicate", "shard", "tp")
    assert dims.groups("tp")[:3] == [[0, 1], [2, 3], [4, 5]]
    assert dims.groups("shard")[:3] == [[0, 2], [1, 3], [4, 6]]
    assert dims.groups("replicate")[:3] == [[0, 4], [1, 5], [2, 6]]
    assert dims.groups("pp")[:2] == [[0, 8], [1, 9]]
    assert dims.groups("dp")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # a stage's data-parallel column per TP rank
    ep = ParallelDims.from_options(8, 4, expert_parallel=2, shard_size=2)
    assert ep.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # consecutive data-parallel ranks
    assert ep.groups("ep_replica") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # the ranks holding the same experts
    with pytest.raises(KeyError, match="no parallel axis"):
        ep.groups("sequence")


def test_expert_groups_stay_inside_each_pipeline_stage():
    """pp=2 x (replicate=2, shard=2) x ep=2: stage 0 is ranks 0-3, stage 1 ranks 4-7, written out by hand."""
    dims = ParallelDims.from_options(8, 4, pipeline_parallel=2, shard_size=2, expert_parallel=2)
    assert dims.groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("ep_replica") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_experts_that_expert_parallelism_cannot_split_are_refused_through_the_record():
    dims = ParallelDims.from_options(4, 4, expert_parallel=4)
    dims.check_experts(8, "layers.0.experts")
    with pytest.raises(MatrixShardError, match="expert_parallel_size=4 does not divide the 6 experts of "
                                               "'layers.0.experts'"):
        dims.check_experts(6, "layers.0.experts")


def test_the_trainer_refuses_expert_parallelism_larger_than_the_world_at_construction():
    from lightning import Trainer

    import lightning_matrixfsdp as mf

    with pytest.raises(mf.MatrixShardError, match=r"expert_parallel_size=4 must divide the data-parallel world size "
                                                  r"2.*devices=2 x num_nodes=1"):
        Trainer(strategy=mf.MatrixFSDPStrategy(expert_parallel_size=4), devices=2, accelerator="cpu", logger=False)
