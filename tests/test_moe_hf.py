"""Tiny Hugging Face MoE models (Mixtral, Qwen3-MoE), unmodified, on 2 and 4 processes: bitwise
equal to DDP with a per-expert Muon written plainly here (on 4 processes the planner splits every
stack into blocks of one expert per owner: docs/moe.md, split expert stacks).

The models store each layer's experts as 3-D stacks (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``), declared automatically. The oracle holds the same model on every
rank, averages the gradients in rank order (tests/oracle.py), and steps ``torch.optim.Muon`` on
one separate 2-D tensor per expert, gate and up apart, copied out of the stacks and back;
AdamW on the rest (embeddings and head by the recipe default). Built from configs, no download.
"""
from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from helpers.dist import PoolTask

pytest.importorskip("transformers")

VOCAB = 64  # what tests/models.batch_for produces
STEPS = 3


def build(name: str) -> nn.Module:
    """A tiny model, float32; 4 experts, top-2, 2 layers."""
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, num_experts_per_tok=2)
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(intermediate_size=12, num_local_experts=4, **common))
    if name == "qwen3_moe":
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=12, num_experts=4,
                                                      head_dim=8, **common))
    raise ValueError(name)


def per_expert_muon(model: nn.Module):
    """DDP's optimizer, plainly: torch.optim.Muon on a separate 2-D tensor per expert (gate and up
    of a fused ``gate_up_proj`` apart), on the other matrices as they are, AdamW on the rest."""
    from helpers.oracle import PerExpertMuon

    def rows(name: str, p: nn.Parameter):
        if name.endswith("experts.gate_up_proj"):
            return p.shape[1] // 2
        return p.shape[1] if name.endswith("experts.down_proj") else None

    return PerExpertMuon(model, rows)


def _scenario(rank: int, name: str) -> dict[str, Any]:
    import lightning_matrixfsdp as mf
    from helpers.equiv import EXACT, assert_owned_grads_equal, close, compare, full_params, make_sharded_optimizer
    from helpers.models import batch_for, lm_loss
    from helpers.oracle import allreduce_mean_grads

    torch.manual_seed(0)
    sharded = build(name)
    oracle = copy.deepcopy(sharded)
    mf.matrix_shard(sharded)
    plan = mf.get_plan(sharded)
    stacks = {s.fqn: s.stack for s in plan.shards() if s.stack is not None}
    opts = make_sharded_optimizer(sharded, "ours")
    ref = per_expert_muon(oracle)
    for step in range(STEPS):
        idx = batch_for(step, rank)
        lo = lm_loss(oracle(idx).logits, idx)
        ls = lm_loss(sharded(idx).logits, idx)
        assert close(lo.detach(), ls.detach(), EXACT), f"{name} step {step}: loss {ls.item()} vs {lo.item()}"
        lo.backward()
        ls.backward()
        allreduce_mean_grads(oracle)
        assert_owned_grads_equal(sharded, oracle, EXACT, f"{name} step {step}")  # split stacks at 4 processes
        ref.step()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        compare(full_params(sharded), dict(oracle.named_parameters()), EXACT, f"{name} param", step)
    return {"stacks": {k: (v.num_experts, v.blocks) for k, v in stacks.items()}, "plan": str(plan),
            "split": sorted(plan.split_stacks)}


def _checkpoint_scenario(rank: int, root: str, kind: str) -> dict[str, Any]:
    """Stacks in checkpoints, without expert parallelism: a run saved after 2 steps (directory and
    consolidated file), loaded into a fresh sharded model and optimizer, takes its third step
    exactly as the uninterrupted run does (weights, and the optimizer state of each stack)."""
    import lightning_matrixfsdp as mf
    from helpers.equiv import EXACT, compare, full_params
    from helpers.models import batch_for, lm_loss

    def fresh():
        torch.manual_seed(0)
        model = build("mixtral")
        mf.matrix_shard(model)
        if kind == "muon":
            opt = mf.Muon(model, lr=0.02)
        else:
            opt = mf.SOAP(model, lr=0.01, precondition_frequency=1)
        return model, mf.route_optimizer(opt)

    def step(model, opt, i):
        idx = batch_for(i, rank)
        lm_loss(model(idx).logits, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model, opt = fresh()
    for i in range(2):
        step(model, opt, i)
    mf.save_sharded(model, f"{root}/{kind}_dir", [opt])
    mf.save_sharded(model, f"{root}/{kind}_file.ckpt", [opt], full=True)
    step(model, opt, 2)
    want = full_params(model)
    for source in (f"{root}/{kind}_dir", f"{root}/{kind}_file.ckpt"):
        other, other_opt = fresh()
        mf.load_sharded(other, source, [other_opt])
        step(other, other_opt, 2)
        compare(full_params(other), want, EXACT, f"resumed from {source}", 2)
    owned = [p for p in model.parameters() if p.numel() and p.ndim == 3]
    shapes = {k: tuple(v.shape) for p in owned for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    return {"state_shapes": shapes}


def worker(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {name: _scenario(rank, name) for name in ("mixtral", "qwen3_moe")}
    if world == 2:
        out["checkpoint"] = {kind: _checkpoint_scenario(rank, root, kind) for kind in ("muon", "soap")}
    return out


# one task per world size on the Hugging Face pools of tests/conftest.py (transformers imported once per
# worker): hf_pool (2 processes, shared with test_hf and others), hf_pool4 (shared with test_moe_ep)
TASKS = {w: PoolTask(worker, tempfile.mkdtemp(prefix=f"moe_hf_{w}_"), timeout=900) for w in (2, 4)}


@pytest.fixture(scope="module")
def pools(hf_pool, hf_pool4):
    return {2: hf_pool, 4: hf_pool4}


def _results(world: int, pools) -> list[dict[str, Any]]:
    return TASKS[world].results(pools[world])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_hf_moe_equals_ddp_with_per_expert_muon(name: str, world: int, pools) -> None:
    res = _results(world, pools)[0][name]
    inter = 12
    gate_up = {k: v for k, v in res["stacks"].items() if k.endswith("gate_up_proj")}
    down = {k: v for k, v in res["stacks"].items() if k.endswith("down_proj")}
    assert len(gate_up) == len(down) == 2, res["stacks"]  # both layers, declared automatically
    assert all(v == (4, (inter, inter)) for v in gate_up.values()), gate_up
    assert all(v == (4, (16,)) for v in down.values()), down
    assert len(res["split"]) == (4 if world == 4 else 0), res["split"]  # 4 processes: blocks of experts (split stacks)
    plan = res["plan"]
    assert "experts.gate_up_proj (x2): stack, expert stack, 4 experts, each as 2 blocks (12, 12)" in plan, plan
    # placed whole on an owner (a matrix role); Muon(model) trains them with AdamW, bare parameters with Muon
    assert "lm_head.weight: matrix, 2-D | Muon(model): adamw, Muon recipe: output head" in plan, plan
    assert "embed_tokens.weight: matrix, 2-D | Muon(model): adamw, Muon recipe: nn.Embedding weight" in plan, plan
    assert "| bare: muon" in plan.split("embed_tokens.weight", 1)[1].splitlines()[0], plan


def test_stacks_resume_from_checkpoints_without_expert_parallelism(hf_pool) -> None:
    res = TASKS[2].results(hf_pool)
    for kind in ("muon", "soap"):
        assert all(kind in r["checkpoint"] for r in res)
    shapes = {k: v for r in res for k, v in r["checkpoint"]["soap"]["state_shapes"].items()}
    assert any(k.startswith("block1/") and v[0] == 4 for k, v in shapes.items()), shapes  # per expert state
