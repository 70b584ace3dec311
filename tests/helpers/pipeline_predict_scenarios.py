"""Prediction under pipeline parallelism (issue 38, items 3): ``forward_outputs`` through the
Trainer and Fabric against the unsplit model on one process.

The user's module is the demos' GPT (or ``HFCausalLM`` around a tiny Llama) whose ``predict_step`` returns
``forward_outputs(self, inputs)``. The oracle is a copy of the module taken before the strategy
split it (or trained by ``oracle_fit``, as the pipeline's Trainer tests train it): for each batch
of the data-parallel place a rank reads (Lightning's prediction sampler: place ``p`` gets samples
``p, p + places, ...``), the model in eval mode without gradients, one micro-batch at a time (the
schedule's forward runs micro-batch by micro-batch), the outputs concatenated. Every rank, of
every stage, must return exactly those outputs.
"""
from __future__ import annotations

import copy
import traceback
import types
from typing import Any

import torch
from torch import nn

from helpers.pipeline_lightning_scenarios import BATCH, _trainer, data, make_module, oracle_fit


def _predict_step(self: nn.Module, batch: Any, batch_idx: int) -> torch.Tensor:
    import lightning_matrixfsdp as mf

    return mf.forward_outputs(self, batch[0])


def predicting(lit: nn.Module) -> nn.Module:
    """``lit`` with the contract's ``predict_step``."""
    lit.predict_step = types.MethodType(_predict_step, lit)
    return lit


def prediction_batches(samples: list, places: int, place: int, batch: int) -> list[torch.Tensor]:
    """The inputs of the batches Lightning's prediction sampler gives ``place`` (not padded, in order)."""
    mine = [samples[i] for i in range(place, len(samples), places)]
    return [torch.stack([x for x, _ in mine[i:i + batch]]) for i in range(0, len(mine), batch)]


def oracle_outputs(model: nn.Module, inputs: torch.Tensor, micro: int) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return torch.cat([model(x) for x in inputs.chunk(micro)])


def run_predict(rank: int, world: int, case: dict) -> dict:
    try:
        return _run_predict(rank, world, case)
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        return {"error": traceback.format_exc()}


def _run_predict(rank: int, world: int, case: dict) -> dict:
    """``trainer.predict`` (after ``fit`` of ``case["fit"]`` steps when given) at ``case["pp"]``."""
    pp, micro, fit = case["pp"], case.get("micro", 4), case.get("fit", 0)
    places = world // pp
    place = rank % places
    lit = predicting(make_module(hf=case.get("hf", False)))
    oracle = copy.deepcopy(lit)
    if fit:
        train = data(places * BATCH * fit)
        _trainer(world, case, {}, max_steps=fit).fit(lit, torch.utils.data.DataLoader(train, batch_size=BATCH))
        oracle_fit(oracle, train, places, fit, 1, micro, None)
    samples = data(case["samples"])
    loader = torch.utils.data.DataLoader(samples, batch_size=case["batch"])
    writer = _Writer()
    got = _trainer(world, case, {}, callbacks=[writer]).predict(lit, loader)
    want = [oracle_outputs(oracle, x, micro) for x in prediction_batches(samples, places, place, case["batch"])]
    indices = list(range(place, len(samples), places))  # what DDP's writer gets at this place
    return {"got": [g.clone() for g in got], "want": want, "written": writer.written,
            "want_indices": [indices[i:i + case["batch"]] for i in range(0, len(indices), case["batch"])],
            "written_same": all(torch.equal(w, g) for w, g in zip(writer.outputs, got))}


def _Writer() -> Any:
    """A prediction writer (``write_interval="batch"``) that keeps what Lightning hands it."""
    from lightning.pytorch.callbacks import BasePredictionWriter

    class Writer(BasePredictionWriter):  # noqa: D101
        def __init__(self) -> None:
            super().__init__(write_interval="batch")
            self.written: list[list[int]] = []
            self.outputs: list[torch.Tensor] = []

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx,  # noqa: D102
                               dataloader_idx) -> None:
            self.written.append(list(batch_indices))
            self.outputs.append(prediction.clone())

    return Writer()


def run_fabric_predict(rank: int, world: int, case: dict) -> dict:
    try:
        return _run_fabric_predict(rank, world, case)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


def _run_fabric_predict(rank: int, world: int, case: dict) -> dict:
    """A Fabric loop: ``forward_outputs`` under ``torch.no_grad()`` on each place's batches; then
    the same call with gradients on (refused on every rank)."""
    from lightning.fabric import Fabric

    import lightning_matrixfsdp as mf

    pp, micro = case["pp"], case.get("micro", 4)
    places = world // pp
    place = rank % places
    lit = make_module()
    oracle = copy.deepcopy(lit)
    strategy = mf.MatrixFSDPFabricStrategy(pipeline_parallel_size=pp, pipeline_schedule=case["schedule"],
                                           pipeline_microbatches=micro, log_plan=False)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(lit)
    model.eval()
    batches = prediction_batches(data(places * BATCH * 2), places, place, BATCH)
    with torch.no_grad():
        got = [mf.forward_outputs(model, x).clone() for x in batches]
    want = [oracle_outputs(oracle, x, micro) for x in batches]
    try:
        mf.forward_outputs(model, batches[0])
        refused = None
    except Exception as e:  # noqa: BLE001
        refused = f"{type(e).__name__}: {e}"
    return {"got": got, "want": want, "refused": refused}


def predict_refusals(rank: int, world: int) -> dict:
    """Each bad prediction under ``pipeline_parallel_size=2``: every rank's message (None: not refused)."""
    cases = {  # name -> (module, samples, batch size, micro-batches)
        "calls_self": (make_module(), 8, 4, 4),  # Lightning's default predict_step: self(batch)
        # two places: a last batch of 3 on one place only (15 samples: 8 and 7), batch counts that differ
        # (9: 5 and 4), a place whose own loader (no distributed sampler) has no batch at all
        "not_a_multiple": (predicting(make_module()), 15 if world == 4 else 6, 4, 4),
        "uneven_places": (predicting(make_module()), 9, 4, 4),
        "place_without_batch": (predicting(make_module()), 0 if rank % 2 else 4, 4, 1),
    }
    out = {}
    for name, (lit, n, batch, micro) in cases.items():
        if name in ("uneven_places", "place_without_batch") and world == 2:
            continue
        loader = torch.utils.data.DataLoader(data(n) if n else [], batch_size=batch)
        kw = {"use_distributed_sampler": False} if name == "place_without_batch" else {}
        try:
            _trainer(world, {"pp": 2, "schedule": "1F1B", "micro": micro}, {}, **kw).predict(lit, loader)
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out
