"""Uneven evaluation under expert parallelism (issue 30): a rank out of batches still serves its
experts, so the ranks that compute never wait in a token exchange.

Every scenario gives the ranks different numbers of evaluation batches (one rank none at all in
some) and checks each computing rank's outputs, batch by batch, against the same batch run by a
plain one-process copy of the model (float64, never sharded): the oracle. One task per world size
runs every scenario, on the session's pools (the Hugging Face ones on ``hf_pool``, the 4-rank ones,
torchtitan-shaped experts without transformers, on ``dist_pools(4)``): a broken join hangs the
task, which the pool gives up on after its timeout.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import lightning_matrixfsdp as mf
from helpers.models import GroupedMoE

TOL = 1e-9  # float64: only the order of the expert sums differs from the oracle
DTYPE = torch.float64
LAYER = "transformers.models.mixtral.modeling_mixtral.MixtralDecoderLayer"
TIMEOUT = 180  # a hang shows as a timeout of the task


class TinyGrouped(torch.nn.Module):
    """Embedding, two MoE blocks (each a unit: materializations between the exchanges), head."""

    def __init__(self, experts: int, skew: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.ModuleList(GroupedMoE(16, experts, skew) for _ in range(2))
        for block in self.blocks:  # expert parallelism in torchtitan's shape, as configure_model applies it
            block.experts = mf.parallelize_experts(block.experts)
        self.head = torch.nn.Linear(16, 64, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in (reversed(self.blocks) if getattr(self, "reverse", False) else self.blocks):
            h = block(h)
        return self.head(h)


def ids(step: int, rank: int, n: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 * step + rank)
    return torch.randint(0, 64, (n, 8), generator=g)


def mixtral_logits(model, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x).logits


def greedy_two(model, x: torch.Tensor) -> torch.Tensor:
    """A predict-style loop: two forwards per step, the second on the first's greedy token."""
    first = mixtral_logits(model, x)
    nxt = first[:, -1].argmax(-1, keepdim=True)
    return torch.cat([first[:, -1], mixtral_logits(model, torch.cat([x, nxt], 1))[:, -1]], 1)


def build(kind: str) -> torch.nn.Module:
    if kind in ("grouped", "skewed"):
        torch.manual_seed(0)
        return TinyGrouped(4, skew=kind == "skewed").to(DTYPE)
    from test_moe_ep import tiny_mixtral

    return tiny_mixtral(4)


def run(kind: str, model, x: torch.Tensor) -> torch.Tensor:
    if kind in ("grouped", "skewed"):
        return model(x)
    return greedy_two(model, x) if kind == "greedy" else mixtral_logits(model, x)


def joined_loop(rank: int, kind: str, counts: list[int], ep: int, forwards: tuple[int, ...] = (),
                **options) -> dict:
    """A loop written against the runtime: ``counts[rank]`` batches here, the join keeping the ranks
    in step; ``forwards[rank]`` forwards per step (default 1; a rank that finishes its step first
    serves the others' remaining forwards). The largest difference from the oracle, and how many
    batches this rank ran."""
    import lightning_matrixfsdp as mf
    from lightning_matrixfsdp.runtime import scheduled_forwards
    from lightning_matrixfsdp.runtime.join import EvalJoin

    oracle = build(kind).eval()
    model = build(kind).eval()
    # several units: materializations (and their prefetch) between the exchanges
    options.setdefault("wrap_policy", {GroupedMoE} if kind in ("grouped", "skewed") else LAYER)
    mf.matrix_shard(model, expert_parallel_size=ep, **options)
    join = EvalJoin([model])
    batches = [ids(s, rank) for s in range(counts[rank])]
    worst, ran = 0.0, 0
    start = time.monotonic()
    with torch.no_grad(), scheduled_forwards(model):
        for s, x in enumerate(batches):
            join.begin_step()
            got = [run(kind, model, x) for _ in range(forwards[rank] if forwards else 1)]
            join.end_step(s == len(batches) - 1)
            worst = max([worst] + [(g - run(kind, oracle, x)).abs().max().item() for g in got])
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


def diverging(rank: int) -> tuple[str, float]:
    """A joined step (rank 3 has no batch) where rank 1 runs the experts modules in the other order
    (one unit: no materialization in between): the error every rank raises, and how long it took."""
    from lightning_matrixfsdp.runtime import scheduled_forwards
    from lightning_matrixfsdp.runtime.errors import RankDivergenceError
    from lightning_matrixfsdp.runtime.join import EvalJoin

    model = build("grouped").eval()
    mf.matrix_shard(model, expert_parallel_size=2, wrap_policy=_root_only)
    model.reverse = rank == 1
    join = EvalJoin([model])
    start = time.monotonic()
    try:
        with torch.no_grad(), scheduled_forwards(model):
            if rank == 3:
                join.drain()
            else:
                join.begin_step()
                model(ids(0, rank))
                join.end_step(True)
    except RankDivergenceError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


# ---------------------------------------------------------------------- the tasks
COUNTS2 = {"mixtral": [3, 1], "no_batch": [0, 2], "greedy": [1, 3], "grouped": [2, 0], "one_unit": [1, 2]}
COUNTS4 = {"ep2": [2, 0, 3, 1], "ep2_skewed": [3, 1, 0, 2], "ep2_hsdp": [1, 3, 0, 2],
           # an expert-parallel group across both shard groups: the announcements must reach every rank
           "ep4_hsdp": [0, 2, 1, 3],
           # rank 3 has no batch, so every step is joined, and ranks 0 and 2 end theirs after one forward
           # while rank 1 runs a second: they serve it
           "ragged": [1, 2, 2, 0]}
TRAINER_COUNTS = [3, 1]


def _root_only(name: str, module: torch.nn.Module) -> bool:
    return False


def _world2(rank: int, world: int) -> dict:
    kinds = {"no_batch": "mixtral", "one_unit": "grouped"}
    out = {name: joined_loop(rank, kinds.get(name, name), counts, ep=2) for name, counts in COUNTS2.items()
           if name != "one_unit"}
    # one unit holding both experts modules: two exchanges after one materialization
    out["one_unit"] = joined_loop(rank, "grouped", COUNTS2["one_unit"], ep=2, wrap_policy=_root_only)
    out["trainer"] = trainer_validate(rank, world, TRAINER_COUNTS)
    return out


def _world4(rank: int, world: int) -> dict:
    return {
        "ep2": joined_loop(rank, "grouped", COUNTS4["ep2"], ep=2),
        "ep2_skewed": joined_loop(rank, "skewed", COUNTS4["ep2_skewed"], ep=2),
        "ep2_hsdp": joined_loop(rank, "grouped", COUNTS4["ep2_hsdp"], ep=2, shard_size=2),
        "ep4_hsdp": joined_loop(rank, "skewed", COUNTS4["ep4_hsdp"], ep=4, shard_size=2),
        "ragged": joined_loop(rank, "grouped", COUNTS4["ragged"], ep=2, forwards=(1, 2, 1, 1)),
        "diverging": diverging(rank),
    }


_DONE: dict[int, tuple] = {}


def results(world: int, pool) -> list[dict]:
    """The world's task, run once for every test of this file (a failure raised again by each)."""
    if world not in _DONE:
        try:
            _DONE[world] = (pool.run(_world2 if world == 2 else _world4, timeout=TIMEOUT), None)
        except AssertionError as e:
            _DONE[world] = (None, e)
    res, err = _DONE[world]
    if err is not None:
        raise err
    return res


@pytest.mark.parametrize("scenario", sorted(COUNTS2))
def test_world2_uneven_evaluation_with_expert_parallelism(scenario, hf_pool):
    pytest.importorskip("transformers")
    for rank, r in enumerate(results(2, hf_pool)):
        res = r[scenario]
        assert res["ran"] == COUNTS2[scenario][rank]
        assert res["worst"] < TOL, (scenario, rank, res)


@pytest.mark.parametrize("scenario", sorted(COUNTS4))
def test_world4_uneven_evaluation_with_expert_parallelism(scenario, dist_pools):
    for rank, r in enumerate(results(4, dist_pools(4))):
        res = r[scenario]
        assert res["ran"] == COUNTS4[scenario][rank]
        assert res["worst"] < TOL, (scenario, rank, res)


def test_trainer_validate_and_predict_uneven_with_expert_parallelism(hf_pool):
    pytest.importorskip("transformers")
    for r in (res["trainer"] for res in results(2, hf_pool)):
        assert len(r["losses"]) == r["n"] and r["n_preds"] == r["n"]
        torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                                   torch.tensor(r["want"], dtype=torch.float64), rtol=0, atol=1e-6)
        assert r["preds"] < TOL, r


def test_ranks_running_experts_modules_in_another_order_raise_on_every_rank(dist_pools):
    for message, seconds in (r["diverging"] for r in results(4, dist_pools(4))):
        assert "diverged in an evaluation step" in message, message
        assert "rank 0 runs the token exchange of experts module 'blocks.0.experts'" in message, message
        assert "rank 1 runs the token exchange of experts module 'blocks.1.experts'" in message, message
        assert seconds < 30, seconds


def test_an_exchange_in_a_dtype_the_idle_ranks_cannot_follow_is_refused_from_the_shared_rows():
    """The join's decision is a function of the announcement rows every rank gathered, so every rank
    raises the same error: an exchange of hidden states in a dtype outside the four the idle ranks
    can build (here float8, code 4 + itemsize) is refused with the dtypes named; two different
    announcements are a divergence; one announcement, however many ranks send it, is followed."""
    from lightning_matrixfsdp.runtime.errors import RankDivergenceError, UnevenInputsError
    from lightning_matrixfsdp.runtime.experts.dispatch import dtype_code
    from lightning_matrixfsdp.runtime.join import DONE, EXCHANGE, EvalJoin

    join = object.__new__(EvalJoin)  # the decision needs no group: only the rows and the names
    join.seam_names, join.states = ["model.layers.0.mlp.experts"], []
    odd = dtype_code(torch.float8_e4m3fn)
    with pytest.raises(UnevenInputsError, match=r"model\.layers\.0\.mlp\.experts.*unsupported dtype.*float32, "
                                                r"float64, bfloat16 or float16"):
        join._wanted([[EXCHANGE, 0, 16, odd], [DONE, -1, -1, -1]])
    ok = [EXCHANGE, 0, 16, dtype_code(torch.bfloat16)]
    assert join._wanted([ok, [DONE, -1, -1, -1], ok]) == tuple(ok)
    with pytest.raises(RankDivergenceError, match="rank 0 runs the token exchange.*rank 1 runs"):
        join._wanted([ok, [EXCHANGE, 0, 32, dtype_code(torch.bfloat16)]])
    assert join._wanted([[DONE, -1, -1, -1]] * 2) is None
