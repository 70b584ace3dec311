"""Coalesced transposed copies for Newton-Schulz on CUDA: block mirrors and transposes.

The symmetric products of Newton-Schulz (:func:`~.symmetric.symmetric_addmm`)
compute only the upper block triangle and then need ``out[lower block] = out[upper
block].T``. On CUDA ``dst.copy_(src.T)`` goes through PyTorch's generic strided kernel,
which coalesces either the reads or the writes of a transpose, not both; for 2-byte
entries that cancelled most of what halving the GEMM work saves (measured on an H200,
docs/benchmarks.md). The Triton kernel here moves one square tile per program through
registers (``tl.trans``), so both sides are contiguous, and does every lower block of
the matrix in one launch: Triton launches cost tens of microseconds of CPU time, and
Newton-Schulz issues two mirrors per iteration. It is exact: a copy.

Without Triton (CPU builds of torch), for CPU tensors, or beyond what the kernel takes
(more than :data:`MAX_BLOCKS` blocks, int32 offsets), :func:`mirror_lower_blocks_`
falls back to one ``copy_`` per block (see :mod:`._triton` for the interpreter the
tests use). :func:`transposed` does the same for a whole matrix (tall matrices are
iterated in their wide orientation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._triton import HAS_TRITON, launch, triton_usable

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["HAS_TRITON", "MAX_BLOCKS", "mirror_lower_blocks_", "transposed"]

#: Most row blocks the one-launch kernel handles (it takes the interior edges as scalars).
MAX_BLOCKS = 8
# 128 x 128 tiles with 4 warps: the mirror was fastest with them, within noise, among
# 32/64/128-wide tiles with 2/4/8 warps on an H200, and the transpose was indifferent
# (scripts/tune_owner_step.py; figures in docs/decisions.md).
_TILE = 128
_WARPS = 4

if HAS_TRITON:

    @triton.jit
    def _block_of(x, e1, e2, e3, e4, e5, e6, e7):
        """Index of the row block that offset ``x`` falls in (edges ascending, padded with m)."""
        return ((x >= e1).to(tl.int32) + (x >= e2).to(tl.int32) + (x >= e3).to(tl.int32)
                + (x >= e4).to(tl.int32) + (x >= e5).to(tl.int32) + (x >= e6).to(tl.int32)
                + (x >= e7).to(tl.int32))

    @triton.jit
    def _mirror_kernel(a, copy, m, stride, batch_stride, e1, e2, e3, e4, e5, e6, e7, COPY: tl.constexpr,
                       TILE: tl.constexpr):
        """One tile of matrix ``program_id(2)``: ``a[r, c] = a[c, r]`` wherever block(r) > block(c)
        (other entries untouched); with ``COPY`` the whole mirrored tile also goes to ``copy``
        (contiguous ``m x m`` matrices)."""
        k = tl.program_id(2).to(tl.int64)
        a += k * batch_stride
        r0 = tl.program_id(0) * TILE
        c0 = tl.program_id(1) * TILE
        # Tiles with no strictly-lower entry (two thirds of them for 3 blocks) stop here unless
        # they are copied.
        if not COPY:
            if _block_of(r0 + TILE - 1, e1, e2, e3, e4, e5, e6, e7) <= _block_of(c0, e1, e2, e3, e4, e5, e6, e7):
                return
        r = r0 + tl.arange(0, TILE)
        c = c0 + tl.arange(0, TILE)
        lower = (_block_of(r, e1, e2, e3, e4, e5, e6, e7)[:, None]
                 > _block_of(c, e1, e2, e3, e4, e5, e6, e7)[None, :])  # [r, c]
        inside = (r[:, None] < m) & (c[None, :] < m)
        # Read the mirror tile as it lies (contiguous along r), transpose in registers.
        tile = tl.trans(tl.load(a + c[:, None] * stride + r[None, :], mask=tl.trans(inside & lower)))
        tl.store(a + r[:, None] * stride + c[None, :], tile, mask=inside & lower)
        if COPY:
            own = tl.load(a + r[:, None] * stride + c[None, :], mask=inside & ~lower)
            copy += k * m * m
            tl.store(copy + r[:, None] * m + c[None, :], tl.where(lower, tile, own), mask=inside)

    @triton.jit
    def _transpose_kernel(src, dst, divisors, rows, cols, DIVIDE: tl.constexpr, TILE: tl.constexpr):
        """One tile of ``dst = src.T`` for matrix ``program_id(2)``: dst is ``rows x cols``, both
        contiguous (stacks of them for a batch); with ``DIVIDE`` each entry is divided by the
        matrix's divisor on the way (float32 IEEE division, as torch's ``div`` of 16-bit values)."""
        k = tl.program_id(2).to(tl.int64)
        src += k * rows * cols
        dst += k * rows * cols
        r = tl.program_id(0) * TILE + tl.arange(0, TILE)
        c = tl.program_id(1) * TILE + tl.arange(0, TILE)
        inside = (r[:, None] < rows) & (c[None, :] < cols)  # [r, c]
        tile = tl.load(src + c[:, None] * rows + r[None, :], mask=tl.trans(inside))
        if DIVIDE:
            d = tl.load(divisors + k).to(tl.float32)
            tile = tl.div_rn(tile.to(tl.float32), d).to(src.dtype.element_ty)
        tl.store(dst + r[:, None] * cols + c[None, :], tl.trans(tile), mask=inside)


def transposed(src: Tensor, divisors: Tensor | None = None) -> Tensor:
    """``src.mT.contiguous()`` for a contiguous 2D ``src`` or 3D stack of matrices, with the
    coalesced kernel on CUDA; with ``divisors`` (one per matrix of a stack, shape ``(B, 1, 1)``,
    ``src``'s dtype) it is ``src.div(divisors).mT.contiguous()`` in the same one pass.

    Newton-Schulz runs tall matrices in their wide orientation: one transposed copy of
    the input before the iteration and one of the result after it. PyTorch's strided
    copy costs about as much as a GEMM of the iteration there (measured on an H200).
    """
    if src.ndim not in (2, 3):
        raise ValueError(f"transposed needs a 2D or 3D tensor, got shape {tuple(src.shape)}")
    cols, rows = src.shape[-2:]
    divide = divisors is not None
    if (not triton_usable(src) or not src.is_contiguous() or rows * cols >= 2**31 or src.numel() == 0
            or (divide and (src.ndim != 3 or divisors.shape != (src.size(0), 1, 1) or divisors.dtype != src.dtype
                            or not divisors.is_contiguous() or divisors.device != src.device))):
        return (src.div(divisors) if divide else src).mT.contiguous()
    dst = torch.empty(*src.shape[:-2], rows, cols, dtype=src.dtype, device=src.device)
    grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE), src.size(0) if src.ndim == 3 else 1)
    launch(_transpose_kernel, grid, src, src, dst, divisors if divide else src, rows, cols, DIVIDE=divide,
           TILE=_TILE, num_warps=_WARPS)
    return dst


def _kernel_ok(a: Tensor, edges: Sequence[int]) -> bool:
    if not triton_usable(a) or len(edges) - 1 > MAX_BLOCKS:
        return False
    m = a.size(-1)
    return a.stride(-1) == 1 and (m - 1) * a.stride(-2) + m < 2**31


def mirror_lower_blocks_(a: Tensor, edges: Sequence[int], copy: Tensor | None = None) -> Tensor:
    """Fill each strictly-lower block of square ``a`` (or of each matrix of a 3D stack) from its
    upper mirror; returns ``a``.

    ``edges`` are the block boundaries ``0 = e_0 < e_1 < ... < e_b = m``: afterwards
    ``a[..., e_j:e_{j+1}, e_i:e_{i+1}] = a[..., e_i:e_{i+1}, e_j:e_{j+1}].mT`` for every ``j > i``.
    Diagonal blocks and the upper blocks are not touched. A stack is one launch.

    ``copy`` (contiguous, ``a``'s shape and dtype): also filled with the mirrored ``a``, in the same
    pass. Newton-Schulz needs ``A`` twice (``b A + c A A`` accumulates into a copy of it); written
    on the mirror's way, the copy costs one write of ``A`` instead of a read and a write.
    """
    m = a.size(-1) if a.ndim in (2, 3) else -1
    if m < 0 or a.size(-2) != m or list(edges[:1]) != [0] or edges[-1] != m:
        raise ValueError(f"mirror_lower_blocks_ needs a square matrix (or a 3D stack of them) and edges from 0 "
                         f"to its size; got {tuple(a.shape)} and {list(edges)}")
    if copy is not None and (copy.shape != a.shape or copy.dtype != a.dtype or copy.device != a.device
                             or not copy.is_contiguous()):
        raise ValueError(f"mirror_lower_blocks_'s copy must be contiguous with a's shape, dtype and device; got "
                         f"{tuple(copy.shape)} {copy.dtype} on {copy.device} for {tuple(a.shape)} {a.dtype} on {a.device}")
    if len(edges) <= 2 or a.numel() == 0 or not _kernel_ok(a, edges):
        for r0, r1 in zip(edges[:-2], edges[1:-1]):
            a[..., r1:, r0:r1].copy_(a[..., r0:r1, r1:].mT)
        if copy is not None:
            copy.copy_(a)
        return a
    interior = list(edges[1:-1]) + [m] * (MAX_BLOCKS - 1 - (len(edges) - 2))  # 7 scalars
    batch = a.size(0) if a.ndim == 3 else 1
    grid = (triton.cdiv(m, _TILE), triton.cdiv(m, _TILE), batch)
    launch(_mirror_kernel, grid, a, a, a if copy is None else copy, m, a.stride(-2),
           a.stride(0) if a.ndim == 3 else 0, *interior, COPY=copy is not None, TILE=_TILE, num_warps=_WARPS)
    return a
