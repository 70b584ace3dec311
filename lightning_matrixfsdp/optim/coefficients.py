"""Coefficient schedules of the quintic iterations: torch.optim.Muon's fixed quintic and
the Polar Express schedule derived here, plus the argument checks shared by every method.

A schedule is a sequence of ``(a, b, c)``, one per iteration of
``X <- a X + (b A + c A^2) X`` (``A = X X^T``); the kernels that run one are in
:mod:`.iteration`. Everything here is plain Python in float64 (no tensors).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

__all__ = [
    "Coefficients",
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "check_coefficients",
    "check_steps",
    "polar_express_coefficients",
]

Coefficients = tuple[float, float, float]

#: The fixed quintic of ``torch.optim.Muon`` (from Keller Jordan's Muon post).
DEFAULT_NS_COEFFICIENTS: Coefficients = (3.4445, -4.775, 2.0315)
DEFAULT_NS_STEPS = 5
_MAX_STEPS = 100  # torch.optim.Muon refuses ns_steps >= 100


def check_steps(steps: int) -> None:
    """An iteration count as torch.optim.Muon accepts it (same messages)."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ValueError(f"Number of steps must be an int, got {steps!r}")
    if steps >= _MAX_STEPS:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if steps < 0:
        raise ValueError(f"Number of steps must be >= 0, got {steps}")


def check_coefficients(ns_coefficients: Sequence[float]) -> Coefficients:
    """One quintic ``(a, b, c)`` as floats, checked as torch.optim.Muon does."""
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    return float(a), float(b), float(c)


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
    check_steps(steps)
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
