"""The fused elementwise kernels of the Muon step (``optim/fused.py``).

On CPU the public functions are torch's own ops (checked bitwise here). The Triton
kernels run here under the Triton interpreter (where Triton is installed): the
momentum kernel against PyTorch's lerp formula evaluated op by op in float32 (the
interpreter does not contract multiply-adds, so that is what it must equal), the
division against torch's ``div_`` (IEEE division on both sides). float32 and float16
only: the interpreter casts to bfloat16 by truncation where the GPU rounds to nearest.
Bitwise equality with torch's CUDA kernels, bfloat16 included, is a GPU measurement
(scripts/tune_owner_step.py, docs/benchmarks.md).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_matrixfsdp.optim.fused import decay_add_, divide_, divide_each_, momentum_update

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_update_on_cpu_is_torchs_lerps(dtype, nesterov):
    torch.manual_seed(0)
    g, b = torch.randn(37, 53).to(dtype), torch.randn(37, 53).to(dtype)
    ours_b, ref_b = b.clone(), b.clone()
    update = momentum_update(g, ours_b, 0.95, nesterov)
    ref_b.lerp_(g, 1 - 0.95)
    ref = g.lerp(ref_b, 0.95) if nesterov else ref_b
    assert torch.equal(ours_b, ref_b) and torch.equal(update, ref)
    if not nesterov:  # torch's update *is* the buffer (Newton-Schulz then scales it in place)
        assert update is ours_b


@pytest.mark.parametrize("transpose", [False, True])
def test_divide_on_cpu_is_torchs_div(transpose):
    x = torch.randn(40, 70).bfloat16()
    x = x.T if transpose else x
    d = x.norm().clamp(min=1e-7)
    ref = x.clone().div_(d)
    out = divide_(x, d)
    assert out is x and torch.equal(x, ref)


@pytest.mark.parametrize("decay", [1.0, 0.998])
@pytest.mark.parametrize("transposed", [False, True])
def test_decay_add_and_divide_each_on_cpu_are_torchs_ops(decay, transposed):
    """On CPU the expert stacks' fused update and batched division are torch's own ops."""
    torch.manual_seed(1)
    p = torch.randn(3, 40, 70)
    u = torch.randn(3, 70, 40).bfloat16().mT if transposed else torch.randn(3, 40, 70).bfloat16()
    ref = p.clone()
    if decay != 1:
        ref.mul_(decay)
    ref.add_(u, alpha=-0.02)
    assert decay_add_(p, u, decay, -0.02) is p and torch.equal(p, ref)
    x, d = u.clone() if not transposed else u.mT.clone().mT, torch.rand(3, 1, 1).bfloat16() + 0.5
    ref = x.clone().div_(d)
    assert divide_each_(x, d) is x and torch.equal(x, ref)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU torch)")
def test_kernels_under_the_triton_interpreter():
    script = textwrap.dedent("""
        import numpy as np, torch
        from lightning_matrixfsdp.optim import fused

        def lerp32(s, e, w):  # ATen/native/Lerp.h, one rounding per op
            w = np.float32(w)
            return s + w * (e - s) if abs(w) < 0.5 else e - (e - s) * (np.float32(1) - w)

        torch.manual_seed(0)
        for dtype in (torch.float32, torch.float16):
            for mom in (0.95, 0.99, 0.5, 0.3, 0.0):
                for n in (1, 2047, 2048, 5000):
                    g, b = torch.randn(n).to(dtype), (3 * torch.randn(n)).to(dtype)
                    gf, bf = g.float().numpy(), b.float().numpy()
                    nb = torch.from_numpy(lerp32(bf, gf, 1 - mom)).to(dtype)
                    upd = torch.from_numpy(lerp32(gf, nb.float().numpy(), mom)).to(dtype)
                    buf = b.clone()
                    out = fused._fused_momentum(g, buf, mom)
                    assert out.dtype == dtype and out.shape == g.shape
                    assert torch.equal(buf, nb), (dtype, mom, n)
                    assert torch.equal(out, upd), (dtype, mom, n)
        for dtype in (torch.float32, torch.float16):
            for shape in [(3,), (2048,), (70, 91)]:
                x = (torch.randn(shape) * 5).to(dtype)
                d = x.norm().clamp(min=1e-7)
                ref = x.clone().div_(d)
                fused._divide(x, d)
                assert torch.equal(x, ref), (dtype, shape)
        # expert stacks: the update written in a narrower dtype, one divisor per matrix, and the
        # weight decay and update in one pass (contiguous and transposed update); the interpreter
        # rounds a*b and the sum apart (Triton 3.6) or fuses them (3.9): held to an ulp or two
        g, b = torch.randn(5000), torch.randn(5000)
        ref = fused._fused_momentum(g, b.clone(), 0.95)
        out = fused._fused_momentum(g, b.clone(), 0.95, torch.float16)
        assert out.dtype == torch.float16 and torch.equal(out, ref.half())
        for dtype in (torch.float32, torch.float16):
            x, d = (torch.randn(3, 70, 91) * 5).to(dtype), (torch.rand(3, 1, 1) + 0.5).to(dtype)
            ref = x.clone().div_(d)
            fused._divide_each(x, d)
            assert torch.equal(x, ref), dtype
            for layout in ("plain", "transposed"):
                for decay in (1.0, 0.998):
                    p = torch.randn(3, 130, 70)
                    u = (torch.randn(3, 70, 130).to(dtype).mT if layout == "transposed"
                         else torch.randn(3, 130, 70).to(dtype))
                    ref = p.double() * torch.tensor(decay, dtype=torch.float32).item() if decay != 1 else p.double()
                    ref = (ref.float().double() + u.double() * torch.tensor(-0.02).item()).float()
                    assert fused._decay_add(p, u, decay, -0.02)
                    torch.testing.assert_close(p, ref, rtol=3e-7, atol=2e-8)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
