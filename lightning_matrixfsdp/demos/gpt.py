"""A small GPT-style decoder for the pre-training example.

Written as an ordinary LightningModule on purpose: no ``configure_model`` and no
sharding calls, so it shows that MatrixFSDPStrategy wraps unmodified modules itself
(each entry of ``blocks`` is the natural unit). The blocks' weight matrices are plain 2D
``nn.Linear`` parameters, which is what Muon trains; the optimizer is built from the module
(``Muon(self, ...)``), so the embeddings and the head go to AdamW (the Muon recipe) under every
strategy alike, and LayerNorm parameters and biases form each unit's AdamW tail.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lightning_matrixfsdp.adapters.pipeline import forward_loss
from lightning_matrixfsdp.demos.schedule import WarmupCosine  # noqa: F401  (its import path before schedule.py)
from lightning_matrixfsdp.demos.schedule import fit_schedules_to_trainer, warmup_cosine


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention; the fused qkv matrix is one Muon role."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Position-wise feed-forward: two matrices with a GELU between."""

    def __init__(self, d_model: int, hidden: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.proj = nn.Linear(hidden, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block; the strategy's default wrap unit."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, bias)
        self.ln2 = nn.LayerNorm(d_model, bias=bias)
        self.mlp = MLP(d_model, mlp_ratio * d_model, dropout, bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class GPT(LightningModule):
    """Decoder-only language model trained with ``lightning_matrixfsdp.Muon``.

    Args:
        vocab_size: 256 for the byte-level data module.
        max_seq_len: size of the learned position table (>= the data's seq_len).
        d_model, n_layers, n_heads, mlp_ratio, dropout, bias: architecture.
        lr: Muon learning rate for the matrices.
        adamw_lr: AdamW learning rate for the non-matrix tail (norms, biases).
        weight_decay: decoupled weight decay for both.
        warmup_steps: linear warmup length in optimizer steps.
        lr_schedule: ``"cosine"`` (decay over the run's stepping batches, which a resumed
            run with a larger ``max_steps`` extends) or ``"constant"``.
        min_lr_ratio: floor of the cosine decay, as a fraction of the peak.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        max_seq_len: int = 256,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 0.02,
        adamw_lr: Optional[float] = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        lr_schedule: Literal["cosine", "constant"] = "cosine",
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio, dropout, bias) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, bias=bias)
        self.head = nn.Linear(d_model, vocab_size, bias=False)  # untied: its own role (AdamW by default: the output head)
        self.apply(self._init_weights)
        # Scaled init of the residual projections keeps the residual stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))
        self.val_nll = MeanMetric()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids ``(B, T)`` -> next-token logits ``(B, T, vocab)``."""
        t = idx.size(1)
        if t > self.hparams.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.hparams.max_seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss_fn(self, logits: Tensor, y: Tensor) -> Tensor:
        """The mean next-token cross-entropy of ``logits`` (float32) against ``y``."""
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        # forward_loss: self.loss_fn(self(x), y), or the pipeline's schedule (docs/pipeline-parallel.md)
        loss = forward_loss(self, *batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", loss.detach().exp(), prog_bar=True)  # the batch's perplexity: exp of its mean loss
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = forward_loss(self, *batch)
        self.val_nll.update(loss.detach(), weight=batch[1].numel())
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        # perplexity over every validation token: exp of their mean loss (summed over the ranks)
        self.log("val_ppl", self.val_nll.compute().exp(), prog_bar=True)
        self.val_nll.reset()

    def _optimizer(self) -> torch.optim.Optimizer:
        hp = self.hparams
        try:
            from lightning_matrixfsdp import Muon  # lazy: the optimizer package is optional at import time
        except ImportError:
            rank_zero_warn("lightning_matrixfsdp.Muon is not importable; GPT falls back to torch.optim.AdamW")
            lr = hp.adamw_lr if hp.adamw_lr is not None else hp.lr
            return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=hp.weight_decay)
        # Built from the module: the Muon recipe's param groups, the same under DDP and matrix_fsdp.
        return Muon(self, lr=hp.lr, weight_decay=hp.weight_decay, adamw_lr=hp.adamw_lr)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return warmup_cosine(self._optimizer(), self.trainer, hp.warmup_steps, hp.lr_schedule, hp.min_lr_ratio)

    def on_train_start(self) -> None:
        # A resumed run restored the saved schedule's length; a larger max_steps must extend it.
        fit_schedules_to_trainer(self.trainer)


class TensorParallelGPT(GPT):
    """The demo GPT with a Llama-style tensor-parallel plan applied in ``configure_model``.

    Needs ``MatrixFSDPStrategy(tensor_parallel_size=T)`` (``self.device_mesh`` is Lightning's
    ``(data_parallel, tensor_parallel)`` mesh). The MLP's first matrix is split colwise and its
    second rowwise (the activation stays split between them). The fused ``qkv`` keeps q, k and v
    one after another, so a colwise split would hand a TP rank parts of q and k instead of whole
    heads: its output is gathered (``output_layouts=Replicate()``) before the heads are formed,
    and the projection takes the full activation. Embeddings, norms and the head stay replicated.
    """

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in tuple(mesh.mesh_dim_names or ()):
            return  # no tensor parallelism: the strategy shards the plain model
        if getattr(self, "_tp_applied", False):  # idempotent: WeightAveraging's setup calls it before the Trainer
            return
        plan = {
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
            "attn.qkv": ColwiseParallel(output_layouts=Replicate()),
            "attn.proj": RowwiseParallel(input_layouts=Replicate()),
        }
        for block in self.blocks:
            parallelize_module(block, mesh["tensor_parallel"], plan)
        self._tp_applied = True
