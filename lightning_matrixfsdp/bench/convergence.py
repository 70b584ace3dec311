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
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_matrixfsdp.demos.data import ByteTextDataModule, split_documents, truncate_documents
from lightning_matrixfsdp.demos.gpt import GPT
from lightning_matrixfsdp.optim.muon import Muon
from lightning_matrixfsdp.optim.orthogonalize import orthogonalize_batched, orthogonalize_with

from .convergence_report import (
    DEFAULT,
    ORTHOGONALIZERS,
    summarize,
    timing_markdown,
    verdict,
    write_json,
    write_report,
)

__all__ = ["CANDIDATE_SCHEDULES", "DEFAULT", "ORTHOGONALIZERS", "RunSpec", "build", "main", "parse_orthogonalizer",
           "summarize", "timing_pass", "train_run", "verdict", "write_report"]

#: Other four-quintic schedules fitted like ``FAST_SCHEDULE`` (``scripts/fit_fast_schedule.py``
#: with other band limits and a weight on matching the default below 1e-3), run as
#: ``"fast~<name>"`` to compare them in training (docs/decisions.md, issue 15). The name is
#: the slope at 0 relative to the default's.
CANDIDATE_SCHEDULES: dict[str, tuple[tuple[float, float, float], ...]] = {
    "slope083": ((5.230927, -14.897663, 10.623016), (4.641483, -8.675433, 4.079784),
                 (4.083947, -6.173584, 2.397376), (4.07533, -5.650123, 2.193497)),
    "slope099": ((5.304776, -15.135395, 10.80527), (4.643679, -8.380406, 3.794984),
                 (4.529153, -6.686324, 2.506685), (4.295174, -5.081765, 1.606076)),
}


def parse_orthogonalizer(name: str) -> tuple[str, int, str | None]:
    """``"newton_schulz@4"`` -> ``("newton_schulz", 4, None)``: a Muon orthogonalizer, its
    ``ns_steps`` (5 without ``@``) and, for ``"fast~<name>"``, a candidate of
    :data:`CANDIDATE_SCHEDULES` that replaces ``fast``'s schedule."""
    base, sep, steps = name.partition("@")
    base, tilde, candidate = base.partition("~")
    if (base not in ORTHOGONALIZERS or (sep and not steps.isdigit())
            or (tilde and (base != "fast" or candidate not in CANDIDATE_SCHEDULES))):
        raise argparse.ArgumentTypeError(
            f"orthogonalizer {name!r}: expected one of {', '.join(ORTHOGONALIZERS)}, optionally with "
            f"@<ns_steps>, or fast~<one of {', '.join(CANDIDATE_SCHEDULES)}>")
    return base, int(steps) if sep else 5, candidate or None


def _candidate_muon(schedule: tuple[tuple[float, float, float], ...]) -> type[Muon]:
    """Muon whose ``"fast"`` runs ``schedule`` (the same kernels as ``fast``)."""

    class CandidateMuon(Muon):
        @staticmethod
        def orthogonalize(group: dict[str, Any], updates: list[torch.Tensor]) -> list[torch.Tensor]:
            if len(updates) > 1:
                return orthogonalize_batched(updates, schedule, group["eps"])
            return [orthogonalize_with(u, schedule, group["eps"], group["symmetric_blocks"]) for u in updates]

    return CandidateMuon


def _orthogonalizer_arg(name: str) -> str:
    parse_orthogonalizer(name)
    return name


@dataclass(frozen=True)
class RunSpec:
    """One training run: everything that determines its losses."""

    orthogonalizer: str
    lr: float
    seed: int
    steps: int = 1000
    d_model: int = 1024
    n_layers: int = 6
    n_heads: int = 16
    seq_len: int = 512
    batch_size: int = 16
    weight_decay: float = 0.01
    adamw_lr: float = 3e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    eval_every: int = 250
    val_batches: int = 40

    @property
    def name(self) -> str:
        return f"{self.orthogonalizer}_lr{self.lr:g}_s{self.seed}"


# ------------------------------------------------------------------------- corpus


def corpus_documents(kind: str, max_bytes: int | None) -> list[bytes]:
    """The documents of ``kind`` ("pydoc" or "stdlib"), in a fixed order, capped at ``max_bytes``.

    "stdlib" adds every ``*.py`` under the standard library (not site-packages) to the
    help topics, shuffled by a fixed seed so that a cap keeps a mix of packages.
    """
    docs = ByteTextDataModule(data_dir=None).documents()
    if kind == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        paths = []
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
            paths += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
        order = torch.randperm(len(paths), generator=torch.Generator().manual_seed(0)).tolist()
        for i in order:
            with open(paths[i], "rb") as f:
                docs.append(f.read())
    elif kind != "pydoc":
        raise ValueError(f"unknown corpus {kind!r}; valid: pydoc, stdlib")
    return truncate_documents(docs, max_bytes)


def prepare_corpus(kind: str, max_bytes: int | None, val_fraction: float, work_dir: Path) -> dict[str, Any]:
    """Split the corpus (tail of each document -> validation) and save it for the workers."""
    train, val = split_documents(corpus_documents(kind, max_bytes), val_fraction)
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"train": train, "val": val}, work_dir / "corpus.pt")
    return {"corpus": kind, "train_bytes": train.numel(), "val_bytes": val.numel(), "val_fraction": val_fraction}


# -------------------------------------------------------------------------- a run


def build(spec: RunSpec, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The seeded model, its Muon (with the AdamW tail) and the warmup-cosine schedule."""
    torch.manual_seed(spec.seed)
    model = GPT(vocab_size=256, max_seq_len=spec.seq_len, d_model=spec.d_model, n_layers=spec.n_layers,
                n_heads=spec.n_heads).to(device)
    orthogonalizer, ns_steps, candidate = parse_orthogonalizer(spec.orthogonalizer)
    cls = Muon if candidate is None else _candidate_muon(CANDIDATE_SCHEDULES[candidate])
    opt = cls(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, adjust_lr_fn="match_rms_adamw",
               adamw_lr=spec.adamw_lr, orthogonalizer=orthogonalizer, ns_steps=ns_steps)

    def factor(step: int) -> float:
        if step < spec.warmup:
            return (step + 1) / spec.warmup
        progress = min(1.0, (step - spec.warmup) / max(1, spec.steps - spec.warmup))
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def batch_starts(spec: RunSpec, n_tokens: int) -> torch.Tensor:
    """Window starts of every training batch, ``(steps, batch)``: a function of the seed only."""
    gen = torch.Generator().manual_seed(1_000_003 * spec.seed + 17)
    return torch.randint(0, n_tokens - spec.seq_len - 1, (spec.steps, spec.batch_size), generator=gen)


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = tokens[starts[:, None] + torch.arange(seq_len + 1, device=tokens.device)].long()
    return chunk[:, :-1], chunk[:, 1:]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


@torch.no_grad()
def validate(model: torch.nn.Module, val: torch.Tensor, spec: RunSpec, device: torch.device) -> float:
    """Mean loss over the first ``val_batches`` non-overlapping windows of the validation text."""
    model.eval()
    n = min(spec.val_batches * spec.batch_size, (val.numel() - 1) // spec.seq_len)
    if n == 0:
        raise ValueError(f"validation text too short ({val.numel()} bytes) for seq_len={spec.seq_len}")
    starts = torch.arange(n, device=val.device) * spec.seq_len
    total = torch.zeros((), device=device)
    for i in range(0, n, spec.batch_size):
        x, y = _windows(val, starts[i:i + spec.batch_size], spec.seq_len)
        total += _loss(model, x, y, device) * x.size(0)
    model.train()
    return float(total / n)


def train_run(spec: RunSpec, corpus: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """One run: train ``spec.steps`` steps, return losses and timings (a JSON-able dict)."""
    model, opt, sched = build(spec, device)
    train, val = corpus["train"].to(device), corpus["val"].to(device)
    starts = batch_starts(spec, train.numel()).to(device)
    losses = torch.empty(spec.steps, device=device)
    evals: list[list[float]] = []
    t0 = time.perf_counter()
    for step in range(spec.steps):
        x, y = _windows(train, starts[step], spec.seq_len)
        loss = _loss(model, x, y, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        sched.step()
        losses[step] = loss.detach()
        if (step + 1) % spec.eval_every == 0 and step + 1 < spec.steps:
            evals.append([step + 1, validate(model, val, spec, device)])
    final = validate(model, val, spec, device)
    evals.append([spec.steps, final])
    wall = time.perf_counter() - t0
    train_losses = losses.tolist()
    return {"spec": asdict(spec), "name": spec.name, "train_loss": train_losses, "val_loss": evals,
            "final_val_loss": final, "final_train_loss": statistics.fmean(train_losses[-50:]),
            "finite": all(math.isfinite(v) for v in train_losses) and math.isfinite(final),
            "wall_s": wall, "ms_per_step_shared": 1e3 * wall / spec.steps,
            "params": sum(p.numel() for p in model.parameters()), "device": _device_name(device),
            "torch": torch.__version__}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ------------------------------------------------------------------------- timing


def time_optimizer(spec: RunSpec, device: torch.device, steps: int, warmup: int = 5) -> dict[str, float]:
    """Median ms of the optimizer step (and of forward+backward) over ``steps`` steps, alone."""
    model, opt, _ = build(spec, device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (spec.batch_size, spec.seq_len + 1), generator=gen).to(device)
    fb, st = [], []
    for i in range(warmup + steps):
        t = [time.perf_counter()]
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if device.type == "cuda" else []
        if ev:
            ev[0].record()
        loss = _loss(model, x[:, :-1], x[:, 1:], device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        if ev:
            ev[1].record()
        t.append(time.perf_counter())
        opt.step()
        if ev:
            ev[2].record()
            torch.cuda.synchronize(device)
        t.append(time.perf_counter())
        if i >= warmup:
            if ev:
                fb.append(ev[0].elapsed_time(ev[1]))
                st.append(ev[1].elapsed_time(ev[2]))
            else:
                fb.append(1e3 * (t[1] - t[0]))
                st.append(1e3 * (t[2] - t[1]))
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"opt_ms": statistics.median(st), "fwd_bwd_ms": statistics.median(fb)}


def timing_pass(base: RunSpec, orthogonalizers: list[str], device: torch.device, steps: int,
                large_d_models: list[int], rounds: int = 1) -> dict[str, Any]:
    """Each orthogonalizer's optimizer step on the trained model and on wider 2-layer ones.

    With ``rounds > 1`` the orthogonalizers take turns ``rounds`` times and each row is the
    median over rounds (``opt_ms_rounds`` keeps them all): a drift of the machine while
    one of them is measured then shows up as spread instead of as a difference.
    """
    out: dict[str, Any] = {"device": _device_name(device), "steps": steps, "rounds": rounds, "models": {}}
    models = {"trained": base}
    for d in large_d_models:
        models[f"d_model {d}"] = replace(base, d_model=d, n_layers=2, n_heads=max(1, d // 128), batch_size=4)
    for label, spec in models.items():
        per_round: dict[str, list[dict[str, float]]] = {name: [] for name in orthogonalizers}
        for _ in range(rounds):
            for name in orthogonalizers:
                per_round[name].append(time_optimizer(replace(spec, orthogonalizer=name), device, steps))
        rows = {name: {"opt_ms": statistics.median(r["opt_ms"] for r in rs),
                       "fwd_bwd_ms": statistics.median(r["fwd_bwd_ms"] for r in rs),
                       "opt_ms_rounds": [r["opt_ms"] for r in rs]}
                for name, rs in per_round.items()}
        out["models"][label] = {"d_model": spec.d_model, "n_layers": spec.n_layers, "rows": rows}
    return out


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
