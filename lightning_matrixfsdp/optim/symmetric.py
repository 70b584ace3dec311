"""Symmetric products for the Newton-Schulz family: only the upper block triangle of a
result known to be symmetric is multiplied, the rest is mirrored.

Used for ``X X^T`` and ``A A`` (and every ``m x m`` product of the Gram-space iteration),
where the symmetry is exact in exact arithmetic. The mirror is
:func:`~lightning_matrixfsdp.optim.transpose.mirror_lower_blocks_` (one coalesced launch on CUDA).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .transpose import mirror_lower_blocks_

__all__ = ["BATCH_SYMMETRIC_BLOCKS", "BATCH_SYMMETRIC_MIN_ROWS", "CUDA_SYMMETRIC_BLOCKS", "SYMMETRIC_MIN_ROWS",
           "gram_polynomial", "symmetric_addmm", "symmetric_blocks", "symmetric_mm_twice"]

#: Row blocks for the symmetric products on CUDA (see :func:`symmetric_addmm`): the most
#: that stayed bitwise equal to torch.optim.Muon on an H200 (docs/benchmarks.md).
CUDA_SYMMETRIC_BLOCKS = 3
#: Smallest ``min(m, n)`` for which the symmetric products are used automatically (the
#: size measured to gain; smaller products are closer to launch-bound).
SYMMETRIC_MIN_ROWS = 4096
#: Row blocks for the symmetric products of a batched iteration (a 3D stack of same-shape
#: matrices) on CUDA when ``blocks`` is ``None``; 1 is torch's plain batched ops. A stack fills
#: the GPU even in row blocks, which one small matrix does not. On an H200 (torch 2.11) 2-8
#: blocks were bitwise torch.optim.Muon's per-matrix iteration on the MoE benchmark's stacks,
#: and 3-4 on seven other stack shapes from 1024 to 3072 rows; 4 was the fastest
#: (docs/benchmarks.md, "The experts' step alone").
BATCH_SYMMETRIC_BLOCKS = 4
#: Smallest ``m`` whose batches use :data:`BATCH_SYMMETRIC_BLOCKS` automatically (at 1024 rows
#: the blocks were slower on the H200, at 1536 even).
BATCH_SYMMETRIC_MIN_ROWS = 2048
#: ``b A + c A A`` in blocks: copy ``A`` once (contiguous) and accumulate each row block in
#: place, rather than copying each upper block into a fresh result (strided copies).
ACCUMULATE_IN_PLACE = True
#: ``A = X X^T`` in blocks comes with its copy for ``b A + c A A`` written by the mirror pass
#: (:func:`symmetric_mm_twice`) instead of a separate clone of ``A``.
MIRROR_COPIES = True
_BLOCK_ALIGN = 256  # interior block edges are multiples of this (whole GEMM tiles)


def symmetric_blocks(x: Tensor, blocks: int | None) -> int:
    """Row blocks for the symmetric products of ``x`` (``m x n``, ``m <= n``).

    ``None`` picks automatically: :data:`CUDA_SYMMETRIC_BLOCKS` on CUDA when ``m`` is at
    least :data:`SYMMETRIC_MIN_ROWS` (where the saved GEMM work beats the extra launches),
    else 1, which is torch.optim.Muon's exact op sequence. CPU stays at 1 so that our
    Muon is bitwise the stock one where the tests compare them. For a 3D stack ``x`` the
    automatic choice is :data:`BATCH_SYMMETRIC_BLOCKS` on CUDA from
    :data:`BATCH_SYMMETRIC_MIN_ROWS` rows on.
    """
    if blocks is None:
        if x.device.type != "cuda":
            return 1
        if x.ndim == 3:
            blocks = BATCH_SYMMETRIC_BLOCKS if x.size(-2) >= BATCH_SYMMETRIC_MIN_ROWS else 1
        elif x.size(-2) < SYMMETRIC_MIN_ROWS:
            return 1
        else:
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
    consume_input: bool = False,
    copy: Tensor | None = None,
) -> Tensor:
    """``beta * input + alpha * left @ right`` for a result known to be symmetric (2D, or 3D
    stacks with the batched ops).

    Only the upper block triangle is multiplied, one row block per GEMM
    (``out[r0:r1, r0:] = left[r0:r1] @ right[:, r0:]``); the strict lower blocks are
    then copied from their mirror images. With ``b`` equal blocks that is
    ``(b + 1) / (2 b)`` of the GEMM work; the mirror is one coalesced launch
    (:func:`~lightning_matrixfsdp.optim.transpose.mirror_lower_blocks_`). Every computed entry is the same dot
    product over the same ``k`` as in the full GEMM, so with a kernel that does not
    split ``k`` it is the same number; ``blocks=1`` is the plain (add)mm. Used for
    ``X X^T`` and ``A A`` in the Newton-Schulz family, where the symmetry is exact
    in exact arithmetic; the off-diagonal blocks of the result are exact mirrors.

    ``consume_input``: ``input`` is a contiguous temporary of the caller's (a copy made on the
    way, :func:`symmetric_mm_twice`); the result is accumulated into it and it is returned.
    ``copy``: a contiguous tensor of the result's shape that the mirror pass also fills with the
    result (blocks, no ``input``; :func:`symmetric_mm_twice`).
    """
    m = left.size(-2)
    if left.ndim == 3:
        mm, addmm = torch.bmm, torch.baddbmm
    else:
        mm, addmm = torch.mm, torch.addmm
    if copy is not None and (blocks <= 1 or input is not None):
        raise ValueError("symmetric_addmm's copy is written by the mirror pass of a blocked product without "
                         f"input; got blocks={blocks} and input {'given' if input is not None else 'None'}")
    if blocks <= 1:
        if input is None:
            return mm(left, right)
        if consume_input:
            return addmm(input, left, right, beta=beta, alpha=alpha, out=input)
        return addmm(input, left, right, beta=beta, alpha=alpha)
    edges = _block_edges(m, blocks)
    in_place = consume_input or (ACCUMULATE_IN_PLACE and input is not None and input.is_contiguous()
                                 and input.dtype == left.dtype)
    if input is not None and in_place:
        # One contiguous copy of the accumulator (or the caller's), then each row block accumulates
        # into itself: the same numbers as copying each upper block into place (what addmm does
        # when its output is not its input), but a plain memcpy instead of one strided copy per block.
        out = input if consume_input else input.clone()
        for r0, r1 in zip(edges[:-1], edges[1:]):
            block = out[..., r0:r1, r0:]
            addmm(block, left[..., r0:r1, :], right[..., r0:], beta=beta, alpha=alpha, out=block)
        return mirror_lower_blocks_(out, edges)
    out = torch.empty(*left.shape[:-1], m, dtype=left.dtype, device=left.device)
    for r0, r1 in zip(edges[:-1], edges[1:]):
        if input is None:
            mm(left[..., r0:r1, :], right[..., r0:], out=out[..., r0:r1, r0:])
        else:
            addmm(input[..., r0:r1, r0:], left[..., r0:r1, :], right[..., r0:], beta=beta, alpha=alpha,
                  out=out[..., r0:r1, r0:])
    return mirror_lower_blocks_(out, edges, copy=copy)


def symmetric_mm_twice(left: Tensor, right: Tensor, blocks: int) -> tuple[Tensor, Tensor]:
    """``left @ right`` (symmetric, as :func:`symmetric_addmm`) and a second, contiguous copy of it,
    written by the mirror pass on its way (:data:`MIRROR_COPIES`; else a clone). The copy is what
    ``b A + c A A`` accumulates into (``consume_input``): the same numbers as cloning ``A``."""
    if blocks <= 1 or not MIRROR_COPIES:
        out = symmetric_addmm(left, right, blocks)
        return out, out.clone()
    copy = torch.empty(*left.shape[:-1], left.size(-2), dtype=left.dtype, device=left.device)
    return symmetric_addmm(left, right, blocks, copy=copy), copy


def gram_polynomial(x: Tensor, blocks: int, beta: float, alpha: float) -> Tensor:
    """``beta A + alpha A A`` with ``A = x x^T`` (2D or a 3D stack): the Gram part of one Newton-Schulz
    iteration. With one block, torch.optim.Muon's ops; in blocks, ``A``'s copy that the product
    accumulates into is written by ``A``'s mirror pass (:func:`symmetric_mm_twice`, with
    :data:`ACCUMULATE_IN_PLACE`), else ``A`` is copied as ``addmm`` copies its input."""
    if blocks > 1 and ACCUMULATE_IN_PLACE:
        gram, acc = symmetric_mm_twice(x, x.mT, blocks)
        return symmetric_addmm(gram, gram, blocks, input=acc, beta=beta, alpha=alpha, consume_input=True)
    gram = symmetric_addmm(x, x.mT, blocks)
    return symmetric_addmm(gram, gram, blocks, input=gram, beta=beta, alpha=alpha)
