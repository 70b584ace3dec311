"""Saves still being written in this process: a read of their path waits for them.

An asynchronous save (``async_save.py``) returns before its files exist. Whatever reads a
checkpoint next in the same process (another Trainer resuming from it, Lightning's
``load_from_checkpoint``, a conversion, a second saver's load) does not know the saver that
started it, so every pending save is listed here with a way to wait for it, and every
reader of this package calls :func:`wait_for` with its path first. The wait is local (a
join of this process's writer thread, no collective): it is safe on one rank alone.

A read waits for the saves of that path, of a directory above or below it, and of its
siblings: a ``save_last="link"`` link or a top-k deletion beside it is made only after the
save is published. If the save of that very path failed, the read raises its failure
instead of reading the previous checkpoint (or finding nothing) without a word.
"""
from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import Callable, Optional, Union

from lightning_matrixfsdp.checkpoint.errors import CheckpointError

__all__ = ["add", "remove", "wait_for"]

#: token -> (the target's real path, a function that waits for the save and returns its failure)
_PENDING: dict[int, tuple[Path, Callable[[], Optional[BaseException]]]] = {}
_LOCK = threading.Lock()
_TOKENS = itertools.count()


def _real(path: Union[str, os.PathLike]) -> Path:
    return Path(os.path.realpath(os.fspath(path)))


def add(path: Union[str, os.PathLike], wait: Callable[[], Optional[BaseException]]) -> int:
    """List a save of ``path`` that is being written; ``wait()`` blocks until it is done and
    returns its failure (None: published). Returns the token for :func:`remove`."""
    with _LOCK:
        token = next(_TOKENS)
        _PENDING[token] = (_real(path), wait)
    return token


def remove(token: int) -> None:
    """The save is done (published or failed)."""
    with _LOCK:
        _PENDING.pop(token, None)


def _related(read: Path, target: Path) -> bool:
    return read == target or read in target.parents or target in read.parents or read.parent == target.parent


def wait_for(path: Union[str, os.PathLike]) -> None:
    """Wait for this process's pending saves that touch ``path`` (see the module docstring);
    raise :class:`CheckpointError` if the save of ``path`` itself failed. Local, any rank."""
    read = _real(path)
    with _LOCK:
        pending = [(target, wait) for target, wait in _PENDING.values() if _related(read, target)]
    for target, wait in pending:
        err = wait()
        if err is not None and target == read:
            raise CheckpointError(f"reading checkpoint {path} waited for its save in the background (async_save) "
                                  f"in this process, which failed: {err}") from err
