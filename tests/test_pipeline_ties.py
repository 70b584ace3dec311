"""Tied embeddings under pipeline parallelism with HSDP inside the stages and with several stages
per rank (issue 38, item 2): equal to the unsplit one-process oracle of ``helpers/pipeline_scenarios.py``
within the tied bounds of ``test_pipeline_exact.py`` (the tied gradient is summed in another order
than autograd's), and a tie whose gradients are not summed is caught by the same checks."""
from __future__ import annotations

import pytest

from helpers.pipeline_scenarios import run_case

TIED = {"grad_tol": 1e-6, "tol": 2e-3}
LLAMA = {"model": "hf_llama", "model_kw": {"tied": True}, **TIED}
# name -> (world, case, stages of each rank)
CASES = {
    # HSDP inside each stage: two replicas of one rank each; every replica steps both copies
    "llama-tied-pp2xhsdp-1f1b": (4, {**LLAMA, "pp": 2, "schedule": "1F1B", "shard_size": 1,
                                     "shard_options": {"replica_split": False}}, [[0], [0], [1], [1]]),
    # replica_split: one replica steps each copy, the other gets the weights from it; with three
    # layers split after the first the embedding's stepping replica is 1 (rank 1) and the head
    # copy's is 0 (rank 2), so the tie crosses replicas
    "llama-tied-pp2xhsdp-split-1f1b": (4, {**LLAMA, "model_kw": {"tied": True, "layers": 3}, "pp": 2,
                                           "schedule": "1F1B", "shard_size": 1, "split": ["model.layers.1"],
                                           "shard_options": {"replica_split": True}}, [[0], [0], [1], [1]]),
    # two stages per rank in loop order: stage 0 on rank 0, the last stage (3) on rank 1
    "llama-tied-pp2-interleaved": (2, {**LLAMA, "pp": 2, "schedule": "Interleaved1F1B"}, [[0, 2], [1, 3]]),
}


def results(hf_pool, hf_pool4, world: int, case: dict) -> list[dict]:
    res = (hf_pool if world == 2 else hf_pool4).run(run_case, case, timeout=300)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return res


@pytest.mark.parametrize("name", sorted(CASES))
def test_tied_pipeline_equals_the_unsplit_model(hf_pool, hf_pool4, name):
    world, case, stages = CASES[name]
    res = results(hf_pool, hf_pool4, world, case)
    assert [r["stages"] for r in res] == stages, name
    for rank, r in enumerate(res):
        assert all(abs(a - b) <= 1e-5 for a, b in zip(r["losses"], r["oracle_losses"])), \
            f"{name} rank {rank}: {r['losses']} vs {r['oracle_losses']}"
        assert not r["differs"], f"{name} rank {rank}: " + "; ".join(r["differs"][:8])
        assert abs(r["eval"] - r["oracle_eval"]) <= 1e-5, f"{name} rank {rank}: evaluation"
        assert r["routed_is_mine"], f"{name} rank {rank}: the optimizer holds parameters of no stage of this rank"
        assert r["step_collectives"] == 0 and r["step_bytes"] == 0, f"{name} rank {rank}: the step communicated"


def test_a_tied_gradient_not_summed_under_hsdp_is_caught(hf_pool, hf_pool4):
    """Under HSDP, the head copy's gradient never added to the embedding's: beyond the tied bounds."""
    world, case, _ = CASES["llama-tied-pp2xhsdp-1f1b"]
    res = results(hf_pool, hf_pool4, world, {**case, "break": "tie_unsummed"})
    assert all(r["differs"] for r in res)


def test_tie_pairs_follow_the_stepping_owners_and_refuse_what_cannot_be_paired():
    """In-process: the pairs come from every rank's (steps the embedding, steps the head copy), in
    rank order; counts that differ are refused, naming the tie and the ranks."""
    from lightning_matrixfsdp.runtime import MatrixShardError
    from lightning_matrixfsdp.runtime.pipeline.ties import Tie, tie_pairs

    tie = [Tie("model.embed_tokens.weight", "lm_head.weight")]
    hsdp = [[[1, 0]], [[1, 0]], [[0, 1]], [[0, 1]]]  # every replica steps both copies
    assert tie_pairs(hsdp, tie) == [[(0, 2), (1, 3)]]
    split = [[[0, 0]], [[1, 0]], [[0, 1]], [[0, 0]]]  # replica_split: replica 1 steps one, replica 0 the other
    assert tie_pairs(split, tie) == [[(1, 2)]]
    with pytest.raises(MatrixShardError, match=r"model.embed_tokens.weight = lm_head.weight.*\[0, 1\].*\[2\]"):
        tie_pairs([[[1, 0]], [[1, 0]], [[0, 1]], [[0, 0]]], tie)


def test_trainer_tied_pp2_hsdp_equals_the_unsplit_oracle(hf_pool4):
    """Through the Trainer (``helpers/pipeline_lightning_scenarios.py``): PP=2 x HSDP (two replicas of
    one rank) with tied embeddings; the strategy sums the tie before the step and sends the stepped
    value back before the replicas' transfers. The Trainer tied row's bounds (weights 2e-3, losses 1e-5)."""
    from helpers.pipeline_lightning_scenarios import run_case as trainer_case

    case = {"pp": 2, "schedule": "1F1B", "hf": True, "tied": True, "validate": True,
            "options": {"shard_size": 1, "replica_split": True}}
    res = hf_pool4.run(trainer_case, case, timeout=300)
    covered = set()
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert max(abs(a - b) for a, b in zip(r["losses"], r["oracle_losses"])) <= 1e-5, (rank, r["losses"])
        assert r["worst"] <= 2e-3, f"rank {rank}: weights differ from the oracle by {r['worst']:.3e}"
        assert max(abs(a - b) for a, b in zip(r["val"], r["oracle_val"])) <= 1e-5, (rank, r["val"])
        assert r["stepped_is_mine"], f"rank {rank}: the optimizer holds parameters of another stage"
        covered |= set(r["compared"])
    assert covered == set(res[0]["names"])


def test_a_tie_whose_copies_one_rank_steps_is_summed_locally():
    """In-process (a V order puts the first and the last stage on one rank): no transfer, the head
    copy's gradient added to the embedding's and cleared, then the stepped value copied back."""
    import torch

    from lightning_matrixfsdp.runtime.pipeline import PipelineMesh
    from lightning_matrixfsdp.runtime.pipeline.ties import Tie, TiedCopies

    emb, head = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.zeros(3, 2))
    emb.grad, head.grad = torch.full((3, 2), 2.0), torch.full((3, 2), 0.5)
    tied = TiedCopies([Tie("emb", "head")], {"emb": emb, "head": head}, PipelineMesh(1, 0, None, None))
    tied.reduce_grads()
    assert torch.equal(emb.grad, torch.full((3, 2), 2.5)) and head.grad is None
    with torch.no_grad():
        emb.sub_(emb.grad)
    tied.sync_weights()
    assert torch.equal(head, emb)
