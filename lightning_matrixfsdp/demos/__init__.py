"""Example modules, data and callbacks used by ``examples/``; offline and CPU-friendly."""

from __future__ import annotations

import json
import math
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only

from lightning_matrixfsdp.demos.data import ByteTextDataModule, TokenWindows, decode, encode
from lightning_matrixfsdp.demos.finetune import LocalTokenDataModule
from lightning_matrixfsdp.demos.gpt import GPT, TensorParallelGPT
from lightning_matrixfsdp.demos.hf import HFCausalLM

REPORT_PREFIX = "[matrixfsdp-demo]"

__all__ = [
    "GPT",
    "HFCausalLM",
    "LossPrinter",
    "REPORT_PREFIX",
    "ByteTextDataModule",
    "LocalTokenDataModule",
    "OptimizerReport",
    "TensorParallelGPT",
    "TokenWindows",
    "decode",
    "encode",
]


def _class_path(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _optimizer_chain(optimizer: object) -> list[str]:
    """Class paths of an optimizer and of any optimizer it wraps (routing wrappers, Lightning's)."""
    chain: list[str] = []
    seen: set[int] = set()
    current: Optional[object] = optimizer
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(_class_path(current))
        inner = None
        for attr in ("_optimizer", "optimizer", "inner", "base_optimizer"):
            candidate = getattr(current, attr, None)
            if isinstance(candidate, torch.optim.Optimizer):
                inner = candidate
                break
        current = inner
    return chain


class OptimizerReport(Callback):
    """Records which optimizer actually stepped and the loss, so runs can be checked.

    Why a callback: with ``--optimizer`` or the strategy's ``optimizer=`` option the
    module's own ``configure_optimizers`` is replaced, so reading the module's code
    does not tell what trained. At the end rank 0 prints one line
    ``[matrixfsdp-demo] {json}`` (optimizer class paths, steps, last loss) and the
    optimizer class is logged as a hyper-parameter.

    Args:
        loss_key: also log the training-step loss under this name when the module
            does not log it itself (LightningTransformer only returns it), so the
            progress bar and TensorBoard show it. ``None`` disables.
    """

    def __init__(self, loss_key: Optional[str] = "train_loss") -> None:
        self.loss_key = loss_key
        self.optimizers: list[str] = []
        self.steps = 0
        self.last_loss: Optional[float] = None
        self.finite = True
        self._module_logs_loss: Optional[bool] = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.steps += 1
        for name in _optimizer_chain(optimizer):
            if name not in self.optimizers:
                self.optimizers.append(name)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        value = float(loss.detach())
        self.last_loss = value
        self.finite = self.finite and math.isfinite(value)
        if self.loss_key is None:
            return
        if self._module_logs_loss is None:  # decided once, on the first batch
            self._module_logs_loss = self.loss_key in trainer.callback_metrics
        if not self._module_logs_loss:
            pl_module.log(self.loss_key, loss.detach(), prog_bar=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._report(trainer)

    @rank_zero_only
    def _report(self, trainer: Trainer) -> None:
        summary = {
            "optimizer": self.optimizers[0] if self.optimizers else None,
            "optimizer_chain": self.optimizers,
            "strategy": _class_path(trainer.strategy),
            "world_size": trainer.world_size,
            "steps": self.steps,
            "last_loss": self.last_loss,
            "finite": self.finite,
        }
        for logger in trainer.loggers:
            logger.log_hyperparams({"optimizer": str(summary["optimizer"]), "strategy": summary["strategy"]})
        # Leading newline: the progress bar leaves its line open on stdout.
        print(f"\n{REPORT_PREFIX} {json.dumps(summary)}", flush=True)


class LossPrinter(Callback):
    """Prints ``step N  train_loss X`` on rank 0 after the first step, every ``every`` steps and the last.

    For runs without a progress bar (scripts, logs of batch jobs). The loss is the
    training-step loss of rank 0's batch, as the progress bar shows it.
    """

    def __init__(self, every: int = 5) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self._printed = -1  # last step printed: accumulation ends several batches on one step

    @rank_zero_only
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        step = trainer.global_step  # optimizer steps done
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        if not isinstance(loss, torch.Tensor) or step == self._printed or not (step == 1 or step % self.every == 0 or last):
            return
        self._printed = step
        print(f"{REPORT_PREFIX} step {step:4d}  train_loss {float(loss.detach()):.4f}", flush=True)

    @rank_zero_only
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        val = float(trainer.callback_metrics["val_loss"])
        print(f"{REPORT_PREFIX} step {trainer.global_step:4d}  val_loss {val:.4f}", flush=True)
