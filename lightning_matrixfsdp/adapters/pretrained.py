"""``PretrainedWeights``: the Trainer callback that loads pretrained weights into the owners.

A LightningModule builds its model with the parameters on the meta device
(``lightning_matrixfsdp.meta_init()`` in ``__init__`` or ``configure_model``); the strategy
shards it at setup; this callback then reads each rank's owned tensors from the files
(``checkpoint/pretrained.py``). As a callback it can be named in a YAML config.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_matrixfsdp.checkpoint.pretrained import PretrainedLoad, load_pretrained

__all__ = ["PretrainedWeights"]


class PretrainedWeights(Callback):
    """Load ``path`` (a Hugging Face directory or ``.safetensors`` file, or a checkpoint of this
    library) into the sharded LightningModule at the start of ``fit``, before the first step.

    ``prefix``: put in front of every file key (``"model."`` when the module holds the Hugging
    Face model as ``self.model``). ``strict``: missing or unexpected keys raise. A run resumed
    with ``fit(ckpt_path=...)`` skips the read (the file need not exist any more): the
    checkpoint's weights replace these anyway.

    When: in ``on_fit_start`` under strategies that restore a checkpoint before it. Strategies
    built on ``ModelParallelStrategy`` (``MatrixFSDPStrategy``) restore after ``on_fit_start``,
    and only then does ``trainer.ckpt_path`` say whether the fit resumes, so the read waits for
    the first hook after the restore: ``on_sanity_check_start``, else ``on_train_start``
    (still before any validation or training step)."""

    def __init__(self, path: str, prefix: str = "", strict: bool = True) -> None:
        self.path, self.prefix, self.strict = path, prefix, strict
        self.loaded: Optional[PretrainedLoad] = None
        self._due = False  # a fit started and the read is neither done nor skipped yet

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._due = True
        if not trainer.strategy.restore_checkpoint_after_setup:  # the resume is known by now
            self._load(trainer, pl_module)

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._load(trainer, pl_module)

    def _load(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._due:
            return
        self._due = False
        if trainer.ckpt_path is None:
            self.loaded = load_pretrained(pl_module, self.path, prefix=self.prefix, strict=self.strict)

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing to resume: the weights come back from the checkpoint itself
