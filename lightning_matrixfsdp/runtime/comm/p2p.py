"""Whole tensors to chosen ranks, point to point, outside the training step.

- :func:`gather_whole`: ``full_model``'s transfer, every parameter's whole tensor from
  its owner to each target rank (one message per parameter and target, all in flight
  at once), counted under ``full_model``;
- :func:`send_tensor` / :func:`recv_tensor`: the full state dict's stream to rank 0,
  one tensor at a time (bounded accelerator memory), blocking, not counted (a
  checkpoint is not model traffic).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, PendingOp, ShardGroup, nbytes
from lightning_matrixfsdp.runtime.param import ShardedParam


def gather_whole(params: Sequence[ShardedParam], sg: ShardGroup, stats: CommStats,
                 targets: Sequence[int]) -> dict[int, torch.Tensor]:
    """Every parameter's whole resident tensor on each of the global ranks ``targets``, from its
    owner (in the order of ``params``, the same on every rank, so sends and receives pair up):
    {index in params: tensor} on a target, empty elsewhere."""
    me = sg.g(sg.rank)
    works, received, sent, got = [], {}, 0, 0
    for i, p in enumerate(params):
        buf = torch.empty(p.shape, dtype=p.orig_dtype, device=p.resident.device) if me in targets else None
        for piece in p.pieces:  # a split expert stack: each block from its owner into its rows
            owner = sg.g(piece.owner)
            rows = buf if buf is None or piece.experts is None else buf[piece.experts[0]:piece.experts[1]]
            dests = [t for t in targets if t != owner]
            if me == owner:
                src = p.resident.data.contiguous()
                for t in dests:
                    works.append(dist.isend(src, dst=t, group=sg.group))
                    sent += nbytes(src)
                if rows is not None and piece.experts is not None:
                    rows.copy_(src)  # this target's own block
            elif me in dests:
                works.append(dist.irecv(rows, src=owner, group=sg.group))
                got += nbytes(rows)
        if buf is not None and (p.split or me != sg.g(p.shard.owner)):
            received[i] = buf
    PendingOp(works, blocking=sg.blocks_host, what="full_model: the owners' weights").wait()
    if works:
        stats.add("full_model", sent, got)
    return received


def send_tensor(t: torch.Tensor, dst: int) -> None:
    """Send ``t`` to global rank ``dst`` on the default group; returns once it is sent."""
    dist.send(t, dst=dst)


def recv_tensor(buf: torch.Tensor, src: int) -> torch.Tensor:
    """Receive into ``buf`` from global rank ``src`` on the default group; returns ``buf``."""
    dist.recv(buf, src=src)
    return buf
