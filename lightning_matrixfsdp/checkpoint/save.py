"""Writing a checkpoint: everything into a hidden sibling first, published by one rename.

A save writes into ``.mfsdp-partial-<target>-<token>`` next to the target (same
filesystem, so the final rename is atomic). Rank 0 writes ``meta.pt`` and the sidecar
(with every file's size and checksums) only after every rank's ``dcp.save`` returned,
and renames the directory (or file) to its final name only after every rank
confirmed.

Leftovers: a save that fails on every rank alike (an agreed error) removes its own
partial; a crash cannot, so the next save of the same target removes the partials
of that target before it writes (they never were a checkpoint, and on a full disk
their space is needed), and after it is published the copies a crash set aside.
A communication failure (a peer died) leaves the partial to that next save: another
rank may still be writing into it.

A directory save is two halves: ``prepare_dir`` (the collective start: views, the agreed
partial, the layout) and ``finish_dir`` (files, checksums, sidecar, publish). A synchronous
save runs both in a row; ``async_save.py`` runs the second in a background thread.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from lightning_matrixfsdp.checkpoint.agree import (
    agree,
    agreed_path,
    broadcast_object,
    current_group,
    describe_failure,
    single_process_quiet,
    world,
)
from lightning_matrixfsdp.checkpoint.errors import CheckpointError
from lightning_matrixfsdp.checkpoint.formats import optimizer_class, unwrap_optimizer
from lightning_matrixfsdp.checkpoint.index import KeyIndex, build_index
from lightning_matrixfsdp.checkpoint.integrity import file_records
from lightning_matrixfsdp.checkpoint.sidecar import META_NAME, SIDECAR_NAME, layout_dict
from lightning_matrixfsdp.checkpoint.state_dict import sharded_model_state_dict, sharded_optimizer_state_dict
from lightning_matrixfsdp.checkpoint.views import VIEWS, gather_views, split_views

__all__ = ["DirSave", "OLD_PREFIX", "PARTIAL_PREFIX", "PathLike", "check_target", "finish_dir", "new_partial",
           "prepare_dir", "publish", "remove_entry", "remove_stale", "save_sharded", "write_checkpoint", "write_file"]

PARTIAL_PREFIX = ".mfsdp-partial-"
OLD_PREFIX = ".mfsdp-old-"
PathLike = Union[str, os.PathLike]


def _tag(path: Path) -> str:
    """Names the target in its partials, so a later save of the same target finds them."""
    return hashlib.sha1(path.name.encode()).hexdigest()[:12]


def new_partial(path: Path, token: Optional[str] = None) -> Path:
    """A fresh temporary sibling of ``path`` (not created)."""
    return path.parent / f"{PARTIAL_PREFIX}{_tag(path)}-{token or secrets.token_hex(8)}"


def _is_checkpoint_dir(path: Path) -> bool:
    return any((path / n).exists() for n in (".metadata", META_NAME, SIDECAR_NAME)) or not any(path.iterdir())


def check_target(path: Path) -> None:
    """Refuse to replace something that is not a checkpoint (a save replaces what is at ``path``)."""
    if path.is_dir() and not path.is_symlink() and not _is_checkpoint_dir(path):
        raise IsADirectoryError(f"the checkpoint path {path} is an existing directory that is not a checkpoint; "
                                "refusing to replace it (choose another path)")


def publish(tmp: Path, path: Path) -> None:
    """Make ``tmp`` visible as ``path``.  A file replaces a file atomically; otherwise the old
    entry is moved aside first (a crash in between leaves it as ``.mfsdp-old-<target>-<token>``)."""
    if tmp.is_file() and (path.is_file() or not path.exists()) and not path.is_symlink():
        os.replace(tmp, path)
    elif path.exists() or path.is_symlink():
        old = path.parent / f"{OLD_PREFIX}{_tag(path)}-{secrets.token_hex(8)}"
        os.rename(path, old)
        os.rename(tmp, path)
        remove_entry(old)
    else:
        os.rename(tmp, path)
    try:  # persist the rename
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def remove_entry(p: Path) -> None:
    """Remove a file, link or directory tree (missing is fine)."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except OSError:
            pass


def remove_stale(path: Path, published: bool = True) -> list[Path]:
    """Remove what crashed or failed saves of ``path`` left beside it: their partials and, once a
    new save of ``path`` is ``published``, the old copies a crash set aside (before that, such a
    copy may be the only one). Call with no other save of ``path`` running."""
    if not path.parent.is_dir():
        return []
    tag = _tag(path)
    stale = [p for pre in ((PARTIAL_PREFIX, OLD_PREFIX) if published else (PARTIAL_PREFIX,))
             for p in path.parent.glob(f"{pre}{tag}-*")]
    for p in stale:
        remove_entry(p)
    return stale


def write_file(obj: Mapping[str, Any], path: Path) -> None:
    """``torch.save`` into a partial file, fsync, then publish (this process only)."""
    check_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path, published=False)
    tmp = new_partial(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(obj), f)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except OSError:
        remove_entry(tmp)
        raise
    except Exception as e:  # torch.save reports a full disk as a RuntimeError
        remove_entry(tmp)
        raise CheckpointError(f"writing checkpoint {path} failed: {e}; the previous checkpoint at that path is "
                              "unchanged") from e
    except BaseException:
        remove_entry(tmp)
        raise
    remove_stale(path)


def save_sharded(module: nn.Module, path: PathLike, optimizers: Iterable[torch.optim.Optimizer] = (),
                 full: bool = False, extra: Optional[Mapping[str, Any]] = None, *, checksums: bool = True) -> None:
    """Save outside Lightning: the module, the optimizers and ``extra`` (goes to ``meta.pt``). Collective.

    ``checksums``: record a CRC-32 of every file a directory save writes (verified on load)."""
    optimizers = [unwrap_optimizer(o) for o in optimizers]
    # before the first collective: a rank with other arguments would enter other collectives
    path = agreed_path(path, full=bool(full), checksums=bool(checksums), optimizers=len(optimizers))
    index = build_index(module)
    checkpoint = dict(extra or {})
    checkpoint["state_dict"] = sharded_model_state_dict(module, full, index)
    checkpoint["optimizer_states"] = [sharded_optimizer_state_dict(module, o, full, index) for o in optimizers]
    write_checkpoint(module, checkpoint, path, full, [optimizer_class(o) for o in optimizers], index=index,
                     checksums=checksums)


def write_checkpoint(module: nn.Module, checkpoint: Mapping[str, Any], path: PathLike, full: bool,
                     optimizer_classes: Sequence[str] = (), *, index: Optional[KeyIndex] = None,
                     checksums: bool = True) -> None:
    """Write what ``sharded_model_state_dict`` / ``sharded_optimizer_state_dict`` produced, crash-safely.
    Collective. ``index``: the key index the state dicts were made with (built if not given).
    Views of sharded tensors anywhere in ``checkpoint`` (``checkpoint/views.py``: the model's
    state as the strategy gives it, a weight-averaging callback's averaged copy) are written
    by their owners, never as placeholders."""
    rank = world()[0]
    path = agreed_path(path, full=bool(full), checksums=bool(checksums),
                       optimizers=len(checkpoint.get("optimizer_states") or []))
    index = index if index is not None else build_index(module)
    checkpoint = dict(checkpoint)
    if full:
        checkpoint, records = gather_views(checkpoint, index)

        def _file() -> None:
            if rank == 0:
                layout = layout_dict(index, checkpoint.get("optimizer_states", []), optimizer_classes)
                if records:
                    layout["views"] = records
                checkpoint.setdefault("matrix_fsdp_layout", layout)
                write_file(checkpoint, path)

        agree(_file)  # also the barrier: nobody returns before the file is in place
        return
    finish_dir(prepare_dir(checkpoint, path, index, optimizer_classes, checksums))


@dataclass
class DirSave:
    """A directory save between its agreed start (the partial exists) and its publish: what
    DCP writes (``state``), what goes to ``meta.pt`` (``meta``: a dict, or its ``torch.save``
    bytes), the sidecar without its ``files`` (``layout``)."""

    path: Path
    tmp: Path
    state: dict[str, Any]
    meta: Union[dict[str, Any], bytes]
    layout: dict[str, Any]
    checksums: bool = True


def prepare_dir(checkpoint: Mapping[str, Any], path: Path, index: KeyIndex, optimizer_classes: Sequence[str] = (),
                checksums: bool = True) -> DirSave:
    """Everything of a directory save before its files: the views split off (collective), the
    partial created (agreed), the sidecar's layout. ``path``: already agreed."""
    rank = world()[0]
    checkpoint, views = split_views(checkpoint, index)
    if views:
        checkpoint[VIEWS] = views  # DCP writes it beside the model and optimizer entries
    tmp = new_partial(path, broadcast_object(secrets.token_hex(8)))

    def _mkdir() -> None:
        if rank == 0:
            check_target(path)
            remove_stale(path, published=False)
            tmp.mkdir(parents=True)

    agree(_mkdir)
    state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict", {})}
    if VIEWS in checkpoint:
        state[VIEWS] = checkpoint.pop(VIEWS)
    opt_states = checkpoint.pop("optimizer_states", [])
    for i, s in enumerate(opt_states):
        state[f"optimizer_{i}"] = s
    return DirSave(path, tmp, state, checkpoint, layout_dict(index, opt_states, optimizer_classes), checksums)


def finish_dir(job: DirSave) -> None:
    """Write the files of ``job``, record them, publish; on an agreed failure remove the partial.
    Collective on the current checkpoint group (``agree.on_group``): any thread may run it."""
    rank = world()[0]
    try:
        _write_dir(job)
    except (CheckpointError, OSError):  # agreed: every rank is past its writes
        if rank == 0:
            remove_entry(job.tmp)
        raise
    if rank == 0:
        remove_stale(job.path)


def _write_dir(job: DirSave) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    rank = world()[0]
    path, tmp = job.path, job.tmp

    def _dcp() -> None:
        try:
            with single_process_quiet():
                dcp.save(job.state, storage_writer=FileSystemWriter(str(tmp)),
                         planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True), process_group=current_group())
        except CheckpointException as e:
            raise CheckpointError(f"writing checkpoint {path} failed: {describe_failure(e)}; the previous "
                                  "checkpoint at that path is unchanged") from None

    agree(_dcp)

    def _meta() -> list[str]:
        if rank != 0:
            return []
        with open(tmp / META_NAME, "wb") as f:
            if isinstance(job.meta, bytes):
                f.write(job.meta)
            else:
                torch.save(job.meta, f)
            f.flush()
            os.fsync(f.fileno())
        return sorted(p.name for p in tmp.iterdir() if p.name != SIDECAR_NAME)

    names = broadcast_object(agree(_meta))  # every rank's dcp.save has returned: all files are there
    files = file_records(tmp, names, job.checksums)

    def _sidecar() -> None:
        if rank == 0:
            text = json.dumps({**job.layout, "files": dict(files)}, indent=1, default=str)
            with open(tmp / SIDECAR_NAME, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())

    agree(_sidecar)
    agree(lambda: publish(tmp, path) if rank == 0 else None)
