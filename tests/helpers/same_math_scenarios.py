"""The same user code under ``strategy="ddp"`` and ``"matrix_fsdp"`` (issue 36, section 1).

Each scenario runs in a 2-process gloo group (``tests/helpers/dist.py``), trains one unchanged
LightningModule (or Fabric loop) under the strategy it is given, and returns its losses and
whole weights, so that ``tests/test_same_math.py`` can compare the two strategies. The
optimizer is built as the docs say: ``Muon(self, ...)`` (the Muon recipe from the module), or
over bare ``self.parameters()`` (by shape) to show that those mean the same everywhere too.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from helpers.lit import gather_full

VOCAB, SEQ, STEPS = 48, 8, 3


def tokens(n: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(11))


# ------------------------------------------------------------------ models, as users build them
def demo_gpt() -> nn.Module:
    from lightning_matrixfsdp.demos import GPT

    return GPT(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=2, warmup_steps=0)


def hf_llama_tied() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                        max_position_embeddings=SEQ, use_cache=False))


def hf_qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=False))


def litgpt_gpt() -> nn.Module:
    from litgpt import GPT, Config

    return GPT(Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16,
                      bias=False, rotary_percentage=1.0, parallel_residual=False))


MODELS: dict[str, Callable[[], nn.Module]] = {"demo_gpt": demo_gpt, "hf_llama_tied": hf_llama_tied,
                                              "hf_qwen3_moe": hf_qwen3_moe, "litgpt": litgpt_gpt}


def logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


class SameCode(LightningModule):
    """One user's module: a causal LM, its loss, and Muon built from the module (or bare)."""

    def __init__(self, model: str, bare: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = MODELS[model]()
        self.bare = bare
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:  # noqa: D102
        x, y = batch[:, :-1], batch[:, 1:]
        loss = F.cross_entropy(logits_of(self.net(x)).flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):  # noqa: D102
        return torch.utils.data.DataLoader(tokens(), batch_size=2)

    def configure_optimizers(self):  # noqa: D102
        import lightning_matrixfsdp as mf

        return mf.Muon(self.parameters() if self.bare else self, lr=0.02, adamw_lr=3e-3)


def tp_gpt_module(batch_size: int) -> LightningModule:
    """The demo's tensor-parallel GPT as a user trains it (its plan applies only under a
    tensor-parallel mesh; under DDP it is the plain GPT), recording its losses."""
    from lightning_matrixfsdp.demos.gpt import TensorParallelGPT

    class Recorded(TensorParallelGPT):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # noqa: D102
            loss = super().training_step(batch, batch_idx)
            self.recorded.append(loss.item())
            return loss

        def train_dataloader(self):  # noqa: D102
            t = tokens()
            return torch.utils.data.DataLoader(list(zip(t[:, :-1], t[:, 1:])), batch_size=batch_size)

    torch.manual_seed(0)
    lit = Recorded(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=2, warmup_steps=0)
    lit.recorded = []
    # float64: Muon's Newton-Schulz and AdamW's first steps turn gradient rounding noise in directions
    # whose gradient is zero (a key bias; a matrix's null directions) into whole-step differences, so
    # float32 runs with different summation orders drift apart; float64 keeps that noise at ~1e-12.
    return lit.double()


def tp_scenario(rank: int, world: int, strategy: str, model: str, bare: bool, options: dict) -> dict:
    """The same TP-ready module under DDP (two data-parallel ranks, one sample each per step) and
    under ``tensor_parallel_size=2`` (one data-parallel rank, both samples per step): the same
    samples per step, so the same math up to the summation order of the TP reductions."""
    lit = tp_gpt_module(batch_size=1 if strategy == "ddp" else 2)
    trainer = Trainer(accelerator="cpu", devices=world, strategy=_strategy(strategy, **options), max_steps=STEPS,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=os.environ.get("TMPDIR", "/tmp"))
    trainer.fit(lit)
    if strategy == "ddp":
        weights = {n: p.detach().clone() for n, p in lit.named_parameters()}
    else:
        import lightning_matrixfsdp as mf

        with mf.full_model(lit, rank=None) as whole:  # the public way to see every weight whole
            weights = {n: p.detach().clone() for n, p in whole.named_parameters()}
    return {"losses": lit.recorded, "weights": weights, "updates": {}}


def _strategy(name: str, **kw: Any) -> Any:
    if name == "ddp" or not kw:
        return name
    import lightning_matrixfsdp as mf

    return mf.MatrixFSDPStrategy(**kw)


def _weights(module: nn.Module, strategy: str) -> dict[str, torch.Tensor]:
    if strategy == "ddp":
        return {n: p.detach().clone() for n, p in module.named_parameters()}
    return gather_full(module)


def trainer_scenario(rank: int, world: int, strategy: str, model: str, bare: bool, options: dict) -> dict:
    """Fit :class:`SameCode` for a few steps under ``strategy``; losses, whole weights, and the
    update each parameter got (from the optimizer's groups)."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.optim.routing import full_param_groups

    lit = SameCode(model, bare)
    options = dict(options)
    clip = options.pop("gradient_clip_val", None)  # a Trainer option, for both strategies
    trainer = Trainer(accelerator="cpu", devices=world, strategy=_strategy(strategy, **options), max_steps=STEPS,
                      gradient_clip_val=clip,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=os.environ.get("TMPDIR", "/tmp"))
    trainer.fit(lit)
    opt = trainer.optimizers[0]
    names = {id(p): n for n, p in lit.named_parameters()}
    groups = full_param_groups(opt) if strategy != "ddp" else [g["params"] for g in opt.param_groups]
    updates = {names[id(p)]: mf.optim.muon.uses_muon(p, g) if p.numel() else None
               for g, ps in zip(opt.param_groups, groups) for p in ps}
    return {"losses": lit.losses, "weights": _weights(lit, strategy), "updates": updates}


def fabric_scenario(rank: int, world: int, strategy: str, model: str, bare: bool, options: dict) -> dict:
    """The same Fabric loop under ``strategy``: setup, Muon built from the module, a few steps."""
    import lightning_matrixfsdp as mf
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world, strategy=_strategy(strategy, **options))
    fabric.launch()  # in the pool's processes: joins the running group
    torch.manual_seed(0)
    net = fabric.setup_module(MODELS[model]())
    opt = fabric.setup_optimizers(mf.Muon(net.parameters() if bare else net, lr=0.02, adamw_lr=3e-3))
    data = tokens()[rank::world]
    losses = []
    for step in range(STEPS):
        batch = data[2 * step:2 * step + 2]
        loss = F.cross_entropy(logits_of(net(batch[:, :-1])).flatten(0, 1), batch[:, 1:].flatten())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    inner = net.module if hasattr(net, "module") else net
    return {"losses": losses, "weights": _weights(inner, strategy), "updates": {}}


def run(rank: int, world: int, kind: str, strategy: str, model: str, bare: bool, options: dict) -> dict:
    """One scenario; an exception comes back as text (the test prints it; the pool stays usable)."""
    try:
        fn = {"fabric": fabric_scenario, "tp": tp_scenario}.get(kind, trainer_scenario)
        return fn(rank, world, strategy, model, bare, options)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}
