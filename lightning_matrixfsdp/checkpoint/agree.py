"""Agreement across ranks: run a step everywhere, and if it fails anywhere, fail everywhere.

A checkpoint step that fails on one rank while the others move on to the next
collective would leave them waiting until the process-group timeout. Every step
that can fail therefore runs through :func:`agree`: each rank runs it, the ranks
exchange their outcome, and all of them raise (the failing rank its own error, the
others the same class with the failing rank's message). Objects travel on the
default group, through ``runtime/comm/small.py``, or, inside :func:`on_group`, on the
group given there (an asynchronous save's background thread uses its own gloo group of
all ranks, so it never interleaves with the training's collectives).
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

import lightning_matrixfsdp.runtime.comm.small as small_comm
from lightning_matrixfsdp.checkpoint.errors import ERROR_CLASSES, CheckpointError

__all__ = ["agree", "agreed_path", "all_gather_object", "barrier", "broadcast_object", "current_group",
           "describe_failure", "on_group", "single_process_quiet", "warn", "world"]

_THREAD = threading.local()


@contextlib.contextmanager
def on_group(group: Optional[dist.ProcessGroup]) -> Any:
    """Within the block, this thread's object collectives (and the DCP save) run on ``group``,
    a group of every rank in global rank order (ranks and rank 0 stay the default group's)."""
    old = getattr(_THREAD, "group", None)
    _THREAD.group = group
    try:
        yield
    finally:
        _THREAD.group = old


def current_group() -> Optional[dist.ProcessGroup]:
    """The group this thread's checkpoint collectives use (``None``: the default group)."""
    return getattr(_THREAD, "group", None)


def world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    return small_comm.gather_objects(obj, current_group())


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if current_group() is not None:  # small objects only: rank 0's entry of a gather
        return all_gather_object(obj if world()[0] == 0 else None)[0]
    return small_comm.broadcast_object(obj, src=0)


def barrier() -> None:
    """A barrier that is a plain all-reduce (works on every backend, on the collective device)."""
    if current_group() is not None:
        all_gather_object(None)
        return
    small_comm.barrier()


def agree(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` on every rank; if it fails anywhere, raise on every rank (never leave peers hanging).

    torch's ``CheckpointException`` derives from ``BaseException``; it is caught too and
    becomes a :class:`CheckpointError`, so callers' ``except Exception`` sees it."""
    err: Optional[BaseException] = None
    out = None
    try:
        out = fn(*args, **kwargs)
    except CheckpointException as e:
        err = CheckpointError(f"torch.distributed.checkpoint failed: {describe_failure(e)}")
    except Exception as e:  # noqa: BLE001 - re-raised below, on all ranks
        err = e
    if world()[1] > 1:
        flags = all_gather_object(None if err is None else (type(err).__name__, str(err)))
        failed = [(r, f) for r, f in enumerate(flags) if f is not None]
        if failed and err is None:
            r, (name, msg) = failed[0]
            raise ERROR_CLASSES.get(name, CheckpointError)(f"{msg} (raised on rank {r})")
    if err is not None:
        raise err
    return out


def describe_failure(e: CheckpointException) -> str:
    """The underlying error of a ``CheckpointException`` in one line (its ``str`` is a traceback)."""
    for rank, pair in sorted(e.failures.items()):
        exc = pair[0] if isinstance(pair, tuple) else pair
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return str(e)


def warn(msg: str) -> None:
    """A warning from rank 0 only (every rank reaches the same verdict)."""
    if world()[0] == 0:
        warnings.warn(msg, UserWarning, stacklevel=3)


def agreed_path(path: Any, **options: Any) -> Path:
    """Rank 0's checkpoint path on every rank, once every rank was given a path and the same
    ``options`` (flags, numbers of optimizers): a rank that disagrees would enter other
    collectives than its peers and leave them waiting. Raises on every rank otherwise."""
    ok = isinstance(path, (str, os.PathLike)) and bool(os.fspath(path))
    mine = (os.fspath(path) if ok else None, None if ok else repr(path), options)
    everyone = all_gather_object(mine)
    bad = [(r, given) for r, (_, given, _) in enumerate(everyone) if given is not None]
    if bad:
        r, given = bad[0]
        raise TypeError(f"a checkpoint path must be a non-empty str or os.PathLike, got {given} (on rank {r})")
    for name, value in options.items():
        values = [o[name] for _, _, o in everyone]
        if any(v != values[0] for v in values):
            raise ValueError(f"ranks disagree on {name}: " + ", ".join(f"rank {r} {v!r}" for r, v in enumerate(values))
                             + "; call the checkpoint function with the same arguments on every rank")
    return Path(everyone[0][0])


@contextlib.contextmanager
def single_process_quiet() -> Any:
    """DCP warns that "torch.distributed is disabled" whenever no process group exists. One
    process is a supported use here (conversion, a single-rank save or load), so the warning
    would only alarm; with a process group nothing is silenced."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled", category=UserWarning)
        yield
