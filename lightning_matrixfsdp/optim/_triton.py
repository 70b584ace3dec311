"""Triton where it exists: whether it is installed, where a kernel may run, how it is launched.

Triton ships with CUDA builds of torch; CPU builds have none, and every kernel of this
package then falls back to torch's ops. ``TRITON_INTERPRET=1`` runs the kernels on CPU
tensors, which is how the tests check them without a GPU. Shared by the kernels of
:mod:`.transpose` and :mod:`.fused`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

try:
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["HAS_TRITON", "launch", "triton_usable"]

HAS_TRITON = triton is not None


def triton_usable(t: Tensor) -> bool:
    """Triton is installed and ``t`` lives where it runs (CUDA, or CPU under the interpreter)."""
    return HAS_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def launch(kernel: Any, grid: tuple[int, ...], t: Tensor, *args: object, **meta: object) -> None:
    """Launch ``kernel`` on ``t``'s device (Triton launches on the current CUDA device)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        with torch.cuda.device(t.device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)
