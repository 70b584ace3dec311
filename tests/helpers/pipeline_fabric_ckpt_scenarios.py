"""``fabric.save`` / ``fabric.load`` under pipeline parallelism (issue 38, item 5 through Fabric).

A plain Fabric loop (``forward_loss``, ``fabric.backward``, ``optimizer.step()``, a StepLR) over the
demos' GPT with the Muon recipe, each data-parallel place on its own batches. The oracles:

* the run that never stopped: 4 steps in one go, against 2 steps, ``fabric.save`` (model,
  optimizer, scheduler and a plain value), a fresh run that ``fabric.load``s the directory and
  trains the last 2 steps: losses, weights and optimizer state equal, bitwise;
* the unsplit model on one process (``oracle_fit``, the pipeline tests' plain oracle): the
  uninterrupted run's losses and weights, bitwise: ``model.state_dict()`` right after the loop
  (under PP x HSDP the replica that did not step a matrix must give its current value: the read
  waits for the transfer), and the tensors themselves after ``sync_replicas(model)``;
* the saving run's own weights: the directory loaded at ``pipeline_parallel_size=1`` (owner
  sharding over the world) holds every weight, by name, bitwise.

Every rank returns what it holds by global name; the test merges and compares across ranks
(each stage's replicas, under HSDP, must agree).
"""
from __future__ import annotations

import copy
import os
import traceback
from typing import Any

import torch

from helpers.pipeline_lightning_scenarios import ADAMW, BATCH, data, make_module, oracle_fit, place_batches


def _fabric(world: int, pp: int, options: dict) -> Any:
    from lightning.fabric import Fabric

    import lightning_matrixfsdp as mf

    strategy = mf.MatrixFSDPFabricStrategy(pipeline_parallel_size=pp, pipeline_schedule="1F1B",
                                           pipeline_microbatches=4, log_plan=False, **options)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric


def _setup(fabric: Any) -> tuple[Any, ...]:
    import lightning_matrixfsdp as mf

    lit = make_module()
    oracle = copy.deepcopy(lit)
    model = fabric.setup_module(lit)
    opt = fabric.setup_optimizers(mf.Muon(model, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, **ADAMW))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    return lit, oracle, model, opt, sched


def _train(fabric: Any, model: Any, opt: Any, sched: Any, batches: list) -> list[float]:
    import lightning_matrixfsdp as mf

    losses = []
    for x, y in batches:
        loss = mf.forward_loss(model, x, y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def _held(lit: Any, opt: Any) -> dict[str, Any]:
    """The weights and per-parameter optimizer state this rank holds, by global name; read from the
    tensors themselves after ``sync_replicas`` (under HSDP the stepped weights reach the other
    replica at the next use, a state read or that call)."""
    from lightning_matrixfsdp.optim.routing import held
    from lightning_matrixfsdp.runtime import sync_replicas

    sync_replicas(lit)

    names = {id(p): n for n, p in lit.named_parameters()}
    inner = getattr(opt, "optimizer", opt)
    state = {}
    for o in getattr(inner, "optimizers", [inner]):
        for p, s in o.state.items():
            if id(p) in names and held(p):
                state.update({f"{names[id(p)]}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    weights = {n: p.detach().clone() for n, p in lit.named_parameters() if held(p)}
    return {"weights": weights, "state": state}


def fabric_resume(rank: int, world: int, case: dict) -> dict:
    try:
        return _fabric_resume(rank, world, case)
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        return {"error": traceback.format_exc()}


def _fabric_resume(rank: int, world: int, case: dict) -> dict:
    pp, options = case["pp"], case.get("options", {})
    one_file = options.get("save_distributed_checkpoint") is False
    path = os.path.join(case["dir"], "fabric_pp.ckpt" if one_file else "fabric_pp")
    places = world // pp
    samples = data(places * BATCH * 4)
    batches = place_batches(samples, places, rank % places, shuffle=False)
    out: dict[str, Any] = {}

    fabric = _fabric(world, pp, options)  # one Fabric per run, as a user's script has
    lit, oracle, model, opt, sched = _setup(fabric)  # the uninterrupted run, and its one-process oracle
    out["whole_losses"] = _train(fabric, model, opt, sched, batches)
    sd = {k: v.clone() for k, v in lit.state_dict().items()}  # a state read right after the loop
    out["whole"] = _held(lit, opt)
    out["whole_sd"] = {n: sd[n] for n in out["whole"]["weights"]}
    out["oracle_losses"] = oracle_fit(oracle, samples, places, 4, 1, 4, None, shuffle=False)[rank % places]
    o_params = dict(oracle.named_parameters())
    out["oracle_worst"] = {what: max((w - o_params[n].detach()).abs().max().item() for n, w in got.items())
                           for what, got in (("state_dict", out["whole_sd"]), ("tensors", out["whole"]["weights"]))}

    fabric = _fabric(world, pp, options)
    lit, _, model, opt, sched = _setup(fabric)  # 2 steps, saved
    _train(fabric, model, opt, sched, batches[:2])
    fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": 2})
    out["saved"] = _held(lit, opt)

    fabric = _fabric(world, pp, options)
    lit, _, model, opt, sched = _setup(fabric)  # loaded, and the last 2 steps
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    rest = fabric.load(path, state)
    out["step"], out["rest"], out["lr"] = state["step"], sorted(rest), [g["lr"] for g in opt.param_groups]
    out["loaded"] = _held(lit, opt)
    out["resumed_losses"] = _train(fabric, model, opt, sched, batches[2:])
    out["resumed"] = _held(lit, opt)

    fabric = _fabric(world, 1, {k: v for k, v in options.items() if k != "shard_size"})  # one stage: owner sharding
    lit, _, model, opt, _ = _setup(fabric)
    fabric.load(path, {"model": model, "optimizer": opt})
    out["pp1"] = _held(lit, opt)
    return out
