"""MatrixFSDPStrategy under the Lightning Trainer equals DDP Muon (tests/helpers/lit.py replays the batches)."""

import pytest
import torch

import lightning_matrixfsdp as mf
from helpers.lit import trainer_worker
from helpers.models import Block
from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS


def _exact(res):
    for r in res:
        assert r["losses"] == r["oracle_losses"], (r["losses"], r["oracle_losses"])
        assert r["param_diff"] == 0.0, f"{r['worst_param']} differs by {r['param_diff']}"
        assert r["distinct_batches"], "ranks saw the same batches: data-parallel size is wrong"


def test_registered_name_matches_ddp_muon_two_processes(dist_pools):
    res = dist_pools(2).run(trainer_worker, {"steps": 5, "summary": True})
    _exact(res)
    assert res[0]["steps"] == 5 and res[0]["optimizer"] == "Muon"
    # Lightning's DistributedSampler gives every rank the same count: no per-step uneven check.
    assert res[0]["uneven_check"] is False
    total, expected = res[0]["summary"]
    assert total == expected, "model summary must count global parameters"
    # No thread of ours outlives fit (Lightning's own test suite fails a test that leaves one).
    for r in res:
        assert "matrix-fsdp-wait" not in r["threads"], r["threads"]


def test_instance_with_options_three_processes(dist_pools):
    strategy = {"planner": "cost_aware", "collective": "p2p", "activation_checkpointing_policy": {Block},
                "wrap_policy": {Block}}
    _exact(dist_pools(3).run(trainer_worker, {"steps": 5, "strategy": strategy}))


def test_zero_missing_grads_with_experts_routed_per_rank(dist_pools):
    """MoE-style routing that differs between ranks trains under the strategy (it hangs
    without the option) and equals DDP with zeros for missing gradients."""
    from helpers import equiv

    res = dist_pools(2).run(trainer_worker, {"steps": 4, "model": {"experts": 2}, "route": equiv.route_by_rank,
                                             "strategy": {"zero_missing_grads": True}})
    _exact(res)


def test_gradient_clipping_by_global_norm(dist_pools):
    _exact(dist_pools(2).run(trainer_worker, {"steps": 5, "trainer": {"gradient_clip_val": 0.3}}))


def test_gradient_clipping_by_value(dist_pools):
    _exact(dist_pools(2).run(trainer_worker, {"steps": 4, "trainer": {"gradient_clip_val": 1e-3,
                                                                     "gradient_clip_algorithm": "value"}}))


@pytest.mark.parametrize("no_sync", [False, True])
def test_gradient_accumulation(no_sync, dist_pools):
    res = dist_pools(2).run(trainer_worker, {"steps": 3, "strategy": {"accumulation_no_sync": no_sync},
                                             "trainer": {"accumulate_grad_batches": 2}})
    _exact(res)
    assert len(res[0]["losses"]) == 6


def test_optimizer_option_replaces_an_existing_modules_sgd_with_muon(dist_pools):
    a = ADAMW_DEFAULTS
    opt = dict(adamw_betas=a["betas"], adamw_eps=a["eps"], **MUON_DEFAULTS)
    # the factory receives bare parameters: by shape, every 2-D tensor on Muon (the oracle too)
    res = dist_pools(2).run(trainer_worker, {"steps": 4, "module_optimizer": "sgd", "strategy": {"optimizer": opt},
                                             "oracle_all_2d": True})
    _exact(res)
    assert res[0]["optimizer"] == "Muon"


def every_matrix(fqn: str, p) -> bool:
    """A matrix_filter: every 2-D parameter is a matrix role, so Muon(model) steps the embeddings too."""
    return True


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-true", "64-true"])
def test_other_precisions_train(precision, dist_pools):
    cfg = {"steps": 4, "trainer": {"precision": precision}}  # strategy="matrix_fsdp"
    if precision == "16-true":  # AdamW's default eps 1e-8 is 0 in float16 (see the warning test)
        a = ADAMW_DEFAULTS
        cfg["strategy"] = {"optimizer": dict(adamw_betas=a["betas"], adamw_eps=1e-4, **MUON_DEFAULTS),
                           # every 2-D parameter on Muon, the oracle too: by default the embeddings and head
                           # train with AdamW, whose second moment of their small gradients underflows in
                           # float16 (eps-bound first steps: 1.4 from the float32 oracle at this lr, 0.15 at
                           # adamw_lr=3e-3, instead of < 0.1); this test is about the precision, not the roles
                           "matrix_filter": every_matrix}
        cfg["oracle_all_2d"] = True
    res = dist_pools(2).run(trainer_worker, cfg)
    for r in res:
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        # not bitwise (other dtypes), but the oracle in float32 stays close
        assert abs(r["losses"][-1] - r["oracle_losses"][-1]) < 0.1


def test_bad_options_are_refused_clearly():
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        mf.MatrixFSDPStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="unknown planner"):
        mf.MatrixFSDPStrategy(planner="magic")
    with pytest.raises(ValueError, match="unknown collective"):
        mf.MatrixFSDPStrategy(collective="magic")
    with pytest.raises(ValueError, match="not a dtype"):
        mf.MatrixFSDPStrategy(param_dtype="float13")
    from lightning.pytorch.plugins.precision import MixedPrecision

    # (on CPU the Trainer turns 16-mixed into bf16-mixed, so hand the plugin over as a GPU run would)
    with pytest.raises(ValueError, match="16-mixed"):
        mf.MatrixFSDPStrategy().precision_plugin = MixedPrecision("16-mixed", device="cpu")
    # Lightning's own connector refuses 64-true for a ModelParallelStrategy instance; the package lets it
    # through for its strategy (trains bitwise DDP's float64: test_callbacks_walk.py), and only for it
    from lightning import Trainer
    from lightning.pytorch.plugins.precision import DoublePrecision
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = Trainer(strategy=mf.MatrixFSDPStrategy(), precision="64-true", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy.precision_plugin, DoublePrecision)
    with pytest.raises(ValueError, match="64-true"):
        Trainer(strategy=ModelParallelStrategy(), precision="64-true", accelerator="cpu", devices=2, logger=False)


def test_configure_model_calling_matrix_shard_is_respected(dist_pools):
    res = dist_pools(2).run(trainer_worker, {"steps": 3, "self_shard": True})
    _exact(res)
    assert res[0]["planner"] == "scope_greedy"  # the module's own choice, not the strategy default


@pytest.mark.parametrize("scheduler", [True, "warmup"], ids=["decay", "warmup"])
def test_optimizer_replacement_keeps_the_modules_lr_schedule(scheduler, dist_pools):
    a = ADAMW_DEFAULTS
    opt = dict(adamw_betas=a["betas"], adamw_eps=a["eps"], **MUON_DEFAULTS)
    res = dist_pools(2).run(trainer_worker, {"steps": 4, "module_optimizer": "sgd", "scheduler": scheduler,
                                             "oracle_all_2d": True,  # the factory's bare parameters: by shape
                                             "strategy": {"optimizer": opt}})
    _exact(res)  # the oracle runs the same LambdaLR on Muon's own lr (0.02), not on SGD's 0.1
    factor = (lambda s: 0.5 ** s) if scheduler is True else (lambda s: (s + 1) / 4)
    assert res[0]["lrs"] == pytest.approx([MUON_DEFAULTS["lr"] * factor(s) for s in range(4)], rel=1e-12)
    # The scheduler moved to the new optimizer must not think step() was overridden.
    assert not [w for r in res for w in r["warnings"] if "overridden" in w], res[0]["warnings"]


def test_plan_and_traffic_are_logged(tmp_path, dist_pools):
    res = dist_pools(2).run(trainer_worker, {"steps": 4, "csv_logger": True, "root": str(tmp_path),
                                             "trainer": {"log_every_n_steps": 2}})
    _exact(res)
    import csv

    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    logged = [r for r in rows if r.get("matrix_fsdp/optimizer_step_ms")]
    assert len(logged) == 2, rows
    for r in logged:
        assert float(r["matrix_fsdp/optimizer_step_ms"]) > 0
        assert float(r["matrix_fsdp/materialize_MB"]) > 0 and float(r["matrix_fsdp/reduce_MB"]) > 0
        assert float(r["matrix_fsdp/optimizer_step_MB"]) == 0.0


def _fsdp2_module_worker(rank, world):
    from lightning.pytorch import Trainer
    from torch.distributed.fsdp import fully_shard

    from helpers.lit import LitTiny

    class FSDP2Module(LitTiny):
        def configure_model(self):
            fully_shard(self.model, mesh=self.device_mesh)

    try:
        Trainer(strategy="matrix_fsdp", accelerator="cpu", devices=world, max_steps=1, logger=False,
                enable_checkpointing=False, enable_progress_bar=False).fit(FSDP2Module())
    except TypeError as e:
        return str(e)
    return "no error"


def test_fsdp2_wrapped_module_is_refused(dist_pools):
    for msg in dist_pools(2).run(_fsdp2_module_worker):
        assert "FSDP2" in msg and "matrix_shard" in msg, msg


@pytest.mark.parametrize("cls", ["SOAP", "Shampoo"])
def test_matrix_optimizers_through_the_strategy_option(cls, dist_pools):
    pytest.importorskip("pytorch_optimizer")
    res = dist_pools(2).run(trainer_worker, {"steps": 3, "module_optimizer": "sgd",
                                             "strategy": {"optimizer": {"class": cls, "lr": 1e-3}}})
    for r in res:
        assert r["optimizer"] == cls
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["losses"][0] == r["oracle_losses"][0]  # same model, same first batch


def test_plan_is_logged_and_a_second_import_is_harmless(caplog):
    import importlib
    import logging

    importlib.reload(mf)  # registers again: must not raise
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["matrix_fsdp"]["strategy"] is mf.MatrixFSDPStrategy
    from lightning.pytorch import Trainer

    from helpers.lit import LitTiny

    import torch.distributed as dist

    try:
        with caplog.at_level(logging.INFO):
            Trainer(strategy="matrix_fsdp", accelerator="cpu", devices=1, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False).fit(LitTiny())
    finally:  # the Trainer left a 1-process group in this pytest process
        if dist.is_initialized():
            dist.destroy_process_group()
    assert "MatrixFSDP plan" in caplog.text and "imbalance" in caplog.text


_THREADS_SCRIPT = '''
import json, os, sys, torch
from lightning.pytorch import Callback, LightningModule, Trainer
import lightning_matrixfsdp  # registers "matrix_fsdp"

class Tiny(LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(8, 8)
    def training_step(self, batch, _):
        return self.w(batch).pow(2).mean()
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Record(Callback):
    def on_train_start(self, trainer, module):
        with open(os.path.join(sys.argv[1], f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}, f)

Trainer(accelerator="cpu", devices=2, strategy="matrix_fsdp", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Record()]).fit(Tiny())
'''


def test_every_launched_rank_gets_lightnings_thread_count(tmp_path):
    """Children of the strategy's own launch set OMP threads as DDP's do (they used to keep
    one thread per core and oversubscribe the CPU)."""
    import json
    import subprocess
    import sys

    from conftest import clean_env
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    script = tmp_path / "threads.py"
    script.write_text(_THREADS_SCRIPT)
    env = clean_env()
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _suggested_max_num_threads(2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"threads": expected, "omp": str(expected)}, (rank, got)
