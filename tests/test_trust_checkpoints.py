"""Checkpoints a user can trust (issue 31): no lost asynchronous save, failures on every rank,
no pretrained re-read on resume, Lightning's ``load_from_checkpoint`` on a directory, the first
asynchronous save's host buffer allocated ahead.

* A script run as its own 2-rank Trainer job (Lightning's launcher, real interpreter exit): an
  ``async_save`` whose background write is slowed down is read at once by a new Trainer
  (``fit(ckpt_path=...)``) and by ``LightningModule.load_from_checkpoint`` on rank 0 alone, and
  one is still pending when the script ends. Beside it the same steps with synchronous saves;
  checkpoints are compared through torch's own converter (``dcp_to_torch_save``). It is started
  first and runs beside the task below (its slowed-down writes leave the CPU to it).
* One task on the session's warm 2-process pool (gloo) for the rest: a log directory that cannot be created (a path under
  a regular file, which fails for root too), a synchronous save there, ``PretrainedWeights``
  resuming with its file deleted (against the uninterrupted run), the reserved host buffer.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.dist import PoolTask

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TESTS = Path(__file__).resolve().parent

# ---------------------------------------------------------------------- the race, as its own job
_RACE = r'''
import os, pickle, sys, threading, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
from lightning.pytorch import Trainer
from torch.distributed.checkpoint import FileSystemWriter
import lightning_matrixfsdp as mf
from helpers.lit import LitTiny, gather_full
from helpers.models import batch_for

root = Path(sys.argv[1])
real = FileSystemWriter.write_data


def slow(self, plan, planner):  # the background write starts late: any read would overtake it
    if threading.current_thread() is not threading.main_thread():
        time.sleep({delay})
    return real(self, plan, planner)


class Lit(LitTiny):
    def training_step(self, batch, batch_idx):  # data by (step, rank): a resume sees the same batches
        return super().training_step(batch_for(self.global_step, self.global_rank), batch_idx)


def trainer(steps, async_save):
    return Trainer(strategy=mf.MatrixFSDPStrategy(log_plan=False, async_save=async_save), accelerator="cpu",
                   devices=2, max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   limit_val_batches=0, enable_checkpointing=False, default_root_dir=root)


out = {{}}
for mode in ("sync", "async"):
    torch.manual_seed(0)
    t = trainer(1, mode == "async")
    t.fit(Lit())
    rank = t.global_rank
    if mode == "async":
        FileSystemWriter.write_data = slow
    t.save_checkpoint(root / f"{{mode}}-1")
    if mode == "async":
        out["pending_at_resume"] = t.strategy.async_saver.pending
    torch.manual_seed(1)  # another init: the resume must replace it
    lit = Lit()
    trainer(2, mode == "async").fit(lit, ckpt_path=root / f"{{mode}}-1")
    full = gather_full(lit.model)
    if rank == 0:
        torch.save(full, root / f"{{mode}}-resumed.pt")
out["resumed_steps"] = len(lit.losses)
t.save_checkpoint(root / "async-2")
out["pending_at_load"] = t.strategy.async_saver.pending
if rank == 0:  # the common rank-0-only read, while rank 1 goes on
    torch.save(Lit.load_from_checkpoint(root / "async-2").state_dict(), root / "loaded.pt")
t.save_checkpoint(root / "at-exit")
out["pending_at_exit"] = t.strategy.async_saver.pending
os.write(1, f"RESULT {{rank}} {{out!r}}\n".encode())  # one write: both ranks print to one pipe
'''


def _weights(ck: Path, tmp: Path) -> dict:
    """The model state of checkpoint directory ``ck``, read by torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ck.name}.torch.pt"
    dcp_to_torch_save(ck, out)
    return torch.load(out, weights_only=False)["state_dict"]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def race(tmp_path_factory):
    """The race script, started in the background as soon as the module needs it: most of its time is
    the slowed-down writes (sleeps), which the 2-process task below fills; its test waits for it last."""
    from conftest import clean_env

    tmp_path = tmp_path_factory.mktemp("race")
    root = tmp_path / "run"
    root.mkdir()
    script = tmp_path / "race.py"
    script.write_text(_RACE.format(tests=str(TESTS), delay=3.0))
    env = clean_env(PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
                    PYTHONWARNINGS="ignore")
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:  # files: no pipe to fill
        proc = subprocess.Popen([sys.executable, str(script), str(root)], env=env, stdout=out, stderr=err, text=True)
    yield tmp_path, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------- one 2-process task
def _lit():
    from helpers.lit import LitTiny
    from helpers.models import batch_for

    class Lit(LitTiny):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch_for(self.global_step, self.global_rank), batch_idx)

    return Lit()


def _trainer(root: Path, steps: int, callbacks=(), async_save: bool = False, **kw):
    from lightning.pytorch import Trainer

    import lightning_matrixfsdp as mf

    opts = dict(logger=False, enable_checkpointing=False, limit_val_batches=0)
    opts.update(kw)
    return Trainer(strategy=mf.MatrixFSDPStrategy(log_plan=False, async_save=async_save), accelerator="cpu",
                   devices=2, max_steps=steps, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=root, callbacks=list(callbacks), **opts)


def _pretrained(rank: int, root: Path) -> dict:
    """PretrainedWeights: a fresh fit reads the file before the sanity check; a resume never reads it."""
    import torch.distributed as dist
    from lightning.pytorch import Callback
    from safetensors.torch import save_file

    import lightning_matrixfsdp as mf
    from helpers.lit import gather_full
    from helpers.models import TinyLM

    file = root / "pretrained.safetensors"
    if rank == 0:
        torch.manual_seed(5)
        save_file({k: v.clone().contiguous() for k, v in TinyLM().state_dict().items()}, str(file))
    dist.barrier()

    class Probe(Callback):
        def __init__(self, pre):
            self.pre, self.at_sanity = pre, None

        def on_validation_start(self, trainer, module):
            if trainer.sanity_checking:
                self.at_sanity = self.pre.loaded is not None

    out: dict = {}
    torch.manual_seed(0)
    pre = mf.PretrainedWeights(str(file), prefix="model.")
    probe = Probe(pre)
    lit = _lit()
    _trainer(root, 2, [pre, probe], limit_val_batches=1, num_sanity_val_steps=1).fit(lit)
    out["fresh"] = (pre.loaded is not None and pre.loaded.files == (str(file),), probe.at_sanity)
    uninterrupted = gather_full(lit.model)
    torch.manual_seed(0)
    t = _trainer(root, 1, [mf.PretrainedWeights(str(file), prefix="model.")])
    t.fit(_lit())
    t.save_checkpoint(root / "pre-1")
    dist.barrier()
    if rank == 0:
        file.unlink()
    dist.barrier()
    torch.manual_seed(0)
    pre = mf.PretrainedWeights(str(file), prefix="model.")
    lit = _lit()
    try:
        _trainer(root, 2, [pre]).fit(lit, ckpt_path=root / "pre-1")
        resumed = gather_full(lit.model)
        out["resume"] = (pre.loaded is None, len(lit.losses) == 1 and _equal(resumed, uninterrupted))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["resume"] = f"{type(e).__name__}: {e}"
    return out


def _reserved_buffer(root: Path) -> dict:
    """async_save: the host buffer exists after the first optimizer step; the first save (step 2)
    stages into that very buffer."""
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Probe(Callback):
        before = after = None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 1:  # after the first step, before any save
                st = trainer.strategy.async_saver.staging
                self.before = (st.buffer, st.nbytes, st.allocations)

        def on_train_end(self, trainer, module):  # the save at step 2 has staged its state
            st = trainer.strategy.async_saver.staging
            self.after = (st.buffer, st.nbytes, st.allocations)

    probe = Probe()
    ck = ModelCheckpoint(dirpath=root / "reserved", every_n_train_steps=2, save_top_k=-1)
    _trainer(root, 2, [probe, ck], async_save=True, enable_checkpointing=True).fit(_lit())
    (b_buf, b_n, b_allocs), (a_buf, a_n, a_allocs) = probe.before, probe.after
    return {"before": (b_buf is not None, b_n, b_allocs), "after": (a_buf is b_buf, a_n, a_allocs),
            "saved": sorted(os.listdir(root / "reserved"))}


def _worker(rank: int, world: int, root: str) -> bytes:
    from lightning.pytorch.loggers import CSVLogger

    root = Path(root)
    out: dict = {"pretrained": _pretrained(rank, root), "reserved": _reserved_buffer(root)}
    blocker = root / "a-file"  # a folder nobody can create, root included: its parent is a regular file
    if rank == 0:
        blocker.write_text("not a folder")
    t = _trainer(root, 1)
    t.fit(_lit())
    try:
        t.save_checkpoint(blocker / "ck")
        out["save"] = None
    except Exception as e:  # noqa: BLE001
        out["save"] = (type(e).__name__, str(e))
    try:  # last: before the fix, rank 1 is left in a barrier that rank 0 never reaches
        _trainer(root, 1, logger=CSVLogger(save_dir=str(blocker / "logs"))).fit(_lit())
        out["logger"] = None
    except Exception as e:  # noqa: BLE001
        out["logger"] = (type(e).__name__, str(e))
    return pickle.dumps(out)


@pytest.fixture(scope="module")
def launch(tmp_path_factory, race, dist_pools):  # the race script starts first and runs beside this task
    pytest.importorskip("safetensors")
    root = tmp_path_factory.mktemp("trust")
    return root, PoolTask(_worker, str(root), timeout=400), dist_pools(2)


def _results(launch) -> list[dict]:
    root, one, pool = launch
    return [pickle.loads(r) for r in one.results(pool)]


def test_an_unwritable_folder_fails_on_every_rank_with_the_same_error_naming_the_path(launch):
    root = launch[0]
    results = _results(launch)
    for what in ("save", "logger"):
        errors = [r[what] for r in results]
        assert all(e is not None for e in errors), (what, errors)
        assert errors[0][0] == errors[1][0] and errors[0][0] in ("NotADirectoryError", "FileExistsError"), errors
        assert all(str(root / "a-file") in msg for _, msg in errors), (what, errors)


def test_pretrained_weights_are_read_before_the_sanity_check_and_not_on_resume(launch):
    for rank, r in enumerate(_results(launch)):
        assert r["pretrained"]["fresh"] == (True, True), (rank, r["pretrained"])
        # the file is gone: the resume must not read it, and it continues as the uninterrupted run
        assert r["pretrained"]["resume"] == (True, True), (rank, r["pretrained"]["resume"])


def test_the_first_async_save_stages_into_the_buffer_reserved_after_the_first_step(launch):
    for rank, r in enumerate(_results(launch)):
        present, nbytes, allocs = r["reserved"]["before"]
        assert present and nbytes > 0 and allocs == 1, (rank, r["reserved"])
        assert r["reserved"]["after"] == (True, nbytes, 1), (rank, r["reserved"])
        assert r["reserved"]["saved"] == ["epoch=0-step=2.ckpt"], r["reserved"]


# ---------------------------------------------------------------------- the race, waited for last
def test_a_pending_async_save_is_waited_for_by_any_reader_and_completes_at_exit(race):
    tmp_path, proc = race
    root = tmp_path / "run"
    proc.wait(timeout=400)
    p = subprocess.CompletedProcess(proc.args, proc.returncode, (tmp_path / "stdout").read_text(),
                                    (tmp_path / "stderr").read_text())
    results = {int(line.split()[1]): eval(line.split(" ", 2)[2])  # noqa: S307 - our own printed dict
               for line in p.stdout.splitlines() if line.startswith("RESULT")}
    assert p.returncode == 0 and sorted(results) == [0, 1], (p.returncode, p.stdout[-3000:], p.stderr[-6000:])
    for rank, r in results.items():  # every read really started while the save was being written
        assert r == {"pending_at_resume": True, "resumed_steps": 1, "pending_at_load": True,
                     "pending_at_exit": True}, (rank, r)
    for bad in ("cannot schedule new futures", "terminate called", "lightning_matrixfsdp:"):
        assert bad not in p.stderr, p.stderr[-6000:]
    # the resume from the asynchronous checkpoint continued exactly as the one from the synchronous
    assert _equal(torch.load(root / "async-resumed.pt"), torch.load(root / "sync-resumed.pt"))
    # load_from_checkpoint (rank 0 alone) and the save pending at exit hold the saved weights
    saved = _weights(root / "sync-1", tmp_path)
    loaded = torch.load(root / "loaded.pt")
    assert _equal(loaded, saved), "load_from_checkpoint must wait for the save and read the directory"
    assert _equal(_weights(root / "at-exit", tmp_path), saved), "the save pending at exit must complete"
    assert not list(root.glob(".mfsdp-*")), "a partial was left behind"


# ---------------------------------------------------------------------- one process
def test_host_staging_reuses_a_buffer_that_fits_and_reallocates_for_a_larger_layout():
    from lightning_matrixfsdp.checkpoint.staging import HostStaging

    st = HostStaging()
    small = {"a": torch.arange(10.0), "b": [torch.ones(3, dtype=torch.int64)]}
    got = st.stage(small)
    first = st.buffer
    assert st.allocations == 1 and torch.equal(got["a"], small["a"]) and torch.equal(got["b"][0], small["b"][0])
    large = {"a": torch.arange(10.0), "c": torch.randn(100, 7)}
    got = st.stage(large)  # a layout that does not fit: a new buffer
    assert st.allocations == 2 and st.buffer is not first and st.nbytes >= 100 * 7 * 4
    assert all(torch.equal(got[k], v) for k, v in large.items())
    second = st.buffer
    other = {"z": torch.arange(50, dtype=torch.float64).reshape(5, 10)}
    got = st.stage(other)  # another layout that fits: the same buffer, sliced anew
    assert st.allocations == 2 and st.buffer is second and torch.equal(got["z"], other["z"])
    st.reserve(st.nbytes + 4096, cuda=False)  # larger than held: allocated in the background
    reserved = st.buffer
    assert st.allocations == 3 and reserved is not second and st.nbytes >= 4096
    got = st.stage(large)
    assert st.allocations == 3 and st.buffer is reserved and all(torch.equal(got[k], v) for k, v in large.items())
    st.reserve(16, cuda=False)  # fits already: nothing new
    assert st.allocations == 3 and st.buffer is reserved
    st.release()
    assert st.buffer is None
