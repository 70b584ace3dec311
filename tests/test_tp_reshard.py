"""Tensor-parallel checkpoints loaded at another (data-parallel, tensor-parallel) mesh: one
4-process launch (``tp_reshard_scenarios.worker``, gloo, float32) and one load in this process.

* (2, 2) -> (4, 1), (2, 2) -> (1, 4), and (4, 1) -> (2, 2) from the directory and from a
  consolidated file, for Muon (fragment state), Shampoo and SOAP (whole-matrix state on the TP
  stepper alone): every weight and state tensor a rank holds equals the saving run's whole
  tensor (or its slice), assembled with plain torch.distributed calls;
* after (2, 2) -> (4, 1), one more Muon step equals DDP Muon written plainly from the oracle;
* (2, 2) -> (1, 1): this process alone (no process group) loads the directory, and logs the
  mesh change;
* Muon, Shampoo and SOAP resume bitwise at the same mesh;
* wrong inputs: a split of another global shape, fragment state of the wrong shape.
"""
from __future__ import annotations

import logging
import shutil
import tempfile

import pytest

from helpers.tp_reshard_scenarios import KINDS, load_at_one_process, worker


@pytest.fixture(scope="module")
def launch(dist_pools):
    """The one launch, a task of the session's 4-process pool (its directory kept for the
    one-process load); a failure is kept too."""
    root = tempfile.mkdtemp(prefix="tp-reshard-")
    try:
        res, err = dist_pools(4).run(worker, root, timeout=600), None
    except AssertionError as e:
        res, err = None, e
    yield root, res, err
    shutil.rmtree(root, ignore_errors=True)


def _results(launch):
    root, res, err = launch
    if err is not None:
        raise err
    return res


def _ok(got, where):
    assert got["checked"] > 0 and not got["bad"], (where, got["bad"][:5])


def _holders_per_split_matrix(res, kind, case):
    """Whole-matrix state on exactly one of the two TP ranks holding a split matrix; Muon's
    momentum (fragment state) on both."""
    counts: dict = {}
    for r in res:
        for n, held in r[kind][case]["holders"].items():
            counts.setdefault(n, []).append(held)
    want = 2 if kind == "muon" else 1
    assert len(counts) == 11 and all(sum(c) == want and len(c) == 2 for c in counts.values()), counts


@pytest.mark.parametrize("kind", KINDS)
def test_tp_checkpoint_loads_without_tp_every_tensor_the_whole_one(launch, kind):
    for rank, r in enumerate(_results(launch)):
        _ok(r[kind]["22_to_41"], (rank, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_tp_checkpoint_loads_at_another_tp_size(launch, kind):
    """(2, 2) -> (1, 4): every rank one TP rank of the one owner; whole state on one of the four."""
    res = _results(launch)
    for rank, r in enumerate(res):
        _ok(r[kind]["22_to_14"], (rank, kind))
    counts: dict = {}
    for r in res:
        for n, held in r[kind]["22_to_14"]["holders"].items():
            counts.setdefault(n, []).append(held)
    want = 4 if kind == "muon" else 1
    assert len(counts) == 11 and all(sum(c) == want and len(c) == 4 for c in counts.values()), counts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["41_to_22", "file_to_22"])
def test_checkpoint_without_tp_loads_into_tp_fragments_and_whole_state_on_the_stepper(launch, kind, source):
    res = _results(launch)
    for rank, r in enumerate(res):
        _ok(r[kind][source], (rank, kind, source))
    _holders_per_split_matrix(res, kind, source)


def test_a_step_after_the_mesh_change_equals_ddp_muon(launch):
    for rank, r in enumerate(_results(launch)):
        _ok(r["muon"]["continued_step"], rank)


@pytest.mark.parametrize("kind", KINDS)
def test_tp_checkpoint_loads_at_one_process(launch, kind, caplog):
    root = launch[0]
    _results(launch)
    with caplog.at_level(logging.INFO, logger="lightning_matrixfsdp.checkpoint.load"):
        got = load_at_one_process(root, kind)
    _ok(got, kind)
    assert any("resharding from mesh (data_parallel=2, tensor_parallel=2)" in m and
               "to mesh (data_parallel=1, tensor_parallel=1)" in m for m in caplog.messages), caplog.messages


@pytest.mark.parametrize("kind", KINDS)
def test_resume_at_the_same_mesh_is_bitwise(launch, kind):
    """SOAP's resume with TP (Muon's and Shampoo's are in test_tensor_parallel.py too), on the model
    whose head fragment has the shape of a whole-matrix state tensor."""
    for rank, r in enumerate(_results(launch)):
        _ok(r[kind]["resume"], (rank, kind))


def test_wrong_shapes_are_refused_naming_the_key_and_both_shapes(launch):
    for r in _results(launch):
        msg = r["errors"]["global_shape"]
        assert "head.weight" in msg and "(4, 8)" in msg and "(6, 8)" in msg, msg
        msg = r["errors"]["fragment_state"]
        assert "'momentum_buffer' of 'blocks.0.qkv.weight'" in msg and "(12, 8)" in msg and "(24, 8)" in msg, msg
        msg = r["errors"]["saved_split"]
        assert "'momentum_buffer' of 'blocks.0.qkv.weight'" in msg and "split over tensor parallelism at the save" in msg


def test_per_fragment_state_that_cannot_be_joined_is_refused_at_the_save(launch):
    """Adafactor over TP-split matrices keeps row and column factors per fragment; a save (directory or
    one file) would keep one TP rank's and drop the others', so it raises on every rank naming the state."""
    for r in _results(launch):
        for full in (False, True):
            msg = r["errors"][f"adafactor_full={full}"]
            assert "cannot be joined" in msg and ("'row_var'" in msg or "'col_var'" in msg), msg
