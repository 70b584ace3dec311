"""The predictor's split-backward V schedules (issue 38 item 6): ZBVZeroBubble and DualPipeV.
Their action order against torch's own lists (its schedule visualizer builds them without a
process group), their idle time and in-flight micro-batches against a plain longest-path timing of
torch's lists written here, the split's cost under owner sharding, refusals and the command line.
In process, no GPU, a few seconds."""

from __future__ import annotations

import functools
import sys

import pytest

from lightning_matrixfsdp.bench.predict import pipeline as pp_mod
from lightning_matrixfsdp.bench.predict.cli import main
from lightning_matrixfsdp.bench.predict.cluster import cluster
from lightning_matrixfsdp.bench.predict.comm import unit_comm
from lightning_matrixfsdp.bench.predict.modes import ModelShape, PredictError
from lightning_matrixfsdp.bench.predict.pipeline import bubble, bubble_fraction, in_flight, predict_pp_mode
from lightning_matrixfsdp.bench.predict.split_schedules import v_order

SMALL = ModelShape("s", 512, 2048, 16, 8, 256, 1000)
CASES = [("ZBVZeroBubble", 2, 1), ("ZBVZeroBubble", 2, 3), ("ZBVZeroBubble", 2, 4), ("ZBVZeroBubble", 3, 7),
         ("ZBVZeroBubble", 4, 8), ("ZBVZeroBubble", 4, 13), ("DualPipeV", 2, 4), ("DualPipeV", 2, 7),
         ("DualPipeV", 3, 6), ("DualPipeV", 4, 8), ("DualPipeV", 4, 11)]
DURATIONS = [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 3), (1, 3, 1), (2, 4, 1.5), (3, 1, 1)]


def torch_lists(name: str, p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """torch's per-rank actions, (kind, stage, micro-batch); a DualPipeV pair as its two parts in order."""
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    out = []
    for ops in vis.get_schedule_ops(name, p, m, num_stages_per_rank=2):
        out.append([(s.computation_type.value, s.stage_index, s.microbatch_index)
                    for a in ops if a is not None for s in (a.sub_actions or (a,))])
    return out


def timing(lists: list[list[tuple[str, int, int]]], f: float, b: float, w: float, count_w: bool = True) -> float:
    """Makespan as a longest path: an action ends its rank's previous action's end or its inputs'
    (whichever is later) plus its duration. Inputs: forward after the previous stage's forward,
    input gradient (or whole backward) after its forward and the next stage's input gradient,
    weight gradient after its input gradient. Stage 0: torch skips the input gradient and runs the
    whole backward as the weight part."""
    last = max(k for ops in lists for _, k, _ in ops)
    where = {}
    for r, ops in enumerate(lists):
        for j, (kind, k, i) in enumerate(ops):
            where[(kind, k, i)] = (r, j)
            if kind == "B":
                where[("I", k, i)] = (r, j)
    ww = w if count_w else 0.0
    cost = {"F": lambda k: f, "I": lambda k: 0.0 if k == 0 else b, "W": lambda k: (b if k == 0 else 0.0) + ww,
            "B": lambda k: b + ww}

    @functools.lru_cache(maxsize=None)
    def end(r: int, j: int) -> float:
        kind, k, i = lists[r][j]
        deps = {"F": [("F", k - 1, i)] if k else [], "W": [("I", k, i)]}.get(
            kind, [("F", k, i)] + ([("I", k + 1, i)] if k < last else []))
        start = max([end(r, j - 1) if j else 0.0] + [end(*where[d]) for d in deps])
        return start + cost[kind](k)

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 20000))
    try:
        return max(end(r, len(ops) - 1) for r, ops in enumerate(lists) if ops)
    finally:
        sys.setrecursionlimit(old)


@pytest.mark.parametrize("name, p, m", CASES)
def test_v_schedules_idle_time_and_memory_against_torchs_action_lists(name, p, m):
    lists = torch_lists(name, p, m)
    assert [list(ops) for ops in v_order(name, p, m)] == lists  # the order, action by action
    for f, b, w in DURATIONS:
        makespan = timing(lists, f, b, w)
        idle = makespan - 2 * m * (f + b + w)
        assert bubble(name, p, f, b, w, m) == pytest.approx(idle), (f, b, w)
        assert bubble_fraction(name, p, m, 2, f, b, w) == pytest.approx(idle / makespan)
    # the timing can tell: weight gradients not counted gives another idle time
    assert timing(lists, 1, 2, 1, count_w=False) - 2 * m * 4 != pytest.approx(bubble(name, p, 1, 2, 1, m))
    held = []
    for ops in lists:
        n = peak = 0
        for kind, _, _ in ops:
            n += {"F": 1, "W": -1, "B": -1}.get(kind, 0)
            peak = max(peak, n)
        held.append(peak)
    assert held == [in_flight(name, p, m, 2, r) for r in range(p)]


def test_idle_time_settles_once_the_v_fills_and_grows_with_stages():
    for name in ("ZBVZeroBubble", "DualPipeV"):
        by_m = [bubble_fraction(name, 4, m, 2, 1.0, 2.0, 1.0) for m in (8, 16, 64, 256)]
        assert all(a > b for a, b in zip(by_m, by_m[1:])) and by_m[-1] < 1e-2, (name, by_m)
        by_p = [bubble(name, p, 1.0, 2.0, 1.0, 32) for p in (2, 4, 8)]
        assert all(a < b for a, b in zip(by_p, by_p[1:])), (name, by_p)


# ---------------------------------------------------------------- the split under owner sharding
def _no_split(monkeypatch):
    monkeypatch.setattr(pp_mod, "_split_shares", lambda schedule, pp, m, v, r: (0.0,) * v)


@pytest.mark.parametrize("name", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_the_split_costs_a_materialization_per_micro_batch_and_stage(name, monkeypatch):
    """With D = 1 a split costs nothing (no collective); with D > 1 each split backward of a chunk
    adds at least one materialization of the chunk's units over what a whole backward costs."""
    m = 8
    d1 = predict_pp_mode(SMALL, cluster("a100-ib", nodes=1, gpus_per_node=4), 4, m, name, 2, weights="regather")
    c = cluster("a100-ib", nodes=2)
    split = predict_pp_mode(SMALL, c, 4, m, name, 2, weights="regather")
    with monkeypatch.context() as mp:
        _no_split(mp)
        whole = predict_pp_mode(SMALL, c, 4, m, name, 2, weights="regather")
        whole_d1 = predict_pp_mode(SMALL, cluster("a100-ib", nodes=1, gpus_per_node=4), 4, m, name, 2,
                                   weights="regather")
    assert d1["pipe_ms"] == pytest.approx(whole_d1["pipe_ms"], rel=1e-9)  # one rank per stage: nothing to gather
    view, _ = pp_mod.stage_view(c, 4, "across")
    counts = pp_mod.chunk_blocks(SMALL, 8)
    bounds = [sum(counts[:k]) for k in range(9)]
    mats = []
    for k in range(8):
        ch = pp_mod._chunk(SMALL, c, view, bounds[k], bounds[k + 1], k == 0, k == 7, "matrix_fsdp_auto", "role_greedy")
        mats.append(sum(max(unit_comm(ch["chosen"], lay, view)) for lay in ch["plan"].units))
    # the busiest rank's split chunks, each split micro-batch one more materialization at least
    least = min(sum(s * mats[k] for s, k in zip(pp_mod._split_shares(name, 4, m, 2, r), pp_mod._rank_chunks(name, 4, 2, r)))
                for r in range(4))
    assert least > 0
    assert split["pipe_ms"] - whole["pipe_ms"] >= m * least * 1e3 * (1 - 1e-9), (split["pipe_ms"], whole["pipe_ms"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="ZBVZeroBubble", v=2, weights="keep"), "weights='keep' is not how it runs"),
    (dict(schedule="InterleavedZeroBubble", v=2, weights="keep"), "weights='keep' is not how it runs"),
    (dict(schedule="ZBVZeroBubble", v=3), "exactly two stages per rank"),
    (dict(schedule="DualPipeV", v=2, m=3), "m=3 < 2 PP = 4"),
    (dict(schedule="Pipedream", v=2), "unknown schedule 'Pipedream'"),
])
def test_split_pipelines_refused_with_the_cause(kwargs, message):
    kw = dict(m=4, v=2, weights="regather")
    kw.update(kwargs)
    with pytest.raises(PredictError, match=message.replace("(", r"\(").replace(")", r"\)")):
        predict_pp_mode(SMALL, cluster("a100-ib", nodes=2), 2, kw["m"], kw["schedule"], kw["v"], weights=kw["weights"])


def test_cli_rows_label_dualpipev_without_overlap(capsys):
    assert main(["--model", "7b", "--cluster", "a100-ib", "--layers", "8", "--nodes", "2", "--pp", "2",
                 "--microbatches", "4", "--schedule", "DualPipeV", "--virtual", "2", "--pp-weights", "regather"]) == 0
    assert "| 2 | 2 x 8 | DualPipeV (2, no overlap) | 4 |" in capsys.readouterr().out
    assert main(["--model", "7b", "--cluster", "a100-ib", "--layers", "8", "--nodes", "2", "--pp", "2",
                 "--microbatches", "4", "--schedule", "ZBVZeroBubble", "--virtual", "2"]) == 2
    assert "use 'regather'" in capsys.readouterr().err
    row = predict_pp_mode(SMALL, cluster("a100-ib", nodes=2), 2, 4, "DualPipeV", 2, weights="regather")
    assert "no overlap" in row["note"] and "MoE all-to-alls" in row["note"]
