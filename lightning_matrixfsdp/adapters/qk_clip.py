"""``QKClip``: the Trainer callback for QK-Clip (Kimi K2's MuonClip), under any strategy.

At the start of ``fit`` it attaches a :class:`~lightning_matrixfsdp.qkclip.QKClipper` to the
LightningModule (after the strategy has sharded or parallelized it) and registers a step
post-hook on the optimizer that trains the attention's query/key tensors: the clip runs right
after that optimizer's ``step()``, before anything else sees the weights (weight averaging,
``replica_split``'s transfers, the next forward). Gradient accumulation steps once per
accumulated batch, and so does the clip. The same code and math run under DDP, one device,
and matrix_fsdp (with HSDP and tensor parallelism).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_matrixfsdp.optim.routing import full_params
from lightning_matrixfsdp.qkclip import QKClipError, QKClipper
from lightning_matrixfsdp.qkclip.clip import check_options

__all__ = ["QKClip"]


class QKClip(Callback):
    """Rescale each attention head's query and key weights after every optimizer step in which
    the head's largest pre-softmax logit exceeded ``tau`` (Kimi K2 used 100).

    ``log``: log ``qk_clip/max_logit`` (the step's largest logit over all heads) and
    ``qk_clip/clipped_heads`` every step. ``block_elements``: logits one block of the
    measurement holds (memory against kernel launches). docs/qk-clip.md has the rule."""

    def __init__(self, tau: float = 100.0, log: bool = True, block_elements: Optional[int] = None) -> None:
        check_options(tau, block_elements)
        self.tau, self.log, self.block_elements = tau, log, block_elements
        self.clipper: Optional[QKClipper] = None
        self._hook: Any = None
        self._pending: Optional[torch.Tensor] = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        kw = {} if self.block_elements is None else {"block_elements": self.block_elements}
        self.clipper = QKClipper(pl_module, self.tau, **kw)
        targets = {id(b.target.param) for b in self.clipper.bound}
        holders = [i for i, opt in enumerate(trainer.optimizers) if targets & {id(p) for p in full_params(opt)}]
        if len(holders) > 1:
            self._detach()
            raise QKClipError(f"QK-Clip: the attention's query/key tensors are trained by optimizers {holders}; "
                              "QK-Clip rescales them after one optimizer's step: give them all to one optimizer")
        if not holders:
            self._detach()
            warnings.warn("QK-Clip: no optimizer trains the attention's query/key tensors; nothing to clip",
                          stacklevel=2)
            return
        self._hook = trainer.optimizers[holders[0]].register_step_post_hook(self._after_step)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        assert self.clipper is not None
        self._pending = self.clipper.step()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._pending is None or not self.log or self.clipper is None:
            return
        maxima, self._pending = self._pending, None
        pl_module.log("qk_clip/max_logit", maxima.max(), on_step=True, on_epoch=False)
        pl_module.log("qk_clip/clipped_heads", (maxima > self.clipper.tau).sum().float(), on_step=True,
                      on_epoch=False)

    def _detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.clipper is not None:
            self.clipper.remove()
            self.clipper = None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._detach()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._detach()
