"""Pipeline parallelism through the Trainer and Fabric against a plainly written oracle (issue 38).

The user's module is the demos' GPT (its steps call ``forward_loss``), with Muon built from the
module at the oracle's hyper-parameters and a StepLR schedule. The oracle is the unsplit model on
one process: for each optimizer step, each accumulated batch and each micro-batch (in the order
the schedule's backwards add them up), every data-parallel place's slice alone (``loss / (M * A)``
backward), the places' gradients summed in place order and divided by their number, added to the
batch's gradient, which is added to the step's (the strategy's backward adds each batch's
gradients to ``.grad``, as ``backward()`` does); then the optional clip (torch's), ``torch.optim.Muon`` on
the recipe's matrices, ``torch.optim.AdamW`` on the rest, and the same schedule. The batches are
those Lightning's ``DistributedSampler`` gives each place (``shuffle=False``: place ``p`` reads
samples ``p, p + places, ...``). Every rank compares what it owns, bitwise where the order allows.
"""
from __future__ import annotations

import copy
import os
import traceback
from typing import Any

import torch
from torch import nn

from helpers.oracle import oracle_optimizers

VOCAB, SEQ, BATCH = 48, 8, 8
ADAMW = dict(adamw_lr=0.02, adamw_betas=(0.9, 0.999), adamw_eps=1e-8, adamw_weight_decay=0.1)


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return list(zip(t[:, :-1], t[:, 1:]))


def make_module(layers: int = 4, sgd: bool = False, hf: bool = False, tied: bool = False) -> nn.Module:
    from lightning_matrixfsdp.demos import GPT, HFCausalLM

    class User(HFCausalLM if hf else GPT):
        """The demo GPT as a user trains it, recording its losses."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # noqa: D102
            loss = super().training_step(batch, batch_idx)
            self.recorded.append(loss.item())
            self.seen.append(int(batch[0].sum()))
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:  # noqa: D102
            super().validation_step(batch, batch_idx)
            self.val_recorded.append(forward_loss_value(self, batch))

        def configure_optimizers(self) -> Any:  # noqa: D102
            import lightning_matrixfsdp as mf

            if self.sgd:  # linear in the gradient: what a clip does shows in the weights whole
                opt = torch.optim.SGD(self.parameters(), lr=0.5)
            else:
                opt = mf.Muon(self, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, **ADAMW)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    if hf:  # the demos' Hugging Face module around a tiny Llama
        lit = User(model_type="llama", warmup_steps=0, config=dict(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=SEQ, tie_word_embeddings=tied))
    else:
        lit = User(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=layers, n_heads=2, warmup_steps=0)
    lit.recorded, lit.val_recorded, lit.seen, lit.sgd = [], [], [], sgd
    return lit


def forward_loss_value(module: nn.Module, batch: Any) -> float:
    import lightning_matrixfsdp as mf

    return mf.forward_loss(module, *batch).item()


def place_batches(samples: list, places: int, place: int, shuffle: bool = True) -> list[tuple[torch.Tensor, ...]]:
    """The batches Lightning's sampler gives ``place`` (torch's DistributedSampler, which it shuffles
    for training, epoch 0, with the seed of the last ``seed_everything`` in this process, the
    ``PL_GLOBAL_SEED`` variable, else 0: a test before this one in a shared pool may have set it;
    not shuffled for evaluation)."""
    from torch.utils.data.distributed import DistributedSampler

    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    mine = [samples[i] for i in DistributedSampler(samples, num_replicas=places, rank=place, shuffle=shuffle, seed=seed)]
    return [tuple(torch.stack(z) for z in zip(*mine[i:i + BATCH])) for i in range(0, len(mine), BATCH)]


def oracle_fit(model: nn.Module, samples: list, places: int, steps: int, accumulate: int, micro: int,
               clip: float | None, shuffle: bool = True, optimizer: Any = None) -> list[list[float]]:
    """The unsplit ``model`` trained as described above; returns each place's per-batch losses.
    ``optimizer``: one object whose ``step()`` steps the model and whose ``opts`` are the torch
    optimizers the schedule follows (a per-expert Muon); default SGD, or torch's Muon and AdamW."""
    per_place = [place_batches(samples, places, p, shuffle) for p in range(places)]
    if optimizer is None:
        opts = [torch.optim.SGD(model.parameters(), lr=0.5)] if model.sgd else oracle_optimizers(model)
        step_all = lambda: [o.step() for o in opts]  # noqa: E731
    else:
        opts, step_all = optimizer.opts, optimizer.step
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in opts]
    params = [p for p in model.parameters() if p.requires_grad]
    losses: list[list[float]] = [[] for _ in range(places)]
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for a in range(accumulate):
            k = step * accumulate + a
            mb_losses: list[list[torch.Tensor]] = [[] for _ in range(places)]
            batch = [torch.zeros_like(p) for p in params]  # the schedule's gradients of this batch
            for m in range(micro):
                grads = []
                for place in range(places):
                    x, y = (t.chunk(micro)[m] for t in per_place[place][k])
                    for p in params:
                        p.grad = None
                    loss = model.loss_fn(model(x), y)
                    (loss / (micro * accumulate)).backward()
                    mb_losses[place].append(loss.detach())
                    grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params])
                for i in range(len(params)):
                    reduced = grads[0][i].clone()
                    for g in grads[1:]:
                        reduced = reduced + g[i]
                    batch[i] = batch[i] + reduced / places
            total = [t + b for t, b in zip(total, batch)]  # added to .grad in the strategy's backward
            for place in range(places):
                losses[place].append(torch.stack(mb_losses[place]).mean().item())
        for p, g in zip(params, total):
            p.grad = g
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        step_all()
        for o in opts:
            o.zero_grad(set_to_none=True)
        for s in scheds:
            s.step()
    return losses


def oracle_eval(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], micro: int) -> float:
    with torch.no_grad():
        pairs = zip(*(t.chunk(micro) for t in batch))
        return torch.stack([model.loss_fn(model(x), y) for x, y in pairs]).mean().item()


def run_case(rank: int, world: int, case: dict) -> dict:
    try:
        return _run_case(rank, world, case)
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        return {"error": traceback.format_exc()}


def _trainer(world: int, case: dict, options: dict, **kw: Any) -> Any:
    from lightning.pytorch import Trainer

    import lightning_matrixfsdp as mf

    strategy = mf.MatrixFSDPStrategy(pipeline_parallel_size=case["pp"], pipeline_schedule=case["schedule"],
                                     pipeline_microbatches=case.get("micro", 4), log_plan=False, **options)
    return Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=os.environ.get("TMPDIR", "/tmp"), **kw)


def _run_case(rank: int, world: int, case: dict) -> dict:
    from lightning_matrixfsdp.adapters.pipeline import pipeline_of
    from lightning_matrixfsdp.optim.routing import held

    pp, steps, acc, micro = case["pp"], case.get("steps", 2), case.get("accumulate", 1), case.get("micro", 4)
    places = world // pp
    clip = case.get("clip")
    lit = make_module(sgd=case.get("sgd", False), hf=case.get("hf", False), tied=case.get("tied", False))
    oracle = copy.deepcopy(lit)
    samples = data(places * BATCH * steps * acc)
    loader = torch.utils.data.DataLoader(samples, batch_size=BATCH)
    trainer = _trainer(world, case, case.get("options", {}), max_steps=steps, accumulate_grad_batches=acc,
                       gradient_clip_val=clip)
    trainer.fit(lit, loader)
    place = rank % places
    o_losses = oracle_fit(oracle, samples, places, steps, acc, micro, clip)
    session = pipeline_of(lit)
    opt = trainer.optimizers[0]
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    mine = {id(p) for p in session.run.parameters() if held(p)}
    o_params = dict(oracle.named_parameters(remove_duplicate=False))  # a tied weight under both names
    compared, worst = [], 0.0
    for name, p in lit.named_parameters():
        if held(p):
            compared.append(name)
            worst = max(worst, (p.detach() - o_params[name].detach()).abs().max().item())
    out = {"seen": lit.seen, "oracle_seen": [int(b[0].sum()) for b in place_batches(samples, places, place)], "losses": lit.recorded, "oracle_losses": o_losses[place], "compared": compared, "worst": worst,
           "stepped_is_mine": stepped == mine, "names": sorted(o_params), "lr": [g["lr"] for g in opt.param_groups]}
    if case.get("validate"):
        val = place_batches(samples[:places * BATCH], places, place, shuffle=False)
        trainer.validate(lit, torch.utils.data.DataLoader(samples[:places * BATCH], batch_size=BATCH),
                         verbose=False)
        out["val"] = lit.val_recorded
        out["oracle_val"] = [oracle_eval(oracle, b, micro) for b in val]
    return out


def run_fabric(rank: int, world: int, case: dict) -> dict:
    try:
        return _run_fabric(rank, world, case)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


def _run_fabric(rank: int, world: int, case: dict) -> dict:
    """A plain Fabric loop (the same code would run under DDP): ``forward_loss``, ``fabric.backward``,
    the clip, the step and the schedule; each place reads its own batches."""
    from lightning.fabric import Fabric

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.optim.routing import held

    pp, steps, micro, clip = case["pp"], case.get("steps", 2), case.get("micro", 4), case.get("clip")
    places = world // pp
    lit = make_module(sgd=case.get("sgd", False), hf=case.get("hf", False), tied=case.get("tied", False))
    oracle = copy.deepcopy(lit)
    samples = data(places * BATCH * steps)
    strategy = mf.MatrixFSDPFabricStrategy(pipeline_parallel_size=pp, pipeline_schedule=case["schedule"],
                                           pipeline_microbatches=micro, log_plan=False)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(lit)
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5) if lit.sgd else
                                  mf.Muon(model, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, **ADAMW))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    place = rank % places
    losses = []
    for x, y in place_batches(samples, places, place, shuffle=False):
        loss = mf.forward_loss(model, x, y)
        fabric.backward(loss)
        if clip is not None:
            fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    o_losses = oracle_fit(oracle, samples, places, steps, 1, micro, clip, shuffle=False)
    o_params = dict(oracle.named_parameters(remove_duplicate=False))  # a tied weight under both names
    compared = [n for n, p in lit.named_parameters() if held(p)]
    worst = max((lit.get_parameter(n).detach() - o_params[n].detach()).abs().max().item() for n in compared)
    return {"losses": losses, "oracle_losses": o_losses[place], "compared": compared, "worst": worst,
            "names": sorted(o_params)}


def refusals(rank: int, world: int) -> dict:
    """Each bad use under ``pipeline_parallel_size=2`` through the Trainer: every rank's message."""
    from lightning.pytorch import LightningModule

    import lightning_matrixfsdp as mf

    class Manual(type(make_module())):  # noqa: D101
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.automatic_optimization = False

    class CallsSelf(type(make_module())):  # noqa: D101
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.loss_fn(self(batch[0]), batch[1])

    class Plain(LightningModule):  # noqa: D101
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return mf.forward_loss(self, *batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class NoLossFn(Plain):  # noqa: D101
        def __init__(self) -> None:
            super().__init__()
            self.model = make_module()

    class Unknown(Plain):  # noqa: D101
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 4)

        def loss_fn(self, o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return (o - t).square().mean()

    def gpt(cls: Any = None, layers: int = 4) -> nn.Module:
        torch.manual_seed(0)
        kw = dict(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=layers, n_heads=2, warmup_steps=0)
        return (cls or type(make_module()))(**kw)

    cases = {
        "manual": (lambda: gpt(Manual), {}, "fit"),
        "calls_self": (lambda: gpt(CallsSelf), {}, "fit"),
        "no_loss_fn": (NoLossFn, {}, "fit"),
        "unknown_model": (Unknown, {}, "fit"),
        "more_stages_than_layers": (lambda: gpt(layers=1), {}, "fit"),
        "split_names_nothing": (gpt, {"pipeline_split": ["blocks.9"]}, "fit"),
        "predict": (gpt, {}, "predict"),
    }
    out = {}
    loader = torch.utils.data.DataLoader(data(BATCH), batch_size=BATCH)
    for name, (build, options, fn) in cases.items():
        lit = build()
        lit.recorded, lit.seen, lit.sgd = [], [], False
        trainer = _trainer(world, {"pp": 2, "schedule": "1F1B"}, options, max_steps=1)
        try:
            getattr(trainer, fn)(lit, loader)
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out
