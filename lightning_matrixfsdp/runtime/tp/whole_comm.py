"""Whole tensors of tensor-parallel-split parameters on chosen ranks, outside the training step.

A TP-split parameter, and a state tensor of its fragment's shape (Muon's momentum, AdamW's
moments of a split tail), lives as T fragments on the T ranks of one TP group. ``full_model``
and the consolidated (one-file) checkpoint need such a tensor whole on one rank or a few:
:func:`fragment_sources` agrees which global rank sends each fragment (the lowest that holds
it: the same answer on every rank), and :func:`gather_fragments` sends the fragments point to
point on the default group and concatenates them along the split dimension on each target.
Called with one tensor at a time it bounds the memory to that tensor (the checkpoint's
stream to rank 0); called with many it puts every message in flight at once (``full_model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, PendingOp, nbytes
from lightning_matrixfsdp.runtime.comm.small import gather_objects

__all__ = ["Fragments", "fragment_sources", "gather_fragments"]


@dataclass(frozen=True)
class Fragments:
    """Where the T fragments of one whole tensor are and what they look like."""

    #: the global rank that sends fragment t (its TP rank t), agreed by every rank
    sources: tuple[int, ...]
    #: fragment t's shape
    shapes: tuple[tuple[int, ...], ...]
    #: the dimension the fragments are concatenated along
    dim: int
    dtype: torch.dtype


def fragment_sources(held: Mapping[str, int], tp_size: int, group: Optional[dist.ProcessGroup] = None
                     ) -> dict[str, list[Optional[int]]]:
    """Every rank's ``held`` ({key: the TP rank of the fragment this rank holds}) gathered over
    ``group`` (every rank, in global rank order): {key: [the lowest global rank holding fragment
    t, or None where no rank does, for t in range(tp_size)]}. Collective."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    found: dict[str, list[Optional[int]]] = {}
    for r, h in sorted(gather_objects((rank, dict(held)), group)):
        for key, t in h.items():
            slots = found.setdefault(key, [None] * tp_size)
            if slots[t] is None:
                slots[t] = r
    return found


def gather_fragments(items: Sequence[Fragments], local: Sequence[Optional[torch.Tensor]], targets: Sequence[int],
                     device: torch.device, stats: Optional[CommStats] = None, phase: str = "full_model",
                     what: str = "the TP fragments of whole tensors") -> dict[int, torch.Tensor]:
    """Item ``i`` whole on each global rank of ``targets``: {i: tensor on ``device``} there, ``{}``
    elsewhere. ``local[i]``: this rank's fragment of item ``i`` where it is a source (else None).
    Every rank calls it with the same items in the same order (sends and receives pair up in that
    order); ranks neither sending nor receiving return at once. ``stats``: counted under ``phase``."""
    me = dist.get_rank()
    works: list = []
    parts: dict[int, list[torch.Tensor]] = {}
    sent = got = 0
    for i, (it, mine) in enumerate(zip(items, local)):
        receiving = me in targets
        for t, src in enumerate(it.sources):
            empty = not torch.Size(it.shapes[t]).numel()
            if src == me:
                if mine is None or tuple(mine.shape) != tuple(it.shapes[t]):
                    raise RuntimeError(f"{what}: global rank {me} was agreed to send fragment {t} of shape "
                                       f"{list(it.shapes[t])} and holds {None if mine is None else list(mine.shape)}")
                data = mine.detach().to(device).contiguous()
                for dst in targets:
                    if dst != me and not empty:
                        works.append(dist.isend(data, dst=dst))
                        sent += nbytes(data)
                if receiving:
                    parts.setdefault(i, []).append(data)
            elif receiving:
                buf = torch.empty(it.shapes[t], dtype=it.dtype, device=device)
                if not empty:
                    works.append(dist.irecv(buf, src=src))
                    got += nbytes(buf)
                parts.setdefault(i, []).append(buf)
    PendingOp(works, blocking=device.type == "cpu", what=what).wait()
    if stats is not None and works:
        stats.add(phase, sent, got)
    return {i: torch.cat(p, dim=items[i].dim) for i, p in parts.items()}
