"""Lightning's callbacks and CPU precisions under matrix_fsdp equal ``strategy="ddp"`` (issue 24's walk).

Each scenario of ``tests/helpers/walk_scenarios.py`` runs once per strategy on the same 2-process pool (one
fit per strategy combines several callbacks); the tests below compare what each callback
produced. With 2 ranks DDP's all-reduce (``g0/2 + g1/2``) and the owners' reduction
(``(g0 + g1)/2``) round alike, so losses and weights are compared bitwise.
"""
from __future__ import annotations

import os

import pytest
import torch

from helpers.dist import under_both
from helpers.walk_scenarios import PRECISIONS, WalkModule, run_scenario

_cache: dict[str, tuple[dict, dict]] = {}


@pytest.fixture(scope="module")
def walk_root(tmp_path_factory):
    return tmp_path_factory.mktemp("walk")


@pytest.fixture
def scenario(dist_pools, walk_root):
    """``scenario(name) -> (ddp, matrix_fsdp)``: each strategy's result, run once per module."""
    def get(name: str) -> tuple[dict, dict]:
        return under_both(_cache, name, lambda strategy: dist_pools(2).run(
            run_scenario, name, strategy, str(walk_root / name), timeout=300))
    return get


def _same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), \
            f"{what}: {k} differs by {(a[k].double() - b[k].double()).abs().max().item()}"


def _train_equal(ddp: list, mf: list, losses: str = "losses", weights: str = "weights") -> None:
    for rank, (d, m) in enumerate(zip(ddp, mf)):
        assert m[losses] == d[losses], f"rank {rank}: losses differ"
    _same_tensors(ddp[0][weights], mf[0][weights], "final weights")


def _close(a: dict, b: dict, rtol: float, atol: float) -> None:
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.allclose(a[k], b[k], rtol=rtol, atol=atol), \
            f"{k} differs by {(a[k].double() - b[k].double()).abs().max().item()}"


# ---------------------------------------------------------------- one fit with many callbacks
def test_training_with_every_callback_equals_ddp(scenario):
    """Losses and final weights of a fit with accumulation scheduled, a block unfrozen at epoch 1
    and early stopping: BaseFinetuning and GradientAccumulationScheduler follow DDP. The
    optimizer holds every parameter, so BaseFinetuning adds no group under DDP, nor here."""
    ddp, mf = scenario("callbacks")
    _train_equal(ddp, mf)
    for d, m in zip(ddp, mf):
        assert m["groups"] == d["groups"] == 1


def test_finetuning_new_param_group_equals_ddp(scenario):
    """The optimizer over the trainable parameters only: the unfrozen block is a new group on
    every rank (owned parameters only here), trained and LR-logged as under DDP."""
    ddp, mf = scenario("finetune")
    _train_equal(ddp, mf)
    for d, m in zip(ddp, mf):
        assert m["groups"] == d["groups"] == 2
    assert _logged(mf[0]["logs"], "lr-") == _logged(ddp[0]["logs"], "lr-")


def test_model_checkpoint_variants_equal_ddp(scenario):
    """Every ModelCheckpoint variant writes the same names at the same steps, picks the same best
    and top-k with the same scores, keeps the same last, links ``last.ckpt`` alike."""
    ddp, mf = scenario("callbacks")
    for key in ("files", "best", "best_k", "last"):
        assert mf[0][key] == ddp[0][key], key
    files = ddp[0]["files"]
    assert len(files["steps"]) > 2 and len(files["topk"]) == 3, files  # the variants did save
    assert files["link"]["last.ckpt"].startswith("link:"), files["link"]


def test_checkpoint_contents_equal_ddp(scenario, walk_root, tmp_path):
    """The best top-k checkpoint (a directory under matrix_fsdp) holds DDP's weights and loop state."""
    from lightning_matrixfsdp.checkpoint import from_native
    from lightning_matrixfsdp.checkpoint.consolidate import dcp_to_file

    ddp, mf = scenario("callbacks")
    for sub in ("topk", "epochs"):
        name = ddp[0]["best"]["topk"][0] if sub == "topk" else sorted(ddp[0]["files"]["epochs"])[-1]
        theirs = torch.load(walk_root / "callbacks" / "ddp" / sub / name, weights_only=False)
        ours_file = tmp_path / f"{sub}.ckpt"
        dcp_to_file(walk_root / "callbacks" / "matrix_fsdp" / sub / name, ours_file)
        ours = torch.load(ours_file, weights_only=False)
        _same_tensors(theirs["state_dict"], ours["state_dict"], f"{sub}/{name}")
        assert (ours["epoch"], ours["global_step"]) == (theirs["epoch"], theirs["global_step"])
        assert ("optimizer_states" in ours) == ("optimizer_states" in theirs), sub
        if sub == "topk":  # Muon's state, per parameter name (DDP's optimizer holds every parameter)
            names = [[n for n, _ in WalkModule().named_parameters()]]
            _, their_state = from_native(theirs["optimizer_states"][0], names)
            _, our_state = from_native(ours["optimizer_states"][0])
            assert their_state.keys() == our_state.keys() and their_state
            for n in their_state:
                _same_tensors({k: torch.as_tensor(v) for k, v in their_state[n].items()},
                              {k: torch.as_tensor(v) for k, v in our_state[n].items()}, f"optimizer state of {n}")


def test_early_stopping_equals_ddp(scenario):
    ddp, mf = scenario("callbacks")
    assert mf[0]["stop"] == ddp[0]["stop"]
    assert mf[0]["epoch"] == ddp[0]["epoch"] and mf[0]["global_step"] == ddp[0]["global_step"]
    assert ddp[0]["stop"][0] > 0 and ddp[0]["epoch"] < 8, "the run must stop early to test the callback"


def _logged(records: list, prefix: str) -> list:
    return [(step, {k: v for k, v in m.items() if k.startswith(prefix)}) for step, m in records
            if any(k.startswith(prefix) for k in m)]


def test_learning_rate_monitor_equals_ddp(scenario):
    ddp, mf = scenario("callbacks")
    lrs = _logged(ddp[0]["logs"], "lr-")
    assert _logged(mf[0]["logs"], "lr-") == lrs
    assert lrs and _logged(mf[0]["logs"], "lr-Muon/pg2") == []  # no group added (see above)


def test_throughput_and_device_stats_monitors_log_like_ddp(scenario):
    """Same metric names at the same steps; sample and batch counts equal (times differ)."""
    ddp, mf = scenario("callbacks")
    for prefix in ("train/", "validate/", "DeviceStatsMonitor"):
        theirs, ours = _logged(ddp[0]["logs"], prefix), _logged(mf[0]["logs"], prefix)
        assert theirs, prefix
        assert [(s, sorted(m)) for s, m in ours] == [(s, sorted(m)) for s, m in theirs], prefix
    counts = [(s, m["train/samples"], m["train/batches"]) for s, m in _logged(ddp[0]["logs"], "train/")
              if "train/samples" in m]
    assert counts == [(s, m["train/samples"], m["train/batches"]) for s, m in _logged(mf[0]["logs"], "train/")
                      if "train/samples" in m]


# ---------------------------------------------------------------- exceptions, timer, tuner
def test_on_exception_checkpoint_equals_ddp(scenario, walk_root, tmp_path):
    from lightning_matrixfsdp.checkpoint.consolidate import dcp_to_file

    ddp, mf = scenario("exception_timer")
    assert mf[0]["raised"] == ddp[0]["raised"] == "walk: planned failure"
    assert mf[0]["exc_files"] == ddp[0]["exc_files"] and "on_exception.ckpt" in ddp[0]["exc_files"]
    for rank, (d, m) in enumerate(zip(ddp, mf)):
        assert m["exc_losses"] == d["exc_losses"], f"rank {rank}: losses differ"
    theirs = torch.load(walk_root / "exception_timer" / "ddp" / "exc" / "on_exception.ckpt", weights_only=False)
    dcp_to_file(walk_root / "exception_timer" / "matrix_fsdp" / "exc" / "on_exception.ckpt", tmp_path / "e.ckpt")
    ours = torch.load(tmp_path / "e.ckpt", weights_only=False)
    _same_tensors(theirs["state_dict"], ours["state_dict"], "on_exception.ckpt")
    assert ours["global_step"] == theirs["global_step"] == ddp[0]["exc_step"] == 3


def test_timer_stops_like_ddp(scenario):
    ddp, mf = scenario("exception_timer")
    assert mf[0]["timer_step"] == ddp[0]["timer_step"] < 6
    _train_equal(ddp, mf, losses="timer_losses", weights="timer_weights")


def test_lr_find_equals_ddp(scenario):
    """The search sees DDP's losses, restores the weights it started from, and the fit at its
    suggestion trains as DDP's."""
    ddp, mf = scenario("tuner")
    assert mf[0]["results"] == ddp[0]["results"]
    assert mf[0]["suggestion"] == ddp[0]["suggestion"] and mf[0]["lr"] == ddp[0]["lr"]
    _same_tensors(ddp[0]["restored"], mf[0]["restored"], "weights restored after lr_find")
    torch.manual_seed(0)
    initial = {n: p.detach() for n, p in WalkModule().model.named_parameters()}
    _same_tensors(initial, mf[0]["restored"], "lr_find must restore the initial weights")
    _train_equal(ddp, mf)


def test_scale_batch_size_is_refused_alike():
    """Lightning refuses batch-size scaling for every distributed strategy, ours included."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.tuner import Tuner

    import lightning_matrixfsdp  # noqa: F401 - registers the strategy

    messages = []
    for strategy in ("ddp", "matrix_fsdp"):
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
        with pytest.raises(ValueError) as err:
            Tuner(trainer).scale_batch_size(WalkModule())
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "distributed" in messages[0]


# ---------------------------------------------------------------- precision plugins
@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_equals_ddp(scenario, precision):
    ddp, mf = scenario("precision")
    d = [r[precision] for r in ddp]
    m = [r[precision] for r in mf]
    assert "error" not in d[0], d[0]
    assert "error" not in m[0], m[0]
    assert m[0]["dtype"] == d[0]["dtype"]
    if precision != "16-true":
        _train_equal(d, m)
        return
    # float16: DDP divides each gradient by the world size before summing, which rounds the
    # subnormal ones (below 6.1e-5); the owners sum first. Equal losses at every step mean equal
    # weights before the last update; after it the weights differ by a rounding of that one
    # Muon update, bounded here by a quarter of its learning rate (0.02).
    for rank in range(2):
        assert m[rank]["losses"] == d[rank]["losses"]
    _close(d[0]["weights"], m[0]["weights"], rtol=0, atol=5e-3)
