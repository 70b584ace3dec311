"""``MatrixFSDPStrategy(replica_split=True)``: the Trainer path (sync after each optimizer step,
validation, gradient accumulation and clipping, the end of fit) equals DDP Muon bitwise on
every rank's own weights, and checkpoints move optimizer state to the stepping replicas."""
from __future__ import annotations

import copy
import os
from typing import Any

import torch

from helpers.lit import LitTiny
from helpers.models import lm_loss
from helpers.oracle import allreduce_mean_grads, clip_global_norm, oracle_optimizers


def _fit(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from lightning.pytorch import Trainer

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.tags import is_owned, shard_of

    torch.manual_seed(0)
    lit = LitTiny(d=16, heads=2, layers=2)
    initial = copy.deepcopy(lit.model)
    strategy = mf.MatrixFSDPStrategy(shard_size=cfg.get("shard_size", 1), replica_split=True, log_plan=False)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=cfg["steps"], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=2, val_check_interval=4, default_root_dir=cfg["root"],
                      accumulate_grad_batches=cfg.get("accumulate", 1), gradient_clip_val=cfg.get("clip"))
    trainer.fit(lit)
    # DDP Muon replaying every batch this rank saw (W = 1: the oracle's flat sum is the stepper's)
    acc, oracle = cfg.get("accumulate", 1), initial
    opts = oracle_optimizers(oracle)
    for step in range(len(lit.seen) // acc):
        grads: dict[str, torch.Tensor] = {}
        for micro in range(acc):
            batch = lit.seen[step * acc + micro]
            (lm_loss(oracle(batch), batch) / acc).backward()
            allreduce_mean_grads(oracle)
            for n, p in oracle.named_parameters():
                if p.grad is not None:
                    grads[n] = grads[n] + p.grad if n in grads else p.grad
                p.grad = None
        for n, p in oracle.named_parameters():
            p.grad = grads.get(n)
        if cfg.get("clip"):
            clip_global_norm(oracle, cfg["clip"])
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    ref = dict(oracle.named_parameters())
    # every rank's own copy (W = 1: each rank owns every parameter), not a broadcast of one of them
    differ = [n for n, p in lit.model.named_parameters() if not torch.equal(p.detach(), ref[n].detach())]
    plan = mf.get_plan(lit)
    me = trainer.global_rank
    opt = trainer.optimizers[0]
    held = sorted(shard_of(p).fqn for p in opt.state if opt.state[p])
    stepped = sorted(shard_of(p).fqn for p in lit.parameters() if is_owned(p) and plan.stepper(shard_of(p).fqn) == me)
    return {"differ": differ, "steps": trainer.global_step, "held": held, "stepped": stepped,
            "stats": mf.get_comm_stats(lit)}


def test_trainer_split_matches_ddp_on_every_replica(tmp_path, dist_pools):
    res = dist_pools(2).run(_fit, {"steps": 3, "accumulate": 2, "clip": 0.3, "root": str(tmp_path)}, timeout=300)
    for r in res:
        assert r["steps"] == 3
        assert not r["differ"], r["differ"]
        assert set(r["held"]) <= set(r["stepped"]) and r["held"], (r["held"], r["stepped"])
        assert r["stats"]["replica_broadcast"]["calls"] > 0 and r["stats"]["replicate"]["calls"] == 0
    assert not set(res[0]["held"]) & set(res[1]["held"])


def _fabric_loop(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from lightning.fabric import Fabric

    import lightning_matrixfsdp as mf
    from helpers.models import TinyLM, batch_for
    from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS

    fabric = Fabric(accelerator="cpu", devices=world, strategy=mf.MatrixFSDPFabricStrategy(
        shard_size=1, replica_split=True, log_plan=False))
    fabric.launch()
    torch.manual_seed(0)
    model = TinyLM(d=16, heads=2, layers=2)
    oracle = copy.deepcopy(model)
    model = fabric.setup_module(model)
    a = ADAMW_DEFAULTS
    opt = fabric.setup_optimizers(mf.Muon(model, adamw_betas=a["betas"], adamw_eps=a["eps"],
                                          **MUON_DEFAULTS))
    o_opts = oracle_optimizers(oracle)
    stale = []
    for step in range(3):
        idx = batch_for(step, rank)
        fabric.backward(lm_loss(model(idx), idx))
        opt.step()  # the strategy starts the transfer right after the step
        opt.zero_grad()
        lm_loss(oracle(idx), idx).backward()
        allreduce_mean_grads(oracle)
        for o in o_opts:
            o.step()
            o.zero_grad(set_to_none=True)
        # state_dict() only waits for transfers already started: current weights prove the start
        sd = model.state_dict()
        stale += [f"{step}:{n}" for n, p in oracle.named_parameters() if not torch.equal(sd[n], p.detach())]
    fabric.save(cfg["path"], {"model": model, "optimizer": opt})
    return {"stale": stale}


def test_fabric_split_starts_the_transfer_after_each_step(tmp_path, dist_pools):
    for r in dist_pools(2).run(_fabric_loop, {"path": str(tmp_path / "ck")}, timeout=300):
        assert not r["stale"], r["stale"]
