"""Pipeline split points and the refusals that come before any process group (issue 38):
in-process, no communication."""
from __future__ import annotations

import pytest
import torch

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.pipeline import PipelineMesh, build_pipeline, family_of, plan_stages, stage_indices
from lightning_matrixfsdp.runtime.pipeline.families import StageModule

BLOCKS = [(f"model.layers.{i}", 10) for i in range(6)]
MODULES = {"model", "model.layers", "model.norm", "lm_head", *(n for n, _ in BLOCKS)}


def test_balanced_split_minimizes_the_largest_stage():
    plan = plan_stages(BLOCKS, pre=25, post=25, num_stages=3)
    assert [s.blocks for s in plan.stages] == [("model.layers.0",), tuple(f"model.layers.{i}" for i in (1, 2, 3, 4)),
                                               ("model.layers.5",)]
    assert [s.params for s in plan.stages] == [35, 40, 35]
    assert plan.how == "balanced by parameter count"
    assert abs(sum(s.share for s in plan.stages) - 1) < 1e-12
    assert plan.stages[0].first and plan.stages[-1].last and not plan.stages[1].first
    assert "stage 1: model.layers.1 .. model.layers.4 (4 blocks); 40 parameters" in plan.describe()
    # no embeddings or head: equal runs
    assert [len(s.blocks) for s in plan_stages(BLOCKS, 0, 0, 3).stages] == [2, 2, 2]


def test_declared_split():
    plan = plan_stages(BLOCKS, 1, 1, 3, split=["model.layers.1", "model.layers.5"], modules=MODULES)
    assert [len(s.blocks) for s in plan.stages] == [1, 4, 1] and plan.how == "declared"


@pytest.mark.parametrize("split,stages,match", [
    (None, 7, "7 pipeline stages for a model of 6 blocks"),
    (["model.layers.9"], 2, "names no module"),
    (["model.norm"], 2, "is a module but not one of the repeated blocks"),
    (["model.layers.3", "model.layers.2"], 3, "out of order"),
    (["model.layers.2", "model.layers.2"], 3, "out of order or repeated"),
    (["model.layers.0"], 2, "is the first block"),
    (["model.layers.2"], 3, "names 1 split points for 3 stages"),
])
def test_bad_splits_are_refused(split, stages, match):
    with pytest.raises(MatrixShardError, match=match):
        plan_stages(BLOCKS, 1, 1, stages, split=split, modules=MODULES)


def test_stage_indices_per_rank():
    assert stage_indices(1, 4, 1, "loop") == [1]
    assert stage_indices(1, 4, 2, "loop") == [1, 5]
    assert stage_indices(1, 4, 2, "v") == [1, 6]


def gpt(layers: int = 4):
    from lightning_matrixfsdp.demos import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=16, max_seq_len=8, d_model=8, n_layers=layers, n_heads=2, warmup_steps=0)


MESH = PipelineMesh(2, 0, None, None)  # checks run before any process group is used


def loss(o, t):
    return torch.nn.functional.cross_entropy(o.flatten(0, 1), t.flatten())


@pytest.mark.parametrize("kw,match", [
    ({"schedule": "Zigzag"}, "unknown pipeline schedule 'Zigzag'"),
    ({"schedule": "1F1B", "stages_per_rank": 2}, "runs one stage per rank"),
    ({"schedule": "ZBVZeroBubble", "expert_parallel_size": 2}, "splits each backward"),
    ({"schedule": "GPipe", "microbatches": 0}, "at least 1"),
    ({"schedule": "Interleaved1F1B", "stages_per_rank": 3}, "6 pipeline stages for a model of 4 blocks"),
    ({"schedule": "GPipe", "split": ["blocks.7"]}, "names no module"),
])
def test_bad_options_are_refused_before_sharding(kw, match):
    with pytest.raises(MatrixShardError, match=match):
        build_pipeline(gpt(), MESH, loss_fn=loss, **kw)


def test_ties_that_are_not_first_to_last_stage_on_two_ranks_are_refused():
    """A tie between the first and the last stage is handled (test_pipeline_exact.py,
    test_pipeline_ties.py: several stages per rank and HSDP too); with one pipeline rank, or a
    weight a middle stage shares, it is refused."""
    model = gpt()
    model.head.weight = model.tok_emb.weight
    with pytest.raises(MatrixShardError, match=r"tok_emb.weight = head.weight across pipeline stages need "
                                               "pipeline_parallel_size >= 2"):
        build_pipeline(model, PipelineMesh(1, 0, None, None), loss_fn=loss, schedule="Interleaved1F1B")
    model = gpt()
    model.blocks[2].attn.qkv.weight = model.blocks[1].attn.qkv.weight
    with pytest.raises(MatrixShardError, match=r"'blocks.1.attn.qkv.weight' is shared by pipeline stages \[1, 2\]"):
        build_pipeline(model, MESH, loss_fn=loss, schedule="Interleaved1F1B")


def test_unknown_family_is_refused():
    with pytest.raises(MatrixShardError, match="does not know how to split Linear"):
        family_of(torch.nn.Linear(2, 2))


def test_stage_modules_keep_global_names_and_compose_to_the_model():
    """Stage modules hold the model's own modules under their global names, and running them one
    after the other gives the model's logits bitwise."""
    model = gpt()
    fam = family_of(model)
    plan = plan_stages([(b, 1) for b in fam.blocks(model)], 0, 0, 3)
    stages = [StageModule(model, s, fam.keep(model, s), fam) for s in plan.stages]
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert stages[1].get_submodule(plan.stages[1].blocks[0]) is model.get_submodule(plan.stages[1].blocks[0])
    x = torch.randint(0, 16, (2, 8))
    h = x
    for st in stages:
        h = st(h)
    assert torch.equal(h, model(x))
    assert stages[-1].get_output_embeddings() is model.head and stages[0].get_output_embeddings() is None


def hf(kind: str, tied: bool = False):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=8, use_cache=False, tie_word_embeddings=tied)
    if kind == "qwen3":  # layers that name their attention type (Qwen3's layer_types)
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hugging_face_stages_compose_to_the_model(kind):
    """A Hugging Face model's stages, run one after the other, give its logits bitwise: embeddings,
    masks and rotary embeddings rebuilt on each stage as the decoder builds them."""
    model = hf(kind)
    fam = family_of(model)
    plan = plan_stages([(b, 1) for b in fam.blocks(model)], 0, 0, 3)
    stages = [StageModule(model, s, fam.keep(model, s), fam) for s in plan.stages]
    assert sorted(n for st in stages for n, _ in st.named_parameters()) == sorted(n for n, _ in model.named_parameters())
    x = torch.randint(0, 16, (2, 8))
    h = x
    for st in stages:
        h = st(h)
    assert torch.equal(h, model(x).logits)


def test_hugging_face_tied_embeddings_on_one_pipeline_rank_are_refused():
    """Every stage on one rank (pipeline size 1, three stages): no pipeline rank to pair the copies."""
    with pytest.raises(MatrixShardError, match="model.embed_tokens.weight = lm_head.weight.*tie_word_embeddings=False"):
        build_pipeline(hf("llama", tied=True), PipelineMesh(1, 0, None, None), loss_fn=loss,
                       schedule="Interleaved1F1B", stages_per_rank=3)
