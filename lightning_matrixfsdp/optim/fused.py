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

__all__ = ["divide_", "momentum_update"]

_BLOCK = 2048
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
        tl.store(update + offsets, u.to(g.dtype), mask=inside)


    @triton.jit
    def _divide_kernel(x, divisor, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        d = tl.load(divisor).to(tl.float32)
        v = tl.load(x + offsets, mask=inside)
        tl.store(x + offsets, tl.div_rn(v.to(tl.float32), d).to(v.dtype), mask=inside)


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


def _fused_momentum(grad: Tensor, buf: Tensor, momentum: float, **compile_options: object) -> Tensor:
    """The kernel: updates ``buf`` in place and returns the Nesterov update
    (``compile_options`` such as ``enable_fp_fusion`` are for the tuning script)."""
    w_buf, w_update = _float32(1 - momentum), _float32(momentum)
    update = torch.empty_like(grad)
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


def momentum_update(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool, fused: bool = True) -> Tensor:
    """``buf.lerp_(grad, 1 - momentum)``; return ``grad.lerp(buf, momentum)`` (Nesterov) or ``buf``.

    With ``fused``, Nesterov and CUDA tensors the kernel covers, one Triton launch;
    otherwise torch's ops (without Nesterov there is nothing to fuse).
    """
    if fused and nesterov and _fusable(grad, buf):
        return _fused_momentum(grad, buf, momentum)
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf
