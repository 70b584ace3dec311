"""The errors checkpoint IO raises; each is raised on every rank alike (see ``agree``)."""
from __future__ import annotations

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointKeyError", "CheckpointMismatchError",
           "ERROR_CLASSES"]


class CheckpointError(RuntimeError):
    """Base class of every checkpoint error raised here (raised on all ranks alike)."""


class CheckpointKeyError(CheckpointError):
    """Missing or unexpected model keys / optimizer entries under ``strict_loading=True``."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model: shapes, dtypes, another model, another optimizer."""


class CheckpointCorruptError(CheckpointError):
    """The checkpoint is unreadable or incomplete: bad sidecar, missing DCP metadata, partial save."""


#: Errors a peer may re-raise by name when another rank failed (``agree``).
ERROR_CLASSES: dict[str, type[Exception]] = {
    c.__name__: c for c in (CheckpointError, CheckpointKeyError, CheckpointMismatchError, CheckpointCorruptError,
                            FileNotFoundError, IsADirectoryError)
}
