"""Pipeline x expert parallelism through the Trainer against a plainly written oracle (issue 38).

The user's module is the demos' ``HFCausalLM`` around a tiny Mixtral (its steps call
``forward_loss``), with Muon built from the module and a StepLR schedule, trained in float64
(``precision="64-true"``) under ``MatrixFSDPStrategy(pipeline_parallel_size=2, expert_parallel_size=2)``.
The oracle is the unsplit model on one process, as in ``pipeline_lightning_scenarios.oracle_fit``:
each micro-batch of every data-parallel place alone (``loss / M`` backward), the places' gradients
summed in place order and divided by their number; then ``PerExpertMuon`` (torch's Muon on each
expert as a matrix of its own, gate and up apart; AdamW on the rest) and the same schedule. Each rank
compares what it steps: its owned dense parameters whole, its experts as the rows of the oracle's stacks.
"""
from __future__ import annotations

import copy
import traceback
from typing import Any

import torch
from torch import nn

from helpers.oracle import ADAMW_DEFAULTS, MUON_DEFAULTS, PerExpertMuon
from helpers.pipeline_lightning_scenarios import BATCH, VOCAB, SEQ, _trainer, data, oracle_fit
from helpers.pipeline_scenarios import expert_rows


def make_moe_module() -> nn.Module:
    """The demos' HFCausalLM around a tiny Mixtral (4 experts, top 2, two layers), float64-ready."""
    from lightning_matrixfsdp.demos import HFCausalLM

    class User(HFCausalLM):
        """HFCausalLM as a user trains it, recording its losses."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # noqa: D102
            loss = super().training_step(batch, batch_idx)
            self.recorded.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:  # noqa: D102
            import lightning_matrixfsdp as mf

            a = ADAMW_DEFAULTS
            opt = mf.Muon(self, adamw_lr=a["lr"], adamw_betas=a["betas"], adamw_eps=a["eps"],
                          adamw_weight_decay=a["weight_decay"], **MUON_DEFAULTS)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    torch.manual_seed(0)
    lit = User(model_type="mixtral", warmup_steps=0, config=dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
        tie_word_embeddings=False))
    lit.model.set_experts_implementation("eager")  # Hugging Face's grouped experts kernel has no float64
    lit.recorded = []
    return lit


def oracle_fit_moe(model: nn.Module, samples: list, places: int, steps: int, micro: int) -> list[list[float]]:
    """The unsplit ``model`` trained as ``oracle_fit`` trains it, stepped by a per-expert Muon."""
    return oracle_fit(model, samples, places, steps, 1, micro, None, optimizer=PerExpertMuon(model, expert_rows))


def run_moe_trainer(rank: int, world: int, case: dict) -> dict:
    try:
        return _run(rank, world, case)
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        return {"error": traceback.format_exc()}


def _run(rank: int, world: int, case: dict) -> dict:
    from lightning_matrixfsdp.adapters.pipeline import pipeline_of
    from lightning_matrixfsdp.optim.routing import held
    from lightning_matrixfsdp.runtime.tags import expert_slice_of

    pp, steps, micro = case["pp"], case.get("steps", 2), case.get("micro", 4)
    places = world // pp
    lit = make_moe_module()
    oracle = copy.deepcopy(lit).to(torch.float64)
    samples = data(places * BATCH * steps)
    loader = torch.utils.data.DataLoader(samples, batch_size=BATCH)
    trainer = _trainer(world, case, {"expert_parallel_size": case["ep"]}, max_steps=steps, precision="64-true")
    trainer.fit(lit, loader)
    o_losses = oracle_fit_moe(oracle, samples, places, steps, micro)
    session = pipeline_of(lit)
    stepped = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"] if p.numel()}
    mine = {id(p) for p in session.run.parameters() if held(p) and p.numel()}
    o_params = dict(oracle.named_parameters())
    compared, experts, worst = [], {}, 0.0
    for name, p in lit.named_parameters():
        if not held(p) or not p.numel():
            continue
        want = o_params[name].detach()
        s = expert_slice_of(p)
        if s is not None:  # this rank's experts of the stack
            experts[name] = [s.first, s.count]
            want = want[s.first:s.first + s.count]
        compared.append(name)
        worst = max(worst, (p.detach() - want).abs().max().item())
    return {"losses": lit.recorded, "oracle_losses": o_losses[rank % places], "compared": compared, "worst": worst,
            "experts": experts, "dtypes": sorted({str(p.dtype) for p in lit.parameters()}),
            "stepped_is_mine": stepped == mine, "names": sorted(o_params)}
