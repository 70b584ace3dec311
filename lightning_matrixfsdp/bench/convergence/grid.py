"""Convergence benchmark of the orthogonalizers: does a faster one train as well?

    python -m lightning_matrixfsdp.bench.convergence --out bench_out/convergence --device cuda --gpus 0,1

Trains the demo GPT (:class:`~lightning_matrixfsdp.demos.gpt.GPT`, byte level) on real
offline text: pydoc's help topics plus the standard library's sources (the
``stdlib`` corpus; ``pydoc`` is the topics alone), split per document into train and
held-out validation. The grid is orthogonalizer x learning rate x seed; every run is
one process on one device (no data parallelism: comparing orthogonalizers needs
none), several per GPU at once. Each run: bf16 autocast, ``Muon(adjust_lr_fn=
"match_rms_adamw")``, gradient clipping 1.0, linear warmup then cosine decay, a
batch order fixed by the seed (the same batches for every orthogonalizer), the
validation loss every ``--eval-every`` steps and at the end ("final loss").

Each run writes one JSON under ``OUT/runs/`` as it finishes, so a timeout keeps what
finished and ``--skip-done`` completes the grid in a second command. Runs that
cannot finish before ``--deadline-s`` are not started (or are stopped). Before the
grid, a timing pass measures the optimizer step of each orthogonalizer alone on
one device (``--timing-steps`` after warm-up), on the trained model and on larger
matrices (``--timing-d-model``). At the end :func:`write_report` turns the JSONs
into ``convergence.md`` (table) and ``convergence.png`` (curves; needs the ``bench``
extra); ``--report-only`` redoes that from an existing ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from .corpus import corpus_documents  # noqa: F401  (its import path before corpus.py)
from .corpus import prepare_corpus
from .report import (
    DEFAULT,
    ORTHOGONALIZERS,
    summarize,
    timing_markdown,
    verdict,
    write_json,
    write_report,
)
from .run import RunSpec, build, train_run
from .timing import timing_pass
from .variants import CANDIDATE_SCHEDULES, parse_orthogonalizer

__all__ = ["CANDIDATE_SCHEDULES", "DEFAULT", "ORTHOGONALIZERS", "RunSpec", "build", "main", "parse_orthogonalizer",
           "summarize", "timing_pass", "train_run", "verdict", "write_report"]


def _orthogonalizer_arg(name: str) -> str:
    parse_orthogonalizer(name)
    return name


# ---------------------------------------------------------------------- scheduler


def grid(args: argparse.Namespace) -> list[RunSpec]:
    """Main grid ordered seed-major (a timeout leaves whole seeds), then the extras."""
    base = RunSpec(DEFAULT, args.lrs[0], 0, steps=args.steps, d_model=args.d_model, n_layers=args.n_layers,
                   n_heads=args.n_heads, seq_len=args.seq_len, batch_size=args.batch_size,
                   eval_every=args.eval_every, val_batches=args.val_batches, warmup=args.warmup)
    runs = [replace(base, orthogonalizer=o, lr=lr, seed=s)
            for s in args.seeds for lr in args.lrs for o in args.orthogonalizers]
    if args.extras:  # the default at twice the first lr: is the first lr the default's best?
        runs.append(replace(base, lr=2 * args.lrs[0], seed=args.seeds[0]))
    return runs


def _worker_cmd(spec: RunSpec, args: argparse.Namespace, work_dir: Path) -> list[str]:
    return [sys.executable, "-m", "lightning_matrixfsdp.bench.convergence", "--worker", json.dumps(asdict(spec)),
            "--out", str(args.out), "--work-dir", str(work_dir), "--device", args.device]


def run_grid(args: argparse.Namespace, work_dir: Path) -> None:
    """Launch one process per run, ``procs_per_device`` at a time on each device."""
    runs_dir = Path(args.out) / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    todo = [s for s in grid(args) if not (args.skip_done and (runs_dir / f"{s.name}.json").exists())]
    devices = args.gpus if args.device == "cuda" else ["cpu"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    running: list[tuple[subprocess.Popen, RunSpec, str, float, Any]] = []
    durations: list[float] = []
    timed = args.timing_steps <= 0 or (args.skip_done and (Path(args.out) / "timing.json").exists())
    print(f"[convergence] {len(todo)} runs to do on {devices} x {args.procs_per_device}", flush=True)

    def launch(dev: str) -> None:
        spec = todo.pop(0)
        denv = dict(env, CUDA_VISIBLE_DEVICES=dev) if args.device == "cuda" else env
        log = open(runs_dir / f"{spec.name}.log", "w")
        proc = subprocess.Popen(_worker_cmd(spec, args, work_dir), env=denv, stdout=log, stderr=subprocess.STDOUT)
        running.append((proc, spec, dev, time.monotonic(), log))

    def fill(devs: list[str]) -> None:
        for dev in devs:
            while todo and sum(1 for r in running if r[2] == dev) < args.procs_per_device:
                if durations and time.monotonic() - start + max(durations) > args.deadline_s:
                    print(f"[convergence] deadline: {len(todo)} runs not started", flush=True)
                    todo.clear()
                    return
                launch(dev)

    fill(devices[1:] if not timed else devices)
    if not timed:  # the timing pass alone on the first device, while the others train
        device = torch.device("cuda", int(devices[0])) if args.device == "cuda" else torch.device("cpu")
        result = timing_pass(grid(args)[0], list(args.orthogonalizers), device, args.timing_steps,
                             args.timing_d_model, args.timing_rounds)
        write_json(Path(args.out) / "timing.json", result)
        print(f"[convergence] timing: {json.dumps(result['models'])}", flush=True)
    fill(devices)
    while running:
        time.sleep(0.2)
        for item in list(running):
            proc, spec, dev, t0, log = item
            if proc.poll() is None:
                if time.monotonic() - start > args.deadline_s:
                    proc.terminate()
                    proc.wait()
                    log.close()
                    print(f"[convergence] deadline: stopped {spec.name}", flush=True)
                    running.remove(item)
                continue
            running.remove(item)
            log.close()
            durations.append(time.monotonic() - t0)
            status = "done" if proc.returncode == 0 else f"FAILED rc={proc.returncode} (see {spec.name}.log)"
            print(f"[convergence] {spec.name} {status} in {durations[-1]:.0f} s", flush=True)
        fill(devices)


def worker(spec_json: str, args: argparse.Namespace) -> None:
    spec = RunSpec(**json.loads(spec_json))
    if args.device == "cpu":
        torch.set_num_threads(1)  # several runs share the cores; also keeps CPU runs reproducible
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", 0)  # CUDA_VISIBLE_DEVICES picks the GPU
        torch.cuda.set_device(device)
        torch.set_num_threads(2)  # the host only launches kernels; several runs share it
    corpus = torch.load(Path(args.work_dir) / "corpus.pt")
    result = train_run(spec, corpus, device)
    write_json(Path(args.out) / "runs" / f"{spec.name}.json", result)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m lightning_matrixfsdp.bench.convergence", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out/convergence")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--gpus", type=lambda s: s.split(","), default=["0", "1"], help="CUDA device ids, comma-separated")
    ap.add_argument("--procs-per-device", "--procs-per-gpu", type=int, default=3, help="runs at once on each device")
    ap.add_argument("--orthogonalizers", nargs="+", default=list(ORTHOGONALIZERS), type=_orthogonalizer_arg,
                    help="names of ORTHOGONALIZERS, each optionally with @<ns_steps> (e.g. newton_schulz@4)")
    ap.add_argument("--lrs", nargs="+", type=float, default=[0.00125, 0.000625],
                    help="the first is the reference lr (default: the default's best on the benchmark model, and half)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--no-extras", dest="extras", action="store_false",
                    help="skip the default at twice the first lr (one seed)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--n-layers", type=int, default=6)
    ap.add_argument("--n-heads", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--val-batches", type=int, default=40)
    ap.add_argument("--corpus", choices=("stdlib", "pydoc"), default="stdlib")
    ap.add_argument("--max-bytes", type=int, default=32_000_000)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--timing-steps", type=int, default=30, help="0: no timing pass")
    ap.add_argument("--timing-d-model", type=int, nargs="*", default=[2048, 4096],
                    help="also time 2-layer models of these widths (MLP 4x: wide matrices); none: off")
    ap.add_argument("--timing-rounds", type=int, default=1,
                    help="orthogonalizers take turns this many times in the timing pass (median reported)")
    ap.add_argument("--timing-only", action="store_true",
                    help="only the timing pass, alone on the first device (no training): the clean speed figure")
    ap.add_argument("--deadline-s", type=float, default=float("inf"),
                    help="start no run that would end after this many seconds; stop those still running then")
    ap.add_argument("--skip-done", action="store_true", help="keep runs (and the timing) already under OUT")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.timing_only:
        device = torch.device("cuda", int(args.gpus[0])) if args.device == "cuda" else torch.device("cpu")
        result = timing_pass(grid(args)[0], list(args.orthogonalizers), device, args.timing_steps,
                             args.timing_d_model, args.timing_rounds)
        write_json(out / "timing.json", result)
        print(timing_markdown(result))
        return
    if not args.report_only:
        with tempfile.TemporaryDirectory(prefix="mfsdp-convergence-") as tmp:
            work_dir = Path(args.work_dir or tmp)
            meta = prepare_corpus(args.corpus, args.max_bytes, args.val_fraction, work_dir)
            write_json(out / "meta.json", meta)
            run_grid(args, work_dir)
    if not (out / "runs").is_dir() or not any((out / "runs").glob("*.json")):
        sys.exit(f"[convergence] no finished run under {out / 'runs'} (see the .log files there)")
    print(write_report(out))


if __name__ == "__main__":
    main()
