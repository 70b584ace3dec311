"""The adapters' own communication: one agreement across the world.

Kept apart so that every torch.distributed call of the package sits in a ``*comm*`` or
``*collective*`` module; the adapters call this, never torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm import comm_device

__all__ = ["any_rank"]


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank of the world (the same answer on every rank; the
    local flag without an initialized process group)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        t = t.to(comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(int(t.item()))
