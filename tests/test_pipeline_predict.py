"""Prediction under pipeline parallelism (issue 38, item 3): ``forward_outputs(self, inputs)``.

Through the Trainer (``trainer.predict``, the demos' GPT, and ``HFCausalLM`` around a tiny Llama,
with a ``predict_step`` that returns ``forward_outputs``) at PP=2 and, after a one-step ``fit``,
at PP=2 x DP=2, and through a Fabric loop at PP=2: every rank of every stage returns, for each batch of its data-parallel place, the
unsplit model's outputs on one process, float32-bitwise (``helpers/pipeline_predict_scenarios.py``:
the oracle runs micro-batch by micro-batch, as the schedule does). Refused on every rank, naming
what to change: Lightning's default ``predict_step`` (``self(batch)``), a batch the micro-batches do
not divide (on one place only), places with different batch counts (a place without any batch too), ``forward_outputs`` with
gradients on. Without pipeline parallelism ``forward_outputs`` is ``self(inputs)`` (in process).
"""
from __future__ import annotations

import pytest
import torch

from helpers.pipeline_predict_scenarios import predict_refusals, run_fabric_predict, run_predict


def _ok(res: list) -> list:
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return res


def _same(res: list) -> None:
    for rank, r in enumerate(res):
        assert len(r["got"]) == len(r["want"]) and r["want"], (rank, len(r["got"]), len(r["want"]))
        for i, (g, w) in enumerate(zip(r["got"], r["want"])):
            assert g.shape == w.shape and g.dtype == w.dtype, (rank, i, g.shape, w.shape, g.dtype)
            assert torch.equal(g, w), f"rank {rank} batch {i}: differs by {(g - w).abs().max().item():.3e}"


@pytest.mark.parametrize("world, case", [
    (2, {"pp": 2, "schedule": "GPipe", "samples": 16, "batch": 8}),
    (4, {"pp": 2, "schedule": "1F1B", "samples": 24, "batch": 4, "fit": 1}),
    (2, {"pp": 2, "schedule": "1F1B", "samples": 8, "batch": 8, "hf": True}),
], ids=["pp2", "pp2xdp2-after-fit", "hf-llama-pp2"])
def test_trainer_predict_equals_the_unsplit_model(request, dist_pools, world, case):
    """The Hugging Face module on the pool that imported transformers."""
    pool = request.getfixturevalue("hf_pool") if case.get("hf") else dist_pools(world)
    res = _ok(pool.run(run_predict, case, timeout=300))
    _same(res)
    for rank, r in enumerate(res):  # a prediction writer gets this place's sample indices, as under DDP
        assert r["written"] == r["want_indices"] and r["written_same"], (rank, r["written"], r["want_indices"])


def test_fabric_forward_outputs_equals_the_unsplit_model(dist_pools):
    res = _ok(dist_pools(2).run(run_fabric_predict, {"pp": 2, "schedule": "1F1B"}, timeout=300))
    _same(res)
    for rank, r in enumerate(res):
        assert r["refused"] and "torch.no_grad()" in r["refused"] and "forward_loss" in r["refused"], (rank, r)


#: bad prediction -> what every rank's message must say
REFUSED = {
    "calls_self": "lightning_matrixfsdp.forward_outputs(self, inputs)",
    "not_a_multiple": "must be a multiple of 4",
    "uneven_places": "different numbers of batches",
    # the uneven-inputs join sees the stages and refuses first, before the predictions' own check
    "place_without_batch": "ranks have an evaluation or prediction batch in this step, under pipeline parallelism",
}


@pytest.mark.parametrize("world", [2, 4])
def test_bad_predictions_are_refused_on_every_rank(dist_pools, world):
    res = dist_pools(world).run(predict_refusals, timeout=300)
    for name, needle in REFUSED.items():
        if name in ("uneven_places", "place_without_batch") and world == 2:
            continue
        for rank, r in enumerate(res):
            assert r[name] is not None and needle in r[name], f"{name} rank {rank}: {r[name]}"


def test_without_pipeline_forward_outputs_is_the_forward():
    import lightning_matrixfsdp as mf
    from helpers.pipeline_lightning_scenarios import make_module

    lit = make_module()
    x = torch.randint(0, 48, (2, 8))
    assert torch.equal(mf.forward_outputs(lit, x), lit(x))
    lit.eval()
    with torch.no_grad():
        assert torch.equal(mf.forward_outputs(lit, x), lit(x))
