"""The global-norm clip's all-reduce is communication like any other: it is counted."""
import csv

import torch

import lightning_matrixfsdp as mf
from helpers.lit import trainer_worker
from helpers.models import TinyLM, batch_for, lm_loss


def _clip_counted_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = mf.matrix_shard(TinyLM())
    batch = batch_for(0, rank)
    lm_loss(model(batch), batch).backward()
    before = mf.get_comm_stats(model)["clip"]
    mf.clip_grad_norm_(model, 0.1)
    return {"before": before, "after": mf.get_comm_stats(model)["clip"], "params": len(list(model.parameters()))}


def test_clip_all_reduce_counts_under_clip(dist_pools):
    for r in dist_pools(2).run(_clip_counted_worker, timeout=120):
        assert r["before"] == {"sent": 0, "recv": 0, "calls": 0}
        # the list check (four float64 numbers), then each parameter's norm and flag (two float64)
        b = 4 * 8 + 2 * 8 * r["params"]
        assert r["after"] == {"sent": b, "recv": b, "calls": 2}, r


def test_strategy_logs_clip_traffic(tmp_path, dist_pools):
    dist_pools(2).run(trainer_worker, {"steps": 2, "csv_logger": True, "root": str(tmp_path),
                                        "trainer": {"gradient_clip_val": 0.3, "log_every_n_steps": 1}},
                      timeout=240)
    rows = [r for r in csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv"))
            if r.get("matrix_fsdp/clip_MB")]
    assert len(rows) == 2, rows
    from helpers.lit import LitTiny

    per_step = 2 * (4 * 8 + 2 * 8 * len(list(LitTiny().parameters())))  # sent + received, two all-reduces
    assert all(float(r["matrix_fsdp/clip_MB"]) == per_step / 2**20 for r in rows), rows


# ---------------------------------------------------------------------- every norm type, like torch
NORMS = (2.0, 1.0, 3.0, 0.5, 0.0, -1.0, float("inf"), float("-inf"))
CASES = ("finite", "nan_on_rank1", "inf_on_rank1", "zero_tensor")


def _grad_for(fqn: str, shape: tuple, case: str, target: str) -> torch.Tensor:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(sum(map(ord, fqn))))
    if fqn == target:
        if case == "nan_on_rank1":
            g.view(-1)[1] = float("nan")
        elif case == "inf_on_rank1":
            g.view(-1)[0] = float("inf")
        elif case == "zero_tensor":
            g.zero_()
    return g


def _norm_types_worker(rank: int, world: int) -> list:
    from lightning_matrixfsdp.runtime.tags import is_owned, shard_of

    torch.manual_seed(0)
    model = mf.matrix_shard(TinyLM())
    named = list(model.named_parameters())
    # the first parameter owned by rank 1 (every rank reads the same plan)
    target = next(shard_of(p).fqn for _, p in named if shard_of(p).owner == 1)
    out = []
    owned = [p for _, p in named if is_owned(p)]  # lists that differ between ranks: float64 partial sums
    for p_norm in NORMS:
        for case in CASES:
            for check, given in ((False, model), (True, model), (False, owned)):
                # oracle: torch's own clip over the full gradients, in this one process
                ref = [torch.nn.Parameter(torch.zeros(shard_of(p).shape)) for _, p in named]
                for r, (_, p) in zip(ref, named):
                    r.grad = _grad_for(shard_of(p).fqn, shard_of(p).shape, case, target)
                try:
                    ref_total, ref_err = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=p_norm,
                                                                        error_if_nonfinite=check), None
                except RuntimeError as e:
                    ref_total, ref_err = None, str(e)
                for _, p in named:
                    p.grad = _grad_for(shard_of(p).fqn, shard_of(p).shape, case, target) if is_owned(p) else None
                try:
                    total, err = mf.clip_grad_norm_(given, 0.5, norm_type=p_norm, error_if_nonfinite=check,
                                                    group=None), None
                except RuntimeError as e:
                    total, err = None, str(e)
                exact = given is model
                grads_ok = err is not None or all(
                    torch.equal(p.grad.isnan(), r.grad.isnan()) and torch.equal(p.grad.nan_to_num(), r.grad.nan_to_num())
                    if exact else torch.allclose(p.grad, r.grad, rtol=1e-5, atol=1e-7, equal_nan=True)
                    for (_, p), r in zip(named, ref) if is_owned(p))
                out.append(dict(norm=p_norm, case=case, check=check, total=None if total is None else total.item(),
                                ref=None if ref_total is None else ref_total.item(), err=err, ref_err=ref_err,
                                grads_ok=grads_ok, exact=exact))
    return out


def test_clip_matches_torch_for_every_norm_type_and_non_finite_gradient(dist_pools):
    import math

    for rank, rows in enumerate(dist_pools(2).run(_norm_types_worker, timeout=180)):
        for r in rows:
            what = f"rank {rank}: norm_type={r['norm']} {r['case']} error_if_nonfinite={r['check']}: {r}"
            assert (r["err"] is None) == (r["ref_err"] is None), what
            if r["err"] is not None:
                assert "non-finite" in r["err"], what
                continue
            if math.isnan(r["ref"]):
                assert math.isnan(r["total"]), what
            elif r["exact"]:  # the same list on every rank: torch's own result, bit for bit
                assert r["total"] == r["ref"], what
            else:
                assert math.isclose(r["total"], r["ref"], rel_tol=1e-5, abs_tol=1e-7), what
            assert r["grads_ok"], what
