"""Checkpoints under pipeline parallelism (issue 38 item 5), run inside the gloo pools.

A run at PP=2 x DP=2 (demo GPT, 1F1B over 4 micro-batches, the Muon recipe: Muon on the matrices,
AdamW on the rest) trains 2 steps and saves; each rank returns the whole weights and optimizer
state of its stages' parameters, gathered from their owners by name (the test's oracle). It then
trains one step more and returns those weights; a fresh PP=2 x DP=2 run that loads the checkpoint
and trains the same step must give them bitwise. Loads at other layouts (PP=1 x DP=4: plain
``matrix_shard`` over the world; PP=4) return what their owners hold after the load, by name,
which the test compares with the saving run's. Refusals come back as the error each rank raised.
"""
from __future__ import annotations

import functools
import traceback
from typing import Any

import torch

from helpers.equiv import full_params, make_sharded_optimizer
from helpers.pipeline_scenarios import MICRO, batch, demo_gpt, lm_loss


def _build(pp: int, seed: int = 0):
    from lightning_matrixfsdp.runtime.pipeline import build_pipeline, pipeline_mesh

    torch.manual_seed(seed)
    model = demo_gpt()
    run = build_pipeline(model, pipeline_mesh(pp), loss_fn=lm_loss, schedule="1F1B", microbatches=MICRO)
    return model, run, make_sharded_optimizer(run.module, "ours")


def _train(run, opts, steps, place: int) -> None:
    for step in steps:
        x, y = batch(step, place)
        run.step(x, y)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)


def _owned_state(modules, opts) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state of the parameters this rank owns, by name (whole: the owner's)."""
    names = {id(p): n for m in modules for n, p in m.named_parameters()}
    out = {}
    for o in opts:
        inner = getattr(o, "optimizer", o)
        for opt in getattr(inner, "optimizers", [inner]):
            for p, s in opt.state.items():
                if id(p) in names and p._mfsdp_owned and p.numel():
                    out[names[id(p)]] = {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
    return out


def _weights(modules) -> dict[str, torch.Tensor]:
    out = {}
    for m in modules:
        out.update({k: v.clone() for k, v in full_params(m).items()})
    return out


def _guard(fn):
    @functools.wraps(fn)
    def run(rank: int, world: int, case: dict) -> Any:
        try:
            return fn(rank, world, case)
        except Exception as e:  # noqa: BLE001 - the test reads every rank's failure
            return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    return run


@_guard
def save_and_resume(rank: int, world: int, case: dict) -> dict:
    """Train 2 steps at PP=2, save (directory, file, async directory), train 1 more; then a fresh
    run loads the directory and trains the same step."""
    from lightning_matrixfsdp.checkpoint import save_sharded, load_sharded
    from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer

    pp = 2
    place = rank % (world // pp)
    model, run, opts = _build(pp)
    _train(run, opts, [0, 1], place)
    out: dict = {"weights": _weights(run.stages), "state": _owned_state(run.stages, opts)}
    save_sharded(model, case["dir"], opts)
    save_sharded(model, case["file"], opts, full=True)
    saver = AsyncCheckpointer()
    saver.save_sharded(model, case["async"], opts)
    saver.wait()
    _train(run, opts, [2], place)
    out["after"] = _weights(run.stages)
    model2, run2, opts2 = _build(pp, seed=1)  # other initial weights: the load must write every tensor
    load_sharded(model2, case["dir"], opts2)
    out["loaded"] = _weights(run2.stages)
    out["loaded_state"] = _owned_state(run2.stages, opts2)
    _train(run2, opts2, [2], place)
    out["resumed"] = _weights(run2.stages)
    return out


@_guard
def load_at(rank: int, world: int, case: dict) -> dict:
    """Load ``case["dir"]`` at PP=``case["pp"]`` (1: plain matrix_shard over the world)."""
    from lightning_matrixfsdp.checkpoint import load_sharded
    from lightning_matrixfsdp.runtime import matrix_shard

    pp = case["pp"]
    if pp == 1:
        torch.manual_seed(1)
        model = matrix_shard(demo_gpt())
        opts = make_sharded_optimizer(model, "ours")
        modules = [model]
    else:
        model, run, opts = _build(pp, seed=1)
        modules = run.stages
    if case.get("rogue") is not None and rank in case["rogue"]:
        model.register_buffer("rogue", torch.zeros(1))  # this stage's model has a key the others lack
    load_sharded(model, case["dir"], opts if case.get("optimizers", True) else [])
    return {"weights": _weights(modules), "state": _owned_state(modules, opts)}


@_guard
def save_rogue(rank: int, world: int, case: dict) -> dict:
    """The stages disagree on the model's keys: stage 1's model has a buffer stage 0's lacks."""
    from lightning_matrixfsdp.checkpoint import save_sharded

    model, run, opts = _build(2)
    if run.stage_indices[0] == 1:
        model.register_buffer("rogue", torch.zeros(1))
    save_sharded(model, case["dir"], opts)
    return {}


@_guard
def pretrained_into_stages(rank: int, world: int, case: dict) -> dict:
    """``load_pretrained`` of a safetensors file into PP=``case["pp"]`` stages: each stage reads its own
    layers (the bytes read are counted per rank)."""
    from lightning_matrixfsdp.checkpoint import load_pretrained

    model, run, _ = _build(case["pp"], seed=1)
    got = load_pretrained(model, case["file"])
    names = {n for stage in run.stages for n, _ in [*stage.named_parameters(), *stage.named_buffers()]}
    return {"weights": _weights(run.stages), "foreign": sorted(set(got.read) - names), "read": len(got.read)}
