"""The CLI entry points, the demo modules and the examples, run as a user would.

Subprocess tests run the real commands (2 CPU processes, gloo) with a few steps and
check: exit status 0, TensorBoard event files written, finite losses, and that the
optimizer which actually stepped is ``lightning_matrixfsdp``'s Muon (printed by the
``OptimizerReport`` callback). Tests that need MatrixFSDPStrategy/Muon skip with a
reason until those are importable; the rest (data, model, callback, the CLI on one
process) need no strategy.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lightning_matrixfsdp.demos import REPORT_PREFIX, ByteTextDataModule, LocalTokenDataModule, OptimizerReport
from lightning_matrixfsdp.demos.data import TokenWindows, decode, encode, split_documents
from lightning_matrixfsdp.demos.gpt import GPT, WarmupCosine

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SUBPROCESS_TIMEOUT = 150

from conftest import clean_env  # noqa: E402


def _runtime_missing() -> Optional[str]:
    """Why the strategy tests cannot run yet, or None when they can."""
    try:
        from lightning_matrixfsdp import MatrixFSDPStrategy, Muon  # noqa: F401
    except ImportError as err:
        return f"lightning_matrixfsdp.MatrixFSDPStrategy / Muon not importable yet: {err}"
    return None


needs_runtime = pytest.mark.skipif(_runtime_missing() is not None, reason=str(_runtime_missing()))


def _console_script() -> list[str]:
    """The installed ``lightning-matrixfsdp`` of this interpreter, else ``python -m``."""
    beside = Path(sys.executable).with_name("lightning-matrixfsdp")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("lightning-matrixfsdp")
    return [found] if found else [sys.executable, "-m", "lightning_matrixfsdp"]


def _run(cmd: list[str], cwd: Path, timeout: float = SUBPROCESS_TIMEOUT) -> subprocess.CompletedProcess:  # noqa: D103
    env = clean_env()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


def _report(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    lines = [ln.split(REPORT_PREFIX, 1)[1] for ln in proc.stdout.splitlines() if REPORT_PREFIX in ln]
    assert len(lines) == 1, f"expected one report line (rank 0 only), got {lines}\n{proc.stdout[-3000:]}"
    return json.loads(lines[0])


def _scalars(log_root: Path, tag: str) -> list[float]:
    """All values of one scalar tag in the TensorBoard event files under log_root."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = sorted(log_root.rglob("events.out.tfevents.*"))
    assert event_files, f"no TensorBoard event files under {log_root}"
    values: list[float] = []
    for run_dir in sorted({f.parent for f in event_files}):
        acc = EventAccumulator(str(run_dir))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values += [e.value for e in acc.Scalars(tag)]
    assert values, f"scalar {tag!r} not logged under {log_root}"
    return values


def _is_our_muon(report: dict[str, Any]) -> bool:
    return any(
        name.startswith("lightning_matrixfsdp") and name.rsplit(".", 1)[-1] == "Muon"
        for name in report["optimizer_chain"]
    )


def _check_trained(
    proc: subprocess.CompletedProcess, log_root: Path, steps: int, muon: bool, world_size: int = 2
) -> dict[str, Any]:
    report = _report(proc)
    assert report["steps"] == steps
    assert report["world_size"] == world_size
    assert report["finite"] and math.isfinite(report["last_loss"])
    losses = _scalars(log_root, "train_loss")
    assert all(math.isfinite(v) for v in losses), losses
    if muon:
        assert _is_our_muon(report), f"the optimizer that stepped was not lightning_matrixfsdp's Muon: {report}"
        assert not any("SGD" in n for n in report["optimizer_chain"]), report
        assert "MatrixFSDPStrategy" in report["strategy"], report
    return report


# ---------------------------------------------------------------- in-process: data, model, callback


def test_byte_tokenizer_round_trip() -> None:
    text = "Muon on owners: ü, ß, 漢字"
    tokens = encode(text)
    assert tokens.dtype == torch.uint8 and tokens.numel() == len(text.encode("utf-8"))
    assert decode(tokens) == text


def test_split_is_per_document_and_disjoint() -> None:
    docs = [bytes(range(100)), b"b" * 40]
    train, val = split_documents(docs, 0.1)
    assert bytes(val.tolist()) == bytes(range(90, 100)) + b"\n\n" + b"b" * 4
    assert bytes(train.tolist()) == bytes(range(90)) + b"\n\n" + b"b" * 36
    with pytest.raises(ValueError):
        split_documents(docs, 1.0)


def test_windows_are_next_token_pairs() -> None:
    ds = TokenWindows(torch.arange(23, dtype=torch.uint8), seq_len=5)
    assert len(ds) == 4  # (23 - 1) // 5 windows, the last target byte must exist
    x, y = ds[3]
    assert x.dtype == torch.long and x.tolist() == [15, 16, 17, 18, 19] and y.tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        ds[4]


def test_default_corpus_is_real_and_deterministic() -> None:
    a = ByteTextDataModule(seq_len=64, batch_size=4)
    b = ByteTextDataModule(seq_len=64, batch_size=4)
    a.setup("fit")
    b.setup("fit")
    assert a.train_set is not None and a.val_set is not None and b.train_set is not None
    assert a.train_set.tokens.numel() > 300_000, "the built-in corpus should be sizable"
    assert torch.equal(a.train_set.tokens, b.train_set.tokens)
    assert 0 < len(a.val_set) < len(a.train_set) // 10
    assert "statement" in decode(a.train_set.tokens[:4096])  # English prose from the reference manual
    x, y = next(iter(a.val_dataloader()))
    assert x.shape == y.shape == (4, 64) and int(x.max()) < a.vocab_size
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_data_dir_accepts_directory_file_and_glob(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha " * 200)
    (tmp_path / "sub" / "b.md").write_text("beta " * 200)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01" * 500)  # binary: must be skipped
    sizes = {}
    for key, spec in {
        "dir": str(tmp_path),
        "file": str(tmp_path / "a.txt"),
        "glob": str(tmp_path / "**" / "*.md"),
    }.items():
        dm = ByteTextDataModule(data_dir=spec, seq_len=16, batch_size=2, val_fraction=0.1)
        dm.setup("fit")
        assert dm.train_set is not None
        assert 0 not in dm.train_set.tokens.tolist(), f"{key}: binary file leaked into the corpus"
        sizes[key] = dm.train_set.tokens.numel()
    assert sizes["dir"] > sizes["file"] > 0 and sizes["glob"] > 0
    with pytest.raises(FileNotFoundError):
        ByteTextDataModule(data_dir=str(tmp_path / "nothing-*.txt")).setup("fit")


def test_gpt_is_causal_and_shaped() -> None:
    torch.manual_seed(0)
    model = GPT(max_seq_len=16, d_model=32, n_layers=2, n_heads=4).eval()
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert "configure_model" not in vars(GPT)  # the strategy must wrap it by itself
    idx = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        out = model(idx)
        changed = idx.clone()
        changed[:, 7] = (changed[:, 7] + 1) % 256
        out2 = model(changed)
    assert out.shape == (2, 12, 256)
    torch.testing.assert_close(out[:, :7], out2[:, :7])  # the past does not see the future
    assert not torch.allclose(out[:, 7:], out2[:, 7:])
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_warmup_cosine_schedule() -> None:
    fn = WarmupCosine(warmup_steps=4, total_steps=20, min_ratio=0.1, cosine=True)
    assert fn(0) == pytest.approx(0.25) and fn(3) == pytest.approx(1.0)
    assert fn(4) == pytest.approx(1.0) and fn(20) == pytest.approx(0.1) and fn(100) == pytest.approx(0.1)
    assert all(fn(s) >= fn(s + 1) for s in range(4, 20))


def test_optimizer_report_sees_through_wrappers() -> None:
    from lightning_matrixfsdp.demos import _optimizer_chain

    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    class Routing:  # shape of a wrapper that holds the real optimizer
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    chain = _optimizer_chain(Routing(inner))
    assert len(chain) == 2 and chain[0].endswith("Routing") and chain[1] == "torch.optim.sgd.SGD"
    assert OptimizerReport().loss_key == "train_loss"


def test_untouched_transformer_prepare_data_is_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's own prepare_data must find the stand-in and never reach for the network."""
    from lightning.pytorch.demos import LightningTransformer
    from lightning.pytorch.demos.transformer import _REQUESTS_AVAILABLE

    if not _REQUESTS_AVAILABLE:
        pytest.skip("LightningTransformer.prepare_data imports requests even offline; not installed")
    import requests

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(requests, "get", no_network)
    monkeypatch.chdir(tmp_path)
    dm = LocalTokenDataModule(cache_bytes=4096)
    dm.prepare_data()
    standin = tmp_path / "data" / "wikitext-2.txt"
    assert standin.read_text(encoding="utf-8").startswith("# Local stand-in")
    LightningTransformer(vocab_size=dm.vocab_size).prepare_data()
    standin.write_text("a real file stays\n")
    dm.prepare_data()
    assert standin.read_text() == "a real file stays\n"


# ---------------------------------------------------------------- subprocess: entry points and examples


def test_module_entry_point_help(tmp_path: Path) -> None:
    top = _run([sys.executable, "-m", "lightning_matrixfsdp", "--help"], tmp_path)
    assert "usage: lightning-matrixfsdp" in top.stdout and "fit" in top.stdout


def test_cli_exposes_optimizer(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (no interpreter start-up): --optimizer exists, so existing modules can get Muon."""
    from lightning_matrixfsdp.cli import cli_main

    monkeypatch.setattr(sys, "argv", ["lightning-matrixfsdp"])  # not pytest's own arguments
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--optimizer" in out and "--lr_scheduler" in out


def test_pretrain_yaml_plumbing_in_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example config through the CLI on one process (no strategy needed): data, model, metrics, logs.

    In-process to stay cheap; the 2-process run with matrix_fsdp is the test below.
    """
    from lightning_matrixfsdp.cli import cli_main

    monkeypatch.setattr(sys, "argv", ["lightning-matrixfsdp"])
    monkeypatch.chdir(tmp_path)
    cli_main(
        ["fit", "--config", str(EXAMPLES / "pretrain_gpt.yaml"), "--trainer.strategy", "auto",
         "--trainer.devices", "1", "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2",
         "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar",
         "false", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    )
    proc = subprocess.CompletedProcess(args=[], returncode=0, stdout=capsys.readouterr().out)
    _check_trained(proc, tmp_path / "runs", steps=4, muon=False, world_size=1)
    assert all(math.isfinite(v) for v in _scalars(tmp_path / "runs", "train_ppl"))
    assert all(math.isfinite(v) for v in _scalars(tmp_path / "runs", "val_ppl"))
    assert list((tmp_path / "runs" / "pretrain_gpt").glob("version_*/config.yaml"))


@pytest.fixture(scope="module")
def examples_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """The three 2-process trainings below in one job (tests/helpers/run_examples.py: the ranks start and
    import once): the pretraining config through the CLI, the fine-tuning script, its config through the
    CLI. Each part is what a user runs; the tests check one part each."""
    from helpers.run_examples import command, parts

    root = tmp_path_factory.mktemp("examples")
    proc = _run(command(
        ["cli", "fit", "--config", EXAMPLES / "pretrain_gpt.yaml", "--trainer.max_steps", "6",
         "--trainer.log_every_n_steps", "2", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2",
         "--trainer.logger.init_args.save_dir", root / "pretrain"],
        ["script", EXAMPLES / "finetune_muon.py", "--max-steps", "4", "--log-every-n-steps", "2",
         "--save-dir", root / "script"],
        ["cli", "fit", "--config", EXAMPLES / "finetune_muon.yaml", "--trainer.max_steps", "4",
         "--trainer.log_every_n_steps", "2", "--trainer.logger.init_args.save_dir", root / "yaml"],
        ["cli", "fit", "--config", EXAMPLES / "pipeline.yaml", "--trainer.max_steps", "3",
         "--trainer.val_check_interval", "3", "--trainer.strategy.pipeline_schedule", "GPipe"],
        ["script", EXAMPLES / "pipeline.py", "--steps", "3"]),
        root, timeout=3 * SUBPROCESS_TIMEOUT)
    return root, [subprocess.CompletedProcess(proc.args, 0, stdout=out) for out in parts(proc.stdout, 5)]


def test_console_script_calls_the_cli_main() -> None:
    """The installed ``lightning-matrixfsdp`` runs ``lightning_matrixfsdp.cli.main``, which the runs below call."""
    from importlib.metadata import entry_points

    from lightning_matrixfsdp import cli

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "lightning-matrixfsdp"]
    assert ep.load() is cli.main, ep.value
    script = Path(_console_script()[0])
    if script.name == "lightning-matrixfsdp":  # pip's wrapper imports and calls that function
        text = script.read_text()
        assert "lightning_matrixfsdp.cli" in text and "main" in text, text


@needs_runtime
def test_pretrain_yaml_matrix_fsdp(examples_run) -> None:
    root, (proc, *_) = examples_run
    _check_trained(proc, root / "pretrain", steps=6, muon=True)
    assert all(math.isfinite(v) for v in _scalars(root / "pretrain", "train_ppl"))
    assert all(math.isfinite(v) for v in _scalars(root / "pretrain", "val_ppl"))


@needs_runtime
def test_finetune_script_trains_with_muon(examples_run) -> None:
    root, (_, proc, *_) = examples_run
    _check_trained(proc, root / "script", steps=4, muon=True)


@needs_runtime
def test_finetune_yaml_trains_with_muon(examples_run) -> None:
    root, (_, _, proc, *_) = examples_run
    _check_trained(proc, root / "yaml", steps=4, muon=True)


@needs_runtime
def test_pipeline_yaml_and_script_train(examples_run) -> None:
    """examples/pipeline.yaml through the CLI (the schedule switched by a flag) and examples/pipeline.py:
    two stages on the two ranks, Muon stepping, finite losses."""
    _, (*_, yaml_run, script_run) = examples_run
    for proc, steps in ((yaml_run, 3), (script_run, 3)):
        report = _report(proc)
        assert report["steps"] == steps and report["finite"] and report["optimizer"].endswith("Muon"), report
    assert "[pipeline] last train loss" in script_run.stdout, script_run.stdout[-3000:]


@pytest.mark.parametrize("cls", ["Muon", "SOAP", "Shampoo"])
def test_cli_optimizer_flag_builds_matrix_optimizers(cls: str, tmp_path: Path) -> None:
    """``--optimizer lightning_matrixfsdp.<cls>`` replaces the module's optimizer (no fit needed)."""
    if cls != "Muon":
        pytest.importorskip("pytorch_optimizer")
    from lightning_matrixfsdp.cli import cli_main

    cli = cli_main(["--config", str(EXAMPLES / "pretrain_gpt.yaml"), "--optimizer", f"lightning_matrixfsdp.{cls}",
                    "--optimizer.lr", "0.001", "--trainer.devices", "1", "--trainer.strategy", "auto",
                    "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)], run=False)
    out = cli.model.configure_optimizers()
    opt = out["optimizer"] if isinstance(out, dict) else (out[0][0] if isinstance(out, tuple) else out)
    assert type(opt).__name__ == cls and opt.param_groups[0]["lr"] == 0.001
