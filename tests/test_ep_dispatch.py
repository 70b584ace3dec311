"""Expert parallelism's token dispatch (``runtime/experts/dispatch.py``, ``runtime/experts/dispatch_comm.py``).

One task on the session's pool of 4 gloo processes (``dist_pools``: the processes, and their
imports, are shared with the suite's other 4-process tests) runs every scenario, at EP=4 (the whole world), EP=2 (two
groups of two: ranks {0,1} and {2,3}, so group ranks differ from global ranks) and EP=1
(``group=None``), in float32 and float64. The oracle is written plainly here: the Mixtral
expert loop over all E experts on every token of the group (each rank regenerates the others'
inputs from their seeds), one loss summed over the group's ranks, autograd.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


E, H, I, K = 8, 8, 6, 2
#: tokens per global rank: rank 1 has none, the others differ
TOKENS = (5, 0, 3, 7)
#: float64 within 1e-12 of the oracle; float32 within float32 noise
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def _experts(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    gate_up = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H ** 0.5
    down = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5
    return gate_up.to(dtype), down.to(dtype)


def _inputs(seed: int, rank: int, dtype: torch.dtype, avoid: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """One global rank's tokens, routing and loss probe, the same wherever they are made."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    t = TOKENS[rank]
    allowed = torch.tensor([e for e in range(E) if e not in avoid])
    # k distinct experts per token, from the allowed ones
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(t)]) if t else \
        torch.zeros(0, K, dtype=torch.long)
    if t > 2:
        idx[2, 1] = E  # one slot routed to no expert
    return {"hidden": torch.randn(t, H, generator=g, dtype=torch.float64).to(dtype),
            "index": idx,
            "weights": torch.rand(t, K, generator=g, dtype=torch.float64).to(dtype),
            "probe": torch.randn(t, H, generator=g, dtype=torch.float64).to(dtype)}


def _plain_layer(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                 ) -> torch.Tensor:
    """Mixtral's expert loop: every expert on the tokens routed to it, weighted, added up."""
    out = torch.zeros_like(x)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * w[tok, slot, None]
        out = out.index_add(0, tok, y)
    return out


def _oracle(ranks: list[int], seed: int, dtype: torch.dtype, avoid: tuple[int, ...]) -> dict:
    """The group's loss through a plain expert loop (Mixtral's) on all its ranks' tokens."""
    gate_up, down = (p.clone().requires_grad_() for p in _experts(dtype))
    data = [_inputs(seed, r, dtype, avoid) for r in ranks]
    hid = [d["hidden"].clone().requires_grad_() for d in data]
    wts = [d["weights"].clone().requires_grad_() for d in data]
    out = _plain_layer(torch.cat(hid), torch.cat([d["index"] for d in data]), torch.cat(wts), gate_up, down)
    loss = (out * torch.cat([d["probe"] for d in data])).sum()
    loss.backward()
    outs = out.detach().split([TOKENS[r] for r in ranks])
    return {"out": outs, "hidden": [h.grad for h in hid], "weights": [v.grad for v in wts],
            "gate_up": gate_up.grad, "down": down.grad}


def _bytes_formula(ranks: list[int], me: int, seed: int, dtype: torch.dtype, avoid: tuple[int, ...]) -> dict:
    """docs/expert-parallel-dispatch.md's formula, from the routing alone."""
    ep, per = len(ranks), E // len(ranks)
    pos = ranks.index(me)
    es = torch.empty(0, dtype=dtype).element_size()
    idx = {r: _inputs(seed, r, dtype, avoid)["index"] for r in ranks}
    block = lambda i: (i // per) if int(i) < E else None  # noqa: E731
    s_out = sum(1 for i in idx[me].reshape(-1).tolist() if block(i) not in (None, pos))
    s_in = sum(1 for r in ranks if r != me for i in idx[r].reshape(-1).tolist() if block(i) == pos)
    counts = (ep - 1) * (per + 3) * 8
    row = H * es
    fwd = {"ep_dispatch": (s_out * row + counts, s_in * row + counts), "ep_combine": (s_in * row, s_out * row)}
    both = {"ep_dispatch": ((s_out + s_in) * row + counts,) * 2, "ep_combine": ((s_out + s_in) * row,) * 2}
    return {"forward": fwd, "forward+backward": both}


def _run(group, ranks: list[int], me: int, seed: int, dtype: torch.dtype, avoid: tuple[int, ...] = (),
         device: str = "cpu") -> dict:
    """One scenario on this rank: the dispatch beside the oracle; the largest differences.
    ``device``: where the dispatch runs (a GPU check over NCCL uses it); the oracle runs on CPU."""
    from lightning_matrixfsdp.runtime.comm.core import CommStats
    from lightning_matrixfsdp.runtime.experts.dispatch import expert_parallel_forward, hf_experts

    ep = len(ranks)
    pos = ranks.index(me)
    per = E // ep
    gate_up, down = _experts(dtype)
    gate_up = gate_up[pos * per:(pos + 1) * per].to(device).clone().requires_grad_()
    down = down[pos * per:(pos + 1) * per].to(device).clone().requires_grad_()
    d = {k: v.to(device) for k, v in _inputs(seed, me, dtype, avoid).items()}
    hidden, weights = d["hidden"].clone().requires_grad_(), d["weights"].clone().requires_grad_()
    stats = CommStats()
    out = expert_parallel_forward(hidden, d["index"], weights, E, hf_experts(gate_up, down, F.silu), group,
                                  stats=stats)
    after_forward = {p: (v["sent"], v["recv"]) for p, v in stats.snapshot().items() if p.startswith("ep_")}
    (out * d["probe"]).sum().backward()
    after_backward = {p: (v["sent"], v["recv"]) for p, v in stats.snapshot().items() if p.startswith("ep_")}
    ref = _oracle(ranks, seed, dtype, avoid)
    diff = lambda a, b: float((a.detach().cpu() - b).abs().max()) if a.numel() else 0.0  # noqa: E731
    return {
        "out": diff(out, ref["out"][pos]),
        "hidden": diff(hidden.grad, ref["hidden"][pos]),
        "weights": diff(weights.grad, ref["weights"][pos]),
        "gate_up": diff(gate_up.grad, ref["gate_up"][pos * per:(pos + 1) * per]),
        "down": diff(down.grad, ref["down"][pos * per:(pos + 1) * per]),
        "grad_none": [n for n, p in (("gate_up", gate_up), ("down", down)) if p.grad is None],
        # experts no token reached whose gradient is not exactly zero (None is "grad_none")
        "zero_experts": [e for e in range(per) if pos * per + e in avoid and None not in (gate_up.grad, down.grad)
                         and not (bool((gate_up.grad[e] == 0).all()) and bool((down.grad[e] == 0).all()))],
        "out_value": out.detach().cpu().tolist(),  # lists: tensors do not outlive the worker
        "bytes": {"forward": after_forward, "forward+backward": after_backward},
        "bytes_formula": _bytes_formula(ranks, me, seed, dtype, avoid) if ep > 1 else None,
    }


def _two_layers(group, ranks: list[int], me: int) -> float:
    """Two MoE layers in a row sharing the experts (float64): the backward's exchanges of the
    second layer run before the first's on every rank. The largest difference to the oracle."""
    from lightning_matrixfsdp.runtime.experts.dispatch import expert_parallel_forward, hf_experts

    dtype, pos, per = torch.float64, ranks.index(me), E // len(ranks)
    full = [p.clone().requires_grad_() for p in _experts(dtype)]
    mine = [p[pos * per:(pos + 1) * per].clone().requires_grad_() for p in _experts(dtype)]
    data = {r: (_inputs(5, r, dtype), _inputs(6, r, dtype)) for r in ranks}
    a, b = data[me]
    hidden = a["hidden"].clone().requires_grad_()
    x = hidden
    for d in (a, b):
        x = expert_parallel_forward(x, d["index"], d["weights"], E, hf_experts(*mine, F.silu), group)
    (x * b["probe"]).sum().backward()

    hid = torch.cat([data[r][0]["hidden"] for r in ranks]).requires_grad_()
    y = hid
    for layer in (0, 1):
        cat = lambda key: torch.cat([data[r][layer][key] for r in ranks])  # noqa: E731
        y = _plain_layer(y, cat("index"), cat("weights"), *full)
    (y * torch.cat([data[r][1]["probe"] for r in ranks])).sum().backward()
    start = sum(TOKENS[r] for r in ranks[:pos])
    diffs = [(x.detach() - y.detach()[start:start + TOKENS[me]]).abs().max() if x.numel() else 0.0,
             (hidden.grad - hid.grad[start:start + TOKENS[me]]).abs().max() if x.numel() else 0.0,
             (mine[0].grad - full[0].grad[pos * per:(pos + 1) * per]).abs().max(),
             (mine[1].grad - full[1].grad[pos * per:(pos + 1) * per]).abs().max()]
    return max(float(v) for v in diffs)


def _order(group, ranks: list[int], me: int) -> dict:
    """The rows ``local_experts`` sees, against the canonical order written out plainly."""
    from lightning_matrixfsdp.runtime.experts.dispatch import expert_parallel_forward

    ep, per = len(ranks), E // len(ranks)
    pos = ranks.index(me)
    seen = {}

    def record(x, counts):
        seen["x"], seen["counts"] = x.detach().clone(), list(counts)
        return x * 1.0

    d = _inputs(7, me, torch.float64)
    # a row that names its source: (global rank, token, 0, ...)
    tag = lambda r, t: torch.tensor([float(r), float(t)] + [0.0] * (H - 2), dtype=torch.float64)  # noqa: E731
    hidden = torch.stack([tag(me, t) for t in range(TOKENS[me])]) if TOKENS[me] else torch.zeros(0, H,
                                                                                                dtype=torch.float64)
    expert_parallel_forward(hidden, d["index"], d["weights"], E, record, group)
    expected, counts = [], []
    for e in range(pos * per, (pos + 1) * per):
        n = 0
        for r in ranks:
            idx = _inputs(7, r, torch.float64)["index"]
            for t in range(TOKENS[r]):
                for j in range(K):
                    if int(idx[t, j]) == e:
                        expected.append((r, t))
                        n += 1
        counts.append(n)
    got = [(int(row[0]), int(row[1])) for row in seen["x"]]
    return {"ok": got == expected and seen["counts"] == counts, "got": got, "expected": expected}


def _refusals(world_group, me: int) -> dict:
    from lightning_matrixfsdp.runtime.experts.dispatch import expert_parallel_forward
    from lightning_matrixfsdp.runtime.errors import MatrixShardError

    def attempt(fn) -> str:
        try:
            fn()
        except MatrixShardError as e:
            return str(e)
        return "no error"

    d = _inputs(3, me, torch.float32)
    keep = lambda x, counts: x  # noqa: E731
    res = {"indivisible": attempt(lambda: expert_parallel_forward(d["hidden"], d["index"], d["weights"], 6, keep,
                                                                  world_group))}
    bad = d["index"].clone()
    if me == 2:
        bad[0, 0] = E + 1
    res["out_of_range"] = attempt(lambda: expert_parallel_forward(d["hidden"], bad, d["weights"], E, keep,
                                                                  world_group))
    neg = d["index"].clone()
    if me == 3:
        neg[1, 1] = -1
    res["negative"] = attempt(lambda: expert_parallel_forward(d["hidden"], neg, d["weights"], E, keep, world_group))
    mixed = d["hidden"].double() if me == 0 else d["hidden"]
    res["dtypes"] = attempt(lambda: expert_parallel_forward(mixed, d["index"], d["weights"], E, keep, world_group))
    # the group still works after the refusals (every rank left the counts exchange)
    res["after"] = tuple(expert_parallel_forward(d["hidden"], d["index"], d["weights"], E, keep, world_group).shape)
    return res


def worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    layouts = {"ep4": (dist.group.WORLD, [0, 1, 2, 3]),
               "ep2": (pairs[rank // 2], [0, 1] if rank < 2 else [2, 3]),
               "ep1": (None, [rank])}
    res: dict = {}
    for name, (group, ranks) in layouts.items():
        for dtype in (torch.float32, torch.float64):
            # expert 5 gets no token anywhere; rank 1 of EP=4 holds experts 2 and 3, both unused
            res[(name, dtype, "uneven")] = _run(group, ranks, rank, 1, dtype, avoid=(5,))
            res[(name, dtype, "idle_rank")] = _run(group, ranks, rank, 2, dtype, avoid=(2, 3))
        res[(name, "order")] = _order(group, ranks, rank)
        res[(name, "two_layers")] = _two_layers(group, ranks, rank)
    res["refusals"] = _refusals(dist.group.WORLD, rank)
    return res


@pytest.fixture(scope="module")
def launch(dist_pools):
    """Every rank's results of the one task (run by the first test that asks)."""
    return dist_pools(4).run(worker, timeout=300)


SCENARIOS = [(ep, dt, sc) for ep in ("ep4", "ep2", "ep1") for dt in (torch.float32, torch.float64)
             for sc in ("uneven", "idle_rank")]


@pytest.mark.parametrize("ep,dtype,scenario", SCENARIOS)
def test_dispatch_matches_the_plain_expert_loop(ep, dtype, scenario, launch):
    """Output and gradients (hidden, router weights, local expert weights) equal the oracle."""
    for rank, res in enumerate(launch):
        r = res[(ep, dtype, scenario)]
        worst = {k: r[k] for k in ("out", "hidden", "weights", "gate_up", "down")}
        assert max(worst.values()) <= TOL[dtype], (rank, worst)
        assert not r["grad_none"], (rank, r["grad_none"])


@pytest.mark.parametrize("scenario", ["uneven", "idle_rank"])
def test_experts_without_tokens_get_zero_gradients(scenario, launch):
    """An expert no token reaches has a gradient of zeros (not None), also on a rank whose whole
    block is idle (EP=4, idle_rank: rank 1 gets no row)."""
    for rank, res in enumerate(launch):
        for ep in ("ep4", "ep2", "ep1"):
            r = res[(ep, torch.float64, scenario)]
            assert not r["grad_none"] and not r["zero_experts"], (rank, ep, r["grad_none"], r["zero_experts"])


@pytest.mark.parametrize("ep", ["ep4", "ep2"])
def test_bytes_equal_the_formula(ep, launch):
    for rank, res in enumerate(launch):
        for dtype in (torch.float32, torch.float64):
            for scenario in ("uneven", "idle_rank"):
                r = res[(ep, dtype, scenario)]
                assert r["bytes"] == r["bytes_formula"], (rank, dtype, scenario, r["bytes"], r["bytes_formula"])


def test_output_is_the_same_across_ep_sizes(launch):
    """The same tokens give the same output at EP=1, 2 and 4 (within float32 noise; see the
    docs for what is bitwise)."""
    for rank, res in enumerate(launch):
        for dtype in (torch.float32, torch.float64):
            base = torch.tensor(res[("ep1", dtype, "uneven")]["out_value"], dtype=dtype).reshape(-1, H)
            for ep in ("ep2", "ep4"):
                other = torch.tensor(res[(ep, dtype, "uneven")]["out_value"], dtype=dtype).reshape(-1, H)
                assert other.shape == base.shape
                worst = float((other - base).abs().max()) if base.numel() else 0.0
                assert worst <= TOL[dtype], (rank, ep, dtype, worst)


@pytest.mark.parametrize("ep", ["ep4", "ep2", "ep1"])
def test_two_layers_in_a_row(ep, launch):
    """Two dispatches in one graph (the backward runs the second layer's exchanges first)."""
    for rank, res in enumerate(launch):
        assert res[(ep, "two_layers")] <= TOL[torch.float64], (rank, res[(ep, "two_layers")])


@pytest.mark.parametrize("ep", ["ep4", "ep2", "ep1"])
def test_local_experts_see_the_canonical_order(ep, launch):
    """Rows reach ``local_experts`` expert-major; inside an expert by source rank, then token, then slot."""
    for rank, res in enumerate(launch):
        r = res[(ep, "order")]
        assert r["ok"], (rank, r["got"], r["expected"])


def test_refusals_raise_on_every_rank(launch):
    results = launch
    for rank, res in enumerate(results):
        r = res["refusals"]
        assert "6 experts cannot be split into 4" in r["indivisible"], r
        if rank == 2:
            assert "rank 2 of the expert-parallel group" in r["out_of_range"] and "expert 9" in r["out_of_range"], r
        else:
            assert "rank(s) [2]" in r["out_of_range"], r
        if rank == 3:
            assert "expert -1" in r["negative"], r
        else:
            assert "rank(s) [3]" in r["negative"], r
        assert "disagree on the hidden size or dtype" in r["dtypes"] and "torch.float64" in r["dtypes"], r
        assert r["after"] == (TOKENS[rank], H)


def test_hf_experts_refuses_mismatched_counts():
    from lightning_matrixfsdp.runtime.experts.dispatch import hf_experts_forward
    from lightning_matrixfsdp.runtime.errors import MatrixShardError

    gate_up, down = _experts(torch.float32)
    with pytest.raises(MatrixShardError, match="one count per local expert"):
        hf_experts_forward(torch.zeros(3, H), [1, 2], gate_up, down, F.silu)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch.nn.functional.grouped_mm is missing")
def test_hf_experts_grouped_mm_forward_matches_the_loop():
    """The grouped-GEMM path's forward (its offsets, the transposes, gate/up) against the loop, on
    CPU, where torch 2.13 runs grouped_mm's forward (its backward only on CUDA; GPU run: docs)."""
    from lightning_matrixfsdp.runtime.experts.dispatch import hf_experts_forward

    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 8, generator=g)  # 16-byte strides
    x, counts = torch.randn(16, 8, generator=g), [5, 0, 3, 8]
    with torch.no_grad():
        loop = hf_experts_forward(x, counts, gate_up, down, F.silu, grouped_mm=False)
        grouped = hf_experts_forward(x, counts, gate_up, down, F.silu, grouped_mm=True)
    torch.testing.assert_close(grouped, loop)
