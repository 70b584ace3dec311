"""Modules of a unit called outside the unit's forward (issue 36, section 2), on the shared
2-rank pool in one run.

**Lightning's GAN example**, switched from ``strategy="ddp"`` to ``"matrix_fsdp"`` and nothing
else: no ``wrap_policy``, no knowledge of units.

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

**The runtime alone** (``matrix_shard``, against DDP written by hand: every gradient all-reduced
and averaged): a block's submodule called by itself, also under activation checkpointing
(non-reentrant and reentrant) and without grad; the root's head called again after the root's
forward returned, in the same loss and in a second backward after the first had resharded it.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_matrixfsdp as mf
from helpers.lit import cpu_trainer, full_numpy
from helpers.models import TinyLM, batch_for, lm_loss

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
    """Lightning's basic GAN example, small: generator step, then discriminator step. Beyond the
    example, a parameter of the LightningModule itself (a logit temperature, the discriminator
    optimizer's) read directly in both steps: frozen in the generator's by the toggle while the
    root unit, which holds it, is materialized."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = Net(Z, D, norm=True)
        self.discriminator = Net(D, 1, norm=False)
        self.temperature = nn.Parameter(torch.ones(()))
        self.losses: list[float] = []

    def judge(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.discriminator(x) / self.temperature, target)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        seed = 1000 * self.current_epoch + 10 * batch_idx + self.global_rank
        z = torch.randn(len(batch), Z, generator=torch.Generator().manual_seed(seed))
        valid, fake = torch.ones(len(batch), 1), torch.zeros(len(batch), 1)

        self.toggle_optimizer(g_opt)
        g_loss = self.judge(torch.tanh(self.generator(z)), valid)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)

        self.toggle_optimizer(d_opt)
        real_loss = self.judge(batch, valid)
        generated = torch.tanh(self.generator(z)).detach()  # generated again, as the example does
        fake_loss = self.judge(generated, fake)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        self.losses += [g_loss.item(), d_loss.item()]

    def configure_optimizers(self):
        return (mf.Muon(self.generator.parameters(), lr=0.05, adamw_lr=0.01),
                torch.optim.AdamW([*self.discriminator.parameters(), self.temperature], lr=0.01))

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


# ---------------------------------------------------------------------- the runtime alone
def _step(model: nn.Module, case: str, rank: int, reduce=lambda: None, probe=lambda: None) -> list[torch.Tensor]:
    """One case's forward and backward(s) on ``model`` (sharded, or the reference with ``reduce``
    after each backward; ``probe`` between a block's forward and its backward); the outputs."""
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(2, 32, generator=g, requires_grad=True)
    fc = model.blocks[0].fc
    idx = batch_for(0, rank)
    if case == "backward_in_root_forward":  # a manual step's shape: the root's own parameter, backward inside
        def body(i: torch.Tensor) -> None:
            (model.pos * x[0]).square().sum().backward()
            reduce()

        model.forward = body
        model(idx)
        return [x.grad]
    if case == "after_a_raise":  # a call that raised leaves nothing behind (the model trains on as DDP)
        try:
            fc(torch.zeros(2, 7))
        except RuntimeError:
            pass
    if case in ("block_submodule", "after_a_raise"):
        outs = [fc(x)]
    elif case == "checkpointed":
        outs = [checkpoint(fc, x, use_reentrant=False)]
    elif case == "checkpointed_reentrant":
        outs = [checkpoint(fc, x, use_reentrant=True)]
    elif case == "no_grad":
        with torch.no_grad():
            return [fc(x)]
    if case == "head_after_root":  # the head in the root's forward and once more after it, one loss
        outs = [model(idx), model.head(x)]
        (lm_loss(outs[0], idx) + outs[1].square().mean()).backward()
        reduce()
        return outs
    if case == "second_backward":  # the second backward needs the head's weight the first resharded
        outs = [model(idx), model.head(x)]
        lm_loss(outs[0], idx).backward()
        reduce()
        grads = {n: p.grad for n, p in model.named_parameters()}  # DDP: the sum of each backward's mean
        for p in model.parameters():
            p.grad = None
        outs[1].square().mean().backward()
        reduce()
        for n, p in model.named_parameters():
            if grads[n] is not None:
                p.grad = grads[n] if p.grad is None else grads[n] + p.grad
        return outs
    probe()
    outs[0].square().mean().backward()
    reduce()
    return outs + [x.grad]


RUNTIME_CASES = ["block_submodule", "checkpointed", "checkpointed_reentrant", "no_grad", "head_after_root",
                 "second_backward", "backward_in_root_forward", "after_a_raise"]


def _runtime_scenario(rank: int, world: int) -> dict:
    from helpers.oracle import allreduce_mean_grads
    from lightning_matrixfsdp.runtime.tags import state_of

    out = {}
    for case in RUNTIME_CASES:
        torch.manual_seed(0)
        ref = TinyLM()
        model = mf.matrix_shard(copy.deepcopy(ref))
        units = state_of(model).units
        after_call: list[str] = []
        ours = _step(model, case, rank, probe=lambda: after_call.extend(u.fqn for u in units if u.is_materialized))
        want = _step(ref, case, rank, lambda: allreduce_mean_grads(ref))
        mine = dict(model.named_parameters())
        grads = {n: (mine[n].grad, p.grad) for n, p in ref.named_parameters() if mine[n].numel()}
        out[case] = {"outputs": all(torch.equal(a, b) for a, b in zip(ours, want)),
                     "grads": sorted(n for n, (a, b) in grads.items()
                                     if (a is None) != (b is None) or (a is not None and not torch.equal(a, b))),
                     "got": sorted(n for n, (a, _) in grads.items() if a is not None),
                     "after_call": after_call,
                     "left_materialized": [u.fqn for u in units if u.is_materialized]}
    return out


def _replica_scenario(rank: int) -> dict:
    """HSDP with ``replica_split`` (one rank per shard group, two replicas), a bare loop: each
    step calls only a block's submodule and steps; the replica that did not step a weight must
    have it from the one that did before the next call, which no root forward starts."""
    torch.manual_seed(0)
    ref = TinyLM()
    model = mf.matrix_shard(copy.deepcopy(ref), shard_size=1, replica_split=True)
    opts = [mf.route_optimizer(mf.Muon(model.parameters())), mf.Muon(ref.parameters())]
    from helpers.oracle import allreduce_mean_grads

    outs: list[list[torch.Tensor]] = [[], []]
    for step in range(3):
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        for i, m in enumerate((model, ref)):
            y = m.blocks[0].fc(x)
            outs[i].append(y.detach())
            y.square().mean().backward()
            if m is ref:
                allreduce_mean_grads(ref)
            opts[i].step()
            opts[i].zero_grad()
    return {"outputs": [torch.equal(a, b) for a, b in zip(*outs)]}


def _worker(rank: int, world: int, root: str) -> dict:
    out = {"runtime": _runtime_scenario(rank, world), "replicas": _replica_scenario(rank),
           "ddp": _fit("ddp_find_unused_parameters_true", world, os.path.join(root, "ddp")),
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


@pytest.mark.parametrize("case", RUNTIME_CASES)
def test_a_module_called_outside_its_unit_runs_as_a_call_of_the_unit(results, case):
    """Before: ``RuntimeError: Linear holding 'blocks.0.fc.weight' ran on rank 1 while its unit
    'blocks.0' was not materialized``."""
    for rank, r in enumerate(results):
        res = r["runtime"][case]
        assert res["outputs"], "outputs differ from the unsharded model's"
        assert res["grads"] == [], f"rank {rank}: gradients differ from DDP's: {res['grads']}"
        # a block reshards when the call returns (its rule), and everything after backward
        assert res["after_call"] == [] and res["left_materialized"] == [], res
    if case != "no_grad":  # the owners got them (a check that can fail: every rank's list empty)
        assert any(r["runtime"][case]["got"] for r in results), "no owner got a gradient"


def test_a_call_outside_every_forward_sees_the_other_replicas_step(results):
    for r in results:
        assert r["replicas"]["outputs"] == [True, True, True], r["replicas"]
