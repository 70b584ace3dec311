"""What watches and reports the model sees its pipeline stages (issue 38 follow-ups).

One Trainer fit of the demos' GPT (4 blocks, each given a persistent buffer so that a stage's
share of a save differs from the whole model's) under ``pipeline_parallel_size=2`` with a declared
split (blocks 0-1 on stage 0, 2-3 on stage 1), a metrics-capturing logger at every step,
``log_plan=True``, ``async_save=True``, then a validation and a save. Each rank returns what the
strategy reported and plainly computed counts to judge it by (from an unsplit copy of the model).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import traceback
from typing import Any

import torch

from helpers.pipeline_lightning_scenarios import BATCH, _trainer, data, make_module

BUFFER = 1000  # elements of each block's extra buffer


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _Reserved(seen: list) -> Any:
    """A callback noting the size of the host buffer ``reserve`` made after the first step (before a
    save could resize it; the end of fit frees it)."""
    from lightning.pytorch import Callback

    class Reserved(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:  # noqa: D102
            buffer = trainer.strategy.async_saver.staging.buffer
            seen.append(buffer.numel() if buffer is not None else -1)

    return Reserved()


def _metrics_logger() -> Any:
    from lightning.pytorch.loggers.logger import Logger

    class Metrics(Logger):
        """Keeps every logged metric."""

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict] = []

        name, version = "metrics", 0

        @property
        def experiment(self) -> None:  # noqa: D102
            return None

        def log_metrics(self, metrics: dict, step: Any = None) -> None:  # noqa: D102
            self.rows.append(dict(metrics))

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:  # noqa: D102
            pass

    return Metrics()


def observe_case(rank: int, world: int, path: str) -> dict:
    try:
        return _observe(rank, world, path)
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        return {"error": traceback.format_exc()}


def _aligned(tensors: list[torch.Tensor]) -> int:
    return sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)


def _observe(rank: int, world: int, path: str) -> dict:
    from lightning.pytorch import Trainer  # noqa: F401 - imported before the strategy (Lightning's order)

    from lightning_matrixfsdp.adapters.pipeline import pipeline_of
    from lightning_matrixfsdp.runtime.tags import state_of

    lit = make_module()
    for i, block in enumerate(lit.blocks):
        block.register_buffer("extra", torch.full((BUFFER,), float(i)))
    plain = copy.deepcopy(lit)  # the unsplit model: the independent counts
    places = world // 2
    samples = data(places * BATCH * 2)
    loader = torch.utils.data.DataLoader(samples, batch_size=BATCH)
    capture = _Capture()
    import lightning_utilities.core.rank_zero as rank_zero

    info = rank_zero.log  # where rank_zero_info writes (Lightning's packages each set it)
    level = info.level
    info.addHandler(capture)
    info.setLevel(logging.INFO)
    try:
        trainer = _trainer(world, {"pp": 2, "schedule": "1F1B"}, {"pipeline_split": ["blocks.2"],
                                                                  "async_save": True},
                           max_steps=2, log_every_n_steps=1)
        trainer.strategy.config = trainer.strategy.config.updated(log_plan=True)
        trainer.loggers = [_metrics_logger()]
        seen: list[int] = []
        trainer.callbacks.append(_Reserved(seen))
        trainer.fit(lit, loader)
        reserved = seen[-1]
        trainer.validate(lit, loader, verbose=False)
        trainer.save_checkpoint(os.path.join(path, "ckpt"))
        trainer.strategy.wait_checkpoints()
    finally:
        info.removeHandler(capture)
        info.setLevel(level)
    from lightning_matrixfsdp.adapters.telemetry import MatrixFSDPSummary

    summary = MatrixFSDPSummary(lit, max_depth=1)  # collective under pipeline parallelism: every rank
    layers = dict(zip(summary.layer_names, summary.param_nums))
    uneven = _uneven_validation(trainer, lit, rank)
    try:
        import lightning_matrixfsdp as mf

        with mf.full_model(lit):
            full = ""
    except Exception as e:  # noqa: BLE001
        full = f"{type(e).__name__}: {e}"
    session = pipeline_of(lit)
    stage = session.run.stage_indices[0]
    mine = [f"blocks.{i}" for i in ((0, 1) if stage == 0 else (2, 3))]
    held = [p for n, p in plain.named_parameters() if any(n.startswith(b + ".") for b in mine)
            or (stage == 0 and n.startswith(("tok_emb.", "pos_emb."))) or (stage == 1 and not n.startswith(
                ("tok_emb.", "pos_emb.", "blocks.")))]
    buffers = [b for n, b in plain.named_buffers() if any(n.startswith(x + ".") for x in mine)]
    opt_state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {
        "uneven": uneven,
        "full_model": full,
        "summary_total": summary.total_parameters,
        "summary_layers": layers,
        "plain_total": sum(p.numel() for p in plain.parameters()),
        "plain_layers": {n: sum(p.numel() for p in plain.get_submodule(n).parameters()) for n in layers},
        "stage": stage,
        "metrics": trainer.loggers[0].rows,
        "log": capture.lines,
        "reserved": reserved,
        # this rank's stage owned whole on one of its ranks: a rank holds at most the stage's tensors
        "stage_bytes": _aligned(held) + _aligned(buffers),
        "all_buffer_bytes": _aligned([b for _, b in plain.named_buffers()]),
        "opt_bytes": _aligned(opt_state),
        "local_param_bytes": _aligned([p.detach() for p in lit.parameters()]),
        "watched": [state_of(s).schedule.peer_check is not None for s in session.run.stages],
        "stage_params": sum(p.numel() for p in held),
        "block_params": [sum(p.numel() for p in b.parameters()) for b in plain.blocks],
        "head_params": sum(p.numel() for n, p in plain.named_parameters()
                           if not n.startswith(("tok_emb.", "pos_emb.", "blocks."))),
        "emb_params": sum(p.numel() for n, p in plain.named_parameters() if n.startswith(("tok_emb.", "pos_emb."))),
    }
    if rank == 0:
        side = os.path.join(path, "ckpt", "matrix_fsdp_layout.json")
        with open(side) as f:
            out["sidecar_plans"] = json.load(f)["plans"]
    return out


def observe_moe_case(rank: int, world: int, case: dict) -> dict:
    try:
        return _observe_moe(rank, world, case)
    except Exception:  # noqa: BLE001 - the test shows every rank's failure
        return {"error": traceback.format_exc()}


def _counting_new_group(calls: list, inside: list) -> Any:
    """``dist.new_group`` that records (the calling function, its ranks, whether ``setup_environment`` runs)."""
    import inspect

    import torch.distributed as dist

    real = dist.new_group

    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        calls.append((inspect.stack()[1].function, list(ranks or []), bool(inside)))
        return real(ranks, *args, **kwargs)

    return real, new_group


def _observe_moe(rank: int, world: int, case: dict) -> dict:
    """A tiny Mixtral under ``pipeline_parallel_size=2`` x ``expert_parallel_size=2`` (4 ranks), one step
    logged: the groups ``setup_environment`` creates, and the experts' load against the unsplit model's
    own router choices on the step's batches (float64, the initial weights)."""
    import torch.distributed as dist

    import lightning_matrixfsdp as mf
    from helpers.pipeline_lightning_moe_scenarios import make_moe_module
    from helpers.pipeline_lightning_scenarios import place_batches

    lit = make_moe_module()
    plain = copy.deepcopy(lit).to(torch.float64)
    places = world // 2
    samples = data(places * BATCH)
    calls: list = []
    inside: list = []
    real, counting = _counting_new_group(calls, inside)
    setup = mf.MatrixFSDPStrategy.setup_environment

    def watched(self: Any) -> None:
        inside.append(True)
        try:
            setup(self)
        finally:
            inside.clear()

    dist.new_group, mf.MatrixFSDPStrategy.setup_environment = counting, watched
    try:
        trainer = _trainer(world, {"pp": 2, "schedule": "1F1B"}, {"expert_parallel_size": 2}, max_steps=1,
                           precision="64-true", log_every_n_steps=1)
        trainer.loggers = [_metrics_logger()]
        trainer.fit(lit, torch.utils.data.DataLoader(samples, batch_size=BATCH))
    finally:
        dist.new_group, mf.MatrixFSDPStrategy.setup_environment = real, setup
    chosen: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, a, out, i=i: chosen.__setitem__(i, chosen.get(i, torch.zeros(4, dtype=torch.int64))
                                                  + torch.bincount(out[2].reshape(-1), minlength=4)))
        for i, layer in enumerate(plain.model.model.layers)]
    plain.train()
    with torch.no_grad():
        for place in range(places):
            x, _ = place_batches(samples, places, place)[0]
            plain.model(input_ids=x)
    for h in hooks:
        h.remove()
    rows = [r for r in trainer.loggers[0].rows if any(k.startswith("matrix_fsdp/experts/") for k in r)]
    return {"calls": calls, "metrics": rows, "oracle_counts": {i: c.tolist() for i, c in chosen.items()},
            "losses": lit.recorded}


def _uneven_validation(trainer: Any, lit: Any, rank: int) -> str:
    """A validation where rank 0 has two batches and the others one (a sampler Lightning keeps):
    the error every rank raises, or "" if none did."""
    from torch.utils.data.distributed import DistributedSampler

    samples = data(BATCH * (2 if rank == 0 else 1))
    loader = torch.utils.data.DataLoader(samples, batch_size=BATCH,
                                         sampler=DistributedSampler(samples, num_replicas=1, rank=0, shuffle=False))
    try:
        trainer.validate(lit, loader, verbose=False)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""
