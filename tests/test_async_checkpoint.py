"""Asynchronous saves (``async_save=True``): the same checkpoints as synchronous saves, completed in order,
failures reported on every rank, crash-safe.

One task on the session's warm 2-process pool (gloo) holds the cross-rank promises; the background
writes are slowed down (``_slow_writes``) so that training, top-k deletions and links really run while a save is pending.
"""
from __future__ import annotations

import os
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from helpers.lit import LitTiny, gather_full
from helpers.models import TinyLM, batch_for, lm_loss

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _slow_writes(delay: float, fail_rank: int = -1, fail_from: int = 0):
    """Background (non-main-thread) DCP writes sleep ``delay`` first; on ``fail_rank`` they fail as a full
    disk from the ``fail_from``-th write on."""
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data
    calls = [0]

    def write_data(self, plan, planner):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(delay)
            calls[0] += 1
            if dist.get_rank() == fail_rank and calls[0] > fail_from:
                raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    FileSystemWriter.write_data = write_data
    return lambda: setattr(FileSystemWriter, "write_data", real)


def _complete(d: Path) -> bool:
    return d.is_dir() and {".metadata", "meta.pt", "matrix_fsdp_layout.json"} <= set(os.listdir(d))


def _flat(x, p=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _flat(v, f"{p}.{k}")
    elif isinstance(x, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in x):
        for i, v in enumerate(x):
            yield from _flat(v, f"{p}.{i}")
    else:
        yield p, x


def _contents(d: Path, tmp: Path) -> dict:
    """Every entry of a published directory: the DCP data (converted independently by torch) and ``meta.pt``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{d.parent.name}-{d.name}.pt"
    dcp_to_torch_save(d, out)
    meta = torch.load(d / "meta.pt", weights_only=False)
    meta.pop("callbacks", None)  # ModelCheckpoint's state names its own directory
    return {**dict(_flat(torch.load(out, weights_only=False))), **{"meta" + k: v for k, v in _flat(meta)}}


def _same(a: dict, b: dict) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        same = (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)) \
            if isinstance(x, torch.Tensor) else x == y
        if not same:
            bad.append(k)
    return bad


class _Lit(LitTiny):
    """Data from (global step, rank): a resumed fit sees the batches of the uninterrupted one."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch_for(self.global_step, self.global_rank), batch_idx)


class _Watch(Callback):
    """At the start of each step, rank 0 looks at the checkpoint directory."""

    def __init__(self, root: Path) -> None:
        self.root, self.seen = root, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.is_global_zero and self.root.is_dir():
            names = [n for n in os.listdir(self.root) if not n.startswith(".") and n != "last.ckpt"]
            last = self.root / "last.ckpt"
            link = None if not os.path.lexists(last) else _complete(last.resolve())
            self.seen.append((batch_idx, sum(_complete(self.root / n) for n in names), link))


def _fit(root: Path, name: str, steps: int, async_save: bool, ckpt_path=None, watch: bool = False):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_matrixfsdp as mf

    torch.manual_seed(0)
    lit = _Lit()
    ck = ModelCheckpoint(dirpath=root / name, filename="{step}", every_n_train_steps=1, save_top_k=2,
                         monitor="step", mode="max", save_last="link")
    callbacks = [ck]
    w = None
    if watch:
        w = _Watch(root / name)
        callbacks.insert(0, w)
    trainer = Trainer(strategy=mf.MatrixFSDPStrategy(log_plan=False, async_save=async_save), accelerator="cpu",
                      devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, default_root_dir=root, callbacks=callbacks)
    trainer.fit(lit, ckpt_path=ckpt_path)
    return lit, trainer, (w.seen if w else None)


def _hsdp(seed: int):
    import lightning_matrixfsdp as mf

    torch.manual_seed(seed)
    model = TinyLM()
    mf.matrix_shard(model, shard_size=1)  # 2 replicas of one shard group; replica_split on ("auto")
    opt = mf.route_optimizer(mf.Muon(model.parameters(), lr=0.02))
    return model, opt


def _train(model, opt, steps: int, start: int = 0) -> None:
    for s in range(start, start + steps):
        x = batch_for(s, dist.get_rank())
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _fabric_round_trip(path: Path) -> bool:
    from lightning.fabric import Fabric

    import lightning_matrixfsdp as mf

    fabric = Fabric(accelerator="cpu", devices=2, strategy=mf.MatrixFSDPFabricStrategy(log_plan=False,
                                                                                        async_save=True))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(TinyLM())
    opt = fabric.setup_optimizers(mf.Muon(model.parameters(), lr=0.02))

    def step(s: int) -> None:
        x = batch_for(s, dist.get_rank())
        fabric.backward(lm_loss(model(x), x))
        opt.step()
        opt.zero_grad()

    step(0)
    undo = _slow_writes(0.3)
    try:
        fabric.save(path, {"model": model, "optimizer": opt, "step": 1})
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        pending = fabric.strategy.async_saver.pending
        step(1)
        rest = fabric.load(path, {"model": model, "optimizer": opt})
    finally:
        undo()
    return pending and rest == {"step": 1} and all(torch.equal(p, saved[n]) for n, p in model.named_parameters())


def _worker(rank, world, root):
    from lightning_matrixfsdp import checkpoint as C
    from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer

    root = Path(root)
    out: dict = {}
    # 1. Trainer: a save every step, sync then async (background writes slowed down: training, the
    #    top-k deletions and the last link all happen while a save is pending)
    sync_lit, _, _ = _fit(root, "sync", 4, False)
    sync_full = gather_full(sync_lit.model)
    undo = _slow_writes(0.4)
    try:
        _, _, seen = _fit(root, "async", 4, True, watch=True)
    finally:
        undo()
    out["seen"] = seen
    out["listing"] = {d: sorted(os.listdir(root / d)) for d in ("sync", "async")}
    # 2. resume from the async step-3 checkpoint: the sync run's last step and final weights
    resumed, _, _ = _fit(root, "resumed", 4, True, ckpt_path=root / "async" / "step=3.ckpt")
    full = gather_full(resumed.model)
    out["resume"] = (resumed.losses == sync_lit.losses[3:] and len(resumed.losses) == 1,
                     all(torch.equal(full[k], sync_full[k]) for k in sync_full) and full.keys() == sync_full.keys())
    # 3. HSDP (replica_split): async and sync saves at the same step, then training goes on at once
    model, opt = _hsdp(0)
    _train(model, opt, 2)
    saver = AsyncCheckpointer()
    undo = _slow_writes(0.3)
    try:
        C.save_sharded(model, root / "hsdp_sync", [opt], extra={"n": 2})
        saver.save_sharded(model, root / "hsdp_async", [opt], extra={"n": 2})
        _train(model, opt, 1, start=2)  # changes every weight while the background write runs
        saver.wait()
    finally:
        undo()
    # 4. a full disk on rank 1 in the background: raised at the next save, on every rank, naming path
    #    and cause; the partial removed, the previous checkpoint intact
    saver.save_sharded(model, root / "lib", [opt], extra={"n": 1})
    saver.wait()
    undo = _slow_writes(0.0, fail_rank=1)
    try:
        saver.save_sharded(model, root / "lib", [opt], extra={"n": 2})  # returns: the failure is in the background
        out["returned"] = True
        try:
            saver.save_sharded(model, root / "other", [opt], extra={"n": 3})
            out["error"] = None
        except C.CheckpointError as e:
            out["error"] = str(e)
    finally:
        undo()
    saver.wait()
    dist.barrier()
    out["lib_left"] = sorted(os.listdir(root))
    # 5. the last save of a fit fails in the background: fit raises, on both ranks
    undo = _slow_writes(0.0, fail_rank=1, fail_from=1)
    try:
        _fit(root, "fails", 2, True)
        out["fit_error"] = None
    except C.CheckpointError as e:
        out["fit_error"] = str(e)
    finally:
        undo()
    # 6. Fabric: fabric.save returns before the write; fabric.load waits and restores the saved step
    out["fabric"] = _fabric_round_trip(root / "fab")
    other, o2 = _hsdp(1)
    out["lib_n"] = C.load_sharded(other, root / "lib", [o2])
    if rank == 0:
        names = out["listing"]["sync"]
        out["diff"] = {n: _same(_contents(root / "sync" / n, root), _contents(root / "async" / n, root))
                       for n in names}
        out["diff"]["hsdp"] = _same(_contents(root / "hsdp_sync", root), _contents(root / "hsdp_async", root))
        out["n_entries"] = len(_contents(root / "hsdp_async", root))
    return pickle.dumps(out)


def test_async_saves_equal_sync_complete_in_order_and_report_failures_on_every_rank(tmp_path, dist_pools):
    results = [pickle.loads(r) for r in dist_pools(2).run(_worker, str(tmp_path), timeout=240)]
    r0 = results[0]
    # the same published checkpoints, tensor for tensor, as the synchronous saves at the same steps
    assert r0["listing"]["async"] == r0["listing"]["sync"] == ["last.ckpt", "step=3.ckpt", "step=4.ckpt"]
    assert os.path.islink(tmp_path / "async" / "last.ckpt") and _complete((tmp_path / "async" / "last.ckpt").resolve())
    assert r0["diff"] == {"last.ckpt": [], "step=3.ckpt": [], "step=4.ckpt": [], "hsdp": []}, r0["diff"]
    assert r0["n_entries"] > 20
    # while saves were pending: never fewer than the 2 top-k checkpoints complete, the link never dangling
    seen = r0["seen"]
    assert [i for i, _, _ in seen] == [1, 2, 3] and seen[-1][1] == 2, seen
    assert all(link in (None, True) for _, _, link in seen), seen
    assert not [p for p in tmp_path.rglob(".mfsdp-*")], "a partial was left behind"
    # resuming from an asynchronous checkpoint continues exactly as the uninterrupted run
    assert r0["resume"] == (True, True)
    # a background failure: raised by the next save on both ranks, naming the path and the cause
    for rank, r in enumerate(results):
        assert r["returned"] and r["error"] is not None, (rank, r["error"])
        assert str(tmp_path / "lib") in r["error"] and "No space left on device" in r["error"], (rank, r["error"])
        assert r["lib_left"] == ["async", "hsdp_async", "hsdp_sync", "lib", "resumed", "sync"], r["lib_left"]
        assert r["lib_n"] == {"n": 1}, "the previous checkpoint must be intact"
        assert r["fit_error"] and str(tmp_path / "fails" / "step=2.ckpt") in r["fit_error"], (rank, r["fit_error"])
        assert "No space left on device" in r["fit_error"]
        assert r["fabric"], "fabric.load must wait for the pending save and restore its state"


# ---------------------------------------------------------------------- one process
_KILLED = """
import os, sys, time, threading
sys.path.insert(0, {tests!r})
import torch
import lightning_matrixfsdp as mf
from torch.distributed.checkpoint import FileSystemWriter
from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer
from helpers.models import TinyLM

target = sys.argv[1]
model = mf.matrix_shard(TinyLM())
saver = AsyncCheckpointer()
saver.save_sharded(model, target, extra={{"n": 1}})
saver.wait()
real = FileSystemWriter.write_data

def stuck(self, plan, planner):
    fut = real(self, plan, planner)
    fut.wait()
    print("WRITTEN", flush=True)  # this rank's data file is on disk; the save is not published
    time.sleep(600)
    return fut

FileSystemWriter.write_data = stuck
saver.save_sharded(model, target, extra={{"n": 2}})
print("RETURNED", flush=True)
time.sleep(600)
"""


def test_sigkill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path):
    import signal
    import subprocess
    import sys

    from conftest import clean_env

    from lightning_matrixfsdp import checkpoint as C

    script = tmp_path / "killed.py"
    script.write_text(_KILLED.format(tests=str(Path(__file__).parent)))
    target = tmp_path / "ck"
    p = subprocess.Popen([sys.executable, str(script), str(target)], env=clean_env(PYTHONWARNINGS="ignore"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line.strip())
            if "WRITTEN" in lines and "RETURNED" in lines:
                break
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert lines == ["RETURNED", "WRITTEN"] or set(lines) == {"RETURNED", "WRITTEN"}, (lines, p.stderr.read())
    partials = [n for n in os.listdir(tmp_path) if n.startswith(C.PARTIAL_PREFIX)]
    assert len(partials) == 1 and any(n.endswith(".distcp") for n in os.listdir(tmp_path / partials[0]))
    assert not C.read_sidecar(target) is None and torch.load(target / C.META_NAME)["n"] == 1
    import lightning_matrixfsdp as mf

    model = mf.matrix_shard(TinyLM())
    assert C.load_sharded(model, target) == {"n": 1}  # intact, loadable, checksums verified
    with pytest.raises(C.CheckpointError):
        C.load_sharded(model, tmp_path / partials[0])  # the partial is no checkpoint
    from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer

    saver = AsyncCheckpointer()
    saver.save_sharded(model, target, extra={"n": 3})
    saver.wait()
    assert sorted(os.listdir(tmp_path)) == ["ck", "killed.py"], "the next save removes the crash's partial"
    assert C.load_sharded(model, target) == {"n": 3}


def test_host_buffers_are_reused_until_the_layout_changes(tmp_path):
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.checkpoint.async_save import AsyncCheckpointer

    model = mf.matrix_shard(TinyLM())
    opt = mf.route_optimizer(mf.Muon(model.parameters(), lr=0.02))
    saver = AsyncCheckpointer()
    saver.save_sharded(model, tmp_path / "a", [opt])  # no optimizer state yet
    first = (saver.staging.nbytes, saver.staging.buffer)
    x = batch_for(0, 0)
    lm_loss(model(x), x).backward()
    opt.step()
    saver.save_sharded(model, tmp_path / "b", [opt])  # momentum buffers now: a new layout
    second = (saver.staging.nbytes, saver.staging.buffer)
    saver.save_sharded(model, tmp_path / "c", [opt])
    third = (saver.staging.nbytes, saver.staging.buffer)
    saver.close()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert first[0] >= params and second[0] > first[0] + params // 2, (first, second, params)
    assert third[0] == second[0] and third[1] is second[1], "the same layout must reuse the buffer"
    assert second[1] is not first[1]


def test_async_checkpoint_io_and_a_file_format_are_refused():
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    import lightning_matrixfsdp as mf

    with pytest.raises(ValueError, match=r"async_save=True"):
        Trainer(strategy=mf.MatrixFSDPStrategy(), plugins=[AsyncCheckpointIO()], accelerator="cpu", devices=1,
                logger=False)
    with pytest.raises(mf.MatrixShardError, match="save_distributed_checkpoint"):
        mf.MatrixFSDPStrategy(async_save=True, save_distributed_checkpoint=False)
