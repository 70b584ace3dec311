"""The convergence benchmark's text: pydoc's help topics, optionally with the standard
library's sources, split per document into training and held-out validation."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Any

import torch

from lightning_matrixfsdp.demos.data import ByteTextDataModule, split_documents, truncate_documents

__all__ = ["corpus_documents", "prepare_corpus"]


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
