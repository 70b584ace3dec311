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


# ---------------------------------------------------------------------- checksums (B4)
def _flip(path, offset=None) -> None:
    """Flip one byte in the middle of a file (a disk or transfer error)."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _zip_member_offset(path, suffix: str) -> int:
    """A byte inside the data of the zip member whose name ends with ``suffix`` (the tensor bytes)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if i.filename.endswith(suffix)), key=lambda i: i.file_size)
    raw = path.read_bytes()
    name_len = int.from_bytes(raw[info.header_offset + 26: info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28: info.header_offset + 30], "little")
    return info.header_offset + 30 + name_len + extra_len + info.file_size // 2


def test_checksums_recorded_and_verified(saved, tmp_path):
    import zlib

    from lightning_matrixfsdp import checkpoint as C

    side = C.read_sidecar(saved / "ok")
    names = sorted(p.name for p in (saved / "ok").iterdir() if p.name != C.SIDECAR_NAME)
    assert sorted(side["files"]) == names and C.META_NAME in names
    for n, rec in side["files"].items():  # an independent CRC-32 of each whole file, from the chunks
        data = (saved / "ok" / n).read_bytes()
        assert rec["size"] == len(data)
        chunk = rec["chunk"]
        assert rec["crc32"] == [zlib.crc32(data[i:i + chunk]) for i in range(0, max(len(data), 1), chunk)]

    ck = _copy(saved, tmp_path)
    data = sorted(ck.glob("*.distcp"))[0]
    _flip(data)
    model, opt = _sharded(3)
    before = snapshot(model, opt)
    with pytest.raises(C.CheckpointCorruptError, match=rf"checksum mismatch in {data.name}"):
        C.load_sharded(model, ck, [opt])
    assert_bitwise_equal(snapshot(model, opt), before)
    C.load_sharded(model, ck, [opt], verify=False)  # the switch: no verification, loads what is there

    # a consolidated file: torch.save's own per-member CRC-32, checked the same way
    C.save_sharded(model, tmp_path / "f.ckpt", [opt], full=True)
    _flip(tmp_path / "f.ckpt", _zip_member_offset(tmp_path / "f.ckpt", "/data/0"))
    other, o2 = _sharded(4)
    before = snapshot(other, o2)
    with pytest.raises(C.CheckpointCorruptError, match=r"f\.ckpt is damaged: .*data/0"):
        C.load_sharded(other, tmp_path / "f.ckpt", [o2])
    assert_bitwise_equal(snapshot(other, o2), before)
    from lightning_matrixfsdp import consolidate

    with pytest.raises(C.CheckpointCorruptError, match="damaged"):
        consolidate.convert(tmp_path / "f.ckpt", tmp_path / "f_dir")
    with pytest.raises(C.CheckpointCorruptError, match=rf"checksum mismatch in {data.name}"):
        consolidate.convert(ck, tmp_path / "c.ckpt")
    assert consolidate.main([str(ck), str(tmp_path / "c.ckpt"), "--no-verify"]) == 0
