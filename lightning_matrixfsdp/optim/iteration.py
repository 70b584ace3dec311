"""The kernels that run a coefficient schedule: ``X <- a X + (b A + c A^2) X`` per
iteration, on one matrix or a stack of same-shape matrices, in ``X`` space or in Gram space.

Each driver casts (bf16 by default), turns the matrix wide, Frobenius-normalizes it and
iterates; the named methods (:mod:`.orthogonalize`, :mod:`.fast`) only choose the
schedule. With one row block the op sequence is torch.optim.Muon's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .coefficients import Coefficients
from .fused import divide_, divide_each_
from .symmetric import gram_polynomial, symmetric_addmm, symmetric_blocks
from .transpose import transposed

__all__ = ["check_matrix", "gram_orthogonalize_with", "orthogonalize_batched", "orthogonalize_stack",
           "orthogonalize_with"]

#: Tall stacks go row-major (one coalesced batched transpose in, one out) when their symmetric
#: products are blocked, as single matrices do (:func:`orthogonalize_with`).
BATCH_ROW_MAJOR = True


def check_matrix(grad: Tensor) -> None:
    """A 2-D matrix, as torch.optim.Muon requires (same message)."""
    if grad.ndim != 2:
        raise ValueError(f"Input tensor gradient must be a 2D matrix, got shape {tuple(grad.shape)}")


def _iterate(x: Tensor, schedule: Sequence[Coefficients], blocks: int = 1) -> Tensor:
    """Apply ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` once per schedule entry.

    With ``blocks == 1`` the op sequence (``@`` then ``addmm`` twice) is exactly
    torch.optim.Muon's, which is what makes the 2D result bitwise equal to it; with
    more blocks ``A`` and ``b A + c A^2`` come from the symmetric products (:func:`gram_polynomial`). 3D input
    uses the batched ops (one launch per product, or per row block).
    """
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for a, b, c in schedule:
        x = addmm(x, gram_polynomial(x, blocks, b, c), x, beta=a)
    return x


def orthogonalize_with(grad: Tensor, schedule: Sequence[Coefficients], eps: float, blocks: int | None = 1) -> Tensor:
    """Run ``schedule`` on ``grad``: bf16, wide orientation, Frobenius normalization, iterate."""
    check_matrix(grad)
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
    grads: Sequence[Tensor],
    schedule: Sequence[Coefficients],
    eps: float,
    gram_restarts: set[int] | None = None,
    blocks: int | None = 1,
) -> list[Tensor]:
    """Stack same-shape matrices and iterate on the stack (in Gram space with ``gram_restarts``;
    ``blocks``: symmetric row blocks of the plain iteration, see :func:`orthogonalize_stack`)."""
    if len(grads) == 0:
        return []
    shape, device = grads[0].shape, grads[0].device
    for g in grads:
        check_matrix(g)
        if g.shape != shape or g.device != device:
            raise ValueError(
                "batched orthogonalization needs matrices of one shape and device, got "
                f"{tuple(shape)} on {device} and {tuple(g.shape)} on {g.device}"
            )
    x = torch.stack([g.bfloat16() for g in grads])
    if gram_restarts is None:
        return list(orthogonalize_stack(x, schedule, eps, blocks).unbind(0))
    tall = shape[0] > shape[1]
    if tall:
        x = x.mT
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x.div_(norms.clamp(min=eps))
    x = _gram_iterate(x, schedule, gram_restarts, 1)
    if tall:
        x = x.mT
    return list(x.unbind(0))


def orthogonalize_stack(stack: Tensor, schedule: Sequence[Coefficients], eps: float,
                        blocks: int | None = 1, contiguous: bool = True) -> Tensor:
    """Run ``schedule`` on every matrix of the 3D ``stack`` at once (batched GEMMs); a bf16 stack
    of the same shape, possibly a transposed view.

    The stack need not be a copy: an expert stack's update viewed as its pieces goes in as it
    is. A bf16 ``stack`` may be normalized in place (as torch.optim.Muon normalizes a bf16
    update), so pass a temporary. ``blocks``: symmetric row blocks (:func:`symmetric_blocks`;
    ``None`` picks :data:`~.symmetric.BATCH_SYMMETRIC_BLOCKS` on CUDA); with 1 the ops are
    torch's batched ``bmm``/``baddbmm``. Blocked tall stacks are iterated row-major
    (:data:`BATCH_ROW_MAJOR`: the normalization and the transpose are one coalesced pass, exact)
    and come back in ``stack``'s layout, or, with ``contiguous=False``, as the transposed view
    of the row-major result (for a consumer that reads it transposed).
    """
    if stack.ndim != 3:
        raise ValueError(f"orthogonalize_stack needs a 3D stack of matrices, got shape {tuple(stack.shape)}")
    x = stack.bfloat16()
    tall = stack.size(1) > stack.size(2)
    wide = x.mT if tall else x
    norms = torch.linalg.vector_norm(wide, dim=(-2, -1), keepdim=True).clamp(min=eps)
    nblocks = symmetric_blocks(wide, blocks)
    row_major = BATCH_ROW_MAJOR and nblocks > 1 and tall and x.is_cuda and x.is_contiguous()
    if row_major:
        wide = transposed(x, divisors=norms)  # (x / norm).mT, contiguous
    else:
        divide_each_(wide, norms)
    wide = _iterate(wide, schedule, nblocks)
    if row_major:
        return transposed(wide) if contiguous else wide.mT
    return wide.mT if tall else wide


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


def gram_orthogonalize_with(
    grad: Tensor,
    schedule: Sequence[Coefficients],
    eps: float,
    restart_at: Sequence[int],
    dtype: torch.dtype,
    blocks: int | None,
) -> Tensor:
    """Wide orientation, Frobenius normalization (out of place), Gram-space iteration."""
    check_matrix(grad)
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    nblocks = symmetric_blocks(x, blocks)
    row_major = nblocks > 1 and tall and x.is_cuda and x.T.is_contiguous()
    if row_major:  # as in orthogonalize_with
        x = transposed(x.T)
    x = _gram_iterate(x, schedule, set(restart_at), nblocks)
    if row_major:
        return transposed(x)
    return x.T if tall else x
