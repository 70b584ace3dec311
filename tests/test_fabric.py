"""Fabric(strategy="matrix_fsdp"): loops equal DDP Muon bitwise; checkpoints reshard and
move between Fabric and the Trainer; setup order, precision and option errors.

Every multi-rank case runs on gloo CPU processes with a hard timeout (tests/helpers/dist.py);
the reference is the plain DDP Muon oracle (tests/helpers/oracle.py), never our own code.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.equiv import full_params
from helpers.models import TinyLM, batch_for, lm_loss
from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS, allreduce_mean_grads, clip_global_norm, oracle_optimizers

TIMEOUT = 300


class Wrapper(nn.Module):
    """The parameter names of tests/helpers/lit.py's LitTiny ("model.*"), so Trainer and Fabric
    checkpoints name the same tensors."""

    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.model = TinyLM(**kw)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


def _muon(params):
    import lightning_matrixfsdp as mf

    a = ADAMW_DEFAULTS
    return mf.Muon(params, adamw_betas=a["betas"], adamw_eps=a["eps"], **MUON_DEFAULTS)


def _fabric(world: int, precision: str = "32-true", **strategy_kw: Any):
    from lightning.fabric import Fabric

    import lightning_matrixfsdp as mf

    strategy = mf.MatrixFSDPFabricStrategy(log_plan=False, **strategy_kw) if strategy_kw else "matrix_fsdp"
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def _oracle_step(oracle: nn.Module, opts: list, batches: list[torch.Tensor], clip: Optional[float],
                 no_sync: bool) -> list[float]:
    """One DDP optimizer step over ``batches`` (micro-batches), as the oracle defines it."""
    acc, losses, summed = len(batches), [], {}
    for batch in batches:
        loss = lm_loss(oracle(batch), batch) / acc
        loss.backward()
        losses.append(loss.item())
        if not no_sync:  # reduce every micro-batch, sum the averages
            allreduce_mean_grads(oracle)
            for n, p in oracle.named_parameters():
                if p.grad is not None:
                    summed[n] = summed[n] + p.grad if n in summed else p.grad
                p.grad = None
    if no_sync:
        allreduce_mean_grads(oracle)
    else:
        for n, p in oracle.named_parameters():
            p.grad = summed.get(n)
    if clip:
        clip_global_norm(oracle, clip)
    for o in opts:
        o.step()
        o.zero_grad(set_to_none=True)
    return losses


def _diff(model: nn.Module, oracle: nn.Module) -> tuple[float, str]:
    full = full_params(model)
    ref = dict(oracle.named_parameters())
    diffs = {n: (full[n].double() - ref[n].detach().double()).abs().max().item() for n in full}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst


def fabric_worker(rank: int, world: int, cfg: dict) -> dict:
    """A Fabric loop and the DDP oracle side by side; optional load before and save after."""
    torch.manual_seed(0)
    fabric = _fabric(world, cfg.get("precision", "32-true"), **cfg.get("strategy", {}))
    model = Wrapper()
    oracle = copy.deepcopy(model)
    if cfg.get("precision") == "64-true":  # DDP's float64: Fabric's DoublePrecision hands the outputs back in float32
        oracle.double().register_forward_hook(lambda m, args, out: out.float())
    o_opts = oracle_optimizers(oracle, is_matrix=lambda n, p: p.ndim == 2)  # bare parameters: by shape
    if cfg.get("joint"):  # optimizer built before sharding, set up together
        opt = _muon(model.parameters())
        model, opt = fabric.setup(model, opt)
    else:
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(_muon(model.parameters()))
    start = 0
    if cfg.get("load"):
        state = {"model": model, "optimizer": opt}
        if cfg.get("load_step"):
            state["step"] = -1
        rest = fabric.load(cfg["load"], state)
        start = state.get("step", 0)
        assert "state_dict" not in rest and "optimizer_states" not in rest
        saved = torch.load(cfg["oracle_in"], weights_only=False)
        oracle.load_state_dict(saved["model"])
        for o, s in zip(o_opts, saved["opts"]):
            o.load_state_dict(s)
    acc, clip, no_sync = cfg.get("accumulate", 1), cfg.get("clip"), cfg.get("strategy", {}).get(
        "accumulation_no_sync", True)
    losses, o_losses, norms = [], [], []
    offset = cfg.get("offset", 0)
    for step in range(cfg.get("steps", 3)):
        batches = [batch_for(offset + step * acc + m, rank) for m in range(acc)]
        for m, batch in enumerate(batches):
            with fabric.no_backward_sync(model, enabled=m < acc - 1):
                loss = lm_loss(model(batch), batch) / acc
                fabric.backward(loss)
            losses.append(loss.item())
        if clip:
            norms.append(fabric.clip_gradients(model, opt, max_norm=clip).item())
        opt.step()
        opt.zero_grad()
        o_losses += _oracle_step(oracle, o_opts, batches, clip, no_sync)
    diff, worst = _diff(model.module, oracle)
    if cfg.get("save"):
        fabric.save(cfg["save"], {"model": model, "optimizer": opt, "step": start + cfg.get("steps", 3)})
        if rank == 0:
            torch.save({"model": oracle.state_dict(), "opts": [o.state_dict() for o in o_opts]}, cfg["oracle_out"])
        dist.barrier()
    return {"losses": losses, "oracle_losses": o_losses, "diff": diff, "worst": worst, "norms": norms,
            "start": start, "dtype": str(next(model.parameters()).dtype)}


def _exact(results: list[dict]) -> None:
    for r in results:
        assert r["losses"] == r["oracle_losses"], (r["losses"], r["oracle_losses"])
        assert r["diff"] == 0.0, f"{r['worst']} differs by {r['diff']:.3e}"


@pytest.mark.parametrize("world", [2, 3])
def test_fabric_loop_equals_ddp_oracle_with_clip_and_accumulation(world: int, dist_pools) -> None:
    res = dist_pools(world).run(fabric_worker, {"steps": 3, "accumulate": 2, "clip": 0.05}, timeout=TIMEOUT)
    _exact(res)
    assert all(n > 0.05 for r in res for n in r["norms"]), "the clip must have scaled the gradients"
    assert res[0]["norms"] == res[1]["norms"], "every rank sees the same global norm"


def test_float64_with_a_strategy_instance_equals_ddp_in_float64(dist_pools) -> None:
    """precision="64-true" with MatrixFSDPFabricStrategy(...) (Lightning refuses it for its
    ModelParallelStrategy): the sharded loop trains in float64, bitwise the DDP oracle in float64."""
    res = dist_pools(2).run(fabric_worker, {"steps": 3, "clip": 0.05, "precision": "64-true",
                                            "strategy": {"accumulation_no_sync": True}}, timeout=TIMEOUT)
    _exact(res)
    assert all(r["dtype"] == "torch.float64" for r in res)


def test_fabric_joint_setup_and_reduce_every_micro_batch(dist_pools) -> None:
    """fabric.setup(model, optimizer) with the optimizer built first; accumulation_no_sync=False
    makes no_backward_sync a no-op (the oracle then reduces every micro-batch too)."""
    cfg = {"steps": 2, "accumulate": 2, "joint": True, "strategy": {"accumulation_no_sync": False}}
    _exact(dist_pools(2).run(fabric_worker, cfg, timeout=TIMEOUT))


def test_fabric_save_at_2_load_at_3_continues_like_the_oracle(tmp_path, dist_pools) -> None:
    ckpt, o1 = str(tmp_path / "fabric.ckpt"), str(tmp_path / "oracle1.pt")
    first = dist_pools(2).run(fabric_worker, {"steps": 2, "clip": 0.05, "save": ckpt, "oracle_out": o1},
                              timeout=TIMEOUT)
    _exact(first)
    assert os.path.isdir(ckpt) and os.path.isfile(os.path.join(ckpt, "matrix_fsdp_layout.json"))
    second = dist_pools(3).run(fabric_worker, {"steps": 2, "clip": 0.05, "load": ckpt, "oracle_in": o1,
                                               "load_step": True, "offset": 100}, timeout=TIMEOUT)
    _exact(second)
    assert [r["start"] for r in second] == [2, 2, 2]


# ---------------------------------------------------------------------------- Trainer <-> Fabric
def _lit_fit(world: int, steps: int, ckpt_in: Optional[str], ckpt_out: str, root: str):
    from lightning.pytorch import Trainer

    from helpers.lit import LitTiny

    lit = LitTiny("muon_bare")  # bare parameters, as the Fabric phase builds its optimizer
    trainer = Trainer(accelerator="cpu", devices=world, strategy="matrix_fsdp", max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, default_root_dir=root)
    trainer.fit(lit, ckpt_path=ckpt_in)
    trainer.save_checkpoint(ckpt_out)
    return lit


def interchange_worker(rank: int, world: int, root: str) -> dict:
    """Trainer (2 steps, save) -> Fabric (load, 2 steps, save) -> Trainer (load, 2 steps), against
    one DDP oracle that replays every rank's batches across the three phases."""
    torch.manual_seed(0)
    import lightning_matrixfsdp  # noqa: F401 - registers the strategies

    t1, f1 = os.path.join(root, "trainer1.ckpt"), os.path.join(root, "fabric.ckpt")
    lit = _lit_fit(world, 2, None, t1, root)
    torch.manual_seed(0)
    oracle = Wrapper()  # LitTiny's initial weights: same seed, same construction order
    o_opts = oracle_optimizers(oracle, is_matrix=lambda n, p: p.ndim == 2)  # bare parameters: by shape
    losses: list[float] = list(lit.losses)
    o_losses: list[float] = []
    for batch in lit.seen:
        o_losses += _oracle_step(oracle, o_opts, [batch], None, True)

    # Fabric resumes the Trainer's checkpoint (model and optimizer) on a differently built model
    fabric = _fabric(world)
    torch.manual_seed(123)
    model = fabric.setup_module(Wrapper())
    opt = fabric.setup_optimizers(_muon(model.parameters()))
    rest = fabric.load(t1, {"model": model, "optimizer": opt})
    assert rest["global_step"] == 2 and "loops" in rest, sorted(rest)
    for step in range(2):
        batch = batch_for(500 + step, rank)
        loss = lm_loss(model(batch), batch)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        o_losses += _oracle_step(oracle, o_opts, [batch], None, True)
    after_fabric = _diff(model.module, oracle)
    fabric.save(f1, {"model": model, "optimizer": opt})

    # the Trainer resumes the Fabric checkpoint (no loops in it: it starts its own count at 0)
    torch.manual_seed(7)
    lit2 = _lit_fit(world, 2, f1, os.path.join(root, "trainer2.ckpt"), root)
    for batch in lit2.seen:
        o_losses += _oracle_step(oracle, o_opts, [batch], None, True)
    losses += lit2.losses
    final = _diff(lit2, _Prefixed(oracle))
    return {"losses": losses, "oracle_losses": o_losses, "after_fabric": after_fabric, "diff": final[0],
            "worst": final[1]}


class _Prefixed(nn.Module):
    """The oracle under LitTiny's names (its ``model`` attribute): LitTiny's parameters are "model.*"."""

    def __init__(self, wrapper: Wrapper) -> None:
        super().__init__()
        self.model = wrapper.model


def test_trainer_checkpoint_to_fabric_and_back(tmp_path, dist_pools) -> None:
    res = dist_pools(2).run(interchange_worker, str(tmp_path), timeout=TIMEOUT)
    for r in res:
        assert r["after_fabric"][0] == 0.0, r["after_fabric"]
    _exact(res)


# ---------------------------------------------------------------------------- errors and options
def wrong_order_worker(rank: int, world: int) -> str:
    import lightning_matrixfsdp as mf

    fabric = _fabric(world)
    with torch.device("meta"):
        model = Wrapper()
    opt = _muon(model.parameters())  # holds meta tensors that sharding replaces
    try:
        fabric.setup(model, opt)
    except RuntimeError as e:
        msg = str(e)
    else:
        raise AssertionError("fabric.setup(model, optimizer) with a meta-device optimizer did not raise")
    stray = fabric.setup_module(Wrapper())
    other = mf.Muon(Wrapper().parameters(), lr=0.02)  # over a model that was never set up
    try:
        fabric.setup_optimizers(other)
    except RuntimeError as e:
        msg2 = str(e)
    else:
        raise AssertionError("an optimizer over another model was accepted")
    assert stray is not None
    return msg + "\n" + msg2


def test_wrong_setup_order_raises_with_the_order_to_use(dist_pools) -> None:
    msgs = dist_pools(2).run(wrong_order_worker, timeout=TIMEOUT)
    assert msgs[0] == msgs[1], "every rank raises the same error"
    for part in msgs[0].split("\n"):
        assert "fabric.setup_module(model)" in part and "fabric.setup_optimizers(optimizer)" in part, part
        assert "not parameters of a sharded model" in part, part


def precision_worker(rank: int, world: int, precision: str) -> dict:
    import lightning_matrixfsdp as mf

    fabric = _fabric(world, precision)
    torch.manual_seed(0)
    model = fabric.setup_module(Wrapper())
    opt = fabric.setup_optimizers(_muon(model.parameters()))
    losses = []
    for step in range(2):
        batch = batch_for(step, rank)
        with fabric.no_backward_sync(model, enabled=False):
            loss = lm_loss(model(batch), batch)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.float().item())
    assert mf.is_matrix_sharded(model.module)
    return {"losses": losses, "param_dtype": str(next(model.parameters()).dtype), "loss_dtype": str(loss.dtype)}


@pytest.mark.parametrize("precision,param_dtype", [("bf16-mixed", "torch.float32"), ("bf16-true", "torch.bfloat16")])
def test_bf16_precisions_train(precision: str, param_dtype: str, dist_pools) -> None:
    res = dist_pools(2).run(precision_worker, precision, timeout=TIMEOUT)
    for r in res:
        assert r["param_dtype"] == param_dtype
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert res[0]["losses"] != res[1]["losses"], "ranks saw distinct batches"


def test_16_mixed_refused_and_registry() -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    import lightning_matrixfsdp as mf

    assert STRATEGY_REGISTRY["matrix_fsdp"]["strategy"] is mf.MatrixFSDPFabricStrategy
    with pytest.raises(ValueError, match="16-mixed"):
        Fabric(accelerator="cpu", devices=1, strategy="matrix_fsdp", precision="16-mixed")
    with pytest.raises(ValueError, match="gradient scaler"):
        mf.MatrixFSDPFabricStrategy().precision = MixedPrecision("16-mixed", device="cuda")


def test_options_are_validated_like_the_trainer_strategy() -> None:
    import lightning_matrixfsdp as mf

    for kw, word in [({"planner": "nope"}, "planner"), ({"collective": "x"}, "collective"),
                     ({"tensor_parallel_size": 0}, "tensor_parallel_size"), ({"shard_size": 0}, "shard_size"),
                     ({"accumulation_no_sync": "yes"}, "accumulation_no_sync"),
                     ({"verify_checkpoints": "no"}, "verify_checkpoints"),
                     ({"reset_changed_roles": 1}, "reset_changed_roles")]:
        with pytest.raises(Exception, match=word):
            mf.MatrixFSDPFabricStrategy(**kw)
        if word != "accumulation_no_sync":  # the Trainer strategy refuses these too
            with pytest.raises(Exception, match=word):
                mf.MatrixFSDPStrategy(**kw)
    opts = mf.MatrixFSDPFabricStrategy(verify_checkpoints=False, reset_changed_roles=True)
    assert (opts.verify_checkpoints, opts.reset_changed_roles) == (False, True)


def test_example_runs_on_two_cpu_processes(tmp_path) -> None:
    import subprocess
    import sys

    from conftest import clean_env

    script = os.path.join(os.path.dirname(__file__), "..", "examples", "fabric_loop.py")
    out = subprocess.run([sys.executable, script, "--steps", "2", "--checkpoint", str(tmp_path / "c.ckpt")],
                         cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "step   1  loss" in out.stdout and "saved and reloaded" in out.stdout, out.stdout[-2000:]
    assert (tmp_path / "c.ckpt" / "matrix_fsdp_layout.json").is_file()
