"""A pipelined Trainer run saved and resumed (issue 38, item 5 through the Trainer).

The oracle is the run that never stopped: the demo GPT at ``pipeline_parallel_size=2`` saved
after two steps (``Trainer.save_checkpoint``, the strategy's sharded directory under the
model's global names), resumed with ``ckpt_path`` and trained to four steps, against four steps
in one go; and the same checkpoint restored at ``pipeline_parallel_size=1`` (owner sharding over
both ranks) against the weights the saving run held. The data is one batch per epoch, so that a
resume after two steps starts where the uninterrupted run goes on (Lightning resumes a run
stopped by ``max_steps`` at an epoch's end in the next epoch under any strategy).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

from helpers.pipeline_lightning_scenarios import BATCH, _trainer, data, make_module


def _fit(world: int, pp: int, steps: int, ckpt: Any = None, save: Any = None) -> dict[str, Any]:
    from lightning_matrixfsdp.optim.routing import held

    lit = make_module()
    loader = torch.utils.data.DataLoader(data(BATCH), batch_size=BATCH)
    trainer = _trainer(world, {"pp": pp, "schedule": "1F1B"}, {}, max_steps=steps)
    trainer.fit(lit, loader, ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(save)
    opt = trainer.optimizers[0]
    names = {id(p): n for n, p in lit.named_parameters()}
    state = {f"{names[id(p)]}/{k}": v.clone() for g in opt.param_groups for p in g["params"] if held(p)
             for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v)}
    weights = {n: p.detach().clone() for n, p in lit.named_parameters() if held(p)}
    return {"weights": weights, "state": state, "losses": list(lit.recorded)}


def resume_case(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Saved at PP=2 after 2 steps; resumed to 4 (PP=2); restored at PP=1; and 4 steps in one go."""
    try:
        path = os.path.join(directory, "pp2.ckpt")
        saved = _fit(world, 2, 2, save=path)
        whole = _fit(world, 2, 4)
        resumed = _fit(world, 2, 4, ckpt=path)
        at_pp1 = _fit(world, 1, 2, ckpt=path)  # max_steps reached: restored, not trained
        return {"saved": saved["weights"], "whole": whole, "resumed": resumed, "pp1": at_pp1["weights"]}
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}
