"""Pipeline parallelism off the happy path (issue 38): every bad input ends in a clear message on
every rank, never a hang, never a silent wrong result.

* A rank that dies (``os._exit``) or stalls (alive, silent) inside a step: the other ranks end
  within seconds with an error, because the pipeline mesh's groups, which carry the schedule's
  point-to-point traffic and each stage's gradient reductions, take the given ``timeout`` (the
  strategies pass theirs) instead of torch's default (30 minutes on gloo). The world group keeps
  torch's default here, so only the pipeline groups' timeout can end the stalled wait.
* Batches a schedule cannot split (a dict or tuple, floats, 1-D, a size the micro-batches do not
  divide on one rank, targets of the wrong rows, columns or dtype, a loss that is no scalar, the
  stages of one place given different batches): the same ``MatrixShardError`` on every rank, naming
  the cause, before any schedule runs; the run trains on afterwards.
* A Mixture-of-Experts model whose config asks for the router's auxiliary loss: refused at setup.
"""
from __future__ import annotations

import pytest

from helpers.pipeline_robust_scenarios import SILENT_S, bad_inputs, fault, group_timeouts, launch

TIMEOUT_S = 8.0  # also how long creating a group may take: a loaded 2-core machine needed more than 3 s


def test_a_rank_lost_mid_schedule_ends_the_others_with_an_error(tmp_path):
    """Rank 1 of a PP=2 run stalls in a step, then (a second run) dies in one: rank 0 ends each
    with an error within seconds, not after torch's default timeout."""
    done = tmp_path / "done"
    res = launch(fault, 2, str(done), TIMEOUT_S, timeout=120)
    assert 0 in res and 1 not in res, f"rank 0 must answer, rank 1 die in the second run: {res}"
    assert (tmp_path / "done.left").exists(), "rank 1 never reached its stall"
    for mode in ("stall", "kill"):
        outcome, message, waited = res[0][mode]
        assert outcome == "error", (mode, res[0][mode])
        assert waited < SILENT_S / 2, f"{mode}: rank 0 waited {waited:.1f} s for its lost peer ({message[:200]})"


def test_strategy_timeout_reaches_the_pipeline_groups(dist_pools):
    for rank, timeouts in enumerate(dist_pools(2).run(group_timeouts, 7.0, timeout=120)):
        assert timeouts and set(timeouts.values()) == {7.0}, (rank, timeouts)


def test_pipeline_mesh_refuses_a_bad_timeout_before_any_collective():
    from datetime import timedelta

    from lightning_matrixfsdp.runtime.errors import MatrixShardError
    from lightning_matrixfsdp.runtime.pipeline import pipeline_mesh

    for bad in (30, timedelta(seconds=0), "30s"):
        with pytest.raises(MatrixShardError, match="timeout"):
            pipeline_mesh(2, timeout=bad)


@pytest.fixture(scope="module")
def refused(dist_pools):
    return dist_pools(2).run(bad_inputs, 60.0, timeout=240)


CAUSES = {  # case -> words the message must hold (on every rank)
    "step: dict batch": ["not one tensor", "attention mask", "input_ids", "rank(s) 0, 1"],
    "evaluate: dict batch": ["not one tensor", "rank(s) 0, 1"],
    "step: tuple inputs": ["not one tensor"],
    "step: float inputs": ["integer token ids"],
    "step: 1-D inputs": ["(batch, sequence)"],
    "step: batch not divisible": ["not a multiple of pipeline_microbatches=4", "rank(s) 0, 1"],
    "step: one rank not divisible": ["not a multiple of pipeline_microbatches=4", "rank(s) 1"],
    "step: target rows": ["one row per input row"],
    "step: targets unshifted (one column more)": ["loss function failed", "rank(s) 1"],
    "evaluate: targets unshifted (one column more)": ["loss function failed", "rank(s) 1"],
    "step: targets float": ["loss function failed"],
    "step: stages read different batches": ["different batches", "rank 0", "rank 1", "sample by place"],
    "step: stages read different sizes": ["different batches", "batch 8 x 8", "batch 4 x 8"],
    "loss not scalar": ["no scalar"],
}


@pytest.mark.parametrize("case", sorted(CAUSES))
def test_a_batch_that_cannot_be_pipelined_is_refused_on_every_rank(refused, case):
    messages = [r[case] for r in refused]
    for rank, message in enumerate(messages):
        for words in CAUSES[case]:
            assert words in message, f"rank {rank}, {case}: {message!r} lacks {words!r}"
    assert messages[0].split(" (here:")[0] == messages[1].split(" (here:")[0], messages


def test_the_run_trains_on_after_the_refusals(refused):
    losses = [r["good step after"] for r in refused]
    assert losses[0] == losses[1] and losses[0] > 0, losses


@pytest.mark.parametrize("make", ["hf_mixtral", "hf_qwen3_moe"])
def test_router_aux_loss_is_refused_not_dropped(make):
    """The load-balancing loss needs every layer's router logits on the last stage: refused in the
    family check (setup, every rank alike: the same config), naming the field and what to change.
    Without it the same model is accepted (the refusal is this field's)."""
    from helpers import pipeline_scenarios
    from lightning_matrixfsdp.runtime.errors import MatrixShardError
    from lightning_matrixfsdp.runtime.pipeline import family_of

    model = getattr(pipeline_scenarios, make)()
    assert family_of(model).name == "Hugging Face causal LM"
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.02
    with pytest.raises(MatrixShardError, match=r"output_router_logits=True.*router_aux_loss_coef=0\.02") as err:
        family_of(model)
    assert "output_router_logits=False" in str(err.value) and "pipeline_parallel_size=1" in str(err.value)


def test_demos_hf_module_with_router_aux_loss_is_refused_at_setup():
    """The Lightning path: the strategy's setup finds the pipelined model (``find_pipelined``) and the
    family refuses it before anything is split."""
    from lightning_matrixfsdp.adapters.pipeline import find_pipelined
    from lightning_matrixfsdp.demos.hf import HFCausalLM
    from lightning_matrixfsdp.runtime.errors import MatrixShardError

    tiny = dict(hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16)
    assert find_pipelined(HFCausalLM("mixtral", config=tiny))[0] == "model"
    module = HFCausalLM("mixtral", config=dict(tiny, output_router_logits=True, router_aux_loss_coef=0.02))
    with pytest.raises(MatrixShardError, match="output_router_logits=True"):
        find_pipelined(module)


def test_uneven_batch_counts_across_places_are_refused_on_every_rank(dist_pools):
    """PP=2 x DP=2, place 1 with one training batch fewer (use_distributed_sampler=False): every
    rank raises UnevenInputsError at the first step where the places' counts differ (the join's
    training check, over the world), naming each rank's state; no rank trains on."""
    from helpers.pipeline_robust_scenarios import uneven_places

    res = dist_pools(4).run(uneven_places, timeout=240)
    for rank, r in enumerate(res):
        kind, message = r["outcome"]
        assert kind == "UnevenInputsError", (rank, r)
        assert "different numbers of training batches" in message and "rank 1: its last batch" in message, message
        assert r["steps"] == 1, (rank, r)  # the second step is refused before its schedule runs


def test_forward_loss_refuses_a_bad_batch_on_every_rank_through_the_trainer(dist_pools):
    """The Lightning contract's path: the refusal is raised inside ``training_step`` on every rank,
    so ``fit`` ends alike everywhere (the pool checks that every rank left at the same point)."""
    from helpers.pipeline_robust_scenarios import trainer_bad_batches

    for rank, r in enumerate(dist_pools(2).run(trainer_bad_batches, timeout=240)):
        assert "not a multiple of pipeline_microbatches=4" in r["six rows"], (rank, r["six rows"])
        assert "not one tensor" in r["dict inputs"] and "input_ids" in r["dict inputs"], (rank, r["dict inputs"])
