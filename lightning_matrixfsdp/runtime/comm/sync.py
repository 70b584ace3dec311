"""The communication that puts every rank on global rank 0's model (``sync.py`` decides what and when).

Three operations, each counted in :class:`~comm.CommStats` under the phase it is given:

- :func:`broadcast_packed`: tensors of any dtype packed into one byte segment, one broadcast
  (the buffers before a forward, as DDP's coalesced buffer broadcast);
- :func:`gather_digests`: every rank's vector of 64-bit digests, one all-gather;
- :func:`send_to_targets`: a source rank sends whole tensors to the ranks whose copies differ
  (the parameters at sharding time), one batch of send/recv.

Tensors travel as their bytes (``uint8``), so booleans, integers and complex numbers move on
every backend, and a tensor on the CPU travels through :func:`comm.comm_device` when the
group runs elsewhere (NCCL).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, comm_device, wait_all
from lightning_matrixfsdp.runtime.comm.small import gather_ints

#: Byte alignment of each tensor inside a packed segment (``Tensor.view(dtype)`` needs its offset aligned).
ALIGN = 16


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's contents as a flat ``uint8`` tensor (a view where it is contiguous)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _slots(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offsets, total


def broadcast_packed(tensors: Sequence[torch.Tensor], src: int, group: Optional[dist.ProcessGroup],
                     stats: CommStats, phase: str, what: str) -> None:
    """Overwrite ``tensors`` on every rank of ``group`` with those of its rank ``src`` (a group rank):
    one broadcast of their bytes. Every rank must pass tensors of the same shapes and dtypes."""
    if not tensors or group is None or dist.get_world_size(group) == 1:
        return
    device = comm_device(group)
    offsets, total = _slots(tensors)
    seg = torch.empty(total, dtype=torch.uint8, device=device)
    me = dist.get_rank(group)
    if me == src:
        for t, off in zip(tensors, offsets):
            b = as_bytes(t)
            seg[off:off + b.numel()].copy_(b)
    work = dist.broadcast(seg, src=dist.get_global_rank(group, src), group=group, async_op=True)
    wait_all([work], device.type == "cpu", what)
    if me == src:
        stats.add(phase, sent=total)
        return
    stats.add(phase, recv=total)
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            t.copy_(seg[off:off + n].view(t.dtype).view(t.shape))


def gather_digests(digests: Sequence[int], group: Optional[dist.ProcessGroup], stats: CommStats,
                   phase: str) -> list[list[int]]:
    """Every rank's ``digests`` (same length everywhere), in rank order of ``group``."""
    rows = gather_ints(digests, group, "the digest exchange of matrix_shard's agreement with rank 0")
    n = 8 * len(digests)
    stats.add(phase, sent=n, recv=n * (len(rows) - 1))
    return rows


def send_to_targets(moves: Sequence[tuple[int, int]], tensors: Sequence[Optional[torch.Tensor]], src: int,
                    group: Optional[dist.ProcessGroup], stats: CommStats, phase: str) -> None:
    """For each ``(index, target)`` of ``moves`` (the same list on every rank), group rank ``src``
    sends ``tensors[index]`` to group rank ``target``, which overwrites its own ``tensors[index]``."""
    if not moves:
        return
    device = comm_device(group)
    me = dist.get_rank(group)
    ops, landing = [], []
    sent = recv = 0
    for i, target in moves:
        t = tensors[i]
        if me == src:
            assert t is not None
            b = as_bytes(t).to(device)
            ops.append(dist.P2POp(dist.isend, b, dist.get_global_rank(group, target), group))
            sent += b.numel()
        elif me == target:
            assert t is not None
            b = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, b, dist.get_global_rank(group, src), group))
            recv += b.numel()
            landing.append((t, b))
    if ops:
        wait_all(dist.batch_isend_irecv(ops), device.type == "cpu", "matrix_shard's transfer of rank 0's parameters")
    stats.add(phase, sent=sent, recv=recv, calls=len(ops))
    with torch.no_grad():
        for t, b in landing:
            t.copy_(b.to(t.device).view(t.dtype).view(t.shape))
