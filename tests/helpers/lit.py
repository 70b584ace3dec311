"""Lightning-side test helpers: a LightningModule around TinyLM and a Trainer worker with its oracle."""
from __future__ import annotations

import copy
import os
import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer

from helpers.models import TinyLM, lm_loss
from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS, allreduce_mean_grads, clip_global_norm, oracle_optimizers


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, vocab: int = 64, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class LitTiny(LightningModule):  # noqa: D101
    """Records every batch and loss it sees, so the oracle can replay them."""

    def __init__(self, optimizer: str = "muon", scheduler: bool = False, **model_kw: Any) -> None:
        super().__init__()
        self.model = TinyLM(**model_kw)
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.seen: list[torch.Tensor] = []
        self.route: Any = None
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:  # noqa: D102
        if self.route is not None:  # data-dependent experts: per rank and step
            for i, blk in enumerate(self.model.blocks):
                blk.route = self.route(len(self.seen), self.global_rank, i)
        loss = lm_loss(self.model(batch), batch)
        self.seen.append(batch.detach().clone())
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.model(batch), batch)
        self.log("val_loss", loss)
        return loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(TokenData(), batch_size=2)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(TokenData(8), batch_size=2)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":  # an "existing" module; the strategy may replace this
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
        else:
            import lightning_matrixfsdp as mf

            a = ADAMW_DEFAULTS
            # from the module (the Muon recipe's two groups), or "muon_bare": one group, by shape
            opt = mf.Muon(self.parameters() if self.optimizer_name == "muon_bare" else self, adamw_betas=a["betas"], adamw_eps=a["eps"], **MUON_DEFAULTS)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, SCHEDULES[self.scheduler])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def schedule(step: int) -> float:
    return 0.5 ** step


def warmup(step: int) -> float:  # a factor other than 1 at step 0
    return (step + 1) / 4


SCHEDULES = {True: schedule, "warmup": warmup}


class SelfShardingLitTiny(LitTiny):
    """Calls matrix_shard itself in configure_model, like fully_shard with FSDP2."""

    def configure_model(self) -> None:
        import lightning_matrixfsdp as mf

        if not mf.is_matrix_sharded(self):
            mf.matrix_shard(self, mesh=self.device_mesh, planner="scope_greedy")


def gather_full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        shard = getattr(p, "_mfsdp_shard", None)
        if shard is None:
            out[name] = p.detach().clone()
            continue
        if shard.experts is not None:  # a split expert stack: each block from its owner
            from lightning_matrixfsdp.runtime.tags import sharded_roots, state_of

            t = torch.empty(shard.shape, dtype=p.dtype)
            pieces = next(ps for r in sharded_roots(module)
                          for ps in [[s for s in state_of(r).plan.shards() if s.fqn == shard.fqn]] if ps)
            for piece in pieces:
                rows = t[piece.experts[0]:piece.experts[1]]
                if p._mfsdp_owned and piece.experts == shard.experts:
                    rows.copy_(p.data)
                dist.broadcast(rows, src=piece.owner)
            out[name] = t
            continue
        t = p.data.clone() if p._mfsdp_owned else torch.empty(shard.shape, dtype=p.dtype)
        dist.broadcast(t, src=shard.owner)
        out[name] = t
    return out


def cpu_trainer(strategy: Any, world: int, root: str, **kw: Any) -> Trainer:
    """A quiet CPU Trainer of ``world`` processes (no logger, checkpointing, bars or summary)."""
    tk = dict(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    tk.update(kw)
    return Trainer(strategy=strategy, **tk)


def full_numpy(module: torch.nn.Module) -> dict[str, Any]:
    """Every parameter whole (gathered from the owners if sharded), as numpy for a result queue
    (tensors do not survive it)."""
    import lightning_matrixfsdp as mf

    full = gather_full(module) if mf.is_matrix_sharded(module) else dict(module.named_parameters())
    return {n: t.detach().numpy().copy() for n, t in full.items()}


def trainer_worker(rank: int, world: int, cfg: dict) -> dict:
    """Fit with Trainer(strategy=...) in this process group; replay the batches through the DDP oracle."""
    import lightning_matrixfsdp as mf

    torch.manual_seed(0)
    cls = SelfShardingLitTiny if cfg.get("self_shard") else LitTiny
    lit = cls(optimizer=cfg.get("module_optimizer", "muon"), scheduler=cfg.get("scheduler", False),
              **cfg.get("model", {}))
    lit.route = cfg.get("route")
    initial = copy.deepcopy(lit.model)
    strategy = cfg.get("strategy", "matrix_fsdp")
    if isinstance(strategy, dict):
        kw = dict(strategy)
        if "optimizer" in kw:  # picklable spec -> factory
            import functools

            spec = dict(kw["optimizer"])
            kw["optimizer"] = functools.partial(getattr(mf, spec.pop("class", "Muon")), **spec)
        strategy = mf.MatrixFSDPStrategy(**kw)
    tk = dict(accelerator="cpu", devices=world, max_steps=cfg.get("steps", 5), logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0, default_root_dir=cfg.get("root", os.getcwd()))
    tk.update(cfg.get("trainer", {}))
    if cfg.get("csv_logger"):
        from lightning.pytorch.loggers import CSVLogger

        tk["logger"] = CSVLogger(tk["default_root_dir"], name="csv", version=0)
    trainer = Trainer(strategy=strategy, **tk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lit)
    threads_after_fit = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    full = gather_full(lit.model)

    # ---- oracle: DDP Muon replaying exactly the batches every rank saw
    acc = tk.get("accumulate_grad_batches", 1)
    clip = tk.get("gradient_clip_val")
    no_sync = isinstance(strategy, mf.MatrixFSDPStrategy) and strategy.accumulation_no_sync
    zero_missing = isinstance(strategy, mf.MatrixFSDPStrategy) and strategy.zero_missing_grads
    oracle = initial
    opts = oracle_optimizers(oracle, is_matrix=(lambda n, p: p.ndim == 2) if cfg.get("oracle_all_2d") else None)
    scheds = ([torch.optim.lr_scheduler.LambdaLR(o, SCHEDULES[cfg["scheduler"]]) for o in opts]
              if cfg.get("scheduler") else [])
    seen = lit.seen
    oracle_losses = []
    for step in range(len(seen) // acc):
        accg: dict = {}
        for micro in range(acc):
            batch = seen[step * acc + micro]
            if lit.route is not None:
                for i, blk in enumerate(oracle.blocks):
                    blk.route = lit.route(step * acc + micro, rank, i)
            loss = lm_loss(oracle(batch), batch)
            oracle_losses.append(loss.item())
            (loss / acc).backward()
            if no_sync:  # local accumulation, one reduction per optimizer step
                continue
            allreduce_mean_grads(oracle, zero_missing)
            for n, p in oracle.named_parameters():
                if p.grad is not None:
                    accg[n] = accg[n] + p.grad if n in accg else p.grad
                p.grad = None
        if no_sync:
            allreduce_mean_grads(oracle, zero_missing)
        else:
            for n, p in oracle.named_parameters():
                p.grad = accg.get(n)
        if clip and tk.get("gradient_clip_algorithm") == "value":
            torch.nn.utils.clip_grad_value_(oracle.parameters(), clip)
        elif clip:
            clip_global_norm(oracle, clip)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        for sc in scheds:
            sc.step()
    summary = None
    if cfg.get("summary"):
        from lightning_matrixfsdp.adapters.telemetry import MatrixFSDPSummary

        summary = (MatrixFSDPSummary(lit, max_depth=1).total_parameters, sum(p.numel() for p in initial.parameters()))
    ref = dict(oracle.named_parameters())
    diffs = {n: (full[n].double() - ref[n].detach().double()).abs().max().item() for n in full}
    return {"losses": lit.losses, "oracle_losses": oracle_losses, "param_diff": max(diffs.values()),
            "worst_param": max(diffs, key=diffs.get), "steps": trainer.global_step,
            "optimizer": type(trainer.optimizers[0]).__name__,
            "lrs": lit.lrs, "uneven_check": trainer.strategy._train_counts_may_differ, "warnings": [str(w.message) for w in caught], "summary": summary, "threads": threads_after_fit, "planner": mf.get_plan(lit).planner, "distinct_batches": not torch.equal(seen[0], _other_rank_first(seen[0]))}


def _other_rank_first(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return parts[(dist.get_rank() + 1) % len(parts)]
