"""``replica_split``'s communication: owned roles between the replicas of one shard rank.

Under HSDP the replicate group links the ranks that own the same roles (shard rank
``r`` of every replica). With ``replica_split`` each role has one stepping replica:

- :meth:`ReplicaExchange.start_reduce` sends every replica's partial sum of a role's
  gradient to its stepper, which adds them in replica order. Point to point rather
  than a backend ``reduce``, whose summation order is the backend's own: with a fixed
  order the float32 result is reproducible and, for ``W = 1``, bitwise the flat
  rank-order sum of DDP.
- :meth:`ReplicaExchange.start_broadcast` sends the stepper's updated weights to the
  other replicas, in place.

Per role of ``b`` bytes: the stepper receives ``(R-1) b`` and sends ``(R-1) b``; every
other replica sends ``b`` and receives ``b`` (phases ``replica_reduce`` and
``replica_broadcast`` of :class:`~lightning_matrixfsdp.runtime.collectives.CommStats`).
On gloo, what goes to one peer in one dtype travels as one packed segment; on NCCL,
which coalesces a batch of send/recv, every tensor goes as it is.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.collectives import CommStats, PendingOp, ShardGroup, nbytes, pack_segment

__all__ = ["ReplicaExchange"]


class ReplicaExchange:
    """Gradients to each role's stepping replica, updated weights back (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, stats: CommStats) -> None:
        self.rg = ShardGroup(group)  # its rank is this rank's replica index
        self.stats = stats
        self.pack = dist.get_backend(group) == "gloo"

    # ------------------------------------------------------------------ layout
    @staticmethod
    def _groups(tensors: Sequence[torch.Tensor], steppers: Sequence[int]) -> Iterator[tuple[int, list[int]]]:
        """(stepper, indices) per (stepper, dtype), in the same order on every replica."""
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, (t, s) in enumerate(zip(tensors, steppers)):
            groups[(int(s), str(t.dtype))].append(i)
        for (s, _), idx in sorted(groups.items()):
            yield s, idx

    def _send_bufs(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [pack_segment(ts)] if self.pack else ts

    def _recv_bufs(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.pack:
            return [torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device)]
        return [torch.empty_like(t) for t in ts]

    def _views(self, bufs: list[torch.Tensor], ts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors ``ts`` inside buffers laid out by ``_send_bufs`` / ``_recv_bufs``."""
        if not self.pack:
            return bufs
        out, off = [], 0
        for t in ts:
            out.append(bufs[0][off:off + t.numel()].view(t.shape))
            off += t.numel()
        return out

    def _issue(self, phase: str, ops: list, sent: int, recv: int, finish: Callable[[], object],
               what: str) -> PendingOp:
        self.stats.add(phase, sent, recv, calls=len(ops))
        works = dist.batch_isend_irecv(ops) if ops else []
        return PendingOp(works, finish, blocking=self.rg.blocks_host, what=what)

    # ------------------------------------------------------------------ operations
    def start_reduce(self, grads: Sequence[torch.Tensor], steppers: Sequence[int]) -> PendingOp:
        """``wait()`` returns, per gradient, the sum over the replicas (added in replica order) on
        its stepper, and None on the other replicas. ``grads`` may be overwritten."""
        rg, me = self.rg, self.rg.rank
        ops: list = []
        sums: list[tuple[list[int], list[list[torch.Tensor]]]] = []
        sent = recv = 0
        for s, idx in self._groups(grads, steppers):
            ts = [grads[i] for i in idx]
            if s != me:
                for b in self._send_bufs(ts):
                    ops.append(dist.P2POp(dist.isend, b, rg.g(s), rg.group))
                    sent += nbytes(b)
                continue
            parts = []  # one entry per replica, in replica order; this replica's own in its slot
            for q in range(rg.size):
                if q == me:
                    parts.append(self._send_bufs(ts) if self.pack else [t.clone() for t in ts])
                    continue
                bufs = self._recv_bufs(ts)
                for b in bufs:
                    ops.append(dist.P2POp(dist.irecv, b, rg.g(q), rg.group))
                    recv += nbytes(b)
                parts.append(bufs)
            sums.append((idx, parts))

        def finish() -> list[Optional[torch.Tensor]]:
            out: list[Optional[torch.Tensor]] = [None] * len(grads)
            for idx, parts in sums:
                totals = parts[0]
                for bufs in parts[1:]:  # ((p_0 + p_1) + p_2) + ...: replica order
                    for t, b in zip(totals, bufs):
                        t.add_(b)
                for i, t in zip(idx, self._views(totals, [grads[i] for i in idx])):
                    out[i] = t
            return out

        return self._issue("replica_reduce", ops, sent, recv, finish, "the replica reduction of gradients")

    def start_broadcast(self, tensors: Sequence[torch.Tensor], steppers: Sequence[int]) -> PendingOp:
        """Overwrite ``tensors[i]`` on every replica with its stepper's copy (in place, complete
        once waited for; until then the receivers' tensors must not be read)."""
        rg, me = self.rg, self.rg.rank
        ops: list = []
        unpack: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        sent = recv = 0
        for s, idx in self._groups(tensors, steppers):
            ts = [tensors[i] for i in idx]
            if s == me:
                bufs = self._send_bufs(ts)
                for q in range(rg.size):
                    if q != me:
                        for b in bufs:
                            ops.append(dist.P2POp(dist.isend, b, rg.g(q), rg.group))
                            sent += nbytes(b)
                continue
            bufs = self._recv_bufs(ts) if self.pack else ts  # NCCL: straight into the tensors
            if self.pack:
                unpack.append((bufs, ts))
            for b in bufs:
                ops.append(dist.P2POp(dist.irecv, b, rg.g(s), rg.group))
                recv += nbytes(b)

        def finish() -> None:
            for bufs, ts in unpack:
                for t, v in zip(ts, self._views(bufs, ts)):
                    t.copy_(v)

        return self._issue("replica_broadcast", ops, sent, recv, finish, "the replica broadcast of updated weights")
