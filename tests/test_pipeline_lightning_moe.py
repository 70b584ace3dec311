"""Pipeline x expert parallelism through the Trainer (issue 38): the demos' ``HFCausalLM`` around a
tiny Mixtral, ``MatrixFSDPStrategy(pipeline_parallel_size=2, expert_parallel_size=2)`` on four gloo
processes (two stages of two data-parallel ranks, each stage splitting its own layer's experts over
its two ranks), 1F1B, two steps, ``precision="64-true"``, against the one-process oracle of
``helpers/pipeline_lightning_moe_scenarios.py`` (the unsplit model, torch's Muon on each expert).

Float64 for the reason tests/test_pipeline_moe.py gives: the expert-parallel dispatch sums each
token's experts in another order than Hugging Face's loop, a last-bit difference that float32 can
turn into a flipped bfloat16 rounding in Muon's Newton-Schulz. Bounds: 1e-12 on losses and weights
(the runtime's test measured losses bitwise, weights within 1.2e-16).
"""
from __future__ import annotations

import pytest

from helpers.pipeline_lightning_moe_scenarios import run_moe_trainer

pytest.importorskip("transformers")

TOL = 1e-12


def test_trainer_pipeline_with_expert_parallelism_equals_the_unsplit_oracle(hf_pool4):
    res = hf_pool4.run(run_moe_trainer, {"pp": 2, "ep": 2, "schedule": "1F1B"}, timeout=300)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    covered = set()
    for rank, r in enumerate(res):
        assert r["dtypes"] == ["torch.float64"], (rank, r["dtypes"])
        assert len(r["losses"]) == 2 and max(abs(a - b) for a, b in zip(r["losses"], r["oracle_losses"])) <= TOL, \
            (rank, r["losses"], r["oracle_losses"])
        assert r["worst"] <= TOL, f"rank {rank}: weights differ from the oracle by {r['worst']:.3e}"
        assert r["stepped_is_mine"], f"rank {rank}: the optimizer holds parameters this rank does not step"
        # stage = rank // 2 holds layer `stage`; its two ranks hold experts 0-1 and 2-3 of each stack
        stage, first = rank // 2, 2 * (rank % 2)
        assert r["experts"] == {f"model.model.layers.{stage}.mlp.experts.{n}": [first, 2]
                                for n in ("gate_up_proj", "down_proj")}, (rank, r["experts"])
        covered |= set(r["compared"])
    assert covered == set(res[0]["names"])


def test_expert_parallel_size_not_dividing_a_stage_is_refused_at_construction():
    """In ``Trainer(...)``: before any process starts, naming both options (4 processes, 2 stages:
    2 ranks a stage, so EP=4 divides the world but no stage)."""
    from lightning.pytorch import Trainer

    import lightning_matrixfsdp as mf

    with pytest.raises(Exception) as info:
        Trainer(accelerator="cpu", devices=4, logger=False,
                strategy=mf.MatrixFSDPStrategy(pipeline_parallel_size=2, expert_parallel_size=4))
    message = str(info.value)
    assert "expert_parallel_size=4 must divide each pipeline stage's data-parallel size 2" in message, message
    assert "pipeline_parallel_size 2" in message, message
