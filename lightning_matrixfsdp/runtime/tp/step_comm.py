"""The optimizer step's traffic inside the tensor-parallel group: fragments to one TP rank and
slices back.

A TP-split matrix lives as T fragments, one per TP rank, all on the same data-parallel owner.
Its whole-matrix update (Newton-Schulz, Shampoo's or SOAP's preconditioners) runs once, on the
matrix's *TP stepper* (``tp_plan.assign_tp_steppers``): :func:`gather_to_steppers` brings every
fragment there and concatenates them along the split dimension, :func:`scatter_from_steppers`
sends every TP rank its slice of the result. Both move every matrix of one call in a single
batch of send/recv, counted under the ``tp`` phase (logical payload per rank). Nothing else
in the step communicates: the data-parallel group sees no byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, ShardGroup, nbytes, wait_all
from lightning_matrixfsdp.runtime.tp.layout import TPLayout

__all__ = ["TP_PHASE", "TPFragment", "gather_to_steppers", "local_fragment", "scatter_from_steppers"]

TP_PHASE = "tp"


@dataclass(frozen=True, eq=False)
class TPFragment:
    """What a resident parameter of a TP-split matrix knows of its siblings (its tag)."""

    layout: TPLayout
    tp: ShardGroup
    #: the TP rank that runs this matrix's whole update
    stepper: int
    stats: Optional[CommStats] = None

    @property
    def rank(self) -> int:
        return self.tp.rank

    @property
    def is_stepper(self) -> bool:
        return self.tp.rank == self.stepper

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.layout.global_shape

    def slice_of(self, whole: torch.Tensor, tp_rank: int) -> torch.Tensor:
        lay = self.layout
        return whole.narrow(lay.dim, lay.offset(tp_rank), lay.sizes[tp_rank])


def _batch(ops: list, frags: Sequence[TPFragment], what: str) -> None:
    if not ops:
        return
    works = dist.batch_isend_irecv(ops)
    wait_all(works, frags[0].tp.blocks_host, what)


def gather_to_steppers(frags: Sequence[TPFragment], tensors: Sequence[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    """Per matrix: the whole tensor (every TP rank's ``tensors[i]`` concatenated along the split
    dimension, in TP-rank order) on its stepper, None on the other TP ranks."""
    ops: list = []
    parts: list[Optional[list[torch.Tensor]]] = []
    sent = recv = 0
    for f, t in zip(frags, tensors):
        lay, tp = f.layout, f.tp
        if not f.is_stepper:
            parts.append(None)
            if t.numel():
                src = t.contiguous()
                ops.append(dist.P2POp(dist.isend, src, tp.g(f.stepper), tp.group))
                sent += nbytes(src)
            continue
        mine: list[torch.Tensor] = []
        for r in range(tp.size):
            if r == tp.rank:
                mine.append(t)
                continue
            buf = torch.empty(lay.local_shape(r), dtype=t.dtype, device=t.device)
            if buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, tp.g(r), tp.group))
                recv += nbytes(buf)
            mine.append(buf)
        parts.append(mine)
    _batch(ops, frags, "the gather of TP fragments to their stepper")
    if frags and frags[0].stats is not None:
        frags[0].stats.add(TP_PHASE, sent, recv, calls=1 if ops else 0)
    return [None if p is None else torch.cat(p, dim=f.layout.dim) for f, p in zip(frags, parts)]


def scatter_from_steppers(frags: Sequence[TPFragment], wholes: Sequence[Optional[torch.Tensor]],
                          dtypes: Sequence[torch.dtype], device: torch.device) -> list[torch.Tensor]:
    """Per matrix: this TP rank's slice of ``wholes[i]``, which only the stepper holds (elsewhere
    None: the slice arrives in ``dtypes[i]``)."""
    ops: list = []
    out: list[torch.Tensor] = []
    sent = recv = 0
    for f, whole, dtype in zip(frags, wholes, dtypes):
        lay, tp = f.layout, f.tp
        if f.is_stepper:
            assert whole is not None
            for r in range(tp.size):
                if r != tp.rank and lay.sizes[r]:
                    piece = f.slice_of(whole, r).contiguous()
                    ops.append(dist.P2POp(dist.isend, piece, tp.g(r), tp.group))
                    sent += nbytes(piece)
            out.append(f.slice_of(whole, tp.rank))
            continue
        buf = torch.empty(lay.local_shape(tp.rank), dtype=dtype, device=device)
        if buf.numel():
            ops.append(dist.P2POp(dist.irecv, buf, tp.g(f.stepper), tp.group))
            recv += nbytes(buf)
        out.append(buf)
    _batch(ops, frags, "the return of whole-matrix updates to their TP ranks")
    if frags and frags[0].stats is not None:
        frags[0].stats.add(TP_PHASE, sent, recv, calls=1 if ops else 0)
    return out



def local_fragment(g: Any, placements: tuple) -> torch.Tensor:
    """This TP rank's fragment of a DTensor gradient in the parameter's placements (a ``Partial``
    gradient is reduced over the TP group first, by DTensor: why it lives here)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(g, DTensor):
        return g
    if tuple(g.placements) != tuple(placements):
        g = g.redistribute(placements=placements)
    return g.to_local()
