"""The owner collectives: one unit's owner-shaped data between the ranks of a shard group.

Materialize (owners -> everyone) and reduce-to-owner (everyone -> owner) have three
implementations behind one interface, :class:`OwnerCollective`: batched send/recv
(``p2p``, the default), one broadcast / reduce per role (``broadcast``), and padded
all-gather / reduce-scatter (``padded_all_gather``, the ablation). Each ``start_*``
issues the communication, counts its bytes in :class:`~comm.CommStats` (the
convention is in ``comm/core.py``) and returns a :class:`~comm.PendingOp`; what a gradient
needs once it reached its owner is ``comm/grads.py``'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Callable, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, PendingOp, ShardGroup, nbytes, pack_segment
from lightning_matrixfsdp.runtime.placement import MatrixShard


class OwnerCollective(ABC):
    """Moves owner-shaped data of one unit between the ranks of a shard group."""

    name: ClassVar[str]

    def __init__(self, sg: ShardGroup, stats: CommStats) -> None:
        self.sg = sg
        self.stats = stats

    @abstractmethod
    def start_materialize(self, shards: Sequence[MatrixShard], sources: Sequence[Optional[torch.Tensor]],
                          outs: Sequence[torch.Tensor]) -> PendingOp:
        """Fill ``outs[i]`` on every rank with the owner's ``sources[i]`` (None on non-owners)."""

    @abstractmethod
    def start_reduce(self, shards: Sequence[MatrixShard], grads: Sequence[torch.Tensor]) -> PendingOp:
        """Sum ``grads[i]`` over ranks onto its owner; ``wait()`` returns a list with the
        sum on the owner and ``None`` elsewhere.  ``grads`` may be overwritten."""

    # -- shared helpers
    def _pending(self, works: list, finish: Optional[Callable[[], object]] = None) -> PendingOp:
        return PendingOp(works, finish, blocking=self.sg.blocks_host)

    def _owner_copies(self, shards: Sequence[MatrixShard], sources, outs) -> None:
        for s, src, out in zip(shards, sources, outs):
            if s.owner == self.sg.rank:
                out.copy_(src)


class P2PCollective(OwnerCollective):
    """Batched send/recv of owner segments: one message per (owner, peer) pair and dtype.

    Each owner packs what it owns of the unit into one contiguous segment, so a unit
    costs ``W - 1`` messages per owner rather than one per parameter; nothing is padded.
    Gradients are summed in shard-rank order, so the result does not depend on who owns it.
    """

    name = "p2p"

    def __init__(self, sg: ShardGroup, stats: CommStats, pack: Optional[bool] = None) -> None:
        super().__init__(sg, stats)
        # gloo pays per message, so pack segments; NCCL coalesces a batch of
        # send/recv into one launch, so send the tensors as they are (no copies).
        if pack is None:
            pack = sg.group is None or dist.get_backend(sg.group) == "gloo"
        self.pack = pack

    def start_materialize(self, shards, sources, outs) -> PendingOp:
        sg = self.sg
        self._owner_copies(shards, sources, outs)
        if sg.size == 1:
            return PendingOp()
        if not self.pack:
            return self._materialize_direct(shards, outs)
        ops, unpack = [], []
        sent = recv = 0
        for dtype, slots, _ in _buckets(shards, outs, sg.size):
            device = outs[slots[0][0]].device
            mine = [i for i, o, _ in slots if o == sg.rank]
            if mine:
                seg = pack_segment([outs[i] for i in mine])
                for q in range(sg.size):
                    if q != sg.rank:
                        ops.append(dist.P2POp(dist.isend, seg, sg.g(q), sg.group))
                        sent += nbytes(seg)
            for o in range(sg.size):
                theirs = [(i, off) for i, ow, off in slots if ow == o]
                if o == sg.rank or not theirs:
                    continue
                n = sum(outs[i].numel() for i, _ in theirs)
                buf = torch.empty(n, dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buf, sg.g(o), sg.group))
                recv += nbytes(buf)
                unpack.append((buf, theirs))
        self.stats.add("materialize", sent, recv, calls=len(ops))

        def finish() -> None:
            for buf, theirs in unpack:
                for i, off in theirs:
                    outs[i].copy_(buf[off:off + outs[i].numel()].view(outs[i].shape))

        return self._pending(dist.batch_isend_irecv(ops) if ops else [], finish)

    def _materialize_direct(self, shards, outs) -> PendingOp:
        sg = self.sg
        ops = []
        sent = recv = 0
        for s, out in zip(shards, outs):
            if s.owner == sg.rank:
                for q in range(sg.size):
                    if q != sg.rank:
                        ops.append(dist.P2POp(dist.isend, out, sg.g(q), sg.group))
                        sent += nbytes(out)
            else:
                ops.append(dist.P2POp(dist.irecv, out, sg.g(s.owner), sg.group))
                recv += nbytes(out)
        self.stats.add("materialize", sent, recv, calls=len(ops))
        return self._pending(dist.batch_isend_irecv(ops) if ops else [])

    def _reduce_direct(self, shards, grads) -> PendingOp:
        sg = self.sg
        ops = []
        inbox: dict[int, list[torch.Tensor]] = {}
        sent = recv = 0
        for i, (s, g) in enumerate(zip(shards, grads)):
            if s.owner != sg.rank:
                ops.append(dist.P2POp(dist.isend, g, sg.g(s.owner), sg.group))
                sent += nbytes(g)
                continue
            parts = []
            for q in range(sg.size):
                if q == sg.rank:
                    parts.append(g)
                    continue
                b = torch.empty_like(g)
                ops.append(dist.P2POp(dist.irecv, b, sg.g(q), sg.group))
                recv += nbytes(b)
                parts.append(b)
            inbox[i] = parts
        self.stats.add("reduce", sent, recv, calls=len(ops))
        works = dist.batch_isend_irecv(ops) if ops else []

        def finish() -> list[Optional[torch.Tensor]]:
            out: list[Optional[torch.Tensor]] = [None] * len(grads)
            for i, parts in inbox.items():
                total = parts[0] if parts[0] is not grads[i] else parts[0].clone()
                for b in parts[1:]:  # shard-rank order
                    total.add_(b)
                out[i] = total
            return out

        return self._pending(works, finish)

    def start_reduce(self, shards, grads) -> PendingOp:
        sg = self.sg
        if sg.size == 1:
            return PendingOp(finish=lambda: list(grads))
        if not self.pack:
            return self._reduce_direct(shards, grads)
        ops, sums = [], []
        sent = recv = 0
        for dtype, slots, _ in _buckets(shards, grads, sg.size):
            device = grads[slots[0][0]].device
            for o in range(sg.size):
                theirs = [(i, off) for i, ow, off in slots if ow == o]
                if not theirs:
                    continue
                if o != sg.rank:
                    seg = pack_segment([grads[i] for i, _ in theirs])
                    ops.append(dist.P2POp(dist.isend, seg, sg.g(o), sg.group))
                    sent += nbytes(seg)
                    continue
                parts = []
                for q in range(sg.size):
                    if q == sg.rank:
                        parts.append(pack_segment([grads[i] for i, _ in theirs]))
                        continue
                    b = torch.empty(sum(grads[i].numel() for i, _ in theirs), dtype=dtype, device=device)
                    ops.append(dist.P2POp(dist.irecv, b, sg.g(q), sg.group))
                    recv += nbytes(b)
                    parts.append(b)
                sums.append((parts, theirs))
        self.stats.add("reduce", sent, recv, calls=len(ops))
        works = dist.batch_isend_irecv(ops) if ops else []

        def finish() -> list[Optional[torch.Tensor]]:
            out: list[Optional[torch.Tensor]] = [None] * len(grads)
            for parts, theirs in sums:
                total = parts[0]
                for b in parts[1:]:  # shard-rank order
                    total.add_(b)
                for i, off in theirs:
                    out[i] = total[off:off + grads[i].numel()].view(grads[i].shape)
            return out

        return self._pending(works, finish)


class BroadcastCollective(OwnerCollective):
    """One broadcast / reduce per role, issued together (NCCL pipelines each one)."""

    name = "broadcast"

    def start_materialize(self, shards, sources, outs) -> PendingOp:
        sg = self.sg
        self._owner_copies(shards, sources, outs)
        if sg.size == 1:
            return PendingOp()
        works = []
        sent = recv = 0
        for s, out in zip(shards, outs):
            works.append(dist.broadcast(out, src=sg.g(s.owner), group=sg.group, async_op=True))
            if s.owner == sg.rank:
                sent += nbytes(out)
            else:
                recv += nbytes(out)
        self.stats.add("materialize", sent, recv, calls=len(works))
        return self._pending(works)

    def start_reduce(self, shards, grads) -> PendingOp:
        sg = self.sg
        if sg.size == 1:
            return PendingOp(finish=lambda: list(grads))
        works = []
        sent = recv = 0
        for s, g in zip(shards, grads):
            works.append(dist.reduce(g, dst=sg.g(s.owner), op=dist.ReduceOp.SUM, group=sg.group, async_op=True))
            if s.owner == sg.rank:
                recv += (sg.size - 1) * nbytes(g)
            else:
                sent += nbytes(g)
        self.stats.add("reduce", sent, recv, calls=len(works))
        me = sg.rank
        return self._pending(works, lambda: [g if s.owner == me else None for s, g in zip(shards, grads)])


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> object:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> object:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True)


def _buckets(shards: Sequence[MatrixShard], tensors: Sequence[torch.Tensor], world: int):
    """Group a unit's tensors by dtype; within a bucket, place each at its owner's offset."""
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_dtype[t.dtype].append(i)
    for dtype, idx in by_dtype.items():
        offsets = [0] * world
        slots = []
        for i in idx:
            o = shards[i].owner
            slots.append((i, o, offsets[o]))
            offsets[o] += tensors[i].numel()
        yield dtype, slots, max(offsets)


class PaddedAllGatherCollective(OwnerCollective):
    """Pad every owner segment to the largest and use all-gather / reduce-scatter (the ablation)."""

    name = "padded_all_gather"

    def start_materialize(self, shards, sources, outs) -> PendingOp:
        sg = self.sg
        self._owner_copies(shards, sources, outs)
        if sg.size == 1:
            return PendingOp()
        works, unpack = [], []
        for dtype, slots, seg in _buckets(shards, outs, sg.size):
            if seg == 0:
                continue
            device = outs[slots[0][0]].device
            send = torch.zeros(seg, dtype=dtype, device=device)
            for i, o, off in slots:
                if o == sg.rank:
                    send[off:off + outs[i].numel()].copy_(outs[i].reshape(-1))
            gathered = torch.empty(seg * sg.size, dtype=dtype, device=device)
            works.append(_all_gather(gathered, send, sg.group))
            b = nbytes(send) * (sg.size - 1)
            self.stats.add("materialize", b, b)
            unpack.append((gathered, slots, seg))

        def finish() -> None:
            for gathered, slots, seg in unpack:
                for i, o, off in slots:
                    if o != sg.rank:
                        n = outs[i].numel()
                        outs[i].copy_(gathered[o * seg + off:o * seg + off + n].view(outs[i].shape))

        return self._pending(works, finish)

    def start_reduce(self, shards, grads) -> PendingOp:
        sg = self.sg
        if sg.size == 1:
            return PendingOp(finish=lambda: list(grads))
        works, unpack = [], []
        for dtype, slots, seg in _buckets(shards, grads, sg.size):
            if seg == 0:
                continue
            device = grads[slots[0][0]].device
            inp = torch.zeros(seg * sg.size, dtype=dtype, device=device)
            for i, o, off in slots:
                inp[o * seg + off:o * seg + off + grads[i].numel()].copy_(grads[i].reshape(-1))
            out = torch.empty(seg, dtype=dtype, device=device)
            works.append(_reduce_scatter(out, inp, sg.group))
            b = nbytes(out) * (sg.size - 1)
            self.stats.add("reduce", b, b)
            unpack.append((out, slots))

        def finish() -> list[Optional[torch.Tensor]]:
            res: list[Optional[torch.Tensor]] = [None] * len(grads)
            for out, slots in unpack:
                for i, o, off in slots:
                    if o == sg.rank:
                        res[i] = out[off:off + grads[i].numel()].view(grads[i].shape)
            return res

        return self._pending(works, finish)


COLLECTIVES: dict[str, type[OwnerCollective]] = {
    c.name: c for c in (P2PCollective, BroadcastCollective, PaddedAllGatherCollective)
}
COLLECTIVE_NAMES = (*COLLECTIVES, "p2p_packed", "p2p_direct")


def make_collective(name: str, sg: ShardGroup, stats: CommStats) -> OwnerCollective:
    """``p2p`` packs segments on gloo and sends tensors directly on NCCL;
    ``p2p_packed`` / ``p2p_direct`` force one of the two. ``name`` was checked where it entered
    (``MatrixFSDPConfig``)."""
    if name in ("p2p_packed", "p2p_direct"):
        return P2PCollective(sg, stats, pack=name == "p2p_packed")
    return COLLECTIVES[name](sg, stats)
