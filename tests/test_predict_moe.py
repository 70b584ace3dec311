"""The MoE predictor (`python -m lightning_matrixfsdp.bench predict moe`): its shapes, bytes and
optimizer work against hand computations on a tiny model, and the order of the modes in the
limiting cases the physics fixes."""

from __future__ import annotations

import json

import pytest

from lightning_matrixfsdp.bench.__main__ import main as bench_main
from lightning_matrixfsdp.bench.predict.cluster import Cluster, cluster
from lightning_matrixfsdp.bench.predict.moe import MOE_MODES, a2a_seconds, edp_ring, predict_moe_mode
from lightning_matrixfsdp.bench.predict.moe_shape import MOE_SHAPES, MoEShape, parameter_counts
from lightning_matrixfsdp.bench.predict.shape import PredictError

# hidden 8, 2 layers, 2 query heads / 1 KV head of 4, 4 experts of intermediate 6, top-2, vocab 10
TINY = MoEShape("tiny", hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, experts=4, top_k=2, expert_mlp=6,
                vocab=10, seq_len=4)


def toy(**kw) -> Cluster:
    """Round numbers: 1 GB/s links, 1e3 FLOP/s, 1 B/s of HBM, no latency."""
    base = dict(name="toy", gpus_per_node=2, nodes=1, matmul_tflops=1e-9, model_eff=1.0, ns_eff_ours=1.0,
                ns_eff_stock=0.5, hbm_gbs=1e-9, muon_bpp=2.0, adamw_bpp=10.0, intra_gbs=1.0, intra_lat_us=0.0,
                inter_gbs=1.0, inter_lat_us=0.0, dispatch_us=0.0, gpu_mem_gib=1.0)
    base.update(kw)
    return Cluster(**base)


def ns(m: int, n: int, steps: int = 5) -> int:
    a, b = min(m, n), max(m, n)
    return steps * (4 * a * a * b + 2 * a ** 3)


# ---------------------------------------------------------------- shapes
def test_tiny_parameters_by_hand():
    attn = 8 * 8 + 4 * 8 + 4 * 8 + 8 * 8  # q, k, v (one KV head of 4), o
    layer_dense = attn + 4 * 8 + 2 * 8  # + router [E, H], two norms
    experts = 4 * (6 * 8 + 6 * 8 + 8 * 6)  # gate, up, down per expert
    root = 2 * 10 * 8 + 8
    counts = parameter_counts(TINY)
    assert counts["experts"] == 2 * experts
    assert counts["total"] == root + 2 * (layer_dense + experts) == 1800
    assert counts["active"] == root + 2 * (layer_dense + experts // 2)  # top-2 of 4


def test_presets_match_the_published_sizes():
    """Mixtral-8x7B: 46.7B parameters, 12.9B active per token; the DeepSeek-V3-lite shape (the
    Moonlight-16B-A3B configuration): about 16B total and 3B active."""
    mix, ds = parameter_counts(MOE_SHAPES["mixtral-8x7b"]), parameter_counts(MOE_SHAPES["deepseek-v3-lite"])
    assert mix["total"] == pytest.approx(46.7e9, rel=0.005) and mix["active"] == pytest.approx(12.9e9, rel=0.01)
    assert ds["total"] == pytest.approx(16.0e9, rel=0.03) and ds["active"] == pytest.approx(3.0e9, rel=0.05)


# ---------------------------------------------------------------- bytes and seconds by hand
def test_token_all_to_all_bytes_and_time_by_hand():
    c = toy(gpus_per_node=4, intra_gbs=2.0)
    row = predict_moe_mode("ours", TINY, c, ep=4)
    one = 4 * 2 * 8 * 2 * 3 / 4  # tokens x top_k x H x bf16 bytes x (EP-1)/EP, each way
    assert row["a2a_bytes"] == one * 6 * 2  # 2 in forward, 2 in backward, 2 in the recomputation; 2 layers
    assert a2a_seconds(c, 4 * 2 * 8 * 2, 4) == pytest.approx(one / 2e9)
    assert row["a2a_ms"] == pytest.approx(6 * 2 * one / 2e9 * 1e3)
    # across nodes: the off-node quarter through the GPU's share of its node's NICs
    c2 = toy(gpus_per_node=2, nodes=2, intra_gbs=100.0, inter_gbs=2.0)
    assert a2a_seconds(c2, 1000.0, 4) == pytest.approx(1000 * 2 / 4 / 1e9)
    assert all(predict_moe_mode(m, TINY, c, ep=4)["a2a_bytes"] == row["a2a_bytes"] for m in MOE_MODES)


def test_expert_ring_by_hand():
    c = toy(gpus_per_node=4, nodes=4, intra_gbs=100.0, inter_gbs=8.0)
    # EP=4 fills a node: one ring per GPU over 4 nodes, 4 rings through each node's NICs
    assert edp_ring(c, 1e9, 4, 4) == pytest.approx(4 * 0.75e9 / 8e9)
    # EP=2: two members of each ring share a node, 2 rings leave each node
    assert edp_ring(c, 1e9, 2, 8) == pytest.approx(2 * 7 / 8 * 1e9 / 8e9)
    assert edp_ring(c, 1e9, 16, 1) == 0.0


def test_expert_weight_bytes_by_hand():
    c = toy(gpus_per_node=2, nodes=2)  # EP=2 inside a node, EDP=2 across the two nodes
    local = 2 * (6 * 8 * 3) * 2  # E/EP experts x one expert's elements x bf16, per layer
    rows = {m: predict_moe_mode(m, TINY, c, ep=2) for m in MOE_MODES}
    assert {r["edp"] for r in rows.values()} == {2}
    # ours: the gradients' all-reduce (or reduce to the stepper + the weights back): 2 ring passes
    assert rows["ours"]["expert_weight_bytes"] == rows["ours_split"]["expert_weight_bytes"] == 2 * local * 1 / 2 * 2
    # FSDP2: all-gather in forward, again in backward, reduce-scatter
    assert rows["fsdp2_ep"]["expert_weight_bytes"] == rows["distmuon"]["expert_weight_bytes"] == 3 * local / 2 * 2


def test_ours_step_by_hand():
    """Busiest owner's dense Newton-Schulz and elementwise work plus every local expert, nothing sent."""
    from lightning_matrixfsdp.bench.predict.moe import dense_plan

    c = toy(gpus_per_node=2)
    plan = dense_plan(TINY, 2)
    per = []
    for r in range(2):
        mine = [s for s in plan.shards() if s.owner == r]
        f = sum(ns(*s.shape) for s in mine if s.role.value == "matrix")
        mat = sum(s.numel for s in mine if s.role.value == "matrix")
        adam = sum(s.numel for s in mine if s.role.value == "tail")
        per.append(f / 1e3 + 2.0 * mat + 10.0 * adam)
    experts = 2 * 2  # 2 layers x E/EP = 2 experts
    expert = experts * ((2 * ns(6, 8) + ns(8, 6)) / 1e3 + 2.0 * 144)
    for mode in ("ours", "ours_split"):  # EDP = 1: the same step
        row = predict_moe_mode(mode, TINY, c, ep=2)
        assert row["opt_ms"] == pytest.approx((max(per) + expert) * 1e3)
        assert row["opt_comm_bytes"] == 0


def test_distmuon_moves_experts_only_when_they_are_in_row_bands():
    c = toy(gpus_per_node=2, nodes=2)
    shard0 = predict_moe_mode("distmuon", TINY, c, ep=2)  # E/EP = 2 experts over EDP = 2: one whole expert each
    bands = predict_moe_mode("distmuon", replace_experts(TINY, 2), c, ep=2)  # 1 expert over EDP = 2: row bands
    # dense: per shape, batches of 4 (the world), two all-to-alls each of 3/4 of one matrix
    dense = sum(2 * m * n * 2 * 3 / 4 * -(-k // 4) for (m, n), k in dense_shapes(TINY).items())
    assert shard0["opt_comm_bytes"] == pytest.approx(dense)
    dense = sum(2 * m * n * 2 * 3 / 4 * -(-k // 4) for (m, n), k in dense_shapes(replace_experts(TINY, 2)).items())
    # row bands: [1, 6, 8] stacks (gate and up of 2 layers: 4) and [1, 8, 6] (down: 2) in batches of EDP = 2,
    # each batch two all-to-alls of half a stack
    assert bands["opt_comm_bytes"] == pytest.approx(dense + 2 * 2 * 48 * 2 / 2 + 1 * 2 * 48 * 2 / 2)


def replace_experts(s: MoEShape, e: int) -> MoEShape:
    from dataclasses import replace

    return replace(s, experts=e, top_k=min(s.top_k, e))


def dense_shapes(s: MoEShape) -> dict[tuple[int, int], int]:
    """The tiny model's dense matrices by shape, written out: q and o, k and v, the router [E, H]."""
    out = {(8, 8): 2 * 2, (4, 8): 2 * 2}
    out[(s.experts, 8)] = out.get((s.experts, 8), 0) + 2
    return out


# ---------------------------------------------------------------- limiting cases
def test_one_expert_replica_moves_no_expert_bytes_in_any_mode():
    """EP = world: nothing to gather or reduce for the experts; ours and ours_split coincide."""
    c = cluster("h200", gpus_per_node=8)
    rows = {m: predict_moe_mode(m, MOE_SHAPES["mixtral-8x7b"], c) for m in MOE_MODES}
    assert all(r["edp"] == 1 and r["expert_weight_bytes"] == 0 for r in rows.values())
    assert rows["ours"]["total_ms"] == pytest.approx(rows["ours_split"]["total_ms"])
    assert rows["ours"]["opt_comm_bytes"] == 0 and rows["distmuon"]["opt_comm_bytes"] > 0  # its dense all-to-alls
    assert rows["fsdp2_ep"]["opt_ms"] > 1.5 * rows["ours"]["opt_ms"]  # stock's DTensor step on the dense part


def test_modes_order_across_nodes_when_experts_are_replicated():
    """Over 2-16 nodes with EP inside a node: ours_split moves 2 expert-sized passes, DistMuon 3 in the
    passes plus 2 in the step, stock FSDP2 + Muon 3 plus its per-iteration collectives: that order."""
    base = cluster("h200", gpus_per_node=8)
    for name in ("mixtral-8x7b", "deepseek-v3-lite"):
        for nodes in (2, 16):
            r = {m: predict_moe_mode(m, MOE_SHAPES[name], base.with_(nodes=nodes)) for m in MOE_MODES}
            assert r["ours_split"]["total_ms"] < r["distmuon"]["total_ms"] < r["fsdp2_ep"]["total_ms"], (name, nodes)
            assert r["ours_split"]["expert_weight_bytes"] == pytest.approx(2 / 3 * r["distmuon"]["expert_weight_bytes"])
            assert r["ours_split"]["opt_comm_bytes"] == 0


def test_replicated_experts_stepped_everywhere_cost_edp_times_the_split():
    """With free links, ours (every replica steps its experts) spends EDP x ours_split's expert
    Newton-Schulz; the split's step is within a ceiling of 1/EDP of the all-reduce variant's experts."""
    s = MOE_SHAPES["mixtral-8x7b"]
    fast = cluster("h200", gpus_per_node=8, nodes=4).with_(intra_gbs=1e9, inter_gbs=1e9, intra_lat_us=0.0,
                                                            inter_lat_us=0.0, dispatch_us=0.0)
    full, split = predict_moe_mode("ours", s, fast), predict_moe_mode("ours_split", s, fast)
    assert full["opt_ns_tflop"] > 3.5 * split["opt_ns_tflop"]
    assert full["total_ms"] > split["total_ms"]


def test_slower_network_widens_ours_lead_over_distmuon():
    s, base = MOE_SHAPES["deepseek-v3-lite"], cluster("h200", gpus_per_node=8, nodes=4)
    ratio = []
    for inter in (base.inter_gbs, base.inter_gbs / 4):
        c = base.with_(inter_gbs=inter)
        ratio.append(predict_moe_mode("distmuon", s, c)["total_ms"] / predict_moe_mode("ours_split", s, c)["total_ms"])
    assert ratio[1] > ratio[0] > 1.0


# ---------------------------------------------------------------- errors and the command line
def test_bad_layouts_are_refused_with_the_cause():
    c = toy(gpus_per_node=2, nodes=3)
    with pytest.raises(PredictError, match="EP=4 must divide the world size 6"):
        predict_moe_mode("ours", TINY, c, ep=4)
    with pytest.raises(PredictError, match="must divide the number of experts 4"):
        predict_moe_mode("ours", TINY, c, ep=3)
    with pytest.raises(PredictError, match="unknown MoE mode"):
        predict_moe_mode("ddp", TINY, c, ep=2)
    with pytest.raises(PredictError, match="top_k=5 exceeds experts=4"):
        MoEShape("bad", 8, 2, 2, 1, 4, experts=4, top_k=5, expert_mlp=6)


def test_command_line_writes_the_rows(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert bench_main(["predict", "moe", "--model", "deepseek-v3-lite", "--nodes", "1", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["nodes"], r["mode"]) for r in rows] == [(k, m) for k in (1, 2) for m in MOE_MODES]
    assert "| deepseek-v3-lite | 2 | 8 x 2 | ours_split |" in capsys.readouterr().out
    assert bench_main(["predict", "moe", "--model", "mixtral-8x7b", "--ep", "3"]) == 2


# ---------------------------------------------------------------- the one-GPU benchmark's MoE model
def test_bench_moe_model_routes_each_token_to_its_top_k_experts():
    """bench/moe_model.py's sorted dispatch against a per-token loop written plainly, and its
    closed-form parameter count."""
    import torch
    import torch.nn.functional as F

    from lightning_matrixfsdp.bench.moe_model import MOE_PRESETS, MoEDecoder, MoEMLP, count_moe_parameters

    cfg = MOE_PRESETS["tiny"]
    assert sum(p.numel() for p in MoEDecoder(cfg).parameters()) == count_moe_parameters(cfg)["total"]
    torch.manual_seed(0)
    mlp = MoEMLP(cfg)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, cfg.hidden)
    got = mlp(x).reshape(10, cfg.hidden)
    flat = x.reshape(10, cfg.hidden)
    gu, down, i = mlp.experts.gate_up_proj, mlp.experts.down_proj, cfg.expert_mlp
    for t in range(10):
        logits = flat[t] @ mlp.router.weight.T
        top = logits.topk(cfg.top_k)
        w = torch.softmax(top.values, dim=0)
        want = sum(w[j] * (down[e] @ (F.silu(gu[e, :i] @ flat[t]) * (gu[e, i:] @ flat[t])))
                   for j, e in enumerate(top.indices.tolist()))
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-6)
