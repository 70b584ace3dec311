"""Checkpoint IO for owner-sharded models (placeholder until the checkpoint work lands).

Until then every save is refused with a clear error rather than writing the
empty placeholders that Lightning's inherited paths would write.
"""
from __future__ import annotations

from typing import Any

_MSG = ("MatrixFSDPStrategy cannot save or load checkpoints yet; pass enable_checkpointing=False to the Trainer. "
        "(Lightning's inherited checkpoint paths would silently write empty placeholders for non-owned weights.)")


def module_state_dict(strategy: Any, full: bool) -> dict:
    raise NotImplementedError(_MSG)


def optimizer_state_dict(strategy: Any, optimizer: Any, full: bool) -> dict:
    raise NotImplementedError(_MSG)


def save(strategy: Any, checkpoint: dict, filepath: Any) -> None:
    raise NotImplementedError(_MSG)


def load(strategy: Any, path: Any, weights_only: Any = None) -> dict:
    raise NotImplementedError(_MSG)
