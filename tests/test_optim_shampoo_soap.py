"""Shampoo / SOAP (pytorch_optimizer, per matrix) + AdamW tail, single process and owner-sharded.

Oracle everywhere: the library optimizer stepped directly on the 2D parameters plus
``torch.optim.AdamW`` (single tensor) on the rest. Each matrix's update in the library
depends only on that matrix's gradient and state, and our wrapper runs the same kernels on
the same inputs, so comparisons are bitwise (``torch.equal``); the one exception is the
library-vs-wrapper check of Shampoo's coupled-Newton root, whose power iteration draws random
start vectors (see SCHUR_NEWTON_TOL; observed max difference ~3e-7 after 6 steps). In the
sharded runs the p2p collective sums gradients in the oracle's rank order, so gradients, and
so every step, are bitwise equal too.
"""
from __future__ import annotations

import copy
import functools
import io
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("pytorch_optimizer")
import pytorch_optimizer  # noqa: E402

from lightning_matrixfsdp.optim.matrix_optimizers import SOAP, Shampoo  # noqa: E402
from lightning_matrixfsdp.optim.routing import route_optimizer  # noqa: E402

OURS = {"SOAP": SOAP, "Shampoo": Shampoo}

# name -> (our class name, our kwargs, library kwargs, AdamW kwargs). Library kwargs are
# written out independently of our translation (enum ints, shape_interpretation).
CASES: dict[str, tuple[str, dict, dict, dict]] = {
    "soap": ("SOAP", dict(lr=0.01, precondition_frequency=2),
             dict(lr=0.01, precondition_frequency=2),
             dict(lr=0.01, weight_decay=0.01)),
    "soap_skipped_dim": ("SOAP", dict(lr=0.02, betas=(0.9, 0.95), max_precondition_dim=16, weight_decay=0.1,
                                      precondition_frequency=3, adamw_weight_decay=0.0),
                         dict(lr=0.02, betas=(0.9, 0.95), max_precondition_dim=16, weight_decay=0.1,
                              precondition_frequency=3),
                         dict(lr=0.02, weight_decay=0.0)),
    # block_size=8: 24x8 and 8x8 give same-shape blocks (stacked statistics), 11x8 does not (a list)
    "shampoo_blocked_svd": ("Shampoo", dict(lr=0.01, start_preconditioning_step=2, preconditioning_compute_steps=2,
                                            block_size=8, graft_type="rmsprop", use_svd=True),
                            dict(lr=0.01, start_preconditioning_step=2, preconditioning_compute_steps=2,
                                 block_size=8, graft_type=3, use_svd=True, shape_interpretation=False),
                            dict(lr=0.01, weight_decay=0.0)),
    # the library's default inverse root: coupled Newton, whose ridge comes from a random-start
    # power iteration (see SCHUR_NEWTON_TOL)
    "shampoo_schur_newton": ("Shampoo", dict(lr=0.01, start_preconditioning_step=1, preconditioning_compute_steps=1,
                                             graft_type="adagrad", weight_decay=0.01, decoupled_weight_decay=True),
                             dict(lr=0.01, start_preconditioning_step=1, preconditioning_compute_steps=1,
                                  graft_type=2, weight_decay=0.01, decoupled_weight_decay=True,
                                  shape_interpretation=False),
                             dict(lr=0.01, weight_decay=0.01)),
}
# Our Shampoo seeds the power iteration per matrix (private generator); the library draws from
# the global one. The start vector only enters through the ridge term eps * lambda_max after
# 100 iterations, so the two differ in the last bits of lambda_max: ~1e-7 relative, and
# after 6 steps at lr=0.01 about 3e-7 absolute on O(1) weights (measured); 1e-5 leaves margin.
SCHUR_NEWTON_TOL = dict(rtol=1e-5, atol=1e-5)
LIBRARY_NAME = {"SOAP": "SOAP", "Shampoo": "ScalableShampoo"}


# ----------------------------------------------------------------------- helpers


class Net(nn.Module):
    """Embedding + tall / wide / square Linear layers + LayerNorm, float32."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.up = nn.Linear(8, 24)
        self.norm = nn.LayerNorm(24)
        self.down = nn.Linear(24, 8, bias=False)
        self.sq = nn.Linear(8, 8)


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def set_grads(models: list[nn.Module], step: int) -> None:
    """The same random gradients on every model."""
    gen = torch.Generator().manual_seed(1000 + step)
    for group in zip(*(list(m.parameters()) for m in models)):
        g = torch.randn(group[0].shape, generator=gen)
        for p in group:
            p.grad = g.clone()


def oracle_optimizers(model: nn.Module, case: str) -> list[torch.optim.Optimizer]:
    """The library on the 2D parameters, torch AdamW on the rest."""
    name, _, lib_kw, adamw_kw = CASES[case]
    lib_cls = getattr(pytorch_optimizer, LIBRARY_NAME[name])
    mats = [p for p in model.parameters() if p.ndim == 2 and getattr(p, "_mfsdp_role", "matrix") == "matrix"]
    rest = [p for p in model.parameters() if all(p is not q for q in mats)]
    return [lib_cls(mats, **lib_kw), torch.optim.AdamW(rest, foreach=False, **adamw_kw)]


def ours(model: nn.Module, case: str, recipe: bool = False, **extra: Any) -> torch.optim.Optimizer:
    """``recipe``: built from the module (the Muon recipe's groups), else over bare parameters."""
    name, kw, _, _ = CASES[case]
    return OURS[name](model if recipe else model.parameters(), **{**kw, **extra})


def assert_same_params(a: nn.Module, b: nn.Module, step: int, tol: dict | None = None) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        same = torch.allclose(p, q, **tol) if tol else torch.equal(p, q)
        assert same, f"step {step}: {n} differs by {(p - q).abs().max().item():.3e}"


# ----------------------------------------------------------------- single process


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_library_plus_adamw(case):
    ref, mine = make_model(), make_model()
    ref_opts, opt = oracle_optimizers(ref, case), ours(mine, case)
    for step in range(6):
        set_grads([ref, mine], step)
        for o in ref_opts:
            o.step()
        opt.step()
        assert_same_params(ref, mine, step, SCHUR_NEWTON_TOL if case == "shampoo_schur_newton" else None)


def test_shampoo_leaves_global_rng_alone_and_is_deterministic():
    """The power iteration runs on a private seeded stream: same result whatever the global RNG."""
    finals = []
    for seed in (1, 2):
        model = make_model()
        opt = ours(model, "shampoo_schur_newton")
        torch.manual_seed(seed)
        for step in range(3):
            set_grads([model], step)
            before = torch.get_rng_state()
            opt.step()
            assert torch.equal(before, torch.get_rng_state()), "optimizer step consumed the global RNG"
        finals.append(model)
    assert_same_params(finals[0], finals[1], 3)


def _all_plain(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, int, float, bool, str, type(None)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip_resumes_identically(case):
    straight = make_model()
    opt = ours(straight, case)
    for step in range(6):
        set_grads([straight], step)
        opt.step()

    first = make_model()
    opt1 = ours(first, case)
    for step in range(3):
        set_grads([first], step)
        opt1.step()
    sd = opt1.state_dict()
    assert all(_all_plain(v) for s in sd["state"].values() for v in s.values()), "non-plain state"
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": sd}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # tensors and scalars only

    resumed = make_model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2 = ours(resumed, case)
    opt2.load_state_dict(saved["opt"])
    for step in range(3, 6):
        set_grads([resumed], step)
        opt2.step()
    assert_same_params(straight, resumed, 6)
    # and the state itself is identical
    s_a, s_b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s_a.keys() == s_b.keys()
    for i in s_a:
        assert s_a[i].keys() == s_b[i].keys()
        for k, v in s_a[i].items():
            assert torch.equal(v, s_b[i][k]) if isinstance(v, torch.Tensor) else v == s_b[i][k], (i, k)


@pytest.mark.parametrize("case", ["soap", "shampoo_blocked_svd"])
@pytest.mark.parametrize("adamw_lr", [None, 0.05])
def test_lr_scheduler_drives_both_parts(case, adamw_lr):
    ref, mine = make_model(), make_model()
    ref_opts = oracle_optimizers(ref, case)
    if adamw_lr is not None:
        ref_opts[1].param_groups[0]["lr"] = adamw_lr
        ref_opts[1].param_groups[0]["initial_lr"] = adamw_lr
    opt = ours(mine, case, adamw_lr=adamw_lr)
    halve = lambda s: 0.5**s  # noqa: E731 - powers of two keep the lr arithmetic exact
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, halve) for o in (*ref_opts, opt)]
    for step in range(4):
        set_grads([ref, mine], step)
        for o in (*ref_opts, opt):
            o.step()
        for s in scheds:
            s.step()
        assert_same_params(ref, mine, step)
    assert opt.param_groups[0]["lr"] == CASES[case][1]["lr"] * 0.5**4


@pytest.mark.parametrize("name", sorted(OURS))
def test_placeholders_missing_grads_and_role_tags(name):
    kept = nn.Parameter(torch.randn(6, 4))
    placeholder = nn.Parameter(torch.empty(0, 4))  # a non-owner's resident matrix
    placeholder._mfsdp_role, placeholder._mfsdp_owned = "matrix", False
    no_grad = nn.Parameter(torch.randn(5, 5))
    tail_matrix = nn.Parameter(torch.randn(3, 4))  # 2D but tagged tail: AdamW
    tail_matrix._mfsdp_role = "tail"
    bias = nn.Parameter(torch.randn(4))
    params = [kept, placeholder, no_grad, tail_matrix, bias]
    opt = OURS[name](params, lr=0.01)
    for p in (kept, tail_matrix, bias):
        p.grad = torch.randn_like(p)
    placeholder.grad = torch.zeros_like(placeholder)
    before = {id(p): p.detach().clone() for p in params}
    opt.step()
    opt.step()  # SOAP's first step only builds its preconditioner (library behaviour)
    assert placeholder not in opt.state and no_grad not in opt.state
    assert torch.equal(no_grad, before[id(no_grad)])
    for p in (kept, tail_matrix, bias):
        assert not torch.equal(p, before[id(p)])
    assert set(opt.state[tail_matrix]) == {"step", "exp_avg", "exp_avg_sq"}  # torch AdamW's keys
    assert set(opt.state[bias]) == {"step", "exp_avg", "exp_avg_sq"}
    assert "exp_avg" in opt.state[kept] or "momentum" in opt.state[kept]
    # routing drops the placeholder; the routed optimizer steps the same way
    route_optimizer(opt)
    assert all(q is not placeholder for q in opt.param_groups[0]["params"])
    opt.step()
    # a 1-D parameter tagged as a matrix is an error, before any state changes
    odd = nn.Parameter(torch.randn(4))
    odd._mfsdp_role = "matrix"
    odd.grad = torch.randn(4)
    opt.add_param_group({"params": [odd]})
    with pytest.raises(ValueError, match="2D"):
        opt.step()


def test_validation_errors():
    p = [nn.Parameter(torch.randn(3, 3))]
    with pytest.raises(ValueError):
        SOAP(p, lr=-1.0)
    with pytest.raises(ValueError):
        SOAP(p, precondition_frequency=0)
    with pytest.raises(ValueError):
        Shampoo(p, graft_type="bogus")
    with pytest.raises(ValueError):
        Shampoo(p, adamw_betas=(0.9, 1.5))
    with pytest.raises(ValueError):
        Shampoo(p, lr=0.1).add_param_group({"params": [nn.Parameter(torch.randn(2, 2))], "lr": -1.0})


def test_factories_and_cli_signature():
    """``functools.partial`` factories and LightningCLI's class-path form both construct it."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.cli import instantiate_class

    model = make_model()
    opt = functools.partial(SOAP, lr=0.02, precondition_frequency=5)(model.parameters())
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[0]["precondition_frequency"] == 5

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(torch.optim.Optimizer, "optimizer", skip={"params"}, instantiate=False,
                                  fail_untyped=False)
    cfg = parser.parse_args(["--optimizer", "lightning_matrixfsdp.optim.matrix_optimizers.Shampoo",
                             "--optimizer.graft_type", "adagrad", "--optimizer.betas", "[0.9, 0.99]",
                             "--optimizer.adamw_lr", "0.003"])
    opt = instantiate_class(model.parameters(), cfg.optimizer.as_dict())
    assert isinstance(opt, Shampoo)
    group = opt.param_groups[0]
    assert group["graft_type"] == "adagrad" and tuple(group["betas"]) == (0.9, 0.99) and group["adamw_lr"] == 0.003


# ------------------------------------------------------------------- distributed

# Distributed cases: one per library, with every code path reached within 4 steps.
DIST_CASES = ("soap", "shampoo_blocked_svd", "shampoo_schur_newton")
# For the coupled-Newton Shampoo the oracle is our wrapper on the full replica (bitwise, since
# the per-matrix seed makes each update independent of placement); the other cases use the
# library itself, and test_matches_library_plus_adamw ties the two together.
WRAPPER_ORACLE = {"shampoo_schur_newton"}
STEPS = 4
SNAPSHOT_AFTER = 2  # steps done when the world-2 run saves what the world-3 run resumes from


def _owned_state(opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """This rank's optimizer state keyed by parameter fqn (what a checkpoint would write)."""
    return {p._mfsdp_shard.fqn: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
            for g in opt.param_groups for p in g["params"] if p in opt.state}


def _load_owned_state(opt: torch.optim.Optimizer, saved: dict[str, dict[str, Any]]) -> None:
    """Give each owned parameter its state by fqn, through the public load_state_dict."""
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    sd["state"] = {i: saved[p._mfsdp_shard.fqn] for i, p in zip(ids, params) if p._mfsdp_shard.fqn in saved}
    opt.load_state_dict(sd)


def _run_case(rank: int, case: str, resume: dict | None) -> dict[str, Any]:
    """Train the sharded model and the full-replica oracle side by side; compare every step."""
    import lightning_matrixfsdp as mf
    from helpers.equiv import count_collectives, full_params
    from helpers.models import TinyLM, batch_for, lm_loss
    from helpers.oracle import allreduce_mean_grads, mark_recipe_tail

    torch.manual_seed(0)
    oracle = TinyLM()
    if resume is not None:
        with torch.no_grad():
            for n, p in oracle.named_parameters():
                p.copy_(resume["params"][n])
    sharded = copy.deepcopy(oracle)
    mf.matrix_shard(sharded, collective="p2p")
    mark_recipe_tail(oracle)  # embedding and head on AdamW, as the optimizer built from the module does
    o_opts = [ours(oracle, case)] if case in WRAPPER_ORACLE else oracle_optimizers(oracle, case)
    s_opt = route_optimizer(ours(sharded, case, recipe=True))
    first, out = 0, {}
    if resume is not None:
        for o, sd in zip(o_opts, resume["oracle_opts"]):
            o.load_state_dict(sd)
        _load_owned_state(s_opt, resume["sharded_state"])
        first = SNAPSHOT_AFTER
    losses = []
    for step in range(first, STEPS):
        idx = batch_for(step, rank)
        lo, ls = lm_loss(oracle(idx), idx), lm_loss(sharded(idx), idx)
        lo.backward()
        ls.backward()
        allreduce_mean_grads(oracle)
        for o in o_opts:
            o.step()
            o.zero_grad(set_to_none=True)
        with count_collectives() as counter:
            s_opt.step()
        assert counter.calls == 0, f"{case}: optimizer step issued collectives {counter.names}"
        s_opt.zero_grad(set_to_none=True)
        assert torch.equal(lo.detach(), ls.detach()), f"{case} step {step}: loss {ls.item()} vs {lo.item()}"
        losses.append(ls.item())
        full = full_params(sharded)
        for n, p in oracle.named_parameters():
            assert torch.equal(full[n], p), f"{case} step {step}: {n} differs by {(full[n] - p).abs().max():.3e}"
        if resume is None and step + 1 == SNAPSHOT_AFTER:
            out = {"params": {n: p.detach().clone() for n, p in oracle.named_parameters()},
                   "oracle_opts": [copy.deepcopy(o.state_dict()) for o in o_opts],
                   "sharded_state": _owned_state(s_opt)}
    return {**out, "losses": losses, "owned": sorted(_owned_state(s_opt))}


def _dist_worker(rank: int, world: int, resume_blob: bytes | None) -> bytes:
    """Each case from scratch; then, if given another world size's snapshot, resumed from it.

    Tensors travel as ``torch.save`` bytes: a worker exits right after returning, before the
    parent could map tensors shared through file descriptors.
    """
    resume = _loads(resume_blob) if resume_blob is not None else None
    out: dict[str, Any] = {}
    for case in DIST_CASES:
        out[case] = _run_case(rank, case, None)
        if resume is not None:
            out[case]["resumed"] = _run_case(rank, case, resume[case])
    return _dumps(out)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)  # our own data (holds library objects)


def _merge_snapshots(results: list[dict]) -> dict[str, Any]:
    """What a fqn-keyed checkpoint holds: model + oracle from rank 0, each fqn's state from its owner."""
    snap = {}
    for case in DIST_CASES:
        merged: dict[str, Any] = {}
        for r in results:
            assert not merged.keys() & r[case]["sharded_state"].keys(), "a parameter has two owners"
            merged.update(r[case]["sharded_state"])
        snap[case] = {"params": results[0][case]["params"], "oracle_opts": results[0][case]["oracle_opts"],
                      "sharded_state": merged}
    return snap


def test_sharded_matches_full_replica_and_resumes_across_world_sizes(dist_pools):
    """World 2 and 3 match the full-replica oracle step by step; world 3 also resumes world 2's state."""
    res2 = [_loads(b) for b in dist_pools(2).run(_dist_worker, None)]
    res3 = [_loads(b) for b in dist_pools(3).run(_dist_worker, _dumps(_merge_snapshots(res2)))]
    for case in DIST_CASES:
        for res in (res2, res3):
            losses = res[0][case]["losses"]
            assert len(losses) == STEPS and losses[-1] != losses[0], (case, losses)
            owned = [set(r[case]["owned"]) for r in res]
            assert sum(map(len, owned)) == len(set().union(*owned)), "state for a parameter on two ranks"
            assert sum(1 for o in owned if o) > 1, "optimizer work not spread over ranks"
        assert len(res3[0][case]["resumed"]["losses"]) == STEPS - SNAPSHOT_AFTER
