"""A Hugging Face causal language model as a LightningModule, for ``examples/finetune_hf.py``.

The model is built from a config (``AutoConfig.for_model``: no download) or, with
``pretrained=``, loaded by ``from_pretrained`` (a local directory or a hub name). It trains
on the byte-level data of :class:`~lightning_matrixfsdp.demos.data.ByteTextDataModule`
(vocabulary 256) with ``lightning_matrixfsdp.Muon`` and the demos' warmup-cosine schedule.
``transformers`` is imported when a module is built, so the demos import without it.

Mixture-of-experts models: when the config asks for the router outputs
(``output_router_logits=True``), the training loss is Hugging Face's own: the cross-entropy plus
``router_aux_loss_coef`` times the model's load-balancing loss (``outputs.aux_loss``), and plus
``router_z_loss_coef`` times a router z-loss where the model reports one. Each is logged on its
own, unscaled, beside ``train_loss`` (``train_aux_loss``, ``train_z_loss``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_matrixfsdp.adapters.pipeline import forward_loss
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

    With ``output_router_logits=True`` in the config (a mixture-of-experts model), ``train_loss``
    is Hugging Face's ``outputs.loss`` for these labels: the cross-entropy plus
    ``router_aux_loss_coef * outputs.aux_loss`` (and ``router_z_loss_coef * outputs.z_loss``
    where the model has one), and ``train_aux_loss`` / ``train_z_loss`` log the unscaled terms.
    A model that returns no auxiliary loss although its config asks for the router outputs is
    refused at the first step, as is an auxiliary loss without its coefficient. Validation logs
    the cross-entropy alone (``val_loss``).

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

    def loss_fn(self, logits: Tensor, y: Tensor) -> Tensor:
        """The mean next-token cross-entropy of ``logits`` (float32) against ``y``."""
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """(the loss to train, the router losses it includes by name, unscaled)."""
        x, y = batch  # y is x shifted by one token already: no shift here
        if not getattr(self.model.config, "output_router_logits", False):
            return forward_loss(self, x, y), {}  # self.loss_fn(self(x), y), or the pipeline's schedule
        out = self.model(input_ids=x, use_cache=False)
        loss = self.loss_fn(out.logits, y)
        terms = router_losses(self.model, out)
        for value, coef in terms.values():  # Hugging Face's order: cross-entropy, then the router terms
            loss = loss + coef * value.to(loss.device)
        return loss, {name: value for name, (value, _) in terms.items()}

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, router = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        for name, value in router.items():
            self.log(f"train_{name}", value.detach().float())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", forward_loss(self, *batch), prog_bar=True, sync_dist=True)

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


#: router loss fields of a Hugging Face output -> the coefficient that scales them in its ``loss``
_ROUTER_TERMS = (("aux_loss", "router_aux_loss_coef"), ("z_loss", "router_z_loss_coef"))


def router_losses(model: Any, out: Any) -> dict[str, tuple[Tensor, float]]:
    """The router losses a Hugging Face causal LM adds to its ``loss`` when its config asks for the
    router outputs (``output_router_logits``): name -> (value, coefficient), the coefficient the
    model's own forward scales it by (the model's attribute, else its config's). Empty when the
    config does not ask. A model that asks but returns no auxiliary loss, or a loss without its
    coefficient, is refused: training would silently go without load balancing."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return {}
    terms: dict[str, tuple[Tensor, float]] = {}
    for name, coef_name in _ROUTER_TERMS:
        value = getattr(out, name, None)
        if value is None:
            continue
        coef = getattr(model, coef_name, None)
        coef = getattr(config, coef_name, None) if coef is None else coef
        if coef is None:
            raise ValueError(f"{type(model).__name__} returned a router {name} but neither it nor its config has "
                             f"{coef_name}: set {coef_name} in the config")
        if not isinstance(value, Tensor):  # Hugging Face returns 0 where no router ran
            value = torch.zeros((), device=out.logits.device)
        terms[name] = (value, float(coef))
    if "aux_loss" not in terms:
        raise ValueError(f"the config of {type(model).__name__} sets output_router_logits=True (a load-balancing "
                         "loss) but the model returned no aux_loss; this model type computes none in the installed "
                         "transformers: set output_router_logits=False, or add the loss yourself in training_step")
    return terms
