"""What the Trainer strategy reports: per-step telemetry and the model summary.

``StepTelemetry``: the strategy records a timestamp pair around every optimizer step and,
at the Trainer's logging interval, logs their mean, the megabytes each phase moved since
the last log, and the experts' load over the steps since then (``get_expert_stats``: the
only collective here, one small all-reduce of token counts at a log step, on every rank).

``MatrixFSDPSummary``: Lightning's summary counts local ``numel``; owner placeholders are
empty, so it would under-report on every rank but the owners. Counts here come from the
placement metadata (the global shape) of each resident parameter.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional

import torch
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary, ModelSummary
from torch import nn

from lightning_matrixfsdp.runtime import get_comm_stats, get_expert_stats
from lightning_matrixfsdp.runtime.queries import expert_stats_of, stage_comm_stats
from lightning_matrixfsdp.runtime.comm.small import gather_objects
from lightning_matrixfsdp.runtime.tags import expert_slice_of, global_numel, is_stage, pipelines_in, shard_of

__all__ = ["MatrixFSDPLayerSummary", "MatrixFSDPSummary", "StepTelemetry"]

#: Optimizer-step timings kept between two metric logs (older ones are dropped).
MAX_TIMED_STEPS = 1000


class StepTelemetry:
    """Optimizer-step times and per-phase traffic, logged as ``matrix_fsdp/*`` metrics."""

    def __init__(self) -> None:
        self._marks: list[tuple[Any, Any]] = []  # (start, end) of recent optimizer steps
        self._last_stats: dict[Any, dict[str, dict[str, int]]] = {}  # counters at the last log, per root / stage
        self._start: Any = None  # the running step's start, set when its closure returned
        self._steps = 0  # optimizer steps since the last log (the experts' per-step figures)

    def timed_closure(self, closure: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
        """``closure`` (forward and backward), marking the start of the optimizer's own step when it returns."""
        self._start = None

        def timed() -> Any:
            out = closure()
            self._start = self.clock(device)
            return out

        return timed

    def end_step(self, device: torch.device) -> None:
        """The optimizer step of the last ``timed_closure`` returned (nothing if its closure never ran)."""
        if self._start is not None:
            self.record_step(self._start, self.clock(device))
            self._start = None

    @staticmethod
    def clock(device: torch.device) -> Any:
        """A timestamp: a CUDA event on the current stream (no device-wide synchronization; it
        is read when metrics are logged), or the host clock on CPU, where ops are synchronous."""
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def record_step(self, start: Any, end: Any) -> None:
        self._marks.append((start, end))
        del self._marks[:-MAX_TIMED_STEPS]  # bounded when nothing logs them

    @staticmethod
    def _elapsed_ms(start: Any, end: Any) -> float:
        if isinstance(start, torch.cuda.Event):
            end.synchronize()  # waits for this step's optimizer kernels only
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def log(self, trainer: Any, roots: Iterable[nn.Module], global_zero: bool) -> None:
        """Log at the Trainer's interval. Call on every rank after each optimizer step: the experts'
        counts are summed over the world at a log step; rank 0 (``global_zero``) logs. Under
        pipeline parallelism (``roots``: this rank's stages) also each stage's traffic, as
        ``matrix_fsdp/stage<k>/<phase>_MB`` (the stage's lowest rank's, gathered at the log step)."""
        self._steps += 1
        if trainer is None or trainer.logger is None:
            return
        step = trainer.global_step
        if trainer.log_every_n_steps <= 0 or (step + 1) % trainer.log_every_n_steps:
            return
        roots = list(roots)
        pipelined = any(is_stage(r) for r in roots)
        metrics: dict[str, float] = {}
        # collective, the same on every rank (the same model, the same interval)
        if pipelined:  # every stage's experts, each counted over its own stage's ranks
            metrics.update(expert_stats_of(roots, steps=self._steps))
        else:
            for root in roots:
                metrics.update(get_expert_stats(root, steps=self._steps))
        stages = stage_comm_stats(roots) if pipelined else {}
        self._steps = 0
        if not global_zero:
            self._marks = []
            return
        if self._marks:
            times = [self._elapsed_ms(a, b) for a, b in self._marks]
            metrics["matrix_fsdp/optimizer_step_ms"] = sum(times) / len(times)
            self._marks = []
        for i, root in enumerate(roots):  # this rank's traffic, summed over its roots
            self._add_moved(metrics, "matrix_fsdp/", ("root", i), get_comm_stats(root))
        for index, now in stages.items():
            self._add_moved(metrics, f"matrix_fsdp/stage{index}/", ("stage", index), now)
        trainer.logger.log_metrics(metrics, step=step)

    def _add_moved(self, metrics: dict[str, float], prefix: str, key: Any, now: dict[str, dict[str, int]]) -> None:
        """Add the megabytes each phase moved since the last log of the counters ``key``."""
        last = self._last_stats.get(key, {})
        for phase, d in now.items():
            prev = last.get(phase, {"sent": 0, "recv": 0})
            moved = d["sent"] + d["recv"] - prev["sent"] - prev["recv"]
            metrics[f"{prefix}{phase}_MB"] = metrics.get(f"{prefix}{phase}_MB", 0.0) + moved / 2**20
        self._last_stats[key] = now


# ---------------------------------------------------------------- model summary
def whole_counts(model: nn.Module) -> dict[int, int]:
    """Under pipeline parallelism: id(parameter) -> its whole element count, for every parameter of
    ``model`` (the stage that holds one knows it; this rank keeps the others' emptied), gathered over
    the world by name; ``{}`` without (then local). Collective under pipeline parallelism."""
    if not pipelines_in(model):
        return {}
    mine = {n: global_numel(p) for n, p in model.named_parameters()
            if shard_of(p) is not None or expert_slice_of(p) is not None or p.numel()}
    whole: dict[str, int] = {}
    for rows in gather_objects(mine):
        for n, count in rows.items():
            whole[n] = max(whole.get(n, 0), count)
    return {id(p): whole.get(n, p.numel()) for n, p in model.named_parameters()}


class MatrixFSDPLayerSummary(LayerSummary):
    def __init__(self, module: nn.Module, counts: Optional[dict[int, int]] = None) -> None:
        super().__init__(module)
        self._counts = counts or {}

    @property
    def num_parameters(self) -> int:
        return sum(self._counts.get(id(p), global_numel(p)) for p in self._module.parameters())


class MatrixFSDPSummary(ModelSummary):
    """Lightning's summary with whole parameter counts (under pipeline parallelism every stage's,
    gathered: the summary is built on every rank, in ``on_fit_start``)."""

    def __init__(self, model: Any, max_depth: int = 1) -> None:
        self._counts = whole_counts(model)
        super().__init__(model, max_depth=max_depth)

    def summarize(self) -> "OrderedDict[str, LayerSummary]":  # type: ignore[override]
        summary = OrderedDict((name, MatrixFSDPLayerSummary(module, self._counts))
                              for name, module in self.named_modules)
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for k in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[k]
        return summary

    def _whole(self, p: nn.Parameter) -> int:
        return self._counts.get(id(p), global_numel(p))

    @property
    def total_parameters(self) -> int:
        return sum(self._whole(p) for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return sum(self._whole(p) for p in self._model.parameters() if p.requires_grad)
