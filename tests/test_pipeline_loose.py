"""Loose ends of pipeline and expert parallelism (issue 38 follow-ups): the strategies' timeout on
the expert groups, ``forward_outputs`` outside the training steps (a validation step, a hook on
every rank, a hook on rank 0 alone), Fabric's split printout and its checkpoint resumed by the
Trainer, and weight averaging (EMA) under pipeline parallelism. Scenarios:
tests/helpers/pipeline_loose_scenarios.py."""
from __future__ import annotations

import pytest

from helpers.pipeline_loose_scenarios import ema, expert_group_timeouts, fabric_to_trainer, outputs_and_lone_forwards

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_strategy_timeout_reaches_the_expert_groups(dist_pools):
    """EP=2 on 4 ranks: the strategy's ``timeout`` on every expert group, without pipeline
    parallelism (expert-parallel and expert-replica groups) and with PP=2 (each stage's groups);
    torch's default (30 minutes on gloo) would keep a stalled token exchange waiting."""
    for rank, r in enumerate(dist_pools(4).run(expert_group_timeouts, 7.0, timeout=120)):
        assert set(r[1]) == {"ep", "ep_replica"} and set(r[1].values()) == {7.0}, (rank, r)
        assert set(r[2]) == {"ep", "stage"} and set(r[2].values()) == {7.0}, (rank, r)


@pytest.fixture(scope="module")
def outputs(dist_pools):
    res = dist_pools(2).run(outputs_and_lone_forwards, timeout=180)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return res


def test_forward_outputs_in_validation_and_in_a_hook_on_every_rank(outputs):
    """``forward_outputs`` in a ``validation_step`` and in ``on_validation_epoch_end`` called on
    every rank: the unsplit model's logits, on every rank (both stages)."""
    for rank, r in enumerate(outputs):
        assert r["outputs"] == [1, 1], (rank, r)
        assert r["worst"] < 1e-5, (rank, r)


def test_a_lone_forward_under_pp_is_refused_with_what_to_do(outputs):
    """``forward_outputs`` on rank 0 alone in a hook: a ``LoneForwardError`` within seconds (before
    the schedule's first collective, which would wait for the process-group timeout) that does
    not suggest ``full_model`` (refused under PP) but calling ``forward_outputs`` on every rank."""
    message, waited = outputs[0]["lone"]
    assert outputs[1]["lone"] is None
    assert "pipelined model" in message and "forward_outputs(self, inputs)` on every rank" in message, message
    assert "full_model cannot gather a pipelined model" in message and "rank(s) [1]" in message, message
    assert "pipeline_parallel_size=1" in message and "full_model(module, rank=0)" not in message, message
    assert waited < 10, waited


@pytest.fixture(scope="module")
def fabric_ckpt(dist_pools, tmp_path_factory):
    res = dist_pools(2).run(fabric_to_trainer, str(tmp_path_factory.mktemp("fabric_pp")), timeout=180)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return res


def test_fabric_prints_the_pipeline_split(fabric_ckpt):
    """``log_plan=True``: Fabric's strategy prints the split on rank 0, as the Trainer's does."""
    r0, r1 = fabric_ckpt
    assert r0["describe"].startswith("pipeline: 2 stages") and "stage 0: embeddings" in r0["describe"]
    assert r0["describe"] in r0["printed"], r0["printed"]
    assert r1["describe"] not in r1["printed"], r1["printed"]


def test_a_fabric_pp_checkpoint_resumes_in_the_trainer(fabric_ckpt):
    """``fabric.save`` at PP=2 (a directory), then ``Trainer.fit(ckpt_path=...)`` at PP=2: training
    starts from the saved weights and optimizer state, bitwise, on every rank (its loops start
    fresh: a Fabric checkpoint has none), and trains on."""
    import math

    import torch

    for rank, r in enumerate(fabric_ckpt):
        saved, restored = r["saved"], r["restored"]
        for what in ("weights", "state"):
            assert saved[what] and saved[what].keys() == restored[what].keys(), (rank, what)
            assert all(torch.equal(saved[what][k], restored[what][k]) for k in saved[what]), (rank, what)
        assert len(r["losses"]) == 1 and math.isfinite(r["losses"][0]), r["losses"]


def test_fabric_under_pp_samples_by_place_and_refuses_uneven_loaders(fabric_ckpt):
    """Fabric's ``DistributedSampler`` under PP=2 on 2 ranks: one data-parallel place (both stages
    read its batches, else the step's check refuses them); loaders of different lengths (rank 0:
    3 batches, rank 1: 2): refused at ``setup_dataloaders`` on every rank, naming each rank's count."""
    for rank, r in enumerate(fabric_ckpt):
        assert r["sampler"] == {"num_replicas": 1, "rank": 0}, (rank, r["sampler"])
        assert "same number of batches (rank 0: 3, rank 1: 2)" in r["uneven"], (rank, r["uneven"])


def test_ema_under_pp_averages_like_the_unsplit_model_and_its_checkpoint_is_refused(dist_pools, tmp_path):
    """``WeightAveraging`` (EMA) at PP=2: the averaged copy holds this rank's stages (the other
    stages' parameters are empty, as in the model), and the weights after fit (the average,
    swapped in) equal the EMA of the unsplit model's weights after each step. A checkpoint with the
    averaged model cannot be written yet: refused on every rank, saying what to do instead."""
    res = dist_pools(2).run(ema, str(tmp_path), timeout=180)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    assert set(res[0]["compared"]).isdisjoint(res[1]["compared"]) and res[0]["compared"] and res[1]["compared"]
    for rank, r in enumerate(res):
        assert r["worst"] < 1e-6 and r["from_raw"] > 1e-4, (rank, r["worst"], r["from_raw"])
        assert r["checkpoint"].startswith("CheckpointError") and "save_weights_only=True" in r["checkpoint"], r
