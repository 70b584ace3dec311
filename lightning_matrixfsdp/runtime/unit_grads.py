"""One unit's gradients on their way to the owners: which ones count, and the reduction started.

A unit reduces the local gradients of its trainable parameters (zeros stand in for a
missing one where every rank agreed to that: ``zero_missing_grads``, or gradients left
by backwards with the reduction off). Otherwise, at the end-of-backward flush, the ranks
first agree on which parameters got a gradient anywhere (DDP leaves the others None) and
refuse parameters that got one on some ranks only. The reduction itself is the
:class:`~grad_comm.GradientReducer`'s; the unit finishes it later (one in flight).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from lightning_matrixfsdp.runtime.comm.core import PendingOp
from lightning_matrixfsdp.runtime.consensus import AGREE_USED, REDUCE
from lightning_matrixfsdp.runtime.errors import RankDivergenceError
from lightning_matrixfsdp.runtime.comm.grads import GradientReducer
from lightning_matrixfsdp.runtime.param import ShardedParam


def start_reduction(params: list[ShardedParam], reducer: GradientReducer, index: int, name: str, flush: bool,
                    zeros_stand_in: bool, check: Optional[Callable[[int, int], None]] = None
                    ) -> tuple[PendingOp, list[bool]]:
    """Take the unsharded gradients of ``params`` (unit ``index``, ``name`` for messages) and start
    their reduction to the owners; returns it (its ``wait()`` gives the mean on the owner, None
    elsewhere) and which parameters it keeps. ``check``: the sequence check (``consensus``)."""
    local = [p.local_grad() for p in params]
    if zeros_stand_in:
        used = [True] * len(local)  # zeros stand in for missing gradients, on every rank
    else:
        used = [g is not None for g in local]
        if flush:
            if check is not None:
                check(AGREE_USED, index)
            used, mixed = reducer.globally_used(used, f"the used-gradient flags of unit {name!r}")
            if any(mixed):
                raise RankDivergenceError(
                    f"parameters of unit {name!r} got a gradient on some ranks but not on "
                    f"others: {', '.join(p.shard.fqn for p, m in zip(params, mixed) if m)}. Without "
                    "zero_missing_grads every rank must leave the same parameters without a gradient; for "
                    "input-dependent branches or per-rank expert routing pass zero_missing_grads=True "
                    "(to MatrixFSDPStrategy or matrix_shard)")
    grads = [
        g if g is not None else torch.zeros(p.shape, dtype=p.reduce_dtype, device=p.device)
        for g, p in zip(local, params)
    ]
    for p in params:
        p.unsharded.grad = None
    if check is not None:
        check(REDUCE, index)
    # one item per piece (a split stack's expert blocks: each block's rows to that block's owner)
    items = [(i, s, b) for i, (p, g) in enumerate(zip(params, grads)) for s, b in p.grad_pieces(g)]
    with torch.no_grad():
        pending = reducer.start([s for _, s, _ in items], [b for _, _, b in items], [used[i] for i, _, _ in items],
                                f"the gradient reduction of unit {name!r}")
    if len(items) == len(params):
        return pending, used

    def regroup() -> list[Optional[torch.Tensor]]:
        """Per parameter: the reduced piece this rank owns (its block of a split stack), else None."""
        out: list[Optional[torch.Tensor]] = [None] * len(params)
        for (i, _, _), g in zip(items, pending.wait()):
            if g is not None:
                out[i] = g
        return out

    return PendingOp(finish=regroup, what=pending.what), used
