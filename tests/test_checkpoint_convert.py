"""Conversion between the directory and the single-file formats: tied weights, weights-only exports.

World 1, in this process (the converter needs no process group).
"""
from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import LightningModule

from helpers.models import TinyLM, batch_for, lm_loss

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
MUON = dict(lr=0.02, weight_decay=0.1)


class LitTied(LightningModule):
    """A LightningModule whose LM head shares the token embedding (``head.weight = tok.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM(tied=True)

    def forward(self, x):
        return self.model(x)


def _trained_tied():
    import lightning_matrixfsdp as mf

    torch.manual_seed(0)
    lit = LitTied()
    assert lit.model.head.weight is lit.model.tok.weight
    mf.matrix_shard(lit.model)
    opt = mf.route_optimizer(mf.Muon(lit.parameters(), **MUON))
    for s in range(2):
        x = batch_for(s, 0)
        lm_loss(lit(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return lit, opt


def _same_native(a: dict, b: dict) -> None:
    """Two optimizer states in torch's native format hold the same entries (``differentiable``:
    torch's ``load_state_dict`` fills it in with its own default)."""
    def groups(s):
        return [{k: v for k, v in g.items() if k != "differentiable"} for g in s["param_groups"]]

    assert groups(a) == groups(b)
    assert a["state"].keys() == b["state"].keys()
    for i, s in a["state"].items():
        assert s.keys() == b["state"][i].keys()
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][i][k])), (i, k)


def test_tied_weights_survive_directory_to_file_and_back(tmp_path):
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp import checkpoint as C
    from lightning_matrixfsdp import consolidate

    lit, opt = _trained_tied()
    x = batch_for(99, 0)
    with torch.no_grad():
        ref_out = lit(x)
    C.save_sharded(lit, tmp_path / "d", [opt])
    C.save_sharded(lit, tmp_path / "direct.ckpt", [opt], full=True)
    side = C.read_sidecar(tmp_path / "d")
    assert side["params"]["model.head.weight"]["alias_of"] == "model.tok.weight"

    assert consolidate.main([str(tmp_path / "d"), str(tmp_path / "c.ckpt")]) == 0
    ck = torch.load(tmp_path / "c.ckpt", weights_only=True)
    # the LightningModule recipe of the docs, strictly: every tied name is there
    plain = LitTied()
    plain.load_state_dict(ck["state_dict"], strict=True)
    assert plain.model.head.weight is plain.model.tok.weight  # loading kept the tie
    with torch.no_grad():
        assert torch.equal(plain(x), ref_out)
    plain_opt = mf.Muon(plain.parameters(), **MUON)
    plain_opt.load_state_dict(ck["optimizer_states"][0])
    # the conversion equals the direct single-file export (keys, tensors, optimizer state)
    direct = torch.load(tmp_path / "direct.ckpt", weights_only=True)
    assert list(ck["state_dict"]) == list(direct["state_dict"])
    assert all(torch.equal(ck["state_dict"][k], v) for k, v in direct["state_dict"].items())
    _same_native(ck["optimizer_states"][0], direct["optimizer_states"][0])

    # file -> directory keeps the tie recorded (stored once) and loads strictly into a sharded tied model
    assert consolidate.main([str(tmp_path / "c.ckpt"), str(tmp_path / "back")]) == 0
    back = json.loads((tmp_path / "back" / C.SIDECAR_NAME).read_text())
    assert back["params"]["model.head.weight"].get("alias_of") == "model.tok.weight"
    torch.manual_seed(5)
    other = LitTied()
    mf.matrix_shard(other.model)
    other_opt = mf.route_optimizer(mf.Muon(other.parameters(), **MUON))
    C.load_sharded(other, tmp_path / "back", [other_opt], strict=True)
    with torch.no_grad():
        assert torch.equal(other(x), ref_out)
    _same_native(other_opt.state_dict(), opt.state_dict())


def test_weights_only_conversion_drops_training_state(tmp_path):
    from lightning_matrixfsdp import checkpoint as C
    from lightning_matrixfsdp import consolidate

    lit, opt = _trained_tied()
    extra = {"epoch": 3, "global_step": 7, "loops": {"fit_loop": {"x": 1}}, "callbacks": {"cb": {"y": 2}},
             "lr_schedulers": [{"last_epoch": 7}], "pytorch-lightning_version": "2.6.6"}
    C.save_sharded(lit, tmp_path / "d", [opt], extra=extra)
    training = ("optimizer_states", "lr_schedulers", "loops", "callbacks")
    # directory -> file
    assert consolidate.main([str(tmp_path / "d"), str(tmp_path / "w.ckpt"), "--weights-only"]) == 0
    w = torch.load(tmp_path / "w.ckpt", weights_only=True)
    assert not [k for k in training if k in w], sorted(w)
    assert (w["epoch"], w["global_step"]) == (3, 7) and "model.tok.weight" in w["state_dict"]
    # file -> directory
    assert consolidate.main([str(tmp_path / "d"), str(tmp_path / "full.ckpt")]) == 0
    assert all(k in torch.load(tmp_path / "full.ckpt", weights_only=True) for k in training)
    assert consolidate.main([str(tmp_path / "full.ckpt"), str(tmp_path / "wd"), "--weights-only"]) == 0
    meta = torch.load(tmp_path / "wd" / C.META_NAME, weights_only=True)
    assert not [k for k in training if k in meta], sorted(meta)
    assert (meta["epoch"], meta["global_step"]) == (3, 7)
    assert not C.read_sidecar(tmp_path / "wd")["optimizers"]


def test_one_process_save_load_and_convert_print_no_dcp_warning(tmp_path):
    # One process is a supported use (conversion, a single-rank run); DCP's "torch.distributed
    # is disabled" warning would only alarm there.
    import warnings

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.checkpoint.consolidate import convert

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    mf.matrix_shard(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mf.save_sharded(m, tmp_path / "ck")
        mf.load_sharded(m, tmp_path / "ck")
        convert(tmp_path / "ck", tmp_path / "ck.pt")
        convert(tmp_path / "ck.pt", tmp_path / "ck2")
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]
