"""Damaged, incomplete and wrong checkpoints: each ends in a clear error naming the cause, on every
rank, and a failed load or save leaves the model, the optimizers and the previous checkpoint as they were.

The single-process cases run in this process (world 1); the cross-rank ones on 2 gloo processes.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

from helpers.models import TinyLM, batch_for, lm_loss

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


# ---------------------------------------------------------------------- damaged data files, 2 ranks (B4, B9)
def _damage(ck, case: str) -> str:
    """Damage a copy of a 2-rank checkpoint; returns the file a good error names."""
    import json

    from lightning_matrixfsdp import checkpoint as C

    victim = ck / "__1_0.distcp"  # written by rank 1
    if case == "flipped":
        _flip(victim)
    elif case == "truncated":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif case in ("empty_old_sidecar", "truncated_no_sidecar"):
        if case == "empty_old_sidecar":  # a sidecar from before checksums: no sizes to compare
            side = json.loads((ck / C.SIDECAR_NAME).read_text())
            del side["files"]
            (ck / C.SIDECAR_NAME).write_text(json.dumps(side))
            victim.write_bytes(b"")
        else:  # a foreign directory: no sidecar at all
            (ck / C.SIDECAR_NAME).unlink()
            victim.write_bytes(victim.read_bytes()[: victim.stat().st_size - 100])
    elif case == "meta_garbage_old_sidecar":
        side = json.loads((ck / C.SIDECAR_NAME).read_text())
        del side["files"]
        (ck / C.SIDECAR_NAME).write_text(json.dumps(side))
        (ck / C.META_NAME).write_bytes(b"\x80garbage")
        return C.META_NAME
    return victim.name


CASES = ("flipped", "truncated", "empty_old_sidecar", "truncated_no_sidecar", "meta_garbage_old_sidecar")


def _damaged_worker(rank, world, root):
    import pickle
    from pathlib import Path

    from lightning_matrixfsdp import checkpoint as C

    root = Path(root)
    model, opt = _sharded(0)
    _train(model, opt, 2)
    C.save_sharded(model, root / "ok", [opt], extra={"global_step": 2})
    C.save_sharded(model, root / "ok", [opt], extra={"global_step": 2})  # replaces itself cleanly
    names = {}
    if rank == 0:
        for case in CASES:
            shutil.copytree(root / "ok", root / case)
            names[case] = _damage(root / case, case)
    dist.barrier()
    out = {}
    other, o2 = _sharded(1)
    _train(other, o2, 1)  # a live optimizer state that a failed load must not touch
    for case in CASES:
        before = snapshot(other, o2)
        try:
            C.load_sharded(other, root / case, [o2])
            err = None
        except BaseException as e:  # noqa: BLE001 - the test checks the class
            err = e
        out[case] = {"type": type(err).__name__ if err is not None else None,
                     "is_exception": isinstance(err, Exception), "msg": str(err),
                     "untouched": _unchanged(snapshot(other, o2), before)}
    # the intact checkpoint still loads, and gives the saved state
    C.load_sharded(other, root / "ok", [o2])
    out["intact"] = _unchanged(snapshot(other, o2), snapshot(model, opt), loaded=True)
    return pickle.dumps({"cases": out, "names": names})


def _unchanged(a, b, loaded: bool = False) -> bool:
    if loaded:  # torch's load_state_dict fills in ``differentiable`` with its own default
        a, b = ({**x, "groups": [{k: v for k, v in g.items() if k != "differentiable"} for g in x["groups"]]}
                for x in (a, b))
    try:
        assert_bitwise_equal(a, b)
        return True
    except AssertionError:
        return False


def test_damaged_files_raise_on_every_rank_and_leave_model_and_optimizer_untouched(tmp_path, dist_pools):
    import pickle

    results = [pickle.loads(r) for r in dist_pools(2).run(_damaged_worker, str(tmp_path))]
    names = results[0]["names"]
    for rank, r in enumerate(results):
        intact = r["cases"].pop("intact")
        for case, got in r["cases"].items():
            assert got["type"] == "CheckpointCorruptError" and got["is_exception"], (rank, case, got)
            assert names[case] in got["msg"], (rank, case, got["msg"])
            assert got["untouched"], f"rank {rank}: the failed load of {case!r} changed the model or optimizer"
        assert intact, f"rank {rank}: the intact checkpoint did not restore the saved state"
    assert "checksum mismatch" in results[0]["cases"]["flipped"]["msg"]
    assert "truncated" in results[1]["cases"]["truncated"]["msg"]


# ---------------------------------------------------------------------- failed and crashed saves (E11, nothing lost)
def _failed_save_worker(rank, world, root):
    import pickle
    from pathlib import Path

    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_matrixfsdp import checkpoint as C

    root = Path(root)
    model, opt = _sharded(0)
    _train(model, opt, 1)
    C.save_sharded(model, root / "ck", [opt], extra={"global_step": 1})
    saved = snapshot(model, opt)
    _train(model, opt, 1, start=1)
    real = FileSystemWriter.write_data
    if rank == 1:  # this rank's disk fills up while it writes its shard
        def full_disk(self, plan, planner):
            raise OSError(28, "No space left on device")

        FileSystemWriter.write_data = full_disk
    try:
        C.save_sharded(model, root / "ck", [opt], extra={"global_step": 2})
        err = None
    except BaseException as e:  # noqa: BLE001 - the test checks the class
        err = e
    finally:  # the worker process is reused by later tests
        FileSystemWriter.write_data = real
    dist.barrier()
    left = sorted(p.name for p in root.iterdir())
    other, o2 = _sharded(1)
    rest = C.load_sharded(other, root / "ck", [o2])
    return pickle.dumps({"type": type(err).__name__, "is_exception": isinstance(err, Exception), "msg": str(err),
                         "left": left, "rest": rest, "intact": _unchanged(snapshot(other, o2), saved, loaded=True)})


def test_failed_save_raises_everywhere_cleans_up_and_keeps_the_previous_checkpoint(tmp_path, dist_pools):
    import pickle

    results = [pickle.loads(r) for r in dist_pools(2).run(_failed_save_worker, str(tmp_path))]
    for rank, r in enumerate(results):
        assert r["type"] == "CheckpointError" and r["is_exception"], (rank, r["type"], r["msg"])
        assert str(tmp_path / "ck") in r["msg"] and "No space left on device" in r["msg"], r["msg"]
        assert r["left"] == ["ck"], f"the failed save left {r['left']}"
        assert r["rest"] == {"global_step": 1} and r["intact"], "the previous checkpoint must be intact"


_CRASH = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
import torch.distributed.checkpoint as dcp
import lightning_matrixfsdp as mf
from lightning_matrixfsdp import checkpoint as C
from helpers.models import TinyLM

target = sys.argv[1]
model = mf.matrix_shard(TinyLM())
C.save_sharded(model, target, extra={{"n": 1}})
real = dcp.save

def dying(*a, **k):
    real(*a, **k)
    os._exit(17)  # killed after writing its files, before the save is published

dcp.save = dying
C.save_sharded(model, target, extra={{"n": 2}})
"""


def test_partials_of_crashed_saves_are_removed_by_the_next_save_of_the_same_target(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from conftest import clean_env

    from lightning_matrixfsdp import checkpoint as C

    script = tmp_path / "crash.py"
    script.write_text(_CRASH.format(tests=str(Path(__file__).parent)))
    root = tmp_path / "ckpts"
    root.mkdir()

    def crash(name: str) -> set[str]:
        before = {p.name for p in root.iterdir()}
        r = subprocess.run([sys.executable, str(script), str(root / name)], env=clean_env(PYTHONWARNINGS="ignore"),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 17, r.stderr
        return {p.name for p in root.iterdir()} - before - {name}

    left_a, left_b = crash("a.ckpt"), crash("b.ckpt")
    assert len(left_a) == 1 and len(left_b) == 1 and all(n.startswith(C.PARTIAL_PREFIX) for n in left_a | left_b)
    assert torch.load(root / "a.ckpt" / C.META_NAME)["n"] == 1  # the crash left the previous save intact
    model, _ = _sharded(0)
    # a save that fails (the disk is full) frees what the crash left and what it wrote itself
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    FileSystemWriter.write_data = disk_full
    try:
        with pytest.raises(C.CheckpointError, match="No space left"):
            C.save_sharded(model, root / "a.ckpt", extra={"n": 3})
    finally:
        FileSystemWriter.write_data = real
    assert {p.name for p in root.iterdir()} == {"a.ckpt", "b.ckpt"} | left_b
    assert torch.load(root / "a.ckpt" / C.META_NAME)["n"] == 1
    crash("a.ckpt")
    C.save_sharded(model, root / "a.ckpt", extra={"n": 3})
    assert {p.name for p in root.iterdir()} == {"a.ckpt", "b.ckpt"} | left_b, "only a.ckpt's partial goes"
    assert C.load_sharded(model, root / "b.ckpt") == {"n": 1}
    C.save_sharded(model, root / "b.ckpt", full=True)  # a consolidated save of b cleans b's partial too
    assert {p.name for p in root.iterdir()} == {"a.ckpt", "b.ckpt"}


# ---------------------------------------------------------------------- wrong paths and foreign things
def test_wrong_paths_are_refused_and_nothing_is_replaced(saved, tmp_path):
    from lightning_matrixfsdp import checkpoint as C

    model, opt = _sharded(5)
    for bad in (None, 123, ""):
        with pytest.raises(TypeError, match="checkpoint path must be"):
            C.save_sharded(model, bad, [opt])
        with pytest.raises(TypeError, match="checkpoint path must be"):
            C.load_sharded(model, bad, [opt])
    # a directory that is not a checkpoint is never replaced by a save (directory or file)
    data = tmp_path / "my_data"
    data.mkdir()
    (data / "precious.txt").write_text("keep me")
    for full in (False, True):
        with pytest.raises(IsADirectoryError, match="not a checkpoint"):
            C.save_sharded(model, data, [opt], full=full)
        assert (data / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_data"], "the refused saves left files behind"
    # a file where the parent directory should be
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(OSError, match="a_file"):
        C.save_sharded(model, tmp_path / "a_file" / "ck", [opt])
    # a zero-byte file, an empty directory, a sidecar whose file list is garbage, a listed file that is gone
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(C.CheckpointCorruptError, match="empty.ckpt"):
        C.load_sharded(model, tmp_path / "empty.ckpt", [opt])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(C.CheckpointCorruptError, match="without DCP '.metadata'"):
        C.load_sharded(model, tmp_path / "empty_dir", [opt])
    import json

    ck = _copy(saved, tmp_path)
    side = json.loads((ck / C.SIDECAR_NAME).read_text())
    (ck / C.SIDECAR_NAME).write_text(json.dumps({**side, "files": ["not", "a", "map"]}))
    with pytest.raises(C.CheckpointCorruptError, match="'files' is not a map"):
        C.load_sharded(model, ck, [opt])
    (ck / C.SIDECAR_NAME).write_text(json.dumps(side))
    sorted(ck.glob("*.distcp"))[0].unlink()
    with pytest.raises(C.CheckpointCorruptError, match=r"__0_0\.distcp is missing"):
        C.load_sharded(model, ck, [opt])
    # meta.pt holding an object torch.load(weights_only=True) refuses: named, and not called corrupt
    ck2 = _copy(saved, tmp_path, "objects")
    torch.save({"global_step": 1, "obj": _Custom()}, ck2 / C.META_NAME)
    side = json.loads((ck2 / C.SIDECAR_NAME).read_text())
    del side["files"]
    (ck2 / C.SIDECAR_NAME).write_text(json.dumps(side))
    before = snapshot(model, opt)
    with pytest.raises(C.CheckpointError, match=r"meta\.pt.*weights_only") as info:
        C.load_sharded(model, ck2, [opt])
    assert not isinstance(info.value, C.CheckpointCorruptError)
    assert_bitwise_equal(snapshot(model, opt), before)
    assert C.load_sharded(model, ck2, [opt], weights_only=False)["global_step"] == 1


class _Custom:
    """An arbitrary Python object in meta.pt."""


def _mixed_arguments_worker(rank, world, root):
    from lightning_matrixfsdp import checkpoint as C

    model, opt = _sharded(0)
    ck = f"{root}/ck"
    calls = [  # rank 1 passes something else than rank 0: every rank must raise, none may wait
        lambda: C.save_sharded(model, (ck, None)[rank], [opt]),
        lambda: C.save_sharded(model, ck, [opt], full=rank == 1),
        lambda: C.save_sharded(model, ck, [opt][: 1 - rank]),
        lambda: C.save_sharded(model, ck, [opt]),  # agreed: saves
        lambda: C.load_sharded(model, ck, [opt], strict=rank == 0),
        lambda: C.load_sharded(model, ck, [opt], reset_changed_roles=rank == 1),
        lambda: C.load_sharded(model, ck, [opt]),  # agreed: loads
    ]
    out = []
    for call in calls:
        try:
            call()
            out.append(None)
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_a_bad_argument_on_one_rank_raises_on_every_rank(tmp_path, dist_pools):
    results = dist_pools(2).run(_mixed_arguments_worker, str(tmp_path), timeout=120)
    for rank, got in enumerate(results):
        assert got[0] is not None and got[0].startswith("TypeError") and "None" in got[0], (rank, got[0])
        for i, what in ((1, "full"), (2, "optimizers"), (4, "strict"), (5, "reset_changed_roles")):
            assert got[i] is not None and got[i].startswith("ValueError"), (rank, i, got[i])
            assert f"ranks disagree on {what}" in got[i], (rank, got[i])
        assert got[3] is None and got[6] is None, (rank, got)
    assert (tmp_path / "ck" / ".metadata").is_file()


def test_failed_file_save_keeps_the_previous_file(tmp_path, monkeypatch):
    from lightning_matrixfsdp import checkpoint as C

    model, opt = _sharded(0)
    C.save_sharded(model, tmp_path / "f.ckpt", [opt], full=True, extra={"n": 1})

    def full_disk(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/3: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(C.CheckpointError, match=r"writing checkpoint .*f\.ckpt failed: .*file write failed"):
        C.save_sharded(model, tmp_path / "f.ckpt", [opt], full=True, extra={"n": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.ckpt"]
    assert torch.load(tmp_path / "f.ckpt", weights_only=True)["n"] == 1
