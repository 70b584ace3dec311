"""The strategy's ``timeout`` reaches the HSDP mesh's own process groups.

``init_device_mesh`` creates the shard and replicate groups with torch's default timeout
(30 minutes on gloo), not the one the world group got, so a rank missing from a replica
all-reduce used to hang for that long. ``hsdp_mesh(..., timeout=)`` builds the groups with
it. The check: rank 0 enters an all-reduce on its replicate group that rank 1 never joins
(rank 1 stays alive until rank 0 is done or ``SILENT_S`` passed, so only the timeout can end
the wait); with a 2-second timeout it fails within seconds, and the default-timeout mesh is
still waiting when rank 1 gives up.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers.dist import run_distributed
from lightning_matrixfsdp.runtime.mesh.comm import hsdp_mesh, shard_and_replicate_groups

SILENT_S = 12.0  # how long rank 1 stays away from the collective


def _replicate_wait(rank: int, world: int, timeout_s: float | None, done: str) -> tuple[str, float]:
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    mesh = hsdp_mesh(1, torch.device("cpu"), timeout)
    assert mesh.mesh_dim_names == ("replicate", "shard") and tuple(mesh.shape) == (world, 1)
    shard, replicate = shard_and_replicate_groups(mesh)
    assert dist.get_world_size(shard) == 1 and dist.get_world_size(replicate) == world
    dist.all_reduce(torch.ones(1), group=replicate)  # the groups work
    if rank == 1:  # alive but silent until rank 0 is done (a file, not the broken group, says so)
        start = time.monotonic()
        while not os.path.exists(done) and time.monotonic() - start < SILENT_S:
            time.sleep(0.05)
        return "absent", time.monotonic() - start
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=replicate)
        outcome = "returned"
    except RuntimeError as err:
        outcome = f"error: {err}"
    waited = time.monotonic() - start
    open(done, "w").close()
    return outcome, waited


def test_hsdp_mesh_groups_use_the_given_timeout(tmp_path):
    (outcome, waited), _ = run_distributed(_replicate_wait, 2, 2.0, str(tmp_path / "done"), timeout=120)
    assert outcome.startswith("error") and waited < SILENT_S / 2, (outcome, waited)


def test_hsdp_mesh_layout_with_a_timeout_matches_init_device_mesh(dist_pools):
    dist_pools(4).run(_layout)


def _layout(rank: int, world: int) -> None:
    reference = hsdp_mesh(2, torch.device("cpu"))
    timed = hsdp_mesh(2, torch.device("cpu"), timedelta(seconds=60))
    assert timed.mesh.tolist() == reference.mesh.tolist() == [[0, 1], [2, 3]]
    for dim in (0, 1):
        assert (dist.get_process_group_ranks(timed.get_group(dim))
                == dist.get_process_group_ranks(reference.get_group(dim)))
    # both groups carry traffic: a sum over the shard group, then over the replicate group
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=timed.get_group(1))
    assert x.item() == (0 + 1 if rank < 2 else 2 + 3)
    dist.all_reduce(x, group=timed.get_group(0))
    assert x.item() == 6


def test_hsdp_mesh_refuses_a_bad_timeout_before_any_collective():
    """No process group here: the option check comes first and names the option."""
    from lightning_matrixfsdp.runtime.errors import MatrixShardError

    for bad in (30, timedelta(seconds=0), "30s"):
        with pytest.raises(MatrixShardError, match="timeout"):
            hsdp_mesh(1, torch.device("cpu"), bad)
