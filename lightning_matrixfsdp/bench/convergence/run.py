"""One run of the convergence benchmark: its spec, the seeded model and optimizer, the
batch order fixed by the seed, validation, and the training loop."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_matrixfsdp.demos.gpt import GPT
from lightning_matrixfsdp.optim.muon import Muon

from .variants import CANDIDATE_SCHEDULES, candidate_muon, parse_orthogonalizer

__all__ = ["RunSpec", "batch_starts", "build", "device_name", "lm_loss", "train_run", "validate"]


@dataclass(frozen=True)
class RunSpec:
    """One training run: everything that determines its losses."""

    orthogonalizer: str
    lr: float
    seed: int
    steps: int = 1000
    d_model: int = 1024
    n_layers: int = 6
    n_heads: int = 16
    seq_len: int = 512
    batch_size: int = 16
    weight_decay: float = 0.01
    adamw_lr: float = 3e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    eval_every: int = 250
    val_batches: int = 40

    @property
    def name(self) -> str:
        return f"{self.orthogonalizer}_lr{self.lr:g}_s{self.seed}"


def build(spec: RunSpec, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The seeded model, its Muon (with the AdamW tail) and the warmup-cosine schedule."""
    torch.manual_seed(spec.seed)
    model = GPT(vocab_size=256, max_seq_len=spec.seq_len, d_model=spec.d_model, n_layers=spec.n_layers,
                n_heads=spec.n_heads).to(device)
    orthogonalizer, ns_steps, candidate = parse_orthogonalizer(spec.orthogonalizer)
    cls = Muon if candidate is None else candidate_muon(CANDIDATE_SCHEDULES[candidate])
    opt = cls(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, adjust_lr_fn="match_rms_adamw",
               adamw_lr=spec.adamw_lr, orthogonalizer=orthogonalizer, ns_steps=ns_steps)

    def factor(step: int) -> float:
        if step < spec.warmup:
            return (step + 1) / spec.warmup
        progress = min(1.0, (step - spec.warmup) / max(1, spec.steps - spec.warmup))
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def batch_starts(spec: RunSpec, n_tokens: int) -> torch.Tensor:
    """Window starts of every training batch, ``(steps, batch)``: a function of the seed only."""
    gen = torch.Generator().manual_seed(1_000_003 * spec.seed + 17)
    return torch.randint(0, n_tokens - spec.seq_len - 1, (spec.steps, spec.batch_size), generator=gen)


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = tokens[starts[:, None] + torch.arange(seq_len + 1, device=tokens.device)].long()
    return chunk[:, :-1], chunk[:, 1:]


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Next-byte cross-entropy, the forward under bf16 autocast, the loss in float32."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


@torch.no_grad()
def validate(model: torch.nn.Module, val: torch.Tensor, spec: RunSpec, device: torch.device) -> float:
    """Mean loss over the first ``val_batches`` non-overlapping windows of the validation text."""
    model.eval()
    n = min(spec.val_batches * spec.batch_size, (val.numel() - 1) // spec.seq_len)
    if n == 0:
        raise ValueError(f"validation text too short ({val.numel()} bytes) for seq_len={spec.seq_len}")
    starts = torch.arange(n, device=val.device) * spec.seq_len
    total = torch.zeros((), device=device)
    for i in range(0, n, spec.batch_size):
        x, y = _windows(val, starts[i:i + spec.batch_size], spec.seq_len)
        total += lm_loss(model, x, y, device) * x.size(0)
    model.train()
    return float(total / n)


def train_run(spec: RunSpec, corpus: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """One run: train ``spec.steps`` steps, return losses and timings (a JSON-able dict)."""
    model, opt, sched = build(spec, device)
    train, val = corpus["train"].to(device), corpus["val"].to(device)
    starts = batch_starts(spec, train.numel()).to(device)
    losses = torch.empty(spec.steps, device=device)
    evals: list[list[float]] = []
    t0 = time.perf_counter()
    for step in range(spec.steps):
        x, y = _windows(train, starts[step], spec.seq_len)
        loss = lm_loss(model, x, y, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        sched.step()
        losses[step] = loss.detach()
        if (step + 1) % spec.eval_every == 0 and step + 1 < spec.steps:
            evals.append([step + 1, validate(model, val, spec, device)])
    final = validate(model, val, spec, device)
    evals.append([spec.steps, final])
    wall = time.perf_counter() - t0
    train_losses = losses.tolist()
    return {"spec": asdict(spec), "name": spec.name, "train_loss": train_losses, "val_loss": evals,
            "final_val_loss": final, "final_train_loss": statistics.fmean(train_losses[-50:]),
            "finite": all(math.isfinite(v) for v in train_losses) and math.isfinite(final),
            "wall_s": wall, "ms_per_step_shared": 1e3 * wall / spec.steps,
            "params": sum(p.numel() for p in model.parameters()), "device": device_name(device),
            "torch": torch.__version__}


def device_name(device: torch.device) -> str:
    """The GPU's name, or ``"cpu"`` (recorded with every result)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
