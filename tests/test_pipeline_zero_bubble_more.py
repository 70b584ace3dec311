"""The split-backward schedules beside the other features (issue 38): tied embeddings with a V layout,
gradient accumulation, MoE without expert parallelism, HSDP with ``replica_split``, and a weight used
twice inside one stage. Each case is checked against the unsplit one-process oracle as
tests/test_pipeline_zero_bubble.py checks its cases (helpers/pipeline_scenarios.py ``run_case``):
losses, every owner's gradient and every weight bitwise in float32 (tied weights: within the tied
bounds of tests/test_pipeline_exact.py, a measured floor), nothing left materialized or unreduced
after a step, and no stage fell back to whole backwards. A weight used twice in one stage (a module
called twice, a parameter shared inside the stage), which torch's weight part cannot split (it fails
mid-schedule on 2.13, and 2.11 would also count a branch twice), makes that stage run whole
backwards: exact, with a warning naming the parameter. The Hugging Face cases skip without
transformers; the rest (the demos' GPT) runs on torch 2.11 as on 2.13:
``python -m pytest -q tests/test_pipeline_zero_bubble_more.py``.
"""
from __future__ import annotations

import warnings

import pytest

from helpers.pipeline_scenarios import run_case

TIED = {"grad_tol": 1e-6, "tol": 2e-3}
LLAMA_TIED = {"model": "hf_llama", "model_kw": {"tied": True}, "pp": 2, **TIED}
V2, V4 = [[0, 3], [1, 2]], [[0, 3], [0, 3], [1, 2], [1, 2]]
# name -> (world, case, the stages of each rank); demo GPT cases on the shared pools, the others on the HF pools
CASES = {
    # a V puts the embedding (stage 0) and the head (stage 3) on one rank: the tied sum is local there
    "zbv-llama-tied-pp2": (2, {**LLAMA_TIED, "schedule": "ZBVZeroBubble"}, V2),
    "dualpipev-llama-tied-pp2": (2, {**LLAMA_TIED, "schedule": "DualPipeV"}, V2),
    "zbv-llama-tied-pp2xdp2": (4, {**LLAMA_TIED, "schedule": "ZBVZeroBubble"}, V4),
    "dualpipev-llama-tied-pp2xdp2": (4, {**LLAMA_TIED, "schedule": "DualPipeV"}, V4),
    # two batches' gradients summed before each optimizer step
    "zb-pp2xdp2-accumulate": (4, {"model": "demo_gpt", "pp": 2, "schedule": "InterleavedZeroBubble",
                                  "accumulate": 2}, [[0, 2], [0, 2], [1, 3], [1, 3]]),
    "zbv-pp2xdp2-accumulate": (4, {"model": "demo_gpt", "pp": 2, "schedule": "ZBVZeroBubble", "accumulate": 2}, V4),
    "dualpipev-pp2xdp2-accumulate": (4, {"model": "demo_gpt", "pp": 2, "schedule": "DualPipeV", "accumulate": 2},
                                     V4),
    # MoE without expert parallelism: each expert stack an ordinary owner-sharded parameter of its stage
    "zbv-qwen3moe-pp2": (2, {"model": "hf_qwen3_moe", "pp": 2, "schedule": "ZBVZeroBubble",
                             "model_kw": {"layers": 4}}, V2),
    "zbv-mixtral-pp2": (2, {"model": "hf_mixtral", "pp": 2, "schedule": "ZBVZeroBubble",
                            "model_kw": {"layers": 4}}, V2),
    # HSDP inside the stages, one replica stepping each matrix and sending it to the other
    "zbv-pp2xhsdp-replica-split": (4, {"model": "demo_gpt", "pp": 2, "schedule": "ZBVZeroBubble", "shard_size": 1,
                                       "shard_options": {"replica_split": True}}, V4),
}


def twice_mlp_gpt(block: int = 2, share: bool = False):
    """The demos' GPT whose block ``block`` applies its norm and MLP twice (``share``: instead, its two
    layer norms share one weight): a weight used twice in that block's stage, one use feeding the other."""
    from helpers.pipeline_scenarios import demo_gpt
    from lightning_matrixfsdp.demos.gpt import Block

    class TwiceMLP(Block):
        def forward(self, x):
            x = x + self.drop(self.attn(self.ln1(x)))
            x = x + self.mlp(self.ln2(x))
            return x + self.mlp(self.ln2(x))

    model = demo_gpt()
    if share:
        model.blocks[block].ln2.weight = model.blocks[block].ln1.weight
    else:
        model.blocks[block].__class__ = TwiceMLP  # deepcopy (the oracle's copy) keeps the class
    return model


def run_watched(rank: int, world: int, case: dict) -> dict:
    """``run_case`` with the test models above registered, and the stages' fallback warnings returned."""
    from helpers import pipeline_scenarios

    pipeline_scenarios.MODELS.setdefault("gpt_twice_mlp", twice_mlp_gpt)
    pipeline_scenarios.MODELS.setdefault("gpt_shared_norm", lambda: twice_mlp_gpt(share=True))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = run_case(rank, world, case)
    out["warned"] = [str(w.message) for w in seen if "used more than once" in str(w.message)]
    return out


@pytest.fixture
def pool(dist_pools, request):
    def get(world: int, model: str):
        if model.startswith("gpt") or model == "demo_gpt":
            return dist_pools(world)
        pytest.importorskip("transformers")
        return request.getfixturevalue("hf_pool" if world == 2 else "hf_pool4")
    return get


def results(pool, world: int, case: dict, fn=run_watched) -> list[dict]:
    res = pool(world, case.get("model", "demo_gpt")).run(fn, case, timeout=300)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return res


def check_exact(name: str, case: dict, res: list[dict]) -> None:
    loss_tol = 1e-5 if "tol" in case else 0.0
    for rank, r in enumerate(res):
        assert all(abs(a - b) <= loss_tol for a, b in zip(r["losses"], r["oracle_losses"])), \
            f"{name} rank {rank}: {r['losses']} vs {r['oracle_losses']}"
        assert not r["differs"], f"{name} rank {rank}: " + "; ".join(r["differs"][:8])
        assert abs(r["eval"] - r["oracle_eval"]) <= loss_tol, f"{name} rank {rank}: {r['eval']} vs {r['oracle_eval']}"
        assert r["routed_is_mine"], f"{name} rank {rank}: the optimizer holds parameters of no stage of this rank"
        assert r["step_collectives"] == 0 and r["step_bytes"] == 0, f"{name} rank {rank}: the step communicated"
        assert r["left"] == [], f"{name} rank {rank}: {r['left']}"
        if "warned" not in case:
            assert r["warned"] == [], f"{name} rank {rank}: a stage fell back to whole backwards: {r['warned']}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_backward_beside_other_features_equals_the_unsplit_model(pool, name):
    world, case, stages = CASES[name]
    res = results(pool, world, case)
    assert [r["stages"] for r in res] == stages, name
    check_exact(name, case, res)


def test_a_tied_gradient_not_summed_in_a_v_is_caught(pool):
    """The V's local sum of the tied weight's two copies skipped: beyond the tied bounds."""
    res = results(pool, 2, {**LLAMA_TIED, "schedule": "ZBVZeroBubble", "break": "tie_unsummed"})
    assert all(r["differs"] for r in res)


# a weight used twice in stage 2 (block 2): rank 1 runs it in a V, rank 0 in loop order
REUSE = {
    "zbv-twice-mlp": (2, {"model": "gpt_twice_mlp", "pp": 2, "schedule": "ZBVZeroBubble"}, 1, "blocks.2.ln2.weight"),
    "dualpipev-twice-mlp": (2, {"model": "gpt_twice_mlp", "pp": 2, "schedule": "DualPipeV"}, 1,
                            "blocks.2.ln2.weight"),
    "zb-shared-norm": (2, {"model": "gpt_shared_norm", "pp": 2, "schedule": "InterleavedZeroBubble"}, 0,
                       "blocks.2.ln1.weight"),
}


@pytest.mark.parametrize("name", sorted(REUSE))
def test_a_weight_used_twice_in_a_stage_runs_that_stage_whole_and_exact(pool, name):
    """torch's weight part of such a weight frees what the other parameters' weight parts need (on
    one rank, mid-schedule): the stage runs whole backwards instead, equal to the oracle, and says so
    on the rank that runs it, naming the parameter."""
    world, case, holder, param = REUSE[name]
    res = results(pool, world, case)
    check_exact(name, {**case, "warned": True}, res)
    for rank, r in enumerate(res):
        if rank == holder:
            assert len(r["warned"]) == 1 and f"stage 2: parameter {param!r}" in r["warned"][0], r["warned"]
        else:
            assert r["warned"] == [], (rank, r["warned"])
