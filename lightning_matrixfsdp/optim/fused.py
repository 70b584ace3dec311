"""Fused elementwise work of the Muon step on CUDA, bitwise torch.optim.Muon's ops.

Newton-Schulz is compute-bound; around it the step is memory-bound: torch.optim.Muon
updates the momentum with ``buf.lerp_(grad, 1 - momentum)`` and then forms the Nesterov
update with ``grad.lerp(buf, momentum)``, which reads ``grad`` and ``buf`` twice and
writes twice. :func:`momentum_update` does both in one pass (read 2, write 2 instead
of read 4, write 2). It evaluates the formula of PyTorch's CUDA ``lerp``
(``ATen/native/Lerp.h``: ``self + w (end - self)`` when ``|w| < 0.5``, else
``end - (end - self)(1 - w)``, in float32 for 16-bit inputs, the weight rounded to
float32) and rounds the new buffer to its dtype before the second lerp reads it, as
the two separate ops do. Whether the compilers contract the same multiply-adds is a
property of the build, so it is measured (``scripts/tune_owner_step.py`` on an H200,
docs/benchmarks.md), and the CPU tests check the formula under the Triton interpreter.

:func:`divide_` is Newton-Schulz's normalization ``x.div_(norm)``: PyTorch runs a
tensor divisor through a generic broadcast kernel; this is one vectorized pass with
the same IEEE division.

Anything the kernels do not cover (CPU, no Triton, other dtypes or layouts) runs
torch's ops.
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from ._triton import HAS_TRITON, launch, triton_usable

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["decay_add_", "divide_", "divide_each_", "momentum_update"]

_BLOCK = 2048
_TILE = 64  # tiles of the transposed update add (fp32 weights: 64 x 64 keeps registers low)
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAS_TRITON:

    @triton.jit
    def _lerp(start, end, weight, SMALL: tl.constexpr):
        """PyTorch's lerp on float32 values (``SMALL``: ``|weight| < 0.5``, decided on the host)."""
        if SMALL:
            return start + weight * (end - start)
        return end - (end - start) * (1.0 - weight)

    @triton.jit
    def _momentum_kernel(grad, buf, update, n, w_buf, w_update,
                         SMALL_BUF: tl.constexpr, SMALL_UPDATE: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        g = tl.load(grad + offsets, mask=inside)
        b = tl.load(buf + offsets, mask=inside)
        new_buf = _lerp(b.to(tl.float32), g.to(tl.float32), w_buf, SMALL_BUF).to(b.dtype)
        tl.store(buf + offsets, new_buf, mask=inside)
        u = _lerp(g.to(tl.float32), new_buf.to(tl.float32), w_update, SMALL_UPDATE)
        tl.store(update + offsets, u.to(update.dtype.element_ty), mask=inside)


    @triton.jit
    def _divide_kernel(x, divisor, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        d = tl.load(divisor).to(tl.float32)
        v = tl.load(x + offsets, mask=inside)
        tl.store(x + offsets, tl.div_rn(v.to(tl.float32), d).to(v.dtype), mask=inside)

    @triton.jit
    def _divide_each_kernel(x, divisors, n, per_matrix, BLOCK: tl.constexpr):
        """``x[k] /= divisors[k]`` over a stack's dense storage (matrix ``k`` is ``per_matrix`` entries)."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        d = tl.load(divisors + offsets // per_matrix, mask=inside, other=1.0).to(tl.float32)
        v = tl.load(x + offsets, mask=inside)
        tl.store(x + offsets, tl.div_rn(v.to(tl.float32), d).to(v.dtype), mask=inside)

    @triton.jit
    def _decay_add_kernel(p, u, n, decay, alpha, DECAY: tl.constexpr, BLOCK: tl.constexpr):
        """``p.mul_(decay)`` (rounded to p's dtype) then ``p.add_(u, alpha=alpha)``: torch's CUDA add
        evaluates ``a + alpha * b`` contracted to one fma, in float32 for 16-bit inputs."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        w = tl.load(p + offsets, mask=inside)
        a = w.to(tl.float32)
        if DECAY:
            a = (a * decay).to(w.dtype).to(tl.float32)
        b = tl.load(u + offsets, mask=inside).to(tl.float32)
        tl.store(p + offsets, tl.fma(b, alpha, a).to(w.dtype), mask=inside)

    @triton.jit
    def _decay_add_t_kernel(p, u, rows, cols, decay, alpha, DECAY: tl.constexpr, TILE: tl.constexpr):
        """:func:`_decay_add_kernel` on one tile of matrix ``program_id(2)`` of ``p`` (``rows x
        cols``, contiguous) with the update stored transposed (``u[k]`` is ``cols x rows``,
        contiguous): both read along their rows, the tile transposed in registers."""
        k = tl.program_id(2).to(tl.int64)
        p += k * rows * cols
        u += k * rows * cols
        r = tl.program_id(0) * TILE + tl.arange(0, TILE)
        c = tl.program_id(1) * TILE + tl.arange(0, TILE)
        inside = (r[:, None] < rows) & (c[None, :] < cols)  # [r, c]
        b = tl.trans(tl.load(u + c[:, None] * rows + r[None, :], mask=tl.trans(inside))).to(tl.float32)
        w = tl.load(p + r[:, None] * cols + c[None, :], mask=inside)
        a = w.to(tl.float32)
        if DECAY:
            a = (a * decay).to(w.dtype).to(tl.float32)
        tl.store(p + r[:, None] * cols + c[None, :], tl.fma(b, alpha, a).to(w.dtype), mask=inside)


def _fusable(grad: Tensor, buf: Tensor) -> bool:
    """CUDA only: the kernel is there to equal torch's CUDA lerp, whose multiply-adds are
    contracted; torch's CPU kernel rounds differently (the interpreter tests call
    :func:`_fused_momentum` directly)."""
    return (
        grad.is_cuda
        and triton_usable(grad)
        and grad.dtype in _FUSED_DTYPES
        and buf.dtype == grad.dtype
        and buf.device == grad.device
        and grad.shape == buf.shape
        and grad.is_contiguous()
        and buf.is_contiguous()
        and grad.numel() > 0
    )


def _float32(x: float) -> float:
    """``x`` rounded to float32, as ``Scalar.to<float>()`` does for lerp's weight."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _fused_momentum(grad: Tensor, buf: Tensor, momentum: float, dtype: torch.dtype | None = None,
                    **compile_options: object) -> Tensor:
    """The kernel: updates ``buf`` in place and returns the Nesterov update, in ``dtype`` if given
    (one rounding of the float32 value, as ``.to(dtype)`` of the float32 update would do;
    ``compile_options`` such as ``enable_fp_fusion`` are for the tuning script)."""
    w_buf, w_update = _float32(1 - momentum), _float32(momentum)
    update = torch.empty_like(grad, dtype=dtype)
    n = grad.numel()
    launch(_momentum_kernel, (triton.cdiv(n, _BLOCK),), grad, grad, buf, update, n, w_buf, w_update,
           SMALL_BUF=abs(w_buf) < 0.5, SMALL_UPDATE=abs(w_update) < 0.5, BLOCK=_BLOCK, **compile_options)
    return update


def _dense(x: Tensor) -> Tensor | None:
    """``x`` or its transpose when either is contiguous (an elementwise op may run on either)."""
    if x.is_contiguous():
        return x
    if x.ndim == 2 and x.T.is_contiguous():
        return x.T
    return None


def _divide(x: Tensor, divisor: Tensor) -> None:
    """The kernel: ``x /= divisor`` on ``x``'s dense storage."""
    n = x.numel()
    launch(_divide_kernel, (triton.cdiv(n, _BLOCK),), x, x, divisor, n, BLOCK=_BLOCK)


def divide_(x: Tensor, divisor: Tensor) -> Tensor:
    """``x.div_(divisor)`` for a one-element ``divisor`` on ``x``'s device; returns ``x``.

    PyTorch runs a tensor divisor through its generic (not vectorized) broadcast kernel,
    slower than a plain pass over the memory (measured on an H200); the Triton kernel is one
    vectorized pass with the same IEEE division (``div_rn``) in float32 for 16-bit
    inputs and the same rounding back. CUDA only, like :func:`momentum_update`.
    """
    dense = _dense(x)
    if (dense is not None and x.is_cuda and triton_usable(x) and x.dtype in _FUSED_DTYPES
            and divisor.numel() == 1 and divisor.dtype == x.dtype and divisor.device == x.device
            and x.numel() > 0):
        _divide(dense, divisor)
        return x
    return x.div_(divisor)


def momentum_update(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool, fused: bool = True,
                    dtype: torch.dtype | None = None) -> Tensor:
    """``buf.lerp_(grad, 1 - momentum)``; return ``grad.lerp(buf, momentum)`` (Nesterov) or ``buf``.

    With ``fused``, Nesterov and CUDA tensors the kernel covers, one Triton launch, which
    writes the update in ``dtype`` if given (the caller casts to it next: a pass saved);
    otherwise torch's ops (without Nesterov there is nothing to fuse), in ``grad``'s dtype.
    """
    if fused and nesterov and _fusable(grad, buf):
        return _fused_momentum(grad, buf, momentum, dtype if dtype in _FUSED_DTYPES else None)
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def divide_each_(x: Tensor, divisors: Tensor) -> Tensor:
    """``x.div_(divisors)`` for a 3D stack ``x`` and one divisor per matrix (shape ``(B, 1, 1)``);
    returns ``x``. The kernel of :func:`divide_` over the stack's storage (``x`` or its ``mT``
    contiguous), each entry divided by its matrix's divisor; torch's broadcast division
    elsewhere."""
    dense = x if x.is_contiguous() else (x.mT if x.ndim == 3 and x.mT.is_contiguous() else None)
    if (dense is not None and x.ndim == 3 and x.is_cuda and triton_usable(x) and x.dtype in _FUSED_DTYPES
            and divisors.shape == (x.size(0), 1, 1) and divisors.dtype == x.dtype
            and divisors.device == x.device and divisors.is_contiguous() and x.numel() > 0):
        _divide_each(dense, divisors)
        return x
    return x.div_(divisors)


def _divide_each(dense: Tensor, divisors: Tensor) -> None:
    """The kernel: ``dense[k] /= divisors[k]`` over the contiguous storage of a stack."""
    n = dense.numel()
    launch(_divide_each_kernel, (triton.cdiv(n, _BLOCK),), dense, dense, divisors, n, n // dense.size(0),
           BLOCK=_BLOCK)


def decay_add_(p: Tensor, update: Tensor, decay: float, alpha: float) -> Tensor:
    """``p.mul_(decay)`` (skipped when ``decay == 1``, as the optimizers skip it) then
    ``p.add_(update, alpha=alpha)``, in one pass on CUDA where ``p`` is contiguous and ``update``
    of its shape, contiguous or the transposed view of a contiguous stack (then read tile by
    tile); returns ``p``. Bitwise torch's two ops where the compiler contracts ``a + alpha * b``
    as torch's CUDA build does (measured: docs/benchmarks.md); torch's ops elsewhere."""
    if p.is_cuda and _decay_add(p, update, decay, alpha):
        return p
    if decay != 1:
        p.mul_(decay)
    return p.add_(update, alpha=alpha)


def _decay_add(p: Tensor, update: Tensor, decay: float, alpha: float) -> bool:
    """The kernels of :func:`decay_add_` where they apply (``update`` contiguous, or the
    transposed view of a contiguous 2D/3D tensor); False where they do not."""
    if not (triton_usable(p) and p.dtype in _FUSED_DTYPES and update.dtype in _FUSED_DTYPES
            and p.shape == update.shape and p.device == update.device and p.is_contiguous() and p.numel() > 0):
        return False
    if update.is_contiguous():
        n = p.numel()
        launch(_decay_add_kernel, (triton.cdiv(n, _BLOCK),), p, p, update, n, _float32(decay), _float32(alpha),
               DECAY=decay != 1, BLOCK=_BLOCK)
        return True
    if p.ndim in (2, 3) and update.mT.is_contiguous() and p.size(-2) * p.size(-1) < 2**31:
        rows, cols = p.shape[-2:]
        grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE), p.size(0) if p.ndim == 3 else 1)
        launch(_decay_add_t_kernel, grid, p, p, update, rows, cols, _float32(decay), _float32(alpha),
               DECAY=decay != 1, TILE=_TILE, num_warps=4)
        return True
    return False
