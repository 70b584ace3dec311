"""Pipeline x expert parallelism: PP=2 x EP=2 (two data-parallel ranks per stage) on a tiny Mixtral
trains as the unsplit model does (issue 38).

Four gloo processes: each stage's two data-parallel ranks split the stage's experts (tokens travel
only inside the stage). Against ``helpers/pipeline_scenarios.py``'s oracle (the unsplit model on
one process, micro-batches and data-parallel places averaged as the schedule and the runtime sum
them, each expert stepped by ``torch.optim.Muon`` as a matrix of its own): losses, gradients
(dense ones on their owners, each rank's experts where they live) and weights after two optimizer
steps, the evaluation loss; the optimizer holds exactly this rank's owned parameters and experts,
and its step issues no collective and moves 0 bytes.

Float64 (the expert-parallel tests' choice, tests/test_moe_ep.py): the expert-parallel dispatch sums
each token's experts' outputs in another order than Hugging Face's loop over experts, so activations
differ in the last bit, and in float32 such a difference can flip a bfloat16 rounding in Muon's
Newton-Schulz (measured: a router weight off by 6.3e-4 after two steps of Interleaved1F1B); float64's
differences flip none. Measured (torch 2.13): losses and the evaluation loss bitwise equal, gradients
within 2.8e-19, weights within 1.2e-16 after two steps. Bounds below: 1e-12 (losses), 1e-15
(gradients), 1e-12 (weights). Deliberate break, checked once: a second stage whose experts start from
global rank 0's (the first stage's, as before pipelines) gives losses off by 1.7e-4 from the
first step.
"""
from __future__ import annotations

import pytest
import torch

from helpers.pipeline_moe_scenarios import refusal, run_moe_case

pytest.importorskip("transformers")

TOL = {"grad_tol": 1e-15, "tol": 1e-12, "dtype": torch.float64}
LOSS_TOL = 1e-12
CASES = {
    "mixtral-pp2xep2-1f1b": {"model": "hf_mixtral", "pp": 2, "ep": 2, "schedule": "1F1B", **TOL},
    "mixtral-pp2xep2-gpipe": {"model": "hf_mixtral", "pp": 2, "ep": 2, "schedule": "GPipe", **TOL},
    # two stages per rank (0 and 2, 1 and 3): both of a rank's stages use its stage's expert groups
    "mixtral-pp2xep2-interleaved": {"model": "hf_mixtral", "pp": 2, "ep": 2, "schedule": "Interleaved1F1B",
                                    "model_kw": {"layers": 4}, **TOL},
    # every router zero: the first step sends every token to the same two experts (a tie), so one rank
    # of each stage's expert-parallel group receives none (the dispatch exchanges zero counts)
    "mixtral-pp2xep2-1f1b-idle-rank": {"model": "hf_mixtral", "pp": 2, "ep": 2, "schedule": "1F1B", "skew": True,
                                       **TOL},
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
    stages = [[0, 2], [0, 2], [1, 3], [1, 3]] if case["schedule"] == "Interleaved1F1B" else [[0], [0], [1], [1]]
    assert [r["stages"] for r in res] == stages
    for rank, r in enumerate(res):
        # each stage splits its own layer's experts over its own two ranks (one layer a stage)
        place, first = rank // 2, 2 * (rank % 2)
        assert r["experts"] == {f"model.layers.{layer}.mlp.experts.{n}": [first, 2, [2 * place, 2 * place + 1]]
                                for layer in stages[rank] for n in ("gate_up_proj", "down_proj")}, r["experts"]
        assert all(abs(a - b) <= LOSS_TOL for a, b in zip(r["losses"], r["oracle_losses"])), \
            f"{name} rank {rank}: {r['losses']} vs {r['oracle_losses']}"
        assert not r["differs"], f"{name} rank {rank}: " + "; ".join(r["differs"][:8])
        assert abs(r["eval"] - r["oracle_eval"]) <= LOSS_TOL, f"{name} rank {rank}: {r['eval']} vs {r['oracle_eval']}"
        assert r["routed_is_mine"], f"{name} rank {rank}: the optimizer holds parameters this rank does not step"
        assert r["step_collectives"] == 0 and r["step_bytes"] == 0, f"{name} rank {rank}: the step communicated"
        if case.get("skew"):
            # the tie goes to one half of the experts (torch's topk picks; 2 and 3 here): one rank of each
            # stage's expert-parallel group, the other receives no token
            assert r["first_step_experts"] in ([0, 1], [2, 3]), r["first_step_experts"]


def test_expert_groups_spanning_the_stages_are_refused(hf_pool4):
    """The deliberate break: expert-parallel groups of a record without the pipeline axis (the world one
    data-parallel group). Refused on every rank when the experts agree (each stage has other experts)."""
    res = hf_pool4.run(run_moe_case, {**CASES["mixtral-pp2xep2-1f1b"], "break": "world_groups"}, timeout=300)
    for r in res:
        assert "experts modules differ across ranks" in r.get("error", ""), r


@pytest.mark.parametrize("options, words", [
    ({"expert_parallel_size": 4}, "expert_parallel_size=4 must divide the data-parallel world size 2 (world 4 "
                                  "(pipeline_parallel_size=2 x 2 data-parallel ranks per stage) / "
                                  "pipeline_parallel_size 2)"),
    ({"tensor_parallel_size": 2}, "pipeline_parallel_size with tensor_parallel_size is not supported yet"),
])
def test_combinations_refused_on_every_rank(hf_pool4, options, words):
    """Before anything is built or communicated: each rank gives the same refusal, naming both options."""
    res = hf_pool4.run(refusal, {"model": "hf_mixtral", "pp": 2, "options": options}, timeout=120)
    for r in res:
        assert words in (r["refused"] or ""), r
