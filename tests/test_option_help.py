"""What each strategy option does, written once in ``MatrixFSDPConfig`` (a field's ``doc``), is
what ``lightning-matrixfsdp fit --trainer.strategy.help MatrixFSDPStrategy`` shows beside it, and
what Fabric's strategy documents (docs/user-guide.md's table is checked in tests/test_docs.py).

In one process: LightningCLI's help action prints and exits, no training starts.
"""
from __future__ import annotations

import re
import sys
from dataclasses import fields

import pytest
from jsonargparse import ArgumentParser

import lightning_matrixfsdp as mf
from lightning_matrixfsdp.cli import cli_main
from lightning_matrixfsdp.runtime.config import ADAPTER, CONFIG_DOC, MatrixFSDPConfig, plain_text


def _help_blocks(text: str, prefix: str) -> dict[str, str]:
    """``{option: its help text}`` for every ``--{prefix}NAME`` entry of an argparse help page."""
    blocks: dict[str, str] = {}
    head = re.compile(rf"^  --{re.escape(prefix)}([\w.]+)(?: \S+)*$", re.M)  # NAME.help entries too
    marks = list(head.finditer(text))
    for m, nxt in zip(marks, marks[1:] + [None]):
        body = text[m.end(): nxt.start() if nxt else len(text)]
        blocks[m.group(1)] = " ".join(body.split())
    return blocks


def _expected() -> dict[str, str]:
    docs = {f.name: f.metadata.get("doc", "") for f in fields(MatrixFSDPConfig)}
    return {**{name: docs[name] for name in MatrixFSDPConfig.names(ADAPTER)}, "config": CONFIG_DOC}


def test_every_option_has_a_description():
    missing = [f.name for f in fields(MatrixFSDPConfig) if len(f.metadata.get("doc", "").split()) < 2]
    assert not missing, f"MatrixFSDPConfig fields without a description (doc=...): {missing}"


def test_cli_help_shows_every_strategy_option_with_its_description(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # one line per entry: nothing wrapped mid-word
    monkeypatch.setattr(sys, "argv", ["lightning-matrixfsdp"])  # not pytest's own arguments
    with pytest.raises(SystemExit) as done:
        cli_main(["fit", "--trainer.strategy.help", "MatrixFSDPStrategy"], run=False)
    assert done.value.code == 0
    blocks = _help_blocks(capsys.readouterr().out, "trainer.strategy.")
    wrong = {name: blocks.get(name, "(not shown)") for name, doc in _expected().items()
             if not blocks.get(name, "").startswith(" ".join(plain_text(doc).split()) + " (type:")}
    assert not wrong, "--trainer.strategy.help MatrixFSDPStrategy, options without their description:\n" + "\n".join(
        f"  {k}: {v}" for k, v in wrong.items())


def test_fabric_strategy_documents_every_option_and_its_fabric_meanings(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")
    parser = ArgumentParser()
    parser.add_class_arguments(mf.MatrixFSDPFabricStrategy, "strategy")
    blocks = _help_blocks(parser.format_help(), "strategy.")
    for name, doc in _expected().items():
        assert blocks.get(name, "").startswith(" ".join(plain_text(doc).split())), (name, blocks.get(name))
    assert "Under Fabric (default True): fabric.no_backward_sync defers" in blocks["accumulation_no_sync"]
    assert "(type: Optional[bool], default: True)" in blocks["accumulation_no_sync"]
    assert "Under Fabric, setup_optimizers" in blocks["optimizer"]


def test_plain_text_of_a_description():
    """Links become the page they lead to, backticks and emphasis go: what a terminal shows."""
    md = "a *different* `x` [moe.md](moe.md#split) and [Limits](#limitations); 2 * 3 * 4"
    assert plain_text(md) == ("a different x docs/moe.md#split and Limits (docs/user-guide.md#limitations); "
                              "2 * 3 * 4")
