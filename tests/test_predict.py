"""The step-time predictor (`python -m lightning_matrixfsdp.bench predict`): formulas against
hand-computed values and independent oracles, the calibration against the measured H200
runs in docs/results, the paper comparison the docs quote, the JSON and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_matrixfsdp.bench.predict.cluster import Cluster, ClusterError, cluster
from lightning_matrixfsdp.bench.config import ModelConfig
from lightning_matrixfsdp.bench.model import count_parameters
from lightning_matrixfsdp.bench.predict.modes import (
    MODES, ModelShape, PredictError, all_params, backward_flops, forward_flops, pipeline, plan_for, predict,
    predict_mode, stock_matrix_work,
)
from lightning_matrixfsdp.bench.predict.cli import calibrate, calibration_table, main, paper_comparison

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
TINY = ModelShape("tiny", hidden=8, mlp=16, layers=2, heads=2, seq_len=4, vocab=10)
SHAPES_7B = ModelShape("7b", 4096, 11008, 32, 32, 4096, 32000)  # predict_shape.SHAPES["7b"], written out
ROW_KEYS = {"mode", "nodes", "gpus_per_node", "world", "span", "replicas", "layers", "parameters", "fwd_ms", "bwd_ms",
            "opt_ms", "total_ms", "peak_gib", "fits"}


def toy_cluster(**kw) -> Cluster:
    """Round numbers so expected values can be written by hand."""
    base = dict(name="toy", gpus_per_node=2, nodes=1, matmul_tflops=1e-9, model_eff=1.0, ns_eff_ours=1.0,
                ns_eff_stock=0.5, hbm_gbs=1e-9, muon_bpp=2.0, adamw_bpp=10.0, intra_gbs=1e-9, intra_lat_us=0.0,
                inter_gbs=1e-9, inter_lat_us=0.0, dispatch_us=0.0, gpu_mem_gib=1.0)
    base.update(kw)
    return Cluster(**base)


# ---------------------------------------------------------------- formulas
def test_parameter_count_matches_the_bench_models_closed_form():
    cfg = ModelConfig(vocab_size=10, hidden=8, n_heads=2, mlp_hidden=16, n_layers=2, seq_len=4)
    assert sum(p.numel for p in all_params(TINY)) == count_parameters(cfg) == 1480


def test_flops_by_hand():
    # block: 2 * 4 tokens * (4*64 + 3*128) + causal attention 2 * 1 * 4^2 * 8 = 5120 + 256
    assert forward_flops(TINY) == 2 * 5376 + 2 * 4 * 10 * 8
    assert backward_flops(TINY) == 2 * 11392 + 2 * 5376  # recompute of the blocks under AC
    assert backward_flops(ModelShape("x", 8, 16, 2, 2, 4, 10, ac=False)) == 2 * 11392


def test_stock_muon_collectives_by_hand():
    flops, colls = stock_matrix_work((4, 4), steps=1, span=2)
    assert flops == (4 * 64 + 2 * 64) / 2
    assert colls == [("all_reduce", 4), ("all_gather", 32), ("all_gather", 32), ("all_gather", 32)]
    flops, colls = stock_matrix_work((8, 4), steps=2, span=2)  # tall: transposed, sharded on the contraction
    assert flops == 2 * (4 * 16 * 8 / 2 + 2 * 64)
    assert colls == [("all_reduce", 4)] + [("all_reduce", 32)] * 4
    assert stock_matrix_work((8, 4), steps=2, span=1) == (2 * (4 * 16 * 8 + 2 * 64), [])


def test_collective_costs_by_hand():
    c = toy_cluster(intra_gbs=2.0, inter_gbs=1.0, intra_lat_us=5.0, inter_lat_us=100.0, gpus_per_node=2, nodes=4)
    assert c.all_gather(4e9, 2) == pytest.approx(4e9 * 0.5 / 2e9 + 5e-6)
    assert c.all_gather(4e9, 8) == pytest.approx(4e9 * 7 / 8 / 1e9 + 5e-6 + 3 * 100e-6)  # bound by the NICs
    assert c.all_reduce(4e9, 2) == pytest.approx(2 * 1.0 + 5e-6)
    assert c.replica_all_reduce(1e9, 4) == pytest.approx(2 * 3 / 4 * 1e9 / 0.5e9 + 5e-6 + 300e-6)
    assert c.replica_p2p(3e9, 1e9, 4) == pytest.approx(3e9 / 0.5e9 + 5e-6 + 300e-6)  # the stepper's R-1 inputs
    assert c.all_gather(1e9, 1) == 0.0


def test_pipeline_exposes_the_first_materialization_and_the_slower_resource():
    assert pipeline([1, 1, 1], [0.5, 0.5, 0.5], [0, 0, 0]) == pytest.approx(3.5)  # compute-bound
    assert pipeline([1, 1, 1], [2, 2, 2], [0, 0, 0]) == pytest.approx(7.0)  # link-bound
    # backward: each reduction follows its compute on the same link; the last one is exposed
    assert pipeline([1, 1], [0, 0], [0.25, 0.25]) == pytest.approx(2.25)
    # replica streams: a slow replica all-reduce of the last unit ends the pass
    assert pipeline([1, 1], [0, 0], [0.25, 0.25], rep=[[0.1, 0.2], [0.1, 3.0]]) == pytest.approx(2.25 + 3.0)


def test_owner_step_is_the_busiest_owners_newton_schulz_plus_elementwise():
    c = toy_cluster(gpus_per_node=2)
    plan = plan_for(TINY, 2)
    per_rank = []
    for r in range(2):
        ns = sum(5 * (4 * min(s.shape) ** 2 * max(s.shape) + 2 * min(s.shape) ** 3)
                 for s in plan.shards() if s.owner == r and s.role.value == "matrix")
        mat = sum(s.numel for s in plan.shards() if s.owner == r and s.role.value == "matrix")
        adam = sum(s.numel for s in plan.shards() if s.owner == r and s.role.value == "tail")
        per_rank.append(ns / 1e3 + (2.0 * mat + 10.0 * adam))  # rates of 1e3 FLOP/s and 1 B/s
    row = predict_mode("matrix_fsdp", TINY, c)
    assert row["opt_ms"] == pytest.approx(max(per_rank) * 1e3)
    # FSDP2 + AdamW steps 1/W of every parameter at 10 B/element
    assert predict_mode("fsdp2_adamw", TINY, c)["opt_ms"] == pytest.approx(1480 / 2 * 10.0 * 1e3)


def test_replica_split_divides_the_step_and_the_optimizer_state():
    c = cluster("a100-ib", nodes=4)
    shape = ModelShape("s", 512, 2048, 8, 8, 256, 1000)
    plain = predict_mode("matrix_fsdp_hsdp", shape, c)
    split = predict_mode("matrix_fsdp_hsdp_split", shape, c)
    assert (plain["span"], plain["replicas"]) == (8, 4)
    assert split["opt_ms"] < plain["opt_ms"] / 2
    assert split["peak_gib"] < plain["peak_gib"]
    one = predict_mode("matrix_fsdp_hsdp_split", shape, cluster("a100-ib", nodes=1))
    plain_one = predict_mode("matrix_fsdp_hsdp", shape, cluster("a100-ib", nodes=1))
    assert one["opt_ms"] == pytest.approx(plain_one["opt_ms"])


def test_replica_split_exchange_costs_about_one_copy_per_link_whatever_the_replicas():
    """The chain and the broadcast: a GPU's replica bytes do not grow with R (a fan-in to the
    stepper would move R - 1 copies through its NICs), so the split's backward stays near plain
    HSDP's ring all-reduce from 2 to 16 nodes."""
    from lightning_matrixfsdp.bench.predict.cluster import cluster as make

    c = make("a100-ib")
    assert c.replica_chain(100e6, 100e6, 16, 0, 0) == pytest.approx(c.replica_chain(100e6, 100e6, 2, 0, 0)
                                                                    + 14 * c.inter_lat_us * 1e-6)
    assert c.replica_broadcast(100e6, 16) < 1.1 * c.replica_broadcast(100e6, 2)
    shape = ModelShape("s", 4096, 16384, 2, 32, 4096, 32000)  # units of ~50 MB per GPU: many chunks
    bwd = {n: predict_mode("matrix_fsdp_hsdp_split", shape, make("a100-ib", nodes=n))["bwd_ms"] for n in (2, 16)}
    plain = predict_mode("matrix_fsdp_hsdp", shape, make("a100-ib", nodes=16))["bwd_ms"]
    assert bwd[16] < 1.5 * bwd[2] and bwd[16] < 1.5 * plain, (bwd, plain)


def test_ddp_and_zero1_hold_full_replicas():
    c = cluster("a100-ib", nodes=1)
    ddp, zero1, ours = (predict_mode(m, TINY, c)["peak_gib"] for m in ("ddp_muon", "zero1_owner", "matrix_fsdp"))
    assert ddp > zero1 > ours


# ---------------------------------------------------------------- calibration and the paper
def test_calibration_reproduces_the_preset_constants():
    fit = calibrate(RESULTS)
    c = cluster("h200")
    for key, value in fit.items():
        assert getattr(c, key) == pytest.approx(value, rel=0.01, abs=0.5 if key == "dispatch_us" else 0.05), key


def test_every_measured_phase_within_15_percent():
    rows = calibration_table(RESULTS)
    assert len(rows) == 2 * 6 * 5
    bad = [(r["run"], r["mode"], r["phase"], round(r["ratio"], 3)) for r in rows if not 0.85 <= r["ratio"] <= 1.15]
    assert not bad, bad
    assert sum(r["role"] == "check" for r in rows) == 45  # the rest contain a fitted constant's measurement


def test_paper_table3_cells_within_the_documented_band():
    rows = paper_comparison(cluster("a100-ib"))
    for r in rows:
        for key in ("stock_opt", "ours_opt", "stock_total", "ours_total_broadcast"):
            pred, published = r[key]
            assert 0.67 <= pred / published <= 1.5, (r["nodes"], key, pred, published)


# ---------------------------------------------------------------- JSON, command line, errors
def test_cli_json_has_one_row_per_mode_and_node(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["--model", "onenode", "--cluster", "a100-ib", "--layers", "2", "--nodes", "1", "2",
                 "--json", str(out)]) == 0
    assert "| matrix_fsdp_hsdp_split | 2 | 16 | 8 x 2 |" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert set(data) == {"model", "cluster", "rows"}
    assert [(r["mode"], r["nodes"]) for r in data["rows"]] == [(m, n) for n in (1, 2) for m in MODES]
    for r in data["rows"]:
        assert set(r) >= ROW_KEYS
        assert r["total_ms"] == pytest.approx(r["fwd_ms"] + r["bwd_ms"] + r["opt_ms"])
        assert all(r[k] > 0 for k in ("fwd_ms", "bwd_ms", "opt_ms", "peak_gib"))


def test_weak_scaling_scales_depth_with_nodes():
    rows = predict(TINY, cluster("a100-ib"), [1, 4], ["fsdp2_adamw"], layers_per_node=3)
    assert [r["layers"] for r in rows] == [3, 12]


def test_bench_entry_point_routes_predict_and_keeps_its_own_flags(capsys):
    from lightning_matrixfsdp.bench.__main__ import config_from_args
    from lightning_matrixfsdp.bench.__main__ import main as bench_main

    assert bench_main(["predict", "--model", "paper", "--layers", "2", "--modes", "fsdp2_muon", "matrix_fsdp"]) == 0
    out = capsys.readouterr().out
    assert "| fsdp2_muon | 1 |" in out and "| matrix_fsdp | 1 |" in out
    cfg, nproc = config_from_args(["--preset", "tiny", "--steps", "2", "--nproc", "2"])  # the benchmark's CLI
    assert (cfg.run.steps, nproc) == (2, 2)


@pytest.mark.parametrize("argv, message", [
    (["--modes", "fsdp2_muon", "nonsense"], "unknown mode 'nonsense'"),
    (["--cluster", "a100-ib", "--shard-size", "3", "--modes", "matrix_fsdp_hsdp"],
     "W=3 does not divide the world size 8"),
    (["--inter-gbs", "-1"], "inter_gbs must be positive, got -1.0"),
    (["--gpus-per-node", "0"], "gpus_per_node must be >= 1"),
    (["--heads", "3"], "hidden=4096 is not divisible by heads=3"),
    (["--nodes", "1", "0"], "nodes must be >= 1, got 0"),
    pytest.param(["--measure"], "--measure needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there to measure")),
])
def test_bad_input_is_refused_with_its_cause(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_errors_from_the_api():
    with pytest.raises(PredictError, match="unknown mode 'x'"):
        predict(TINY, cluster("a100-ib"), [1], ["x"])
    with pytest.raises(ClusterError, match="intra_gbs must be positive"):
        cluster("a100-ib").with_(intra_gbs=0.0)
    with pytest.raises(ClusterError, match="unknown cluster preset 'tpu'"):
        cluster("tpu")


# ---------------------------------------------------------------- stock Muon's collectives, observed
def _stock_muon_collectives(rank: int, world: int, shapes: list[tuple[int, int]], steps: int) -> list:
    """Run torch.optim.Muon on Shard(0) DTensor parameters (FSDP2's layout) and record every
    collective DTensor issues, with the local input's bytes."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            name = func.__name__.split(".")[0]
            if func.namespace in ("_c10d_functional", "c10d") and name.startswith(("all_", "reduce")):
                x = args[0]
                self.seen.append((name, x.numel() * x.element_size()))
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (world,))
    out = []
    for shape in shapes:
        torch.manual_seed(0)
        p = torch.nn.Parameter(distribute_tensor(torch.randn(shape, dtype=torch.bfloat16), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(shape, dtype=torch.bfloat16), mesh, [Shard(0)])
        opt = torch.optim.Muon([p], lr=0.01, ns_steps=steps)
        rec = Record()
        with rec:
            opt.step()
        out.append(rec.seen)
    return out


def test_stock_muon_model_matches_what_dtensor_issues(dist_pools):
    shapes, steps, world = [(8, 8), (8, 32), (32, 8)], 2, 2
    seen = dist_pools(world).run(_stock_muon_collectives, shapes, steps, timeout=120)[0]
    for shape, observed in zip(shapes, seen):
        _, model = stock_matrix_work(shape, steps, world)
        # the model counts an all-gather by its output (the whole matrix), DTensor passes each rank's input
        expected = [(k, b // world if k == "all_gather" else b) for k, b in model[1:]]
        big = [(k.replace("_into_tensor", ""), b) for k, b in observed if b > 4]
        assert big == expected, (shape, observed)
        assert sum(b <= 4 for _, b in observed) == 1  # the norm's scalar all-reduce


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from lightning_matrixfsdp.bench.predict.cli import plot_scaling

    rows = predict(TINY, cluster("a100-ib"), [1, 2], ["fsdp2_muon", "matrix_fsdp", "matrix_fsdp_hsdp_split"])
    plot_scaling({"weak_hsdp": rows, "7b": rows, "32b": rows}, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stock_muon_bytes_match_the_bench_count_on_two_h200s():
    """The collectives of the model, counted with the bench's per-rank convention (bench/comm.py),
    against the bytes the bench counted for fsdp2_muon's optimizer step on 2 x H200."""
    from lightning_matrixfsdp.bench.predict.modes import shape_from_bench_config

    run = json.loads((RESULTS / "2026-11-30-h200x2-aa2fc35-onenode" / "bench_onenode_w2_cuda.json").read_text())
    shape, w = shape_from_bench_config(run["config"]), 2
    sent = 0.0
    for p in all_params(shape):
        if p.is_matrix:
            for kind, nbytes in stock_matrix_work(p.shape, shape.ns_steps, w)[1]:
                sent += (w - 1) * nbytes / w if kind == "all_gather" else 2 * (w - 1) / w * nbytes
    measured = run["modes"]["fsdp2_muon"]["bytes"]["optimizer_step"]["max_sent"]
    assert sent == pytest.approx(measured, rel=1e-6)


# ---------------------------------------------------------------- the defaults (issue 22)
def test_auto_is_within_3_percent_of_the_best_explicit_choice_everywhere():
    """collective="auto" / replica_split="auto", as the runtime's chooser resolves them on each
    preset cluster, against the best explicit choice: paper, 7b, 32b on a100-ib and h200, 1-16 nodes."""
    from lightning_matrixfsdp.bench.predict.cli import auto_comparison

    rows = auto_comparison()
    assert len(rows) == 3 * 2 * 5 * 2
    worst = max(rows, key=lambda r: r["ratio"])
    assert worst["ratio"] <= 1.03, worst
    # the rule as the table shows it: p2p on one node, broadcast across; the split from two replicas on
    for r in rows:
        if r["mode"] == "matrix_fsdp_auto":
            assert r["chosen"] == ("matrix_fsdp" if r["nodes"] == 1 else "matrix_fsdp_broadcast"), r
        else:
            assert r["chosen"] == ("matrix_fsdp_hsdp" if r["nodes"] == 1 else "matrix_fsdp_hsdp_split"), r


# ---------------------------------------------------------------- tensor parallelism (issue 21)
ONE = ModelShape("one", hidden=8, mlp=8, layers=1, heads=2, seq_len=4, vocab=0, gated=False, ns_steps=1)


def test_tp_modes_by_hand():
    """One block of six 8x8 matrices and two norms, T = 2 on one node of two GPUs (D = 1), the
    toy cluster's rates (1e3 FLOP/s, 1 B/s of HBM and NVLink, no latency)."""
    from lightning_matrixfsdp.bench.predict.tp import local_shape, predict_tp_mode

    assert local_shape("blocks.0.attn.wq.weight", (8, 8), 2) == (4, 8)  # colwise
    assert local_shape("blocks.0.mlp.down.weight", (8, 16), 2) == (8, 8)  # rowwise
    assert local_shape("embed.weight", (11, 8), 2) == (6, 8)  # vocabulary padded
    assert local_shape("blocks.0.attn_norm.weight", (8,), 2) == (8,)  # replicated
    c = toy_cluster(gpus_per_node=2, nodes=1)
    ns = 4 * 8 * 8 * 8 + 2 * 8 ** 3  # one Newton-Schulz step of an 8x8 matrix: 3072 FLOPs
    # forward: 2 * 4 tokens * 384 matrix elements + causal attention 2 * 16 * 8, at 1e3 FLOP/s,
    # plus 4 TP collectives of the group's 2 * 4 tokens * 8 * 2 bytes = 128 B, each moving 64 B
    fwd, bwd = (3328 / 1e3 + 4 * 64), (3 * 3328 / 1e3 + 8 * 64)  # backward: mirrored + recomputed
    rows = {m: predict_tp_mode(m, ONE, c, tp=2) for m in ("matrix_fsdp_tp", "fsdp2_muon_tp", "megatron_dup_tp")}
    for m, r in rows.items():
        assert (r["tp"], r["dp"]) == (2, 1)
        assert r["fwd_ms"] == pytest.approx(fwd * 1e3), m
        assert r["bwd_ms"] == pytest.approx(bwd * 1e3), m
    elementwise = 6 * 32 * 2.0 + 16 * 10.0  # momentum on 192 matrix elements, AdamW on the 16 norm elements
    # ours: each TP rank orthogonalizes 3 whole matrices; it receives the other half of those (3 x 64 B) and
    # sends its half of the other rank's 3 (3 x 64 B), then the same back
    assert rows["matrix_fsdp_tp"]["opt_ms"] == pytest.approx((3 * ns / 1e3 + elementwise + 2 * 192) * 1e3)
    assert rows["matrix_fsdp_tp"]["step_tp_bytes"] == 2 * (192 + 192)
    assert rows["matrix_fsdp_tp"]["step_dp_bytes"] == 0
    # FSDP2 + TP and duplicated: all six matrices on both ranks at the stock rate (ns_eff 0.5), one
    # TP all-gather of each whole 128 B matrix (64 B through each link)
    redundant = 6 * ns / 500 + elementwise + 6 * 64
    assert rows["fsdp2_muon_tp"]["opt_ms"] == pytest.approx(redundant * 1e3)
    assert rows["megatron_dup_tp"]["opt_ms"] == pytest.approx(redundant * 1e3)
    # batch per TP group: each GPU computes half of one sequence's FLOPs; the collectives carry 64 B (32 B each)
    group = predict_tp_mode("matrix_fsdp_tp", ONE, c, tp=2, per_group=True)
    assert group["fwd_ms"] == pytest.approx((3328 / 2 / 1e3 + 4 * 32) * 1e3)
    assert group["bwd_ms"] == pytest.approx((3 * 3328 / 2 / 1e3 + 8 * 32) * 1e3)
    assert group["opt_ms"] == pytest.approx(rows["matrix_fsdp_tp"]["opt_ms"])
    assert (group["global_batch"], rows["matrix_fsdp_tp"]["global_batch"]) == (1, 2)


@pytest.mark.parametrize("name, nodes, per_group", [("a100-ib", 1, False), ("a100-ib", 2, True), ("h200", 3, False)])
def test_tp_one_is_the_non_tp_prediction_exactly(name, nodes, per_group):
    from lightning_matrixfsdp.bench.predict.tp import TP_BASE, predict_tp_mode

    shape, c = ModelShape("s", 512, 2048, 4, 8, 256, 1000), cluster(name, nodes=nodes)
    for mode, base in TP_BASE.items():
        tp, ref = predict_tp_mode(mode, shape, c, tp=1, per_group=per_group), predict_mode(base, shape, c)
        for key in ("fwd_ms", "bwd_ms", "opt_ms", "total_ms", "peak_gib", "fits"):
            assert tp[key] == ref[key], (mode, key, tp[key], ref[key])


def test_tp_spreads_ours_but_repeats_the_duplicated_newton_schulz():
    """At a fixed world, ours' step stays near T = 1's (each matrix orthogonalized once, spread over
    the TP group) with zero DP bytes; duplicated's grows with T (every TP rank repeats it); the TP
    activation collectives grow with T; ours is the fastest TP mode at every T > 1."""
    from lightning_matrixfsdp.bench.predict.tp import TP_MODES, predict_tp, tp_activation_seconds

    c = cluster("a100-ib", nodes=2)
    rows = {(r["mode"], r["tp"]): r for r in predict_tp(SHAPES_7B, c, [2], TP_MODES, (1, 2, 4, 8))}
    ours = [rows[("matrix_fsdp_tp", t)]["opt_ms"] for t in (1, 2, 4, 8)]
    dup = [rows[("megatron_dup_tp", t)]["opt_ms"] for t in (1, 2, 4, 8)]
    assert max(ours) < 1.15 * ours[0], ours
    assert all(a < b for a, b in zip(dup, dup[1:])), dup
    assert all(rows[("matrix_fsdp_tp", t)]["step_dp_bytes"] == 0 for t in (1, 2, 4, 8))
    act = [tp_activation_seconds(SHAPES_7B, c, t)[0] for t in (1, 2, 4, 8)]
    assert act[0] == 0.0 and all(a < b for a, b in zip(act, act[1:])), act
    for t in (2, 4, 8):
        best = min(TP_MODES, key=lambda m: rows[(m, t)]["total_ms"])
        assert best == "matrix_fsdp_tp", (t, {m: rows[(m, t)]["total_ms"] for m in TP_MODES})


def test_tp_adds_gpus_to_one_batch_and_ours_divides_its_step_over_them():
    """A global batch of 16 sequences on 2 T nodes (one per TP group): ours' step halves each
    time T doubles (every matrix once, over all D T GPUs); duplicated's does not fall (each
    TP group repeats its D-th); ours ends fastest end to end."""
    from lightning_matrixfsdp.bench.predict.tp import predict_tp_mode

    rows = {(m, t): predict_tp_mode(m, SHAPES_7B, cluster("a100-ib", nodes=2 * t), t, per_group=True)
            for m in ("matrix_fsdp_tp", "megatron_dup_tp") for t in (1, 2, 4, 8)}
    assert {rows[(m, t)]["global_batch"] for m, t in rows} == {16}
    ours = [rows[("matrix_fsdp_tp", t)]["opt_ms"] for t in (1, 2, 4, 8)]
    dup = [rows[("megatron_dup_tp", t)]["opt_ms"] for t in (1, 2, 4, 8)]
    assert all(0.4 < b / a < 0.6 for a, b in zip(ours, ours[1:])), ours
    assert all(b >= 0.95 * a for a, b in zip(dup, dup[1:])), dup
    assert rows[("matrix_fsdp_tp", 8)]["total_ms"] < 0.6 * rows[("matrix_fsdp_tp", 1)]["total_ms"]
    assert rows[("matrix_fsdp_tp", 8)]["total_ms"] < rows[("megatron_dup_tp", 8)]["total_ms"]


def test_tp_bad_sizes_are_refused():
    from lightning_matrixfsdp.bench.predict.tp import predict_tp

    with pytest.raises(PredictError, match="T=3 must divide the GPUs per node"):
        predict_tp(TINY, cluster("a100-ib"), [1], tps=(3,))
    with pytest.raises(PredictError, match="T=4 must divide heads=2"):
        predict_tp(TINY, cluster("a100-ib"), [1], tps=(4,))
    with pytest.raises(PredictError, match="unknown TP mode 'fsdp2_muon'"):
        predict_tp(TINY, cluster("a100-ib"), [1], ["fsdp2_muon"], (2,))


def test_cli_tp_rows_and_table(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["--model", "7b", "--cluster", "a100-ib", "--layers", "2", "--tp", "1", "2", "--nodes", "1", "2",
                 "--json", str(out)]) == 0
    assert "| megatron_dup_tp | 2 |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert sorted({(r["tp"], r["dp"], r["nodes"]) for r in rows}) == [(1, 8, 1), (1, 16, 2), (2, 4, 1), (2, 8, 2)]
    assert main(["--cluster", "a100-ib", "--tp", "2", "--modes", "ddp_muon"]) == 2
    assert "unknown TP mode 'ddp_muon'" in capsys.readouterr().err
