"""Loose ends of pipeline and expert parallelism (issue 38 follow-ups), each against a plain oracle.

* ``expert_group_timeouts``: the strategy's ``timeout`` on the expert-parallel groups, without
  pipeline parallelism (``build_mesh``) and with it (each stage's groups, ``stage_mesh_info``).
* ``outputs_and_lone_forwards``: ``forward_outputs`` in a ``validation_step`` and in a hook called
  on every rank: the unsplit model's logits on every rank; called on rank 0 alone: a
  ``LoneForwardError`` within seconds that says what to do under pipeline parallelism.
* ``fabric_to_trainer``: a Fabric run at ``pipeline_parallel_size=2`` prints its split, samples by
  data-parallel place, refuses loaders of different lengths and saves a directory; a Trainer at
  PP=2 resumes from it (``fit(ckpt_path=...)``) with the saved weights and optimizer state.
* ``ema``: Lightning's ``WeightAveraging`` (EMA) at PP=2: the averaged weights equal the EMA of the
  unsplit model's weights after each step (``oracle_fit``).
"""
from __future__ import annotations

import copy
import logging
import os
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

from helpers.pipeline_lightning_scenarios import ADAMW, BATCH, _trainer, data, make_module, oracle_fit


def _timeout_s(group: Any) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()  # noqa: SLF001


def expert_group_timeouts(rank: int, world: int, seconds: float) -> dict:
    """EP=2 on 4 ranks, without and with PP=2: each expert group's gloo timeout, read back."""
    from lightning.pytorch import LightningModule, Trainer

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.pipeline.combine import stage_dims
    from lightning_matrixfsdp.runtime.pipeline.comm import stage_mesh_info

    out = {}
    for pp in (1, 2):
        strategy = mf.MatrixFSDPStrategy(pipeline_parallel_size=pp, expert_parallel_size=2,
                                         timeout=timedelta(seconds=seconds), log_plan=False)
        Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)
        strategy.connect(LightningModule())  # a bare module: the groups are what is read
        strategy.setup_environment()
        if pp == 1:
            experts = strategy.shard_mesh.experts
        else:  # what build_pipeline creates for the stages (the strategy's pipeline mesh)
            mesh = strategy.pipeline_mesh
            experts = stage_mesh_info(mesh, stage_dims(pp, mesh.dp_size, mesh.shard_size, 2)).experts
        groups = {"ep": experts.ep_group, "ep_replica": experts.replica_group, "stage": experts.stage_group}
        out[pp] = {name: _timeout_s(g) for name, g in groups.items() if g is not None}
    return out


# ---------------------------------------------------------------------- forward_outputs outside training
def _outputs_module(how: str) -> Any:
    import lightning_matrixfsdp as mf

    class Outputs(type(make_module())):
        """Records ``forward_outputs`` in its validation steps and at the epoch's end (``how``:
        "every" rank, or rank 0 "lone")."""

        def validation_step(self, batch: Any, batch_idx: int) -> None:  # noqa: D102
            self.step_outputs.append(mf.forward_outputs(self, batch[0]))

        def on_validation_epoch_end(self) -> None:  # noqa: D102
            x = self.prompt
            if how == "every":
                self.hook_outputs.append(mf.forward_outputs(self, x))
            elif self.trainer.is_global_zero:
                start = time.monotonic()
                try:
                    mf.forward_outputs(self, x)
                    self.lone = ("ran", 0.0)
                except mf.LoneForwardError as e:
                    self.lone = (str(e), time.monotonic() - start)

    torch.manual_seed(0)
    lit = Outputs(vocab_size=48, max_seq_len=8, d_model=32, n_layers=2, n_heads=2, warmup_steps=0)
    lit.step_outputs, lit.hook_outputs, lit.lone = [], [], None
    lit.prompt = data(4)[0][0].repeat(4, 1)  # 4 rows: one per micro-batch
    return lit


def outputs_and_lone_forwards(rank: int, world: int) -> dict:
    """PP=2 on 2 ranks, ``trainer.validate`` (the initial weights): the outputs against the unsplit
    model's, then the same hook on rank 0 alone (the lone-forward wait shortened to 1 s)."""
    from lightning_matrixfsdp.runtime.consensus import LONE_FORWARD_ENV

    out: dict[str, Any] = {}
    try:
        lit = _outputs_module("every")
        oracle = copy.deepcopy(lit)
        samples = data(BATCH)
        loader = torch.utils.data.DataLoader(samples, batch_size=BATCH)
        _trainer(world, {"pp": 2, "schedule": "1F1B"}, {}).validate(lit, loader, verbose=False)
        x = torch.stack([s[0] for s in samples])
        with torch.no_grad():
            want = [oracle(x), oracle(lit.prompt)]
        got = lit.step_outputs + lit.hook_outputs
        out["outputs"] = [len(lit.step_outputs), len(lit.hook_outputs)]
        out["worst"] = max((g - w).abs().max().item() for g, w in zip(got, want))
        os.environ[LONE_FORWARD_ENV] = "1"
        lit = _outputs_module("lone")
        try:
            _trainer(world, {"pp": 2, "schedule": "1F1B"}, {}).validate(lit, loader, verbose=False)
        finally:
            os.environ.pop(LONE_FORWARD_ENV, None)
        out["lone"] = lit.lone
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        out["error"] = traceback.format_exc()
    return out


# ---------------------------------------------------------------------- Fabric: its split printout, its checkpoint
class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _held_state(lit: Any, opt: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The weights and optimizer state this rank holds, by global name."""
    from lightning_matrixfsdp.optim.routing import held

    names = {id(p): n for n, p in lit.named_parameters()}
    inner = getattr(opt, "optimizer", opt)
    state = {}
    for o in getattr(inner, "optimizers", [inner]):
        for p, s in o.state.items():
            if id(p) in names and held(p):
                state.update({f"{names[id(p)]}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return {"weights": {n: p.detach().clone() for n, p in lit.named_parameters() if held(p)}, "state": state}


def fabric_to_trainer(rank: int, world: int, directory: str) -> dict:
    """PP=2 on 2 ranks: a Fabric run with ``log_plan=True`` (its printout captured), 2 steps, then
    ``fabric.save`` of a directory; a Trainer at PP=2 ``fit(ckpt_path=...)`` from it: what it holds
    when training starts, and one more step."""
    from lightning.fabric import Fabric
    from lightning.pytorch.callbacks import Callback

    import lightning_matrixfsdp as mf

    out: dict[str, Any] = {}
    try:
        lines = _Lines()
        import lightning_utilities.core.rank_zero as rank_zero

        logger = rank_zero.log  # the logger rank_zero_info writes to (Lightning sets it)
        level = logger.level
        logger.addHandler(lines)
        logger.setLevel(logging.INFO)
        try:
            strategy = mf.MatrixFSDPFabricStrategy(pipeline_parallel_size=2, pipeline_schedule="1F1B",
                                                   pipeline_microbatches=4, log_plan=True)
            fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
            fabric.launch()
            lit = make_module()
            model = fabric.setup_module(lit)
        finally:
            logger.removeHandler(lines)
            logger.setLevel(level)
        out["printed"] = lines.lines
        out["describe"] = mf.adapters.pipeline.pipeline_of(lit).run.plan.describe()
        opt = fabric.setup_optimizers(mf.Muon(model, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, **ADAMW))
        # Fabric's sampler: the stages of the one data-parallel place read the same batches
        loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data(2 * BATCH), batch_size=BATCH))
        out["sampler"] = fabric.strategy.distributed_sampler_kwargs
        for x, y in loader:
            fabric.backward(mf.forward_loss(model, x, y))
            opt.step()
            opt.zero_grad()
        # uneven loaders (rank 0 a batch more): refused at setup on every rank, not a hang at the end
        try:
            fabric.setup_dataloaders(torch.utils.data.DataLoader(data((3 - rank) * BATCH), batch_size=BATCH),
                                     use_distributed_sampler=False)
            out["uneven"] = "accepted"
        except mf.MatrixShardError as e:
            out["uneven"] = str(e)
        path = os.path.join(directory, "fabric_pp")
        fabric.save(path, {"model": model, "optimizer": opt})
        out["saved"] = _held_state(lit, opt)

        class AtStart(Callback):
            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                out["restored"] = _held_state(pl_module, trainer.optimizers[0])

        lit = make_module()
        trainer = _trainer(world, {"pp": 2, "schedule": "1F1B"}, {}, max_steps=1, callbacks=[AtStart()])
        trainer.fit(lit, torch.utils.data.DataLoader(data(BATCH), batch_size=BATCH), ckpt_path=path)
        out["losses"] = list(lit.recorded)
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        out["error"] = traceback.format_exc()
    return out


# ---------------------------------------------------------------------- weight averaging (EMA)
DECAY = 0.8


class _EmaSGD:
    """The oracle's optimizer (``oracle_fit``): SGD, then the exponential moving average of the
    weights after each step (the first step's weights as they are), as ``get_ema_multi_avg_fn`` does."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.opts = [torch.optim.SGD(model.parameters(), lr=0.5)]
        self.average: dict[str, torch.Tensor] = {}

    def step(self) -> None:
        self.opts[0].step()
        for n, p in self.model.named_parameters():
            now = p.detach().clone()
            self.average[n] = now if n not in self.average else torch.lerp(self.average[n], now, 1 - DECAY)


def _ema_trainer(world: int, root: str, save: bool) -> Any:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    import lightning_matrixfsdp as mf

    callbacks = [WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(DECAY))]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True))
    strategy = mf.MatrixFSDPStrategy(pipeline_parallel_size=2, pipeline_schedule="1F1B", pipeline_microbatches=4,
                                     log_plan=False)
    return Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_checkpointing=save,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, max_steps=3,
                   callbacks=callbacks)


def ema(rank: int, world: int, root: str) -> dict:
    """PP=2 on 2 ranks, SGD with ``WeightAveraging`` (EMA) for 3 steps: the weights each rank holds
    after fit (the average, swapped in at the end) against the oracle's EMA; then the same fit
    saving a checkpoint each epoch."""
    from lightning_matrixfsdp.optim.routing import held

    out: dict[str, Any] = {}
    try:
        lit = make_module(layers=2, sgd=True)
        oracle = copy.deepcopy(lit)
        samples = data(3 * BATCH)
        _ema_trainer(world, root, False).fit(lit, torch.utils.data.DataLoader(samples, batch_size=BATCH))
        averaging = _EmaSGD(oracle)
        oracle_fit(oracle, samples, 1, 3, 1, 4, None, optimizer=averaging)
        mine = {n: p.detach() for n, p in lit.named_parameters() if held(p)}
        out["compared"] = sorted(mine)
        out["worst"] = max((p - averaging.average[n]).abs().max().item() for n, p in mine.items())
        out["from_raw"] = max((p - oracle.get_parameter(n).detach()).abs().max().item() for n, p in mine.items())
        lit = make_module(layers=2, sgd=True)
        try:
            _ema_trainer(world, root, True).fit(lit, torch.utils.data.DataLoader(samples, batch_size=BATCH))
            out["checkpoint"] = "saved"
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            out["checkpoint"] = f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        out["error"] = traceback.format_exc()
    return out
