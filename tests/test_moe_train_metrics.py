"""Mixture-of-experts training as its users expect (issue 36): the load-balancing loss in the demo's
loss, and the experts' statistics in the Trainer's logger.

The load-balancing loss: ``HFCausalLM``'s training loss and logged ``train_aux_loss`` equal Hugging
Face's own ``outputs.loss`` / ``outputs.aux_loss`` of the same model on the same batch (the oracle is
transformers itself). One process, plain Lightning: nothing distributed is needed for the loss.
"""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from helpers.dist import PoolTask
from helpers.walk_scenarios import MemoryLogger

pytest.importorskip("transformers")

TINY = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16, tie_word_embeddings=False)


def _hf_module(**config):
    from lightning_matrixfsdp.demos import HFCausalLM

    torch.manual_seed(0)
    return HFCausalLM(model_type="mixtral", config=dict(TINY, **config), lr=0.02, warmup_steps=0,
                      lr_schedule="constant")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) as the demos' data gives them, y = x shifted by one; the last label is ignored (-100), so
    that the loss is the one Hugging Face computes with ``labels=x`` (it shifts them itself)."""
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    y = torch.cat([x[:, 1:], torch.full((2, 1), -100)], dim=1)
    return x, y


def _one_step_metrics(module) -> dict[str, float]:
    from lightning.pytorch import Trainer

    logger = MemoryLogger()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=logger, log_every_n_steps=1,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([_batch()], batch_size=None))
    return {k: v for _, m in logger.records for k, v in m.items()}


@pytest.mark.parametrize("asks", [True, False], ids=["output_router_logits", "without"])
def test_training_loss_is_hugging_faces_loss_with_its_load_balancing_loss(asks: bool) -> None:
    module = _hf_module(output_router_logits=asks, router_aux_loss_coef=0.05)
    x, _ = _batch()
    reference = copy.deepcopy(module.model)
    with torch.no_grad():
        want = reference(input_ids=x, labels=x)  # Hugging Face's own loss, before the step changes the weights
    got = _one_step_metrics(module)
    assert got["train_loss"] == pytest.approx(want.loss.item(), rel=0, abs=2e-6), (got, want.loss)
    if asks:
        assert want.aux_loss is not None and want.aux_loss.item() > 0
        assert got["train_aux_loss"] == pytest.approx(want.aux_loss.item(), rel=0, abs=1e-7)
        with torch.no_grad():  # the difference is the scaled auxiliary loss: it is really in the loss
            plain = reference(input_ids=x, labels=x, output_router_logits=False).loss
        assert got["train_loss"] - plain.item() == pytest.approx(0.05 * want.aux_loss.item(), abs=2e-6)
    else:
        assert "train_aux_loss" not in got


def test_router_losses_are_refused_or_scaled_as_the_model_says() -> None:
    from lightning_matrixfsdp.demos.hf import router_losses

    logits = torch.zeros(1, 2, 3)
    asks = SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.1, router_z_loss_coef=0.001)
    # a model type that reports no load-balancing loss although its config asks for the router outputs
    with pytest.raises(ValueError, match="returned no aux_loss"):
        router_losses(SimpleNamespace(config=asks), SimpleNamespace(logits=logits, aux_loss=None))
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        router_losses(SimpleNamespace(config=SimpleNamespace(output_router_logits=True)),
                      SimpleNamespace(logits=logits, aux_loss=torch.tensor(1.0)))
    # the model's own attribute wins over its config (what its forward scales by), and a z-loss is taken too
    model = SimpleNamespace(config=asks, router_aux_loss_coef=0.2)
    terms = router_losses(model, SimpleNamespace(logits=logits, aux_loss=torch.tensor(2.0), z_loss=torch.tensor(3.0)))
    assert {k: (v.item(), c) for k, (v, c) in terms.items()} == {"aux_loss": (2.0, 0.2), "z_loss": (3.0, 0.001)}
    assert router_losses(SimpleNamespace(config=SimpleNamespace(output_router_logits=False)),
                         SimpleNamespace(logits=logits, aux_loss=torch.tensor(2.0))) == {}


# ---------------------------------------------------------------------- expert statistics in the logger
LAYER = "transformers.models.mixtral.modeling_mixtral.MixtralDecoderLayer"
EXPERTS, TOP_K, STEPS, EVERY = 4, 2, 4, 2


def _counted_module(ep: int):
    """The demo module, with a plain count of every router's top-k choices in each training step's
    forward (a forward hook on the router; a recomputation inside backward is not a training
    forward: what it adds is dropped when the next step starts)."""
    from lightning_matrixfsdp.demos import HFCausalLM

    class Counted(HFCausalLM):
        def __init__(self) -> None:
            super().__init__(model_type="mixtral", config=dict(TINY, output_router_logits=True,
                                                               router_aux_loss_coef=0.02),
                             lr=0.02, warmup_steps=0, lr_schedule="constant")
            self.seen: list[torch.Tensor] = []
            self.steps: list[torch.Tensor] = []  # per training forward: [layers, experts]
            for layer in self.model.model.layers:
                layer.mlp.gate.register_forward_hook(
                    lambda m, args, out: self.seen.append(torch.bincount(out[2].reshape(-1), minlength=EXPERTS)))

        def training_step(self, batch, batch_idx):
            self.seen.clear()
            loss = super().training_step(batch, batch_idx)
            self.steps.append(torch.stack(self.seen))
            return loss

    torch.manual_seed(0)
    return Counted()


def _fit_with_stats(rank: int, world: int, ep: int, accumulate: int, checkpointing: bool) -> dict:
    from lightning.pytorch import Trainer

    import lightning_matrixfsdp as mf

    module = _counted_module(ep)
    logger = MemoryLogger()
    g = torch.Generator().manual_seed(5)
    data = [(x, torch.roll(x, -1)) for x in torch.randint(0, 256, (32, 8), generator=g)]
    strategy = mf.MatrixFSDPStrategy(wrap_policy=LAYER, expert_parallel_size=ep, log_plan=False,
                                     activation_checkpointing_policy=LAYER if checkpointing else None)
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=logger,
                      log_every_n_steps=EVERY, accumulate_grad_batches=accumulate, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, default_root_dir=".")
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=2))
    return {"steps": [s.tolist() for s in module.steps], "records": logger.records if rank == 0 else []}


def _stats_world2(rank: int, world: int) -> dict:
    return {"ep2": _fit_with_stats(rank, world, ep=2, accumulate=2, checkpointing=True),
            "ep1": _fit_with_stats(rank, world, ep=1, accumulate=1, checkpointing=False)}


STATS = PoolTask(_stats_world2, timeout=600)  # on hf_pool (tests/conftest.py): warm, transformers imported


@pytest.mark.parametrize("scenario,accumulate", [("ep2", 2), ("ep1", 1)], ids=["ep2_checkpointing_accumulation",
                                                                              "without_ep"])
def test_tokens_per_expert_in_the_logger_equal_a_plain_count_of_the_routers_choices(scenario, accumulate, hf_pool):
    results = [r[scenario] for r in STATS.results(hf_pool)]
    per_rank = [torch.tensor(r["steps"]) for r in results]  # [micro-batches, layers, experts] per rank
    assert all(len(p) == STEPS * accumulate for p in per_rank)
    logged = [m for _, m in results[0]["records"] if "matrix_fsdp/experts/tokens_cv_max" in m]
    assert len(logged) == STEPS // EVERY, results[0]["records"]
    window = EVERY * accumulate
    for w, metrics in enumerate(logged):
        counts = sum(p[w * window:(w + 1) * window].sum(0) for p in per_rank)  # [layers, experts], every rank
        assert counts.sum() == len(per_rank) * window * 2 * 8 * TOP_K * 2  # ranks x batches x tokens x k x layers
        worst = 0.0
        for layer, row in enumerate(counts.double()):
            mean = row.mean()
            cv = (((row - mean) ** 2).mean().sqrt() / mean).item()
            worst = max(worst, cv)
            assert metrics[f"matrix_fsdp/experts/{layer}/tokens_min"] == row.min().item() / EVERY
            assert metrics[f"matrix_fsdp/experts/{layer}/tokens_max"] == row.max().item() / EVERY
            assert metrics[f"matrix_fsdp/experts/{layer}/tokens_cv"] == pytest.approx(cv, rel=1e-12)
        assert metrics["matrix_fsdp/experts/tokens_cv_max"] == pytest.approx(worst, rel=1e-12)
        assert "matrix_fsdp/experts/dropped" not in metrics  # Mixtral drops no token
    aux = [m["train_aux_loss"] for _, m in results[0]["records"] if "train_aux_loss" in m]
    assert aux and all(math.isfinite(a) and a > 0 for a in aux)


# ---------------------------------------------------------------------- the plan printout
def _row(text: str, rank: int) -> list[str]:
    """The printout table's cells for ``rank``."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 5 and cells[0] == str(rank):
            return cells
    raise AssertionError(f"no row for rank {rank} in\n{text}")


def _plans_world2(rank: int, world: int) -> dict:
    """Each rank's printout at EP=2 and without EP, beside what the rank really holds: its parameter
    bytes, and after one step of Muon its parameters, gradients and optimizer state; the printed
    expert ranges checked against the local slices' values (the whole stacks are known: every rank
    builds the same model)."""
    import re

    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime.tags import expert_slice_of
    from test_moe_ep import batch, loss_of, tiny_mixtral

    out = {}
    whole = dict(tiny_mixtral(4).named_parameters())
    for ep in (2, 1):
        model = tiny_mixtral(4)
        mf.matrix_shard(model, expert_parallel_size=ep)
        plan = mf.get_plan(model)
        text = str(plan)
        held = {n: p.detach().clone() for n, p in model.named_parameters()}
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        opt = mf.Muon(model, lr=0.02)  # the recipe the plan prices
        loss_of(model, batch(0, rank)).backward()
        opt.step()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)  # not the 0-d step counters
        stacks = {}
        if ep > 1:  # the range the printout gives this rank, against the rows of the whole stacks it holds
            a, b = map(int, re.search(rf"^  rank {rank}: experts \[(\d+), (\d+)\)", text, re.M).groups())
            stacks = {n: torch.equal(held[n], whole[n][a:b]) for n, p in model.named_parameters()
                      if expert_slice_of(p) is not None}
        else:  # "stack X: whole on rank r": the owner holds it whole, the other rank nothing
            for n, owner in re.findall(r"^stack (\S+): whole on rank (\d+)", text, re.M):
                stacks[n] = torch.equal(held[n], whole[n]) if int(owner) == rank else held[n].numel() == 0
        out[ep] = {"text": text, "params": params, "resident": params + grads + state, "stacks": stacks,
                   "plan": (plan.param_bytes(rank), plan.resident_bytes(rank))}
    return out


PLANS = PoolTask(_plans_world2, timeout=300)


@pytest.mark.parametrize("ep", [2, 1], ids=["ep2", "without_ep"])
def test_the_plan_printout_gives_what_each_rank_holds(ep, hf_pool):
    results = [r[ep] for r in PLANS.results(hf_pool)]
    for rank, r in enumerate(results):
        # the plan's figures, to the byte: parameters held; parameters, gradients and optimizer state after a step
        assert r["plan"] == (r["params"], r["resident"]), (rank, r["plan"], r["params"], r["resident"])
        cells = _row(results[0]["text"], rank)  # rank 0 prints the plan; every rank's figures are in it
        assert cells[1] == f"{r['params'] / 2**20:.2f}", (cells, r["params"])
        assert cells[2] == f"{r['resident'] / 2**20:.2f}", (cells, r["resident"])
        assert len(r["stacks"]) == 4 and all(r["stacks"].values()), r["stacks"]  # 2 layers x 2 stacks
    if ep > 1:
        assert "  rank 0: experts [0, 2) of every experts module" in results[0]["text"]
        assert "  rank 1: experts [2, 4) of every experts module" in results[0]["text"]
    else:
        assert "expert_parallel" not in results[0]["text"]


def test_routing_counts_take_training_forwards_only_and_report_dropped_slots() -> None:
    """The counting hook without a process group: a slot routed to expert E (no expert) is a dropped
    slot, a keyword routing argument (GPT-OSS's ``router_indices``) is read, evaluation and a forward
    inside backward are not counted; the summary against plain arithmetic written here."""
    from lightning_matrixfsdp.runtime.experts.stats import RoutingCounts, summarize

    class Experts(torch.nn.Module):
        def forward(self, hidden_states, router_indices=None, routing_weights=None):
            return hidden_states

    a, b = Experts(), Experts()
    routing, backward = RoutingCounts(), [False]
    routing.in_backward = lambda: backward[0]
    for name, m in (("model.layers.0.mlp.experts", a), ("model.layers.1.mlp.experts", b)):
        routing.add_module(name, 4)
        routing.watch(name, m, kind_grouped=False)
    h = torch.zeros(3, 2)
    a(h, torch.tensor([[0, 1], [0, 4], [2, 0]]), None)  # one slot to no expert (4 = E)
    b(h, router_indices=torch.tensor([[3, 3], [3, 1], [2, 3]]), routing_weights=None)
    backward[0] = True
    a(h, torch.tensor([[1, 1], [1, 1], [1, 1]]), None)  # a recomputation inside backward: not counted
    backward[0] = False
    a.eval()
    a(h, torch.tensor([[2, 2], [2, 2], [2, 2]]), None)  # evaluation: not counted
    names, experts, flat = routing.take()
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"] and experts == [4, 4]
    assert flat.tolist() == [3, 1, 1, 0, 1, 0, 1, 1, 4, 0]
    metrics = summarize(names, experts, flat.tolist(), steps=2)
    cv0 = math.sqrt(((3 - 1.25) ** 2 + 2 * (1 - 1.25) ** 2 + 1.25 ** 2) / 4) / 1.25
    cv1 = math.sqrt((1.5 ** 2 + 0.5 ** 2 + 0.5 ** 2 + 2.5 ** 2) / 4) / 1.5
    assert metrics == pytest.approx({
        "matrix_fsdp/experts/0/tokens_min": 0.0, "matrix_fsdp/experts/0/tokens_max": 1.5,
        "matrix_fsdp/experts/0/tokens_cv": cv0, "matrix_fsdp/experts/1/tokens_min": 0.0,
        "matrix_fsdp/experts/1/tokens_max": 2.0, "matrix_fsdp/experts/1/tokens_cv": cv1,
        "matrix_fsdp/experts/tokens_cv_max": max(cv0, cv1), "matrix_fsdp/experts/dropped": 0.5})
    assert routing.take()[2].tolist() == [0] * 10  # taken: the next window starts from zero
