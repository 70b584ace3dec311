"""What a missing optional package does: a clear ImportError naming what to install, raised
before any work is done (never a silent skip, never a failure at the end of a long run).

A package is made missing with ``sys.modules[name] = None``, which makes every import of it
raise ImportError, as on a machine where it is not installed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn


def test_bench_plot_without_matplotlib_names_the_extra_before_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_matrixfsdp.bench.__main__ import main

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "out"
    with pytest.raises(ImportError, match=r"pip install 'lightning-matrixfsdp\[bench\]'.*--no-plot"):
        main(["--preset", "tiny", "--modes", "ddp_muon", "--out", str(out)])
    assert not out.exists()  # nothing ran


def test_bench_report_plot_without_matplotlib_names_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_matrixfsdp.bench.report import plot

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"lightning-matrixfsdp\[bench\]"):
        plot({"modes": {}}, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("cls", ["SOAP", "Shampoo"])
def test_matrix_optimizers_without_their_library_name_the_requirement(
        cls: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_matrixfsdp.optim import matrix_optimizers

    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)
    with pytest.raises(ImportError, match=r"pip install 'pytorch-optimizer>="):
        getattr(matrix_optimizers, cls)([nn.Parameter(torch.randn(4, 4))])
