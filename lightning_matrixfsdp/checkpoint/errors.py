"""The errors checkpoint IO raises; each is raised on every rank alike (see ``agree``)."""
from __future__ import annotations

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointKeyError", "CheckpointMismatchError",
           "CheckpointNotResumableError", "ERROR_CLASSES"]


class CheckpointError(RuntimeError):
    """Base class of every checkpoint error raised here (raised on all ranks alike)."""


class CheckpointKeyError(CheckpointError):
    """Missing or unexpected model keys / optimizer entries under ``strict_loading=True``."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the run: shapes, dtypes, another model, another optimizer,
    parameters whose optimizer role changed."""


class CheckpointCorruptError(CheckpointError):
    """The checkpoint is unreadable, incomplete or damaged: bad sidecar, missing files,
    truncated files, checksum mismatch, partial save."""


class CheckpointNotResumableError(CheckpointError, KeyError):
    """``fit(ckpt_path=...)`` on a checkpoint without the training state (optimizer states): a
    ``KeyError`` too, as Lightning raises for such a checkpoint under DDP."""

    __str__ = BaseException.__str__  # the message as written (KeyError's would quote it)


#: Errors a peer may re-raise by name when another rank failed (``agree``): the checkpoint
#: errors, and the OS and argument errors whose meaning does not depend on the rank that met them.
ERROR_CLASSES: dict[str, type[Exception]] = {
    c.__name__: c for c in (CheckpointError, CheckpointKeyError, CheckpointMismatchError, CheckpointCorruptError,
                            CheckpointNotResumableError, FileNotFoundError, FileExistsError, IsADirectoryError,
                            NotADirectoryError, PermissionError, TypeError, ValueError)
}
