"""Uneven evaluation under expert parallelism (issue 30): a rank out of batches still serves its
experts, so the ranks that compute never wait in a token exchange.

Every scenario gives the ranks different numbers of evaluation batches (one rank none at all in
some) and checks each computing rank's outputs, batch by batch, against the same batch run by a
plain one-process copy of the model (float64, never sharded): the oracle. One launch per world
size runs every scenario; a broken join hangs the launch, which ``run_distributed`` kills.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from helpers.dist import OneLaunch

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

TOL = 1e-9  # float64: only the order of the expert sums differs from the oracle
LAYER = "transformers.models.mixtral.modeling_mixtral.MixtralDecoderLayer"


def ids(step: int, rank: int, n: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 * step + rank)
    return torch.randint(0, 64, (n, 8), generator=g)


def skewed_grouped(experts: int = 4):
    """The torchtitan-shaped model of ``test_moe_ep`` (the same initialization), its forward giving
    the logits, and routers that always pick experts 0 and 1 (a bias of +-5, no weight): every token
    goes to expert-parallel place 0, so place 0's tokens route to no remote expert, and a rank at
    place 1 computes nothing for anyone yet still exchanges counts."""
    from test_moe_ep import DTYPE, TinyGrouped

    class GroupedLogits(TinyGrouped):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            h = self.embed(input_ids)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    torch.manual_seed(0)
    model = GroupedLogits(experts).to(DTYPE)
    for block in model.blocks:
        router = torch.nn.Linear(16, experts, bias=True, dtype=DTYPE)
        with torch.no_grad():
            router.weight.zero_()
            router.bias.copy_(torch.tensor([5.0, 5.0] + [-5.0] * (experts - 2)))
        block.router = router
    return model


def grouped_out(model, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def mixtral_logits(model, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x).logits


def greedy_two(model, x: torch.Tensor) -> torch.Tensor:
    """A predict-style loop: two forwards per step, the second on the first's greedy token."""
    first = mixtral_logits(model, x)
    nxt = first[:, -1].argmax(-1, keepdim=True)
    return torch.cat([first[:, -1], mixtral_logits(model, torch.cat([x, nxt], 1))[:, -1]], 1)


RUNS = {"mixtral": mixtral_logits, "grouped": grouped_out, "greedy": greedy_two}


def build(kind: str):
    from test_moe_ep import tiny_mixtral

    return skewed_grouped() if kind == "grouped" else tiny_mixtral(4)


def joined_loop(rank: int, kind: str, counts: list[int], ep: int, **options) -> dict:
    """A loop written against the runtime: ``counts[rank]`` batches here, the join keeping the ranks
    in step. The largest difference from the oracle, and how many batches this rank ran."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime import scheduled_forwards
    from lightning_matrixfsdp.runtime.join import EvalJoin

    run = RUNS[kind]
    oracle = build(kind).eval()
    model = build(kind).eval()
    if kind != "grouped":
        options.setdefault("wrap_policy", LAYER)  # several units: materializations between the exchanges
    mf.matrix_shard(model, expert_parallel_size=ep, **options)
    join = EvalJoin([model])
    batches = [ids(s, rank) for s in range(counts[rank])]
    worst, ran = 0.0, 0
    start = time.monotonic()
    with torch.no_grad(), scheduled_forwards(model):
        for s, x in enumerate(batches):
            join.begin_step()
            got = run(model, x)
            join.end_step(s == len(batches) - 1)
            worst = max(worst, (got - run(oracle, x)).abs().max().item())
            ran += 1
        if not batches:
            join.drain()
    return {"worst": worst, "ran": ran, "seconds": time.monotonic() - start}


def trainer_validate(rank: int, world: int, counts: list[int]) -> dict:
    """``Trainer.validate`` and ``Trainer.predict`` with ``expert_parallel_size=2`` and a per-rank
    loader of ``counts[rank]`` batches (no DistributedSampler): each batch's loss and logits
    against the oracle."""
    from lightning.pytorch import LightningModule, Trainer

    import lightning_matrixfsdp as mf
    from test_moe_ep import tiny_mixtral

    class LitMoE(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_mixtral(4)
            self.losses: list[float] = []

        def val_dataloader(self):
            return torch.utils.data.DataLoader([ids(s, rank) for s in range(counts[rank])], batch_size=None)

        predict_dataloader = val_dataloader

        def validation_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def predict_step(self, batch, batch_idx):
            return greedy_two(self.model, batch)

    lit = LitMoE()
    oracle = tiny_mixtral(4).eval()
    trainer = Trainer(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      default_root_dir=os.getcwd(),
                      strategy=mf.MatrixFSDPStrategy(wrap_policy=LAYER, expert_parallel_size=2))
    trainer.validate(lit, verbose=False)
    preds = trainer.predict(lit) or []
    with torch.no_grad():
        batches = [ids(s, rank) for s in range(counts[rank])]
        want = [oracle(input_ids=x, labels=x).loss.item() for x in batches]
        want_preds = [greedy_two(oracle, x) for x in batches]
    return {"n": counts[rank], "losses": lit.losses, "want": want,
            "preds": max([(p - w).abs().max().item() for p, w in zip(preds, want_preds)], default=0.0),
            "n_preds": len(preds)}


# ---------------------------------------------------------------------- launches
def _world2(rank: int, world: int) -> dict:
    return {
        "mixtral": joined_loop(rank, "mixtral", [3, 1], ep=2),
        "no_batch": joined_loop(rank, "mixtral", [0, 2], ep=2),
        "greedy": joined_loop(rank, "greedy", [1, 3], ep=2),
        "grouped_skewed": joined_loop(rank, "grouped", [1, 3], ep=2),
        "grouped_skewed_other": joined_loop(rank, "grouped", [3, 0], ep=2),
        "trainer": trainer_validate(rank, world, [3, 1]),
    }


def _world4(rank: int, world: int) -> dict:
    return {
        "ep2": joined_loop(rank, "mixtral", [2, 0, 3, 1], ep=2),
        "ep2_hsdp": joined_loop(rank, "mixtral", [1, 3, 0, 2], ep=2, shard_size=2),
        # an expert-parallel group across both shard groups: the announcements must reach every rank
        "ep4_hsdp": joined_loop(rank, "mixtral", [0, 2, 1, 3], ep=4, shard_size=2),
    }


WORLD2 = OneLaunch(_world2, 2, timeout=240)
WORLD4 = OneLaunch(_world4, 4, timeout=240)

COUNTS2 = {"mixtral": [3, 1], "no_batch": [0, 2], "greedy": [1, 3], "grouped_skewed": [1, 3],
           "grouped_skewed_other": [3, 0]}
COUNTS4 = {"ep2": [2, 0, 3, 1], "ep2_hsdp": [1, 3, 0, 2], "ep4_hsdp": [0, 2, 1, 3]}


@pytest.mark.parametrize("scenario", sorted(COUNTS2))
def test_world2_uneven_evaluation_with_expert_parallelism(scenario):
    for rank, r in enumerate(WORLD2.results()):
        res = r[scenario]
        assert res["ran"] == COUNTS2[scenario][rank]
        assert res["worst"] < TOL, (scenario, rank, res)


@pytest.mark.parametrize("scenario", sorted(COUNTS4))
def test_world4_uneven_evaluation_with_expert_parallelism(scenario):
    for rank, r in enumerate(WORLD4.results()):
        res = r[scenario]
        assert res["ran"] == COUNTS4[scenario][rank]
        assert res["worst"] < TOL, (scenario, rank, res)


def test_trainer_validate_and_predict_uneven_with_expert_parallelism():
    for r in (res["trainer"] for res in WORLD2.results()):
        assert len(r["losses"]) == r["n"] and r["n_preds"] == r["n"]
        torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                                   torch.tensor(r["want"], dtype=torch.float64), rtol=0, atol=1e-6)
        assert r["preds"] < TOL, r
