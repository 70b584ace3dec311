"""Pipeline parallelism off the happy path (issue 38): a rank that dies or stalls mid-schedule,
batches a schedule cannot split, and the strategy's timeout on the pipeline's groups.

A run's result says how it ended on each rank that could answer: ``("error", message, seconds
waited)`` or ``("ok", ...)``; a killed rank answers nothing (``launch`` collects the others).
"""
from __future__ import annotations

import os
import queue as _queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from helpers.pipeline_scenarios import batch, demo_gpt, lm_loss

FAULT_STEP = 1  # the step (0-based) in which the last stage's rank dies or stalls
SILENT_S = 40.0  # how long a stalled rank stays alive without taking part (then it leaves)


def launch(fn: Callable, world: int, *args: Any, timeout: float = 90.0) -> dict[int, Any]:
    """``fn(rank, world, *args)`` on ``world`` fresh gloo processes (world group: torch's default
    timeout); each answering rank's result by rank, whatever the others did. Every process is
    killed at the end (one that died answers nothing)."""
    import torch.multiprocessing as mp

    from helpers.dist import _free_port, _worker

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < world:
        alive = [p for r, p in enumerate(procs) if r not in got and p.is_alive()]
        try:
            rank, status, payload = results.get(timeout=1.0)
            got[rank] = payload if status == "ok" else ("crash", payload, -1.0)
        except _queue.Empty:
            if not alive or time.monotonic() > deadline:
                break
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    return got


def _pipeline(rank: int, loss_fn: Callable, timeout_s: Optional[float], pp: int = 2) -> Any:
    from lightning_matrixfsdp.runtime.pipeline import build_pipeline, pipeline_mesh

    torch.manual_seed(0)
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    mesh = pipeline_mesh(pp, timeout=timeout)
    return build_pipeline(demo_gpt(2), mesh, loss_fn=loss_fn, schedule="1F1B", microbatches=4)


def fault(rank: int, world: int, done: str, timeout_s: Optional[float]) -> dict:
    """PP=2 on two ranks, the demos' GPT, twice: in step ``FAULT_STEP`` of a first run rank 1 (the
    last stage) stalls in its loss (alive and silent until rank 0 is done or ``SILENT_S`` passed);
    in a second run, on a fresh pipeline mesh, it dies there (``os._exit``). Rank 0 reports how
    each of its steps ended; rank 1 notes that it left the first run (a file) and dies in the second."""
    import torch.distributed as dist

    out = {"stall": _faulty_run(rank, "stall", done, timeout_s)}
    dist.barrier()  # the world group (torch's default timeout) is intact: both ranks start the second run
    out["kill"] = _faulty_run(rank, "kill", done, timeout_s)
    return out


def _faulty_run(rank: int, mode: str, done: str, timeout_s: Optional[float]) -> tuple:
    calls = {"n": 0}
    faulty = rank == 1

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if faulty and calls["n"] > 4 * FAULT_STEP:  # the first micro-batch of that step
            if mode == "kill":
                os._exit(17)
            start = time.monotonic()
            while not os.path.exists(done) and time.monotonic() - start < SILENT_S:
                time.sleep(0.05)
            raise _Left()
        return lm_loss(outputs, targets)

    run = _pipeline(rank, loss_fn, timeout_s)
    x, y = batch(0, 0)
    start = time.monotonic()
    try:
        for _ in range(FAULT_STEP + 1):
            start = time.monotonic()
            run.step(x, y)
        outcome = ("ok", "", time.monotonic() - start)
    except Exception as err:  # noqa: BLE001 - how the survivor ends is the result
        outcome = ("error", f"{type(err).__name__}: {err}", time.monotonic() - start)
    if faulty:  # it left (torch may wrap the exception its loss raised)
        open(f"{done}.left", "w").close()
    else:
        open(done, "w").close()
    return outcome


class _Left(Exception):
    """The stalled rank leaves (its peers are done, or it waited long enough)."""


def group_timeouts(rank: int, world: int, seconds: float) -> dict:
    """The strategy's ``timeout`` on its pipeline mesh's groups: a Trainer's strategy set up here
    (the pool's process group is reused), then each group's gloo timeout read back."""
    from lightning.pytorch import LightningModule, Trainer

    import lightning_matrixfsdp as mf

    strategy = mf.MatrixFSDPStrategy(pipeline_parallel_size=2, timeout=timedelta(seconds=seconds), log_plan=False)
    Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False)
    strategy.connect(LightningModule())  # a bare module: the groups are what is read
    strategy.setup_environment()
    mesh = strategy.pipeline_mesh
    groups = {"pp": mesh.pp_group} | {f"dp{d}": mesh.dp_mesh.get_group(d) for d in range(mesh.dp_mesh.ndim)}
    cpu = torch.device("cpu")
    return {name: g._get_backend(cpu).options._timeout.total_seconds() for name, g in groups.items()}  # noqa: SLF001


# ---------------------------------------------------------------------- batches that cannot be pipelined
def _bad_batches(rank: int, world: int) -> dict[str, tuple[Any, Any]]:
    """name -> (inputs, targets) on this rank; ``None`` where this rank passes a good batch."""
    x, y = batch(0, rank % (world // 2))  # 8 x 8 token ids, 4 micro-batches
    last = rank == world - 1
    return {
        "dict batch": ({"input_ids": x, "attention_mask": torch.ones_like(x)}, y),
        "tuple inputs": ((x, torch.ones_like(x)), y),
        "float inputs": (x.float(), y),
        "1-D inputs": (x.flatten(), y.flatten()),
        "batch not divisible": (x[:6], y[:6]),
        # one rank's batch not divisible: every rank refuses, naming it
        "one rank not divisible": ((x[:6], y[:6]) if last else (x, y)),
        "target rows": (x, y[:4]),
        "targets unshifted (one column more)": (x, torch.cat([y, y[:, :1]], 1)),
        "targets float": (x, y.float()),
        # the stages of one place read different batches (a sampler keyed on the global rank)
        "stages read different batches": (x, (y + 1) % 48) if last else (x, y),
        "stages read different sizes": ((x[:4], y[:4]) if last else (x, y)),
    }


def bad_inputs(rank: int, world: int, timeout_s: float) -> dict:
    """Each batch of ``_bad_batches`` to ``step`` (and the first ones to ``evaluate``), then a good
    step: every rank reports each refusal's message; the run still works after them."""
    from lightning_matrixfsdp.runtime.errors import MatrixShardError

    out: dict[str, Any] = {}
    run = _pipeline(rank, lm_loss, timeout_s)
    for name, (x, y) in _bad_batches(rank, world).items():
        for what, call in (("step", run.step), ("evaluate", run.evaluate)):
            if what == "evaluate" and name not in ("dict batch", "targets unshifted (one column more)"):
                continue
            try:
                call(x, y)
                out[f"{what}: {name}"] = "ran"
            except MatrixShardError as err:
                out[f"{what}: {name}"] = str(err)
            except Exception:  # noqa: BLE001 - a torch error is what the checks must prevent
                out[f"{what}: {name}"] = "other: " + traceback.format_exc(limit=3)
    x, y = batch(1, rank % (world // 2))
    out["good step after"] = float(run.step(x, y))
    no_scalar = _pipeline(rank, lambda o, t: torch.nn.functional.cross_entropy(
        o.flatten(0, 1), t.flatten(), reduction="none"), timeout_s)
    try:
        no_scalar.step(x, y)
        out["loss not scalar"] = "ran"
    except MatrixShardError as err:
        out["loss not scalar"] = str(err)
    return out


# ---------------------------------------------------------------------- uneven batch counts under PP x DP
def uneven_places(rank: int, world: int, epochs: int = 2) -> dict:
    """PP=2 x DP=2 through the Trainer with ``use_distributed_sampler=False``: data-parallel place 1
    gets one batch fewer than place 0 (a per-place dataset, as a custom sampler would give). Every
    rank reports how ``fit`` ended and the steps it ran."""
    from helpers.pipeline_lightning_scenarios import BATCH, _trainer, data, make_module

    places = world // 2
    place = rank % places
    samples = data(BATCH * (3 if place == 0 else 2))
    loader = torch.utils.data.DataLoader(samples, batch_size=BATCH)
    module = make_module(layers=2)
    trainer = _trainer(world, {"pp": 2, "schedule": "1F1B"}, {"timeout": timedelta(seconds=20)},
                       max_epochs=epochs, use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0)
    start = time.monotonic()
    try:
        trainer.fit(module, loader)
        outcome = ("ok", "")
    except Exception as err:  # noqa: BLE001 - how each rank ends is the result
        outcome = (type(err).__name__, str(err))
    return {"outcome": outcome, "steps": len(module.recorded), "seconds": time.monotonic() - start}


# ---------------------------------------------------------------------- through the Trainer
def trainer_bad_batches(rank: int, world: int) -> dict:
    """``forward_loss(self, x, y)`` under PP=2 through the Trainer with a batch the micro-batches do
    not divide, and with the inputs as a dict (ids and an attention mask): how ``fit`` ends on each rank."""
    import lightning_matrixfsdp as mf
    from helpers.pipeline_lightning_scenarios import _trainer, data, make_module

    class DictBatch(type(make_module(layers=2))):  # noqa: D101
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return mf.forward_loss(self, {"input_ids": x, "attention_mask": torch.ones_like(x)}, y)

    out = {}
    for name, cls, batch_size in (("six rows", None, 6), ("dict inputs", DictBatch, 8)):
        torch.manual_seed(0)
        module = make_module(layers=2) if cls is None else cls(vocab_size=48, max_seq_len=8, d_model=32, n_layers=2,
                                                               n_heads=2, warmup_steps=0)
        module.recorded, module.val_recorded, module.seen, module.sgd = [], [], [], False
        trainer = _trainer(world, {"pp": 2, "schedule": "1F1B"}, {}, max_steps=1, limit_val_batches=0,
                           num_sanity_val_steps=0)
        try:
            trainer.fit(module, torch.utils.data.DataLoader(data(batch_size), batch_size=batch_size))
            out[name] = "ran"
        except Exception as err:  # noqa: BLE001
            out[name] = f"{type(err).__name__}: {err}"
    return out
