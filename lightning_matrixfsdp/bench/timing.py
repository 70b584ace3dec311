"""Phase timing and memory probes.

Each phase boundary synchronizes the device, so a phase's time contains all the
kernels and collectives it launched (asynchronous work cannot leak into the
next phase). On CUDA the interval is read from CUDA events recorded right
before each synchronize; on CPU from `time.perf_counter`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PHASES: tuple[str, ...] = ("zero_grad", "forward", "backward", "optimizer_step")


def synchronize(device: torch.device) -> None:
    """Wait for all queued device work (no-op on CPU, where ops are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` after ``warmup`` calls (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize(device)
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return sorted(out)[len(out) // 2]


def matmul_tflops(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """bf16 rate of one ``n^3`` matmul on ``device``: the ceiling behind the Newton-Schulz FLOP floor."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / (median_ms(lambda: a @ b, device, reps) * 1e-3) / 1e12


def ns_matmuls(mats: list[torch.Tensor], steps: int = 5) -> None:
    """torch.optim.Muon's Newton-Schulz products (default coefficients) on each (wide, bf16) matrix and
    nothing else: the baseline the experts' step is timed beside."""
    a, b, c = 3.4445, -4.7750, 2.0315
    for x in mats:
        for _ in range(steps):
            g = x @ x.mT
            y = torch.addmm(g, g, g, beta=b, alpha=c)
            x = torch.addmm(x, y, x, beta=a)


def rss_bytes() -> int | None:
    """Current resident set size of this process, or None where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class MemoryProbe:
    """Peak memory of this rank over a measured window.

    CUDA: `torch.cuda.max_memory_allocated` (reset at `start`). CPU: the largest
    RSS sampled at phase boundaries (process-wide, so it includes the Python
    runtime and allocator caches; comparable between modes only roughly).
    """

    device: torch.device
    peak_rss: int = 0

    @property
    def kind(self) -> str:
        return "cuda_max_allocated" if self.device.type == "cuda" else "cpu_rss_sampled"

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak_rss = 0
        self.sample()

    def sample(self) -> None:
        if self.device.type != "cuda":
            rss = rss_bytes()
            if rss is not None:
                self.peak_rss = max(self.peak_rss, rss)

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak_rss or None


@dataclass
class PhaseTimer:
    """Times consecutive phases of one training step, in milliseconds."""

    device: torch.device
    memory: MemoryProbe | None = None
    times_ms: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        self.times_ms = {}
        synchronize(self.device)
        self._t = time.perf_counter()
        if self.device.type == "cuda":
            self._ev = torch.cuda.Event(enable_timing=True)
            self._ev.record()

    def mark(self, phase: str) -> None:
        """End the current phase (named `phase`) and start the next one."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            synchronize(self.device)
            self.times_ms[phase] = self._ev.elapsed_time(ev)
            self._ev = ev
        else:
            now = time.perf_counter()
            self.times_ms[phase] = (now - self._t) * 1e3
            self._t = now
        if self.memory is not None:
            self.memory.sample()

    def row(self) -> list[float]:
        """[zero_grad, forward, backward, optimizer_step, total] for this step."""
        vals = [self.times_ms.get(p, 0.0) for p in PHASES]
        return vals + [sum(vals)]


def median_rows(rows: list[list[float]]) -> list[float]:
    """Column-wise median over steps."""
    if not rows:
        return []
    return [statistics.median(col) for col in zip(*rows)]
