"""Checkpoint IO: resharding resume, exact Lightning resume, consolidated export, interop, crash safety, errors.

Process launches are the cost here (2 CPU cores): each distributed test is one
spawn that checks several things; the error cases run in this process (world 1,
no process group).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers.dist import _free_port
from helpers.models import TinyLM, batch_for, lm_loss

MUON = dict(lr=0.02, weight_decay=0.1)
# DCP without a process group (the world-1 cases in this process) says so on every call.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# ---------------------------------------------------------------------- helpers (run inside workers)
def _sharded(seed: int, planner: str = "role_greedy", mesh=None, **model_kw):
    import lightning_matrixfsdp as mf

    torch.manual_seed(seed)
    model = TinyLM(**model_kw)
    mf.matrix_shard(model, planner=planner, mesh=mesh)
    return model, mf.route_optimizer(mf.Muon(model.parameters(), **MUON))


def _train(model, opt, steps: int, start: int = 0) -> list[float]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for s in range(start, start + steps):
        x = batch_for(s, rank)
        loss = lm_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _ret(obj) -> bytes:
    """Results leave a worker as bytes: tensors sent through the queue would live in the
    worker's shared memory, which is gone once the worker exits."""
    import pickle

    return pickle.dumps(obj)


def _run(dist_pools, fn, world, *args, **kw):
    import pickle

    return [pickle.loads(r) for r in dist_pools(world).run(fn, *args, **kw)]


def _gather(obj):
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def full_state(model: nn.Module, opt) -> dict:
    """Every parameter and every optimizer-state entry, whole, keyed by name (test-side, from the owners)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params, state = {}, {}
    local_p = {n: p.detach().clone() for n, p in model.named_parameters()
               if getattr(p, "_mfsdp_owned", True) and p.numel()}
    local_s = {names[id(p)]: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
               for g in opt.param_groups for p in g["params"] if p in opt.state}
    for ps, ss in _gather((local_p, local_s)):
        params.update(ps)
        state.update(ss)
    hp = [{k: v for k, v in g.items() if k not in ("params", "differentiable")} for g in opt.param_groups]
    return {"params": params, "state": state, "groups": hp}


def assert_same_state(got: dict, ref: dict) -> None:
    assert got["params"].keys() == ref["params"].keys()
    for n, t in ref["params"].items():
        assert torch.equal(got["params"][n], t), f"parameter {n} differs"
    assert got["state"].keys() == ref["state"].keys(), "optimizer state covers other parameters"
    for n, s in ref["state"].items():
        assert got["state"][n].keys() == s.keys(), n
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(got["state"][n][k]), torch.as_tensor(v)), f"optimizer state {n}/{k}"
    assert [{k: g[k] for k in r} for g, r in zip(got["groups"], ref["groups"])] == ref["groups"]


# ---------------------------------------------------------------------- resharding (no Trainer: fast)
def _save_w2(rank, world, root):
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp import checkpoint as C

    model, opt = _sharded(0)
    _train(model, opt, 2)
    C.save_sharded(model, f"{root}/d2", [opt], extra={"note": "w2"})
    C.save_sharded(model, f"{root}/f2.ckpt", [opt], full=True)
    ref = full_state(model, opt)
    x = batch_for(99, 0)
    with torch.no_grad():
        out = model(x)
    # HSDP (2 replicas of a 1-rank shard group): load the 2-rank checkpoint, save it both ways
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    hsdp, hopt = _sharded(7, mesh=mesh)
    C.load_sharded(hsdp, f"{root}/d2", [hopt])
    hsdp_state = full_state(hsdp, hopt)
    C.save_sharded(hsdp, f"{root}/d_hsdp", [hopt])
    C.save_sharded(hsdp, f"{root}/f_hsdp.ckpt", [hopt], full=True)
    return _ret({"ref": ref, "owners": mf.get_plan(model).owners, "out": out, "hsdp": hsdp_state}
                if rank == 0 else None)


def _load_w3(rank, world, root):
    from lightning_matrixfsdp import checkpoint as C

    model, opt = _sharded(1)
    rest = C.load_sharded(model, f"{root}/d2", [opt])
    from_dir = full_state(model, opt)
    C.save_sharded(model, f"{root}/d3", [opt])
    model2, opt2 = _sharded(2)
    C.load_sharded(model2, f"{root}/f2.ckpt", [opt2])
    from_file = full_state(model2, opt2)
    return _ret({"dir": from_dir, "file": from_file, "rest": rest} if rank == 0 else None)


def _load_w2_other_planner(rank, world, root):
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp import checkpoint as C

    out = {}
    for name in ("d2", "d3"):
        model, opt = _sharded(3, planner="scope_greedy")
        C.load_sharded(model, f"{root}/{name}", [opt])
        out[name] = full_state(model, opt)
    out["owners"] = mf.get_plan(model).owners
    _train(model, opt, 1, start=2)  # the resumed optimizer steps
    return _ret(out if rank == 0 else None)


def test_reshard_2_to_3_3_to_2_2_to_1_and_other_planner(tmp_path, dist_pools):
    saved = _run(dist_pools, _save_w2, 2, str(tmp_path))[0]
    ref = saved["ref"]
    assert ref["state"] and all("momentum_buffer" in s or "exp_avg" in s for s in ref["state"].values())
    side = json.loads((tmp_path / "d2" / "matrix_fsdp_layout.json").read_text())
    assert side["world_size"] == 2 and side["planner"] == "role_greedy"
    assert {k: v["owner"] for k, v in side["params"].items()} == saved["owners"]
    assert sorted(os.listdir(tmp_path / "d2")) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                   "matrix_fsdp_layout.json", "meta.pt"]
    assert_same_state(saved["hsdp"], ref)  # 2 -> HSDP 2 x 1
    assert json.loads((tmp_path / "d_hsdp" / "matrix_fsdp_layout.json").read_text())["replicate"] == 2

    w3 = _run(dist_pools, _load_w3, 3, str(tmp_path))[0]
    assert_same_state(w3["dir"], ref)    # 2 -> 3
    assert_same_state(w3["file"], ref)   # consolidated file -> 3
    assert w3["rest"] == {"note": "w2"}
    assert json.loads((tmp_path / "d3" / "matrix_fsdp_layout.json").read_text())["world_size"] == 3

    w2 = _run(dist_pools, _load_w2_other_planner, 2, str(tmp_path))[0]
    assert w2["owners"] != saved["owners"], "the other planner should place some roles elsewhere"
    assert_same_state(w2["d2"], ref)     # 2 -> 2 with another planner
    assert_same_state(w2["d3"], ref)     # 3 -> 2

    from lightning_matrixfsdp import checkpoint as C

    for name in ("d2", "d_hsdp", "f_hsdp.ckpt"):  # world 1, in this process (no process group)
        model, opt = _sharded(4)
        C.load_sharded(model, tmp_path / name, [opt])
        assert_same_state(full_state(model, opt), ref)  # 2 -> 1, HSDP -> 1

    # consolidated file: plain torch, no package, same outputs as the sharded model
    ck = torch.load(tmp_path / "f2.ckpt", weights_only=True)
    plain = TinyLM()
    plain.load_state_dict(ck["state_dict"])
    with torch.no_grad():
        assert torch.equal(plain(batch_for(99, 0)), saved["out"])
    import lightning_matrixfsdp as mf

    opt = mf.Muon(plain.parameters(), **MUON)
    opt.load_state_dict(ck["optimizer_states"][0])
    assert_same_state(full_state(plain, opt), ref)


# ---------------------------------------------------------------------- Lightning: exact resume, callbacks, ckpt_path
def _lit_classes():
    from lightning.pytorch import LightningModule

    import lightning_matrixfsdp as mf

    class LitCk(LightningModule):
        """Data comes from (global_step, rank): the resume check tests the checkpoint, not the loader."""

        def __init__(self, opt: str = "muon") -> None:
            super().__init__()
            self.model = TinyLM()
            self.opt = opt
            self.losses: dict[int, float] = {}
            self.register_buffer("steps_seen", torch.zeros((), dtype=torch.long))  # replicated, not sharded

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, i):
            x = batch_for(self.global_step, self.global_rank).to(self.device)
            loss = lm_loss(self.model(x), x)
            self.losses[self.global_step] = loss.item()
            self.steps_seen += 1
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, i):
            x = batch_for(1000 + i, self.global_rank).to(self.device)
            self.log("val_loss", lm_loss(self.model(x), x), sync_dist=True)

        def test_step(self, batch, i):
            x = batch_for(2000 + i, self.global_rank).to(self.device)
            self.log("test_loss", lm_loss(self.model(x), x), sync_dist=True)

        def predict_step(self, batch, i):
            return self.model(batch_for(3000 + i, self.global_rank).to(self.device))

        def train_dataloader(self):
            return torch.utils.data.DataLoader(range(64), batch_size=1)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(range(2), batch_size=1)

        test_dataloader = predict_dataloader = val_dataloader

        def configure_optimizers(self):
            o = (torch.optim.AdamW(self.parameters(), lr=1e-2) if self.opt == "adamw"
                 else mf.Muon(self.parameters(), **MUON))
            sched = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
            return {"optimizer": o, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class LitFsdp2(LitCk):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for b in self.model.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return LitCk, LitFsdp2


def _trainer(root, strategy=None, **kw):
    from lightning.pytorch import Trainer

    import lightning_matrixfsdp as mf

    args = dict(accelerator="cpu", devices=dist.get_world_size(), logger=False, enable_progress_bar=False,
                enable_model_summary=False, limit_val_batches=0, default_root_dir=root, enable_checkpointing=False)
    args.update(kw)
    return Trainer(strategy=strategy or mf.MatrixFSDPStrategy(log_plan=False), **args)


def _lit_worker(rank, world, root):
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_matrixfsdp as mf

    LitCk, _ = _lit_classes()
    root = Path(root)
    torch.manual_seed(0)
    a = LitCk()
    every = ModelCheckpoint(dirpath=root / "every", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    best = ModelCheckpoint(dirpath=root / "best", filename="best-{step}", monitor="train_loss", mode="min",
                           save_top_k=1, every_n_train_steps=1, save_last=True)
    ta = _trainer(root, max_steps=6, callbacks=[every, best], enable_checkpointing=True)
    ta.fit(a)
    full_a = full_state(a, ta.optimizers[0])
    pred_a = ta.predict(a)

    # exact resume on the same world size from the step-3 checkpoint
    torch.manual_seed(1)
    b = LitCk()
    tb = _trainer(root, max_steps=6)
    tb.fit(b, ckpt_path=root / "every" / "step=3.ckpt")
    full_b = full_state(b, tb.optimizers[0])

    # validate / test / predict(ckpt_path=...) into a fresh module
    torch.manual_seed(2)
    c = LitCk()
    tc = _trainer(root, limit_val_batches=2)
    val_c = tc.validate(c, ckpt_path=root / "best" / "last.ckpt", verbose=False)[0]["val_loss"]
    test_c = tc.test(c, ckpt_path=root / "best" / "last.ckpt", verbose=False)[0]["test_loss"]
    pred_c = tc.predict(c, ckpt_path=root / "best" / "last.ckpt")
    ta_val = _trainer(root, limit_val_batches=2)
    val_a = ta_val.validate(a, verbose=False)[0]["val_loss"]

    # consolidated export through Trainer.save_checkpoint
    ta.strategy._save_distributed_checkpoint = False
    ta.save_checkpoint(root / "full.ckpt")
    x = batch_for(7, 0)
    with torch.no_grad():
        out_a = a(x)
    result = {"losses_a": a.losses, "losses_b": b.losses, "full_a": full_a, "full_b": full_b,
            "pred_a": pred_a, "pred_c": pred_c, "val": (val_a, val_c), "test_c": test_c, "out_a": out_a,
            "best": sorted(os.listdir(root / "best")), "every": sorted(os.listdir(root / "every")),
            "global_step_b": tb.global_step, "buffers": (int(a.steps_seen), int(b.steps_seen)),
            "lr_b": tb.optimizers[0].param_groups[0]["lr"],
            "lr_a": ta.optimizers[0].param_groups[0]["lr"]} if rank == 0 else None
    return _ret(result)


def test_lightning_exact_resume_callbacks_ckpt_path_and_consolidated_export(tmp_path, dist_pools):
    r = _run(dist_pools, _lit_worker, 2, str(tmp_path), timeout=300)[0]
    # ModelCheckpoint: top-1 by train_loss plus last, every-3-steps kept; all are complete directories
    assert r["every"] == ["step=3.ckpt", "step=6.ckpt"]
    assert len(r["best"]) == 2 and "last.ckpt" in r["best"], r["best"]
    for d in ("every", "best"):
        for name in os.listdir(tmp_path / d):
            assert {"meta.pt", ".metadata", "matrix_fsdp_layout.json"} <= set(os.listdir(tmp_path / d / name))
    assert not [p for p in tmp_path.rglob(".mfsdp-*")], "a temporary save directory was left behind"
    # exact resume: same losses after step 3, same final weights and optimizer state, same LR schedule
    assert r["global_step_b"] == 6 and sorted(r["losses_b"]) == [3, 4, 5]
    assert all(r["losses_b"][s] == r["losses_a"][s] for s in (3, 4, 5)), (r["losses_a"], r["losses_b"])
    assert_same_state(r["full_b"], r["full_a"])
    assert r["lr_b"] == r["lr_a"]
    assert r["buffers"] == (6, 6)
    # validate / test / predict from a checkpoint
    assert r["val"][0] == r["val"][1]
    assert all(torch.equal(p, q) for p, q in zip(r["pred_a"], r["pred_c"]))
    # consolidated export: plain torch.load + load_state_dict, no package, same outputs and optimizer state
    LitCk, _ = _lit_classes()
    ck = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert ck["global_step"] == 6 and "loops" in ck and ck["lr_schedulers"]
    plain = LitCk()
    plain.load_state_dict(ck["state_dict"])
    with torch.no_grad():
        assert torch.equal(plain(batch_for(7, 0)), r["out_a"])
    import lightning_matrixfsdp as mf

    opt = mf.Muon(plain.parameters(), **MUON)
    opt.load_state_dict(ck["optimizer_states"][0])
    got = full_state(plain, opt)
    assert_same_state({**got, "groups": r["full_a"]["groups"]}, r["full_a"])


# ---------------------------------------------------------------------- interop: ModelParallelStrategy + FSDP2
def _fsdp2_worker(rank, world, root):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    LitCk, LitFsdp2 = _lit_classes()
    root = Path(root)
    torch.manual_seed(0)
    f = LitFsdp2(opt="adamw")
    every = ModelCheckpoint(dirpath=root / "fsdp2", filename="{step}", every_n_train_steps=2, save_top_k=-1)
    tf = _trainer(root, strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                  max_steps=3, callbacks=[every], enable_checkpointing=True)
    tf.fit(f)
    ref = {n: p.full_tensor().detach().clone() for n, p in f.named_parameters()}

    # weights only: validate into our layout; then resume training (AdamW state and LR schedule)
    torch.manual_seed(1)
    g = LitCk(opt="adamw")
    tg = _trainer(root, limit_val_batches=2)
    tg.validate(g, ckpt_path=root / "fsdp2" / "step=2.ckpt", verbose=False)
    loaded = {n: p.detach().clone() for n, p in full_state(g, torch.optim.SGD([torch.zeros(1)]))["params"].items()}
    torch.manual_seed(2)
    h = LitCk(opt="adamw")
    th = _trainer(root, max_steps=3)
    th.fit(h, ckpt_path=root / "fsdp2" / "step=2.ckpt")
    mine = full_state(h, th.optimizers[0])["params"]
    return _ret({"ref": ref, "losses_f": f.losses, "losses_h": h.losses, "after": mine, "loaded": loaded}
                if rank == 0 else None)


def test_import_model_parallel_fsdp2_checkpoint(tmp_path, dist_pools):
    r = _run(dist_pools, _fsdp2_worker, 2, str(tmp_path), timeout=300)[0]
    assert not (tmp_path / "fsdp2" / "step=2.ckpt" / "matrix_fsdp_layout.json").exists()  # a foreign checkpoint
    # the step-2 loss is computed from the imported weights: same as FSDP2's
    assert sorted(r["losses_h"]) == [2]
    assert r["losses_h"][2] == pytest.approx(r["losses_f"][2], rel=1e-6, abs=1e-6)
    # one more AdamW step from the imported optimizer state and LR schedule lands where FSDP2 did
    for n, t in r["ref"].items():
        torch.testing.assert_close(r["after"][n], t, rtol=1e-5, atol=1e-6, msg=f"{n} after the resumed step")
    # the converter reads the foreign directory too; validate(ckpt_path=...) loaded exactly those weights
    from lightning_matrixfsdp import consolidate

    consolidate.main([str(tmp_path / "fsdp2" / "step=2.ckpt"), str(tmp_path / "fsdp2.ckpt")])
    ck = torch.load(tmp_path / "fsdp2.ckpt", weights_only=True)
    assert ck["global_step"] == 2 and len(ck["optimizer_states"]) == 1
    assert set(r["loaded"]) < set(ck["state_dict"])  # parameters, plus the buffer
    assert all(torch.equal(ck["state_dict"][n], t) for n, t in r["loaded"].items())


# ---------------------------------------------------------------------- crash safety
def _crash_worker(rank, world, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp

    from lightning_matrixfsdp import checkpoint as C

    model, opt = _sharded(0)
    _train(model, opt, 2)
    C.save_sharded(model, f"{root}/ck", [opt], extra={"step": 2})
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, f"{root}/ref.pt")
    _train(model, opt, 1, start=2)
    real = dcp.save

    def dying(*a, **k):
        out = real(*a, **k)
        if rank == 1:
            os._exit(17)  # killed after writing its shard, before the save is published
        return out

    dcp.save = dying
    C.save_sharded(model, f"{root}/ck", [opt], extra={"step": 3})


def test_rank_killed_during_save_leaves_previous_checkpoint(tmp_path):
    import multiprocessing as mp

    from lightning_matrixfsdp import checkpoint as C

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_crash_worker, args=(r, 2, port, str(tmp_path)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    procs[1].join(timeout=180)
    procs[0].join(timeout=10)  # its peer is gone: it errors out or hangs; the job is torn down either way
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert procs[1].exitcode == 17, "rank 1 should have died inside the second save"
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".mfsdp-partial-")]
    assert len(partial) == 1 and (partial[0] / ".metadata").exists(), "the interrupted save stays hidden"
    assert torch.load(tmp_path / "ck" / "meta.pt")["step"] == 2, "the previous checkpoint must be intact"
    with pytest.raises(C.CheckpointCorruptError, match="incomplete"):
        C.load_sharded(_sharded(0)[0], partial[0])
    ref = torch.load(tmp_path / "ref.pt")
    model, opt = _sharded(5)  # resume (here on 1 process) from the previous checkpoint
    assert C.load_sharded(model, tmp_path / "ck", [opt]) == {"step": 2}
    assert_same_state(full_state(model, opt), ref)
    assert all(torch.isfinite(torch.tensor(_train(model, opt, 1, start=2))))


# ---------------------------------------------------------------------- bad checkpoints (world 1, this process)
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from lightning_matrixfsdp import checkpoint as C

    root = tmp_path_factory.mktemp("bad")
    model, opt = _sharded(0)
    _train(model, opt, 1)
    C.save_sharded(model, root / "ok", [opt])
    C.save_sharded(model, root / "ok.ckpt", [opt], full=True)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, root / "plain.pt")
    return root, full_state(model, opt)


def _load(root, name, strict=True, with_opt=True, **model_kw):
    from lightning_matrixfsdp import checkpoint as C

    model, opt = _sharded(9, **model_kw)
    C.load_sharded(model, root / name, [opt] if with_opt else [], strict=strict)
    return model, opt


def test_bad_checkpoint_errors(saved, tmp_path):
    from lightning_matrixfsdp import checkpoint as C

    root, ref = saved
    # missing keys (the model has a branch the checkpoint lacks): strict error, or load the rest with a warning
    with pytest.raises(C.CheckpointKeyError, match=r"missing keys \['branch.weight', 'branch.bias'\]"):
        _load(root, "ok", extra_branch=True)
    with pytest.warns(UserWarning, match="missing keys"):
        model, _ = _load(root, "ok", strict=False, with_opt=False, extra_branch=True)
    assert torch.equal(dict(model.named_parameters())["head.weight"], ref["params"]["head.weight"])
    # unexpected keys
    big, big_opt = _sharded(0, extra_branch=True)
    C.save_sharded(big, tmp_path / "big", [big_opt])
    with pytest.raises(C.CheckpointKeyError, match=r"unexpected keys \['branch.bias', 'branch.weight'\]"):
        _load(tmp_path, "big")
    # shape mismatch (always an error)
    with pytest.raises(C.CheckpointMismatchError, match="shape mismatch"):
        _load(root, "ok", strict=False, d=48)
    # dtype mismatch: error, or cast with strict_loading=False
    model64 = TinyLM().double()
    import lightning_matrixfsdp as mf

    mf.matrix_shard(model64)
    with pytest.raises(C.CheckpointMismatchError, match="dtype mismatch"):
        C.load_sharded(model64, root / "ok")
    with pytest.warns(UserWarning, match="casting"):
        C.load_sharded(model64, root / "ok", strict=False)
    assert torch.equal(dict(model64.named_parameters())["pos"], ref["params"]["pos"].double())
    # a checkpoint of another model
    other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    mf.matrix_shard(other)
    for name in ("ok", "ok.ckpt", "plain.pt"):
        with pytest.raises(C.CheckpointMismatchError, match="another model"):
            C.load_sharded(other, root / name, strict=False)
    # another optimizer: error, or weights only with a warning
    model, _ = _sharded(9)
    adamw = mf.route_optimizer(torch.optim.AdamW(model.parameters()))
    before = {n: p.clone() for n, p in model.named_parameters()}
    for name in ("ok", "ok.ckpt"):
        with pytest.raises(C.CheckpointMismatchError, match="cannot take the saved state"):
            C.load_sharded(model, root / name, [adamw])
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "validated before loading"
    with pytest.warns(UserWarning, match="cannot take the saved state"):
        C.load_sharded(model, root / "ok", [adamw], strict=False)
    assert not adamw.state
    # corrupted sidecar; a sidecar that does not describe the data
    bad = tmp_path / "bad_json"
    shutil.copytree(root / "ok", bad)
    (bad / C.SIDECAR_NAME).write_text("{ not json")
    with pytest.raises(C.CheckpointCorruptError, match="sidecar .* corrupted"):
        _load(tmp_path, "bad_json")
    side = json.loads((root / "ok" / C.SIDECAR_NAME).read_text())
    side["params"]["head.weight"]["shape"] = [1, 2]
    shutil.copytree(root / "ok", tmp_path / "bad_shape")
    (tmp_path / "bad_shape" / C.SIDECAR_NAME).write_text(json.dumps(side))
    with pytest.raises(C.CheckpointCorruptError, match="does not match the saved data at 'head.weight'"):
        _load(tmp_path, "bad_shape")
    del side["format_version"]
    (tmp_path / "bad_shape" / C.SIDECAR_NAME).write_text(json.dumps(side))
    with pytest.raises(C.CheckpointCorruptError, match="format_version"):
        _load(tmp_path, "bad_shape")
    # incomplete directories, garbage files, nothing at all
    shutil.copytree(root / "ok", tmp_path / "no_md")
    (tmp_path / "no_md" / ".metadata").unlink()
    with pytest.raises(C.CheckpointCorruptError, match="without DCP '.metadata'"):
        _load(tmp_path, "no_md")
    (tmp_path / "garbage.ckpt").write_bytes(b"\x00not a checkpoint")
    with pytest.raises(C.CheckpointCorruptError, match="cannot be read"):
        _load(tmp_path, "garbage.ckpt")
    with pytest.raises(FileNotFoundError):
        _load(tmp_path, "nothing_here")


def test_plain_state_dict_and_consolidate_cli(saved, tmp_path):
    from lightning_matrixfsdp import consolidate
    from lightning_matrixfsdp import checkpoint as C

    root, ref = saved
    # a plain state_dict file, also under another prefix (a LightningModule holding the model as .model)
    model, _ = _load(root, "plain.pt", with_opt=False)
    assert all(torch.equal(p, ref["params"][n]) for n, p in model.named_parameters())

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = TinyLM()

    import lightning_matrixfsdp as mf

    w = mf.matrix_shard(Wrap())
    assert C.load_sharded(w, root / "plain.pt") is None  # weights only
    assert all(torch.equal(p, ref["params"][n[len("model."):]]) for n, p in w.named_parameters())
    # directory -> file (the real CLI, in a fresh interpreter) -> directory -> load
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "lightning_matrixfsdp.consolidate", str(root / "ok"),
                          str(tmp_path / "c.ckpt")], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    ck = torch.load(tmp_path / "c.ckpt", weights_only=True)
    plain = TinyLM()
    plain.load_state_dict(ck["state_dict"])
    opt = mf.Muon(plain.parameters(), **MUON)
    opt.load_state_dict(ck["optimizer_states"][0])
    assert_same_state(full_state(plain, opt), ref)
    assert consolidate.main([str(tmp_path / "c.ckpt"), str(tmp_path / "back")]) == 0
    assert C.read_sidecar(tmp_path / "back")["world_size"] == 1
    model, opt = _load(tmp_path, "back")
    assert_same_state(full_state(model, opt), ref)


@pytest.mark.parametrize("name", ["SOAP", "Shampoo"])
def test_library_optimizer_state_round_trip(name, tmp_path):
    """Shampoo/SOAP keep flat, dotted state keys ("name.i"): both formats restore them exactly."""
    pytest.importorskip("pytorch_optimizer")
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp import checkpoint as C

    kw = {"SOAP": dict(precondition_frequency=2), "Shampoo": dict(start_preconditioning_step=2,
                                                                   preconditioning_compute_steps=2)}[name]

    def make(seed):
        torch.manual_seed(seed)
        model = mf.matrix_shard(TinyLM(layers=1))
        return model, mf.route_optimizer(getattr(mf, name)(model.parameters(), lr=1e-3, **kw))

    model, opt = make(0)
    _train(model, opt, 3)
    C.save_sharded(model, tmp_path / "d", [opt])
    C.save_sharded(model, tmp_path / "f.ckpt", [opt], full=True)
    ref = full_state(model, opt)
    assert any("." in k for s in ref["state"].values() for k in s), "expected the library's dotted state keys"
    _train(model, opt, 1, start=3)
    for src in ("d", "f.ckpt"):
        other, o2 = make(1)
        C.load_sharded(other, tmp_path / src, [o2])
        assert_same_state(full_state(other, o2), ref)
        _train(other, o2, 1, start=3)  # the next step lands exactly where the uninterrupted run did
        assert all(torch.equal(p, q) for p, q in zip(other.parameters(), model.parameters()))


def test_tensor_hyperparameters_round_trip(tmp_path):
    """A tensor learning rate is a DCP tensor entry among the param-group objects."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp import checkpoint as C

    model = mf.matrix_shard(TinyLM(layers=1))
    opt = mf.route_optimizer(mf.Muon(model.parameters(), lr=torch.tensor(0.02)))
    _train(model, opt, 1)
    opt.param_groups[0]["lr"] = torch.tensor(0.005)
    C.save_sharded(model, tmp_path / "d", [opt])
    other = mf.matrix_shard(TinyLM(layers=1))
    o2 = mf.route_optimizer(mf.Muon(other.parameters(), lr=torch.tensor(0.02)))
    C.load_sharded(other, tmp_path / "d", [o2])
    assert torch.equal(o2.param_groups[0]["lr"], torch.tensor(0.005))
    assert_same_state(full_state(other, o2), full_state(model, opt))


def _soap_save_w2(rank, world, root):
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp import checkpoint as C

    torch.manual_seed(0)
    model = mf.matrix_shard(TinyLM(layers=1))
    opt = mf.route_optimizer(mf.SOAP(model.parameters(), lr=1e-3, precondition_frequency=2))
    _train(model, opt, 3)
    C.save_sharded(model, os.path.join(root, "soap_w2"), [opt])
    return _ret(full_state(model, opt))


@pytest.mark.parametrize("name", ["SOAP"])
def test_matrix_optimizer_state_reshards_2_to_1(name, tmp_path, dist_pools):
    """SOAP's preconditioner state written by 2 owners loads whole into 1 rank."""
    pytest.importorskip("pytorch_optimizer")
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp import checkpoint as C

    ref = _run(dist_pools, _soap_save_w2, 2, str(tmp_path))[0]
    assert ref["state"] and any("." in k for s in ref["state"].values() for k in s)
    torch.manual_seed(5)
    model = mf.matrix_shard(TinyLM(layers=1))
    opt = mf.route_optimizer(mf.SOAP(model.parameters(), lr=1e-3, precondition_frequency=2))
    C.load_sharded(model, tmp_path / "soap_w2", [opt])
    assert_same_state(full_state(model, opt), ref)
