"""Byte-level language-model data from local text files, usable offline.

The tokenizer is the identity on UTF-8 bytes (vocabulary 256): nothing to download,
nothing to train, and every file on disk is valid input.

Default corpus (``data_dir=None``): the Python reference manual's help topics that
every CPython ships as ``pydoc_data.topics`` (what ``help("assert")`` prints; about
0.47 MB of English prose and grammar, 79 topics, in the size class of the classic
character-level "tiny Shakespeare"). If that module is missing (some stripped
distributions drop it) the fallback is the standard library's own top-level
``*.py`` sources under ``sysconfig.get_paths()["stdlib"]`` (several MB of code,
comments and docstrings). Point ``data_dir`` at a directory, a file or a glob to
train on anything else.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Sequence
from typing import Optional

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 256
_SNIFF_BYTES = 8192


def _as_tensor(data: bytes) -> Tensor:
    """Bytes -> uint8 tensor (1 byte per token in memory; widened per batch)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def truncate_documents(docs: Sequence[bytes], max_bytes: Optional[int]) -> list[bytes]:
    """The first ``max_bytes`` bytes of the corpus, in document order (``None``: all of it)."""
    if max_bytes is None:
        return list(docs)
    kept: list[bytes] = []
    budget = max_bytes
    for doc in docs:
        if budget <= 0:
            break
        kept.append(doc[:budget])
        budget -= len(kept[-1])
    return kept


def encode(text: str) -> Tensor:
    """UTF-8 bytes as a uint8 tensor: the whole tokenizer."""
    return _as_tensor(text.encode("utf-8"))


def decode(tokens: Tensor) -> str:
    """Inverse of :func:`encode`; invalid byte sequences (a cut code point) become U+FFFD."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def stdlib_source_glob() -> str:
    """The glob of the standard library's top-level modules, present wherever Python is."""
    return os.path.join(sysconfig.get_paths()["stdlib"], "*.py")


def _default_documents() -> list[bytes]:
    """The built-in corpus: pydoc's help topics in a fixed (sorted) order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return [_read(p) for p in _expand(stdlib_source_glob())]
    return [topics[key].encode("utf-8") for key in sorted(topics)]


def _looks_binary(path: str) -> bool:
    """A NUL byte in the first block is how we tell binaries (images, .pyc) from text."""
    with open(path, "rb") as f:
        return b"\x00" in f.read(_SNIFF_BYTES)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _expand(data_dir: str) -> list[str]:
    """Directory (recursive), single file, or glob -> sorted list of text files.

    Sorted so every rank, and every run, sees the same corpus in the same order.
    """
    path = os.path.expanduser(data_dir)
    if os.path.isdir(path):
        candidates = glob.glob(os.path.join(glob.escape(path), "**", "*"), recursive=True)
    elif os.path.isfile(path):
        candidates = [path]
    else:
        candidates = glob.glob(path, recursive=True)
    files = sorted(p for p in candidates if os.path.isfile(p) and not _looks_binary(p))
    if not files:
        raise FileNotFoundError(f"no text files found for data_dir={data_dir!r} (a directory, a file or a glob)")
    return files


def split_documents(documents: Sequence[bytes], val_fraction: float) -> tuple[Tensor, Tensor]:
    """Cut every document at the same relative point: head -> train, tail -> val.

    Splitting per document (not the concatenation) keeps both sides drawn from the
    whole corpus, and it depends only on the data, never on seq_len or world size.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    train: list[bytes] = []
    val: list[bytes] = []
    for doc in documents:
        cut = len(doc) - int(len(doc) * val_fraction)
        train.append(doc[:cut])
        val.append(doc[cut:])
    sep = b"\n\n"
    return _as_tensor(sep.join(d for d in train if d)), _as_tensor(sep.join(d for d in val if d))


class TokenWindows(Dataset):
    """Non-overlapping windows of a token stream as ``(input, next-token target)`` pairs.

    Map-style with a fixed length, so Lightning's DistributedSampler can shard and
    shuffle it; we add no sampler of our own.
    """

    def __init__(self, tokens: Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_len
        chunk = self.tokens[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class ByteTextDataModule(LightningDataModule):
    """Byte-level next-token data over local text: offline, deterministic, tokenizer-free.

    Args:
        data_dir: a directory (all text files below it), a file, or a glob such as
            ``"~/books/**/*.txt"``. ``None``: pydoc's help topics (see module docstring).
        seq_len: tokens per training example.
        batch_size: examples per batch on each rank.
        val_fraction: share of every document (its tail) kept for validation.
        max_bytes: optional cap on the corpus size, for quick runs.
        num_workers: DataLoader workers; 0 keeps runs simple and reproducible on CPU.
    """

    vocab_size: int = VOCAB_SIZE

    def __init__(
        self,
        data_dir: Optional[str] = None,
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_bytes: Optional[int] = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.train_set: Optional[TokenWindows] = None
        self.val_set: Optional[TokenWindows] = None

    def documents(self) -> list[bytes]:
        """The corpus as a list of documents, in a deterministic order."""
        docs = _default_documents() if self.data_dir is None else [_read(p) for p in _expand(self.data_dir)]
        return truncate_documents(docs, self.max_bytes)

    def setup(self, stage: str) -> None:
        """Every rank reads the (small, local) corpus itself: there is nothing to download."""
        if self.train_set is not None:
            return
        train, val = split_documents(self.documents(), self.val_fraction)
        self.train_set = TokenWindows(train, self.seq_len)
        self.val_set = TokenWindows(val, self.seq_len)
        if len(self.train_set) == 0:
            raise ValueError(f"corpus too small: {train.numel()} training bytes for seq_len={self.seq_len}")

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() first"
        # shuffle=True for single-process runs; in distributed runs Lightning swaps in a
        # DistributedSampler (which shuffles with its own seed) and we must not fight it.
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
