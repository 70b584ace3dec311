"""Orthogonalization kernels for Muon: approximate the polar factor ``U V^T`` of a matrix.

Everything here is a pure function of its inputs (no optimizer state, no process
group), so the owner of a matrix role can call it locally and benchmarks can
measure it alone.

* :func:`newton_schulz` is bit-for-bit the iteration of ``torch.optim.Muon``
  (bf16, fixed quintic coefficients), so our Muon equals the stock one.
* :func:`newton_schulz_batched` runs the same iteration on a stack of same-shape
  matrices with one ``bmm``/``baddbmm`` launch per product, which removes the
  per-matrix launch overhead when a model has many small matrices.
* :func:`polar_express` (opt-in) uses a different quintic per iteration, derived
  here from the Polar Express recipe, and gets much closer to ``U V^T`` in the
  same number of iterations.
* :func:`gram_polar_express` (opt-in, experimental) runs the same polynomials on
  the small ``m x m`` Gram matrix instead of the ``m x n`` matrix, with restarts.
* :func:`gram_newton_schulz` runs torch.optim.Muon's own quintic in Gram space: the
  default's update (same size, same singular-value profile) with the Gram-space
  FLOP saving for wide matrices (not used by ``Muon`` today: in bf16 training it
  spiked and diverged, see ``optim/muon.py``'s ``FAST_WARNING``).
* :func:`polar_error` measures any of them against the exact polar factor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .fused import divide_
from .transpose import mirror_lower_blocks_, transposed

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "GRAM_NS_RESTART_AT",
    "gram_newton_schulz",
    "gram_newton_schulz_batched",
    "gram_polar_express",
    "newton_schulz",
    "newton_schulz_batched",
    "orthogonalize_batched",
    "orthogonalize_with",
    "polar_error",
    "polar_factor",
    "polar_express",
    "polar_express_batched",
    "polar_express_coefficients",
    "symmetric_addmm",
    "symmetric_blocks",
]

Coefficients = tuple[float, float, float]

#: The fixed quintic of ``torch.optim.Muon`` (from Keller Jordan's Muon post).
DEFAULT_NS_COEFFICIENTS: Coefficients = (3.4445, -4.775, 2.0315)
DEFAULT_NS_STEPS = 5
_MAX_STEPS = 100  # torch.optim.Muon refuses ns_steps >= 100

#: Row blocks for the symmetric products on CUDA (see :func:`symmetric_addmm`): the most
#: that stayed bitwise equal to torch.optim.Muon on an H200 (docs/benchmarks.md).
CUDA_SYMMETRIC_BLOCKS = 3
#: Smallest ``min(m, n)`` for which the symmetric products are used automatically (the
#: size measured to gain; smaller products are closer to launch-bound).
SYMMETRIC_MIN_ROWS = 4096
_BLOCK_ALIGN = 256  # interior block edges are multiples of this (whole GEMM tiles)


# --------------------------------------------------------------------------- checks


def _check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ValueError(f"Number of steps must be an int, got {steps!r}")
    if steps >= _MAX_STEPS:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if steps < 0:
        raise ValueError(f"Number of steps must be >= 0, got {steps}")


def _check_coefficients(ns_coefficients: Sequence[float]) -> Coefficients:
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    return float(a), float(b), float(c)


def _check_matrix(grad: Tensor) -> None:
    if grad.ndim != 2:
        raise ValueError(f"Input tensor gradient must be a 2D matrix, got shape {tuple(grad.shape)}")


# ------------------------------------------------------------------- the iteration


def symmetric_blocks(x: Tensor, blocks: int | None) -> int:
    """Row blocks for the symmetric products of ``x`` (``m x n``, ``m <= n``).

    ``None`` picks automatically: :data:`CUDA_SYMMETRIC_BLOCKS` on CUDA when ``m`` is at
    least :data:`SYMMETRIC_MIN_ROWS` (where the saved GEMM work beats the extra launches),
    else 1, which is torch.optim.Muon's exact op sequence. CPU stays at 1 so that our
    Muon is bitwise the stock one where the tests compare them.
    """
    if blocks is None:
        if x.device.type != "cuda" or x.size(-2) < SYMMETRIC_MIN_ROWS:
            return 1
        blocks = CUDA_SYMMETRIC_BLOCKS
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"symmetric blocks must be a positive int or None, got {blocks!r}")
    return max(1, min(blocks, x.size(-2) // _BLOCK_ALIGN))


def _block_edges(m: int, blocks: int) -> list[int]:
    """``blocks + 1`` row offsets, interior ones rounded to :data:`_BLOCK_ALIGN` (GEMM tiles)."""
    edges = [0]
    for i in range(1, blocks):
        edge = int(round(i * m / blocks / _BLOCK_ALIGN)) * _BLOCK_ALIGN
        edges.append(min(max(edge, edges[-1] + _BLOCK_ALIGN), m))
    edges.append(m)
    return sorted(set(edges))


def symmetric_addmm(
    left: Tensor,
    right: Tensor,
    blocks: int,
    input: Tensor | None = None,
    beta: float = 1.0,
    alpha: float = 1.0,
) -> Tensor:
    """``beta * input + alpha * left @ right`` for a result known to be symmetric.

    Only the upper block triangle is multiplied, one row block per GEMM
    (``out[r0:r1, r0:] = left[r0:r1] @ right[:, r0:]``); the strict lower blocks are
    then copied from their mirror images. With ``b`` equal blocks that is
    ``(b + 1) / (2 b)`` of the GEMM work; the mirror is one coalesced launch
    (:func:`~lightning_matrixfsdp.optim.transpose.mirror_lower_blocks_`). Every computed entry is the same dot
    product over the same ``k`` as in the full GEMM, so with a kernel that does not
    split ``k`` it is the same number; ``blocks=1`` is the plain (add)mm. Used for
    ``X X^T`` and ``A A`` in the Newton-Schulz family, where the symmetry is exact
    in exact arithmetic; the off-diagonal blocks of the result are exact mirrors.
    """
    m = left.size(0)
    if blocks <= 1:
        if input is None:
            return left @ right
        return torch.addmm(input, left, right, beta=beta, alpha=alpha)
    out = torch.empty(m, m, dtype=left.dtype, device=left.device)
    edges = _block_edges(m, blocks)
    for r0, r1 in zip(edges[:-1], edges[1:]):
        if input is None:
            torch.mm(left[r0:r1], right[:, r0:], out=out[r0:r1, r0:])
        else:
            torch.addmm(input[r0:r1, r0:], left[r0:r1], right[:, r0:], beta=beta, alpha=alpha,
                        out=out[r0:r1, r0:])
    return mirror_lower_blocks_(out, edges)


def _iterate(x: Tensor, schedule: Sequence[Coefficients], blocks: int = 1) -> Tensor:
    """Apply ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` once per schedule entry.

    With ``blocks == 1`` the op sequence (``@`` then ``addmm`` twice) is exactly
    torch.optim.Muon's, which is what makes the 2D result bitwise equal to it; with
    more blocks ``A`` and ``b A + c A^2`` come from :func:`symmetric_addmm`. 3D input
    uses the batched ops.
    """
    if x.ndim == 2:
        for a, b, c in schedule:
            gram = symmetric_addmm(x, x.T, blocks)
            gram_update = symmetric_addmm(gram, gram, blocks, input=gram, beta=b, alpha=c)
            x = torch.addmm(x, gram_update, x, beta=a)
        return x
    for a, b, c in schedule:
        gram = torch.bmm(x, x.mT)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x


def orthogonalize_with(grad: Tensor, schedule: Sequence[Coefficients], eps: float, blocks: int | None = 1) -> Tensor:
    """Run ``schedule`` on ``grad``: bf16, wide orientation, Frobenius normalization, iterate."""
    _check_matrix(grad)
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    # Frobenius norm >= spectral norm: afterwards every singular value is <= 1.
    # In place, as torch.optim.Muon does (it then also scales a bf16 input tensor).
    divide_(x, x.norm().clamp(min=eps))
    nblocks = symmetric_blocks(x, blocks)
    row_major = nblocks > 1 and tall and x.is_cuda and x.T.is_contiguous()
    if row_major:
        # Row blocks of a row-major X: measured faster on an H200 and bitwise the same
        # there (copies are exact); on CPU torch's column-major view is kept (bitwise
        # only that way). Both transposes use the coalesced kernel.
        x = transposed(x.T)
    x = _iterate(x, schedule, nblocks)
    if row_major:
        return transposed(x)  # the parameter's layout, so the update add is coalesced
    return x.T if tall else x


def orthogonalize_batched(
    grads: Sequence[Tensor], schedule: Sequence[Coefficients], eps: float, gram_restarts: set[int] | None = None
) -> list[Tensor]:
    """Stack same-shape matrices and iterate on the stack (in Gram space with ``gram_restarts``)."""
    if len(grads) == 0:
        return []
    shape, device = grads[0].shape, grads[0].device
    for g in grads:
        _check_matrix(g)
        if g.shape != shape or g.device != device:
            raise ValueError(
                "batched orthogonalization needs matrices of one shape and device, got "
                f"{tuple(shape)} on {device} and {tuple(g.shape)} on {g.device}"
            )
    x = torch.stack([g.bfloat16() for g in grads])
    tall = shape[0] > shape[1]
    if tall:
        x = x.mT
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x.div_(norms.clamp(min=eps))
    x = _iterate(x, schedule) if gram_restarts is None else _gram_iterate(x, schedule, gram_restarts, 1)
    if tall:
        x = x.mT
    return list(x.unbind(0))


# ------------------------------------------------------------ stock Newton-Schulz


def newton_schulz(
    grad: Tensor,
    ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = 1e-7,
    blocks: int | None = None,
) -> Tensor:
    """torch.optim.Muon's quintic Newton-Schulz; returns a bf16 matrix of ``grad``'s shape.

    With ``blocks=1`` (automatic on CPU and for small matrices) it is bitwise equal to
    ``torch.optim._muon._zeropower_via_newtonschulz`` (same ops in the same order).
    With more blocks (automatic on CUDA, see :func:`symmetric_blocks`) it is the same
    iteration in the same precision with the symmetric products ``X X^T`` and ``A A``
    computed as their upper block triangle (:func:`symmetric_addmm`; with ``b`` blocks
    those two products cost ``(b + 1) / (2 b)`` of the full GEMMs). With 1-3 blocks it was
    bitwise the stock result on an H200 (docs/benchmarks.md); in general it is equal up
    to bf16 rounding.
    """
    _check_steps(ns_steps)
    coefficients = _check_coefficients(ns_coefficients)
    return orthogonalize_with(grad, [coefficients] * ns_steps, eps, blocks)


def newton_schulz_batched(
    grads: Sequence[Tensor],
    ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = 1e-7,
) -> list[Tensor]:
    """:func:`newton_schulz` for many matrices of one shape, one batched GEMM per product.

    Same math as the per-matrix call, without a launch per matrix (the gain for many
    small matrices: docs/benchmarks.md). Measured bitwise equal to the loop on CPU
    (oneDNN, AVX512, torch 2.13) and on an H200 (torch 2.11, CUDA 13); other backends'
    batched kernels may round differently, so only equality to bf16 rounding is promised.
    """
    _check_steps(ns_steps)
    coefficients = _check_coefficients(ns_coefficients)
    return orthogonalize_batched(grads, [coefficients] * ns_steps, eps)


# ------------------------------------------------------------------ Polar Express
#
# Facts used (Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign
# Methods and Their Application to the Muon Algorithm", arXiv:2505.16932, 2025):
#  1. If every singular value of X lies in [l, u], the best composition of T odd
#     polynomials of degree 5 (worst case over that interval) is obtained greedily:
#     at each step take the odd quintic p minimizing max_{x in [l, u]} |1 - p(x)|,
#     then continue on the interval [min p, max p] that p maps [l, u] onto.
#  2. Practical starting interval: u = 1 after Frobenius normalization and a
#     lower bound l = 1e-3.
#  3. For bf16 robustness, every polynomial but the last is evaluated at x / 1.01:
#     a margin for singular values pushed slightly above u by rounding.
# Our own choices, by measurement (tests/test_optim_muon.py, polar_error): the
# design interval of a step never starts below ``cushion * u`` with cushion 0.02
# (it caps the slope of the first polynomial at no measurable accuracy cost), and
# each polynomial is rescaled so the interval it maps onto is centered on 1.
# The coefficients are computed here by our own solver: the minimax odd quintic
# on [l, u] equioscillates at l, at the two roots of p', and at u (alternation
# theorem for the Haar system {x, x^3, x^5} on l > 0), so a Remez exchange with
# closed-form interior extrema converges in a few rounds.


def _odd_quintic(coefficients: Coefficients, x: float) -> float:
    a, b, c = coefficients
    x2 = x * x
    return x * (a + x2 * (b + c * x2))


def _critical_points(coefficients: Coefficients, lo: float, hi: float) -> list[float]:
    """Positive roots of p'(x) = a + 3b x^2 + 5c x^4 inside (lo, hi)."""
    a, b, c = coefficients
    roots: list[float] = []
    if abs(c) < 1e-300:
        candidates = [-a / (3 * b)] if b != 0 else []
    else:
        disc = 9 * b * b - 20 * a * c
        if disc < 0:
            return []
        s = math.sqrt(disc)
        candidates = [(-3 * b - s) / (10 * c), (-3 * b + s) / (10 * c)]
    for y in candidates:
        if y > 0 and lo < math.sqrt(y) < hi:
            roots.append(math.sqrt(y))
    return sorted(roots)


def _range_on(coefficients: Coefficients, lo: float, hi: float) -> tuple[float, float]:
    """(min, max) of the odd quintic on [lo, hi]."""
    values = [_odd_quintic(coefficients, x) for x in [lo, hi, *_critical_points(coefficients, lo, hi)]]
    return min(values), max(values)


def _solve4(rows: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for the 4x4 Remez system."""
    n = len(rhs)
    m = [row[:] + [r] for row, r in zip(rows, rhs)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][k] * out[k] for k in range(r + 1, n))) / m[r][r]
    return out


def _minimax_quintic(lo: float, hi: float, iters: int = 100) -> Coefficients:
    """Odd quintic minimizing max_{x in [lo, hi]} |1 - p(x)| (Remez exchange, float64)."""
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo}, hi={hi}")
    # Start from Chebyshev-like interior nodes; exchange them for p's extrema.
    nodes = [lo, lo + (hi - lo) * 0.25, lo + (hi - lo) * 0.75, hi]
    coefficients: Coefficients = (1.0, 0.0, 0.0)
    for _ in range(iters):
        rows = [[x, x**3, x**5, (-1.0) ** i] for i, x in enumerate(nodes)]
        a, b, c, _err = _solve4(rows, [1.0] * 4)
        coefficients = (a, b, c)
        interior = _critical_points(coefficients, lo, hi)
        if len(interior) != 2:
            break  # degenerate (interval already tiny around 1): keep the last solve
        new_nodes = [lo, interior[0], interior[1], hi]
        if max(abs(p - q) for p, q in zip(new_nodes, nodes)) < 1e-15 * hi:
            break
        nodes = new_nodes
    return coefficients


@functools.lru_cache(maxsize=64)
def polar_express_coefficients(
    steps: int = DEFAULT_NS_STEPS,
    lower: float = 1e-3,
    safety: float = 1.01,
    cushion: float = 0.02,
) -> tuple[Coefficients, ...]:
    """Per-iteration quintic coefficients ``((a, b, c), ...)`` for ``steps`` iterations.

    ``lower`` is the assumed smallest singular value after Frobenius normalization,
    ``safety`` divides the input of every polynomial but the last, ``cushion`` caps
    how far below ``u`` a design interval may start. See the module notes for the
    published facts these follow; the numbers are derived here, in float64.
    """
    _check_steps(steps)
    lo, hi = float(lower), 1.0
    schedule: list[Coefficients] = []
    for t in range(steps):
        design_lo = max(lo, cushion * hi)
        if design_lo >= hi * (1 - 1e-12):
            p: Coefficients = (1.0, 0.0, 0.0)
        else:
            p = _minimax_quintic(design_lo, hi)
        # Re-center so that [lo, hi] maps onto an interval symmetric around 1
        # (the cushioned design leaves p(lo) below the equioscillation level).
        new_lo, new_hi = _range_on(p, lo, hi)
        scale = 2.0 / (new_lo + new_hi)
        a, b, c = (coef * scale for coef in p)
        if t < steps - 1 and safety != 1.0:
            # p(x / s): accept singular values up to s * hi without blow-up.
            a, b, c = a / safety, b / safety**3, c / safety**5
        p = (a, b, c)
        lo, hi = _range_on(p, lo, hi)
        schedule.append(p)
    return tuple(schedule)


def polar_express(
    grad: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    eps: float = 1e-7,
    lower: float = 1e-3,
    blocks: int | None = None,
) -> Tensor:
    """Orthogonalize with the Polar Express schedule; bf16 result of ``grad``'s shape.

    Same kernels and cost per iteration as :func:`newton_schulz`, much smaller
    distance to ``U V^T`` at 5 iterations (measured in the tests). ``lower`` is the
    smallest normalized singular value the schedule is designed to lift to 1: a
    larger one converges in fewer iterations for well-conditioned matrices but
    leaves smaller singular values behind. ``blocks``: as :func:`newton_schulz`.
    """
    return orthogonalize_with(grad, polar_express_coefficients(steps, lower), eps, blocks)


def polar_express_batched(
    grads: Sequence[Tensor], steps: int = DEFAULT_NS_STEPS, eps: float = 1e-7, lower: float = 1e-3
) -> list[Tensor]:
    """:func:`polar_express` on a stack of same-shape matrices (batched GEMMs)."""
    return orthogonalize_batched(grads, polar_express_coefficients(steps, lower), eps)


# --------------------------------------------------------------- Gram-space variant


def _gram_iterate(x: Tensor, schedule: Sequence[Coefficients], restarts: set[int], blocks: int) -> Tensor:
    """``X <- z X`` with ``z = a I + b R + c R^2`` once per schedule entry, carried out on
    ``R = X X^T`` and the accumulated ``Q`` (``X_t = Q X_0``: ``Q <- z Q``, ``R <- z R z``).

    ``x`` is wide and normalized, 2D or a 3D stack (batched GEMMs). R, Z and Q are
    polynomials in the first R, so every product of two of them is symmetric: with
    ``blocks > 1`` (2D) all ``m x m`` products go through :func:`symmetric_addmm`.
    ``z`` is formed explicitly; taking ``a`` as the GEMMs' ``beta`` instead (no rounded
    ``a I``) removed a small bias on well-conditioned matrices but made ``R`` diverge
    under Polar Express's coefficients on real gradients (docs/decisions.md, issue 15).
    """
    if x.ndim == 3:
        r = torch.bmm(x, x.mT)
        q: Tensor | None = None
        for t, (a, b, c) in enumerate(schedule):
            z = torch.baddbmm(r, r, r, beta=b, alpha=c)
            z.diagonal(dim1=-2, dim2=-1).add_(a)
            q = z if q is None else torch.bmm(z, q)
            r = torch.bmm(torch.bmm(z, r), z)
            r = 0.5 * (r + r.mT)
            if t + 1 in restarts and t + 1 < len(schedule):
                x = torch.bmm(q, x)
                r = torch.bmm(x, x.mT)
                q = None
        return x if q is None else torch.bmm(q, x)
    r = symmetric_addmm(x, x.T, blocks)
    q = None  # None stands for the identity (skips Q = Z I)
    for t, (a, b, c) in enumerate(schedule):
        z = symmetric_addmm(r, r, blocks, input=r, beta=b, alpha=c)
        z.diagonal().add_(a)
        q = z if q is None else symmetric_addmm(z, q, blocks)
        if blocks > 1:
            r = symmetric_addmm(symmetric_addmm(z, r, blocks), z, blocks)  # mirrored: stays symmetric
        else:
            r = z @ r @ z
            r = 0.5 * (r + r.T)  # keep R symmetric despite rounding
        if t + 1 in restarts and t + 1 < len(schedule):
            x = q @ x
            r = symmetric_addmm(x, x.T, blocks)
            q = None
    return x if q is None else q @ x


def _gramorthogonalize_with(
    grad: Tensor,
    schedule: Sequence[Coefficients],
    eps: float,
    restart_at: Sequence[int],
    dtype: torch.dtype,
    blocks: int | None,
) -> Tensor:
    """Wide orientation, Frobenius normalization (out of place), Gram-space iteration."""
    _check_matrix(grad)
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    nblocks = symmetric_blocks(x, blocks)
    row_major = nblocks > 1 and tall and x.is_cuda and x.T.is_contiguous()
    if row_major:  # as in _orthogonalize
        x = transposed(x.T)
    x = _gram_iterate(x, schedule, set(restart_at), nblocks)
    if row_major:
        return transposed(x)
    return x.T if tall else x


def gram_polar_express(
    grad: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    eps: float = 1e-7,
    restart_at: Sequence[int] = (2,),
    dtype: torch.dtype = torch.bfloat16,
    lower: float = 1e-3,
    blocks: int | None = None,
) -> Tensor:
    """Polar Express iterated on the ``m x m`` Gram matrix (``m = min`` dimension).

    Every quintic step is ``X <- q(R) X`` with ``R = X X^T``, so ``X_t = Q_t X_0``
    where ``Q`` and ``R`` stay ``m x m``: per iteration four ``m^3`` products
    instead of ``2 m^2 n + m^3``, plus ``2 m^2 n`` at each (re)start. It pays off
    when ``n`` is a few times ``m``. ``R`` squares the condition number, so
    rounding in ``R`` grows through the products; a restart (``X = Q X_0``, ``R``
    recomputed from ``X``, ``Q = I``) after the iterations in ``restart_at`` resets
    it. Measured in bf16: without a restart ill-conditioned inputs blow up (errors
    far above 1); with one restart after iteration 2 the result stays within a few
    hundredths of :func:`polar_express` (tests use :func:`polar_error`). On an H200
    it was faster than :func:`polar_express` for wide matrices and slower for square
    ones (docs/benchmarks.md). ``blocks``: as :func:`newton_schulz` (here every
    ``m x m`` product is symmetric).
    """
    return _gramorthogonalize_with(grad, polar_express_coefficients(steps, lower), eps, restart_at, dtype, blocks)


#: Where the Gram-space iteration with torch.optim.Muon's quintic restarts: after
#: iteration 3 of 5 it stayed within the default's own bf16 rounding of the exact
#: iteration on the inputs measured, after 2 it drifted further on ill-conditioned ones
#: (docs/decisions.md, issue 15).
GRAM_NS_RESTART_AT: tuple[int, ...] = (3,)


def gram_newton_schulz(
    grad: Tensor,
    ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = 1e-7,
    restart_at: Sequence[int] = GRAM_NS_RESTART_AT,
    blocks: int | None = None,
) -> Tensor:
    """torch.optim.Muon's quintic (same polynomial of ``X``), iterated in Gram space.

    In exact arithmetic the result is :func:`newton_schulz`'s: the same composition of
    the same quintic applied to the singular values, so the same update size and
    singular-value profile at the same learning rate; only the rounding differs. The
    cost is that of :func:`gram_polar_express` (fewer FLOPs for aspect ratios of about
    4 and more). ``Muon(orthogonalizer="fast")`` ran it until it proved unstable in bf16.
    """
    _check_steps(ns_steps)
    coefficients = _check_coefficients(ns_coefficients)
    return _gramorthogonalize_with(grad, [coefficients] * ns_steps, eps, restart_at, torch.bfloat16, blocks)


def gram_newton_schulz_batched(
    grads: Sequence[Tensor],
    ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = 1e-7,
    restart_at: Sequence[int] = GRAM_NS_RESTART_AT,
) -> list[Tensor]:
    """:func:`gram_newton_schulz` on a stack of same-shape matrices (batched GEMMs)."""
    _check_steps(ns_steps)
    coefficients = _check_coefficients(ns_coefficients)
    return orthogonalize_batched(grads, [coefficients] * ns_steps, eps, set(restart_at))


# ---------------------------------------------------------------------- accuracy


def polar_factor(grad: Tensor, rtol: float | None = None) -> Tensor:
    """``U V^T`` of ``grad`` in float64 over the singular values above ``rtol * sigma_max``
    (default ``max(m, n) * eps`` of ``grad``'s dtype, as ``torch.linalg.matrix_rank``)."""
    _check_matrix(grad)
    if rtol is None:
        dtype = grad.dtype if grad.is_floating_point() else torch.float64
        rtol = max(grad.shape) * torch.finfo(dtype).eps
    u, s, vh = torch.linalg.svd(grad.detach().to(torch.float64), full_matrices=False)
    keep = s > rtol * s.max() if s.numel() and s.max() > 0 else torch.zeros_like(s, dtype=torch.bool)
    return u[:, keep] @ vh[keep, :]


def polar_error(update: Tensor, grad: Tensor, rtol: float | None = None, polar: Tensor | None = None) -> float:
    """Relative Frobenius distance ``||update - U V^T|| / ||U V^T||``, computed in float64.

    ``U V^T`` is :func:`polar_factor` of ``grad`` (pass it as ``polar`` to reuse one
    SVD for several updates): for a rank-deficient ``grad`` the target is the partial
    isometry on its range, which is what the polynomial iterations converge to (they
    map zero singular values to zero). ``||U V^T||_F = sqrt(rank)``. Used by tests and
    benchmarks to compare methods.
    """
    _check_matrix(grad)
    if update.shape != grad.shape:
        raise ValueError(f"update shape {tuple(update.shape)} != grad shape {tuple(grad.shape)}")
    if polar is None:
        polar = polar_factor(grad, rtol)
    diff = update.detach().to(torch.float64) - polar
    reference = torch.linalg.matrix_norm(polar)
    if reference == 0:  # zero matrix: measure the update itself
        return float(torch.linalg.matrix_norm(diff))
    return float(torch.linalg.matrix_norm(diff) / reference)
