"""Uneven inputs (issue 12, C6): evaluation with unequal batch counts per rank completes and
matches an unsharded copy of the model; uneven training raises on every rank within seconds."""
from __future__ import annotations

import copy
import os
import time

import pytest
import torch

from helpers.lit import LitTiny
from helpers.models import lm_loss

# batches per rank, by world size: some ranks run out early, one has none at all
COUNTS = {2: [5, 2], 3: [1, 4, 0]}


class Batches(torch.utils.data.Dataset):
    """``n`` batches of tokens, different on every rank."""

    def __init__(self, n: int, rank: int) -> None:
        g = torch.Generator().manual_seed(100 + rank)
        self.x = torch.randint(0, 64, (n * 2, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class LitEval(LitTiny):
    def __init__(self, n: int, rank: int, train_n: int = 4) -> None:
        super().__init__()
        self.n, self.rank_, self.train_n = n, rank, train_n
        self.val_losses: list[float] = []
        self.test_losses: list[float] = []

    def _loader(self, n: int):
        return torch.utils.data.DataLoader(Batches(n, self.rank_), batch_size=2)

    def train_dataloader(self):
        return self._loader(self.train_n)

    def val_dataloader(self):
        return self._loader(self.n)

    def test_dataloader(self):
        return self._loader(self.n)

    def predict_dataloader(self):
        return self._loader(self.n)

    def validation_step(self, batch, batch_idx):
        loss = lm_loss(self.model(batch), batch)
        self.val_losses.append(loss.item())
        return loss

    def test_step(self, batch, batch_idx):
        loss = lm_loss(self.model(batch), batch)
        self.test_losses.append(loss.item())
        return loss

    def predict_step(self, batch, batch_idx):
        return self.model(batch)


def _trainer(world: int, **kw):
    from lightning.pytorch import Trainer

    import lightning_matrixfsdp as mf

    args = dict(accelerator="cpu", devices=world, strategy=mf.MatrixFSDPStrategy(), logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                use_distributed_sampler=False, default_root_dir=os.getcwd())
    args.update(kw)
    return Trainer(**args)


def _eval_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    n = COUNTS[world][rank]
    lit = LitEval(n, rank)
    oracle = copy.deepcopy(lit.model).eval()  # a plain copy, never sharded
    trainer = _trainer(world)
    trainer.validate(lit, verbose=False)
    trainer.test(lit, verbose=False)
    preds = trainer.predict(lit)
    # fit with validation inside: sanity check and the end-of-epoch validation (uneven too)
    lit.val_losses = []
    fit_trainer = _trainer(world, max_steps=2, limit_train_batches=2, num_sanity_val_steps=1)
    t0 = time.monotonic()
    fit_trainer.fit(lit)
    with torch.no_grad():
        batches = [b for b in lit._loader(n)]
        want = [lm_loss(oracle(b), b).item() for b in batches]
        want_logits = [oracle(b) for b in batches]
    return {"fit_val": lit.val_losses, "test": lit.test_losses,
            # plain lists: tensors would cross the process boundary through shared memory that the
            # exiting worker may already have released
            "preds": [p.detach().tolist() for p in preds or []], "want": want,
            "want_logits": [w.tolist() for w in want_logits],
            "fit_s": time.monotonic() - t0, "n": n}


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_evaluation_completes_and_matches_unsharded(world, dist_pools):
    res = dist_pools(world).run(_eval_worker, timeout=300)
    for r in res:
        assert len(r["test"]) == r["n"] and len(r["preds"]) == r["n"]
        torch.testing.assert_close(torch.tensor(r["test"]), torch.tensor(r["want"]), rtol=1e-5, atol=1e-6)
        for got, want in zip(r["preds"], r["want_logits"]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
        # fit: one sanity batch (if any), then the whole validation set after training moved the weights
        assert len(r["fit_val"]) == min(r["n"], 1) + r["n"]
        if r["n"]:
            assert abs(r["fit_val"][0] - r["want"][0]) < 1e-5
    assert sum(len(r["preds"]) for r in res) == sum(COUNTS[world])


def _validate_worker(rank: int, world: int) -> list[float]:
    torch.manual_seed(0)
    lit = LitEval(COUNTS[world][rank], rank)
    oracle = copy.deepcopy(lit.model).eval()
    _trainer(world).validate(lit, verbose=False)
    with torch.no_grad():
        want = [lm_loss(oracle(b), b).item() for b in lit._loader(lit.n)]
    return [lit.val_losses, want]


def test_uneven_validate_matches_unsharded(dist_pools):
    for got, want in dist_pools(3).run(_validate_worker, timeout=240):
        assert len(got) == len(want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def _uneven_train_worker(rank: int, world: int, counts: list[int]) -> str:
    from lightning_matrixfsdp.runtime.errors import UnevenInputsError

    torch.manual_seed(0)
    lit = LitEval(1, rank, train_n=counts[rank])
    trainer = _trainer(world, max_epochs=1, limit_val_batches=0)
    t0 = time.monotonic()
    with pytest.raises(UnevenInputsError) as e:
        trainer.fit(lit)
    assert time.monotonic() - t0 < 60
    return str(e.value)


@pytest.mark.parametrize("counts", [[3, 1], [2, 0], [1, 2, 4]])
def test_uneven_training_raises_on_every_rank(counts, dist_pools):
    msgs = dist_pools(len(counts)).run(_uneven_train_worker, counts, timeout=180)
    assert len(set(msgs)) == 1  # the same error on every rank
    assert "different numbers of training batches" in msgs[0] and "use_distributed_sampler" in msgs[0]
