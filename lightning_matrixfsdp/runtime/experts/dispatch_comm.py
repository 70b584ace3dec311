"""Expert parallelism's communication: the counts exchange and the token all-to-all.

The ranks of an expert-parallel group hold disjoint blocks of experts; tokens travel to the
rank of their expert and back (``experts/dispatch.py`` decides what goes where). Two
operations, both one ``all_to_all_single`` on the group (gloo has it on CPU, NCCL on GPU;
zero-size splits are fine on both):

- :func:`exchange_counts`: every rank sends every rank one row of int64 (how many rows it will
  send for each of the receiver's experts, and a header that carries input refusals, so a bad
  input on one rank raises on all of them instead of leaving the others in the next exchange);
- :func:`all_to_all_tokens`: rows of a ``[N, H]`` tensor to their ranks, with autograd: the
  backward sends the gradients back along the same routes (the splits swapped).

Bytes are logical payload per rank (``comm/core.py``'s convention), the rows a rank keeps for itself
not counted: a token exchange counts ``rows x H x element size`` sent and received, the counts
exchange ``(EP - 1) x row length x 8`` each way. The backward of a token exchange is counted
under its forward's phase (sent and received swapped). Phases: ``ep_dispatch`` (counts and the
tokens to the experts), ``ep_combine`` (the expert outputs back).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, PendingOp, ShardGroup

__all__ = ["EP_COMBINE", "EP_DISPATCH", "all_to_all_tokens", "exchange_counts", "expert_group"]

EP_DISPATCH = "ep_dispatch"
EP_COMBINE = "ep_combine"


def expert_group(group: Optional[dist.ProcessGroup]) -> ShardGroup:
    """The expert-parallel group as a :class:`ShardGroup` (None, or no process group
    initialized: one rank, no communication)."""
    return ShardGroup(group)


def _a2a(out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[list[int]], in_splits: Optional[list[int]],
         sg: ShardGroup, what: str) -> None:
    work = dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=sg.group, async_op=True)
    PendingOp([work], blocking=sg.blocks_host, what=what).wait()


def exchange_counts(rows: torch.Tensor, sg: ShardGroup, stats: Optional[CommStats] = None) -> torch.Tensor:
    """``rows[d]`` (int64, one row per rank of the group) goes to rank ``d``; returns the rows
    received, ``[EP, C]``, row ``s`` from rank ``s``. Counted under ``ep_dispatch``."""
    rows = rows.contiguous()
    if sg.size == 1:
        return rows.clone()
    out = torch.empty_like(rows)
    _a2a(out, rows, None, None, sg, "the expert-parallel counts exchange")
    if stats is not None:
        b = (sg.size - 1) * rows.shape[1] * rows.element_size()
        stats.add(EP_DISPATCH, b, b)
    return out


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], sg: ShardGroup, stats: Optional[CommStats],
              phase: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    _a2a(out, x, recv, send, sg, f"the expert-parallel token exchange ({phase})")
    if stats is not None:
        row = math.prod(x.shape[1:]) * x.element_size()  # from the shape: x may have no row
        me = sg.rank
        stats.add(phase, (sum(send) - send[me]) * row, (sum(recv) - recv[me]) * row)
    return out


class _TokenAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], sg: ShardGroup,
                stats: Optional[CommStats], phase: str) -> torch.Tensor:
        ctx.routes = (send, recv, sg, stats, phase)
        return _exchange(x, send, recv, sg, stats, phase)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        send, recv, sg, stats, phase = ctx.routes
        # The same routes reversed: every rank runs this backward in the same order as its
        # forward (the layers' chain), so the exchanges pair up across the group.
        return _exchange(grad, recv, send, sg, stats, phase), None, None, None, None, None


def all_to_all_tokens(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], sg: ShardGroup,
                      stats: Optional[CommStats] = None, phase: str = EP_DISPATCH) -> torch.Tensor:
    """Rows ``x[sum(send[:d]) : sum(send[:d+1])]`` go to rank ``d``; returns the rows received,
    rank 0's first (``recv_splits[s]`` from rank ``s``). Differentiable: the gradient of the
    result comes back to ``x``'s rows along the same routes. On one rank, ``x`` itself."""
    send, recv = [int(s) for s in send_splits], [int(s) for s in recv_splits]
    if len(send) != sg.size or len(recv) != sg.size:
        raise ValueError(f"all_to_all_tokens: {len(send)} send and {len(recv)} receive splits for a group of "
                         f"{sg.size} ranks")
    if sum(send) != x.shape[0]:
        raise ValueError(f"all_to_all_tokens: the send splits sum to {sum(send)}, but x has {x.shape[0]} rows")
    if sg.size == 1:
        return x
    return _TokenAllToAll.apply(x, send, recv, sg, stats, phase)
