"""How close an update is to the exact polar factor ``U V^T``: the measure tests and
benchmarks compare the orthogonalizers with (float64, SVD; never on the training path)."""

from __future__ import annotations

import torch
from torch import Tensor

from .iteration import check_matrix

__all__ = ["polar_error", "polar_factor"]


def polar_factor(grad: Tensor, rtol: float | None = None) -> Tensor:
    """``U V^T`` of ``grad`` in float64 over the singular values above ``rtol * sigma_max``
    (default ``max(m, n) * eps`` of ``grad``'s dtype, as ``torch.linalg.matrix_rank``)."""
    check_matrix(grad)
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
    check_matrix(grad)
    if update.shape != grad.shape:
        raise ValueError(f"update shape {tuple(update.shape)} != grad shape {tuple(grad.shape)}")
    if polar is None:
        polar = polar_factor(grad, rtol)
    diff = update.detach().to(torch.float64) - polar
    reference = torch.linalg.matrix_norm(polar)
    if reference == 0:  # zero matrix: measure the update itself
        return float(torch.linalg.matrix_norm(diff))
    return float(torch.linalg.matrix_norm(diff) / reference)
