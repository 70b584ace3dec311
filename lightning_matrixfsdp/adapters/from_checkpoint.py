"""``load_from_checkpoint(cls, path)``: ``LightningModule.load_from_checkpoint`` for directories too.

Lightning's ``cls.load_from_checkpoint(path)`` opens ``path`` as one file (``torch.load``)
and offers no hook before that (no strategy or checkpoint IO takes part in the classmethod):
on the directory that ``save_distributed_checkpoint=True`` (the default) writes, it stopped
with ``IsADirectoryError``. This helper reads such a directory in this process, without a
process group or a GPU (what ``python -m lightning_matrixfsdp.consolidate IN OUT
--weights-only`` reads), and hands it to Lightning's own ``cls.load_from_checkpoint`` as an
in-memory file, which Lightning accepts: hyper-parameters, ``on_load_checkpoint``,
``strict``, ``map_location`` and ``**kwargs`` behave as for a file. Any other path goes to
Lightning unchanged.

``install_directory_loading`` (run when the package is imported) lets Lightning's classmethod
itself do the same: it wraps the loader Lightning's ``_load_from_checkpoint`` calls by name
(``lightning.pytorch.core.saving.pl_load``), which then reads a local directory holding DCP's
``.metadata`` as this helper does, and passes every other path to Lightning's loader as before.
Where that name is missing (another Lightning version) nothing is wrapped and the helper above
remains the way. Both wait for a save of the path still running in this process (``async_save``).

``trainer.fit(ckpt_path=directory)`` under DDP or on one device: those strategies read the
checkpoint through their ``CheckpointIO`` (``TorchCheckpointIO``, whose ``torch.load`` of a
directory stopped with ``IsADirectoryError`` on every rank). :class:`DirectoryCheckpointIO` is
that plugin reading a directory as the one file ``python -m lightning_matrixfsdp.consolidate``
makes of it (weights, optimizer states in torch's format, loops, schedulers, callbacks): the
public way, ``Trainer(strategy="ddp", plugins=[DirectoryCheckpointIO()])``. The import also wraps
the loader ``TorchCheckpointIO`` calls by name (``lightning.fabric.plugins.io.torch_io.pl_load``)
the same way, so a plain ``Trainer(strategy="ddp")`` in a process that imported the package
resumes from a directory too. Every rank reads the whole directory, as it would read the file.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO, Any, Optional, TypeVar, Union

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

import lightning_matrixfsdp.checkpoint.pending as pending_saves
from lightning_matrixfsdp.checkpoint.consolidate import read_directory

__all__ = ["DirectoryCheckpointIO", "install_directory_loading", "load_from_checkpoint"]

T = TypeVar("T")


def load_from_checkpoint(cls: type[T], checkpoint_path: Union[str, os.PathLike, IO[bytes]], map_location: Any = None,
                         hparams_file: Optional[Union[str, os.PathLike]] = None, strict: Optional[bool] = None,
                         weights_only: Optional[bool] = None, verify: bool = True, **kwargs: Any) -> T:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` (a ``LightningModule`` or
    ``LightningDataModule`` class) that also reads this package's checkpoint directories
    (and ``ModelParallelStrategy``'s). The weights and the rest of the checkpoint are held in
    host memory twice while Lightning reads them. ``verify=False`` skips the directory's checksums."""
    if not (isinstance(cls, type) and callable(getattr(cls, "load_from_checkpoint", None))):
        raise TypeError(f"load_from_checkpoint(cls, path): cls must be a LightningModule or LightningDataModule "
                        f"class, got {cls!r} ({type(cls).__name__})")
    args = dict(map_location=map_location, hparams_file=hparams_file, strict=strict, weights_only=weights_only)
    if not _is_local_directory(checkpoint_path):
        return cls.load_from_checkpoint(checkpoint_path, **args, **kwargs)  # type: ignore[attr-defined]
    buf = _directory_as_file(Path(checkpoint_path), weights_only, verify)  # type: ignore[arg-type]
    return cls.load_from_checkpoint(buf, **args, **kwargs)  # type: ignore[attr-defined]


def _is_local_directory(path: Any) -> bool:
    """Whether ``path`` is a local directory, once a save of it in this process is complete."""
    if not isinstance(path, (str, os.PathLike)) or "://" in os.fspath(path):
        return False
    pending_saves.wait_for(path)
    return Path(path).is_dir()


def _is_checkpoint_directory(path: Any) -> bool:
    """A local directory holding DCP's ``.metadata`` (this package's, or ``ModelParallelStrategy``'s)."""
    return _is_local_directory(path) and (Path(path) / ".metadata").is_file()


def _directory_as_file(path: Path, weights_only: Optional[bool], verify: bool = True,
                       training: bool = False) -> io.BytesIO:
    """The directory as the file the converter writes, in memory: the weights and the rest of its
    checkpoint, and with ``training`` the optimizer states too (what resuming needs)."""
    ck = read_directory(path, weights_only=not training, safe=weights_only is not False, verify=verify)
    buf = io.BytesIO()
    torch.save(ck, buf)
    del ck
    buf.seek(0)
    return buf


class DirectoryCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` that also loads a checkpoint directory (this package's, or
    ``ModelParallelStrategy``'s), as the consolidated file ``python -m lightning_matrixfsdp.consolidate
    DIR FILE`` would hold: full weights, optimizer states in torch's native format, loops, LR
    schedulers and callbacks. For moving a run to DDP or one device:
    ``Trainer(strategy="ddp", plugins=[DirectoryCheckpointIO()]).fit(model, ckpt_path=directory)``.
    Saving and every other path are ``TorchCheckpointIO``'s. Holds the checkpoint in host memory
    twice while it loads (the file it makes in memory, then what ``torch.load`` returns of it)."""

    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not _is_checkpoint_directory(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        buf = _directory_as_file(Path(path), weights_only, training=True)
        return torch.load(buf, map_location=map_location, weights_only=weights_only)


def _wrap(module: Any, training: bool) -> None:
    """Wrap the loader ``module`` calls by the name ``pl_load`` so that it reads checkpoint
    directories (``training``: with the optimizer states). Idempotent; nothing where it is missing."""
    lightning_load = getattr(module, "pl_load", None)
    if lightning_load is None or getattr(lightning_load, "reads_directories", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        if _is_checkpoint_directory(path_or_url):
            path_or_url = _directory_as_file(Path(path_or_url), weights_only, training=training)
        return lightning_load(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load.reads_directories = True  # type: ignore[attr-defined]
    module.pl_load = pl_load


def install_directory_loading() -> None:
    """Make ``LightningModule.load_from_checkpoint(directory)`` and ``TorchCheckpointIO`` (DDP's and
    one device's ``fit(ckpt_path=directory)``) read this package's (and DCP's) checkpoint
    directories (see the module docstring). Idempotent."""
    import lightning.fabric.plugins.io.torch_io as torch_io
    import lightning.pytorch.core.saving as saving

    _wrap(saving, training=False)  # a module's weights and hyper-parameters: no optimizer states
    _wrap(torch_io, training=True)  # a resume: everything
