"""The scenarios of ``test_tp_lightning.py``'s one 4-process launch (``worker``, world 4 = data
parallel 2 x tensor parallel 2, gloo, float32): Lightning's checkpoint paths with a TP model.
Each scenario returns plain values; the tests check them (see that file's docstring)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback

from lightning_matrixfsdp import local_state_dict
from helpers.tp_reference import SPLIT, SPLIT_BIAS, Net, batch, loss_of, parallelize
from helpers.tp_scenarios import _ours

TP = 2
EMA_DECAY = 0.8


def _split(name: str):
    """The TP split dimension of a parameter of ``Net`` (under any prefix), None if TP leaves it whole."""
    if ".blocks." not in f".{name}":
        return None
    tail = name.split("blocks.", 1)[1].split(".", 1)[1]
    return SPLIT.get(tail, SPLIT_BIAS.get(tail))


def _full(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole tensors of this rank's resident ones (a fragment or the whole where its data-parallel
    owner is, an empty placeholder elsewhere), gathered with plain ``torch.distributed`` calls: the
    owner's TP fragments joined along the split dimension in TP-rank order (ranks d*T .. d*T+T-1)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: v.detach().cpu().clone() for k, v in named.items()})
    out = {}
    for k in named:
        dim = _split(k)
        owners = [r for r in range(len(every)) if every[r][k].numel()]
        if dim is None:
            out[k] = every[owners[0]][k]
            continue
        first = owners[0] - owners[0] % TP
        out[k] = torch.cat([every[first + t][k] for t in range(TP)], dim=dim)
    return out


def _read_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, whole, by flat key (one process, torch's own reader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), os.path.join(tmp, "all.pt"))
        nested = torch.load(os.path.join(tmp, "all.pt"), weights_only=False)
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)

    walk("", nested)
    return out


def _shared_dir() -> Path:
    box = [tempfile.mkdtemp(prefix="tp-lit-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


class LitTP(LightningModule):
    """``Net`` parallelized in ``configure_model`` on Lightning's mesh; records what its checkpoint
    hooks see of ``checkpoint["state_dict"]``."""

    def __init__(self, kind: str = "shampoo") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.kind, self.losses, self.parallelized = Net(), kind, [], False
        self.saved_views: list[dict[str, torch.Tensor]] = []
        self.saved_params: list[dict[str, torch.Tensor]] = []
        self.loaded_view: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if not self.parallelized:  # idempotent: WeightAveraging's setup calls it before the Trainer does
            parallelize(self.net, self.device_mesh["tensor_parallel"])
            self.parallelized = True

    def training_step(self, x, i):
        loss = loss_of(self.net, x)
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        data = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))  # 2 steps per epoch per DP rank
        return torch.utils.data.DataLoader(list(data), batch_size=4)

    def configure_optimizers(self):
        return _ours(self.kind, list(self.parameters()))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.saved_views.append({k: v.detach().clone() for k, v in checkpoint["state_dict"].items()})
        self.saved_params.append({k: p.detach().clone() for k, p in self.named_parameters()})

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.loaded_view = {k: v.detach().clone() for k, v in checkpoint["state_dict"].items()}


class Loops(Callback):
    """The global step each training batch starts at (the loops a resume restores)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)


class Raw(Callback):
    """Listed before the averaging callback: this rank's parameters after every optimizer step, before
    the callback averages them (the EMA oracle's input)."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial = {k: p.detach().clone() for k, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.weights.append({k: p.detach().clone() for k, p in pl_module.named_parameters()})


def _fit(root: Path, ckpt_path: Any = None, async_save: bool = False, ema: bool = False, kind: str = "shampoo",
         swa: bool = False, single_file: bool = False) -> dict:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging, WeightAveraging
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    import lightning_matrixfsdp as mf

    lit, loops, raw = LitTP(kind), Loops(), Raw()
    ckpt = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True)
    callbacks = [loops, raw, ckpt] + ([WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))] if ema else [])
    if swa:  # averages the weights at the start of every epoch (its setup copies the module before TP)
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1))
    trainer = Trainer(accelerator="cpu", devices=4, strategy=mf.MatrixFSDPStrategy(
                          tensor_parallel_size=TP, async_save=async_save, save_distributed_checkpoint=not single_file),
                      max_epochs=3 if swa else 2, logger=False, callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root)
    trainer.fit(lit, ckpt_path=ckpt_path)
    return {"lit": lit, "trainer": trainer, "steps": loops.steps, "raw": raw.weights, "initial": raw.initial}


def _state(lit: LightningModule, trainer) -> tuple[dict, dict]:
    opt = trainer.optimizers[0]
    params = dict(lit.named_parameters())
    state = {}
    for k, p in params.items():
        for n, v in opt.state.get(p, {}).items():
            state[f"{k}/{n}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return {k: p.detach().clone() for k, p in params.items()}, state


def _diff(a: dict, b: dict) -> list:
    bad = [("keys", sorted(set(a) ^ set(b))[:4])] if set(a) != set(b) else []
    for k in a.keys() & b.keys():
        same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        if not same:
            bad.append(k)
    return bad


def _trainer(root: Path) -> dict:
    """The uninterrupted fit (2 epochs of 2 steps, an epoch checkpoint each); a fit resumed from the
    first epoch's checkpoint; the same first fit with ``async_save``; ``trainer.save_checkpoint``."""
    full = _fit(root / "sync")
    weights, state = _state(full["lit"], full["trainer"])
    full["trainer"].save_checkpoint(root / "final.ckpt")
    whole = _full(dict(full["lit"].named_parameters()))  # the oracle of the files' content
    resumed = _fit(root / "resumed", ckpt_path=root / "sync" / "epoch=0.ckpt")
    r_weights, r_state = _state(resumed["lit"], resumed["trainer"])
    first_saved = full["lit"].saved_views[0]
    mine = full["lit"].saved_params[0]
    views = {"keys": sorted(first_saved) == sorted(f"{k}" for k in local_state_dict(full["lit"])),
             # the hook sees this rank's view: its fragment where its DP rank owns the key, else empty
             "save": [k for k, p in mine.items()
                      if not (torch.equal(first_saved[k], p) if p.numel() else first_saved[k].numel() == 0)],
             "load": [k for k, v in first_saved.items() if not torch.equal(resumed["lit"].loaded_view.get(k), v)]}
    _fit(root / "async", async_save=True)  # its files are compared with the synchronous ones below
    out = {"resume_weights": _diff(weights, r_weights), "resume_state": _diff(state, r_state),
           "states": len(state), "whole_states": _whole_state_count(full),
           "steps": full["steps"], "resumed_steps": resumed["steps"],
           "losses": full["lit"].losses[2:] == resumed["lit"].losses, "views": views}
    dist.barrier()
    if dist.get_rank() == 0:
        final = _read_dir(root / "final.ckpt")
        out["final"] = [k for k, v in whole.items() if not torch.equal(final.get(f"state_dict.{k}"), v)]
        out["final_entries"] = len(whole)
        for name in ("epoch=0.ckpt", "epoch=1.ckpt"):
            a, b = _read_dir(root / "sync" / name), _read_dir(root / "async" / name)
            out[f"async_{name}"] = (len(a), _diff(a, b))
    # Lightning's single-file format: the epoch files hold the whole tensors, and a fit resumed from
    # the first ends where the uninterrupted fit ends
    one = _fit(root / "file", single_file=True)
    from_file = _fit(root / "file-resumed", ckpt_path=root / "file" / "epoch=0.ckpt")
    f_weights, f_state = _state(from_file["lit"], from_file["trainer"])
    out["file_resume_weights"], out["file_resume_state"] = _diff(weights, f_weights), _diff(state, f_state)
    out["file_losses"] = full["lit"].losses[2:] == from_file["lit"].losses
    whole_one = _full(dict(one["lit"].named_parameters()))
    dist.barrier()
    if dist.get_rank() == 0:
        ck = torch.load(root / "file" / "epoch=1.ckpt", map_location="cpu", weights_only=False)
        out["file_entries"] = len(whole_one)
        out["file_weights"] = [k for k, v in whole_one.items() if not torch.equal(ck["state_dict"].get(k), v)]
        out["file_states"] = sum(len(s) for s in ck["optimizer_states"][0]["state"].values())
    return out


def _averaging(root: Path) -> dict:
    """``WeightAveraging`` (EMA) with TP: the final weights (the average swapped in) equal the EMA of
    each step's weights written out here (``torch.lerp`` on this rank's fragments: elementwise); a fit
    resumed from the first epoch's checkpoint (the averaged copy's views written and read back per
    TP rank) ends where the uninterrupted one does."""
    full = _fit(root / "ema", ema=True, kind="muon")
    avg = None
    for w in full["raw"]:
        avg = {k: v.clone() for k, v in w.items()} if avg is None else {
            k: torch.lerp(avg[k], w[k], 1 - EMA_DECAY) for k in w}
    final = {k: p.detach().clone() for k, p in full["lit"].named_parameters()}
    resumed = _fit(root / "ema-resumed", ckpt_path=root / "ema" / "epoch=0.ckpt", ema=True, kind="muon")
    out = {"oracle": _diff(final, avg), "averaged": bool(_diff(final, full["raw"][-1])),
           "resumed": _diff(final, {k: p.detach() for k, p in resumed["lit"].named_parameters()}),
           "split": sum(1 for k, v in final.items() if _split(k) is not None and v.numel()), "steps": len(full["raw"])}
    # SWA (swa_epoch_start=1: Lightning's epoch 0 on): the running mean of the weights at the start of
    # epochs 0, 1 and 2 (before any step, after step 2, after step 4), as torch's swa_utils defines it
    swa = _fit(root / "swa", swa=True, kind="muon")
    mean = dict(swa["initial"])
    for n, w in enumerate((swa["raw"][1], swa["raw"][3]), start=1):
        mean = {k: mean[k] + (w[k] - mean[k]) / (n + 1) for k in w}
    swa_final = {k: p.detach() for k, p in swa["lit"].named_parameters()}
    out["swa"] = _diff(swa_final, mean)
    out["swa_steps"] = len(swa["raw"])
    # resumed from epoch 1's checkpoint: the averaged copy's views (in SWA's callback state) read back per TP rank
    again = _fit(root / "swa-resumed", ckpt_path=root / "swa" / "epoch=1.ckpt", swa=True, kind="muon")
    out["swa_resumed"] = _diff(swa_final, {k: p.detach() for k, p in again["lit"].named_parameters()})
    return out


def _whole_state_count(run: dict) -> int:
    """How many state tensors of this rank have a split matrix's global shape (Shampoo's whole state)."""
    opt = run["trainer"].optimizers[0]
    n = 0
    for k, p in run["lit"].named_parameters():
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and _split(k) is not None and v.ndim == 2 and v.shape != p.shape:
                n += 1
    return n


def _fabric(root: Path) -> dict:
    """``fabric.save`` after 2 steps, 2 more steps; a fresh model and optimizer ``fabric.load`` it and
    run the same 2 steps: bitwise the uninterrupted run; the async save writes the same content."""
    from lightning.fabric import Fabric

    import lightning_matrixfsdp as mf

    out = {}
    for name, async_save in (("sync", False), ("async", True)):
        fabric = Fabric(accelerator="cpu", devices=4,
                        strategy=mf.MatrixFSDPFabricStrategy(tensor_parallel_size=TP, async_save=async_save))
        fabric.launch()
        mesh = fabric.strategy.device_mesh
        dp = mesh["data_parallel"].get_local_rank()

        def make():
            torch.manual_seed(0)
            model = fabric.setup_module(parallelize(Net(), mesh["tensor_parallel"]))
            return model, fabric.setup_optimizers(_ours("shampoo", list(model.parameters())))

        def train(model, opt, first):
            for step in range(first, first + 2):
                fabric.backward(loss_of(model, batch(step, dp)))
                opt.step()
                opt.zero_grad()

        model, opt = make()
        train(model, opt, 0)
        fabric.save(root / f"fabric-{name}", {"model": model, "optimizer": opt, "step": 2})
        train(model, opt, 2)
        fresh, fresh_opt = make()
        rest = fabric.load(root / f"fabric-{name}", {"model": fresh, "optimizer": fresh_opt})
        train(fresh, fresh_opt, 2)
        a = {k: p.detach() for k, p in model.named_parameters()}
        b = {k: p.detach() for k, p in fresh.named_parameters()}
        sa = {f"{k}/{n}": v for k, p in model.named_parameters() for n, v in opt.state.get(p, {}).items()}
        sb = {f"{k}/{n}": v for k, p in fresh.named_parameters()
              for n, v in fresh_opt.state.get(p, {}).items()}
        fabric.strategy.wait_checkpoints()  # the async save published before its files are compared
        out[name] = {"weights": _diff(a, b), "state": _diff(sa, sb), "states": len(sa), "rest": rest}
    dist.barrier()
    if dist.get_rank() == 0:
        a, b = _read_dir(root / "fabric-sync"), _read_dir(root / "fabric-async")
        out["async_same"] = (len(a), _diff(a, b))
    return out


def _cli(root: Path) -> dict:
    """``examples/tensor_parallel.yaml`` run through LightningCLI (``fit``, 2 steps): the strategy it
    builds, the mesh the model was parallelized on, and the steps it ran."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.cli import cli_main

    yaml = Path(__file__).resolve().parents[2] / "examples" / "tensor_parallel.yaml"
    cli = cli_main(["fit", "--config", str(yaml), "--trainer.max_steps=2", f"--trainer.default_root_dir={root / 'cli'}"])
    t = cli.trainer
    tp = mf.get_comm_stats(cli.model).get("tp", {})
    return {"steps": t.global_step, "tp": t.strategy.config.tensor_parallel_size,
            "names": tuple(t.strategy.device_mesh.mesh_dim_names), "tp_bytes": tp.get("sent", 0) + tp.get("recv", 0)}


def worker(rank: int, world: int) -> dict:
    """Every scenario on one rank of the launch, in an order every rank follows."""
    import shutil

    root = _shared_dir()
    try:
        return {"trainer": _trainer(root), "averaging": _averaging(root), "fabric": _fabric(root), "cli": _cli(root)}
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
