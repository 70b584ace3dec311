"""``replica_split`` under HSDP: each role stepped by one replica, bitwise equal to DDP.

The oracle (``tests/helpers/oracle.py``) is DDP on full replicas. With ``W = 1`` its flat
rank-order sum is exactly what the stepping replica computes, so the comparison uses
the oracle's own all-reduce. With ``W > 1`` the stepper adds the shard groups' partial
sums in replica order, ``(g_0 + ... + g_{W-1}) + (g_W + ... ) + ...``: the oracle
then sums in that grouping (``oracle.allreduce_mean_grads(group=W)``, written independently of the
runtime), which is still a data-parallel mean, only with its terms grouped per node.
"""
from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from helpers.equiv import move_grads_into, step_oracle_and_sharded
from helpers.models import TinyLM, batch_for, lm_loss
from helpers.oracle import (ADAMW_DEFAULTS, MUON_DEFAULTS, allreduce_mean_grads, clip_global_norm, mark_recipe_tail,
                            oracle_optimizers, sharded_recipe_matrix)


# ---------------------------------------------------------------------- pure: the assignment
def _units(shapes_per_unit):
    from lightning_matrixfsdp.runtime.placement import ParamSpec, UnitSpec

    return [UnitSpec(f"u{i}", tuple(ParamSpec(f"u{i}.p{j}", s, "float32", len(s) == 2) for j, s in enumerate(shapes)))
            for i, shapes in enumerate(shapes_per_unit)]


def test_assignment_balances_newton_schulz_flops_per_shard_rank():
    from lightning_matrixfsdp.runtime.planner import make_plan, newton_schulz_flops
    from lightning_matrixfsdp.runtime.replicas.assign import assign_steppers

    units = _units([[(64, 64), (64, 256), (256, 64), (64, 64), (64,)], [(128, 128), (32, 32), (32,)]])
    plan = make_plan(units, 1, "role_greedy")
    steppers, flops = assign_steppers(plan, units, 2)
    # independent brute force over all 2-way splits of the roles of shard rank 0 (W = 1: all of them)
    roles = [("u0.p0",), ("u0.p1",), ("u0.p2",), ("u0.p3",), ("u1.p0",), ("u1.p1",), ("u0.p4",), ("u1.p2",)]
    cost = {"u0.p0": newton_schulz_flops((64, 64)), "u0.p1": newton_schulz_flops((64, 256)),
            "u0.p2": newton_schulz_flops((64, 256)), "u0.p3": newton_schulz_flops((64, 64)),
            "u1.p0": newton_schulz_flops((128, 128)), "u1.p1": newton_schulz_flops((32, 32)),
            "u0.p4": 12 * 64, "u1.p2": 12 * 32}
    total = sum(cost.values())
    best = min(max(sum(cost[r[0]] for i, r in enumerate(roles) if m >> i & 1),
                   total - sum(cost[r[0]] for i, r in enumerate(roles) if m >> i & 1)) for m in range(2 ** len(roles)))
    got = [sum(c for k, c in cost.items() if steppers[k] == rep) for rep in (0, 1)]
    assert got == [row[0] for row in flops]
    assert sum(got) == total and max(got) <= 1.1 * best, (got, best)
    assert set(steppers) == {p.fqn for u in units for p in u.params}


def test_assignment_is_deterministic_and_per_shard_rank():
    from lightning_matrixfsdp.runtime.planner import make_plan
    from lightning_matrixfsdp.runtime.replicas.assign import assign_steppers

    units = _units([[(16, 16)] * 5 + [(16,)], [(8, 16)] * 3])
    plan = make_plan(units, 2, "role_greedy")
    a = assign_steppers(plan, units, 3)
    assert a == assign_steppers(plan, units, 3)
    steppers, flops = a
    assert len(flops) == 3 and all(len(r) == 2 for r in flops)
    # every replica steps something on each shard rank that owns at least 3 roles
    for r in range(2):
        mine = [p.fqn for u in units for p in u.params if plan.shard(p.fqn).owner == r and len(p.shape) == 2]
        if len(mine) >= 3:
            assert {steppers[f] for f in mine} == {0, 1, 2}
    # equal roles go largest first, ties by replica index: the first of five equal matrices to replica 0
    assert steppers["u0.p0"] == 0
    # tail params of a unit share one stepper (one role)
    assert len({steppers[p.fqn] for u in units for p in u.params if len(p.shape) < 2 and p.fqn.startswith("u0")}) == 1


def test_plan_records_steppers_in_dict_digest_and_text():
    from lightning_matrixfsdp.runtime.placement import Plan, first_difference
    from lightning_matrixfsdp.runtime.planner import make_plan
    from lightning_matrixfsdp.runtime.replicas.assign import assign_steppers

    units = _units([[(16, 16), (16, 32), (16,)]])
    plan = make_plan(units, 1, "role_greedy", replicate=2)
    digest_off = plan.digest()
    assert not plan.replica_split and plan.stepper("u0.p0") is None and "steppers" not in plan.to_dict()
    plan.steppers, plan.replica_flops = assign_steppers(plan, units, 2)
    assert plan.replica_split and plan.digest() != digest_off
    back = Plan.from_json(plan.to_json())
    assert back.steppers == plan.steppers and back.replica_flops == plan.replica_flops
    assert back.digest() == plan.digest()
    other = Plan.from_dict(plan.to_dict())
    other.steppers = {k: 1 - v for k, v in plan.steppers.items()}
    assert other.digest() != plan.digest()
    assert "stepping replica" in first_difference(plan.to_dict(), other.to_dict())
    assert "replica_split" in str(plan)


def test_option_is_checked():
    from lightning_matrixfsdp.runtime.config import MatrixFSDPConfig
    from lightning_matrixfsdp.runtime.errors import MatrixShardError

    assert MatrixFSDPConfig(replica_split=True).replica_split is True
    with pytest.raises(MatrixShardError, match="replica_split='yes'"):
        MatrixFSDPConfig(replica_split="yes")


# ---------------------------------------------------------------------- distributed: equal to DDP
def _optimizers(model, kind: str, sharded: bool):
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.optim.matrix_optimizers import SOAP, Shampoo

    if not sharded:
        mark_recipe_tail(model)  # the DDP oracle: embedding and head on AdamW, as matrix_shard's default
    params = mf.param_groups(model) if sharded else [p for p in model.parameters() if p.requires_grad]
    if kind == "soap":
        opt = [SOAP(params, lr=0.01, precondition_frequency=2)]
    elif kind == "shampoo":
        opt = [Shampoo(params, lr=0.01, start_preconditioning_step=1, preconditioning_compute_steps=1,
                       graft_type="adagrad", weight_decay=0.01, decoupled_weight_decay=True)]
    elif kind == "torch" and sharded:  # torch.optim.Muon + AdamW through routing
        opt = oracle_optimizers(model, is_matrix=sharded_recipe_matrix)
    elif kind == "muon" and sharded:
        ak = ADAMW_DEFAULTS
        opt = [mf.Muon(params, adamw_lr=ak["lr"], adamw_betas=ak["betas"], adamw_eps=ak["eps"],
                       adamw_weight_decay=ak["weight_decay"], **MUON_DEFAULTS)]
    else:  # the DDP oracle of both: torch.optim.Muon + AdamW
        opt = oracle_optimizers(model)
    return [mf.route_optimizer(o) for o in opt] if sharded else opt


def _gather_full(model) -> dict[str, torch.Tensor]:
    """Every parameter from its owner in this rank's shard group (test-side)."""
    from lightning_matrixfsdp.runtime.tags import shard_of, state_of

    sg = state_of(model).sg
    out = {}
    for name, p in model.named_parameters():
        s = shard_of(p)
        t = p.data.clone() if s.owner == sg.rank else torch.empty(s.shape, dtype=p.dtype)
        if sg.size > 1:
            dist.broadcast(t, src=sg.g(s.owner), group=sg.group)
        out[name] = t
    return out


def split_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime import get_comm_stats, get_plan, start_replica_sync, sync_replicas
    from lightning_matrixfsdp.runtime.tags import is_owned, shard_of, state_of

    W = cfg["shard_size"]
    torch.manual_seed(0)
    oracle = TinyLM(d=16, heads=2, layers=2, extra_branch=cfg.get("branch", False))
    for n, p in oracle.named_parameters():
        if any(n.startswith(f) for f in cfg.get("frozen", ())):
            p.requires_grad_(False)
    sharded = copy.deepcopy(oracle)
    mf.matrix_shard(sharded, shard_size=W, replica_split=True, zero_missing_grads=cfg.get("zero_missing", False),
                    collective="p2p_direct" if cfg.get("direct") else "p2p")
    plan = get_plan(sharded)
    st = state_of(sharded)
    if cfg.get("direct") and st.replicas is not None:  # NCCL's layout on gloo: every tensor as it is
        st.replicas.exchange.pack = False
    if cfg.get("chunk"):  # the reduction chain in many chunks, cut across tensors
        st.replicas.exchange.chunk_bytes = cfg["chunk"]
    R = world // W
    me = st.replicas.exchange.rg.rank if R > 1 else 0
    assert plan.replica_split == (R > 1)
    kind = cfg.get("optimizer", "muon")
    o_opts, s_opts = _optimizers(oracle, kind, False), _optimizers(sharded, kind, True)
    if kind in ("soap", "shampoo"):  # the same wrapper on the full replica (each matrix on its own)
        o_opts = _optimizers(oracle, kind, False)
    accumulate, zero_missing = cfg.get("accumulate", 1), cfg.get("zero_missing", False)
    for step in range(cfg.get("steps", 3)):
        if cfg.get("branch"):  # the branch used on one rank only: zero_missing_grads' case
            oracle.use_branch = sharded.use_branch = rank == step % world
        acc: dict[str, torch.Tensor] = {}
        for micro in range(accumulate):
            idx = batch_for(step * accumulate + micro, rank, vocab=64)
            lo = lm_loss(oracle(idx), idx) / accumulate
            ls = lm_loss(sharded(idx), idx) / accumulate
            assert torch.equal(lo.detach(), ls.detach()), f"step {step}: loss {ls.item()} vs oracle {lo.item()}"
            lo.backward()
            ls.backward()
            if W == 1:
                allreduce_mean_grads(oracle, zero_missing)  # the oracle's own flat sum
            else:
                allreduce_mean_grads(oracle, zero_missing, group=W)
            move_grads_into(oracle, acc)
        for n, p in oracle.named_parameters():
            p.grad = acc.get(n)
        if cfg.get("clip"):
            clip_global_norm(oracle, cfg["clip"])
            mf.clip_grad_norm_(sharded, cfg["clip"])
        o_params = dict(oracle.named_parameters())
        for n, p in sharded.named_parameters():
            og = o_params[n].grad
            steps_here = is_owned(p) and plan.stepper(shard_of(p).fqn) in (None, me)
            if not steps_here or og is None:
                assert p.grad is None, f"{n}: a gradient on a rank that does not step it"
                continue
            assert p.grad is not None and torch.equal(p.grad, og), f"step {step}: grad {n} differs"
        step_oracle_and_sharded(o_opts, s_opts)
        if cfg.get("sync") == "explicit":
            for o in s_opts:
                start_replica_sync(sharded, o)
            # state_dict() waits for the transfers started (and may be called on one rank alone);
            # local_state_dict: this rank's part (a plain state_dict() of a partial model is refused)
            sd = mf.local_state_dict(sharded)
            for n, p in oracle.named_parameters():
                if sd[n].numel():
                    assert torch.equal(sd[n], p.detach()), f"step {step}: state_dict()[{n!r}] is stale"
        if cfg.get("sync") != "lazy":  # the lazy case checks weights through the next forwards only
            sync_replicas(sharded)
            full = _gather_full(sharded)
            for n, p in oracle.named_parameters():
                assert torch.equal(full[n], p.detach()), f"step {step}: param {n} differs"
    # the final forward (no_grad) starts and waits for what is still to send
    idx = batch_for(999, rank)
    with torch.no_grad():
        assert torch.equal(oracle(idx), sharded(idx)), "final logits differ"
    # optimizer state only where the role is stepped
    held = {shard_of(p).fqn for o in s_opts for p in o.state if o.state[p]}
    stepped = {shard_of(p).fqn for p in sharded.parameters()
               if is_owned(p) and p.requires_grad and plan.stepper(shard_of(p).fqn) in (None, me)}
    assert held <= stepped, f"optimizer state held for roles stepped elsewhere: {held - stepped}"
    # analytic replica bytes, per used role of b bytes: the running sum goes 0 -> 1 -> ... -> m, where
    # m is the stepper s if at most one replica follows it (that one sends its own part to s), else
    # the last replica (which sends the total to s); the stepper broadcasts b, the others receive it
    expect = {"replica_reduce": [0, 0], "replica_broadcast": [0, 0]}
    for p in sharded.parameters():
        sh = shard_of(p)
        if not (is_owned(p) and p.requires_grad) or R == 1:
            continue
        b, s = sh.nbytes, plan.stepper(sh.fqn)
        m = s if s >= R - 2 else R - 1
        sends = me < m or me > m or (me == m and m != s)
        receives = (1 <= me <= m) + (me == s and m != s) + (me == s and m < R - 1)
        expect["replica_reduce"][0] += b if sends else 0
        expect["replica_reduce"][1] += receives * b
        expect["replica_broadcast"][0 if s == me else 1] += b
    state_bytes = sum(v.numel() * v.element_size() for o in s_opts for s_ in o.state.values()
                      for v in s_.values() if isinstance(v, torch.Tensor))
    trainable = sum(shard_of(p).nbytes for p in sharded.parameters() if is_owned(p) and p.requires_grad)
    return {"stats": get_comm_stats(sharded), "expect": expect, "steps": cfg.get("steps", 3), "trainable": trainable,
            "state_bytes": state_bytes, "held": sorted(held)}


def _run(dist_pools, world, **cfg):
    return dist_pools(world).run(split_worker, cfg, timeout=200)


@pytest.mark.parametrize("R,W", [(2, 1), (2, 2), (3, 1), (4, 1)], ids=["2x1", "2x2", "3x1", "4x1"])
def test_split_matches_ddp_bitwise_and_counts_bytes(R, W, dist_pools):
    res = _run(dist_pools, R * W, shard_size=W, sync="explicit", steps=3)
    for r in res:
        for phase, (sent, recv) in r["expect"].items():
            got = r["stats"][phase]
            assert (got["sent"], got["recv"]) == (r["steps"] * sent, r["steps"] * recv), (phase, got, sent, recv)
        assert r["stats"]["replicate"]["calls"] == 0
        # bounded by the owned bytes T whatever R: one copy sent and at most two received in the
        # reduction, one copy in or out in the broadcast (a fan-in stepper would take R - 1 copies)
        T, n = r["trainable"], r["steps"]
        red, bc = r["stats"]["replica_reduce"], r["stats"]["replica_broadcast"]
        assert red["sent"] <= n * T and red["recv"] <= 2 * n * T and bc["sent"] + bc["recv"] == n * T, (red, bc, T)
    # every role's state is held exactly once per shard rank (across replicas)
    for w in range(W):
        names = [n for rank, r in enumerate(res) if rank % W == w for n in r["held"]]
        assert len(names) == len(set(names))


@pytest.mark.parametrize("R,W,cfg", [
    (2, 1, dict(accumulate=2, clip=0.05, sync="lazy")),
    (3, 1, dict(frozen=("blocks.0.",), clip=0.05, optimizer="torch")),
    (2, 2, dict(zero_missing=True, branch=True, accumulate=2)),
    (2, 1, dict(optimizer="soap")),
    (2, 1, dict(optimizer="shampoo", sync="lazy")),
    (3, 1, dict(direct=True, sync="explicit")),
    (2, 2, dict(direct=True, accumulate=2, sync="lazy")),
    (4, 1, dict(chunk=200, accumulate=2, sync="lazy")),
], ids=["accumulate-clip-lazy", "frozen-clip-torch", "zero-missing-2x2", "soap", "shampoo", "direct-3x1",
        "direct-2x2", "chunked-4x1"])
def test_split_matches_ddp_with_features(R, W, cfg, dist_pools):
    _run(dist_pools, R * W, shard_size=W, steps=2, **cfg)


# ---------------------------------------------------------------------- the exchange alone, any stepper
def exchange_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """``ReplicaExchange`` over the whole world as the replicate group: roles of float32 and bfloat16
    stepped by every replica in turn, against an independent fold in replica order."""
    from lightning_matrixfsdp.runtime.comm.core import CommStats
    from lightning_matrixfsdp.runtime.replicas.comm import ReplicaExchange

    stats = CommStats()
    ex = ReplicaExchange(dist.group.WORLD, stats, chunk_bytes=cfg["chunk"])
    ex.pack = cfg.get("pack", True)
    shapes = [(7, 5), (3,), (11, 4), (6, 6), (9,)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float32]
    steppers = [cfg["stepper"] if cfg.get("stepper") is not None else i % world for i in range(len(shapes))]
    gen = torch.Generator().manual_seed(100 + rank)
    # magnitudes spread over many binades, so that the order of the additions changes the result
    grads = [(torch.randn(s, generator=gen) * 10.0 ** torch.randint(-6, 6, s, generator=gen)).to(dt)
             for s, dt in zip(shapes, dtypes)]
    mine = [g.clone() for g in grads]
    out = ex.start_reduce(grads, steppers).wait()
    order_matters = False
    for i, (g, s) in enumerate(zip(mine, steppers)):
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g)
        total = parts[0].clone()
        for x in parts[1:]:  # ((g_0 + g_1) + g_2) + ...
            total = total + x
        reverse = parts[-1].clone()
        for x in parts[-2::-1]:
            reverse = reverse + x
        order_matters |= not torch.equal(total, reverse)
        if s == rank:
            assert out[i] is not None and out[i].dtype == g.dtype and torch.equal(out[i], total), i
        else:
            assert out[i] is None, i
    reduce_stats = stats.snapshot()["replica_reduce"]
    # the weights back: each replica's tensors overwritten with its stepper's, in place
    weights = [torch.full(s, float(rank), dtype=dt) for s, dt in zip(shapes, dtypes)]
    ex.start_broadcast(weights, steppers).wait()
    for w, s in zip(weights, steppers):
        assert torch.equal(w, torch.full_like(w, float(s)))
    role_bytes = [g.numel() * g.element_size() for g in mine]
    return {"reduce": reduce_stats, "broadcast": stats.snapshot()["replica_broadcast"], "bytes": role_bytes,
            "steppers": steppers, "order_matters": order_matters}


@pytest.mark.parametrize("R,stepper,chunk,pack", [
    (2, None, 8, True), (3, None, 12, True), (4, None, 8, True), (4, 1, 12, False), (4, 0, 1 << 20, True),
], ids=["R2", "R3", "R4-chunks", "R4-stepper1-direct", "R4-stepper0-one-chunk"])
def test_exchange_sums_in_replica_order_with_bytes_independent_of_R(R, stepper, chunk, pack, dist_pools):
    """Bitwise the replica-order fold wherever the stepper sits in the order (chunked or not), and
    per role no rank sends more than one copy or receives more than two, broadcast included:
    a fan-in to the stepper would receive R - 1 copies (and send R - 1 in the broadcast)."""
    res = dist_pools(R).run(exchange_worker, {"chunk": chunk, "stepper": stepper, "pack": pack}, timeout=120)
    # the oracle can tell a wrong order apart (two terms commute: from R = 3 on)
    assert R == 2 or any(r["order_matters"] for r in res)
    role_bytes, steppers = res[0]["bytes"], res[0]["steppers"]
    for rank, r in enumerate(res):
        stepped = sum(b for b, s in zip(role_bytes, steppers) if s == rank)
        assert r["reduce"]["sent"] <= sum(role_bytes), (rank, r["reduce"])
        assert r["reduce"]["recv"] <= sum(role_bytes) + stepped, (rank, r["reduce"])
        assert r["broadcast"]["sent"] == stepped and r["broadcast"]["recv"] == sum(role_bytes) - stepped
    # summed over the replicas: R - 1 additions each one message, plus at most one hop per role
    total = sum(r["reduce"]["sent"] for r in res)
    assert total == sum(r["reduce"]["recv"] for r in res)
    assert (R - 1) * sum(role_bytes) <= total <= R * sum(role_bytes)


# ---------------------------------------------------------------------- checkpoints
def _train_and_save(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train 2 steps with or without replica_split (W = 1), save a directory and a file."""
    import json

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.checkpoint import save_sharded

    torch.manual_seed(0)
    model = TinyLM(d=16, heads=2, layers=2)
    mf.matrix_shard(model, shard_size=1, replica_split=cfg["split"])
    opts = _optimizers(model, "muon", True)
    for step in range(2):
        idx = batch_for(step, rank)
        lm_loss(model(idx), idx).backward()
        opts[0].step()
        opts[0].zero_grad(set_to_none=True)
    # no explicit sync: the save itself must send the last step's update first
    save_sharded(model, cfg["dir"], opts, extra={"step": 2})
    save_sharded(model, cfg["file"], opts, full=True)
    side = json.loads(open(f"{cfg['dir']}/matrix_fsdp_layout.json").read()) if rank == 0 else None
    return {"side": side}


def _load_and_check(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Load the directory into another layout; weights and each stepper's state equal the file's."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.checkpoint import load_sharded
    from lightning_matrixfsdp.runtime.tags import is_owned

    torch.manual_seed(1)  # other initial weights: the load must replace them
    model = TinyLM(d=16, heads=2, layers=2)
    mf.matrix_shard(model, shard_size=cfg["W"], replica_split=cfg["split"])
    opts = _optimizers(model, "muon", True)
    ref = torch.load(cfg["file"], weights_only=False)
    for source in (cfg["file"], cfg["dir"]):  # the consolidated file, then the directory
        meta = load_sharded(model, source, opts)
        assert meta["step"] == 2 if source == cfg["dir"] else meta is not None
        _check_loaded(model, opts, ref)
    # and it trains on: one step, then every replica's weights are equal
    idx = batch_for(5, rank)
    lm_loss(model(idx), idx).backward()
    opts[0].step()
    mf.runtime.sync_replicas(model)
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters() if is_owned(p)}}


def _check_loaded(model, opts, ref) -> None:
    """Weights equal the consolidated file's; optimizer state equal to it on stepping ranks, absent elsewhere."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.tags import is_owned, shard_of, state_of

    names = [n for g in ref["optimizer_states"][0]["param_groups"] for n in g["param_names"]]
    ids = [i for g in ref["optimizer_states"][0]["param_groups"] for i in g["params"]]
    ref_state = {n: ref["optimizer_states"][0]["state"][i] for n, i in zip(names, ids)
                 if i in ref["optimizer_states"][0]["state"]}
    plan = mf.get_plan(model)
    me = state_of(model).replica_rank
    by_id = {id(p): p for p in model.parameters()}
    held = 0
    for p in opts[0].state:
        fqn = shard_of(by_id[id(p)]).fqn
        assert plan.stepper(fqn) in (None, me), f"state loaded on a replica that does not step {fqn}"
        for k, v in ref_state[fqn].items():
            assert torch.equal(torch.as_tensor(opts[0].state[p][k]), torch.as_tensor(v)), (fqn, k)
        held += 1
    expected = sum(1 for p in model.parameters() if is_owned(p) and plan.stepper(shard_of(p).fqn) in (None, me))
    assert held == expected, (held, expected)
    for n, p in model.named_parameters():
        if is_owned(p):
            assert torch.equal(p.detach(), ref["state_dict"][n]), n


def test_checkpoints_across_split_and_layouts(tmp_path, dist_pools):
    on, off = {"dir": str(tmp_path / "on"), "file": str(tmp_path / "on.ckpt"), "split": True}, \
              {"dir": str(tmp_path / "off"), "file": str(tmp_path / "off.ckpt"), "split": False}
    side = dist_pools(2).run(_train_and_save, on)[0]["side"]
    dist_pools(2).run(_train_and_save, off)
    assert {p.get("stepper") for p in side["params"].values()} == {0, 1}
    assert side["plans"][0]["plan"]["steppers"]
    # the consolidated export does not depend on replica_split (both runs are DDP, bitwise)
    a, b = torch.load(on["file"], weights_only=False), torch.load(off["file"], weights_only=False)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    sa, sb = a["optimizer_states"][0], b["optimizer_states"][0]
    assert [g["param_names"] for g in sa["param_groups"]] == [g["param_names"] for g in sb["param_groups"]]
    assert sa["state"].keys() == sb["state"].keys()
    assert all(torch.equal(torch.as_tensor(sa["state"][i][k]), torch.as_tensor(v))
               for i in sa["state"] for k, v in sb["state"][i].items())
    # split save -> unsplit (R, W) = (2, 1) and split (2, 2); unsplit save -> split (4, 1)
    for world, W, split, src in ((2, 1, False, on), (4, 2, True, on), (4, 1, True, off)):
        dist_pools(world).run(_load_and_check, {"dir": src["dir"], "file": src["file"], "W": W, "split": split})


# ---------------------------------------------------------------------- bench: the scaling rows
def test_scaling_split_rows_match_the_model(tmp_path, monkeypatch):
    """The HSDP rows of ``bench.scaling`` (R=2, W=1): counted bytes equal the analytic model, the
    split mode holds half the optimizer state, and its losses are the unsplit mode's (W = 1: exact).
    The entry point runs in this process (no interpreter start of its own); it spawns its 2 ranks."""
    import json

    from conftest import clean_env

    from lightning_matrixfsdp.bench import scaling

    kept = clean_env()
    for name in [k for k in os.environ if k not in kept]:  # no rendezvous left behind by earlier tests
        monkeypatch.delenv(name)
    before = os.environ.get("MATRIX_FSDP_CHECK_SEQUENCE")
    assert scaling.main(["--world", "--split", "2,1", "--layers", "2", "--out", str(tmp_path)]) == 0
    assert os.environ.get("MATRIX_FSDP_CHECK_SEQUENCE") == before  # the bench's own setting stays its own
    study = json.loads((tmp_path / "scaling.json").read_text())
    rows = {r["mode"]: r for r in study["split_rows"]}
    assert set(rows) == {"matrix_hsdp", "matrix_hsdp_split"}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["measured"] == {k: int(v) for k, v in r["analytic"].items()}, r
    assert rows["matrix_hsdp_split"]["measured"]["forward"] > 0  # the weights go back in the next forward
    total = [sum(rows[m]["optimizer_state"]) for m in ("matrix_hsdp", "matrix_hsdp_split")]
    assert total[0] == 2 * total[1]
    runs = json.loads((tmp_path / "r2w1" / "bench_scaling_w2_cpu.json").read_text())["modes"]
    assert runs["matrix_hsdp_split"]["losses"] == runs["matrix_hsdp"]["losses"]


def test_strategy_option_is_checked():
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.errors import MatrixShardError

    with pytest.raises(MatrixShardError, match="replica_split=1"):
        mf.MatrixFSDPStrategy(replica_split=1)
    with pytest.raises(MatrixShardError, match="replica_split='on'"):
        mf.MatrixFSDPFabricStrategy(replica_split="on")
    assert mf.MatrixFSDPStrategy(replica_split=True, shard_size=1).replica_split is True
