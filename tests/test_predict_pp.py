"""The predictor's pipeline-parallel modes (issue 38 item 6): the schedules' idle time and
in-flight micro-batches against plain timetables written here (and against torch's own action
order, simulated here), PP = 1 against the owner-sharding prediction, activation bytes by hand,
limits, bad input and the command line. In process, no GPU, seconds."""

from __future__ import annotations

import json

import pytest

from lightning_matrixfsdp.bench.predict.cli import main
from lightning_matrixfsdp.bench.predict.cluster import Cluster, cluster
from lightning_matrixfsdp.bench.predict.modes import ModelShape, PredictError, predict_mode
from lightning_matrixfsdp.bench.predict.pipeline import (
    bubble, bubble_fraction, chunk_blocks, in_flight, p2p_seconds, predict_pp_mode,
)

SMALL = ModelShape("s", 512, 2048, 8, 8, 256, 1000)


# ---------------------------------------------------------------- plain timetables (the oracle)
def gpipe_order(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Every rank: all forwards, then all backwards (stage = rank)."""
    return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(p)]


def one_f_one_b_order(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Rank r: p-1-r warm-up forwards, then one forward and one backward in turn, then the rest."""
    out = []
    for r in range(p):
        warm = min(m, p - 1 - r)
        ops = [("F", r, i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                ops.append(("F", r, f))
                f += 1
            ops.append(("B", r, b))
            b += 1
        out.append(ops)
    return out


def simulate(order: list[list[tuple[str, int, int]]], stages: int, dur: dict[str, float]) -> tuple[float, list[int]]:
    """Run each rank's list in order; an op starts when its rank is free and its inputs exist:
    F(k, i) after F(k-1, i); B(k, i) ("B" full backward or "I" input gradient) after F(k, i) and
    B(k+1, i); W(k, i) after B(k, i). Returns the makespan and each rank's peak of chunk
    activations held (forward done, last backward op of that chunk not yet)."""
    done: dict[tuple[int, str, int], float] = {}
    pos, free = [0] * len(order), [0.0] * len(order)
    while any(pos[r] < len(order[r]) for r in range(len(order))):
        moved = False
        for r, ops in enumerate(order):
            while pos[r] < len(ops):
                kind, k, i = ops[pos[r]]
                if kind == "F":
                    deps = [(k - 1, "F", i)] if k else []
                elif kind == "W":
                    deps = [(k, "I", i)]
                else:  # a full backward also counts as its input gradient, below
                    deps = [(k, "F", i)] + ([(k + 1, "I", i)] if k < stages - 1 else [])
                if not all(d in done for d in deps):
                    break
                free[r] = max([free[r]] + [done[d] for d in deps]) + dur[kind]
                done[(k, kind, i)] = free[r]
                if kind == "B":
                    done[(k, "I", i)] = free[r]
                pos[r] += 1
                moved = True
        assert moved, "the order deadlocks"
    peaks = []
    for ops in order:
        held = peak = 0
        for kind, _, _ in ops:
            held += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
            peak = max(peak, held)
        peaks.append(peak)
    return max(free), peaks


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 9)])
def test_gpipe_and_1f1b_idle_slots_and_memory_against_a_timetable(p, m):
    for schedule, order in (("GPipe", gpipe_order(p, m)), ("1F1B", one_f_one_b_order(p, m))):
        for f, b in ((1.0, 1.0), (1.0, 2.0)):
            makespan, peaks = simulate(order, p, {"F": f, "B": b})
            idle = makespan - m * (f + b)  # every rank's idle time is the same
            assert idle == pytest.approx(bubble(schedule, p, f, b, 0.0)), (schedule, p, m, f, b)
            assert idle / makespan == pytest.approx(bubble_fraction(schedule, p, m, 1, f, b, 0.0))
            if (f, b) == (1.0, 1.0):
                assert idle / makespan == pytest.approx((p - 1) / (m + p - 1))
        assert peaks == [in_flight(schedule, p, m, 1, r) for r in range(p)], (schedule, peaks)


def _torch_order(name: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """torch's own action order for a multi-stage schedule (its schedule visualizer builds it
    without a process group), as this file's (kind, stage, micro-batch) tuples."""
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}
    out = []
    for ops in vis.get_schedule_ops(name, p, m, num_stages_per_rank=v):
        row = []
        for a in ops:
            if a is None:
                continue
            for s in (a.sub_actions or (a,)):
                kind = s.computation_type.value
                if kind in kinds:
                    row.append((kinds[kind], s.stage_index, s.microbatch_index))
        out.append(row)
    return out


@pytest.mark.parametrize("name, v", [("Interleaved1F1B", 2), ("Interleaved1F1B", 4), ("InterleavedZeroBubble", 2),
                                     ("InterleavedZeroBubble", 4), ("LoopedBFS", 2), ("LoopedBFS", 4)])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 10), (4, 6)])
def test_interleaved_schedules_against_torchs_action_order(name, v, p, m):
    order = _torch_order(name, p, m, v)
    for f, b, w in ((1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 3), (1, 3, 1), (2, 4, 1.5)):
        makespan, peaks = simulate(order, p * v, {"F": f, "I": b, "W": w, "B": b + w})
        idle = makespan - m * v * (f + b + w)
        assert idle == pytest.approx(bubble(name, p, f, b, w)), (f, b, w)
        if name in ("Interleaved1F1B", "LoopedBFS"):
            assert idle / makespan == pytest.approx((p - 1) / (v * m + p - 1))
    assert peaks == [in_flight(name, p, m, v, r) for r in range(p)]


def test_bubble_vanishes_as_micro_batches_grow_and_grows_with_stages():
    for schedule, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2)):
        by_m = [bubble_fraction(schedule, 4, m, v, 1.0, 2.0, 1.0) for m in (4, 8, 16, 64, 4096)]
        assert all(a > b for a, b in zip(by_m, by_m[1:])) and by_m[-1] < 1e-3, (schedule, by_m)
        by_p = [bubble_fraction(schedule, p, 16, v, 1.0, 2.0, 1.0) for p in (1, 2, 4, 8)]
        assert by_p[0] == 0.0 and all(a < b for a, b in zip(by_p, by_p[1:])), (schedule, by_p)
    # interleaving divides the idle share's growth, zero bubble lowers it further
    assert bubble_fraction("InterleavedZeroBubble", 4, 8, 2, 1, 2, 1) < bubble_fraction("Interleaved1F1B", 4, 8, 2, 1, 2, 1) \
        < bubble_fraction("1F1B", 4, 8, 1, 1, 2, 1)
    rows = [predict_pp_mode(SMALL, cluster("a100-ib", nodes=2), 4, m) for m in (4, 16, 64)]
    assert [r["bubble_frac"] for r in rows] == sorted((r["bubble_frac"] for r in rows), reverse=True)


# ---------------------------------------------------------------- limits and hand values
@pytest.mark.parametrize("name, nodes", [("a100-ib", 1), ("a100-ib", 2), ("h200", 3)])
@pytest.mark.parametrize("inner", ["matrix_fsdp_auto", "matrix_fsdp_hsdp_auto"])
def test_pp_one_is_the_owner_sharding_prediction_exactly(name, nodes, inner):
    c = cluster(name, nodes=nodes)
    for weights in ("keep", "regather"):
        pp, ref = predict_pp_mode(SMALL, c, 1, weights=weights, inner=inner), predict_mode(inner, SMALL, c)
        assert pp["pipe_ms"] == pytest.approx(ref["fwd_ms"] + ref["bwd_ms"], rel=1e-12)  # x 1e3 rounds apart
        for key in ("opt_ms", "total_ms", "peak_gib", "fits", "max_gamma"):
            assert pp[key] == ref[key], (key, pp[key], ref[key])
        assert (pp["bubble_ms"], pp["p2p_bytes_per_step"], pp["dp"]) == (0.0, 0, c.world)


def toy(**kw) -> Cluster:
    base = dict(name="toy", gpus_per_node=4, nodes=2, matmul_tflops=1.0, model_eff=1.0, ns_eff_ours=1.0,
                ns_eff_stock=1.0, hbm_gbs=1.0, muon_bpp=1.0, adamw_bpp=1.0, intra_gbs=2.0, intra_lat_us=5.0,
                inter_gbs=8.0, inter_lat_us=10.0, dispatch_us=0.0, gpu_mem_gib=80.0)
    return Cluster(**{**base, **kw})


def test_activation_bytes_between_stages_by_hand():
    shape = ModelShape("x", 4096, 11008, 32, 32, 4096, 32000, batch=2)
    act = 2 * 4096 * 4096 * 2  # batch x seq x hidden x bf16 bytes: 64 MiB per micro-batch and direction
    # across nodes (PP=2 over 2 nodes: a stage is one node of 4 GPUs crossing at once): a quarter of 8 GB/s each
    assert p2p_seconds(shape, toy(), 2, "across", True) == pytest.approx(act / 2e9 + 15e-6)
    assert p2p_seconds(shape, toy(), 2, "within", False) == pytest.approx(act / 2e9 + 5e-6)  # NVLink
    assert p2p_seconds(shape, toy(), 1, "across", False) == 0.0
    row = predict_pp_mode(ModelShape("y", 64, 128, 8, 4, 32, 100, batch=3), toy(), 2, 6, "Interleaved1F1B", 2)
    assert row["p2p_bytes_per_microbatch"] == 3 * 32 * 64 * 2
    assert row["p2p_bytes_per_step"] == 2 * 2 * 6 * 3 * 32 * 64 * 2  # forward and back, v chunks, m micro-batches
    assert (row["dp"], row["global_batch"], row["p2p_link"]) == (4, 4 * 6 * 3, "inter-node")


def test_split_balances_compute_and_puts_the_head_last():
    assert chunk_blocks(SMALL, 1) == [8]
    big_head = ModelShape("h", 256, 512, 12, 4, 256, 50000)
    split = chunk_blocks(big_head, 4)
    assert sum(split) == 12 and split[-1] < split[0] and min(split) >= 1, split
    assert chunk_blocks(ModelShape("n", 256, 512, 12, 4, 256, 0), 4) == [3, 3, 3, 3]


def test_stage_groups_are_smaller_but_idle_the_same_share_of_owners_and_memory_per_schedule():
    """A stage has 1/PP of the matrices over 1/PP of the ranks: its collectives span fewer ranks,
    but the share of owners with no matrix stays (here 56 matrices over 128 ranks: 0.5625)."""
    c = cluster("a100-ib", nodes=16)  # 128 GPUs, 7 matrices per block: more owners than matrices
    shape = ModelShape("s", 1024, 4096, 8, 8, 1024, 8000)
    rows = [predict_pp_mode(shape, c, p, 2 * p) for p in (1, 2, 4, 8)]
    assert [r["dp"] for r in rows] == [128, 64, 32, 16]
    assert [r["idle_owner_frac"] for r in rows] == [1 - 56 / 128] * 4
    gpipe, ofob = (predict_pp_mode(shape, c, 4, 16, s)["peak_gib"] for s in ("GPipe", "1F1B"))
    assert gpipe > ofob  # GPipe holds all 16 micro-batches, 1F1B at most 4
    keep, regather = (predict_pp_mode(shape, c, 4, 16, weights=w) for w in ("keep", "regather"))
    assert keep["peak_gib"] > regather["peak_gib"] and keep["pipe_ms"] < regather["pipe_ms"]


# ---------------------------------------------------------------- refusals and the command line
@pytest.mark.parametrize("kwargs, message", [
    (dict(pp=2, schedule="LoopedBFS", v=2), "LoopedBFS is modelled from PP micro-batches on"),
    (dict(pp=2, m=4, schedule="LoopedBFS"), "pass virtual stages v >= 2"),
    (dict(pp=2, schedule="Pipedream"), "unknown schedule 'Pipedream'"),
    (dict(pp=2, m=4, schedule="Interleaved1F1B"), "pass virtual stages v >= 2"),
    (dict(pp=2, m=4, schedule="1F1B", v=2), "virtual stages must be 1"),
    (dict(pp=2, m=5, schedule="Interleaved1F1B", v=2), "multiple of the rounds"),
    (dict(pp=3), "PP=3 does not divide the world size 16"),
    (dict(pp=16, m=16), "16 pipeline chunks (PP x v) exceed its 8 layers"),
    (dict(pp=16, m=16, placement="within"), "PP must divide the 8 GPUs per node"),
    (dict(pp=2, weights="lazy"), "unknown weights policy 'lazy'"),
])
def test_bad_pipelines_are_refused_with_the_cause(kwargs, message):
    kw = dict(m=1, schedule="1F1B", v=1, placement="across", weights="keep")
    kw.update(kwargs)
    pp = kw.pop("pp")
    with pytest.raises(PredictError, match=message.replace("(", r"\(").replace(")", r"\)")):
        predict_pp_mode(SMALL, cluster("a100-ib", nodes=2), pp, kw["m"], kw["schedule"], kw["v"], kw["placement"],
                        kw["weights"])


def test_cli_pp_rows_and_errors(tmp_path, capsys):
    out = tmp_path / "pp.json"
    assert main(["--model", "7b", "--cluster", "a100-ib", "--layers", "8", "--nodes", "2", "--pp", "1", "2",
                 "--microbatches", "4", "--json", str(out)]) == 0
    assert "| 2 | 2 x 8 | 1F1B (1) | 4 |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["pp"], r["dp"], r["microbatches"]) for r in rows] == [(1, 16, 4), (2, 8, 4)]
    assert main(["--cluster", "a100-ib", "--pp", "2", "--schedule", "LoopedBFS", "--virtual", "2"]) == 2
    assert "m=1 < PP=2" in capsys.readouterr().err
    assert main(["--cluster", "a100-ib", "--pp", "2", "--tp", "2"]) == 2
    assert "drop --tp" in capsys.readouterr().err
