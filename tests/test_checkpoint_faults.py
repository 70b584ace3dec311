"""Damaged, incomplete and wrong checkpoints: each ends in a clear error naming the cause, on every
rank, and a failed load or save leaves the model, the optimizers and the previous checkpoint as they were.

The single-process cases run in this process (world 1); the cross-rank ones on 2 gloo processes.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from models import TinyLM, batch_for, lm_loss

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
MUON = dict(lr=0.02, weight_decay=0.1)


def _sharded(seed: int, **model_kw):
    import lightning_matrixfsdp as mf

    torch.manual_seed(seed)
    model = TinyLM(**model_kw)
    mf.matrix_shard(model)
    return model, mf.route_optimizer(mf.Muon(model.parameters(), **MUON))


def _train(model, opt, steps: int, start: int = 0) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    for s in range(start, start + steps):
        x = batch_for(s, rank)
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def snapshot(model, opt) -> dict:
    """Every local parameter and optimizer-state tensor, cloned (what this rank holds)."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for p, s in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"params": params, "state": state, "groups": groups}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for n, t in a["params"].items():
        assert t.dtype == b["params"][n].dtype and torch.equal(t, b["params"][n]), f"parameter {n} changed"
    assert a["state"].keys() == b["state"].keys(), "optimizer state covers other parameters"
    for n, s in a["state"].items():
        assert s.keys() == b["state"][n].keys(), n
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][n][k])), f"optimizer state {n}/{k}"
    assert a["groups"] == b["groups"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from lightning_matrixfsdp import checkpoint as C

    root = tmp_path_factory.mktemp("faults")
    model, opt = _sharded(0)
    _train(model, opt, 1)
    C.save_sharded(model, root / "ok", [opt], extra={"global_step": 1, "epoch": 0})
    return root


def _copy(saved, tmp_path, name="ck"):
    shutil.copytree(saved / "ok", tmp_path / name)
    return tmp_path / name


# ---------------------------------------------------------------------- meta.pt (B2)
def test_missing_meta_is_an_error_naming_the_file(saved, tmp_path):
    from lightning_matrixfsdp import checkpoint as C

    ck = _copy(saved, tmp_path)
    (ck / C.META_NAME).unlink()
    model, opt = _sharded(1)
    with pytest.raises(C.CheckpointCorruptError, match=r"meta\.pt is missing.*step 0"):
        C.load_sharded(model, ck, [opt])
    with pytest.raises(C.CheckpointCorruptError, match=r"meta\.pt is missing"):
        C.load_sharded(model, ck)  # weights only: the directory still is a training checkpoint
    from lightning_matrixfsdp import consolidate

    with pytest.raises(C.CheckpointCorruptError, match=r"meta\.pt is missing"):
        consolidate.convert(ck, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()
    # a directory of weights only (no optimizer, no sidecar, no meta.pt): loads, nothing else to restore
    import torch.distributed.checkpoint as dcp

    src, _ = _sharded(2)
    dcp.save({"state_dict": src.state_dict()}, checkpoint_id=str(tmp_path / "weights"), no_dist=True)
    assert C.load_sharded(model, tmp_path / "weights") is None
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), src.parameters()))
