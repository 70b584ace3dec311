"""What watches and reports the model sees the pipeline stages (issue 38 follow-ups): under
``pipeline_parallel_size=2`` x 2 data-parallel ranks (4 gloo processes, the shared pool), one fit
(``helpers/pipeline_observe_scenarios.py``) whose reports are judged against counts taken plainly
from an unsplit copy of the model: the per-stage telemetry, the plan log naming each stage's units,
the time and memory shares, the lone-forward watch on the stages (and no false alarm from the
schedule's forwards), ``AsyncCheckpointer.reserve`` sized to this rank's stage, and the sidecar's
plans of both stages, uneven evaluation and ``full_model`` refused on every rank. Then PP=2 x EP=2 on a tiny Mixtral
(the 4-process Hugging Face pool): no whole-world expert group, and the experts' load of both stages.
"""
from __future__ import annotations

import pytest

from helpers.pipeline_observe_scenarios import BUFFER, observe_case, observe_moe_case


@pytest.fixture(scope="module")
def observed(dist_pools, tmp_path_factory):
    res = dist_pools(4).run(observe_case, str(tmp_path_factory.mktemp("observe")), timeout=300)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return res


def test_telemetry_reports_every_stage(observed):
    rows = [row for row in observed[0]["metrics"] if "matrix_fsdp/optimizer_step_ms" in row]
    assert len(rows) == 2, rows  # log_every_n_steps=1, two steps
    for row in rows:
        for stage in (0, 1):
            keys = [k for k in row if k.startswith(f"matrix_fsdp/stage{stage}/")]
            assert keys, (stage, sorted(row))
            assert all(row[k] >= 0 for k in keys)
        assert row["matrix_fsdp/optimizer_step_ms"] > 0
    # rank 0 is stage 0's lowest rank: its own traffic is stage 0's
    for row in rows:
        for k, v in row.items():
            if k.startswith("matrix_fsdp/stage0/"):
                assert v == pytest.approx(row["matrix_fsdp/" + k.split("/", 2)[2]])
    # each micro-batch's gradients are reduced to their owners: with two ranks a stage, the stage's lowest
    # rank sends every float32 gradient it does not own and receives every one it owns, once per
    # micro-batch (M = 4) of each step; the extra buffers are broadcast before each micro-batch's forward
    for r in observed[:: 2]:  # ranks 0 and 2: stages 0 and 1
        stage, params = r["stage"], r["stage_params"]
        for row in rows:
            assert row[f"matrix_fsdp/stage{stage}/reduce_MB"] * 2 ** 20 == 4 * 4 * params, (stage, row)
            assert row[f"matrix_fsdp/stage{stage}/buffers_MB"] * 2 ** 20 == 4 * 2 * BUFFER * 4, (stage, row)


def test_plan_log_names_every_stage_and_its_parameters(observed):
    log = "\n".join(observed[0]["log"])
    assert "split declared" in log
    at = log.index("pipeline stage 0:"), log.index("pipeline stage 1:")
    end = log.find("pipeline stage 0:", at[1])  # validate's setup logs the plans again
    stage0, stage1 = log[at[0]:at[1]], log[at[1]:end if end > 0 else len(log)]
    assert "units=3" in stage0 and "units=3" in stage1  # each stage: its two blocks and its root
    assert "tok_emb.weight" in stage0 and "ln_f.weight" not in stage0, stage0
    assert "ln_f.weight" in stage1 and "tok_emb.weight" not in stage1, stage1


def test_plan_reports_memory_and_estimated_time_shares(observed):
    r = observed[0]
    blocks, head, emb = r["block_params"], r["head_params"], r["emb_params"]
    total = emb + sum(blocks) + head
    memory = [(emb + blocks[0] + blocks[1]) / total, (blocks[2] + blocks[3] + head) / total]
    flops = sum(blocks) + head  # 2 x matmul parameters per token; the embeddings are a lookup
    time = [(blocks[0] + blocks[1]) / flops, (blocks[2] + blocks[3] + head) / flops]
    log = "\n".join(r["log"])
    for stage in (0, 1):
        assert (f"(memory {100 * memory[stage]:.1f}%), time ~{100 * time[stage]:.1f}% (estimate)"
                in log), (stage, memory, time, log)
    assert "time (estimate)" in log


def test_lone_forward_watch_covers_the_stages(observed):
    # installed on each stage, and the schedule's forwards in training and validation raised nothing
    assert all(r["watched"] == [True] for r in observed)


def test_async_reserve_is_this_ranks_stage(observed):
    for rank, r in enumerate(observed):
        # at most this rank's stage (params owned here, its blocks' buffers) and its optimizer state
        assert r["reserved"] <= r["stage_bytes"] + r["opt_bytes"], (rank, r)
        assert r["reserved"] >= r["local_param_bytes"] + r["opt_bytes"], (rank, r)
        # the other stage's buffers are not reserved
        assert r["reserved"] < r["local_param_bytes"] + r["all_buffer_bytes"] + r["opt_bytes"], (rank, r)


def test_sidecar_names_both_stages(observed):
    plans = observed[0]["sidecar_plans"]
    assert [p["stage"] for p in plans] == [0, 1], plans
    text = [str(p["plan"]) for p in plans]
    assert "blocks.0" in text[0] and "blocks.3" in text[1] and "blocks.3" not in text[0], text


def test_model_summary_counts_every_stage(observed):
    for rank, r in enumerate(observed):
        assert r["summary_total"] == r["plain_total"], (rank, r["summary_total"], r["plain_total"])
        assert r["summary_layers"] == r["plain_layers"], (rank, r["summary_layers"], r["plain_layers"])
        assert len(r["summary_layers"]) > 2


def test_uneven_evaluation_is_refused_on_every_rank(observed):
    for rank, r in enumerate(observed):
        assert r["uneven"].startswith("UnevenInputsError") and "pipeline parallelism" in r["uneven"], (rank, r["uneven"])


def test_full_model_is_refused_on_every_rank(observed):
    for rank, r in enumerate(observed):
        assert r["full_model"].startswith("MatrixShardError") and "pipeline stages" in r["full_model"], (rank, r)


def test_pipeline_x_experts_setup_and_expert_stats(hf_pool4):
    """PP=2 x EP=2 (4 ranks): ``setup_environment`` creates no expert group (the whole-world record's
    would span both stages' ranks, and nothing uses them), each stage still creates its own, the run
    trains, and the logged experts' load equals the unsplit model's own router choices per layer
    (layer 0 on stage 0, layer 1 on stage 1)."""
    import math

    pytest.importorskip("transformers")
    res = hf_pool4.run(observe_moe_case, {}, timeout=300)
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    for rank, r in enumerate(res):
        in_setup = [c for c in r["calls"] if c[0] == "expert_groups" and c[2]]
        assert not in_setup, (rank, in_setup)
        assert any(c[0] == "expert_groups" and not c[2] for c in r["calls"]), (rank, r["calls"])
        assert len(r["losses"]) == 1 and math.isfinite(r["losses"][0])
    metrics = res[0]["metrics"]
    assert len(metrics) == 1, metrics
    row = metrics[0]
    for layer, counts in res[0]["oracle_counts"].items():
        keys = [k for k in row if k.startswith(f"matrix_fsdp/experts/{layer}/")]  # short names: the layer
        mean = sum(counts) / len(counts)
        cv = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts)) / mean
        want = {"tokens_min": min(counts), "tokens_max": max(counts), "tokens_cv": cv}
        got = {k.rsplit("/", 1)[1]: row[k] for k in keys}
        assert got == pytest.approx(want), (layer, got, want, sorted(row))
