"""Lightning's weight-averaging callbacks under matrix_fsdp, each run beside Lightning's own DDP.

``WeightAveraging`` (EMA through ``get_ema_multi_avg_fn``) and ``StochasticWeightAveraging``
keep a ``deepcopy`` of the LightningModule and average it with the model's parameters
side by side. Under owner sharding that copy is sharded like the model
(``runtime/views/copies.py``), so every rank averages exactly what it owns, elementwise, as DDP
does on the whole tensors: the final weights (after the callbacks swap the average in)
are bitwise DDP's. Checkpoints write the averaged copy from its owners in both formats
(``checkpoint/views.py``), so a fit resumed from an epoch checkpoint ends where the
uninterrupted fit ends, and where DDP's does.

Every Trainer fit runs twice in one pair of worker processes: ``strategy="ddp"`` first,
then ``"matrix_fsdp"``, with the same seed and data; results leave the workers as plain
values.
"""
from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from torch import nn

from helpers.lit import LitTiny, gather_full

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


# ---------------------------------------------------------------------- helpers (run inside the workers)
def _callback(kind: str):
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    if kind == "ema":
        return WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.8))
    return StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)


class Raw(Callback):
    """Listed before the averaging callback: keeps the trained weights at ``on_train_end``, before
    the average is copied in (the averaging must have changed something)."""

    weights: dict = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self.weights = gather_full(pl_module)


def _fit(strategy: Any, kind: str, root: str, module: Any = None, epochs: int = 3, val: int = 0,
         every_epoch_ckpt: bool = False, ckpt_path: Any = None, seed: int = 0) -> dict:
    """One fit; returns its final full weights (after the callbacks' swap) and what it saw."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_matrixfsdp  # noqa: F401 - registers "matrix_fsdp"

    torch.manual_seed(seed)
    lit = (module or LitTiny)()
    raw = Raw()
    averaging = _callback(kind)
    callbacks = [raw, averaging]
    if every_epoch_ckpt:
        callbacks.append(ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1,
                                         save_on_train_epoch_end=True))
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_epochs=epochs,
                      limit_train_batches=3, limit_val_batches=val, num_sanity_val_steps=0, logger=False,
                      enable_checkpointing=every_epoch_ckpt, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, default_root_dir=root)
    trainer.fit(lit, ckpt_path=ckpt_path)
    return {"weights": gather_full(lit), "raw": raw.weights, "module": lit, "callback": averaging,
            "metrics": {k: v.item() for k, v in trainer.callback_metrics.items()},
            "losses": list(getattr(lit, "losses", []))}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _shared_dir() -> str:
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------- EMA: training, validation swap, copy size
def _ema_worker(rank: int, world: int) -> dict:
    import lightning_matrixfsdp as mf
    from helpers.lit import SelfShardingLitTiny

    root = _shared_dir()
    ddp = _fit("ddp", "ema", os.path.join(root, "ddp"), epochs=2, val=2)
    # configure_model shards: WeightAveraging's setup calls it, then deep-copies the *sharded* module
    ours = _fit("matrix_fsdp", "ema", os.path.join(root, "mf"), module=SelfShardingLitTiny, epochs=2, val=2)
    # HSDP with replica_split (each rank a shard group of one, replicas step different roles): the
    # updated weights must have arrived before the callback averages them after each step
    split = _fit(mf.MatrixFSDPStrategy(shard_size=1, replica_split=True), "ema", os.path.join(root, "split"),
                 epochs=2, val=2)
    copy_local = sum(p.numel() for p in ours["callback"]._average_model.module.parameters())
    model_local = sum(p.numel() for p in ours["module"].parameters())
    return {"weights": _equal(ddp["weights"], ours["weights"]), "losses": ddp["losses"] == ours["losses"],
            "replica_split": _equal(ddp["weights"], split["weights"]),
            "val_loss": (ddp["metrics"]["val_loss"], ours["metrics"]["val_loss"]),
            "averaged": not _equal(ddp["weights"], ddp["raw"]) and not _equal(ours["weights"], ours["raw"]),
            "copy_local": copy_local, "model_local": model_local,
            "global": sum(t.numel() for t in ddp["weights"].values()), "planner": mf.get_plan(ours["module"]).planner}


def test_ema_weight_averaging_like_ddp(dist_pools):
    """EMA (``WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn)``): same losses, same validation
    loss on the swapped-in average, bitwise the same final weights, also under HSDP with
    ``replica_split``; the averaged copy holds only what each rank owns (it was copied from a
    module ``configure_model`` had sharded)."""
    for r in dist_pools(2).run(_ema_worker):
        assert r["weights"] and r["losses"] and r["averaged"] and r["replica_split"], r
        assert r["val_loss"][0] == r["val_loss"][1], r
        assert r["planner"] == "scope_greedy"  # the module sharded itself: the deepcopy came after sharding
        assert r["copy_local"] == r["model_local"] < r["global"], r


# ---------------------------------------------------------------------- SWA with BatchNorm: the update pass
class LitBN(LightningModule):
    """BatchNorm (SWA adds an epoch that recomputes its statistics for the averaged weights:
    forwards without backward) and a plain SGD optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        data = torch.utils.data.TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 4, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _swa_bn_worker(rank: int, world: int) -> dict:
    root = _shared_dir()
    out = {}
    for name in ("ddp", "matrix_fsdp"):
        r = _fit(name, "swa", os.path.join(root, name), module=LitBN)
        out[name] = (r["weights"], {n: b.clone() for n, b in r["module"].named_buffers()})
    (dw, db), (ow, ob) = out["ddp"], out["matrix_fsdp"]
    return {"weights": _equal(dw, ow), "buffers": _equal(db, ob), "batches": ob["net.1.num_batches_tracked"].item()}


def test_swa_batchnorm_update_like_ddp(dist_pools):
    """SWA on a model with BatchNorm: Lightning appends an epoch of forwards without backward
    that recomputes the statistics for the averaged weights (and steps the optimizer with the
    gradients left from the last real step, as it does under DDP); final weights bitwise DDP's,
    and rank 0's BatchNorm statistics too (DDP broadcasts rank 0's buffers, so rank 1's
    follow whatever the buffer policy is; rank 0 keeps its own either way)."""
    r0, r1 = dist_pools(2).run(_swa_bn_worker)
    for r in (r0, r1):
        assert r["weights"], r
    assert r0["buffers"], r0
    assert r0["batches"] == 3  # the statistics are the update pass's own: reset, then its 3 batches


# ---------------------------------------------------------------------- EMA of a model whose expert stack is split
class LitStack(LightningModule):
    """A layer, an expert stack ``[4, 8, 8]`` (declared by ``expert_stacks``; every expert applied
    to every row) and a head: at 2 ranks the planner splits the stack into two blocks of experts."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.experts = nn.Parameter(torch.randn(4, 8, 8) * 0.3)
        self.out = nn.Linear(8, 1)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = torch.relu(self.inp(x))
        return self.out(sum(h @ self.experts[e].T for e in range(self.experts.shape[0])))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # noqa: D102
        x, y = batch
        loss = ((self(x) - y) ** 2).mean()
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):  # noqa: D102
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(12, 8, generator=g), torch.randn(12, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=2)

    def configure_optimizers(self):  # noqa: D102
        import lightning_matrixfsdp as mf
        from lightning_matrixfsdp.runtime.classify import tag_expert_stacks
        from lightning_matrixfsdp.runtime.tags import shard_of

        if shard_of(self.experts) is None:  # DDP: tag the stack as matrix_shard does (each expert a matrix)
            tag_expert_stacks(self, "experts")
        return mf.Muon(self.parameters(), lr=0.02)


def _stack_worker(rank: int, world: int) -> dict:
    import lightning_matrixfsdp as mf

    root = _shared_dir()
    ddp = _fit("ddp", "ema", os.path.join(root, "ddp"), module=LitStack, epochs=2)
    ours = _fit(mf.MatrixFSDPStrategy(expert_stacks="experts"), "ema", os.path.join(root, "mf"), module=LitStack,
                epochs=2)
    avg = dict(ours["callback"]._average_model.module.named_parameters())
    # interrupted at the epoch-0 checkpoint (the averaged copy's blocks written by their owners) and resumed
    where = os.path.join(root, "ck")
    _fit(mf.MatrixFSDPStrategy(expert_stacks="experts"), "ema", where, module=LitStack, epochs=2,
         every_epoch_ckpt=True)
    resumed = _fit(mf.MatrixFSDPStrategy(expert_stacks="experts"), "ema", where + "-resumed", module=LitStack,
                   epochs=2, ckpt_path=os.path.join(where, "epoch=0.ckpt"))
    return {"weights": _equal(ddp["weights"], ours["weights"]), "losses": ddp["losses"] == ours["losses"],
            "resumed": _equal(ddp["weights"], resumed["weights"]),
            "averaged": not _equal(ours["weights"], ours["raw"]),
            "split": dict(mf.get_plan(ours["module"]).split_stacks),
            "copy_block": tuple(avg["experts"].shape), "model_block": tuple(ours["module"].experts.shape)}


def test_ema_of_a_model_with_a_split_expert_stack_like_ddp(dist_pools):
    """The averaged copy holds each owner's block of the split stack (copied before sharding, cut
    like the model); the final weights equal DDP's bitwise, also after a resume from a checkpoint
    taken mid-fit (the averaged blocks written by their owners and read back)."""
    for r in dist_pools(2).run(_stack_worker):
        assert r["split"], r  # the planner really split the stack
        assert r["weights"] and r["losses"] and r["averaged"] and r["resumed"], r
        assert r["copy_block"] == r["model_block"] == (2, 8, 8), r


# ---------------------------------------------------------------------- checkpoints: interrupt, resume, convert
def _resume_worker(rank: int, world: int, kind: str) -> dict:
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.checkpoint.consolidate import dcp_to_file

    root = _shared_dir()
    ddp = _fit("ddp", kind, os.path.join(root, "ddp"))
    out: dict[str, Any] = {}
    for fmt, distributed in (("dir", True), ("file", False)):
        where = os.path.join(root, fmt)
        full = _fit(mf.MatrixFSDPStrategy(save_distributed_checkpoint=distributed), kind, where,
                    every_epoch_ckpt=True)
        resumed = _fit(mf.MatrixFSDPStrategy(save_distributed_checkpoint=distributed), kind, where + "-resumed",
                       ckpt_path=os.path.join(where, "epoch=1.ckpt"))
        out[fmt] = {"uninterrupted": _equal(ddp["weights"], full["weights"]),
                    "resumed": _equal(ddp["weights"], resumed["weights"]),
                    "averaged": not _equal(full["weights"], full["raw"])}
    # the conversion tool keeps the averaged state too: the directory of the first run, as one file,
    # holds what the file-format run wrote itself (same computation)
    if rank == 0:
        dcp_to_file(os.path.join(root, "dir", "epoch=1.ckpt"), os.path.join(root, "converted.ckpt"))
    dist.barrier()
    a = torch.load(os.path.join(root, "converted.ckpt"), weights_only=False)
    b = torch.load(os.path.join(root, "file", "epoch=1.ckpt"), weights_only=False)
    out["converted"] = _same_tensors(a, b)
    return out


def _same_tensors(a: Any, b: Any) -> bool:
    """Every tensor of two checkpoint dicts equal (ignoring the layout record and the loops)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        keys = set(a) - {"matrix_fsdp_layout", "loops"}
        return isinstance(b, dict) and keys == set(b) - {"matrix_fsdp_layout", "loops"} and all(
            _same_tensors(a[k], b[k]) for k in keys)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_tensors(x, y) for x, y in zip(a, b))
    return True


@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_checkpoint_resume_like_ddp(dist_pools, kind):
    """A fit interrupted at the epoch-1 checkpoint and resumed ends with bitwise the weights of
    the uninterrupted fit and of DDP, from a checkpoint directory and from a single file
    (``save_distributed_checkpoint=False``): the averaged copy (EMA: the checkpoint's
    ``state_dict``, the model under ``current_model_state``; SWA: the callback's state) was
    written whole by its owners. The consolidation tool carries it over as well."""
    for r in dist_pools(2).run(_resume_worker, kind):
        for fmt in ("dir", "file"):
            assert r[fmt] == {"uninterrupted": True, "resumed": True, "averaged": True}, (fmt, r)
        assert r["converted"], r


# ---------------------------------------------------------------------- what a copy cannot do
class LitLate(LitTiny):
    """Builds a layer in ``configure_model``: SWA copies the module in its ``setup``, before that."""

    def configure_model(self) -> None:
        if not hasattr(self, "late"):
            self.late = nn.Linear(4, 4)


def _late_worker(rank: int, world: int) -> str:
    try:
        _fit("matrix_fsdp", "swa", _shared_dir(), module=LitLate)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_copy_missing_layers_is_refused(dist_pools):
    """A copy made before ``configure_model`` built layers cannot mirror the sharded model: every
    rank says so at setup (under DDP the copy lacks them too, and the callback pairs the
    parameters by position)."""
    for msg in dist_pools(2).run(_late_worker):
        assert "does not have the model's parameters" in msg and "configure_model" in msg, msg


def test_sharded_copy_refuses_forward():
    """``deepcopy`` of a sharded model (or of one of its units) gives a copy without the runtime
    (before: a segmentation fault, copying the freed unsharded buffers); the copy holds this
    rank's owned weights only, so its forward raises a clear error; the model runs on."""
    import lightning_matrixfsdp as mf
    from helpers.models import TinyLM

    torch.manual_seed(0)
    model = mf.matrix_shard(TinyLM())
    averaged, block = copy.deepcopy(model), copy.deepcopy(model.blocks[0])
    assert not mf.is_matrix_sharded(averaged) and not mf.is_matrix_sharded(block)
    assert all(torch.equal(a, b) for a, b in zip(averaged.parameters(), model.parameters()))
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="cannot run forward"):
        averaged(x)
    assert model(x).shape == (1, 4, 64)


def test_copy_of_a_meta_device_model_takes_its_initialized_values():
    """A copy made of a meta-device model before sharding (a callback's ``setup``) holds the
    values ``matrix_shard`` initialized, not meta tensors the averaging could not update."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.views.copies import shard_copies, track_copies
    from helpers.models import TinyLM

    with torch.device("meta"):
        model = TinyLM()
    track_copies(model)
    averaged = copy.deepcopy(model)
    mf.matrix_shard(model, device="cpu")
    shard_copies(model)
    assert not any(t.is_meta for t in [*averaged.parameters(), *averaged.buffers()])
    assert all(torch.equal(a, b) for a, b in zip(averaged.parameters(), model.parameters()))
