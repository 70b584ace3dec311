"""``load_from_checkpoint(cls, path)``: ``LightningModule.load_from_checkpoint`` for directories too.

Lightning's ``cls.load_from_checkpoint(path)`` opens ``path`` as one file (``torch.load``)
and has no hook before that: on the directory that ``save_distributed_checkpoint=True``
(the default) writes, it stops with Lightning's own ``IsADirectoryError``. This helper
reads such a directory in this process, without a process group or a GPU (what
``python -m lightning_matrixfsdp.consolidate IN OUT --weights-only`` reads), and hands it
to Lightning's own ``cls.load_from_checkpoint`` as an in-memory file, which Lightning
accepts: hyper-parameters, ``on_load_checkpoint``, ``strict``, ``map_location`` and
``**kwargs`` behave as for a file. Any other path goes to Lightning unchanged.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO, Any, Optional, TypeVar, Union

import torch

from lightning_matrixfsdp.checkpoint.consolidate import read_directory

__all__ = ["load_from_checkpoint"]

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
    if not isinstance(checkpoint_path, (str, os.PathLike)) or not Path(checkpoint_path).is_dir():
        return cls.load_from_checkpoint(checkpoint_path, **args, **kwargs)  # type: ignore[attr-defined]
    ck = read_directory(Path(checkpoint_path), weights_only=True, safe=weights_only is not False, verify=verify)
    buf = io.BytesIO()
    torch.save(ck, buf)
    del ck
    buf.seek(0)
    return cls.load_from_checkpoint(buf, **args, **kwargs)  # type: ignore[attr-defined]
