"""Lightning's GAN example, switched from ``strategy="ddp"`` to ``"matrix_fsdp"`` and nothing else:
no ``wrap_policy``, no knowledge of units (issue 36, section 2).

Its shape: manual optimization, ``self.generator(z)`` and ``self.discriminator(x)`` called
straight from ``training_step`` with ``manual_backward`` in between, each network holding an input
and an output ``nn.Linear`` of its own (so in the root unit under the default units) and its
blocks in an ``nn.ModuleList`` (units of their own). The generator steps with our Muon, the
discriminator with ``torch.optim.AdamW``; ``toggle_optimizer``/``untoggle_optimizer``; the
discriminator is called twice (real, then a freshly generated fake, detached).

One run on the shared 2-rank pool, against Lightning's DDP in the same process group with the
same seeds: the losses and weights equal bitwise (two ranks: every sum has one order), also
under HSDP with ``replica_split`` (each role stepped on one replica and sent to the other); and a
run resumed from the checkpoint written after its first epoch ends equal to the uninterrupted run.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import lightning_matrixfsdp as mf
from helpers.lit import cpu_trainer, full_numpy

Z, D, H = 4, 8, 16


class Net(nn.Module):
    """An input layer and an output layer of its own, two blocks in an ``nn.ModuleList``."""

    def __init__(self, d_in: int, d_out: int, norm: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, H)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(H, H), *([nn.BatchNorm1d(H)] if norm else []), nn.LeakyReLU(0.2))
            for _ in range(2))
        self.out = nn.Linear(H, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.leaky_relu(self.inp(x), 0.2)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class Reals(torch.utils.data.Dataset):
    def __init__(self, n: int = 32) -> None:
        self.x = torch.randn(n, D, generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class GAN(LightningModule):
    """Lightning's basic GAN example, small: generator step, then discriminator step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = Net(Z, D, norm=True)
        self.discriminator = Net(D, 1, norm=False)
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        seed = 1000 * self.current_epoch + 10 * batch_idx + self.global_rank
        z = torch.randn(len(batch), Z, generator=torch.Generator().manual_seed(seed))
        valid, fake = torch.ones(len(batch), 1), torch.zeros(len(batch), 1)

        self.toggle_optimizer(g_opt)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(torch.tanh(self.generator(z))), valid)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)

        self.toggle_optimizer(d_opt)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(batch), valid)
        generated = torch.tanh(self.generator(z)).detach()  # generated again, as the example does
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(generated), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        self.losses += [g_loss.item(), d_loss.item()]

    def configure_optimizers(self):
        return (mf.Muon(self.generator.parameters(), lr=0.05, adamw_lr=0.01),
                torch.optim.AdamW(self.discriminator.parameters(), lr=0.01))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Reals(), batch_size=4)


def _fit(strategy, world: int, root: str, ckpt_path: str | None = None, save: bool = False) -> dict:
    torch.manual_seed(0)
    gan = GAN()
    initial = full_numpy(gan)
    callbacks = [ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_top_k=-1, every_n_epochs=1)] if save else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cpu_trainer(strategy, world, root, max_epochs=2, callbacks=callbacks, enable_checkpointing=save)
        trainer.fit(gan, ckpt_path=ckpt_path)
    out = {"weights": full_numpy(gan), "initial": initial, "losses": gan.losses,
           "buffers": {n: b.numpy().copy() for n, b in gan.named_buffers()}}
    if mf.is_matrix_sharded(gan):
        units = {u.fqn: [s.fqn for s in u.shards] for u in mf.get_plan(gan).units}
        out["units"] = units
    return out


def _worker(rank: int, world: int, root: str) -> dict:
    out = {"ddp": _fit("ddp_find_unused_parameters_true", world, os.path.join(root, "ddp")),
           "ours": _fit("matrix_fsdp", world, os.path.join(root, "ours"), save=True),
           "hsdp": _fit(mf.MatrixFSDPStrategy(shard_size=1), world, os.path.join(root, "hsdp"))}
    ckpt = os.path.join(root, "ours", "ckpt", "epoch=0-step=8.ckpt")
    out["resumed"] = _fit("matrix_fsdp", world, os.path.join(root, "resumed"), ckpt_path=ckpt)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, dist_pools):
    return dist_pools(2).run(_worker, str(tmp_path_factory.mktemp("gan")), timeout=300)


def _same(ours: dict, ref: dict, what: str) -> None:
    assert ours.keys() == ref.keys()
    for n, w in ref.items():
        a, b = torch.from_numpy(ours[n]), torch.from_numpy(w)
        assert torch.equal(a, b), f"{what}: {n} differs by {(a - b).abs().max().item():.3g}"


def test_the_networks_own_layers_are_in_the_root_unit(results):
    """What the test is about: the layers called outside any unit's forward are the root's."""
    units = results[0]["ours"]["units"]
    assert "generator.inp.weight" in units[""] and "discriminator.out.weight" in units[""], units
    assert "generator.blocks.0" in units and "discriminator.blocks.1" in units, units


@pytest.mark.parametrize("run", ["ours", "hsdp"])
def test_lightning_gan_trains_as_under_ddp(results, run):
    """Before: ``RuntimeError: Linear holding 'generator.inp.weight' ran on rank 0 while its unit
    '<root>' was not materialized``."""
    for r in results:
        ddp = r["ddp"]
        assert all((ddp["weights"][n] != ddp["initial"][n]).any() for n in ddp["weights"]), "something never trained"
        assert r[run]["losses"] == ddp["losses"]
        _same(r[run]["weights"], ddp["weights"], run)
        _same(r[run]["buffers"], ddp["buffers"], f"{run} buffers")  # BatchNorm: rank 0's, as DDP's


def test_lightning_gan_resumes_as_the_uninterrupted_run(results):
    for r in results:
        whole, resumed = r["ours"], r["resumed"]
        assert resumed["losses"] == whole["losses"][len(whole["losses"]) // 2:]
        _same(resumed["weights"], whole["weights"], "resumed")
