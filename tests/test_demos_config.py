"""What examples/pretrain_gpt.yaml tells a user to do about checkpoints works as it says."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt.yaml"
ADD_CHECKPOINT = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                  "--trainer.callbacks.every_n_train_steps=2"]


def _cli(args: list[str], tmp_path: Path):
    from lightning_matrixfsdp.cli import cli_main

    # one process, no strategy: only the Trainer's construction is checked here
    return cli_main(["--config", str(CONFIG), "--trainer.devices", "1", "--trainer.strategy", "auto",
                     "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path), *args], run=False)


def test_pretrain_yaml_checkpoint_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.callbacks import ModelCheckpoint

    monkeypatch.setattr(sys, "argv", ["lightning-matrixfsdp"])  # not pytest's own arguments
    assert not _cli([], tmp_path).trainer.checkpoint_callbacks  # as shipped: off
    # "set this to true": Lightning's default ModelCheckpoint
    on = _cli(["--trainer.enable_checkpointing", "true"], tmp_path).trainer.checkpoint_callbacks
    assert len(on) == 1 and isinstance(on[0], ModelCheckpoint)
    # "set it to true AND add a ModelCheckpoint": the one added, configured as given
    added = _cli(["--trainer.enable_checkpointing", "true", *ADD_CHECKPOINT], tmp_path).trainer.checkpoint_callbacks
    assert len(added) == 1 and "'every_n_train_steps': 2" in added[0].state_key
    # "Lightning refuses a ModelCheckpoint callback while this is false"
    with pytest.raises(MisconfigurationException, match="enable_checkpointing=False"):
        _cli(ADD_CHECKPOINT, tmp_path)
