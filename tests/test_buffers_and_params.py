"""Buffers and parameters as DDP has them (issue 24), each case run under Lightning's own DDP and
under matrix_fsdp in the same worker and compared:

- BatchNorm statistics: rank 0's broadcast before forwards (``broadcast_buffers=True``, DDP's
  default) or each rank's own (``False``); ``sync_batchnorm=True`` converts like DDP and is refused
  on the CPU like DDP;
- ranks that build different weights train rank 0's, as DDP broadcasts them when it wraps;
- integer, bool, float64 and complex parameters train or ride along as under DDP; sparse
  gradients are refused when sharding, on every rank;
- pruning (``ModelPruning``, ``torch.nn.utils.prune``) is refused with its cause.
"""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch import nn

import lightning_matrixfsdp as mf
from helpers.lit import gather_full

TIMEOUT = 240


# ---------------------------------------------------------------------- models
class BNBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.bn = nn.BatchNorm1d(2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.bn(self.fc(x))))


class Kinds(nn.Module):
    """Parameters of every dtype DDP carries: integer and bool (frozen), float64 and complex (trained)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.counts = nn.Parameter(torch.arange(d), requires_grad=False)
        self.keep = nn.Parameter(torch.arange(d) % 3 != 0, requires_grad=False)
        self.w64 = nn.Parameter(torch.randn(d, d, dtype=torch.float64) / d)
        self.phase = nn.Parameter(torch.randn(d, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.double() @ self.w64).float() * self.keep + self.counts.float() * 1e-3
        return y + (x * self.phase).real


class Lit(LightningModule):
    """A few blocks (units of their own) and a head; records its validation losses."""

    def __init__(self, kind: str = "bn", d: int = 8, layers: int = 2, optimizer: str = "muon") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Kinds(d) if kind == "kinds" else BNBlock(d) for _ in range(layers))
        self.emb = nn.Embedding(4, d, sparse=True) if kind == "sparse" else None
        self.head = nn.Linear(d, 1)
        self.optimizer_name = optimizer
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = x + self.emb(torch.arange(x.shape[0]) % 4)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(nn.functional.mse_loss(self(x), y).item())

    def _data(self, n: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(n, 8, generator=g) * 3 + 1
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 2), batch_size=4)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._data(16)  # 2 steps per epoch on each of 2 ranks

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._data(8)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.01)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.01)
        return mf.Muon(self.parameters(), lr=0.02, adamw_lr=0.01)


# ---------------------------------------------------------------------- one fit, and DDP beside it
def _fit(strategy: Any, cfg: dict) -> tuple[Lit, Trainer]:
    torch.manual_seed(cfg.get("seed", 0) + (dist.get_rank() if cfg.get("seed_per_rank") else 0))
    lit = Lit(cfg.get("kind", "bn"), optimizer=cfg.get("optimizer", "muon"))
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), logger=False,
                      max_epochs=cfg.get("epochs", 2), enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=cfg.get("sanity", 1),
                      limit_val_batches=cfg.get("val_batches", 1), callbacks=cfg.get("callbacks", []),
                      sync_batchnorm=cfg.get("sync_batchnorm", False), gradient_clip_val=cfg.get("clip"),
                      default_root_dir=cfg["root"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.13's FutureWarning on broadcast_buffers; Lightning's hints
        trainer.fit(lit)
    return lit, trainer


def _state(lit: Lit) -> dict[str, Any]:
    """Full parameters (gathered from their owners), this rank's buffers, validation losses."""
    params = gather_full(lit)
    return {"params": params, "buffers": {n: b.clone() for n, b in lit.named_buffers()}, "val": lit.val_losses}


def ddp_and_matrix_fsdp(rank: int, world: int, cfg: dict) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    ddp_lit, _ = _fit(DDPStrategy(**cfg.get("ddp", {})), cfg)
    ddp = _state(ddp_lit)
    lit, _ = _fit(mf.MatrixFSDPStrategy(log_plan=False, **cfg.get("mf", {})), cfg)
    return {"ddp": ddp, "mf": _state(lit), "stats": mf.get_comm_stats(lit)}


def _assert_equal(res: list[dict]) -> None:
    for rank, r in enumerate(res):
        for what in ("params", "buffers"):
            ddp, mine = r["ddp"][what], r["mf"][what]
            assert ddp.keys() == mine.keys(), (rank, what, sorted(ddp), sorted(mine))
            for name in ddp:
                assert torch.equal(ddp[name], mine[name]), f"rank {rank}: {what} {name} differs from DDP's"
        assert r["ddp"]["val"] == r["mf"]["val"], (rank, r["ddp"]["val"], r["mf"]["val"])


# ---------------------------------------------------------------------- 1. BatchNorm statistics
@pytest.mark.parametrize("broadcast", [True, False])
def test_batchnorm_statistics_like_ddp(broadcast, dist_pools, tmp_path):
    """Running statistics, weights and validation losses (which read the statistics) equal DDP's
    on every rank, bitwise: rank 0's statistics broadcast before forwards (DDP's default), or each
    rank's own with broadcast_buffers=False as DDP(broadcast_buffers=False)."""
    res = dist_pools(2).run(ddp_and_matrix_fsdp, {"root": str(tmp_path), "ddp": {"broadcast_buffers": broadcast},
                                                  "mf": {"broadcast_buffers": broadcast}}, timeout=TIMEOUT)
    _assert_equal(res)
    mean0, mean1 = (r["mf"]["buffers"]["blocks.0.bn.running_mean"] for r in res)
    # the ranks saw different batches: their own statistics differ; the validation that ends the
    # fit started from rank 0's
    assert torch.equal(mean0, mean1) == broadcast
    stats = res[1]["stats"]
    if broadcast:
        assert stats["buffers"]["calls"] > 0 and stats["buffers"]["recv"] > 0, stats
    else:
        assert "buffers" not in stats, stats


def test_sync_batchnorm_converted_and_refused_on_cpu_like_ddp(dist_pools, tmp_path):
    """sync_batchnorm=True converts BatchNorm to SyncBatchNorm as under DDP (it was ignored), and the
    CPU, where torch's SyncBatchNorm cannot run, is refused at setup on every rank, as DDP refuses it."""
    res = dist_pools(2).run(sync_bn_worker, str(tmp_path), timeout=TIMEOUT)
    for r in res:
        assert "SyncBatchNorm layers only work with GPU modules" in r["ddp"], r["ddp"]
        assert "sync_batchnorm=True on the CPU" in r["mf"] and "GPU kernels only" in r["mf"], r["mf"]
        assert r["converted"], "the BatchNorm layers were not converted to SyncBatchNorm"


def sync_bn_worker(rank: int, world: int, root: str) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    out: dict[str, Any] = {}
    for key, strategy in (("ddp", DDPStrategy()), ("mf", mf.MatrixFSDPStrategy(log_plan=False))):
        trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world, logger=False, max_steps=1,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          sync_batchnorm=True, default_root_dir=root)
        lit = Lit()
        try:
            trainer.fit(lit)
            out[key] = "no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[key] = f"{type(e).__name__}: {e}"
        out["converted"] = all(isinstance(b.bn, nn.SyncBatchNorm) for b in lit.blocks)
    return out


# ---------------------------------------------------------------------- 2. different weights per rank
def test_ranks_with_different_weights_train_rank_zeros_like_ddp(dist_pools, tmp_path):
    """Each rank seeds differently before building the model: DDP broadcasts rank 0's parameters
    when it wraps; matrix_shard gives every owner rank 0's, so the trained model equals DDP's."""
    res = dist_pools(2).run(ddp_and_matrix_fsdp, {"root": str(tmp_path), "seed_per_rank": True, "epochs": 1},
                            timeout=TIMEOUT)
    _assert_equal(res)
    moved = res[0]["stats"]["init_sync"]["sent"] + res[1]["stats"]["init_sync"]["recv"]
    assert moved > 1000, res[1]["stats"]  # the roles rank 1 owns came from rank 0


def agree_worker(rank: int, world: int, cfg: dict) -> dict:
    """Bare matrix_shard: the weights every owner keeps, and the bytes the agreement moved."""
    torch.manual_seed(rank if cfg["seed_per_rank"] else 0)
    ctx = torch.device("meta") if cfg.get("meta") else torch.device("cpu")
    with ctx:
        model = nn.Sequential(BNBlock(8), BNBlock(8), nn.Linear(8, 2))
    if not cfg.get("meta"):
        with torch.no_grad():
            for b in model.modules():
                if isinstance(b, nn.BatchNorm1d):
                    b.running_mean.fill_(float(rank))  # per-rank buffers: rank 0's must win
    built = {n: p.detach().clone() for n, p in model.named_parameters()}
    mf.matrix_shard(model, wrap_policy={BNBlock}, shard_size=cfg.get("shard_size"), device="cpu")
    return {"full": gather_full(model), "built": built, "stats": mf.get_comm_stats(model),
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


@pytest.mark.parametrize("case", ["agree", "differ", "hsdp_differ", "meta_hsdp"])
def test_every_owner_takes_rank_zeros_weights_when_sharding(case, dist_pools):
    """The owner of each role (every replica's, under HSDP) ends with global rank 0's values; ranks
    that agree move no parameter bytes (8 bytes of digest per parameter); a meta-device model, which
    its owners initialize, still shards (under HSDP the replicas take replica 0's)."""
    cfg = {"agree": {"seed_per_rank": False}, "differ": {"seed_per_rank": True},
           "hsdp_differ": {"seed_per_rank": True, "shard_size": 1},
           "meta_hsdp": {"seed_per_rank": True, "shard_size": 1, "meta": True}}[case]
    res = dist_pools(2).run(agree_worker, cfg, timeout=TIMEOUT)
    for r in res:
        for name, t in r["full"].items():
            assert torch.equal(t, res[0]["full"][name]), f"{name} differs between ranks"
            if not cfg.get("meta"):
                assert torch.equal(t, res[0]["built"][name]), f"{name} is not rank 0's"
        for name, b in r["buffers"].items():
            assert torch.equal(b, res[0]["buffers"][name]), f"buffer {name} is not rank 0's"
    n_params = len(res[0]["built"])
    received = res[1]["stats"]["init_sync"]["recv"]
    if case == "agree":
        assert received == 8 * n_params, res[1]["stats"]  # the digests, nothing else
    else:
        assert received > 8 * n_params, res[1]["stats"]


def test_digest_sees_one_flipped_bit():
    """The agreement moves only what differs, so its digest must see the smallest difference."""
    from lightning_matrixfsdp.runtime.sync import digests

    t = torch.randn(3, 70_000)  # more than one exact block of the digest
    flipped = t.clone()
    flipped.view(torch.int32)[2, 69_999] ^= 1
    d = digests([t, t.clone(), flipped, t.reshape(70_000, 3), t.double()])
    assert d[0] == d[1] and len(set(d[1:])) == 4, d  # equal copies agree; a bit, the shape, the dtype differ


# ---------------------------------------------------------------------- 3. every kind of parameter
def test_integer_bool_float64_complex_parameters_like_ddp(dist_pools, tmp_path):
    """Frozen int64 and bool parameters ride along, float64 and complex64 ones train, as under DDP
    (AdamW: Muon refuses complex parameters under both), bitwise."""
    res = dist_pools(2).run(ddp_and_matrix_fsdp, {"root": str(tmp_path), "kind": "kinds", "optimizer": "adamw",
                                                  "epochs": 1, "val_batches": 0, "sanity": 0}, timeout=TIMEOUT)
    _assert_equal(res)
    p = res[0]["mf"]["params"]
    assert p["blocks.0.counts"].dtype == torch.int64 and p["blocks.0.keep"].dtype == torch.bool
    assert p["blocks.1.w64"].dtype == torch.float64 and p["blocks.1.phase"].dtype == torch.complex64


def test_global_norm_clip_counts_complex_moduli_like_torch():
    """Lightning's DDP clips with torch.nn.utils.clip_grad_norm_, whose norm of a complex gradient
    is that of its moduli; the owners' clip took the real parts only (``.double()``)."""
    torch.manual_seed(0)
    grads = [torch.randn(5, dtype=torch.complex64), torch.randn(3, 4)]
    ref = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    mine = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, q, g in zip(ref, mine, grads):
        p.grad, q.grad = g.clone(), g.clone()
    for norm_type in (2.0, 3.0):
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type)
        got = mf.clip_grad_norm_(mine, 0.5, norm_type=norm_type)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        for p, q in zip(ref, mine):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=0)


def test_sparse_gradients_refused_when_sharding_on_every_rank(dist_pools, tmp_path):
    """DDP trains nn.Embedding(sparse=True) (its all-reduce takes sparse gradients); the owner
    reduction cannot, so matrix_shard refuses it on every rank, naming the parameter."""
    res = dist_pools(2).run(sparse_worker, str(tmp_path), timeout=TIMEOUT)
    for r in res:
        assert r["ddp"] == "trained", r["ddp"]
        assert "MatrixShardError: parameter 'emb.weight' belongs to Embedding(sparse=True)" in r["mf"], r["mf"]
        assert "sparse=False" in r["mf"]


def sparse_worker(rank: int, world: int, root: str) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    cfg = {"root": root, "kind": "sparse", "optimizer": "sgd", "epochs": 1, "val_batches": 0, "sanity": 0}
    out = {}
    for key, strategy in (("ddp", DDPStrategy()), ("mf", mf.MatrixFSDPStrategy(log_plan=False))):
        try:
            _fit(strategy, cfg)
            out[key] = "trained"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[key] = f"{type(e).__name__}: {e}"
    return out


# ---------------------------------------------------------------------- 4. pruning
def test_model_pruning_refused_with_its_cause(dist_pools, tmp_path):
    """ModelPruning trains under DDP; under matrix_fsdp it is refused at setup on every rank, and
    torch.nn.utils.prune on a sharded model is refused at the prune call, naming the weight."""
    res = dist_pools(2).run(pruning_worker, str(tmp_path), timeout=TIMEOUT)
    for r in res:
        assert r["ddp"] == "pruned", r["ddp"]
        assert "ModelPruning is not supported by strategy='matrix_fsdp'" in r["mf"], r["mf"]
        assert "pruning 'blocks.0.fc.weight' (torch.nn.utils.prune" in r["prune"], r["prune"]
        assert r["untouched"], "the refused prune changed the module"


def pruning_worker(rank: int, world: int, root: str) -> dict:
    from lightning.pytorch.callbacks import ModelPruning
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.utils import prune

    out: dict[str, Any] = {}
    for key, strategy in (("ddp", DDPStrategy()), ("mf", mf.MatrixFSDPStrategy(log_plan=False))):
        cb = ModelPruning("l1_unstructured", amount=0.5, verbose=0)
        try:
            lit, _ = _fit(strategy, {"root": root, "epochs": 1, "val_batches": 0, "sanity": 0, "callbacks": [cb]})
            out[key] = "pruned" if lit.blocks[0].fc.weight.eq(0).any() else "not pruned"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[key] = f"{type(e).__name__}: {e}"
    torch.manual_seed(0)
    model = mf.matrix_shard(Lit(), wrap_policy={BNBlock})
    try:
        prune.l1_unstructured(model.blocks[0].fc, "weight", amount=0.5)
        out["prune"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["prune"] = f"{type(e).__name__}: {e}"
    fc = model.blocks[0].fc
    out["untouched"] = "weight_orig" not in fc._parameters and "weight_mask" not in fc._buffers
    return out
