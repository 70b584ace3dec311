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
    with ``fit(ckpt_path=...)`` skips the read: the checkpoint's weights are loaded after
    ``on_fit_start`` and would replace these anyway."""

    def __init__(self, path: str, prefix: str = "", strict: bool = True) -> None:
        self.path, self.prefix, self.strict = path, prefix, strict
        self.loaded: Optional[PretrainedLoad] = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path is not None:
            return
        self.loaded = load_pretrained(pl_module, self.path, prefix=self.prefix, strict=self.strict)

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing to resume: the weights come back from the checkpoint itself
