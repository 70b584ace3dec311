"""Parallel sizes that cannot divide the world are refused before any process starts (issue 36).

``Trainer(...)`` and ``Fabric(...)`` know the devices and nodes when they configure the launcher:
a ``tensor_parallel_size``, ``data_parallel_size``, ``shard_size`` or ``expert_parallel_size`` that
cannot split that world is refused there, naming the option, in this process (nothing is launched).
Sizes that conflict whatever the world are refused when the strategy is built. The same check runs
again in ``setup_environment`` on every rank, before the process group.
"""
from __future__ import annotations

import time

import pytest
import torch

import lightning_matrixfsdp as mf

#: (strategy options, devices, num_nodes, words the error must hold)
BAD_WORLDS = [
    ({"expert_parallel_size": 4}, 2, 1, "expert_parallel_size=4 must divide the data-parallel world size 2"),
    ({"expert_parallel_size": 4}, 2, 3, "expert_parallel_size=4 must divide the data-parallel world size 6"),
    ({"expert_parallel_size": 3, "shard_size": 2}, 4, 1, "expert_parallel_size=3 must divide"),
    ({"expert_parallel_size": 2, "tensor_parallel_size": "auto"}, 2, 1, "with tensor parallelism"),
    ({"tensor_parallel_size": 3}, 4, 1, "tensor_parallel_size=3 must divide the world size 4"),
    ({"tensor_parallel_size": 2}, 3, 1, "tensor_parallel_size=2 must divide the world size 3"),
    ({"data_parallel_size": 3, "tensor_parallel_size": 2}, 4, 1, "must equal the world size 4"),
    ({"data_parallel_size": 4}, 2, 1, "data_parallel_size=4 x tensor_parallel_size=1 must equal the world size 2"),
    ({"shard_size": 3}, 4, 1, "shard_size=3 must divide the data-parallel size 4"),
    ({"shard_size": 4}, 2, 1, "shard_size=4 must divide the data-parallel size 2"),
    ({"shard_size": 3, "tensor_parallel_size": 2}, 4, 1, "shard_size=3 must divide the data-parallel size 2"),
    ({"expert_parallel_size": 2, "shard_size": 3}, 3, 1, "expert_parallel_size=2 must divide"),
]

#: sizes that conflict whatever the world: refused by the strategy's constructor
BAD_OPTIONS = [
    ({"expert_parallel_size": 2, "tensor_parallel_size": 2}, "with tensor parallelism"),
    ({"data_parallel_size": 4, "shard_size": 3}, "shard_size=3 must divide the data-parallel size 4"),
    ({"data_parallel_size": 2, "expert_parallel_size": 4}, "expert_parallel_size=4 must divide"),
]

GOOD_WORLDS = [
    ({"expert_parallel_size": 2}, 2, 1),
    ({"expert_parallel_size": 2, "shard_size": 1}, 2, 2),
    ({"expert_parallel_size": 4, "shard_size": 2}, 4, 2),
    ({"tensor_parallel_size": 2, "shard_size": 2}, 4, 2),
    ({"tensor_parallel_size": "auto"}, 2, 2),
]


def _build(kind: str, options: dict, devices: int, nodes: int):
    from lightning import Fabric, Trainer

    if kind == "trainer":
        return Trainer(strategy=mf.MatrixFSDPStrategy(**options), accelerator="cpu", devices=devices,
                       num_nodes=nodes, logger=False, enable_progress_bar=False)
    return Fabric(strategy=mf.MatrixFSDPFabricStrategy(**options), accelerator="cpu", devices=devices,
                  num_nodes=nodes)


@pytest.mark.parametrize("kind", ["trainer", "fabric"])
def test_a_size_that_cannot_divide_the_world_is_refused_before_launch(kind):
    for options, devices, nodes, words in BAD_WORLDS:
        start = time.monotonic()
        with pytest.raises(mf.MatrixShardError) as err:
            _build(kind, options, devices, nodes)
        assert words in str(err.value), (options, devices, nodes, str(err.value))
        assert f"devices={devices} x num_nodes={nodes}" in str(err.value), str(err.value)
        assert time.monotonic() - start < 5, "refused late"
    for options, devices, nodes in GOOD_WORLDS:
        _build(kind, options, devices, nodes)  # accepted


@pytest.mark.parametrize("cls", [mf.MatrixFSDPStrategy, mf.MatrixFSDPFabricStrategy])
def test_sizes_that_conflict_whatever_the_world_are_refused_by_the_constructor(cls):
    for options, words in BAD_OPTIONS:
        with pytest.raises(mf.MatrixShardError, match=words.replace("(", r"\(")):
            cls(**options)
    with pytest.raises(mf.MatrixShardError, match="with tensor parallelism"):
        mf.MatrixFSDPConfig(expert_parallel_size=2, tensor_parallel_size=4)


def test_setup_environment_on_each_rank_raises_the_same_error_before_the_process_group():
    """A strategy whose launcher was never configured (its sizes not checked there) still refuses in
    ``setup_environment``, before any collective: every rank raises this error on its own."""
    strategy = mf.MatrixFSDPStrategy(expert_parallel_size=4)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.num_nodes = 1
    with pytest.raises(mf.MatrixShardError, match="expert_parallel_size=4 must divide the data-parallel world "
                                                  "size 2"):
        strategy.setup_environment()
    assert not torch.distributed.is_initialized()
