"""Orthogonalization methods for Muon: approximate the polar factor ``U V^T`` of a matrix.

Everything here is a pure function of its inputs (no optimizer state, no process
group), so the owner of a matrix role can call it locally and benchmarks can
measure it alone. This module is the methods by name; the pieces they are made of
live one concern per file and are re-exported here:

* :mod:`.coefficients`: the coefficient schedules (torch.optim.Muon's quintic, the
  Polar Express schedule derived there) and the argument checks;
* :mod:`.symmetric`: the symmetric block products (:func:`symmetric_addmm`);
* :mod:`.iteration`: the kernels that run a schedule (:func:`orthogonalize_with`,
  :func:`orthogonalize_batched`, the Gram-space iteration);
* :mod:`.accuracy`: :func:`polar_factor` and :func:`polar_error`.

The methods:

* :func:`newton_schulz` is bit-for-bit the iteration of ``torch.optim.Muon``
  (bf16, fixed quintic coefficients), so our Muon equals the stock one.
* :func:`newton_schulz_batched` runs the same iteration on a stack of same-shape
  matrices with one ``bmm``/``baddbmm`` launch per product, which removes the
  per-matrix launch overhead when a model has many small matrices.
* :func:`polar_express` (opt-in) uses a different quintic per iteration, derived
  from the Polar Express recipe (:func:`polar_express_coefficients`), and gets much
  closer to ``U V^T`` in the same number of iterations.
* :func:`gram_polar_express` (opt-in, experimental) runs the same polynomials on
  the small ``m x m`` Gram matrix instead of the ``m x n`` matrix, with restarts.
* :func:`gram_newton_schulz` runs torch.optim.Muon's own quintic in Gram space: the
  default's update (same size, same singular-value profile) with the Gram-space
  FLOP saving for wide matrices (not used by ``Muon`` today: in bf16 training it
  spiked and diverged, see ``optim/muon.py``'s ``FAST_WARNING``).
* :func:`polar_error` measures any of them against the exact polar factor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .accuracy import polar_error, polar_factor
from .coefficients import Coefficients  # noqa: F401  (its import path before coefficients.py)
from .coefficients import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    check_coefficients,
    check_steps,
    polar_express_coefficients,
)
from .iteration import gram_orthogonalize_with, orthogonalize_batched, orthogonalize_with
from .symmetric import CUDA_SYMMETRIC_BLOCKS, SYMMETRIC_MIN_ROWS  # noqa: F401  (their import path before symmetric.py)
from .symmetric import symmetric_addmm, symmetric_blocks

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
    check_steps(ns_steps)
    coefficients = check_coefficients(ns_coefficients)
    return orthogonalize_with(grad, [coefficients] * ns_steps, eps, blocks)


def newton_schulz_batched(
    grads: Sequence[Tensor],
    ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = 1e-7,
    blocks: int | None = 1,
) -> list[Tensor]:
    """:func:`newton_schulz` for many matrices of one shape, one batched GEMM per product.

    Same math as the per-matrix call, without a launch per matrix (the gain for many
    small matrices: docs/benchmarks.md). Measured bitwise equal to the loop on CPU
    (oneDNN, AVX512, torch 2.13) and on an H200 (torch 2.11, CUDA 13); other backends'
    batched kernels may round differently, so only equality to bf16 rounding is promised.
    ``blocks``: symmetric row blocks of the batched products (1: torch's plain batched ops;
    ``None``: automatic, :func:`symmetric_blocks`).
    """
    check_steps(ns_steps)
    coefficients = check_coefficients(ns_coefficients)
    return orthogonalize_batched(grads, [coefficients] * ns_steps, eps, blocks=blocks)


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


# --------------------------------------------------------------- Gram-space variants


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
    return gram_orthogonalize_with(grad, polar_express_coefficients(steps, lower), eps, restart_at, dtype, blocks)


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
    check_steps(ns_steps)
    coefficients = check_coefficients(ns_coefficients)
    return gram_orthogonalize_with(grad, [coefficients] * ns_steps, eps, restart_at, torch.bfloat16, blocks)


def gram_newton_schulz_batched(
    grads: Sequence[Tensor],
    ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = 1e-7,
    restart_at: Sequence[int] = GRAM_NS_RESTART_AT,
) -> list[Tensor]:
    """:func:`gram_newton_schulz` on a stack of same-shape matrices (batched GEMMs)."""
    check_steps(ns_steps)
    coefficients = check_coefficients(ns_coefficients)
    return orthogonalize_batched(grads, [coefficients] * ns_steps, eps, set(restart_at))
