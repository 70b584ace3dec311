"""Lightning's checkpoint paths with a tensor-parallel model, at world 4 = data parallel 2 x tensor
parallel 2 (gloo, float32), in one 4-process launch (``tp_lightning_scenarios.worker``); each test
reads its part. The model is ``tp_reference.Net`` parallelized in ``configure_model`` (colwise and
rowwise layers, a fused QKV, uneven splits, a matrix TP leaves whole), trained with Shampoo
(whole-matrix state on the TP stepper, fragment state elsewhere) or Muon.

* Trainer: ``ModelCheckpoint`` saves directories; ``fit(ckpt_path=<epoch 0>)`` ends bitwise where
  the uninterrupted fit ends (every rank's weights and optimizer state, the losses of the resumed
  steps, the global step); the module's ``on_save_checkpoint`` / ``on_load_checkpoint`` see this
  rank's views (its fragment where owned, else empty); ``trainer.save_checkpoint`` writes the
  global tensors, compared with the fragments gathered here with plain ``torch.distributed``;
  ``async_save=True`` writes the same tensors as the synchronous save; Lightning's single-file
  format (``save_distributed_checkpoint=False``) holds the whole tensors the test gathers and a fit
  resumed from it ends bitwise where the uninterrupted fit ends.
* Weight averaging: ``WeightAveraging`` (EMA): the final weights equal the EMA written out here
  over each step's weights, and a resumed fit ends where the uninterrupted one does;
  ``StochasticWeightAveraging`` (its copy made before the TP plan): the running mean written out here,
  also after a resume.
* Fabric: ``fabric.save`` / ``fabric.load`` round-trip bitwise, synchronous and asynchronous (same
  content on disk).
"""
from __future__ import annotations

import pytest

from helpers.dist import PoolTask
from helpers.tp_lightning_scenarios import worker

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


# every test reads its part of the one launch, a task of the session's 4-process pool
_LAUNCH = PoolTask(worker, timeout=600)


@pytest.fixture(autouse=True)
def _pool(dist_pools):
    _LAUNCH.pool = dist_pools(4)


def test_trainer_resume_from_a_model_checkpoint_is_bitwise_the_uninterrupted_fit():
    for rank, r in enumerate(_LAUNCH.results()):
        t = r["trainer"]
        assert t["states"] > 0 and not t["resume_weights"] and not t["resume_state"], (rank, t)
        assert t["whole_states"] > 0, t  # every rank steps some split matrix whole (Shampoo's whole state)
        assert t["steps"] == [0, 1, 2, 3] and t["resumed_steps"] == [2, 3], t
        assert t["losses"], t


def test_lightning_hooks_see_this_ranks_views():
    for rank, r in enumerate(_LAUNCH.results()):
        v = r["trainer"]["views"]
        assert v["keys"] and not v["save"] and not v["load"], (rank, v)


def test_trainer_save_checkpoint_writes_the_global_tensors():
    r0 = _LAUNCH.results()[0]["trainer"]
    assert r0["final_entries"] == 24 and not r0["final"], r0["final"]


def test_async_save_writes_what_the_synchronous_save_writes():
    r0 = _LAUNCH.results()[0]
    for name in ("epoch=0.ckpt", "epoch=1.ckpt"):
        n, bad = r0["trainer"][f"async_{name}"]
        assert n > 24 and not bad, (name, bad)
    n, bad = r0["fabric"]["async_same"]
    assert n > 24 and not bad, bad


def test_single_file_format_holds_whole_tensors_and_resumes_bitwise():
    for rank, r in enumerate(_LAUNCH.results()):
        t = r["trainer"]
        assert not t["file_resume_weights"] and not t["file_resume_state"] and t["file_losses"], (rank, t)
        if rank == 0:
            assert t["file_entries"] > 0 and not t["file_weights"] and t["file_states"] > 0, t


def test_ema_weight_averaging_with_tp_and_its_resume():
    for rank, r in enumerate(_LAUNCH.results()):
        a = r["averaging"]
        assert a["steps"] == 4 and a["averaged"] and not a["oracle"], (rank, a)
        assert not a["resumed"], (rank, a)
    assert any(r["averaging"]["split"] for r in _LAUNCH.results())


def test_swa_with_tp_copy_made_before_the_plan():
    """``StochasticWeightAveraging`` copies the module in its ``setup``, before ``configure_model``
    applies the TP plan: the copy keeps this TP rank's slice; the final weights are the running
    mean written out here, and a fit resumed from epoch 1's checkpoint ends with them too."""
    for rank, r in enumerate(_LAUNCH.results()):
        a = r["averaging"]
        assert a["swa_steps"] == 6 and not a["swa"], (rank, a["swa"])
        assert not a["swa_resumed"], (rank, a["swa_resumed"])  # resumed from epoch 1: the same final weights


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fabric_save_load_round_trip_bitwise(mode):
    for rank, r in enumerate(_LAUNCH.results()):
        f = r["fabric"][mode]
        assert f["states"] > 0 and not f["weights"] and not f["state"], (rank, f)
        assert f["rest"] == {"step": 2}, f


def test_cli_yaml_example_runs_with_tp():
    """examples/tensor_parallel.yaml through LightningCLI's ``fit`` at world 4 (2 steps)."""
    for r in _LAUNCH.results():
        c = r["cli"]
        assert c["steps"] == 2 and c["tp"] == 2 and c["names"] == ("data_parallel", "tensor_parallel"), c
        assert c["tp_bytes"] > 0, c  # split matrices were stepped whole on their TP steppers
