"""The MoE bytes-and-memory benchmark (``python -m lightning_matrixfsdp.bench.moe_bytes``) at its
smallest configuration: 2 gloo processes, no EP and EP=2, one step of the tiny MoE decoder.
Correctness of its claims, not timings:

- under EP no expert-weight byte moves, while without EP the same split does find them (so the
  check can fail), and the split adds up to the runtime's measured phases exactly;
- the token bytes equal the docs' formula evaluated on the routing every rank recorded;
- each rank holds ``3 x P_experts / EP`` bytes of expert parameters, gradients and momentum, with
  ``P_experts`` from the model's shape here, and no storage beyond the tensors' bytes;
- the optimizer step moves nothing.
"""

from __future__ import annotations

import json

from helpers.dist import OneLaunch

from lightning_matrixfsdp.bench.moe_bytes import bench_config, check, compact, markdown, run_rank, summarize

STEPS = 1


def _run(rank: int, world: int) -> list:
    return run_rank(bench_config(), eps=(2,), steps=STEPS, ddp=False)


RUN = OneLaunch(_run, 2, timeout=240)


def _summary() -> dict:
    return summarize(RUN.results(), bench_config(), STEPS)


def test_expert_weights_never_move_under_ep_and_the_split_finds_them_without():
    modes = _summary()["modes"]
    assert set(modes) == {"ours_no_ep", "ours_ep2"}
    for r in modes["ours_ep2"]["ranks"]:
        assert r["bytes"]["expert_weights"] == [0, 0], r["bytes"]
        assert r["bytes"]["tokens"][0] > 0 and r["checks"]["attributed"], r
    # without EP the stacks are roles: their owner sends them to the other rank, which receives them
    moved = [r["bytes"]["expert_weights"] for r in modes["ours_no_ep"]["ranks"]]
    assert sum(s for s, _ in moved) == sum(g for _, g in moved) > 0, moved
    assert all(r["checks"]["attributed"] and r["opt_bytes"] == [0, 0] for m in modes.values() for r in m["ranks"])


def test_token_bytes_equal_the_formula_on_the_recorded_routing():
    cfg = bench_config()
    ranks = _summary()["modes"]["ours_ep2"]["ranks"]
    for r in ranks:
        t = r["tokens"]
        assert t["measured"] == t["formula"], t
        # forward dispatch: S_out rows of H fp32, and per layer and step one counts row of (E/EP + 3) int64
        counts = cfg.n_layers * STEPS * (cfg.experts // 2 + 3) * 8
        assert t["measured"]["fwd.ep_dispatch"][0] == t["S_out"] * cfg.hidden * 4 + counts
    # what one rank sends to its peer's experts is what the peer receives
    assert ranks[0]["tokens"]["S_out"] == ranks[1]["tokens"]["S_in"] > 0


def test_expert_memory_is_three_times_the_experts_over_ep():
    cfg = bench_config()
    p_experts = cfg.n_layers * (cfg.experts * 2 * cfg.expert_mlp * cfg.hidden + cfg.experts * cfg.hidden
                                * cfg.expert_mlp) * 4
    s = _summary()
    for r in s["modes"]["ours_ep2"]["ranks"]:
        assert r["memory"]["expert"] == [p_experts // 2] * 3, r["memory"]
        assert r["memory"]["storage"] == r["memory"]["logical"], r["memory"]
    no_ep = s["modes"]["ours_no_ep"]["ranks"]
    assert sum(sum(r["memory"]["expert"]) for r in no_ep) == 3 * p_experts
    assert check(s) == [], check(s)
    assert "| ours_ep2 | 0.0 |" in markdown(s)
    small = compact(s)  # what the command line writes: a few KB, the agreements kept as flags
    assert len(json.dumps(small)) < 8000
    assert all(r["tokens"]["equals_formula"] for r in small["modes"]["ours_ep2"]["ranks"])
