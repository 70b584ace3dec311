"""A tensor-parallel model's whole tensors outside its mesh, at world 4 = D 2 x T 2 (gloo,
float32), every scenario in one 4-process launch (``tp_export_scenarios.worker``):

* the consolidated file of the live TP model (``save_sharded(full=True)``) holds the whole
  weights, Muon's momentum and AdamW's moments of split tails assembled from the TP fragments,
  and Shampoo's whole-matrix state from the TP stepper, equal (``torch.equal``) to an oracle
  assembled in the test with plain ``torch.distributed``; it is the file a model without TP
  writes (loaded into one at D 4 x T 1 and saved back, it is the same);
* ``python -m lightning_matrixfsdp.consolidate`` of the TP checkpoint directory gives the same
  whole tensors and state, and keeps the sidecar's mesh record;
* the safetensors export of the directory and of the file holds the whole weights;
* a directory with Shampoo state of a fragment's shape (the MLP 8 -> 16 -> 8) saves and resumes;
* ``load_pretrained`` of the safetensors export into a fresh TP model gives each rank its slice;
* ``full_model`` gives plain whole tensors, the model runs there as the unsplit model and
  pickles; afterwards it trains on;
* the consolidated file and ``full_model`` under HSDP with TP ((replicate 2 x shard 1) x TP 2).
"""
from __future__ import annotations

import pytest

from helpers.dist import PoolTask
from helpers.tp_export_scenarios import worker


# every test reads its part of the one launch, a task of the session's 4-process pool
_LAUNCH = PoolTask(worker, timeout=600)


@pytest.fixture(autouse=True)
def _pool(dist_pools):
    _LAUNCH.pool = dist_pools(4)


def _bad(kind: str, *what: str) -> list:
    """Every rank's mismatches of scenario ``kind`` whose label starts with one of ``what``."""
    out = []
    for rank, r in enumerate(_LAUNCH.results()):
        c = r[kind]
        assert c["weights"] > 0 and c["states"] > 0, (rank, c)
        out += [(rank, *b) for b in c["bad"] if str(b[0]).startswith(what)]
    return out


def test_consolidated_file_of_a_tp_model_holds_whole_weights_and_muon_state():
    assert not _bad("muon", "file", "non-TP load")
    first = _LAUNCH.results()[0]["muon"]
    # the same file a model without TP writes: loaded into one (D 4 x T 1) and saved back, it is unchanged
    assert not first["format_diff"], first["format_diff"][:5]
    assert first["file_mesh"] == {"data_parallel": 2, "tensor_parallel": 2}, first


def test_consolidated_file_of_a_tp_model_holds_shampoo_whole_matrix_state():
    # (its MLP 8 -> 16 -> 8: a TP fragment of the MLP's matrices has the shape of a preconditioner)
    assert not _bad("shampoo", "file", "non-TP load")
    assert not _LAUNCH.results()[0]["shampoo"]["format_diff"]


def test_consolidate_command_and_safetensors_export_of_a_tp_checkpoint_give_whole_tensors():
    for kind in ("muon", "shampoo"):
        assert not _bad(kind, "consolidate", "safetensors")
        # the sidecar's record of the mesh the run had is carried into the file, as the live save writes it
        assert _LAUNCH.results()[0][kind]["conv_mesh"] == {"data_parallel": 2, "tensor_parallel": 2}
        # the file converted back to a directory: the sidecar of one writer, no TP records (whole tensors)
        assert _LAUNCH.results()[0][kind]["back_tp"] == [], _LAUNCH.results()[0][kind]["back_tp"]


def test_tp_directory_with_whole_matrix_state_of_a_fragments_shape_saves_and_resumes():
    assert not _bad("shampoo", "resume")


def test_load_pretrained_of_the_safetensors_export_into_a_tp_model_gives_each_rank_its_slice():
    assert not _bad("muon", "pretrained into TP") and not _bad("shampoo", "pretrained into TP")


def test_full_model_gives_plain_whole_tensors_and_runs_as_the_unsplit_model():
    for rank, r in enumerate(_LAUNCH.results()):
        f = r["full_model"]
        assert f["checked"] > 0 and not f["bad"], (rank, f["bad"][:5])


def test_hsdp_with_tp_consolidated_file_and_full_model_hold_the_whole_tensors():
    assert not _bad("hsdp", "file", "full_model")
