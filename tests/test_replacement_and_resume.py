"""Issue 24, side by side with Lightning's DDP in the same test (2 CPU processes):

* ``MatrixFSDPStrategy(optimizer=...)`` keeps every scheduler form Lightning accepts: the
  replacement's learning rates follow the same schedule as a DDP run whose module returns the
  replacement itself (its learning rate in place of the module's);
* ``fit(ckpt_path=...)`` on a checkpoint without the training state is refused as DDP refuses
  it, never restarted with a fresh optimizer; validate on it works; a DDP full checkpoint
  resumes exactly as under DDP;
* ``lightning_matrixfsdp.load_from_checkpoint`` reads the directory ``ModelCheckpoint`` wrote;
* (issue 36) a matrix_fsdp directory resumes under DDP, through the import's wrap of Lightning's
  loader and through ``DirectoryCheckpointIO``, as the uninterrupted matrix_fsdp run (weights,
  optimizer and scheduler states, bitwise), and the plugin alone restores it on one device.

Float32 tolerance where stated: a rescaled schedule computes ``new_lr * (x / module_lr)``
where the DDP run computes ``x`` on the new learning rate, so learning rates agree to a few
ulps (checked at 1e-12 relative) and the weights to float32 rounding (rtol 1e-5, atol 1e-6).
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.optim import lr_scheduler as S

from helpers.lit import LitTiny, TokenData, gather_full
from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS

STEPS = 6  # two batches per epoch: three epochs
MODULE_LR = 0.1  # the module's SGD (replaced under matrix_fsdp)
MUON = dict(adamw_betas=ADAMW_DEFAULTS["betas"], adamw_eps=ADAMW_DEFAULTS["eps"], **MUON_DEFAULTS)  # lr 0.02
TOL = dict(rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ scheduler forms
def _warmup(s: int) -> float:
    return min(1.0, (s + 1) / 3)


def _step_lambda_warmup(opt, base):
    return {"optimizer": opt, "lr_scheduler": {"scheduler": S.LambdaLR(opt, _warmup), "interval": "step"}}


def _epoch_lists(opt, base):  # ([optimizers], [schedulers]): Lightning's default interval, the epoch
    return [opt], [S.StepLR(opt, step_size=1, gamma=0.5)]


def _frequency(opt, base):
    return {"optimizer": opt, "lr_scheduler": {"scheduler": S.ExponentialLR(opt, gamma=0.7), "interval": "step",
                                               "frequency": 2}}


def _plateau(opt, base):  # mode="max" on a falling loss: a reduction at every step, down to min_lr
    sched = S.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0, min_lr=0.3 * base)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "monitor": "synced_loss"}}


def _sequential(opt, base):
    warm = S.LinearLR(opt, start_factor=0.25, total_iters=2)
    cos = S.CosineAnnealingLR(opt, T_max=4, eta_min=0.1 * base)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": S.SequentialLR(opt, [warm, cos], milestones=[2]),
                                               "interval": "step"}}


def _chained(opt, base):
    chain = S.ChainedScheduler([S.ConstantLR(opt, factor=0.5, total_iters=2), S.ExponentialLR(opt, gamma=0.8)])
    return {"optimizer": opt, "lr_scheduler": {"scheduler": chain, "interval": "step"}}


def _one_cycle(opt, base):  # cycles the momentum too (cycle_momentum=True by default)
    sched = S.OneCycleLR(opt, max_lr=base, total_steps=STEPS + 1)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _cosine(opt, base):
    return {"optimizer": opt, "lr_scheduler": {"scheduler": S.CosineAnnealingLR(opt, T_max=3, eta_min=0.2 * base),
                                               "interval": "step"}}


def _cyclic(opt, base):
    sched = S.CyclicLR(opt, base_lr=0.2 * base, max_lr=base, step_size_up=2)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _several(opt, base):  # a warmup every step and a decay every epoch on one optimizer
    return [opt], [{"scheduler": S.LambdaLR(opt, _warmup), "interval": "step"},
                   S.MultiStepLR(opt, milestones=[1, 2], gamma=0.5)]


CASES = {f.__name__.lstrip("_"): f for f in (_step_lambda_warmup, _epoch_lists, _frequency, _plateau, _sequential,
                                             _chained, _one_cycle, _cosine, _cyclic, _several)}


class LitSched(LitTiny):
    """LitTiny with a scheduler form; ``sgd``: the module's optimizer is SGD (replaced), else Muon."""

    def __init__(self, case: str, sgd: bool) -> None:
        super().__init__(optimizer="sgd" if sgd else "muon_bare")
        self.case = case
        self.momenta: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.momenta.append(self.trainer.optimizers[0].param_groups[0].get("momentum"))
        self.log("synced_loss", loss, sync_dist=True)  # the same value on every rank (ReduceLROnPlateau)
        return loss

    def configure_optimizers(self):
        import lightning_matrixfsdp as mf

        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=MODULE_LR, momentum=0.9)
        else:
            # bare parameters, as the optimizer= factory receives them (one group, by shape)
            opt = mf.Muon(self.parameters() if self.optimizer_name == "muon_bare" else self, **MUON)
        return CASES[self.case](opt, opt.param_groups[0]["lr"])


def _trainer(strategy, root, **kw):
    from lightning.pytorch import Trainer

    args = dict(accelerator="cpu", devices=dist.get_world_size(), logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root)
    args.update(kw)
    return Trainer(strategy=strategy, **args)


def _matrix_fsdp(**kw):
    import lightning_matrixfsdp as mf

    return mf.MatrixFSDPStrategy(log_plan=False, **kw)


def _full_params(lit, sharded: bool) -> dict[str, torch.Tensor]:
    return gather_full(lit.model) if sharded else {n: p.detach().clone() for n, p in lit.model.named_parameters()}


def _schedule_worker(rank: int, world: int, cases: list[str], root: str) -> dict:
    import lightning_matrixfsdp as mf

    out = {}
    for case in cases:
        for name in ("ddp", "matrix_fsdp"):
            torch.manual_seed(0)
            lit = LitSched(case, sgd=name == "matrix_fsdp")
            strategy = "ddp" if name == "ddp" else _matrix_fsdp(optimizer=functools.partial(mf.Muon, **MUON))
            trainer = _trainer(strategy, root, max_steps=STEPS, limit_train_batches=2)
            error = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    trainer.fit(lit)
                except Exception as e:  # noqa: BLE001 - reported per case (a collective-free failure)
                    error = f"{type(e).__name__}: {e}"
            out[case, name] = {"error": error, "lrs": lit.lrs, "momenta": lit.momenta, "losses": lit.losses,
                               "params": _full_params(lit, name == "matrix_fsdp"),
                               "schedulers": len(trainer.lr_scheduler_configs),
                               "optimizer": type(trainer.optimizers[0]).__name__,
                               "warnings": [str(w.message) for w in caught]}
    return out


@pytest.fixture(scope="module")
def schedules(dist_pools, tmp_path_factory):
    """Every case on the same two workers, once for the module."""
    return dist_pools(2).run(_schedule_worker, list(CASES), str(tmp_path_factory.mktemp("sched")), timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_replacement_follows_the_schedule_as_ddp(schedules, case):
    for r in schedules:
        ddp, ours = r[case, "ddp"], r[case, "matrix_fsdp"]
        assert ddp["error"] is None and ours["error"] is None, (ddp["error"], ours["error"])
        assert ours["optimizer"] == ddp["optimizer"] == "Muon"
        assert ours["schedulers"] == ddp["schedulers"], [w for w in ours["warnings"] if "dropping" in w]
        assert len(ours["lrs"]) == len(ddp["lrs"]) == STEPS
        assert ours["lrs"] == pytest.approx(ddp["lrs"], rel=1e-12, abs=0), (ours["lrs"], ddp["lrs"])
        assert len(set(ours["lrs"])) > 1, "the case must change the learning rate"
        assert ours["momenta"] == pytest.approx(ddp["momenta"], rel=1e-12, abs=0)
        if ours["lrs"] == ddp["lrs"] and ours["momenta"] == ddp["momenta"]:  # the same hyper-parameters: bitwise
            assert ours["losses"] == ddp["losses"]
            assert all(torch.equal(ours["params"][n], t) for n, t in ddp["params"].items()), case
            continue
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), **TOL)
        for n, t in ddp["params"].items():
            torch.testing.assert_close(ours["params"][n], t, **TOL, msg=f"{case}: {n}")


# ------------------------------------------------------------------ schedulers that cannot follow
class _DuckScheduler:
    """Not a torch LRScheduler (Lightning accepts any object with step/state_dict/load_state_dict)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def step(self, *args) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] *= 0.5

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class LitDropped(LitTiny):
    def __init__(self, form: str) -> None:
        super().__init__(optimizer="sgd")
        self.form = form

    def configure_optimizers(self):
        if self.form == "duck":
            opt = torch.optim.SGD(self.parameters(), lr=MODULE_LR)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": _DuckScheduler(opt), "interval": "step"}}
        decay = [p for p in self.parameters() if p.ndim == 2]
        opt = torch.optim.SGD([{"params": decay}, {"params": [p for p in self.parameters() if p.ndim != 2]}],
                              lr=MODULE_LR)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": S.StepLR(opt, 1, 0.5), "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric) -> None:  # what Lightning asks of a non-torch scheduler
        scheduler.step()


def _dropped_worker(rank: int, world: int, root: str) -> dict:
    import lightning_matrixfsdp as mf

    out = {}
    for form in ("duck", "groups"):
        torch.manual_seed(0)
        lit = LitDropped(form)
        trainer = _trainer(_matrix_fsdp(optimizer=functools.partial(mf.Muon, **MUON)), root, max_steps=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(lit)
        out[form] = {"lrs": lit.lrs, "schedulers": len(trainer.lr_scheduler_configs),
                     "warnings": [str(w.message) for w in caught if "dropping" in str(w.message)]}
    return out


def test_a_scheduler_that_cannot_follow_is_dropped_with_the_reason(dist_pools, tmp_path):
    res = dist_pools(2).run(_dropped_worker, str(tmp_path), timeout=300)
    for r in res[:1]:  # rank_zero_warn
        duck, groups = r["duck"], r["groups"]
        assert duck["schedulers"] == groups["schedulers"] == 0
        assert duck["lrs"] == groups["lrs"] == [MUON["lr"]] * 3  # the replacement's own learning rate
        assert any("_DuckScheduler is not a torch.optim.lr_scheduler.LRScheduler" in w for w in duck["warnings"])
        assert any("has 2 param group(s) and the replacement Muon 1" in w for w in groups["warnings"])



# ------------------------------------------------------------------ fit(ckpt_path=...) without the training state
def _attempt(fn, *args, **kwargs):
    """(result, None) or (None, (class name, is a KeyError, message))."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - compared with DDP's below
        return None, (type(e).__name__, isinstance(e, KeyError), str(e))


def _strategy(name: str, **kw):
    return "ddp" if name == "ddp" else _matrix_fsdp(**kw)


def _resume_worker(rank: int, world: int, root: str) -> dict:
    import lightning_matrixfsdp as mf
    from lightning.pytorch.callbacks import ModelCheckpoint

    root_p, out = Path(root), {}
    # two steps under each strategy: a weights-only and a full checkpoint; a plain state_dict
    for name in ("ddp", "matrix_fsdp"):
        torch.manual_seed(0)
        lit = LitTiny(scheduler=True)
        cbs = [ModelCheckpoint(dirpath=root_p / name, filename="weights", save_weights_only=True),
               ModelCheckpoint(dirpath=root_p / name, filename="full", monitor="train_loss")]
        _trainer(_strategy(name), root, max_steps=2, callbacks=cbs, enable_checkpointing=True).fit(lit)
        if name == "ddp" and rank == 0:
            torch.save(lit.state_dict(), root_p / "plain.pt")
    dist.barrier()
    sources = {"ddp_weights": root_p / "ddp" / "weights.ckpt", "our_weights": root_p / "matrix_fsdp" / "weights.ckpt",
               "plain": root_p / "plain.pt"}
    for src, path in sources.items():
        for name in ("ddp", "matrix_fsdp"):
            if name == "ddp" and src == "our_weights":
                continue  # a weights-only directory under DDP: Lightning's own refusal, as for its file
            torch.manual_seed(1)
            lit = LitTiny(scheduler=True)
            before = {n: p.detach().clone() for n, p in lit.named_parameters()}
            trainer = _trainer(_strategy(name), root, max_steps=4)
            _, error = _attempt(trainer.fit, lit, ckpt_path=path)
            untouched = all(torch.equal(before[n], p.detach()) for n, p in lit.named_parameters() if p.numel())
            out["fit", src, name] = {"error": error, "steps": len(lit.losses), "untouched": untouched}
            torch.manual_seed(2)
            val, error = _attempt(_trainer(_strategy(name), root, limit_val_batches=2).validate, LitTiny(),
                                  ckpt_path=path, verbose=False)
            out["validate", src, name] = {"error": error, "val": val[0]["val_loss"] if val else None}
    # back to DDP (issue 36): a matrix_fsdp run of four one-step epochs saving a directory at each epoch's end;
    # the one at step 2 resumed under DDP, without and with the explicit plugin
    torch.manual_seed(0)
    lit = LitOneStep(scheduler=True)
    every = ModelCheckpoint(dirpath=root_p / "back", save_top_k=-1)
    _trainer(_matrix_fsdp(), root, max_steps=4, callbacks=[every], enable_checkpointing=True).fit(lit)
    out["back", "uninterrupted"] = {"error": None, "losses": lit.losses, "lrs": lit.lrs, "seen": lit.seen}
    for name, plugins in (("ddp", []), ("ddp_plugin", [mf.DirectoryCheckpointIO()])):
        torch.manual_seed(1)
        lit = LitOneStep(scheduler=True)
        trainer = _trainer("ddp", root, max_steps=4, plugins=plugins)
        _, error = _attempt(trainer.fit, lit, ckpt_path=root_p / "back" / "epoch=1-step=2.ckpt")
        if error is None:
            trainer.save_checkpoint(root_p / f"back-{name}.ckpt")
        out["back", name] = {"error": error, "losses": lit.losses, "lrs": lit.lrs, "seen": lit.seen}
    # a DDP full checkpoint (one .ckpt file, optimizer and scheduler states) resumed by each strategy
    for name in ("ddp", "matrix_fsdp"):
        torch.manual_seed(1)
        lit = LitTiny(scheduler=True)
        trainer = _trainer(_strategy(name), root, max_steps=4)
        _, error = _attempt(trainer.fit, lit, ckpt_path=root_p / "ddp" / "full.ckpt")
        out["resume", name] = {"error": error, "losses": lit.losses, "lrs": lit.lrs,
                               "params": _full_params(lit, name == "matrix_fsdp")}
    # the replacement's schedule (OneCycleLR, in the optimizer's param groups too) across a resume
    muon = functools.partial(mf.Muon, **MUON)
    for name in ("ddp", "matrix_fsdp"):
        kw = {"optimizer": muon} if name == "matrix_fsdp" else {}
        path = root_p / f"{name}-one-cycle.ckpt"
        torch.manual_seed(0)
        first = LitSched("one_cycle", sgd=name == "matrix_fsdp")
        t = _trainer(_strategy(name, **kw), root, max_steps=2, limit_train_batches=2)
        t.fit(first)
        t.save_checkpoint(path)
        torch.manual_seed(1)
        second = LitSched("one_cycle", sgd=name == "matrix_fsdp")
        _, error = _attempt(_trainer(_strategy(name, **kw), root, max_steps=STEPS, limit_train_batches=2).fit,
                            second, ckpt_path=path)
        out["replaced", name] = {"error": error, "lrs": first.lrs + second.lrs, "momenta": first.momenta + second.momenta,
                                 "params": _full_params(second, name == "matrix_fsdp"), "seen": first.seen + second.seen}
    return out


@pytest.fixture(scope="module")
def resume_root(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def resumed(dist_pools, resume_root):
    return dist_pools(2).run(_resume_worker, str(resume_root), timeout=600)


@pytest.mark.parametrize("src", ["ddp_weights", "our_weights", "plain"])
def test_fit_refuses_a_checkpoint_without_training_state_as_ddp(resumed, src):
    ddp_error = resumed[0]["fit", "ddp_weights" if src == "our_weights" else src, "ddp"]["error"]
    assert ddp_error is not None and ddp_error[1], "DDP refuses it with a KeyError"
    for r in resumed:  # every rank, before anything was written or trained
        got = r["fit", src, "matrix_fsdp"]
        assert got["error"] is not None, f"{src}: fit restarted with a fresh optimizer instead of refusing"
        name, is_key_error, msg = got["error"]
        assert is_key_error and name == "CheckpointNotResumableError", got["error"]
        assert msg.startswith("Trying to restore optimizer state but checkpoint"), msg
        assert ("plain state_dict" if src == "plain" else "save_weights_only=True") in msg, msg
        assert "load_weights" in msg and "validate/test/predict" in msg, msg
        assert got["steps"] == r["fit", src if src != "our_weights" else "ddp_weights", "ddp"]["steps"] == 0
        assert got["untouched"], "the refused load changed the model"


def test_validate_loads_a_weights_only_checkpoint_as_ddp(resumed):
    for r in resumed:
        ddp = r["validate", "ddp_weights", "ddp"]
        assert ddp["error"] is None, ddp["error"]
        assert r["validate", "ddp_weights", "matrix_fsdp"] == ddp  # the same weights: bitwise
        assert r["validate", "plain", "matrix_fsdp"] == ddp  # the same weights as a plain state_dict
        assert r["validate", "plain", "ddp"]["error"][:2] == ("KeyError", True)  # DDP cannot, we can
        ours = r["validate", "our_weights", "matrix_fsdp"]  # our own run's weights
        assert ours["error"] is None and ours["val"] == pytest.approx(ddp["val"], rel=1e-5)


def test_a_ddp_full_checkpoint_resumes_as_under_ddp(resumed):
    for r in resumed:
        ddp, ours = r["resume", "ddp"], r["resume", "matrix_fsdp"]
        assert ddp["error"] is None and ours["error"] is None, (ddp["error"], ours["error"])
        assert len(ours["losses"]) == 2 and ours["losses"] == ddp["losses"]  # steps 2 and 3
        assert ours["lrs"] == ddp["lrs"]  # the scheduler's state came along
        assert all(torch.equal(ours["params"][n], t) for n, t in ddp["params"].items())


class LitOneStep(LitTiny):
    """One batch per rank per epoch (2 ranks): a checkpoint at an epoch's end resumes on exactly the
    batches the uninterrupted run sees next (Lightning restarts a dataloader that was part-way through)."""

    def train_dataloader(self):
        return torch.utils.data.DataLoader(TokenData(4), batch_size=2)


def _hyper(group: dict) -> dict:
    """A param group's hyper-parameters; torch's implementation flags read as booleans, absent as False
    (its ``Optimizer.__setstate__`` fills them in; a checkpoint need not hold them)."""
    flags = ("differentiable", "foreach", "fused", "capturable")
    out = {k: v for k, v in group.items() if k not in ("param_names", *flags)}
    return {**out, **{k: bool(group.get(k)) for k in flags}}


def _same_state(a: dict, b: dict) -> list[str]:
    """Where two checkpoint files' weights, optimizer states and schedulers differ (bitwise)."""
    bad = [k for k in b["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"][k])]
    for i, (oa, ob) in enumerate(zip(a["optimizer_states"], b["optimizer_states"], strict=True)):
        assert oa["state"].keys() == ob["state"].keys()
        bad += [f"optimizer {i} param {j} {n}" for j, st in ob["state"].items() for n, t in st.items()
                if not torch.equal(torch.as_tensor(oa["state"][j][n]), torch.as_tensor(t))]
        bad += [f"optimizer {i} group {j}" for j, (ga, gb) in enumerate(zip(oa["param_groups"], ob["param_groups"]))
                if _hyper(ga) != _hyper(gb)]
    return bad + (["lr_schedulers"] if a["lr_schedulers"] != b["lr_schedulers"] else [])


@pytest.mark.parametrize("how", ["ddp", "ddp_plugin"])
def test_a_matrix_fsdp_directory_resumes_under_ddp_as_the_uninterrupted_run(resumed, resume_root, how):
    """Before: ``Trainer(strategy="ddp").fit(ckpt_path=<directory>)`` stopped with IsADirectoryError on
    every rank. Now steps 2 and 3 under DDP are the uninterrupted matrix_fsdp run's, bit for bit."""
    for r in resumed:
        ref, got = r["back", "uninterrupted"], r["back", how]
        assert got["error"] is None, got["error"]
        assert len(got["losses"]) == 2 and got["losses"] == ref["losses"][2:]
        assert got["lrs"] == ref["lrs"][2:]
        assert all(torch.equal(a, b) for a, b in zip(got["seen"], ref["seen"][2:], strict=True))
    from lightning_matrixfsdp.checkpoint.consolidate import read_directory

    ours = read_directory(resume_root / "back" / "epoch=3-step=4.ckpt")  # the uninterrupted run's last save
    ddp = torch.load(resume_root / f"back-{how}.ckpt", weights_only=False)
    assert ours["global_step"] == ddp["global_step"] == 4
    assert _same_state(ours, ddp) == []  # weights, Muon momenta, AdamW moments and steps, the scheduler


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")  # its ModelCheckpoint: not needed here
def test_directory_checkpoint_io_restores_one_device(resumed, resume_root, monkeypatch, tmp_path):
    """The explicit plugin on its own (the import's wrap of Lightning's loader taken off): one device
    restores the directory's weights and optimizer state; without either, Lightning's IsADirectoryError."""
    import lightning.fabric.plugins.io.torch_io as torch_io
    from lightning.fabric.utilities.cloud_io import _load

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.checkpoint.consolidate import read_directory

    path = resume_root / "back" / "epoch=1-step=2.ckpt"
    monkeypatch.setattr(torch_io, "pl_load", _load)
    with pytest.raises(IsADirectoryError):
        _one_device(path, tmp_path, [])
    lit, trainer = _one_device(path, tmp_path, [mf.DirectoryCheckpointIO()])
    want = read_directory(path)
    got = {"state_dict": lit.state_dict(), "optimizer_states": [o.state_dict() for o in trainer.optimizers],
           "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]}
    assert _same_state(want, got) == []


def _one_device(path, root, plugins):
    from lightning.pytorch import Trainer

    lit = LitOneStep(scheduler=True)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, default_root_dir=root, plugins=plugins)
    trainer.fit(lit, ckpt_path=path)  # at its step: restored, nothing trained
    return lit, trainer


def test_replacement_schedule_survives_a_resume(resumed):
    """Replacement + OneCycleLR saved at step 2 and resumed, against DDP saving and resuming its own Muon."""
    for r in resumed:
        ddp, ours = r["replaced", "ddp"], r["replaced", "matrix_fsdp"]
        assert ddp["error"] is None and ours["error"] is None, (ddp["error"], ours["error"])
        assert len(ours["seen"]) == len(ddp["seen"]) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(ours["seen"], ddp["seen"]))  # Lightning's resume, both
        assert ours["lrs"] == pytest.approx(ddp["lrs"], rel=1e-12, abs=0)
        assert ours["momenta"] == pytest.approx(ddp["momenta"], rel=1e-12, abs=0)
        for n, t in ddp["params"].items():
            torch.testing.assert_close(ours["params"][n], t, **TOL, msg=n)


# ------------------------------------------------------------------ load_from_checkpoint on a directory
class LitHp(LitTiny):
    def __init__(self, tag: str = "default", scheduler: bool = False) -> None:
        super().__init__(scheduler=scheduler)
        self.save_hyperparameters()


def _last_worker(rank: int, world: int, root: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    for name in ("ddp", "matrix_fsdp"):
        torch.manual_seed(0)
        lit = LitHp(tag="trained")
        last = ModelCheckpoint(dirpath=Path(root) / name, save_last=True)
        _trainer(_strategy(name), root, max_steps=3, callbacks=[last], enable_checkpointing=True).fit(lit)


def test_load_from_checkpoint_reads_the_directory_model_checkpoint_wrote(dist_pools, tmp_path):
    import lightning_matrixfsdp as mf

    dist_pools(2).run(_last_worker, str(tmp_path), timeout=300)
    ddp_path, our_path = tmp_path / "ddp" / "last.ckpt", tmp_path / "matrix_fsdp" / "last.ckpt"
    assert ddp_path.is_file() and our_path.is_dir()
    ddp = LitHp.load_from_checkpoint(ddp_path)
    # Lightning's own classmethod reads the directory too (the package wraps its loader)
    own = LitHp.load_from_checkpoint(our_path)
    assert dict(own.hparams) == dict(ddp.hparams) and own.state_dict().keys() == ddp.state_dict().keys()
    assert all(torch.equal(own.state_dict()[k], t) for k, t in ddp.state_dict().items())
    ours = mf.load_from_checkpoint(LitHp, our_path)  # one process, no process group
    assert type(ours) is LitHp and dict(ours.hparams) == dict(ddp.hparams) == {"tag": "trained", "scheduler": False}
    want = ddp.state_dict()
    got = ours.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], t) for k, t in want.items())  # the same training as DDP's: bitwise
    # keyword overrides of the hyper-parameters, as Lightning's; a file goes to Lightning unchanged
    assert mf.load_from_checkpoint(LitHp, our_path, tag="override").hparams.tag == "override"
    again = mf.load_from_checkpoint(LitHp, ddp_path).state_dict()
    assert all(torch.equal(again[k], t) for k, t in want.items())


def test_load_from_checkpoint_refuses_what_is_not_a_lightning_class(tmp_path):
    import lightning_matrixfsdp as mf

    for bad in (object, torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match="must be a LightningModule or LightningDataModule class"):
            mf.load_from_checkpoint(bad, tmp_path)
