"""Tensor parallelism x owner sharding at world 4 = data parallel 2 x tensor parallel 2 (gloo,
float32): every scenario in one launch (``_LAUNCH``, a task of the session's 4-process pool),
each test reads its part.

* step oracle (Muon, Shampoo, SOAP): after each of 3 steps every fragment a rank holds, and its
  optimizer state, equal the slice of a whole-matrix step on the gathered gradient, taken by the
  unwrapped library / ``torch.optim.Muon`` written out here (``torch.equal``);
* trajectory: 8 steps bitwise equal to ``tp_reference.Reference`` (DP mean + the same TP plan +
  whole-matrix Muon), and the blockwise reference (each fragment orthogonalized alone) is not;
* bytes: ``step()`` talks only inside the TP group (every send/recv peer is a TP peer, no
  collective), and the TP bytes equal the formula of docs/tensor-parallel.md;
* HSDP with TP: (replicate 2 x shard 1) x TP 2 equals the same reference;
* checkpoints: save at (D, T), resume bitwise at (D, T); a sidecar recording another mesh loads
  (resharding: test_tp_reshard.py);
  Lightning's views of the model (save and load) are this TP rank's fragments;
* accumulation with activation checkpointing, the clip's norm over both groups, bf16 compute,
  the refusals, the Trainer and Fabric paths, the plan printout and the ``tp`` byte counters;
* ``zero_missing_grads``, frozen parameters, ``SequenceParallel`` and ``loss_parallel()`` in the
  plan, compiled blocks: each bitwise the reference with the same options; ``grad_norm`` against
  norms of the gathered gradients; a TP group with different plans refused naming the TP group.

The scenarios are written out in ``helpers/tp_scenarios.py`` and ``helpers/tp_compose_scenarios.py``, the reference in
``helpers/tp_reference.py``.
"""
from __future__ import annotations

import pytest

from helpers.dist import PoolTask
from helpers.tp_scenarios import UNSPLIT_TOLERANCE, worker


# every test reads its part of the one launch, a task of the session's 4-process pool
_LAUNCH = PoolTask(worker, timeout=900)


@pytest.fixture(autouse=True)
def _pool(dist_pools):
    _LAUNCH.pool = dist_pools(4)


@pytest.mark.parametrize("kind", ["muon", "shampoo", "soap"])
def test_step_oracle_every_fragment_and_state_is_the_whole_matrix_step(kind):
    for rank, r in enumerate(_LAUNCH.results()):
        got = r[kind]
        assert got["checked"] > 0 and got["state_checked"] > 0, (rank, got)
        assert not got["bad"], (rank, got["bad"][:5])


def test_trajectory_8_steps_bitwise_the_whole_matrix_reference_and_not_blockwise():
    res = [r["trajectory"] for r in _LAUNCH.results()]
    assert all(r["loss_equal"] and r["weights_equal"] for r in res), res
    # negative control: orthogonalizing each fragment alone gives another trajectory
    assert not all(r["blockwise_equal"] for r in res)
    # within a stated tolerance of one-process training of the unsplit model (measured <= 6e-8 after
    # 8 steps, 1.1e-3..1.8e-3 after 20), which the blockwise run is far outside of (measured 0.04..0.07
    # after 8 steps, 0.14..0.16 after 20)
    assert all(r["unsplit_max_diff"] <= UNSPLIT_TOLERANCE for r in res), [r["unsplit_max_diff"] for r in res]
    assert all(r["blockwise_unsplit_max_diff"] > UNSPLIT_TOLERANCE for r in res), res


def test_step_talks_only_inside_the_tp_group_and_tp_bytes_follow_the_formula():
    for rank, r in enumerate(_LAUNCH.results()):
        t = r["trajectory"]
        assert t["calls"] <= {"batch_isend_irecv"}, (rank, t["calls"])  # no collective, no DP traffic
        assert not t["foreign_peers"], (rank, t["foreign_peers"])
        assert all(b == t["expected_bytes"] for b in t["bytes"]), (rank, t["bytes"][:2], t["expected_bytes"])
        assert t["expected_bytes"] != (0, 0)


def test_hsdp_with_tensor_parallelism_equals_the_reference():
    res = [r["hsdp"] for r in _LAUNCH.results()]
    assert all(r["loss_equal"] and r["weights_equal"] for r in res), res


def test_trainer_path_tp_ranks_share_batches_and_equal_the_reference():
    res = [r["trainer"] for r in _LAUNCH.results()]
    assert all(r["names"] == ("data_parallel", "tensor_parallel") for r in res), res
    assert all(len(r["losses"]) == 3 and r["losses"] == r["ref"] for r in res), res
    firsts = [r["first_batch"] for r in res]
    assert firsts[0] == firsts[1] and firsts[2] == firsts[3] and firsts[0] != firsts[2], firsts  # keyed on DP rank


def test_accumulation_and_activation_checkpointing_with_tp_equal_the_reference():
    res = [r["accumulation_checkpointing"] for r in _LAUNCH.results()]
    assert all(r["loss_equal"] and r["weights_equal"] for r in res), res


def test_clipping_takes_the_norm_over_both_groups():
    res = [r["clip"] for r in _LAUNCH.results()]
    assert len({r["total"] for r in res}) == 1, res  # every rank the same total
    for r in res:
        assert r["clipped"] and r["scaled"], r
        assert abs(r["total"] - r["want"]) <= 1e-6 * r["want"], r
        # a list of parameters (the strategies' clip): the TP group comes from the fragments
        assert r["list_total"] == r["total"] and r["list_scaled"], r


def test_partial_and_two_dimensional_placements_are_refused():
    for r in _LAUNCH.results():
        msgs = r["refusals"]
        assert "Partial" in msgs["partial"] and "Shard(0), Shard(1) and Replicate()" in msgs["partial"], msgs
        assert "tensor-parallel mesh only" in msgs["2d"], msgs
        assert "steps each fragment alone" in msgs["torch_muon"], msgs


def test_checkpoint_at_the_same_mesh_resumes_bitwise_and_another_recorded_mesh_loads():
    for rank, r in enumerate(_LAUNCH.results()):
        c = r["checkpoint"]
        assert c["weights"] > 0 and c["states"] > 0 and not c["bad"], (rank, c["bad"][:5])
        assert c["mesh"] == {"data_parallel": 2, "tensor_parallel": 2}, c["mesh"]
        assert c["tp"] and all(v["dim"] in (0, 1) and len(v["sizes"]) == 2 for v in c["tp"].values()), c["tp"]
        assert c["other_mesh"] == "loaded", c["other_mesh"]
        assert c["file_save"] == "no error", c["file_save"]  # the consolidated file: test_tp_export.py
        assert c["lightning_save"] == c["lightning_load"] == "views ok", (c["lightning_save"], c["lightning_load"])


def test_checkpoint_resumes_shampoo_whole_matrix_state_on_the_tp_stepper_alone():
    for rank, r in enumerate(_LAUNCH.results()):
        c = r["checkpoint_shampoo"]
        assert c["weights"] > 0 and c["states"] > 0 and not c["bad"], (rank, c["bad"][:5])


def test_mesh_sizes_must_multiply_to_the_world():
    from lightning_matrixfsdp.adapters.shared import mesh_sizes

    assert mesh_sizes("auto", 1, 4, 4) == (4, 1)
    assert mesh_sizes("auto", "auto", 8, 4) == (2, 4)  # Lightning's "auto": TP over a node's processes
    assert mesh_sizes(2, 2, 4, 4) == (2, 2)
    with pytest.raises(ValueError, match="must equal the world size 4"):
        mesh_sizes(3, 2, 4, 4)
    with pytest.raises(ValueError, match="must divide the world size 4"):
        mesh_sizes("auto", 3, 4, 4)


def test_tp_steppers_balance_newton_schulz_flops_and_localize_keeps_owners():
    from lightning_matrixfsdp.runtime.placement import ParamSpec, UnitSpec
    from lightning_matrixfsdp.runtime.planner import make_plan
    from lightning_matrixfsdp.runtime.tp.layout import TPLayout, chunk_sizes
    from lightning_matrixfsdp.runtime.tp.plan import assign_tp_steppers, localize

    assert chunk_sizes(11, 2) == (6, 5) and chunk_sizes(24, 2) == (12, 12) and chunk_sizes(3, 4) == (1, 1, 1, 0)
    shapes = {"a": (64, 32), "b": (32, 32), "c": (32, 16), "d": (16, 16), "e": (8, 8)}
    unit = UnitSpec("", tuple(ParamSpec(n, s, "float32", True) for n, s in shapes.items()))
    plan = make_plan([unit], 1)  # one owner: every matrix on data-parallel rank 0
    layouts = {n: TPLayout(n, 0, s, chunk_sizes(s[0], 2)) for n, s in shapes.items() if n != "e"}
    layouts["e"] = TPLayout("e", None, shapes["e"], (8, 8))  # replicated: no TP stepper
    tp = assign_tp_steppers(plan, layouts, 2)
    # largest first to the lighter TP rank: a -> 0, b -> 1, c -> 1, d -> 1 (ties to the lower rank)
    assert tp.steppers == {"a": 0, "b": 1, "c": 1, "d": 1}, tp.steppers
    local = localize(plan, layouts, tp_rank=1)
    assert [s.shape for s in local.units[0].shards] == [(32, 32), (16, 32), (16, 16), (8, 16), (8, 8)]
    assert [s.owner for s in local.units[0].shards] == [s.owner for s in plan.units[0].shards]
    assert [s.segment_offset for s in local.units[0].shards] == [0, 1024, 1536, 1792, 1920]


def test_fabric_path_with_tp_equals_the_reference():
    res = [r["fabric"] for r in _LAUNCH.results()]
    assert all(r["names"] == ("data_parallel", "tensor_parallel") and r["same"] for r in res), res


def test_bf16_compute_with_tp_stays_near_the_float32_reference():
    for r in _LAUNCH.results():
        b = r["bf16"]
        assert all(abs(a - w) <= 0.05 * abs(w) for a, w in zip(b["losses"], b["ref"])), b


def test_cli_yaml_builds_the_tp_strategy_and_model(monkeypatch):
    """examples/tensor_parallel.yaml through LightningCLI, parsed and instantiated in this process (its
    4-process ``fit`` runs in test_tp_lightning.py::test_cli_yaml_example_runs_with_tp)."""
    import sys
    from pathlib import Path

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.cli import cli_main
    from lightning_matrixfsdp.demos import TensorParallelGPT

    monkeypatch.setattr(sys, "argv", ["lightning-matrixfsdp"])
    cli = cli_main(["--config", str(Path(__file__).parents[1] / "examples" / "tensor_parallel.yaml")], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, mf.MatrixFSDPStrategy) and strategy.config.tensor_parallel_size == 2
    assert isinstance(cli.model, TensorParallelGPT)


def test_a_tp_group_across_nodes_warns(monkeypatch):
    import warnings

    from lightning_matrixfsdp.runtime.mesh.comm import warn_if_tp_spans_nodes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_tp_spans_nodes([2, 3])  # one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.warns(UserWarning, match="spans nodes"):
        warn_if_tp_spans_nodes([2, 3])


# ---------------------------------------------------------------- everything else keeps working with TP on
# (the scenarios of helpers/tp_compose_scenarios.py, run in the same launch)


def _bitwise(name):
    res = [r[name] for r in _LAUNCH.results()]
    for rank, r in enumerate(res):
        assert r["loss_equal"] and r["weights_equal"], (rank, r["bad"][:5])
    return res


def test_zero_missing_grads_with_tp_equals_the_reference_with_zeros():
    """The MLP (split matrices and biases) left out on one data-parallel rank at a time, and on both:
    the missing gradients count as zeros in the DP mean (the reference adds zeros), bit for bit."""
    from helpers.tp_compose_scenarios import skip_schedule

    assert {len(skip_schedule(s, d)) for s in range(4) for d in range(2)} == {0, 1}  # the schedule skips
    _bitwise("zero_missing")


def test_frozen_split_and_replicated_parameters_with_tp_stay_and_the_rest_equals_the_reference():
    for r in _bitwise("frozen"):
        assert r["frozen_unchanged"] and r["frozen_held"] > 0, r


def test_sequence_parallel_norms_in_the_plan_equal_the_reference_and_the_unsplit_model():
    """``SequenceParallel`` norm (and gate) layers, the residual stream split by rows: bitwise the
    reference with the same plan; within UNSPLIT_TOLERANCE of the unsplit model (measured <= 6e-8
    after 3 steps)."""
    for r in _bitwise("sequence_parallel"):
        assert r["unsplit_max_diff"] <= UNSPLIT_TOLERANCE, r


def test_loss_parallel_with_a_colwise_head_equals_the_reference_and_the_unsplit_model():
    """``loss_parallel()`` cross-entropy on a colwise head's DTensor logits (``use_local_output=False``):
    bitwise the reference with the same plan; within UNSPLIT_TOLERANCE of the unsplit model
    (measured <= 3.1e-4 after 3 steps)."""
    for r in _bitwise("loss_parallel"):
        assert r["unsplit_max_diff"] <= UNSPLIT_TOLERANCE, r


def test_compiled_blocks_with_tp_equal_the_eager_reference():
    """Each block's forward through torch.compile (AOTAutograd, ``aot_eager``): the trajectory is
    the eager reference's bit for bit, one graph and no recompilation."""
    for r in _bitwise("compiled"):
        assert r["graphs"] == 1, r


def test_grad_norm_with_tp_gives_lightnings_keys_with_whole_gradient_norms():
    res = [r["grad_norm"] for r in _LAUNCH.results()]
    for norm_type in ("2", "1", "inf"):
        assert all(r[norm_type]["keys"] for r in res), norm_type  # a frozen parameter has no key
        # float64 partial norms of the fragments vs torch's float32 norm of the whole gradient
        assert all(r[norm_type]["max_rel"] <= 1e-6 for r in res), [r[norm_type]["max_rel"] for r in res]
        assert all(r[norm_type]["got"] == res[0][norm_type]["got"] for r in res)  # the same on every rank


def test_tp_group_with_different_plans_is_refused_naming_the_tp_group():
    for rank, r in enumerate(_LAUNCH.results()):
        msg = r["digest_mismatch"]
        assert "plan mismatch between tensor-parallel group rank 0 and rank 1" in msg, msg
        assert f"global ranks {rank - rank % 2} and {rank - rank % 2 + 1}" in msg, msg
        assert "blocks.1.gate.weight" in msg and "same parallelize plan" in msg, msg


def test_plan_printout_names_each_tp_ranks_load_and_the_byte_counters_have_the_tp_phase():
    """The plan printed at setup (rank 0) names every owner's TP ranks with the Newton-Schulz
    GFLOP they step (computed here from the shapes); ``get_comm_stats`` has the ``tp`` phase with
    3 steps of docs/tensor-parallel.md's bytes, and the Trainer logs them as ``matrix_fsdp/tp_MB``."""
    import re

    res = [r["trainer"] for r in _LAUNCH.results()]
    lines = [line for line in res[0]["printed"] if line.startswith("tensor parallel: T=2")]
    assert len(lines) == 1, res[0]["printed"]
    per_owner = re.findall(r"owner (\d+): ([^;]+)", lines[0])
    found = {(int(o), int(t)): float(g) for o, rest in per_owner for t, g in re.findall(r"tp(\d+) ([0-9.e+-]+)", rest)}
    want = {(o, t): f / 1e9 for o, row in res[0]["loads"].items() for t, f in enumerate(row)}
    assert set(found) == set(want) == {(0, 0), (0, 1), (1, 0), (1, 1)}, (found, want)
    assert all(abs(found[k] - want[k]) <= 1e-3 * want[k] for k in want), (found, want)
    for rank, r in enumerate(res):
        sent, recv = r["expected"]
        assert r["comm_stats"]["tp"]["sent"] == 3 * sent and r["comm_stats"]["tp"]["recv"] == 3 * recv, (rank, r)
    sent, recv = res[0]["expected"]
    assert res[0]["tp_metric"] == [(sent + recv) / 2**20] * 3, res[0]["tp_metric"]
