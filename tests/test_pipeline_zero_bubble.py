"""The split-backward schedules (zero bubble, DualPipeV) train exactly as the unsplit model does
(issue 38): torch's ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV`` run each micro-batch's backward on a stage as an input part and a later
weight part (runtime/pipeline/split_backward.py). Each case is checked as tests/test_pipeline_exact.py
checks GPipe / 1F1B / Interleaved1F1B (helpers/pipeline_scenarios.py: losses, every owner's gradient
and every weight bitwise in float32 against the unsplit model on one process, 0 bytes in
``optimizer.step()``), and after every step no unit is left materialized and no full gradient
left unreduced. A weight part whose gradients are reduced before torch computed them is caught.
"""
from __future__ import annotations

import pytest

from helpers.dist import run_checked
from helpers.pipeline_scenarios import run_case

# name -> (world, case, the stages of each rank)
CASES = {
    "zb-pp2": (2, {"model": "demo_gpt", "pp": 2, "schedule": "InterleavedZeroBubble"}, [[0, 2], [1, 3]]),
    "zbv-pp2": (2, {"model": "demo_gpt", "pp": 2, "schedule": "ZBVZeroBubble"}, [[0, 3], [1, 2]]),
    "dualpipev-pp2": (2, {"model": "demo_gpt", "pp": 2, "schedule": "DualPipeV"}, [[0, 3], [1, 2]]),
    # every block recomputed in backward (non-reentrant checkpointing): in the input part and again in the weight part
    "zbv-pp2-checkpoint": (2, {"model": "demo_gpt", "pp": 2, "schedule": "ZBVZeroBubble", "checkpoint": True},
                           [[0, 3], [1, 2]]),
    "zbv-pp2xdp2": (4, {"model": "demo_gpt", "pp": 2, "schedule": "ZBVZeroBubble"}, [[0, 3], [0, 3], [1, 2], [1, 2]]),
    "zbv-pp2xhsdp": (4, {"model": "demo_gpt", "pp": 2, "schedule": "ZBVZeroBubble", "shard_size": 1},
                     [[0, 3], [0, 3], [1, 2], [1, 2]]),
    "zb-pp2xdp2": (4, {"model": "demo_gpt", "pp": 2, "schedule": "InterleavedZeroBubble"},
                   [[0, 2], [0, 2], [1, 3], [1, 3]]),
    "dualpipev-pp2xdp2": (4, {"model": "demo_gpt", "pp": 2, "schedule": "DualPipeV"},
                          [[0, 3], [0, 3], [1, 2], [1, 2]]),
}


def results(dist_pools, world: int, case: dict, fn=run_case) -> list[dict]:
    return run_checked(dist_pools(world), fn, case)


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_backward_schedule_equals_the_unsplit_model(dist_pools, name):
    world, case, stages = CASES[name]
    res = results(dist_pools, world, case)
    assert [r["stages"] for r in res] == stages, name
    for rank, r in enumerate(res):
        assert r["losses"] == r["oracle_losses"], f"{name} rank {rank}: {r['losses']} vs {r['oracle_losses']}"
        assert not r["differs"], f"{name} rank {rank}: " + "; ".join(r["differs"][:8])
        assert r["eval"] == r["oracle_eval"], f"{name} rank {rank}: evaluation {r['eval']} vs {r['oracle_eval']}"
        assert r["step_collectives"] == 0 and r["step_bytes"] == 0, f"{name} rank {rank}: the step communicated"
        assert r["left"] == [], f"{name} rank {rank}: {r['left']}"


def test_trainer_with_a_split_backward_schedule_equals_the_unsplit_oracle(dist_pools):
    """``pipeline_schedule="ZBVZeroBubble"`` through the Trainer (helpers/pipeline_lightning_scenarios.py,
    as tests/test_pipeline_lightning.py's rows): per-step losses, every owned weight after the fit and the
    validation loss bitwise equal to the one-process oracle."""
    from helpers.pipeline_lightning_scenarios import run_case as trainer_case

    res = results(dist_pools, 2, {"pp": 2, "schedule": "ZBVZeroBubble", "validate": True}, trainer_case)
    for rank, r in enumerate(res):
        assert r["losses"] == r["oracle_losses"], (rank, r["losses"], r["oracle_losses"])
        assert r["worst"] == 0.0, f"rank {rank}: weights differ from the oracle by {r['worst']:.3e}"
        assert r["stepped_is_mine"], f"rank {rank}: the optimizer holds parameters of another stage"
        assert r.get("val") == r.get("oracle_val"), (rank, r.get("val"), r.get("oracle_val"))
    assert set(res[0]["compared"]) | set(res[1]["compared"]) == set(res[0]["names"])


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_expert_parallelism_with_a_split_backward_is_refused(schedule):
    """Local experts take their gradients at the end of each whole backward, which a weight part is
    not: refused before anything is sharded, naming the schedules to use instead (one process)."""
    from helpers.pipeline_scenarios import demo_gpt, lm_loss
    from lightning_matrixfsdp.runtime import MatrixShardError
    from lightning_matrixfsdp.runtime.pipeline import PipelineMesh, build_pipeline

    with pytest.raises(MatrixShardError, match="expert_parallel_size=2.*Use 1F1B or Interleaved1F1B"):
        build_pipeline(demo_gpt(), PipelineMesh(1, 0, None, None), loss_fn=lm_loss, schedule=schedule,
                       expert_parallel_size=2)
