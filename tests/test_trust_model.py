"""What a user meets after (and around) ``fit``, beside DDP on 2 CPU processes, one launch:

* ``model.state_dict()`` of a sharded model is refused clearly (on every rank, and on rank 0
  alone without a hang) instead of giving a partial dict silently; ``full_model`` gives it
  whole, ``local_state_dict`` this rank's part on purpose, checkpoints still work;
* every manual-optimization API Lightning documents, each variant trained under DDP
  (``ddp_find_unused_parameters_true``) and ``matrix_fsdp`` in the same process group and
  compared weight by weight; two backwards through one forward at the runtime level;
* (a second launch, 4 processes) meta-device initialization with tensor parallelism against a
  one-process initialization of the unsplit model.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn

import lightning_matrixfsdp as mf
from helpers.lit import LitTiny, cpu_trainer, full_numpy, gather_full
from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS

CLIP = 0.05


def _error(call) -> Any:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads the type and the words
        return type(e).__name__, str(e)
    return None


# ---------------------------------------------------------------------- state_dict after fit
def _state_dict_scenario(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    lit = LitTiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cpu_trainer("matrix_fsdp", world, root, max_steps=2, limit_val_batches=0)
        trainer.fit(lit)
    out: dict[str, Any] = {"every_rank": _error(lit.state_dict)}
    out["inner"] = _error(lit.model.state_dict)  # the LightningModule's inner model (save_pretrained calls it)
    out["named_parameters"] = {n: tuple(p.shape) for n, p in lit.named_parameters()}
    if rank == 0:  # the common `if trainer.is_global_zero: torch.save(model.state_dict(), ...)`
        out["rank0_alone"] = _error(lambda: torch.save(lit.state_dict(), os.path.join(root, "model.pt")))
    # by hand: every owner broadcasts its tensor (independent of full_model and the checkpoints)
    whole = {f"model.{n}": t for n, t in gather_full(lit.model).items()}
    with mf.full_model(lit, rank=0):
        if rank == 0:
            sd = lit.state_dict()
            out["full_model"] = sorted(k for k in whole if not torch.equal(sd[k], whole[k]))
            out["full_model_keys"] = sorted(sd) == sorted(LitTiny().state_dict())
        else:  # the placeholders here: still refused, naming where the model is
            out["full_model_elsewhere"] = _error(lit.state_dict)
    local = mf.local_state_dict(lit)
    out["local_empty"] = sorted(k for k, v in local.items() if v.numel() == 0)
    out["local_owned"] = sorted(k for k, v in local.items() if v.numel() and k in whole
                                and torch.equal(v, whole[k]))
    # Lightning's own checkpointing reads the model through our index: still works, both formats
    trainer.save_checkpoint(os.path.join(root, "dir.ckpt"))
    trainer.strategy.config = dataclasses.replace(trainer.strategy.config, save_distributed_checkpoint=False)
    trainer.save_checkpoint(os.path.join(root, "one.ckpt"))
    if rank == 0:
        saved = torch.load(os.path.join(root, "one.ckpt"), weights_only=False)["state_dict"]
        out["file"] = sorted(k for k in whole if not torch.equal(saved[k], whole[k]))
    # one rank per shard group (HSDP of replicas): every rank holds every tensor whole
    torch.manual_seed(0)
    plain = LitTiny().model
    ref = {k: v.clone() for k, v in plain.state_dict().items()}
    mf.matrix_shard(plain, shard_size=1)
    sd = plain.state_dict()
    out["replicated"] = sorted(ref) == sorted(sd) and all(torch.equal(ref[k], sd[k]) for k in ref)
    return out


class LitMoE(LightningModule):
    """Embedding, one top-2 MoE block of 4 stacked experts (declared for expert parallelism), head."""

    def __init__(self) -> None:
        from helpers.models import GroupedMoE

        super().__init__()
        self.model = nn.ModuleDict({"embed": nn.Embedding(64, 16), "moe": GroupedMoE(16, 4), "head": nn.Linear(16, 64)})
        mf.parallelize_experts(self.model["moe"].experts)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        m = self.model
        logits = m["head"](m["moe"](m["embed"](batch)))[:, :-1]
        return F.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0)),
                                           batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _expert_scenario(rank: int, world: int, root: str) -> dict:
    """HSDP with a shard group of one rank and expert parallelism: every dense weight whole on every
    rank, each expert stack this rank's [E/EP, ...] slice. Before: state_dict() returned the slices."""
    torch.manual_seed(0)
    lit = LitMoE()
    strategy = mf.MatrixFSDPStrategy(shard_size=1, expert_parallel_size=2, log_plan=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cpu_trainer(strategy, world, root, max_steps=1)
        trainer.fit(lit)
    experts = lit.model["moe"].experts
    out: dict[str, Any] = {"local": tuple(experts.w1.shape), "every_rank": _error(lit.state_dict),
                           "inner": _error(lit.model.state_dict), "experts_module": _error(experts.state_dict)}
    # the way the message names: one file, every stack whole (by hand: the slices gathered in EP rank order)
    whole = {}
    for name in ("w1", "w2", "w3"):
        parts = [torch.empty_like(getattr(experts, name)) for _ in range(world)]
        torch.distributed.all_gather(parts, getattr(experts, name).detach().contiguous())
        whole[f"model.moe.experts.{name}"] = torch.cat(parts)
    trainer.strategy.config = dataclasses.replace(trainer.strategy.config, save_distributed_checkpoint=False)
    trainer.save_checkpoint(os.path.join(root, "one.ckpt"))
    if rank == 0:
        saved = torch.load(os.path.join(root, "one.ckpt"), weights_only=False)["state_dict"]
        out["file"] = {k: tuple(saved[k].shape) for k in whole}
        out["file_differs"] = sorted(k for k, t in whole.items() if not torch.equal(saved[k], t))
    return out


# ---------------------------------------------------------------------- manual optimization
class Reals(torch.utils.data.Dataset):
    def __init__(self, n: int = 24, d: int = 8) -> None:
        self.x = torch.randn(n, d, generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def _muon(params: Any, lr: float = MUON_DEFAULTS["lr"]) -> torch.optim.Optimizer:
    a = ADAMW_DEFAULTS
    return mf.Muon(params, adamw_betas=a["betas"], adamw_eps=a["eps"], **{**MUON_DEFAULTS, "lr": lr})


class ManualGAN(LightningModule):
    """A generator and a discriminator, each with its own optimizer, trained by hand in one of
    the ways Lightning's manual-optimization guide shows (``variant``)."""

    def __init__(self, variant: str, z: int = 4, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.variant = variant
        self.z = z
        self.gen = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, d))
        self.disc = nn.Sequential(nn.Linear(d, h), nn.LayerNorm(h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                                  nn.Linear(h, 1))
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def _noise(self, n: int, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * batch_idx + self.global_rank)
        return torch.randn(n, self.z, generator=g)

    def _d_loss(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(fake), 1)
        return (F.binary_cross_entropy_with_logits(self.disc(real), ones)
                + F.binary_cross_entropy_with_logits(self.disc(fake), zeros)) / 2

    def _g_loss(self, fake: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.disc(fake), torch.ones(len(fake), 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        noise = self._noise(len(batch), batch_idx)
        v = self.variant
        if v == "toggled_context":  # the guide's context manager, zero_grad/backward/step inside
            with self.toggled_optimizer(d_opt):
                d_loss = self._d_loss(batch, self.gen(noise))  # no detach: the toggle keeps gen out
                d_opt.zero_grad()
                self.manual_backward(d_loss)
                d_opt.step()
            with self.toggled_optimizer(g_opt):
                g_loss = self._g_loss(self.gen(noise))
                g_opt.zero_grad()
                self.manual_backward(g_loss)
                g_opt.step()
        elif v == "toggle_no_detach":  # toggle/untoggle by hand, D's loss through the generator
            self.toggle_optimizer(d_opt)
            d_loss = self._d_loss(batch, self.gen(noise))
            self.manual_backward(d_loss)
            d_opt.step()
            d_opt.zero_grad()
            self.untoggle_optimizer(d_opt)
            self.toggle_optimizer(g_opt)
            g_loss = self._g_loss(self.gen(noise))
            self.manual_backward(g_loss)
            g_opt.step()
            g_opt.zero_grad()
            self.untoggle_optimizer(g_opt)
        elif v == "no_toggle":  # both losses, no toggle: each optimizer steps on what reached it
            d_loss = self._d_loss(batch, self.gen(noise).detach())
            d_opt.zero_grad()
            self.manual_backward(d_loss)
            d_opt.step()
            g_loss = self._g_loss(self.gen(noise))
            g_opt.zero_grad()
            self.manual_backward(g_loss)  # the discriminator's gradients too, left for the next zero_grad
            g_opt.step()
        elif v == "closures":  # closures passed to opt.step, as the guide's LBFGS-style example
            def d_closure() -> torch.Tensor:
                loss = self._d_loss(batch, self.gen(noise).detach())
                d_opt.zero_grad()
                self.manual_backward(loss)
                self.losses.append(loss.item())
                return loss

            def g_closure() -> torch.Tensor:
                loss = self._g_loss(self.gen(noise))
                g_opt.zero_grad()
                self.manual_backward(loss)
                self.losses.append(loss.item())
                return loss

            d_loss = d_opt.step(closure=d_closure)
            g_loss = g_opt.step(closure=g_closure)
        elif v == "two_backwards":  # manual_backward on one loss, then another (one forward); one step
            fake = self.gen(noise)
            g_loss = self._g_loss(fake)
            d_loss = self._d_loss(batch, fake.detach())
            self.manual_backward(g_loss, retain_graph=True)
            self.manual_backward(d_loss)
            g_opt.step()
            d_opt.step()
            g_opt.zero_grad()
            d_opt.zero_grad()
        elif v in ("accumulate", "accumulate_value_clip"):  # by hand over 3 batches, no sync block
            last = (batch_idx + 1) % 3 == 0
            with self.toggled_optimizer(d_opt):
                d_loss = self._d_loss(batch, self.gen(noise).detach())
                self.manual_backward(d_loss / 3)
            with self.toggled_optimizer(g_opt):
                g_loss = self._g_loss(self.gen(noise))
                self.manual_backward(g_loss / 3)
            if last:
                algo = "value" if v == "accumulate_value_clip" else "norm"
                clip = 0.01 if algo == "value" else CLIP
                for opt in (d_opt, g_opt):
                    self.clip_gradients(opt, gradient_clip_val=clip, gradient_clip_algorithm=algo)
                    opt.step()
                    opt.zero_grad()
        elif v == "schedulers":  # self.lr_schedulers(), stepped by hand every other batch
            g_sched, d_sched = self.lr_schedulers()
            with self.toggled_optimizer(d_opt):
                d_loss = self._d_loss(batch, self.gen(noise).detach())
                self.manual_backward(d_loss)
                self.clip_gradients(d_opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
                d_opt.step()
                d_opt.zero_grad()
            with self.toggled_optimizer(g_opt):
                g_loss = self._g_loss(self.gen(noise))
                self.manual_backward(g_loss)
                g_opt.step()
                g_opt.zero_grad(set_to_none=False)
            if batch_idx % 2 == 1:
                g_sched.step()
                d_sched.step()
            self.lrs.append(g_opt.param_groups[0]["lr"])
        elif v == "raw_optimizers":  # the torch optimizers themselves (use_pl_optimizer=False)
            g_raw, d_raw = self.optimizers(use_pl_optimizer=False)
            d_loss = self._d_loss(batch, self.gen(noise).detach())
            d_raw.zero_grad()
            self.manual_backward(d_loss)
            d_raw.step()
            g_loss = self._g_loss(self.gen(noise))
            g_raw.zero_grad()
            self.manual_backward(g_loss)
            g_raw.step()
        else:
            raise ValueError(v)
        self.losses += [float(d_loss), float(g_loss)]

    def configure_optimizers(self):
        g, d = _muon(self.gen.parameters()), _muon(self.disc.parameters(), lr=0.01)
        if self.variant != "schedulers":
            return g, d
        return [g, d], [torch.optim.lr_scheduler.StepLR(g, 1, gamma=0.5),
                        torch.optim.lr_scheduler.LambdaLR(d, lambda s: 1 / (s + 1))]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Reals(), batch_size=4)


#: variants whose reference adds gradients of several backwards: summed in another order than
#: ours (DDP re-averages the accumulated .grad, we add each reduced one)
ROUNDED = {"accumulate", "accumulate_value_clip", "two_backwards"}
VARIANTS = ["toggled_context", "toggle_no_detach", "no_toggle", "closures", "two_backwards", "accumulate",
            "accumulate_value_clip", "schedulers", "raw_optimizers"]


def _fit(variant: str, strategy: Any, world: int, root: str) -> dict:
    torch.manual_seed(0)
    gan = ManualGAN(variant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu_trainer(strategy, world, root, max_epochs=1).fit(gan)
    return {"weights": full_numpy(gan), "losses": gan.losses, "lrs": gan.lrs}


def _manual_scenario(rank: int, world: int, root: str) -> dict:
    out = {}
    for v in VARIANTS:
        out[v, "ddp"] = _fit(v, "ddp_find_unused_parameters_true", world, os.path.join(root, v, "ddp"))
        # the default units: the root holds both networks, called from training_step outside any
        # unit's forward and after manual_backward (test_outside_calls.py); wrap_policy units: test_manual_and_finetuning
        out[v, "mfsdp"] = _fit(v, "matrix_fsdp", world, os.path.join(root, v, "mfsdp"))
    return out


def _retained_scenario(rank: int, world: int) -> dict:
    """matrix_shard alone: two backwards through one forward (retain_graph), against DDP written
    by hand (every backward's gradient all-reduced and averaged)."""
    from helpers.oracle import allreduce_mean_grads

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    sharded, ref = mf.matrix_shard(make()), make()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    for model in (sharded, ref):
        out = model(x)
        out.pow(2).mean().backward(retain_graph=True)
        if model is ref:
            allreduce_mean_grads(ref)
        (out * 3).sin().mean().backward()
        if model is ref:
            allreduce_mean_grads(ref)
    ours = dict(sharded.named_parameters())
    return {n: (ours[n].grad - p.grad).abs().max().item() if ours[n].grad is not None else None
            for n, p in ref.named_parameters() if ours[n].numel()}


def _worker(rank: int, world: int, root: str) -> dict:
    return {"state_dict": _state_dict_scenario(rank, world, os.path.join(root, "sd")),
            "experts": _expert_scenario(rank, world, os.path.join(root, "ep")),
            "retained": _retained_scenario(rank, world),
            "manual": _manual_scenario(rank, world, os.path.join(root, "manual"))}


@pytest.fixture(scope="module")
def results(tmp_path_factory, dist_pools):
    return dist_pools(2).run(_worker, str(tmp_path_factory.mktemp("trust")), timeout=400)


def _is_refusal(err: Any) -> None:
    assert err is not None, "state_dict() returned a partial dict without a word"
    kind, msg = err
    assert kind == "PartialStateDictError", err
    for word in ("full_model", "save_sharded", "save_distributed_checkpoint=False", "local_state_dict"):
        assert word in msg, (word, msg)


def test_state_dict_after_fit_is_whole_or_refused(results):
    """Before: rank 1's ``state_dict()`` held ``model.pos`` as shape (0, 32), rank 0's file missed
    every weight rank 0 does not own, and nothing said so."""
    r0, r1 = (r["state_dict"] for r in results)
    for r in (r0, r1):
        _is_refusal(r["every_rank"])
        _is_refusal(r["inner"])  # the inner model too: the same rule on every submodule
        assert r["local_owned"] and r["local_empty"], "each rank owns part of the model"
        assert r["replicated"], "one rank per shard group: state_dict() is whole, as before"
    _is_refusal(r0["rank0_alone"])  # rank 0 alone: an error, no hang (the launch went on)
    assert "empty placeholders" in r0["rank0_alone"][1]
    assert r0["full_model"] == [] and r0["full_model_keys"], r0["full_model"]
    _is_refusal(r1["full_model_elsewhere"])
    assert "full_model holds the whole model on rank 0" in r1["full_model_elsewhere"][1]
    assert r0["file"] == [], r0["file"]  # Lightning's own checkpoint: every weight whole
    # local_state_dict (and named_parameters, the same tensors): whole where owned, (0, ...) elsewhere;
    # each sharded weight is owned by exactly one of the two ranks
    assert not set(r0["local_owned"]) & set(r1["local_owned"])
    sharded = set(r0["local_owned"]) | set(r1["local_owned"])
    assert set(r0["local_empty"]) == sharded - set(r0["local_owned"])
    for r in (r0, r1):
        empty = {k for k, shape in r["named_parameters"].items() if shape[0] == 0}
        assert empty == set(r["local_empty"]), (empty, r["local_empty"])


def test_state_dict_of_expert_slices_is_refused(results):
    """HSDP with one rank per shard group and EP=2: every dense weight is whole everywhere, so the old
    guard passed, and state_dict() held each stack as this rank's (2, 32, 16) of (4, 32, 16)."""
    for rank, r in enumerate(results):
        ep = r["experts"]
        assert ep["local"] == (2, 32, 16), ep["local"]
        for call in ("every_rank", "inner", "experts_module"):
            assert ep[call] is not None, f"rank {rank}: {call} state_dict() returned half the experts silently"
            kind, msg = ep[call]
            assert kind == "PartialStateDictError", ep[call]
            assert "expert-parallel slice" in msg and "(2, 32, 16)" in msg and "(4, 32, 16)" in msg, msg
            assert f"experts {2 * rank}-{2 * rank + 1} of 4" in msg, msg
            for word in ("save_distributed_checkpoint=False", "save_sharded(model, path, full=True)",
                         "python -m lightning_matrixfsdp.consolidate", "local_state_dict"):
                assert word in msg, (word, msg)
            assert "with lightning_matrixfsdp.full_model" not in msg, "full_model does not gather EP experts"
        assert "'model.moe.experts'" in ep["experts_module"][1]  # a submodule's refusal names its path
    assert results[0]["experts"]["file"] == {f"model.moe.experts.{n}": s for n, s in
                                             (("w1", (4, 32, 16)), ("w2", (4, 16, 32)), ("w3", (4, 32, 16)))}
    assert results[0]["experts"]["file_differs"] == []  # the alternative it names gives every expert whole


def test_two_backwards_through_one_forward_reduce_each(results):
    """Before: the second backward's gradients were never reduced (the first had ended the
    iteration, so the units took the later gradients for no forward at all): off by 0.5."""
    for r in results:
        assert r["retained"] and all(d is not None and d < 1e-6 for d in r["retained"].values()), r["retained"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_manual_optimization_equals_ddp(results, variant):
    """Before: ``two_backwards`` (two manual_backward calls on losses of one training_step)
    differed by 3e-3 in its losses (the second backward's gradients never reached the owners)."""
    for r in results:
        ddp, ours = r["manual"][variant, "ddp"], r["manual"][variant, "mfsdp"]
        assert ours["lrs"] == ddp["lrs"]
        assert ours["weights"].keys() == ddp["weights"].keys()
        if variant in ROUNDED:
            assert ours["losses"] == pytest.approx(ddp["losses"], abs=1e-6)
            for n, w in ddp["weights"].items():
                assert abs(ours["weights"][n] - w).max() < 1e-6, (n, abs(ours["weights"][n] - w).max())
        else:
            assert ours["losses"] == ddp["losses"]
            for n, w in ddp["weights"].items():
                a, b = torch.from_numpy(ours["weights"][n]), torch.from_numpy(w)
                assert torch.equal(a, b), f"{n} differs from DDP by {(a - b).abs().max().item():.3g}"



# ---------------------------------------------------------------------- meta-device init with TP
def _tp_meta_scenario(rank: int, world: int) -> dict:
    """D 2 x T 2: a model built on the meta device, parallelized, sharded; every rank's resident
    tensors against a one-process initialization of the unsplit model under the same seed."""
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.tp_reference import Net, parallelize, slice_of, whole_dim

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    tp_group = mesh["tensor_parallel"].get_group()
    tp_rank = mesh["tensor_parallel"].get_local_rank()

    def one_process_init(seed: int) -> tuple[nn.Module, torch.Tensor]:
        # the oracle, in this process alone: the unsplit model's storage, then each module's
        # reset_parameters in module order (what meta-device initialization means)
        with torch.device("meta"):
            ref = Net()
        ref.to_empty(device="cpu")
        torch.manual_seed(seed)
        for m in ref.modules():
            if any(True for _ in m.parameters(recurse=False)) and callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
        return ref, torch.rand(3)  # and where the generator is afterwards

    ref, _ = one_process_init(5)
    _, after_ref = one_process_init(5 + 100 * tp_rank)
    # ours: built on the meta device, the TP plan applied there, then sharded; TP rank 1 seeded
    # otherwise, so its copies can only equal TP rank 0's if they came from there
    with mf.meta_init():
        model = Net()
    model = parallelize(model, mesh["tensor_parallel"])
    torch.manual_seed(5 + 100 * tp_rank)
    mf.matrix_shard(model, mesh=mesh)
    after_ours = torch.rand(3)
    wrong, owned = [], []
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not p.numel():
            continue
        dim = whole_dim(name)
        expect = want[name].detach() if dim is None else slice_of(want[name].detach(), dim, tp_group)
        owned.append(name)
        if not torch.equal(p.detach(), expect):
            wrong.append((name, (p.detach() - expect).abs().max().item() if p.shape == expect.shape else "shape"))
    # the sharded model runs: its loss is the unsplit model's (TP sums rowwise products in another order)
    from helpers.tp_reference import batch, loss_of

    x = batch(0, mesh["data_parallel"].get_local_rank())
    with torch.no_grad():
        loss, ref_loss = loss_of(model, x).item(), loss_of(ref, x).item()
    return {"wrong": wrong, "owned": owned, "generator": torch.equal(after_ref, after_ours), "loss": loss,
            "ref_loss": ref_loss, "trainer": _tp_metacpu_trainer(ref, tp_group)}


class _MetaTP(LightningModule):
    """``Net`` built under the Trainer's ``init_module(empty_init=True)``, parallelized in configure_model."""

    def __init__(self) -> None:
        super().__init__()
        from helpers.tp_reference import Net

        self.net = Net()

    def configure_model(self) -> None:
        from helpers.tp_reference import parallelize

        parallelize(self.net, self.device_mesh["tensor_parallel"])
        # the seed right before the strategy shards (and so initializes): whatever Lightning drew
        # before configure_model in this process (a reused test worker) does not count
        torch.manual_seed(5)

    def training_step(self, x: torch.Tensor, i: int) -> torch.Tensor:  # never runs (max_steps=0)
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return _muon(self.parameters())


def _tp_metacpu_trainer(ref: nn.Module, tp_group: Any) -> list:
    """The same through the Trainer (set up by a fit of no step): the residents against ``ref``."""
    from helpers.tp_reference import slice_of, whole_dim

    trainer = Trainer(accelerator="cpu", devices=4, strategy=mf.MatrixFSDPStrategy(tensor_parallel_size=2),
                      max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    with trainer.init_module(empty_init=True):
        lit = _MetaTP()
    assert all(p.is_meta for p in lit.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(lit, train_dataloaders=torch.utils.data.DataLoader(list(torch.zeros(8, 8)), batch_size=4))
    want = dict(ref.named_parameters())
    wrong = []
    for name, p in lit.net.named_parameters():
        if p.numel():
            dim = whole_dim(name)
            expect = want[name].detach() if dim is None else slice_of(want[name].detach(), dim, tp_group)
            if p.shape != expect.shape or not torch.equal(p.detach(), expect):
                wrong.append(name)
    return wrong


def test_meta_init_with_tensor_parallelism_equals_a_one_process_init(dist_pools):
    """Before: refused ("a meta-device DTensor; ... build the model on a real device"); with the
    refusal lifted, rowwise fragments drew with the fragment's fan-in and each TP rank drew its
    replicated copies from its own generator."""
    res = dist_pools(4).run(_tp_meta_scenario, timeout=240)
    for r in res:
        assert r["wrong"] == [], r["wrong"]
        assert r["generator"], "the generator did not advance as in the one-process initialization"
    # every parameter held by some rank (each TP column owns its share; both TP ranks of a column alike)
    names = {n for r in res for n in r["owned"]}
    from helpers.tp_reference import Net

    assert names == {n for n, _ in Net().named_parameters()}
    for r in res:
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5, (r["loss"], r["ref_loss"])
        assert r["trainer"] == [], r["trainer"]  # Trainer(init_module(empty_init=True)) + configure_model
