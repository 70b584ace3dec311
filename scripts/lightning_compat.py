"""Lightning's own multi-process CPU tests, run with ``strategy="ddp"`` swapped for ``"matrix_fsdp"``.

    timeout -k 10 7200 python scripts/lightning_compat.py LIGHTNING_SRC [--out results.md]
        [--only SUBSTRING ...] [--timeout 300]

``LIGHTNING_SRC`` is a Lightning source tree (a clone at the installed release, or any
folder with its ``tests/tests_pytorch``); nothing is downloaded. Each test of ``TESTS``
(tests that train or evaluate with ``strategy="ddp"``/``"ddp_spawn"`` or a ``DDPStrategy``
on 2 CPU processes) runs twice, each time in its own ``pytest`` process with this file
loaded as a pytest plugin (``-p lightning_compat``) that rewrites the strategy of every
``Trainer(...)``:

- ``matrix_fsdp``: every ``"ddp*"`` string and plain ``DDPStrategy`` becomes matrix_fsdp;
- ``ddp`` (where matrix_fsdp fails, or for every test with ``--ddp-too``): ``"ddp_spawn"``
  (``_fork``, ``_notebook``) becomes ``"ddp"``, so that DDP runs with the launcher
  matrix_fsdp has (the script is started again for the other rank, which gets its own
  ``tmp_path``); what fails here too is a spawn-only expectation.

The launcher's other rank re-runs the same command, so it rewrites alike. The table written
to ``--out`` gives both outcomes and a verdict: ``pass``; ``fail`` (matrix_fsdp fails
where DDP passes: the first error line, and the issue-24 row it falls under when one is
known); ``N/A`` with the reason (the test checks what only DDP has, or fails under DDP
with this launcher too), and ``skip`` as pytest reports it. ``--only`` picks tests by
substring. The tests need what Lightning's test conftest imports (pytest, tqdm) and
``cloudpickle`` (several test modules), ``fastapi`` and ``uvicorn`` (the servable test).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

# --------------------------------------------------------------------------- the test list
# (node id under tests/, area); standalone tests need PL_RUN_STANDALONE_TESTS=1 (the runner sets
# it for those only: Lightning's conftest then drops every test that is not standalone).
P = "tests_pytorch/"
TESTS: list[tuple[str, str]] = [
    (P + "callbacks/test_early_stopping.py::test_multiple_early_stopping_callbacks[callbacks2-2-False-ddp_spawn-2-2]", "callbacks"),
    (P + "callbacks/test_early_stopping.py::test_multiple_early_stopping_callbacks[callbacks4-3-False-ddp_spawn-2-None]", "callbacks"),
    (P + "callbacks/test_early_stopping.py::test_multiple_early_stopping_callbacks[callbacks7-3-True-ddp_spawn-2-None]", "callbacks"),
    (P + "callbacks/test_pruning.py::test_pruning_callback_ddp_cpu", "callbacks"),
    (P + "callbacks/test_spike.py::test_trainer_spike_detection_integration[0-2-None-True]", "callbacks"),
    (P + "callbacks/test_spike.py::test_trainer_spike_detection_integration[1-2-nan-False]", "callbacks"),
    (P + "callbacks/test_stochastic_weight_avg.py::test_swa_callback_ddp_cpu", "callbacks"),
    (P + "callbacks/test_weight_averaging.py::test_ema_ddp_spawn_cpu", "callbacks"),
    (P + "callbacks/test_weight_averaging.py::test_ema_resume_ddp", "callbacks"),
    (P + "checkpointing/test_model_checkpoint.py::test_model_checkpoint_no_extraneous_invocations", "checkpointing"),
    (P + "checkpointing/test_torch_saving.py::test_model_torch_save_ddp_cpu", "checkpointing"),
    (P + "loggers/test_all.py::test_logger_initialization[CSVLogger]", "logging"),
    (P + "loggers/test_all.py::test_logger_initialization[TensorBoardLogger]", "logging"),
    (P + "loops/test_prediction_loop.py::test_prediction_loop_batch_sampler_set_epoch_called[False]", "loops"),
    (P + "loops/test_prediction_loop.py::test_prediction_loop_batch_sampler_set_epoch_called[True]", "loops"),
    (P + "models/test_amp.py::test_amp_cpus[ddp_spawn-16-mixed-2]", "precision"),
    (P + "models/test_amp.py::test_amp_cpus[ddp_spawn-bf16-mixed-2]", "precision"),
    (P + "overrides/test_distributed.py::test_params_synced_during_nonfit", "strategies"),
    (P + "profilers/test_profiler.py::test_simple_profiler_distributed_files", "logging"),
    (P + "serve/test_servable_module_validator.py::test_servable_module_validator_with_trainer", "callbacks"),
    (P + "strategies/launchers/test_multiprocessing.py::test_fit_twice_raises", "strategies"),
    (P + "strategies/launchers/test_multiprocessing.py::test_memory_sharing_disabled", "strategies"),
    (P + "strategies/test_ddp_integration.py::test_ddp_cpu", "strategies"),
    (P + "strategies/test_ddp_integration.py::test_ddp_spawn_add_get_queue", "strategies"),
    (P + "trainer/connectors/test_data_connector.py::test_dataloader_reinit_for_subclass", "loops"),
    (P + "trainer/connectors/test_data_connector.py::test_eval_shuffle_with_distributed_sampler_replacement[False]", "loops"),
    (P + "trainer/connectors/test_data_connector.py::test_eval_shuffle_with_distributed_sampler_replacement[True]", "loops"),
    (P + "trainer/flags/test_overfit_batches.py::test_distributed_sampler_with_overfit_batches", "loops"),
    (P + "trainer/logging_/test_distributed_logging.py::test_all_rank_logging_ddp_cpu", "logging"),
    (P + "trainer/properties/test_get_model.py::test_get_model_ddp_cpu", "strategies"),
    (P + "trainer/test_dataloaders.py::test_distributed_sampler_without_global_seed", "loops"),
    (P + "trainer/test_trainer.py::test_fit_test_synchronization", "loops"),
    (P + "trainer/test_trainer.py::test_spawn_predict_return_predictions", "loops"),
    (P + "trainer/test_trainer.py::test_trainer_predict_ddp_spawn[cpu]", "loops"),
    (P + "tuner/test_lr_finder.py::test_lr_finder_with_ddp", "tuner"),
    (P + "tuner/test_scale_batch_size.py::test_batch_size_finder_with_distributed_strategies", "tuner"),
    (P + "tuner/test_tuning.py::test_tuner_with_distributed_strategies", "tuner"),
    (P + "utilities/test_combined_loader.py::test_combined_data_loader_validation_test[False]", "loops"),
    (P + "utilities/test_combined_loader.py::test_combined_data_loader_validation_test[True]", "loops"),
    (P + "utilities/test_combined_loader.py::test_combined_data_loader_with_max_size_cycle_and_ddp[False-cpu]", "loops"),
    (P + "utilities/test_combined_loader.py::test_combined_data_loader_with_max_size_cycle_and_ddp[True-cpu]", "loops"),
]

# Tests that check what only DDP has: a failure of these is N/A, with the reason.
NOT_APPLICABLE: dict[str, str] = {
    P + "checkpointing/test_model_checkpoint.py::test_model_checkpoint_no_extraneous_invocations":
        "asserts that only rank 0 calls torch.save; every rank writes its own tensors into a sharded checkpoint",
    P + "strategies/test_ddp_integration.py::test_ddp_cpu": "asserts isinstance(trainer.strategy, DDPStrategy)",
    P + "trainer/test_trainer.py::test_spawn_predict_return_predictions":
        "asserts isinstance(trainer.strategy, DDPStrategy) and the spawn launcher's ProcessRaisedException",
}

# Failures that fall under a row of issue 24's table (fixed by another change).
KNOWN_ROWS: dict[str, str] = {
    P + "callbacks/test_pruning.py::test_pruning_callback_ddp_cpu": "ModelPruning",
    P + "callbacks/test_stochastic_weight_avg.py::test_swa_callback_ddp_cpu": "StochasticWeightAveraging",
    P + "callbacks/test_weight_averaging.py::test_ema_ddp_spawn_cpu": "WeightAveraging / EMA",
    P + "callbacks/test_weight_averaging.py::test_ema_resume_ddp": "WeightAveraging / EMA",
    P + "checkpointing/test_torch_saving.py::test_model_torch_save_ddp_cpu": "torch.save(trainer.model) pickling",
    P + "overrides/test_distributed.py::test_params_synced_during_nonfit": "rank-divergent initial weights",
}

SWAP_ENV = "MFSDP_COMPAT_SWAP"  # "matrix_fsdp" or "ddp": what the strategy becomes
REPORT_ENV = "MFSDP_COMPAT_REPORT"  # a file every process appends its reports to (JSON lines)


# --------------------------------------------------------------------------- the pytest plugin
def _record(entry: dict[str, Any]) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        entry.update(pid=os.getpid(), local_rank=os.environ.get("LOCAL_RANK", "0"))
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _swapped(strategy: Any) -> Any:
    """``"ddp*"`` strings and plain ``DDPStrategy`` objects become matrix_fsdp; a subclass of
    ``DDPStrategy`` (a test's own) is kept and recorded as not swapped. In the ``ddp`` mode
    only the spawn-launched strings change, to ``"ddp"``."""
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_matrixfsdp as mf

    if os.environ.get(SWAP_ENV) == "ddp":
        if isinstance(strategy, str) and strategy in ("ddp_spawn", "ddp_fork", "ddp_notebook"):
            _record({"swap": strategy})
            return "ddp"
        return strategy
    if isinstance(strategy, str) and strategy.startswith("ddp"):
        _record({"swap": strategy})
        return "matrix_fsdp"
    if type(strategy) is DDPStrategy:
        _record({"swap": "DDPStrategy()"})
        kw = {"process_group_backend": strategy._process_group_backend}
        if strategy._timeout is not None:
            kw["timeout"] = strategy._timeout
        return mf.MatrixFSDPStrategy(**kw)
    if isinstance(strategy, DDPStrategy):
        _record({"kept": type(strategy).__name__})
    return strategy


def pytest_configure(config: Any) -> None:
    """Installed in every process of a swapped run, the launcher's children included."""
    if os.environ.get(SWAP_ENV) not in ("ddp", "matrix_fsdp"):
        return
    import functools

    from lightning.pytorch import Trainer

    import lightning_matrixfsdp  # noqa: F401 - registers "matrix_fsdp"

    if getattr(Trainer.__init__, "_mfsdp_compat", False):
        return
    original = Trainer.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if "strategy" in kwargs:
            kwargs["strategy"] = _swapped(kwargs["strategy"])
        original(self, *args, **kwargs)

    __init__._mfsdp_compat = True  # type: ignore[attr-defined]
    Trainer.__init__ = __init__  # type: ignore[method-assign]


def pytest_runtest_logreport(report: Any) -> None:
    if report.when == "call" or report.outcome != "passed":
        message = ""
        if report.outcome == "failed":
            message = _first_error(str(report.longrepr))
        elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])
        _record({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "message": message})


def _first_error(text: str) -> str:
    """The ``E   ...`` lines of a pytest failure, or its last line."""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    lines = [ln for ln in lines if ln]
    picked = next((ln for ln in lines if "Error" in ln or "assert" in ln), lines[0] if lines else "")
    return (picked or text.strip().splitlines()[-1] if text.strip() else "")[:300]


# --------------------------------------------------------------------------- the runner
def _standalone(tests_dir: Path, nodeid: str) -> bool:
    """Whether the test function carries ``RunIf(standalone=True)`` (its decorators, by source)."""
    file, _, name = nodeid.partition("::")
    name = name.split("[")[0]
    import ast

    src = (tests_dir / file).read_text()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return any("standalone=True" in (ast.get_source_segment(src, d) or "") for d in node.decorator_list)
    return False


def run_one(tests_dir: Path, nodeid: str, mode: str, timeout: float, worktree: Path) -> dict[str, Any]:
    """One test in its own pytest process group; its reports (every rank's) and the swaps made."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
        # Every process gets its own numbered tmp_path under this folder (pytest's default layout).
        env.update({SWAP_ENV: mode, REPORT_ENV: str(report), "PYTHONUNBUFFERED": "1", "PYTEST_DEBUG_TEMPROOT": tmp,
                    "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(worktree),
                                                   env.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
        if _standalone(tests_dir, nodeid):
            env["PL_RUN_STANDALONE_TESTS"] = "1"
        cmd = [sys.executable, "-m", "pytest", "-p", "lightning_compat", "-p", "no:cacheprovider", "-q", "-rN", nodeid]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the test's process group: pytest and its ranks
            out, _ = proc.communicate()
            timed_out = True
        entries = [json.loads(ln) for ln in report.read_text().splitlines()] if report.exists() else []
    return {"entries": entries, "timed_out": timed_out, "returncode": proc.returncode, "output": out,
            "seconds": time.monotonic() - start}


def outcome(res: dict[str, Any]) -> tuple[str, str]:
    """(pass | fail | skip, note) of one run."""
    reports = [e for e in res["entries"] if "outcome" in e]
    failed = [e for e in reports if e["outcome"] == "failed"]
    if res["timed_out"]:
        return "fail", f"timed out after {res['seconds']:.0f} s"
    if failed:
        return "fail", failed[0]["message"]
    if reports and all(e["outcome"] == "skipped" for e in reports):
        return "skip", reports[0]["message"]
    if reports:
        return "pass", ""
    tail = [ln for ln in res["output"].splitlines() if ln.strip()][-1:] or ["no output"]
    return "fail", f"no test report (exit {res['returncode']}): {tail[0][:200]}"


def verdict(nodeid: str, ddp: tuple[str, str], ours: tuple[str, str], swapped: bool, kept: list[str]) -> tuple[str, str]:
    """The table's result and note from both runs."""
    result, note = ours
    if not swapped and result != "skip":  # the test never ran matrix_fsdp (a DDPStrategy subclass of its own)
        return "N/A", ("no Trainer strategy swapped" + (f" (kept {', '.join(kept)})" if kept else "")
                       + (f"; {result}: {note}" if note else f"; {result}"))
    if result != "fail":
        return result, note
    row = f"row: {KNOWN_ROWS[nodeid]}; " if nodeid in KNOWN_ROWS else ""
    if nodeid in NOT_APPLICABLE:
        return "N/A", f"{row}{NOT_APPLICABLE[nodeid]} ({note})"
    if ddp[0] == "fail":
        return "N/A", f"{row}fails under ddp with this launcher too ({ddp[1]}); matrix_fsdp: {note}"
    return "fail", f"{row}{note}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lightning_src", type=Path, help="Lightning source folder (holds tests/tests_pytorch)")
    parser.add_argument("--out", type=Path, default=None, help="write the results table (Markdown) here")
    parser.add_argument("--only", action="append", default=None,
                        help="run only the tests whose id contains this (repeatable)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per test run (default 300)")
    parser.add_argument("--ddp-too", action="store_true",
                        help="run DDP for every test (default: only where matrix_fsdp fails)")
    args = parser.parse_args(argv)
    tests_dir = args.lightning_src / "tests"
    if not (tests_dir / "tests_pytorch" / "conftest.py").exists():
        parser.error(f"{tests_dir}/tests_pytorch/conftest.py not found: give the Lightning source folder")
    worktree = Path(__file__).resolve().parent.parent
    rows = []
    for nodeid, area in TESTS:
        if args.only and not any(o in nodeid for o in args.only):
            continue
        ours = run_one(tests_dir, nodeid, "matrix_fsdp", args.timeout, worktree)
        m = outcome(ours)
        # DDP runs where matrix_fsdp fails (or with --ddp-too): does the test pass with this launcher?
        base = run_one(tests_dir, nodeid, "ddp", args.timeout, worktree) if m[0] == "fail" or args.ddp_too else None
        d = outcome(base) if base is not None else ("-", "")
        swapped = any("swap" in e for e in ours["entries"])
        kept = sorted({e["kept"] for e in ours["entries"] if "kept" in e})
        result, note = verdict(nodeid, d, m, swapped, kept)
        rows.append((nodeid, area, d[0], m[0], result, note))
        print(f"{result:5s} mf={m[0]:4s} {ours['seconds']:4.0f}s ddp={d[0]:4s} {nodeid}  {note[:200]}", flush=True)
    counts = {k: sum(r[4] == k for r in rows) for k in ("pass", "fail", "N/A", "skip")}
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    print(summary)
    if args.out is not None:
        import lightning
        import torch

        lines = [f"lightning {lightning.__version__}, torch {torch.__version__}, tests of {args.lightning_src.name}; "
                 f"{len(rows)} tests: {summary}.", "",
                 "ddp: the test under DDP with matrix_fsdp's launcher, run where matrix_fsdp fails (- elsewhere).", "",
                 "| test | area | ddp | matrix_fsdp | result | note |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| `{_cell(n.removeprefix(P))}` | {a} | {d} | {m} | {r} | {_cell(note)} |"
                  for n, a, d, m, r, note in rows]
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
