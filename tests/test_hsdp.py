"""HSDP (replicate x shard) equals DDP Muon; replicas exchange only owned gradients."""
import pytest
import torch

from helpers.equiv import equivalence_worker

STEPS = 3


@pytest.mark.parametrize("shard_size", [2, 1, 4], ids=["2x2", "4x1", "1x4"])
def test_hsdp_matches_ddp_muon(shard_size, dist_pools):
    # float64: the replica all-reduce adds partial sums in another order than the
    # oracle's flat sum (see tests/helpers/equiv.py for why float32 would drift).
    res = dist_pools(4).run(equivalence_worker, {"steps": STEPS, "shard_size": shard_size, "dtype": torch.float64})
    for r in res:
        stats = r["stats"]
        plan = r["plan_dict"]
        assert plan["world"] == shard_size and plan["replicate"] == 4 // shard_size
        if shard_size == 4:
            assert stats["replicate"]["calls"] == 0
        else:
            # per step, each rank sends exactly its owned trainable gradients to its replicas
            assert stats["replicate"]["sent"] == STEPS * r["owned_grad_bytes"], (stats, r["owned_grad_bytes"])
        assert stats["optimizer_step"]["calls"] == 0


def test_hsdp_clip_of_a_sharded_module_uses_its_shard_group(dist_pools):
    # clip_grad_norm_(module) without group=: replicas hold equal gradients, so the norm is
    # the shard group's; summed over the world it came out sqrt(R) times too large.
    res = dist_pools(4).run(equivalence_worker, {"steps": STEPS, "shard_size": 2, "dtype": torch.float64,
                                                 "clip": 0.05})
    for r in res:  # the worker compares gradients and parameters with the oracle's after the clip
        assert r["worst"]["grad"] <= 1e-9 and r["worst"]["param"] <= 1e-9, r["worst"]
