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
from dataclasses import dataclass, field

import torch

PHASES: tuple[str, ...] = ("zero_grad", "forward", "backward", "optimizer_step")


def synchronize(device: torch.device) -> None:
    """Wait for all queued device work (no-op on CPU, where ops are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
