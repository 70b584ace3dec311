"""Shared worker: train the sharded model and the DDP Muon oracle side by side, compare."""
from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from helpers.models import TinyLM, batch_for, lm_loss
from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS, allreduce_mean_grads, clip_global_norm, oracle_optimizers, sharded_recipe_matrix

# Tolerances.  Both sides run the same float32 forward/backward on the same rank.
# The p2p collective sums gradients in shard-rank order, exactly as the oracle's
# ordered all-reduce, so with p2p (and with any collective at world size <= 2,
# where a sum of two terms is order-free) the runs must be *bitwise* equal.  The
# broadcast and padded collectives sum inside gloo in an order we do not control;
# a one-ulp difference in a float32 gradient can flip one bfloat16 rounding inside
# Newton-Schulz and the trajectories then drift apart chaotically at lr=0.02, so
# those are compared in float64 (sum-order noise ~1e-16, bf16 flips practically
# impossible) to 1e-9.
EXACT = dict(rtol=0.0, atol=0.0)
FLOAT64 = dict(rtol=1e-9, atol=1e-9)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole on every rank, broadcast from its owner (test-side gather).

    With HSDP, owners are shard-group ranks; this gathers within the caller's shard
    group, so every replica checks its own copy.
    """
    from lightning_matrixfsdp.runtime.tags import state_of

    st = state_of(model)
    sg = st.sg
    out = {}
    for name, p in model.named_parameters():
        shard = p._mfsdp_shard
        if shard.experts is not None:  # a split expert stack: each block from its owner
            t = torch.empty(shard.shape, dtype=p.dtype)
            for piece in st.plan.pieces(shard.fqn):
                rows = t[piece.experts[0]:piece.experts[1]]
                if piece.owner == sg.rank:
                    rows.copy_(p.data)
                dist.broadcast(rows, src=sg.g(piece.owner), group=sg.group)
            out[name] = t
            continue
        t = p.data.clone() if p._mfsdp_owned else torch.empty(shard.shape, dtype=p.dtype)
        if sg.size > 1:
            dist.broadcast(t, src=sg.g(shard.owner), group=sg.group)
        out[name] = t
    return out


def make_sharded_optimizer(model, kind: str, muon_kw=None, adamw_kw=None):
    import lightning_matrixfsdp as mf

    if kind == "ours":
        mk, ak = {**MUON_DEFAULTS, **(muon_kw or {})}, {**ADAMW_DEFAULTS, **(adamw_kw or {})}
        opt = mf.Muon(model, adamw_lr=ak["lr"],  # the Muon recipe's groups, as the oracle's
                      adamw_betas=ak["betas"], adamw_eps=ak["eps"], adamw_weight_decay=ak["weight_decay"], **mk)
        return [mf.route_optimizer(opt)]
    # any torch optimizer via routing: torch.optim.Muon on matrix roles, AdamW on the tail
    opts = oracle_optimizers(model, is_matrix=sharded_recipe_matrix,
                             muon_kw=muon_kw, adamw_kw=adamw_kw)
    return [mf.route_optimizer(o) for o in opts]


def close(a: torch.Tensor, b: torch.Tensor, tol: dict) -> bool:
    return torch.equal(a, b) if tol["atol"] == 0 and tol["rtol"] == 0 else torch.allclose(a, b, **tol)


def move_grads_into(model: torch.nn.Module, acc: dict[str, torch.Tensor]) -> None:
    """Add each gradient of ``model`` to ``acc`` (by name) and clear it: one micro-batch's
    averaged gradients summed into the window's, as DDP does when every backward reduces."""
    for n, p in model.named_parameters():
        if p.grad is not None:
            acc[n] = acc[n] + p.grad if n in acc else p.grad
        p.grad = None


def assert_owned_grads_equal(sharded: torch.nn.Module, oracle: torch.nn.Module, tol: dict, what: str) -> None:
    """Every gradient this rank owns in ``sharded`` equals the oracle's (already averaged) within
    ``tol``; an expert stack split over owners is compared as this owner's block of experts."""
    from lightning_matrixfsdp.runtime.tags import is_owned, shard_of

    o_params = dict(oracle.named_parameters())
    for n, p in sharded.named_parameters():
        if is_owned(p) and p.numel():
            rows = shard_of(p).experts
            want = o_params[n].grad if rows is None else o_params[n].grad[rows[0]:rows[1]]
            assert close(p.grad, want, tol), f"{what}: grad {n} (experts {rows})"


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def compare(a: dict, b: dict, tol: dict, what: str, step: int) -> float:
    worst = 0.0
    for k in a:
        d = maxdiff(a[k], b[k])
        worst = max(worst, d)
        assert close(a[k], b[k], tol), f"step {step}: {what} {k} differs by {d:.3e}"
    return worst


def equivalence_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import lightning_matrixfsdp as mf

    torch.manual_seed(0)
    torch.set_default_dtype(cfg.get("dtype", torch.float32))
    model_kw = cfg.get("model", {})
    if cfg.get("meta"):
        with torch.device("meta"):
            sharded = TinyLM(**model_kw)
    else:
        oracle = TinyLM(**model_kw)
        sharded = copy.deepcopy(oracle)
    frozen = cfg.get("frozen", ())
    for n, p in sharded.named_parameters():
        if any(n.startswith(f) for f in frozen):
            p.requires_grad_(False)
    mf.matrix_shard(sharded, planner=cfg.get("planner", "role_greedy"), collective=cfg.get("collective", "p2p"),
                    matrix_filter=cfg.get("matrix_filter"), shard_size=cfg.get("shard_size"),
                    reshard_after_forward=cfg.get("reshard_after_forward", True), prefetch=cfg.get("prefetch", True),
                    zero_missing_grads=cfg.get("zero_missing_grads", False),
                    replica_split=cfg.get("replica_split", False))
    if cfg.get("meta"):
        oracle = TinyLM(**model_kw)
        full = full_params(sharded)
        # owners initialized their parameters: finite, LayerNorm weights one, matrices random
        assert all(torch.isfinite(t).all() for t in full.values())
        assert torch.equal(full["blocks.0.ln1.weight"], torch.ones_like(full["blocks.0.ln1.weight"]))
        assert all(t.std() > 0 for t in full.values() if t.ndim == 2)
        with torch.no_grad():
            for n, p in oracle.named_parameters():
                p.copy_(full[n])
    for n, p in oracle.named_parameters():
        if any(n.startswith(f) for f in frozen):
            p.requires_grad_(False)
    is_matrix = cfg.get("matrix_filter")
    o_opts = oracle_optimizers(oracle, is_matrix=(lambda n, p: p.ndim == 2 and is_matrix(n, p)) if is_matrix else None,
                               muon_kw=cfg.get("muon_kw"), adamw_kw=cfg.get("adamw_kw"))
    s_opts = make_sharded_optimizer(sharded, cfg.get("optimizer", "ours"), cfg.get("muon_kw"), cfg.get("adamw_kw"))

    tol = FLOAT64 if cfg.get("dtype") == torch.float64 else EXACT
    accumulate = cfg.get("accumulate", 1)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    losses = []
    no_sync = cfg.get("no_sync", False)
    for step in range(cfg.get("steps", 5)):
        unused = cfg.get("unused_every") and step % cfg["unused_every"] == 1
        for m in (oracle, sharded):
            m.use_branch = not unused
            if cfg.get("branch_on_rank") is not None:  # the root's branch, used on one rank only
                m.use_branch = rank == (step + cfg["branch_on_rank"]) % world
            if cfg.get("route") is not None:  # per rank and step: which expert each block runs
                for i, blk in enumerate(m.blocks):
                    blk.route = cfg["route"](step, rank, i)
        zero_missing = cfg.get("zero_missing_grads", False)
        acc: dict = {}
        for micro in range(accumulate):
            idx = batch_for(step * accumulate + micro, rank)
            last = micro == accumulate - 1
            if no_sync:  # accumulate full gradients locally, reduce once on the last micro-batch
                mf.set_requires_gradient_sync(sharded, last)
            lo = lm_loss(oracle(idx), idx) / accumulate
            ls = lm_loss(sharded(idx), idx) / accumulate
            lo.backward()
            ls.backward()
            if not no_sync:  # the oracle reduces every micro-batch too and sums the averages
                allreduce_mean_grads(oracle, zero_missing)
                move_grads_into(oracle, acc)
            d = maxdiff(lo.detach(), ls.detach())
            worst["loss"] = max(worst["loss"], d)
            assert close(lo.detach(), ls.detach(), tol), f"step {step}: loss {ls.item()} vs oracle {lo.item()}"
            losses.append(ls.item())
        if no_sync:
            allreduce_mean_grads(oracle, zero_missing)
        else:
            for n, p in oracle.named_parameters():
                p.grad = acc.get(n)
        if cfg.get("clip"):
            clip_global_norm(oracle, cfg["clip"])
            mf.clip_grad_norm_(sharded, cfg["clip"])
        # full gradients: on the owner, the resident .grad is the averaged full gradient
        o_params = dict(oracle.named_parameters())
        for n, p in sharded.named_parameters():
            og = o_params[n].grad
            if not p._mfsdp_owned:
                assert p.grad is None, f"non-owner holds a gradient for {n}"
                continue
            if og is None:
                assert p.grad is None, f"{n}: oracle has no gradient but the owner has one"
                continue
            assert p.grad is not None and p.grad.shape == og.shape, f"{n}: missing or misshaped gradient"
            d = maxdiff(p.grad, og)
            worst["grad"] = max(worst["grad"], d)
            assert close(p.grad, og, tol), f"step {step}: grad {n} differs by {d:.3e}"
        step_oracle_and_sharded(o_opts, s_opts)  # no collective may run inside the optimizer step
        check_memory_shape(sharded)
        worst["param"] = max(worst["param"], compare(full_params(sharded), dict(oracle.named_parameters()),
                                                     tol, "param", step))
    # final logits in eval / no_grad
    idx = batch_for(999, rank)
    with torch.no_grad():
        lo, ls = oracle(idx), sharded(idx)
    worst["logits"] = maxdiff(lo, ls)
    assert close(lo, ls, tol), f"final logits differ by {worst['logits']:.3e}"
    check_memory_shape(sharded)
    owned_bytes = sum(p.numel() * p.element_size() for p in sharded.parameters()
                      if p._mfsdp_owned and p.requires_grad)
    return {"worst": worst, "losses": losses, "owned_grad_bytes": owned_bytes, "plan": str(mf.get_plan(sharded)),
            "plan_dict": mf.get_plan(sharded).to_dict(), "stats": mf.get_comm_stats(sharded)}


def no_matrices(fqn: str, p) -> bool:
    """A matrix_filter that sends everything to the AdamW tail."""
    return False


def leave_last_rank_empty(units, world):
    """A custom planner: role_greedy over the first world-1 ranks; the last rank owns nothing."""
    from lightning_matrixfsdp.runtime.placement import Plan, UnitLayout
    from lightning_matrixfsdp.runtime.planner import make_plan

    inner = make_plan(units, world - 1, "role_greedy")
    return Plan(world, "leave_last_rank_empty", [UnitLayout(u.fqn, world, u.shards) for u in inner.units],
                inner.loads_bytes + [0], inner.loads_flops + [0])


class count_collectives:
    """Counts every torch.distributed collective / p2p call made inside the block: ``calls``,
    ``names`` (in order) and ``peers`` (the peers of ``batch_isend_irecv``'s ops).

    ``names``: the functions to wrap (default ``NAMES``). Code that builds ``dist.P2POp``s needs
    ``isend``/``irecv`` left unwrapped (``P2POp`` refuses any other function): pass ``NO_P2P_OPS``."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all",
             "all_to_all_single", "gather", "scatter", "all_gather_object", "broadcast_object_list", "barrier",
             "reduce_scatter_single", "all_gather_single")
    NO_P2P_OPS = tuple(n for n in NAMES if n not in ("isend", "irecv"))

    def __init__(self, names: Optional[Sequence[str]] = None) -> None:
        self.wrap = tuple(self.NAMES if names is None else names)

    def __enter__(self):
        self.calls, self.names, self.peers, self._orig = 0, [], set(), {}
        for n in self.wrap:
            f = getattr(dist, n, None)
            if f is None:
                continue
            self._orig[n] = f

            def wrapped(*a, __f=f, __n=n, **k):
                self.calls += 1
                self.names.append(__n)
                if __n == "batch_isend_irecv":
                    self.peers.update(op.peer for op in (a[0] if a else k["p2p_op_list"]))
                return __f(*a, **k)

            setattr(dist, n, wrapped)
        return self

    def __exit__(self, *exc):
        for n, f in self._orig.items():
            setattr(dist, n, f)


def check_memory_shape(model: torch.nn.Module) -> None:
    """Between steps: every parameter is held whole exactly once across ranks; no unsharded buffer."""
    from lightning_matrixfsdp.runtime.tags import state_of

    st = state_of(model)
    for p in st.params:
        if p.aliases:  # a shard group of one rank: the unsharded parameter is the resident's own bytes
            assert p.unsharded.data_ptr() == p.resident.data_ptr(), f"{p.shard.fqn}: alias lost its resident"
        else:
            assert p.unsharded.untyped_storage().size() == 0, f"{p.shard.fqn}: unsharded buffer still allocated"
        assert p.unsharded.grad is None, f"{p.shard.fqn}: unsharded gradient still held"
        for m, name in p.registrations:
            assert m._parameters[name] is p.resident, f"{p.shard.fqn}: unsharded parameter still registered"
    sizes = torch.tensor([p.numel() for p in model.parameters()], dtype=torch.int64)
    full = torch.tensor([p._mfsdp_shard.numel for p in model.parameters()], dtype=torch.int64)
    if st.sg.size > 1:
        dist.all_reduce(sizes, group=st.sg.group)  # once per replica
    assert torch.equal(sizes, full), "resident tensors do not hold each parameter exactly once"


def route_by_rank(step: int, rank: int, block: int) -> Optional[int]:
    """Data-dependent unused parameters: rank 0's blocks run every expert, the others one
    expert each, changing with step and block; every third step all ranks run expert 0
    only, so expert 1 is unused on every rank."""
    if step % 3 == 2:
        return 0
    return None if rank == 0 else (rank + step + block) % 2


def step_oracle_and_sharded(o_opts: Sequence, s_opts: Sequence) -> None:
    """One step of the oracle's optimizers, then of the sharded ones, which may not run any collective;
    both zero their gradients."""
    for o in o_opts:
        o.step()
        o.zero_grad(set_to_none=True)
    with count_collectives() as counter:
        for o in s_opts:
            o.step()
    assert counter.calls == 0, f"optimizer step issued {counter.calls} collectives: {counter.names}"
    for o in s_opts:
        o.zero_grad(set_to_none=True)
