"""Our Muon(+AdamW tail) against plain torch.optim.Muon + torch.optim.AdamW, and the
orthogonalizers against torch's Newton-Schulz and the exact SVD polar factor."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from lightning_matrixfsdp.optim import coefficients
from lightning_matrixfsdp.optim.muon import ORTHOGONALIZERS, Muon, uses_muon
from lightning_matrixfsdp.optim.orthogonalize import (
    gram_polar_express,
    newton_schulz,
    newton_schulz_batched,
    polar_error,
    polar_express,
    polar_express_batched,
    polar_express_coefficients,
)

try:  # torch's own kernel, as a direct oracle; the optimizer tests use only public API
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_newton_schulz
except ImportError:  # pragma: no cover - moved in some future torch
    torch_newton_schulz = None

TORCH_NS = ((3.4445, -4.775, 2.0315), 5, 1e-7)


# ----------------------------------------------------------------------- helpers


class Net(nn.Module):
    """Embedding + Linear layers (wide, tall, square) + LayerNorm, float32."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.up = nn.Linear(8, 24)  # weight 24x8: tall
        self.norm = nn.LayerNorm(24)
        self.down = nn.Linear(24, 8, bias=False)  # 8x24: wide
        self.sq1 = nn.Linear(8, 8)
        self.sq2 = nn.Linear(8, 8)  # same shape as sq1: a batched bucket


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def set_random_grads(models: list[nn.Module], step: int) -> None:
    """Give every model identical random gradients (the same for each model)."""
    gen = torch.Generator().manual_seed(1000 + step)
    params = [list(m.parameters()) for m in models]
    for group in zip(*params):
        g = torch.randn(group[0].shape, generator=gen)
        for p in group:
            p.grad = g.clone()


def oracle_optimizers(model: nn.Module, matrix_filter=None, **kw):
    """torch.optim.Muon on the matrices, torch.optim.AdamW (single tensor) on the rest."""
    matrix_filter = matrix_filter or (lambda p: p.ndim == 2)
    mats = [p for p in model.parameters() if matrix_filter(p)]
    rest = [p for p in model.parameters() if not matrix_filter(p)]
    muon_kw = {k: kw[k] for k in ("lr", "weight_decay", "momentum", "nesterov", "adjust_lr_fn") if k in kw}
    adamw_wd = kw.get("adamw_weight_decay")
    adamw = torch.optim.AdamW(
        rest,
        lr=kw.get("adamw_lr") or kw.get("lr", 1e-3),
        betas=kw.get("adamw_betas", (0.9, 0.999)),
        eps=kw.get("adamw_eps", 1e-8),
        weight_decay=adamw_wd if adamw_wd is not None else kw.get("weight_decay", 0.1),
        foreach=False,
    )
    return [torch.optim.Muon(mats, **muon_kw), adamw]


def assert_models_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs: max {(p - q).abs().max().item():.3e}"


def run_steps(model, optimizers, steps: int, start: int = 0, schedulers=()) -> None:
    for t in range(start, start + steps):
        set_random_grads([model], t)
        for opt in optimizers:
            opt.step()
        for s in schedulers:
            s.step()


# --------------------------------------------------------- Newton-Schulz kernels


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (20, 20), (1, 7), (7, 1)])
@pytest.mark.parametrize("steps", [0, 1, 5])
@pytest.mark.skipif(torch_newton_schulz is None, reason="torch's Newton-Schulz helper moved")
def test_newton_schulz_bitwise_equals_torch(shape, steps):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(hash(shape) % 1000))
    coefficients = (3.0, -3.2, 1.2)
    expected = torch_newton_schulz(g, coefficients, steps, 1e-6)
    assert torch.equal(newton_schulz(g, coefficients, steps, 1e-6), expected)
    assert torch.equal(newton_schulz(g), torch_newton_schulz(g, *TORCH_NS))


def test_batched_matches_per_matrix():
    gen = torch.Generator().manual_seed(3)
    for shape in [(12, 40), (40, 12), (16, 16)]:
        grads = [torch.randn(shape, generator=gen) * (i + 1) for i in range(5)]
        batched = newton_schulz_batched(grads)
        loop = [newton_schulz(g) for g in grads]
        for b, l in zip(batched, loop):
            assert b.shape == l.shape and b.dtype == l.dtype
            # Same math; the batched GEMM/norm kernels may round differently from
            # the 2D ones on some backends (they are bitwise equal on our CPU), so
            # allow a few bf16 ulps. A wrong per-matrix norm or orientation is O(1).
            torch.testing.assert_close(b.float(), l.float(), rtol=2**-6, atol=2**-8)
        for b, l in zip(polar_express_batched(grads), [polar_express(g) for g in grads]):
            torch.testing.assert_close(b.float(), l.float(), rtol=2**-6, atol=2**-8)
    assert newton_schulz_batched([]) == []
    with pytest.raises(ValueError, match="one shape"):
        newton_schulz_batched([torch.randn(3, 4), torch.randn(4, 3)])


def test_kernel_input_errors():
    with pytest.raises(ValueError, match="2D"):
        newton_schulz(torch.randn(3))
    with pytest.raises(ValueError, match="less than 100"):
        newton_schulz(torch.randn(3, 3), ns_steps=100)
    with pytest.raises(ValueError, match="exactly 3"):
        newton_schulz(torch.randn(3, 3), ns_coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match="shape"):
        polar_error(torch.randn(3, 4), torch.randn(4, 3))


# ------------------------------------------------------------------- accuracy


def _with_condition(m: int, n: int, cond: float, gen: torch.Generator) -> torch.Tensor:
    """Random m x n matrix with log-spaced singular values from 1 down to 1/cond."""
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, dtype=torch.float64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=gen))
    s = torch.logspace(0, -math.log10(cond), k, dtype=torch.float64)
    return ((u * s) @ v.T).float()


def test_polar_error_oracle():
    torch.manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(30, 10, dtype=torch.float64))
    g = q @ torch.diag(torch.linspace(1, 5, 10, dtype=torch.float64))  # polar factor is q
    assert polar_error(q, g) < 1e-12
    assert abs(polar_error(2 * q, g) - 1.0) < 1e-12
    assert abs(polar_error(torch.zeros(30, 10), g) - 1.0) < 1e-12
    # rank-deficient: the target is the partial isometry A B^T on the range of g
    a, _ = torch.linalg.qr(torch.randn(30, 3, dtype=torch.float64))
    b, _ = torch.linalg.qr(torch.randn(10, 3, dtype=torch.float64))
    low_rank = a @ torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)) @ b.T
    assert polar_error(a @ b.T, low_rank) < 1e-12
    assert polar_error(torch.zeros(30, 10), torch.zeros(30, 10)) == 0.0


# Documented accuracy (relative Frobenius distance to U V^T, 5 iterations, bf16),
# measured on this suite's matrices with margin. Stock Newton-Schulz does not aim
# for U V^T (its fixed quintic leaves singular values in roughly [0.7, 1.2]).
# Polar Express is designed to lift singular values >= 1e-3 (after Frobenius
# normalization) to 1; ill-conditioned inputs put singular values below that.
ACCURACY = {
    # (kind) -> (newton_schulz, polar_express) bounds
    "gaussian": (0.26, 0.12),  # rectangular Gaussian: measured ~0.22 / ~0.09
    "cond1e2": (0.24, 0.13),  # measured ~0.20 / ~0.10
    "cond1e3": (0.42, 0.28),  # measured ~0.36 / ~0.23
}


@pytest.mark.parametrize("shape", [(64, 192), (192, 64), (40, 320)])
@pytest.mark.parametrize("kind", list(ACCURACY))
def test_orthogonalizer_accuracy(shape, kind):
    gen = torch.Generator().manual_seed(7)
    if kind == "gaussian":
        g = torch.randn(shape, generator=gen)
    else:
        g = _with_condition(*shape, float(kind[4:]), gen)
    ns_bound, pe_bound = ACCURACY[kind]
    err_ns = polar_error(newton_schulz(g), g)
    err_pe = polar_error(polar_express(g), g)
    err_gram = polar_error(gram_polar_express(g), g)
    assert err_ns < ns_bound
    assert err_pe < pe_bound
    assert err_pe < err_ns  # strictly more accurate at the same cost
    # Gram-space iteration with its restart: within a few hundredths of Polar Express.
    assert err_gram < err_pe + 0.04
    # ... and the restart is what keeps it there: without it, bf16 drifts.
    if kind == "cond1e3":
        no_restart = gram_polar_express(g, restart_at=())
        assert not torch.isfinite(no_restart).all() or polar_error(no_restart, g) > 1.0


@pytest.mark.parametrize(
    "make",
    [
        lambda gen: torch.zeros(16, 32),
        lambda gen: torch.randn(16, 2, generator=gen) @ torch.randn(2, 32, generator=gen),  # rank 2
        lambda gen: torch.randn(16, 32, generator=gen) * 1e-20,
        lambda gen: torch.randn(16, 32, generator=gen) * 1e20,
        lambda gen: torch.randn(1, 32, generator=gen),
        lambda gen: torch.randn(48, 48, generator=gen),
        lambda gen: _with_condition(32, 96, 1e6, gen),
    ],
)
def test_no_nan(make):
    g = make(torch.Generator().manual_seed(11))
    outs = [
        newton_schulz(g),
        polar_express(g),
        gram_polar_express(g),
        *newton_schulz_batched([g, g]),
        *polar_express_batched([g]),
    ]
    for out in outs:
        assert out.shape == g.shape
        assert torch.isfinite(out).all()
        assert out.float().abs().max() < 10  # bounded: no blow-up either


def test_polar_express_schedule():
    """Independent checks of the derived coefficients, in float64 on a dense grid."""
    x = torch.logspace(-3, 0, 4001, dtype=torch.float64)

    def compose(schedule):
        y = x.clone()
        for a, b, c in schedule:
            y = a * y + b * y**3 + c * y**5
        return y

    # Worst-case over [1e-3, 1]: 5 steps reach ~0.13, 6 steps essentially converge;
    # stock Newton-Schulz (5 steps) is far from it on the same interval.
    assert (compose(polar_express_coefficients(5)) - 1).abs().max() < 0.16
    assert (compose(polar_express_coefficients(6)) - 1).abs().max() < 0.02
    assert (compose([TORCH_NS[0]] * 5) - 1).abs().max() > 0.3
    # Each minimax quintic equioscillates (alternation theorem) and nothing on the
    # interval exceeds the alternation level: that is what "minimax" means.
    for lo, hi in [(1e-3, 1.0), (0.1, 1.0), (0.5, 1.5)]:
        a, b, c = coefficients._minimax_quintic(lo, hi)
        grid = torch.linspace(lo, hi, 20001, dtype=torch.float64)
        err = 1 - (a * grid + b * grid**3 + c * grid**5)
        nodes = [lo, *coefficients._critical_points((a, b, c), lo, hi), hi]
        level = [1 - coefficients._odd_quintic((a, b, c), t) for t in nodes]
        assert len(nodes) == 4
        assert all(abs(abs(e) - abs(level[0])) < 1e-9 for e in level)
        assert all(level[i] * level[i + 1] < 0 for i in range(3))
        assert err.abs().max() <= abs(level[0]) + 1e-9


# -------------------------------------------------------- optimizer vs. torch


@pytest.mark.parametrize("weight_decay", [0.05, 0.0])  # 0: we skip torch's multiply by 1
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_and_adamw(adjust_lr_fn, nesterov, weight_decay):
    kw = dict(lr=0.02, weight_decay=weight_decay, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ours, ref = make_model(), make_model()
    opt = Muon(ours.parameters(), **kw)
    run_steps(ours, [opt], 4)
    run_steps(ref, oracle_optimizers(ref, **kw), 4)
    assert_models_equal(ours, ref)
    # torch's state layout, so tooling that inspects it keeps working
    for p in ours.parameters():
        state = opt.state[p]
        if p.ndim == 2:
            assert set(state) == {"momentum_buffer"}
        else:
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
            assert state["step"].dtype == torch.float32 and state["step"].item() == 4


def test_adamw_hyperparameters_and_groups():
    """Separate AdamW hyper-parameters, and per-group overrides."""
    kw = dict(
        lr=0.01, weight_decay=0.1, adamw_lr=3e-3, adamw_betas=(0.8, 0.95), adamw_eps=1e-6, adamw_weight_decay=0.0
    )
    ours, ref = make_model(), make_model()
    opt = Muon(ours.parameters(), **kw)
    run_steps(ours, [opt], 3)
    run_steps(ref, oracle_optimizers(ref, **kw), 3)
    assert_models_equal(ours, ref)

    ours, ref = make_model(), make_model()
    special = [ours.sq1.weight, ours.sq1.bias]
    rest = [p for p in ours.parameters() if all(p is not s for s in special)]
    opt = Muon([{"params": special, "lr": 0.05, "adamw_lr": 1e-2}, {"params": rest}], lr=0.01)
    ref_special = [ref.sq1.weight, ref.sq1.bias]
    ref_rest = [p for p in ref.parameters() if all(p is not s for s in ref_special)]
    ref_opts = [
        torch.optim.Muon([ref.sq1.weight], lr=0.05),
        torch.optim.AdamW([ref.sq1.bias], lr=1e-2, weight_decay=0.1, foreach=False),
        torch.optim.Muon([p for p in ref_rest if p.ndim == 2], lr=0.01),
        torch.optim.AdamW([p for p in ref_rest if p.ndim != 2], lr=0.01, weight_decay=0.1, foreach=False),
    ]
    run_steps(ours, [opt], 3)
    run_steps(ref, ref_opts, 3)
    assert_models_equal(ours, ref)


def test_role_tag_overrides_shape():
    ours, ref = make_model(), make_model()
    ours.emb.weight._mfsdp_role = "tail"  # 2D, but tagged: AdamW
    ours.down.weight._mfsdp_role = "matrix"
    assert not uses_muon(ours.emb.weight) and uses_muon(ours.down.weight) and not uses_muon(ours.up.bias)
    opt = Muon(ours.parameters(), lr=0.02)
    run_steps(ours, [opt], 3)
    ref_filter = lambda p: p.ndim == 2 and p is not ref.emb.weight  # noqa: E731
    run_steps(ref, oracle_optimizers(ref, matrix_filter=ref_filter, lr=0.02), 3)
    assert_models_equal(ours, ref)
    assert set(opt.state[ours.emb.weight]) == {"step", "exp_avg", "exp_avg_sq"}

    bad = nn.Parameter(torch.randn(5))
    bad._mfsdp_role = "matrix"
    bad.grad = torch.randn(5)
    with pytest.raises(ValueError, match="2D"):
        Muon([bad]).step()


def test_empty_placeholders_and_missing_grads_are_skipped():
    ours, ref = make_model(), make_model()
    placeholders = [nn.Parameter(torch.empty(0, 8)), nn.Parameter(torch.empty(0))]
    placeholders[0]._mfsdp_role = "matrix"
    placeholders[1]._mfsdp_role = "tail"
    opt = Muon([*ours.parameters(), *placeholders], lr=0.02)
    ref_opts = oracle_optimizers(ref, lr=0.02)
    for t in range(3):
        set_random_grads([ours, ref], t)
        for p in placeholders:
            p.grad = torch.empty_like(p)
        ours.sq2.weight.grad = None  # an unused parameter: untouched, like torch
        ref.sq2.weight.grad = None
        opt.step()
        for o in ref_opts:
            o.step()
    assert_models_equal(ours, ref)
    assert all(len(opt.state[p]) == 0 for p in placeholders)
    assert len(opt.state[ours.sq2.weight]) == 0


@pytest.mark.parametrize("adamw_lr", [None, 4e-3])
def test_lr_scheduler_drives_both(adamw_lr):
    factor = lambda step: 1.0 / (1 + 0.3 * step)  # noqa: E731
    ours, ref = make_model(), make_model()
    opt = Muon(ours.parameters(), lr=0.02, adamw_lr=adamw_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    ref_opts = oracle_optimizers(ref, lr=0.02, adamw_lr=adamw_lr)
    ref_scheds = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in ref_opts]
    run_steps(ours, [opt], 5, schedulers=[sched])
    run_steps(ref, ref_opts, 5, schedulers=ref_scheds)
    if adamw_lr is None:
        assert_models_equal(ours, ref)  # the AdamW lr *is* group["lr"]
    else:
        # We compute adamw_lr * (lr * f / lr) where the oracle computes adamw_lr * f:
        # the ratio may be off by one float64 rounding (~1e-16 relative), far below
        # float32 resolution, so parameters agree to float32 rounding of the updates.
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # and the scheduled lr really reached the AdamW params: a frozen lr would differ
    frozen = make_model()
    opt_frozen = Muon(frozen.parameters(), lr=0.02, adamw_lr=adamw_lr)
    run_steps(frozen, [opt_frozen], 5)
    assert not torch.allclose(frozen.norm.weight, ours.norm.weight)


def test_lr_at_init_carried_by_a_group_is_kept():
    """A rebuilt group (e.g. by the owner-routing wrapper after the scheduler ran)
    keeps its recorded initial lr, so the AdamW lr keeps following the schedule."""
    ours, ref = make_model(), make_model()
    opt = Muon([{"params": list(ours.parameters()), "lr": 0.01, "lr_at_init": 0.04}], adamw_lr=8e-3)
    run_steps(ours, [opt], 2)
    run_steps(ref, oracle_optimizers(ref, lr=0.01, adamw_lr=2e-3), 2)  # 8e-3 * 0.01 / 0.04
    assert_models_equal(ours, ref)


def test_state_dict_round_trip_continues_identically():
    kw = dict(lr=0.02, adamw_lr=5e-3, orthogonalizer="batched", adjust_lr_fn="match_rms_adamw")
    factor = lambda step: 0.5**step  # noqa: E731
    straight = make_model()
    opt = Muon(straight.parameters(), **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    run_steps(straight, [opt], 6, schedulers=[sched])

    first = make_model()
    opt1 = Muon(first.parameters(), **kw)
    sched1 = torch.optim.lr_scheduler.LambdaLR(opt1, factor)
    run_steps(first, [opt1], 3, schedulers=[sched1])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict(), "sched": sched1.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = make_model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2 = Muon(resumed.parameters(), lr=0.7)  # different hyper-parameters, overwritten by load
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, factor)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    for key in ("lr_at_init", "adamw_lr", "orthogonalizer", "adjust_lr_fn", "adamw_betas"):
        assert opt2.param_groups[0][key] == opt1.param_groups[0][key]
    run_steps(resumed, [opt2], 3, start=3, schedulers=[sched2])
    assert_models_equal(resumed, straight)


def test_batched_optimizer_matches_loop():
    a, b = make_model(), make_model()
    opt_a = Muon(a.parameters(), lr=0.02, orthogonalizer="batched")
    opt_b = Muon(b.parameters(), lr=0.02)
    run_steps(a, [opt_a], 3)
    run_steps(b, [opt_b], 3)
    # See test_batched_matches_per_matrix: equal to bf16 kernel rounding (bitwise on
    # our CPU); an update is lr * O(1) per entry, so 1e-4 absolute is a few ulps of it.
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["polar_express", "gram_polar_express"])
def test_opt_in_orthogonalizers_step(name):
    model = make_model()
    before = copy.deepcopy(model)
    opt = Muon(model.parameters(), lr=0.02, orthogonalizer=name)
    run_steps(model, [opt], 3)
    for p, q in zip(model.parameters(), before.parameters()):
        assert torch.isfinite(p).all() and not torch.equal(p, q)


def test_closure_and_no_collectives(monkeypatch):
    import torch.distributed as dist

    def forbidden(*args, **kwargs):
        raise AssertionError("step() must not communicate")

    collectives = (
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "barrier", "broadcast",
        "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "send", "isend", "irecv",
    )  # fmt: skip
    for name in collectives:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, forbidden)

    ours, ref = make_model(), make_model()
    opt = Muon(ours.parameters(), lr=0.02, orthogonalizer="batched")
    ref_opt = Muon(ref.parameters(), lr=0.02, orthogonalizer="batched")
    x = torch.randint(0, 11, (4, 3))

    def loss_of(model):
        h = model.emb(x)
        h = model.norm(model.up(h)).relu()
        return model.sq2(model.sq1(model.down(h))).pow(2).mean()

    def closure():
        opt.zero_grad()
        loss = loss_of(ours)
        loss.backward()
        return loss

    loss = opt.step(closure)
    ref_loss = loss_of(ref)
    ref_loss.backward()
    ref_opt.step()
    assert torch.equal(loss, ref_loss)
    assert_models_equal(ours, ref)


def test_input_validation():
    params = make_model().parameters
    cases = [
        (dict(lr=-1.0), "Learning rate"),
        (dict(momentum=-0.1), "momentum"),
        (dict(weight_decay=-0.1), "weight decay"),
        (dict(adjust_lr_fn="bogus"), "bogus"),
        (dict(ns_coefficients=(1.0, 2.0)), "exactly 3"),
        (dict(ns_steps=100), "ns_steps"),
        (dict(adamw_betas=(0.9, 1.0)), "beta"),
        (dict(adamw_lr=-1e-3), "adamw_lr"),
        (dict(adamw_eps=-1.0), "adamw_eps"),
        (dict(adamw_weight_decay=-1.0), "adamw_weight_decay"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            Muon(params(), **kwargs)
    with pytest.raises(ValueError) as info:
        Muon(params(), orthogonalizer="svd")
    assert all(name in str(info.value) for name in ORTHOGONALIZERS)
    # a bad group added later is rejected too
    opt = Muon(params())
    with pytest.raises(ValueError, match="Learning rate"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(2, 2))], "lr": -1.0})
    assert len(opt.param_groups) == 1  # the rejected group was not kept
    with pytest.raises(ValueError, match="complex"):
        Muon([nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))])
    emb = nn.Embedding(5, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        Muon(emb.parameters()).step()


def test_warns_when_adamw_eps_vanishes_in_float16():
    from lightning_matrixfsdp.optim import tail as muon_mod

    muon_mod._EPS_WARNED.clear()
    norm = nn.Parameter(torch.ones(8, dtype=torch.float16))
    norm.grad = torch.full_like(norm, 1e-3)
    with pytest.warns(RuntimeWarning, match="rounds to 0 in torch.float16"):
        Muon([norm], lr=0.02).step()
    # the reason it matters: the second moment underflows and 0 / 0 follows, as in torch's AdamW
    assert not torch.isfinite(norm).all()
    ok = nn.Parameter(torch.ones(8, dtype=torch.float16))
    ok.grad = torch.full_like(ok, 1e-3)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([ok], lr=0.02, adamw_eps=1e-4).step()  # representable: no warning
        Muon([nn.Parameter(torch.ones(3))], lr=0.02).step()  # float32: no warning (no grad is fine too)
    assert torch.isfinite(ok).all()


# ------------------------------------------------------------- batch_shapes stacks


def _params(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        p = nn.Parameter(torch.randn(s, generator=gen).to(dtype))
        p.grad = torch.randn(s, generator=gen).to(dtype)
        out.append(p)
    return out


def test_batch_shapes_stacks_same_shapes_within_the_element_cap(monkeypatch):
    from lightning_matrixfsdp.optim import muon as muon_mod

    monkeypatch.setattr(muon_mod, "BATCH_MAX_ELEMENTS", 2 * 64 * 32)
    ps = _params([(64, 32)] * 3 + [(32, 64)] * 2 + [(48, 48)])
    opt = Muon(ps, batch_shapes=True)
    buckets = Muon._buckets(opt.param_groups[0], ps)
    index = {id(p): i for i, p in enumerate(ps)}
    as_ids = sorted(sorted(index[id(p)] for p in b) for b in buckets)
    assert as_ids == [[0, 1], [2], [3, 4], [5]]  # (64, 32) split by the cap; shapes never mixed
    assert [len(b) for b in Muon._buckets(Muon(ps).param_groups[0], ps)] == [1] * 6  # CPU default: off
    # torch normalizes a bf16 momentum buffer in place when it is the update (no Nesterov):
    # those stay single so that quirk is reproduced
    bf = _params([(64, 32)] * 3, torch.bfloat16)
    group = Muon(bf, batch_shapes=True, nesterov=False).param_groups[0]
    assert [len(b) for b in Muon._buckets(group, bf)] == [1, 1, 1]
    with pytest.raises(ValueError, match="batch_shapes"):
        Muon(ps, batch_shapes="yes")


@pytest.mark.parametrize("nesterov, dtype", [(True, torch.float32), (False, torch.bfloat16), (True, torch.bfloat16)])
def test_batch_shapes_step_matches_torch_muon(nesterov, dtype):
    shapes = [(64, 32)] * 3 + [(32, 64)] * 2 + [(48, 48)]
    ours, ref = _params(shapes, dtype), _params(shapes, dtype)
    opt = Muon(ours, lr=0.02, nesterov=nesterov, batch_shapes=True)
    ref_opt = torch.optim.Muon(ref, lr=0.02, nesterov=nesterov)
    for step in range(3):
        opt.step()
        ref_opt.step()
        gen = torch.Generator().manual_seed(100 + step)
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            q.grad = p.grad.clone()
    for p, q in zip(ours, ref):
        if not nesterov:  # singletons: torch's exact ops, quirk included
            assert torch.equal(p, q)
        else:  # batched GEMMs: bitwise on the CPU and GPU measured, promised to bf16 rounding
            torch.testing.assert_close(p, q, rtol=0, atol=1e-4 if dtype == torch.float32 else 1e-2)
