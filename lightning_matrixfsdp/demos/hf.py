"""A Hugging Face causal language model as a LightningModule, for ``examples/finetune_hf.py``.

The model is built from a config (``AutoConfig.for_model``: no download) or, with
``pretrained=``, loaded by ``from_pretrained`` (a local directory or a hub name). It trains
on the byte-level data of :class:`~lightning_matrixfsdp.demos.data.ByteTextDataModule`
(vocabulary 256) with ``lightning_matrixfsdp.Muon`` and the demos' warmup-cosine schedule.
``transformers`` is imported when a module is built, so the demos import without it.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_matrixfsdp.checkpoint.pretrained import load_pretrained, meta_init
from lightning_matrixfsdp.demos.data import VOCAB_SIZE
from lightning_matrixfsdp.demos.schedule import fit_schedules_to_trainer, warmup_cosine
from lightning_matrixfsdp.optim.muon import Muon

INSTALL_HINT = "pip install 'lightning-matrixfsdp[hf]'"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"HFCausalLM needs Hugging Face transformers: {INSTALL_HINT}") from err
    return transformers


class HFCausalLM(LightningModule):
    """A Hugging Face ``*ForCausalLM`` trained on byte tokens with ``lightning_matrixfsdp.Muon``.

    Args:
        model_type: a transformers model type (``"llama"``, ``"gpt2"``, ``"mistral"``, ...).
        config: keyword arguments of that model's config (sizes, ``tie_word_embeddings``);
            ``vocab_size`` defaults to 256, the byte vocabulary. With ``pretrained``, they
            override the saved config.
        pretrained: a directory written by ``save_pretrained`` or a hub name; ``None``
            builds a randomly initialized model from ``config``.
        empty_init: with ``pretrained`` (a local directory), build the model from its config
            with the parameters on the meta device and let each rank read only the tensors it
            owns at the start of ``fit`` (``load_pretrained``), instead of ``from_pretrained``
            on every rank. The same weights, bit for bit.
        lr: Muon learning rate for the matrices.
        adamw_lr: AdamW learning rate for the non-matrix tail (norms, biases).
        weight_decay: decoupled weight decay for both.
        warmup_steps, lr_schedule, min_lr_ratio: the schedule, as in ``demos.GPT``.

    The config's ``use_cache`` is turned off: a KV cache is for generation. In training it
    grows again each time activation checkpointing recomputes a layer, and with
    transformers up to 5.3 torch's checkpoint then fails ("Recomputed values ... have
    different metadata"); see docs/huggingface.md.
    """

    def __init__(
        self,
        model_type: str = "llama",
        config: Optional[dict[str, Any]] = None,
        pretrained: Optional[str] = None,
        empty_init: bool = False,
        lr: float = 0.02,
        adamw_lr: Optional[float] = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 5,
        lr_schedule: Literal["cosine", "constant"] = "cosine",
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        transformers = _transformers()
        overrides = dict(config or {})
        if pretrained is not None and empty_init:
            with meta_init():
                hf_config = transformers.AutoConfig.from_pretrained(pretrained, **overrides)
                self.model = transformers.AutoModelForCausalLM.from_config(hf_config)
        elif pretrained is not None:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, **overrides)
        else:
            overrides.setdefault("vocab_size", VOCAB_SIZE)
            hf_config = transformers.AutoConfig.for_model(model_type, **overrides)
            self.model = transformers.AutoModelForCausalLM.from_config(hf_config)
        self.model.config.use_cache = False

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` -> next-token logits ``(B, T, vocab)``."""
        return self.model(input_ids=idx, use_cache=False).logits

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch  # y is x shifted by one token already: no shift here
        logits = self(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer: torch.optim.Optimizer = Muon(  # the Muon recipe's groups, alike under every strategy
            self, lr=hp.lr, weight_decay=hp.weight_decay, adamw_lr=hp.adamw_lr)
        return warmup_cosine(optimizer, self.trainer, hp.warmup_steps, hp.lr_schedule, hp.min_lr_ratio)

    def on_fit_start(self) -> None:
        hp = self.hparams
        if hp.pretrained is not None and hp.empty_init and self.trainer.ckpt_path is None:  # a resume loads its own
            load_pretrained(self, hp.pretrained, prefix="model.")

    def on_train_start(self) -> None:
        fit_schedules_to_trainer(self.trainer)  # a resumed run with a larger max_steps extends the schedule
