"""Pipeline parallelism against a plainly written oracle (issue 38), run inside the gloo pools.

The oracle is the unsplit model on one process: for each micro-batch it runs every
data-parallel place's slice alone (``loss / M`` backward, as the pipeline's loss function
scales it), averages the places' gradients (summed in place order, divided by their number:
the reduction the runtime does after each micro-batch's backward) and adds the average to the
step's gradient, micro-batch after micro-batch (the order the schedule's backwards run in, per
stage). Then ``torch.optim.Muon`` on the recipe's matrices and ``torch.optim.AdamW`` on the rest
(tests/helpers/oracle.py). Every rank computes the oracle whole and compares the parameters of
the stages it runs, gathered from their owners, bitwise (float32): with at most two
data-parallel places the two-term sums round alike in any order, and M = 4 makes the 1/M
scaling exact, so nothing but a wrong computation can differ.
"""
from __future__ import annotations

import copy
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from helpers.equiv import count_collectives, full_params, make_sharded_optimizer
from helpers.oracle import PerExpertMuon, oracle_optimizers

VOCAB, SEQ, BATCH, MICRO = 48, 8, 8, 4


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def demo_gpt(layers: int = 4) -> nn.Module:
    from lightning_matrixfsdp.demos import GPT

    return GPT(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=layers, n_heads=2, warmup_steps=0)


def hf_llama(layers: int = 4, tied: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                        tie_word_embeddings=tied, max_position_embeddings=SEQ, use_cache=False))


def hf_qwen3_moe(layers: int = 2) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=False))


def hf_mixtral(layers: int = 2) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
        use_cache=False, tie_word_embeddings=False))


def litgpt_gpt(layers: int = 4) -> nn.Module:
    from litgpt import GPT, Config

    return GPT(Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=layers, n_head=2, n_embd=16,
                      bias=False, rotary_percentage=1.0, parallel_residual=False))


MODELS: dict[str, Callable[..., nn.Module]] = {"demo_gpt": demo_gpt, "hf_llama": hf_llama,
                                               "hf_qwen3_moe": hf_qwen3_moe, "hf_mixtral": hf_mixtral,
                                               "litgpt": litgpt_gpt}
#: the MoE models: the oracle steps each expert of a stack as its own matrix
MOE = ("hf_qwen3_moe", "hf_mixtral")


def logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def batch(step: int, place: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + place)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def oracle_step(model: nn.Module, places: int, step: int, accumulation: int = 1) -> list[torch.Tensor]:
    """One batch's gradients on the unsplit ``model``, added to its ``.grad`` (each micro-batch's loss
    divided by ``MICRO * accumulation``); returns each place's mean loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    losses = [[] for _ in range(places)]
    for m in range(MICRO):
        per_place = []
        for place in range(places):
            x, y = (t.chunk(MICRO)[m] for t in batch(step, place))
            for p in params:
                p.grad = None
            loss = lm_loss(logits_of(model(x)), y)
            (loss / (MICRO * accumulation)).backward()
            losses[place].append(loss.detach())
            per_place.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params])
        for i in range(len(params)):
            reduced = per_place[0][i].clone()
            for g in per_place[1:]:
                reduced = reduced + g[i]
            total[i] = total[i] + reduced / places
    for p, g in zip(params, total):
        p.grad = g
    return [torch.stack(l).mean() for l in losses]


def expert_rows(name: str, p: nn.Parameter):
    """The oracle's cut of an expert stack: each expert a matrix, gate and up of ``gate_up_proj`` apart."""
    if name.endswith("experts.gate_up_proj"):
        return p.shape[1] // 2
    return p.shape[1] if name.endswith("experts.down_proj") else None


#: matrix optimizers beside Muon: ours (class, kwargs) and, written out independently, the
#: pytorch-optimizer class and kwargs it wraps, with torch's AdamW on the recipe's tail
LIBRARY = {
    "soap": ("SOAP", dict(lr=0.01, precondition_frequency=2),
             "SOAP", dict(lr=0.01, precondition_frequency=2), dict(lr=0.01, weight_decay=0.01)),
    "shampoo": ("Shampoo", dict(lr=0.01, start_preconditioning_step=1, preconditioning_compute_steps=1, block_size=8,
                                graft_type="rmsprop", use_svd=True),
                "ScalableShampoo", dict(lr=0.01, start_preconditioning_step=1, preconditioning_compute_steps=1,
                                        block_size=8, graft_type=3, use_svd=True, shape_interpretation=False),
                dict(lr=0.01, weight_decay=0.0)),
}


def library_optimizers(oracle: nn.Module, stepped: nn.Module, name: str) -> tuple[list, list]:
    """(the oracle's optimizers, ours): the library per recipe matrix of the whole model and AdamW
    on the rest, against our wrapper built from this rank's stages (the recipe applied per stage)."""
    import pytorch_optimizer

    import lightning_matrixfsdp as mf
    from helpers.oracle import recipe_matrix

    ours, kw, lib, lib_kw, adamw_kw = LIBRARY[name]
    is_matrix = recipe_matrix(oracle)
    named = list(oracle.named_parameters())
    mats = [p for n, p in named if is_matrix(n, p)]
    rest = [p for n, p in named if not is_matrix(n, p)]
    o_opts = [getattr(pytorch_optimizer, lib)(mats, **lib_kw), torch.optim.AdamW(rest, foreach=False, **adamw_kw)]
    return o_opts, [mf.route_optimizer(getattr(mf, ours)(stepped, **kw))]


def recompute_blocks(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every block of the demos' GPT, written plainly."""
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(block.forward)


def leftovers(run: Any) -> list[str]:
    """What a step left on this rank's stages: units still materialized, unsharded (full) gradients
    not reduced to their owners."""
    from lightning_matrixfsdp.runtime.tags import state_of

    left = []
    for stage in run.stages:
        for unit in state_of(stage).units:
            left += [f"unit {unit.fqn!r} materialized"] if unit.is_materialized else []
            left += [f"full gradient of {p.shard.fqn!r}" for p in unit.params if p.unsharded.grad is not None]
    return left


def run_case(rank: int, world: int, case: dict) -> dict:
    """One pipelined training run and its oracle; a failure comes back as ``{"error": text}``."""
    try:
        return _run_case(rank, world, case)
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        return {"error": traceback.format_exc()}


def _run_case(rank: int, world: int, case: dict) -> dict:
    from lightning_matrixfsdp.runtime import MatrixShardError, get_comm_stats, sync_replicas
    from lightning_matrixfsdp.runtime.pipeline import build_pipeline, pipeline_mesh

    pp, steps = case["pp"], case.get("steps", 2)
    places = world // pp
    torch.manual_seed(0)
    oracle = MODELS[case["model"]](**case.get("model_kw", {}))
    model = copy.deepcopy(oracle)
    if case.get("checkpoint"):  # each block's forward recomputed in backward (non-reentrant checkpointing)
        recompute_blocks(model)
    mesh = pipeline_mesh(pp, case.get("shard_size"))
    run = build_pipeline(model, mesh, loss_fn=lm_loss, schedule=case["schedule"], microbatches=MICRO,
                         split=case.get("split"), stages_per_rank=case.get("stages_per_rank"),
                         **case.get("shard_options", {}))  # e.g. replica_split under HSDP
    if case.get("break") == "unscaled" and run.holds_last:
        run.loss_divisor = 1  # the last stage skips the 1/M scaling of its micro-batches' losses
    stepped = model if case.get("break") == "foreign" else run.module  # "foreign": the whole model's parameters
    if "optimizer" in case:  # Shampoo / SOAP: the library on the recipe's matrices, built per stage from the module
        o_opts, s_opts = library_optimizers(oracle, stepped, case["optimizer"])
    else:
        o_opts = oracle_optimizers(oracle) if case["model"] not in MOE else [PerExpertMuon(oracle, expert_rows)]
        s_opts = make_sharded_optimizer(stepped, "ours")
    mine = {id(p) for p in run.parameters() if p._mfsdp_owned and p.numel()}
    routed = {id(p) for o in s_opts for g in o.param_groups for p in g["params"] if p.numel()}
    place = rank % places
    out: dict = {"losses": [], "oracle_losses": [], "worst": 0.0, "differs": [], "stages": list(run.stage_indices),
                 "routed_is_mine": routed == mine, "plan": run.plan.describe()}
    o_params = dict(oracle.named_parameters(remove_duplicate=False))  # a tied weight under both names
    tol, grad_tol = case.get("tol", 0.0), case.get("grad_tol", 0.0)
    acc = case.get("accumulate", 1)
    for step in range(steps):
        for k in range(acc):  # accumulate_grad_batches: a window of batches, one optimizer step
            x, y = batch(step * acc + k, place)
            loss = run.step(x, y, accumulation=acc)
            out.setdefault("left", []).extend(leftovers(run))
            o_losses = oracle_step(oracle, places, step * acc + k, acc)
            out["losses"].append(loss.item())
            out["oracle_losses"].append(o_losses[place].item())
        if case.get("break") != "tie_unsummed":
            run.reduce_tied_grads()  # tied weights: both copies' gradients summed on the embedding's owner
        for name, p in run.named_parameters():  # gradients on the owners, before any step
            # an owner has the gradient (under HSDP's replica_split only on the replica that steps it)
            if p._mfsdp_owned and p.grad is not None:
                d = (p.grad - o_params[name].grad).abs().max().item()
                out["worst_grad"] = max(out.get("worst_grad", 0.0), d)
                if d > grad_tol:
                    out["differs"].append(f"step {step}: grad {name} by {d:.3e}")
        for o in o_opts:
            o.step()
            if hasattr(o, "zero_grad"):
                o.zero_grad(set_to_none=True)
        with count_collectives() as counter:
            for o in s_opts:
                o.step()
        out.setdefault("step_collectives", 0)
        out["step_collectives"] += counter.calls
        for o in s_opts:
            o.zero_grad(set_to_none=True)
        run.sync_tied_weights()  # the stepped tied weight to the last stage's copy
        for stage in run.stages:
            sync_replicas(stage)  # replica_split: the stepping replica's weights reach the others
            for name, t in full_params(stage).items():
                d = (t - o_params[name].detach()).abs().max().item()
                out["worst"] = max(out["worst"], d)
                if d > tol:
                    out["differs"].append(f"step {step}: {name} by {d:.3e}")
    out["step_bytes"] = sum(sum(get_comm_stats(s)["optimizer_step"].values()) for s in run.stages)
    x, y = batch(99, place)
    try:  # 6 rows for 4 micro-batches: refused on every rank, before any communication
        run.step(x[:6], y[:6])
        out["uneven"] = None
    except MatrixShardError as err:
        out["uneven"] = str(err)
    out["eval"] = run.evaluate(x, y).item()
    with torch.no_grad():
        out["oracle_eval"] = torch.stack([lm_loss(logits_of(oracle(a)), b)
                                          for a, b in zip(x.chunk(MICRO), y.chunk(MICRO))]).mean().item()
    return out
