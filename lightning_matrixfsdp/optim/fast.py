"""``Muon(orthogonalizer="fast")``: four quintic iterations fitted to the default's five.

torch.optim.Muon applies one fixed odd quintic five times. As a function of a singular
value ``s`` of the Frobenius-normalized momentum, that composition is linear (slope
about 485) below ``s ~ 1e-3`` (the momentum's noise floor, where a quarter to over half
of the singular values of real momenta sit) and oscillates between 0.68 and 1.20 above ``s ~ 3e-3``. The
training behaviour follows that response: an iteration that lifts the noise floor
further (Polar Express) trained worse at the same learning rate (docs/decisions.md,
issue 15).

:data:`FAST_SCHEDULE` is four quintics, so four iterations of exactly the default's
kernels (same GEMMs, bf16, same stacking and symmetric products): 4/5 of the default's
Newton-Schulz FLOPs. Its coefficients were fitted (``scripts/fit_fast_schedule.py``, in
float64) so that the locally averaged size of the response, and its average, follow the
default's on ``1e-5 <= s <= 1`` while the oscillation stays in a band close to the
default's and every intermediate iteration stays below 1.5 (bf16 headroom). Four
quintics (a polynomial of degree 625 instead of 3125) cannot reach the default's slope
with so narrow a band, so the fit trades some slope (0.70x on the noise floor) for a
slightly higher band; on real momenta the update's RMS is within a few percent of the
default's (docs/decisions.md). The curves and the training comparison are in
docs/benchmarks.md "Convergence".
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .coefficients import Coefficients
from .iteration import orthogonalize_batched, orthogonalize_with

__all__ = ["FAST_SCHEDULE", "fast_newton_schulz", "fast_newton_schulz_batched"]

#: The four quintics ``(a, b, c)`` of ``X <- a X + (b A + c A^2) X``, ``A = X X^T``, in
#: order (output of ``scripts/fit_fast_schedule.py``, rounded to 6 decimals).
FAST_SCHEDULE: tuple[Coefficients, ...] = (
    (5.2853, -15.036403, 10.718676),
    (4.554844, -8.291235, 3.809704),
    (3.816227, -5.716773, 2.230646),
    (3.716775, -5.366089, 2.291115),
)


def fast_newton_schulz(grad: Tensor, eps: float = 1e-7, blocks: int | None = None) -> Tensor:
    """Orthogonalize with :data:`FAST_SCHEDULE`; a bf16 matrix of ``grad``'s shape.

    ``blocks``: as :func:`~lightning_matrixfsdp.optim.orthogonalize.newton_schulz`.
    """
    return orthogonalize_with(grad, FAST_SCHEDULE, eps, blocks)


def fast_newton_schulz_batched(grads: Sequence[Tensor], eps: float = 1e-7, blocks: int | None = 1) -> list[Tensor]:
    """:func:`fast_newton_schulz` on a stack of same-shape matrices (batched GEMMs; ``blocks``:
    as :func:`~lightning_matrixfsdp.optim.orthogonalize.newton_schulz_batched`)."""
    return orthogonalize_batched(grads, FAST_SCHEDULE, eps, blocks=blocks)
