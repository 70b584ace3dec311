"""Meta-device initialization with tensor parallelism: TP rank 0's whole tensors to the TP group.

TP rank 0 of an owner's TP group initialized each parameter whole (``meta_init.py``); here it
sends every other TP rank of the group what that rank holds of it: its slice of a TP-split
parameter, the whole tensor of a TP-replicated one (so the copies are equal across the TP
group whatever each rank's generator). One batch of send/recv per call, counted under the
``tp`` phase.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, ShardGroup, nbytes, wait_all
from lightning_matrixfsdp.runtime.tp.layout import TPLayout

__all__ = ["scatter_initialized"]

_PHASE = "tp"


def _part(whole: torch.Tensor, lay: TPLayout, tp_rank: int) -> torch.Tensor:
    if not lay.split:
        return whole
    return whole.narrow(lay.dim, lay.offset(tp_rank), lay.sizes[tp_rank])  # type: ignore[arg-type]


def scatter_initialized(tp: ShardGroup, layouts: Sequence[TPLayout], wholes: Sequence[Optional[torch.Tensor]],
                        targets: Sequence[torch.Tensor], stats: Optional[CommStats] = None) -> None:
    """Fill ``targets[i]`` (this TP rank's resident data of parameter ``i``) from TP rank 0's
    ``wholes[i]`` (None on the other TP ranks). Collective over ``tp``: every TP rank passes the
    same parameters in the same order (their owners are the same on every TP rank)."""
    ops: list = []
    sent = recv = 0
    for lay, whole, target in zip(layouts, wholes, targets):
        if tp.rank == 0:
            assert whole is not None
            for r in range(1, tp.size):
                piece = _part(whole, lay, r).contiguous()
                if piece.numel():
                    ops.append(dist.P2POp(dist.isend, piece, tp.g(r), tp.group))
                    sent += nbytes(piece)
            with torch.no_grad():
                target.copy_(_part(whole, lay, 0))
        elif target.numel():
            ops.append(dist.P2POp(dist.irecv, target, tp.g(0), tp.group))
            recv += nbytes(target)
    if ops:
        wait_all(dist.batch_isend_irecv(ops), tp.blocks_host, "the initialized tensors' slices to their TP ranks")
    if stats is not None:
        stats.add(_PHASE, sent, recv, calls=1 if ops else 0)
