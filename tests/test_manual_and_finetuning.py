"""Manual optimization (a GAN with two optimizers), BackboneFinetuning with resume, and
clipping under HSDP: each run under ``strategy="matrix_fsdp"`` and Lightning's own DDP in
the same process group, and compared."""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import lightning_matrixfsdp as mf
from helpers.lit import cpu_trainer, full_numpy
from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS

CLIP = 0.05


def _muon(params: Any) -> torch.optim.Optimizer:
    a = ADAMW_DEFAULTS
    return mf.Muon(params, adamw_betas=a["betas"], adamw_eps=a["eps"], **MUON_DEFAULTS)


def _same_weights(ours: dict, ddp: dict) -> None:
    assert ours.keys() == ddp.keys()
    for n, w in ddp.items():
        a, b = torch.from_numpy(ours[n]), torch.from_numpy(w)
        assert torch.equal(a, b), f"{n} differs from DDP by {(a - b).abs().max().item():.3g}"


# ---------------------------------------------------------------------- manual optimization: a GAN
class Reals(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, d: int = 8) -> None:
        self.x = torch.randn(n, d, generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class GAN(LightningModule):
    """Generator and discriminator, each with its own Muon; manual optimization with
    toggle_optimizer, manual_backward, clip_gradients and a step every 2 batches."""

    def __init__(self, clip: float = CLIP, z: int = 4, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.clip = clip
        self.z = z
        self.gen = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, d))
        self.disc = nn.Sequential(nn.Linear(d, h), nn.LayerNorm(h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                                  nn.Linear(h, 1))
        self.losses: list[float] = []
        self.norms: list[float] = []  # under DDP: the norms the clip met (the test checks it clipped)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        noise = torch.randn(len(batch), self.z,
                            generator=torch.Generator().manual_seed(100 * batch_idx + self.global_rank))
        ones, zeros = torch.ones(len(batch), 1), torch.zeros(len(batch), 1)
        # both optimizers accumulate over 2 batches; only the window's last backward syncs
        last = (batch_idx + 1) % 2 == 0

        self.toggle_optimizer(d_opt)
        with self.trainer.strategy.block_backward_sync():
            fake = self.gen(noise).detach()
            d_loss = (F.binary_cross_entropy_with_logits(self.disc(batch), ones)
                      + F.binary_cross_entropy_with_logits(self.disc(fake), zeros)) / 2
            self.manual_backward(d_loss / 2)
        self.untoggle_optimizer(d_opt)

        with g_opt.toggle_model(sync_grad=last):  # toggle_optimizer / untoggle_optimizer inside
            g_loss = F.binary_cross_entropy_with_logits(self.disc(self.gen(noise)), ones)
            self.manual_backward(g_loss / 2)
        if last:
            for opt in (d_opt, g_opt):
                if not mf.is_matrix_sharded(self):
                    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
                    self.norms.append(torch.nn.utils.get_total_norm(grads).item())
                self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
                opt.step()
                opt.zero_grad()
        self.losses += [d_loss.item(), g_loss.item()]

    def configure_optimizers(self):
        return _muon(self.gen.parameters()), _muon(self.disc.parameters())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Reals(), batch_size=4)


# ---------------------------------------------------------------------- BackboneFinetuning and resume
class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Finetuned(LightningModule):
    """A backbone that BackboneFinetuning freezes, then unfreezes by adding a param group."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return _muon([p for p in self.parameters() if p.requires_grad])

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Pairs(), batch_size=4)


class ResumableBackboneFinetuning(BackboneFinetuning):
    """Lightning 2.6's BackboneFinetuning puts its param groups back on resume but leaves their
    parameters frozen (Lightning issue #21901, under every strategy), so a resumed run could not
    equal an uninterrupted one; this is the fix proposed there (PR #21902): the groups it put
    back train again."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        before = [len(o.param_groups) for o in trainer.optimizers]
        super().on_fit_start(trainer, pl_module)
        for opt, n in zip(trainer.optimizers, before):
            for group in opt.param_groups[n:]:
                for p in group["params"]:
                    p.requires_grad_(True)


class DDPAllParameters(DDPStrategy):
    """DDP that also registers the parameters frozen when it wraps the model. Stock DDP registers
    only those that require grad then, so a backbone unfrozen later trains on each rank's own
    gradients and the ranks drift apart (tried: 0.03 apart after 3 epochs): no reference."""

    def _setup_model(self, model: nn.Module) -> Any:
        frozen = [p for p in model.parameters() if not p.requires_grad]
        for p in frozen:
            p.requires_grad_(True)
        try:
            return super()._setup_model(model)
        finally:
            for p in frozen:
                p.requires_grad_(False)


def _finetune_worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, strategy in (("ddp", lambda: DDPAllParameters(find_unused_parameters=True)),
                           ("mfsdp", lambda: mf.MatrixFSDPStrategy(wrap_policy={nn.Sequential}))):
        for resume in (False, True):
            torch.manual_seed(0)
            model = Finetuned()
            initial = full_numpy(model)
            ckpts = os.path.join(root, name, "ckpt")
            callbacks = [ResumableBackboneFinetuning(unfreeze_backbone_at_epoch=1)]
            if not resume:
                callbacks.append(ModelCheckpoint(dirpath=ckpts, save_top_k=-1, every_n_epochs=1))
            ckpt = os.path.join(ckpts, "epoch=1-step=8.ckpt") if resume else None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = cpu_trainer(strategy(), world, os.path.join(root, name), max_epochs=3, callbacks=callbacks,
                                   enable_checkpointing=not resume)
                trainer.fit(model, ckpt_path=ckpt)
            groups = trainer.optimizers[0].param_groups
            out[(name, resume)] = {"weights": full_numpy(model), "initial": initial, "groups": len(groups),
                                   # every group routed: each rank steps only what it owns
                                   "routed": all(p.numel() > 0 for g in groups for p in g["params"])}
    return out


def test_backbone_finetuning_and_its_resume_equal_ddp(tmp_path, dist_pools):
    """The resume failed: the checkpoint's optimizer had 2 param groups, the run's 1 (the
    callback puts them back in on_fit_start, which DDP runs before the optimizer state loads)."""
    for r in dist_pools(2).run(_finetune_worker, str(tmp_path), timeout=240):
        ref = r[("ddp", False)]
        backbone = [n for n in ref["weights"] if n.startswith("backbone")]
        assert all((ref["weights"][n] != ref["initial"][n]).any() for n in backbone), "the backbone never trained"
        for key in (("ddp", True), ("mfsdp", False), ("mfsdp", True)):
            assert r[key]["groups"] == 2 and r[key]["routed"], key
            _same_weights(r[key]["weights"], ref["weights"])


def _gan_worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, strategy in (("ddp", lambda: "ddp_find_unused_parameters_true"),
                           ("mfsdp", lambda: mf.MatrixFSDPStrategy(wrap_policy={nn.Sequential},
                                                                   accumulation_no_sync=True)),
                           ("mfsdp_sync", lambda: mf.MatrixFSDPStrategy(wrap_policy={nn.Sequential}))):
        torch.manual_seed(0)
        gan = GAN()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpu_trainer(strategy(), world, os.path.join(root, name), max_steps=8).fit(gan)
        out[name] = {"weights": full_numpy(gan), "losses": gan.losses, "norms": gan.norms}
    return out


def test_gan_manual_optimization_equals_ddp(tmp_path, dist_pools):
    """toggle_optimizer died with a gloo abort: over routed param groups each rank froze only the
    parameters it owns. Two optimizers, manual_backward, clip_gradients, accumulation by hand."""
    for r in dist_pools(2).run(_gan_worker, str(tmp_path), timeout=240):
        ddp, ours, synced = r["ddp"], r["mfsdp"], r["mfsdp_sync"]
        assert max(ddp["norms"]) > CLIP, "the clip never acted"
        # accumulation under no-sync, as DDP's toggle_model(sync_grad=False): bitwise
        assert ours["losses"] == ddp["losses"]
        _same_weights(ours["weights"], ddp["weights"])
        # the default reduces every backward (DDP would reduce the accumulated .grad instead):
        # the same sums, rounded differently
        for n, w in ddp["weights"].items():
            assert abs(synced["weights"][n] - w).max() < 1e-6, n


# ---------------------------------------------------------------------- clipping under HSDP
def _clip_worker(rank: int, world: int, root: str) -> dict:
    from helpers.lit import LitTiny

    out = {}
    for name, strategy in (("ddp", lambda: "ddp"), ("hsdp", lambda: mf.MatrixFSDPStrategy(shard_size=1)),
                           ("mfsdp", lambda: mf.MatrixFSDPStrategy(shard_size=2))):
        torch.manual_seed(0)
        lit = LitTiny()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpu_trainer(strategy(), world, os.path.join(root, name), max_steps=4, gradient_clip_val=0.3,
                     limit_val_batches=0).fit(lit)
        out[name] = {"weights": full_numpy(lit), "losses": lit.losses}
    return out


def test_trainer_clipping_equals_ddp_with_and_without_replicas(tmp_path, dist_pools):
    """The clip summed float64 partial squares; DDP's (torch's) norm stacks float32 per-tensor
    norms: at shard_size=1 the weights came out 1.5e-8 from DDP's."""
    for r in dist_pools(2).run(_clip_worker, str(tmp_path), timeout=240):
        for name in ("hsdp", "mfsdp"):
            assert r[name]["losses"] == r["ddp"]["losses"], name
            _same_weights(r[name]["weights"], r["ddp"]["weights"])
