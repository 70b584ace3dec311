"""The convergence benchmark's command on CPU with a tiny model: one JSON per run, the
table, the plot, ``--skip-done``, and reproducible runs (same seed, same losses)."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch

from lightning_matrixfsdp.bench.convergence import grid as convergence
from lightning_matrixfsdp.bench.convergence.report import plot
from lightning_matrixfsdp.optim.muon import Muon
from lightning_matrixfsdp.optim.orthogonalize import orthogonalize_with

TINY = ["--device", "cpu", "--corpus", "pydoc", "--max-bytes", "60000", "--steps", "4", "--warmup", "2",
        "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4",
        "--eval-every", "2", "--val-batches", "2", "--lrs", "0.02", "--seeds", "0", "--no-extras",
        "--procs-per-device", "2", "--timing-d-model", "48"]


def test_grid_writes_runs_table_plot_and_is_reproducible(tmp_path, capsys):
    out = tmp_path / "conv"
    convergence.main(TINY + ["--out", str(out), "--orthogonalizers", "newton_schulz", "newton_schulz@4",
                             "--timing-steps", "1"])
    runs = {p.stem: json.loads(p.read_text()) for p in (out / "runs").glob("*.json")}
    assert set(runs) == {"newton_schulz_lr0.02_s0", "newton_schulz@4_lr0.02_s0"}
    for r in runs.values():
        assert len(r["train_loss"]) == 4 and r["finite"]
        assert [s for s, _ in r["val_loss"]] == [2, 4] and r["val_loss"][-1][1] == r["final_val_loss"]
    ns, other = runs["newton_schulz_lr0.02_s0"], runs["newton_schulz@4_lr0.02_s0"]
    # same seed: same initial weights and batches, so the loss before the first step is the same
    assert ns["train_loss"][0] == other["train_loss"][0]
    assert ns["train_loss"][1:] != other["train_loss"][1:]  # the optimizers differ afterwards
    # the same run again in this process (one thread, as the worker): the same losses, bit for bit
    spec = convergence.RunSpec(**ns["spec"])
    corpus = dict(zip(("train", "val"), _corpus()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = convergence.train_run(spec, corpus, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert again["train_loss"] == ns["train_loss"] and again["final_val_loss"] == ns["final_val_loss"]

    md = (out / "convergence.md").read_text()
    assert "| newton_schulz | 0.02 | 1 |" in md and "| newton_schulz@4 | 0.02 | 1 |" in md
    timing = json.loads((out / "timing.json").read_text())
    assert set(timing["models"]) == {"trained", "d_model 48"}
    assert set(timing["models"]["trained"]["rows"]) == {"newton_schulz", "newton_schulz@4"}
    assert "opt step ms (d_model 48)" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "convergence.png").stat().st_size > 1000
        # variants get their own curve, not only the names of the default grid
        drawn = plot(list(runs.values()), tmp_path / "again.png")
        assert sorted(drawn) == [(0.02, "newton_schulz"), (0.02, "newton_schulz@4")]

    # --skip-done: nothing is run again
    stamp = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}
    capsys.readouterr()
    convergence.main(TINY + ["--out", str(out), "--orthogonalizers", "newton_schulz", "newton_schulz@4", "--skip-done"])
    assert "0 runs to do" in capsys.readouterr().out
    assert stamp == {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}


def _corpus() -> tuple[torch.Tensor, torch.Tensor]:
    from lightning_matrixfsdp.demos.data import split_documents

    return split_documents(convergence.corpus_documents("pydoc", 60000), 0.05)


def test_summary_spread_and_verdict():
    """Mean, spread and the fast-vs-default verdict, on hand-made results."""
    def run(name, lr, seed, val):
        spec = {"orthogonalizer": name, "lr": lr, "seed": seed}
        return {"spec": spec, "final_val_loss": val, "final_train_loss": val, "wall_s": 1.0, "finite": True}

    runs = [run("newton_schulz", 0.02, s, v) for s, v in enumerate([2.0, 2.1, 2.2])]
    runs += [run("newton_schulz", 0.01, s, v) for s, v in enumerate([2.3, 2.3, 2.3])]
    runs += [run("fast", 0.02, s, v) for s, v in enumerate([2.05, 2.15, 2.25])]
    rows = convergence.summarize(runs)
    ns = next(r for r in rows if r["orthogonalizer"] == "newton_schulz" and r["lr"] == 0.02)
    assert abs(ns["val_mean"] - 2.1) < 1e-12 and abs(ns["val_std"] - 0.1) < 1e-12
    assert (ns["val_min"], ns["val_max"]) == (2.0, 2.2)
    assert "best lr (of those with several seeds) is 0.02" in convergence.verdict(rows)
    assert "within the spread" in convergence.verdict(rows)  # +0.05 against +-0.1
    worse = runs[:6] + [run("fast", 0.02, s, v) for s, v in enumerate([2.3, 2.4, 2.5])]
    assert "WORSE" in convergence.verdict(convergence.summarize(worse))


def test_orthogonalizer_variants_set_ns_steps():
    """``name@k`` runs Muon's ``name`` with ``ns_steps=k``; anything else is refused by name."""
    assert convergence.parse_orthogonalizer("fast") == ("fast", 5, None)
    assert convergence.parse_orthogonalizer("newton_schulz@4") == ("newton_schulz", 4, None)
    assert convergence.parse_orthogonalizer("fast~slope083") == ("fast", 5, "slope083")
    spec = convergence.RunSpec("newton_schulz@4", 0.02, 0, d_model=32, n_layers=1, n_heads=2, seq_len=16)
    _, opt, _ = convergence.build(spec, torch.device("cpu"))
    assert {g["ns_steps"] for g in opt.param_groups} == {4}
    # a candidate schedule runs instead of fast's: its update is the candidate's composite
    spec = convergence.RunSpec("fast~slope099", 0.02, 0, d_model=32, n_layers=1, n_heads=2, seq_len=16)
    _, opt, _ = convergence.build(spec, torch.device("cpu"))
    grad = torch.randn(16, 48, generator=torch.Generator().manual_seed(0))
    group = opt.param_groups[0]
    mine = type(opt).orthogonalize(group, [grad])[0]
    assert torch.equal(mine, orthogonalize_with(grad, convergence.CANDIDATE_SCHEDULES["slope099"], group["eps"], 1))
    assert not torch.equal(mine, Muon.orthogonalize(group, [grad])[0])
    for bad in ("newton", "newton_schulz@", "newton_schulz@x", "fast@four", "fast~nope", "newton_schulz~slope083"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected one of"):
            convergence.parse_orthogonalizer(bad)
    with pytest.raises(SystemExit):
        convergence.parse_args(["--orthogonalizers", "newton"])
