"""Which update each parameter gets: ``param_groups(model)`` / ``Muon(model)`` (the Muon recipe),
bare parameters (by shape), bad groups refused, and the one routing line each optimizer logs.
In one process; the strategies' side by side is ``test_same_math.py``."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.runtime.experts.stacks import ExpertStack
from lightning_matrixfsdp.runtime.tags import stack_of


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.emb(idx))))


def _step(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """One step on fixed gradients; the change of every parameter."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def test_the_recipe_groups_of_a_plain_model():
    model = TinyLM()
    groups = mf.param_groups(model, matrix={"weight_decay": 0.0}, adamw={"lr": 1e-3})
    names = {id(p): n for n, p in model.named_parameters()}
    assert [g["role"] for g in groups] == ["matrix", "adamw"]
    assert [names[id(p)] for p in groups[0]["params"]] == ["block.weight"]
    assert {names[id(p)] for p in groups[1]["params"]} == {"emb.weight", "block.bias", "norm.weight", "norm.bias",
                                                            "head.weight"}
    assert groups[0]["weight_decay"] == 0.0 and groups[1]["lr"] == 1e-3
    with pytest.raises(TypeError, match="expects an nn.Module"):
        mf.param_groups(list(model.parameters()))


def test_module_and_bare_parameters_step_as_torch_muon_and_adamw_say():
    """From the module: the embedding and head by AdamW's first step (lr * sign(g) at eps=0),
    the hidden matrix by Muon; bare: every 2-D tensor by Muon, as torch.optim.Muon would."""
    torch.manual_seed(0)
    model, bare = TinyLM(), TinyLM()
    bare.load_state_dict(model.state_dict())
    lr, adamw_lr = 0.02, 1e-3
    kw = dict(lr=lr, adamw_lr=adamw_lr, weight_decay=0.0, adamw_eps=0.0)
    moved = _step(mf.Muon(model, **kw), model)
    g = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    for n in ("emb.weight", "head.weight", "norm.weight"):  # AdamW's first step: -lr * sign(grad)
        torch.testing.assert_close(moved[n], -adamw_lr * grads[n].sign())
    ref = nn.Parameter(bare.block.weight.detach().clone())
    ref.grad = grads["block.weight"].clone()
    torch.optim.Muon([ref], lr=lr, weight_decay=0.0).step()
    assert torch.equal(model.block.weight.detach(), ref.detach())
    emb = nn.Parameter(bare.emb.weight.detach().clone())
    _step(mf.Muon(bare.parameters(), **kw), bare)
    emb.grad = grads["emb.weight"].clone()
    torch.optim.Muon([emb], lr=lr, weight_decay=0.0).step()
    assert torch.equal(bare.emb.weight.detach(), emb.detach())  # bare: the embedding on Muon


def test_bad_groups_are_refused_naming_the_cause():
    model = TinyLM()
    with pytest.raises(ValueError, match="role must be one of"):
        mf.Muon([{"params": list(model.parameters()), "role": "muon"}])
    opt = mf.Muon([{"params": [model.norm.weight], "role": "matrix"}])
    model.norm.weight.grad = torch.ones(8)
    with pytest.raises(ValueError, match="updates 2D matrices only"):
        opt.step()


def test_stacks_of_a_plain_model_are_tagged_and_stepped_per_expert_only_from_the_module():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=16, hidden_size=8, intermediate_size=6, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=3)
    model = transformers.MixtralForCausalLM(cfg)
    experts = model.model.layers[0].mlp.experts
    assert stack_of(experts.gate_up_proj) is None
    groups = mf.param_groups(model)
    matrix = {id(p) for p in groups[0]["params"]}
    assert id(experts.gate_up_proj) in matrix and id(experts.down_proj) in matrix
    assert stack_of(experts.gate_up_proj) == ExpertStack(3, (6, 6))
    assert id(model.lm_head.weight) not in matrix and id(model.model.embed_tokens.weight) not in matrix


def test_each_optimizer_logs_one_line_saying_which_tensors_go_where(caplog):
    model = TinyLM()
    with caplog.at_level(logging.INFO, logger="lightning_matrixfsdp.roles"):
        logger = logging.getLogger("lightning_matrixfsdp.roles")
        logger.addHandler(caplog.handler)  # the package's own handler does not propagate
        try:
            mf.Muon(model, lr=0.02)
            mf.Muon(model.parameters(), lr=0.02)
        finally:
            logger.removeHandler(caplog.handler)
    recipe, bare = [r.getMessage() for r in caplog.records if r.name == "lightning_matrixfsdp.roles"]
    assert recipe.startswith("Muon (with its AdamW tail): 1 tensors on the matrix optimizer, 5 on AdamW")
    assert "emb.weight" in recipe and "head.weight" in recipe and "Muon recipe" in recipe
    assert bare.startswith("Muon (with its AdamW tail): 3 tensors on the matrix optimizer, 3 on AdamW")
    assert "embeddings and output head included" in bare and "Muon(model)" in bare
