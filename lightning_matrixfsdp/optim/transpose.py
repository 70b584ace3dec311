"""A coalesced transposed copy for CUDA, used to mirror the symmetric block products.

``dst.copy_(src.T)`` on CUDA goes through PyTorch's generic strided kernel, which can
coalesce either the reads or the writes of a transpose but not both; for the 2-byte
entries of Newton-Schulz's Gram matrices that is slow enough to cancel most of what
computing only half of a symmetric product saves (measured on an H200, see
docs/benchmarks.md). The Triton kernel here moves one square tile per program through
registers (``tl.trans``), so both sides are contiguous. It is exact: a copy.
Its tile size is autotuned per shape on first use.

Without Triton (CPU builds of torch) or for CPU tensors, :func:`transpose_copy_` falls
back to ``dst.copy_(src.T)``. ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors,
which is how the tests check it without a GPU.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU builds have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["HAS_TRITON", "transpose_copy_"]

HAS_TRITON = triton is not None

if HAS_TRITON:

    @triton.jit
    def _transpose_copy_kernel(src, dst, rows, cols, src_stride, dst_stride, TILE: tl.constexpr):
        """``dst[r, c] = src[c, r]`` for one ``TILE x TILE`` tile; dst is ``rows x cols``."""
        r = tl.program_id(0) * TILE + tl.arange(0, TILE)
        c = tl.program_id(1) * TILE + tl.arange(0, TILE)
        # Read the tile as it lies in src (contiguous along r), transpose in registers.
        tile = tl.load(src + c[:, None] * src_stride + r[None, :],
                       mask=(c[:, None] < cols) & (r[None, :] < rows))
        tl.store(dst + r[:, None] * dst_stride + c[None, :], tl.trans(tile),
                 mask=(r[:, None] < rows) & (c[None, :] < cols))

    # On GPUs the tile is autotuned per (rows, cols) on first use (a copy, so the
    # autotuner's repeated trial launches are harmless); the interpreter cannot tune.
    _tuned_transpose_copy_kernel = triton.autotune(
        configs=[triton.Config({"TILE": tile}, num_warps=warps) for tile in (32, 64, 128) for warps in (4, 8)],
        key=["rows", "cols"],
    )(_transpose_copy_kernel)


def _use_kernel(dst: Tensor) -> bool:
    if not HAS_TRITON:
        return False
    return dst.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _int32_view(t: Tensor) -> bool:
    """Row-major (unit column stride) with every element offset addressable in int32."""
    return t.stride(1) == 1 and (t.size(0) - 1) * t.stride(0) + t.size(1) < 2**31


def transpose_copy_(dst: Tensor, src: Tensor) -> Tensor:
    """``dst.copy_(src.T)`` for 2D row-major views (unit column stride); returns ``dst``."""
    if src.shape != dst.shape[::-1] or src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError(f"transpose_copy_ needs src of shape {tuple(dst.shape[::-1])}, dtype {dst.dtype} "
                         f"and device {dst.device}; got {tuple(src.shape)}, {src.dtype}, {src.device}")
    if dst.numel() == 0:
        return dst
    if not _use_kernel(dst) or not (_int32_view(dst) and _int32_view(src)):
        return dst.copy_(src.T)
    rows, cols = dst.shape

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(rows, meta["TILE"]), triton.cdiv(cols, meta["TILE"])

    args = (src, dst, rows, cols, src.stride(0), dst.stride(0))
    if not dst.is_cuda:  # TRITON_INTERPRET=1 on CPU tensors
        _transpose_copy_kernel[grid](*args, TILE=64)
        return dst
    with torch.cuda.device(dst.device):
        _tuned_transpose_copy_kernel[grid](*args)
    return dst

