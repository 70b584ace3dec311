"""``python -m lightning_matrixfsdp.consolidate IN OUT``: see ``lightning_matrixfsdp.checkpoint.consolidate``."""
from __future__ import annotations

import sys

from lightning_matrixfsdp.checkpoint.consolidate import convert, dcp_to_file, file_to_dcp, main

__all__ = ["convert", "dcp_to_file", "file_to_dcp", "main"]

if __name__ == "__main__":
    sys.exit(main())
