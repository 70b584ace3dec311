"""Lightning's callbacks, run under ``strategy="ddp"`` and ``"matrix_fsdp"`` side by side.

Each scenario function runs in a 2-process gloo group (``tests/helpers/dist.py``), fits once
with the strategy it is given, and returns what the callbacks produced (losses,
full weights, checkpoint names, logged metrics, callback state), so that
``tests/test_callbacks_walk.py`` can compare the two strategies' results.
"""
from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    DeviceStatsMonitor,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    OnExceptionCheckpoint,
    ThroughputMonitor,
    Timer,
)
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from helpers.lit import TokenData, gather_full
from helpers.models import TinyLM, lm_loss
from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call of rank 0 (Lightning logs on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, {k: float(v) for k, v in metrics.items()}))


class WalkModule(LightningModule):
    """TinyLM with what the callbacks need: a step-logged and epoch-logged training loss, a
    rank-synced validation loss, an ``lr`` attribute (lr_find), an epoch-interval StepLR."""

    def __init__(self, lr: float = MUON_DEFAULTS["lr"], adamw_eps: float = ADAMW_DEFAULTS["eps"],
                 raise_at_step: int = -1, trainable_only: bool = False) -> None:
        super().__init__()
        self.model = TinyLM(d=16, heads=2, layers=2)
        self.lr = lr
        self.adamw_eps = adamw_eps
        self.raise_at_step = raise_at_step
        self.trainable_only = trainable_only  # the optimizer BaseFinetuning's docs ask for
        self.losses: list[float] = []
        self.flops_per_batch = 1000  # ThroughputMonitor reports FLOPs when the module gives them
        self.sync_late: list[torch.nn.Parameter] = []  # see LateUnfreeze

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.model(batch), batch)
        self.losses.append(loss.item())
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", lm_loss(self.model(batch), batch), sync_dist=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == self.raise_at_step:
            raise RuntimeError("walk: planned failure")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # DDP reduces only what required grad when it wrapped the model (see LateUnfreeze).
        for p in self.sync_late:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(TokenData(n=32), batch_size=2)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(TokenData(n=8), batch_size=2)

    def configure_optimizers(self):
        import lightning_matrixfsdp as mf

        a = ADAMW_DEFAULTS
        # bare parameters: by shape (every 2-D tensor on Muon) under DDP and matrix_fsdp alike
        params = [p for p in self.parameters() if p.requires_grad or not self.trainable_only]
        opt = mf.Muon(params, **{**MUON_DEFAULTS, "lr": self.lr}, adamw_betas=a["betas"],
                      adamw_eps=self.adamw_eps)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class LateUnfreeze(BaseFinetuning):
    """Freezes the first block before training and unfreezes it as a new param group at epoch 1.

    DDP builds its reducer over the parameters that require grad when it wraps the model, so it
    never reduces these gradients: each DDP rank would train its own copy of the block. For a
    correct DDP reference the module all-reduces them by hand (``WalkModule.sync_late``), which
    only the DDP run asks for.
    """

    def __init__(self, sync_by_hand: bool) -> None:
        super().__init__()
        self.sync_by_hand = sync_by_hand

    def freeze_before_training(self, pl_module: WalkModule) -> None:
        self.freeze(pl_module.model.blocks[0])

    def finetune_function(self, pl_module: WalkModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.blocks[0], optimizer)
            if self.sync_by_hand:
                pl_module.sync_late = list(pl_module.model.blocks[0].parameters())


def _strategy(name: str, **kw: Any) -> Any:
    if name == "ddp" or not kw:
        return name
    import lightning_matrixfsdp as mf

    return mf.MatrixFSDPStrategy(**kw)


def _trainer(strategy: Any, root: str, **kw: Any) -> Trainer:
    args = dict(accelerator="cpu", devices=2, strategy=strategy, default_root_dir=root, logger=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    args.update(kw)
    return Trainer(**args)


def _weights(lit: WalkModule, strategy: str) -> dict[str, torch.Tensor]:
    if strategy == "ddp":
        return {n: p.detach().clone() for n, p in lit.model.named_parameters()}
    return gather_full(lit.model)


def _names(path: str) -> dict[str, str]:
    """Entry -> "link:<target>" or "ckpt" for every entry of a checkpoint folder (a checkpoint is
    a file under DDP, a directory under matrix_fsdp's default ``save_distributed_checkpoint``)."""
    if not os.path.isdir(path):
        return {}
    out = {}
    for e in sorted(os.listdir(path)):
        full = os.path.join(path, e)
        out[e] = f"link:{os.readlink(full)}" if os.path.islink(full) else "ckpt"
    return out


def run_scenario(rank: int, world: int, name: str, strategy: str, root: str) -> dict:
    """Run scenario ``name`` under ``strategy``; an exception comes back as text, so that one
    strategy's failure is reported by the comparison and leaves the worker pool usable."""
    try:
        return SCENARIOS[name](rank, world, strategy, os.path.join(root, strategy))
    except Exception:  # noqa: BLE001 - the test prints it
        return {"error": traceback.format_exc()}


def callbacks_scenario(rank: int, world: int, strategy: str, root: str) -> dict:
    """One fit with checkpoints of every kind, early stopping, LR and device monitors, an
    accumulation schedule and a late unfreeze."""
    torch.manual_seed(0)
    lit = WalkModule()
    d = {k: os.path.join(root, k) for k in ("steps", "epochs", "topk", "link", "tepoch")}
    ckpts = {
        "steps": ModelCheckpoint(d["steps"], every_n_train_steps=3, save_top_k=-1),
        "epochs": ModelCheckpoint(d["epochs"], filename="w-{epoch}", every_n_epochs=2, save_top_k=-1,
                                  save_weights_only=True),
        "topk": ModelCheckpoint(d["topk"], filename="best-{epoch:02d}-{val_loss:.3f}", monitor="val_loss",
                                save_top_k=2, save_last=True),
        "link": ModelCheckpoint(d["link"], monitor="val_loss", save_top_k=1, every_n_epochs=2, save_last="link"),
        "tepoch": ModelCheckpoint(d["tepoch"], filename="{epoch}-{train_loss_epoch:.4f}",
                                  monitor="train_loss_epoch", save_top_k=1, save_on_train_epoch_end=True,
                                  auto_insert_metric_name=False),
    }
    stop = EarlyStopping(monitor="val_loss", min_delta=0.02, patience=1)
    logger = MemoryLogger()
    callbacks = [*ckpts.values(), stop, LearningRateMonitor(logging_interval="step"),
                 GradientAccumulationScheduler({0: 1, 2: 2}), LateUnfreeze(sync_by_hand=strategy == "ddp"),
                 ThroughputMonitor(batch_size_fn=lambda b: b.size(0), window_size=2), DeviceStatsMonitor(cpu_stats=True),
                 Timer(duration=timedelta(hours=1))]
    s = _strategy(strategy, accumulation_no_sync=True)
    trainer = _trainer(s, root, max_epochs=8, limit_train_batches=4, limit_val_batches=2, log_every_n_steps=1,
                       callbacks=callbacks, logger=logger)
    trainer.fit(lit)
    return {
        "losses": lit.losses, "weights": _weights(lit, strategy), "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "files": {k: _names(v) for k, v in d.items()},
        "best": {k: (os.path.basename(c.best_model_path), c.best_model_score) for k, c in ckpts.items()},
        "best_k": {k: {os.path.basename(p): v for p, v in c.best_k_models.items()} for k, c in ckpts.items()},
        "last": {k: os.path.basename(c.last_model_path) for k, c in ckpts.items()},
        "stop": (stop.stopped_epoch, stop.wait_count, stop.best_score),
        "logs": logger.records, "groups": len(trainer.optimizers[0].param_groups),
    }


def finetune_scenario(rank: int, world: int, strategy: str, root: str) -> dict:
    """``BaseFinetuning`` as its docs ask: an optimizer over the trainable parameters only, so the
    unfrozen block comes in as a new param group."""
    torch.manual_seed(0)
    lit = WalkModule(trainable_only=True)
    logger = MemoryLogger()
    callbacks = [LateUnfreeze(sync_by_hand=strategy == "ddp"), LearningRateMonitor(logging_interval="step")]
    trainer = _trainer(strategy, root, max_epochs=2, limit_train_batches=3, limit_val_batches=0, logger=logger,
                       log_every_n_steps=1, callbacks=callbacks, enable_checkpointing=False)
    trainer.fit(lit)
    return {"losses": lit.losses, "weights": _weights(lit, strategy), "logs": logger.records,
            "groups": len(trainer.optimizers[0].param_groups)}


def exception_timer_scenario(rank: int, world: int, strategy: str, root: str) -> dict:
    """``OnExceptionCheckpoint`` after a failure at step 3, then a ``Timer`` that stops at once."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    lit = WalkModule(raise_at_step=3)
    path = os.path.join(root, "exc")
    trainer = _trainer(strategy, root, max_steps=6, limit_val_batches=0,
                       callbacks=[OnExceptionCheckpoint(path, filename="on_exception")])
    try:
        trainer.fit(lit)
        out["raised"] = None
    except RuntimeError as e:
        out["raised"] = str(e)
    out["exc_files"] = _names(path)
    out["exc_step"] = trainer.global_step
    out["exc_losses"] = lit.losses

    torch.manual_seed(0)
    lit = WalkModule()
    timer = Timer(duration=timedelta(0), interval="step")
    trainer = _trainer(strategy, root, max_steps=6, limit_val_batches=0, callbacks=[timer])
    trainer.fit(lit)
    out["timer_step"] = trainer.global_step
    out["timer_losses"] = lit.losses
    out["timer_weights"] = _weights(lit, strategy)
    return out


def tuner_scenario(rank: int, world: int, strategy: str, root: str) -> dict:
    """``Tuner.lr_find`` (it saves, searches, restores), then a short fit at its suggestion."""
    from lightning.pytorch.tuner import Tuner

    torch.manual_seed(0)
    lit = WalkModule()
    trainer = _trainer(strategy, root, max_steps=3, limit_val_batches=0)
    finder = Tuner(trainer).lr_find(lit, min_lr=1e-4, max_lr=1.0, num_training=8, attr_name="lr")
    after_restore = _weights(lit, strategy)
    trainer.fit(lit)
    return {"results": finder.results, "suggestion": finder.suggestion(), "lr": lit.lr,
            "restored": after_restore, "losses": lit.losses, "weights": _weights(lit, strategy)}


#: "64-true-instance": 64-true with ``MatrixFSDPStrategy()`` given as an instance, which Lightning's
#: connector refuses for its ModelParallelStrategy (the package lets it through: issue 36)
PRECISIONS = ("64-true", "64-true-instance", "bf16-mixed", "bf16-true", "16-true", "16-mixed")


def precision_scenario(rank: int, world: int, strategy: str, root: str) -> dict:
    """Three steps in each precision that runs on CPU (``16-mixed`` becomes ``bf16-mixed`` there);
    AdamW's epsilon is 1e-4, which float16 can represent."""
    import lightning_matrixfsdp as mf

    out = {}
    for name in PRECISIONS:
        precision, instance = name.removesuffix("-instance"), name.endswith("-instance")
        chosen: Any = mf.MatrixFSDPStrategy(log_plan=False) if instance and strategy == "matrix_fsdp" else strategy
        torch.manual_seed(0)
        lit = WalkModule(adamw_eps=1e-4)
        try:
            trainer = _trainer(chosen, root, max_steps=3, limit_val_batches=0, precision=precision)
            trainer.fit(lit)
            out[name] = {"losses": lit.losses, "weights": _weights(lit, strategy),
                         "dtype": next(lit.parameters()).dtype}
        except Exception as e:  # noqa: BLE001 - compared with DDP's outcome
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


SCENARIOS = {"callbacks": callbacks_scenario, "finetune": finetune_scenario, "exception_timer": exception_timer_scenario, "tuner": tuner_scenario,
             "precision": precision_scenario}
