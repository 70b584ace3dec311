"""Everything of the tied weights (ties.py) that calls torch.distributed: which ranks own and
step each copy (one gather over the world, when the pipeline is built), and the point-to-point
transfers of a tied gradient and of its stepped value between the two copies' owners."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["gather_tie_flags", "recv_from", "send_to"]


def gather_tie_flags(flags: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """Every rank's ``flags`` (one row of small integers per tied weight, the same length on every
    rank), indexed ``[rank][tie][flag]``. Collective over the world; a world of one returns its own."""
    if not flags:
        return []
    if not dist.is_initialized():
        return [[list(row) for row in flags]]
    mine = torch.tensor([list(row) for row in flags], dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [t.tolist() for t in parts]


def send_to(tensor: torch.Tensor, dst: int) -> None:
    """``tensor`` to global rank ``dst`` (blocking)."""
    dist.send(tensor.contiguous(), dst=dst)


def recv_from(tensor: torch.Tensor, src: int) -> None:
    """Into ``tensor`` from global rank ``src`` (blocking)."""
    dist.recv(tensor, src=src)
