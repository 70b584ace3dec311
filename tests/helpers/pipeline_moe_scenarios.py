"""Pipeline x expert parallelism against the plain oracle of ``pipeline_scenarios.py`` (issue 38).

A tiny Mixtral split into stages (``build_pipeline(..., expert_parallel_size=EP)``), each stage
owner-sharded over its data-parallel ranks, which also split the stage's experts (tokens move only
inside the stage). The oracle is ``pipeline_scenarios``' unsplit model on one process (every
data-parallel place's micro-batch alone, the places averaged after each micro-batch) stepped by
``PerExpertMuon`` (each expert a matrix of its own). Each rank compares the dense parameters of its
stages, gathered from their owners, and its own experts (the rows of the oracle's stacks it holds).
"""
from __future__ import annotations

import contextlib
import copy
import traceback

import torch

from helpers.equiv import count_collectives, make_sharded_optimizer
from helpers.oracle import PerExpertMuon
from helpers.pipeline_scenarios import MICRO, MODELS, batch, expert_rows, lm_loss, logits_of, oracle_step


def run_moe_case(rank: int, world: int, case: dict) -> dict:
    """One pipelined expert-parallel run and its oracle; a failure comes back as ``{"error": text}``."""
    try:
        with _world_groups(case.get("break") == "world_groups"):
            return _run(rank, world, case)
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        return {"error": traceback.format_exc()}


def refusal(rank: int, world: int, case: dict) -> dict:
    """The message ``build_pipeline`` refuses ``case``'s options with on this rank (None: accepted)."""
    from lightning_matrixfsdp.runtime import MatrixShardError
    from lightning_matrixfsdp.runtime.pipeline import build_pipeline, pipeline_mesh

    torch.manual_seed(0)
    model = MODELS[case["model"]]()
    try:
        build_pipeline(model, pipeline_mesh(case["pp"]), loss_fn=lm_loss, schedule="1F1B", microbatches=MICRO,
                       **case["options"])
    except MatrixShardError as err:
        return {"refused": str(err)}
    except Exception:  # noqa: BLE001
        return {"refused": None, "error": traceback.format_exc()}
    return {"refused": None}


@contextlib.contextmanager
def _world_groups(on: bool):
    """The deliberate break (``on``): the expert-parallel groups of a record without the pipeline axis
    (the whole world one data-parallel group, as before pipelines), for the stage of every rank; the
    pool's worker gets the real function back afterwards."""
    import dataclasses

    from lightning_matrixfsdp.runtime.mesh.comm import expert_groups
    from lightning_matrixfsdp.runtime.pipeline import comm

    if on:
        comm.expert_groups = lambda dims, *timeout: expert_groups(
            dataclasses.replace(dims, pipeline=1, shard=dims.world, replicate=1), *timeout)
    try:
        yield
    finally:
        comm.expert_groups = expert_groups


def _gathered(stage) -> dict[str, torch.Tensor]:
    """Every dense parameter whole (broadcast from its owner in the stage's shard group); expert slices as held."""
    import torch.distributed as dist

    from lightning_matrixfsdp.runtime.tags import expert_slice_of, is_owned, shard_of, state_of

    sg = state_of(stage).sg
    out = {}
    for name, p in stage.named_parameters():
        if expert_slice_of(p) is not None:
            out[name] = p.detach().clone()
            continue
        shard = shard_of(p)
        t = p.data.clone() if is_owned(p) else torch.empty(shard.shape, dtype=p.dtype)
        if sg.size > 1:
            dist.broadcast(t, src=sg.g(shard.owner), group=sg.group)
        out[name] = t
    return out


def _rows(p: torch.nn.Parameter, oracle_value: torch.Tensor) -> torch.Tensor:
    """The oracle's value of what ``p`` holds: the whole tensor, or this rank's experts of a stack."""
    from lightning_matrixfsdp.runtime.tags import expert_slice_of

    s = expert_slice_of(p)
    return oracle_value if s is None else oracle_value[s.first:s.first + s.count]


def _run(rank: int, world: int, case: dict) -> dict:
    from lightning_matrixfsdp.runtime import get_comm_stats
    from lightning_matrixfsdp.runtime.pipeline import build_pipeline, pipeline_mesh
    from lightning_matrixfsdp.runtime.tags import expert_slice_of, is_owned

    pp, ep, steps = case["pp"], case["ep"], case.get("steps", 2)
    places = world // pp
    torch.manual_seed(0)
    oracle = MODELS[case["model"]](**case.get("model_kw", {}))
    if case.get("dtype", torch.float32) == torch.float64:  # Hugging Face's grouped experts kernel has no float64
        oracle.set_experts_implementation("eager")
        oracle.to(torch.float64)
    if case.get("skew"):  # every router zero: the first step routes every token to the same two experts (a tie)
        for name, p in oracle.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.data.zero_()
    model = copy.deepcopy(oracle)
    routed_to: list[int] = []  # the experts the oracle's first step routed tokens to
    hooks = [m.register_forward_pre_hook(lambda _, args: routed_to.extend(args[1].unique().tolist()))
             for n, m in oracle.named_modules() if n.endswith("mlp.experts")]
    run = build_pipeline(model, pipeline_mesh(pp), loss_fn=lm_loss, schedule=case["schedule"], microbatches=MICRO,
                         expert_parallel_size=ep)
    o_opt = PerExpertMuon(oracle, expert_rows)
    s_opts = make_sharded_optimizer(run.module, "ours")
    experts = {n: expert_slice_of(p) for n, p in run.named_parameters() if expert_slice_of(p) is not None}
    mine = {id(p) for n, p in run.named_parameters() if (n in experts or is_owned(p)) and p.numel()}
    routed = {id(p) for o in s_opts for g in o.param_groups for p in g["params"] if p.numel()}
    place = rank % places
    out: dict = {"losses": [], "oracle_losses": [], "worst": 0.0, "worst_grad": 0.0, "differs": [],
                 "stages": list(run.stage_indices), "routed_is_mine": routed == mine,
                 "experts": {n: [s.first, s.count, s.groups.ep_ranks] for n, s in experts.items()}}
    o_params = dict(oracle.named_parameters())
    tol, grad_tol = case.get("tol", 0.0), case.get("grad_tol", 0.0)
    for step in range(steps):
        x, y = batch(step, place)
        out["losses"].append(run.step(x, y).item())
        out["oracle_losses"].append(oracle_step(oracle, places, step)[place].item())
        if step == 0:
            out["first_step_experts"] = sorted(set(routed_to))
            for h in hooks:
                h.remove()
        for name, p in run.named_parameters():  # gradients where they are stepped, before any step
            if (name in experts or is_owned(p)) and p.grad is not None:
                d = (p.grad - _rows(p, o_params[name].grad)).abs().max().item()
                out["worst_grad"] = max(out["worst_grad"], d)
                if d > grad_tol:
                    out["differs"].append(f"step {step}: grad {name} by {d:.3e}")
        o_opt.step()
        with count_collectives() as counter:
            for o in s_opts:
                o.step()
        out["step_collectives"] = out.get("step_collectives", 0) + counter.calls
        for o in s_opts:
            o.zero_grad(set_to_none=True)
        for stage in run.stages:
            held = dict(stage.named_parameters())
            for name, t in _gathered(stage).items():
                d = (t - _rows(held[name], o_params[name].detach())).abs().max().item()
                out["worst"] = max(out["worst"], d)
                if d > tol:
                    out["differs"].append(f"step {step}: {name} by {d:.3e}")
    out["step_bytes"] = sum(sum(get_comm_stats(s)["optimizer_step"].values()) for s in run.stages)
    x, y = batch(99, place)
    out["eval"] = run.evaluate(x, y).item()
    with torch.no_grad():
        out["oracle_eval"] = torch.stack([lm_loss(logits_of(oracle(a)), b)
                                          for a, b in zip(x.chunk(MICRO), y.chunk(MICRO))]).mean().item()
    return out
