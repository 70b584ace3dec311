"""``replica_split``'s communication: owned roles between the replicas of one shard rank.

Under HSDP the replicate group links the ranks that own the same roles (shard rank
``r`` of every replica). With ``replica_split`` each role has one stepping replica ``s``
of the ``R``:

- :meth:`ReplicaExchange.start_reduce` sums every replica's partial gradient of a role
  onto ``s`` in replica order, ``((g_0 + g_1) + g_2) + ...``, never in the backend's own
  order (a backend ``reduce`` picks its own): the float32 result is reproducible and,
  for ``W = 1``, bitwise the flat rank-order sum of DDP. The running sum travels a
  chain ``0 -> 1 -> ... -> m``, each replica adding its own part. With ``s >= R - 2`` the
  chain ends at ``m = s`` and the last replica, if it is not ``s``, sends its raw part
  to ``s``, which adds it last; otherwise the chain runs to ``m = R - 1`` and the final
  sum makes one more hop to ``s``. Every role's traffic is thus about one copy per
  link, however many replicas there are (a fan-in to ``s`` would bring ``R - 1`` copies
  to one rank). The chain is cut into chunks of ``CHUNK_BYTES`` and run as a pipeline
  of steps: at step ``t`` the hop ``h`` of chunk ``k = t - h`` moves, so a chunk leaves a
  replica while the next arrives, and the chain costs about one transfer of the
  role plus ``R - 1`` chunks, not ``R - 1`` transfers. Messages that depend on nothing
  (the chain's first hop, the raw part of the last replica) are issued by ``start``;
  the chain's later hops are issued by ``wait``, step by step, after the additions they
  carry (the host must do them on gloo; on NCCL the steps are queued without blocking
  the host).
- :meth:`ReplicaExchange.start_broadcast` overwrites the other replicas' weights with
  the stepper's, in place, through the backend's broadcast (no arithmetic, so NCCL's
  pipelined ring or tree is right, each byte crossing each link about once). On gloo,
  which pays a whole round of messages per call, one broadcast per (stepper, dtype)
  packed segment; on NCCL one per tensor, straight into the parameters: packing would
  cost two extra copies of every byte, and a unit has few tensors, each a pipelined
  broadcast.

Bytes in :class:`~lightning_matrixfsdp.runtime.comm.core.CommStats`, per rank and
role of ``b`` bytes (logical payload, the convention of the rest of the package):

- ``replica_reduce``: every replica sends ``b`` once, except the stepper where the
  chain ends (``s >= R - 2``), which sends nothing; replicas ``1 .. m`` receive ``b``
  (the running sum), and the stepper receives one more ``b`` (the final sum or the
  last replica's raw part) where it is not the chain's end or where a raw part follows.
  So no rank sends more than ``b`` or receives more than ``2 b``, for any ``R``; at
  ``R = 2`` it is exactly the fan-in (the non-stepper sends ``b``, the stepper receives it).
- ``replica_broadcast``: the stepper sends ``b``, every other replica receives ``b``
  (what a broadcast's root contributes and its receivers obtain, not the relay of
  NCCL's ring or tree, as :class:`~lightning_matrixfsdp.runtime.comm.collectives.BroadcastCollective`
  counts it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, PendingOp, ShardGroup, nbytes, pack_segment, wait_all

__all__ = ["CHUNK_BYTES", "ReplicaExchange", "chain_end"]

#: Chunk of the reduction chain. Small enough that the pipeline's fill (``R - 1`` chunks)
#: is a small part of a unit's transfer even across many replicas; large enough that the
#: per-message cost (a kernel launch and a network round on NCCL, a syscall and a TCP
#: message on gloo) stays small against the chunk's transfer time.
CHUNK_BYTES = 4 * 2**20


def chain_end(stepper: int, replicas: int) -> int:
    """Where the running sum of a role stepped by ``stepper`` stops: at the stepper when at
    most one replica follows it (that one sends its raw part there), else at the last replica."""
    return stepper if stepper >= replicas - 2 else replicas - 1


@dataclass
class _Group:
    """The roles of one (stepper, dtype): this replica's buffers for them."""

    stepper: int
    idx: list[int]
    own: torch.Tensor  # this replica's partial sum, packed
    acc: Optional[torch.Tensor] = None  # the running sum on replicas 1 .. m (received, then own added)
    extra: Optional[torch.Tensor] = None  # on the stepper: the final sum (m != s) or the last raw part
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) in elements


def _reduce_hops(me: int, s: int, m: int, R: int) -> list[tuple[int, object, int, str]]:
    """This replica's messages for one group whose stepper is ``s`` and whose chain ends at ``m``
    (``chain_end``), as (hop, op, peer, buffer); hop -1: after the chain (the raw part of the
    replicas past its end)."""
    mine: list[tuple[int, object, int, str]] = []
    if me < m:  # the running sum (replica 0: its own part) to the next replica
        mine.append((me, dist.isend, me + 1, "acc" if me else "own"))
    if 1 <= me <= m:
        mine.append((me - 1, dist.irecv, me - 1, "acc"))
    if me == m != s:  # the final sum to the stepper
        mine.append((m, dist.isend, s, "acc"))
    if me == s != m:
        mine.append((m, dist.irecv, m, "extra"))
    if m < R - 1 and me == R - 1:  # after the chain's end: the raw part to the stepper
        mine.append((-1, dist.isend, s, "own"))
    if m < R - 1 and me == s:
        mine.append((-1, dist.irecv, R - 1, "extra"))
    return mine


class ReplicaExchange:
    """Gradients to each role's stepping replica, updated weights back (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, stats: CommStats, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.rg = ShardGroup(group)  # its rank is this rank's replica index
        self.stats = stats
        self.pack = dist.get_backend(group) == "gloo"
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = int(chunk_bytes)

    # ------------------------------------------------------------------ layout
    @staticmethod
    def _groups(tensors: Sequence[torch.Tensor], steppers: Sequence[int]) -> Iterator[tuple[int, list[int]]]:
        """(stepper, indices) per (stepper, dtype), in the same order on every replica."""
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, (t, s) in enumerate(zip(tensors, steppers)):
            groups[(int(s), str(t.dtype))].append(i)
        for (s, _), idx in sorted(groups.items()):
            yield s, idx

    @staticmethod
    def _views(buf: torch.Tensor, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors ``ts`` inside a packed segment ``buf``."""
        out, off = [], 0
        for t in ts:
            out.append(buf[off:off + t.numel()].view(t.shape))
            off += t.numel()
        return out

    def _works(self, ops: list) -> list:
        return dist.batch_isend_irecv(ops) if ops else []

    # ------------------------------------------------------------------ the reduction chain
    def start_reduce(self, grads: Sequence[torch.Tensor], steppers: Sequence[int]) -> PendingOp:
        """``wait()`` returns, per gradient, the sum over the replicas (added in replica order) on
        its stepper, and None on the other replicas. ``grads`` may be overwritten."""
        rg, me, R = self.rg, self.rg.rank, self.rg.size
        if R == 1:
            return PendingOp(finish=lambda: list(grads))
        what = "the replica reduction of gradients"
        groups: list[_Group] = []
        # every message of this rank, by step: (op, peer, group, chunk, buffer); hop h >= 1 of the
        # chain's chunk k moves at step k + h, after the addition it carries; step 0 (the chain's
        # first hop, the raw part after the chain's end) depends on nothing and goes out now
        steps: dict[int, list[tuple[object, int, _Group, int, str]]] = defaultdict(list)
        sent = recv = calls = 0
        k = 0  # chunks of the groups before this one
        for s, idx in self._groups(grads, steppers):
            own = pack_segment([grads[i] for i in idx])
            g = _Group(s, idx, own)
            per = max(1, self.chunk_bytes // own.element_size())
            g.chunks = [(o, min(per, own.numel() - o)) for o in range(0, own.numel(), per)]
            m = chain_end(s, R)
            if 1 <= me <= m:
                g.acc = torch.empty_like(own)
            if me == s and (m != s or m < R - 1):
                g.extra = torch.empty_like(own)
            hops = _reduce_hops(me, s, m, R)
            for c, (_, n) in enumerate(g.chunks):
                for hop, fn, peer, buf in hops:
                    steps[k + c + hop if hop > 0 else 0].append((fn, peer, g, c, buf))
                    if fn is dist.isend:
                        sent += n * own.element_size()
                    else:
                        recv += n * own.element_size()
                    calls += 1
            k += len(g.chunks)
            groups.append(g)
        self.stats.add("replica_reduce", sent, recv, calls=calls)

        def issue(batch: list[tuple[object, int, _Group, int, str]]) -> list:
            ops = []
            for fn, peer, g, c, buf in batch:
                off, n = g.chunks[c]
                ops.append(dist.P2POp(fn, getattr(g, buf)[off:off + n], rg.g(peer), rg.group))
            return self._works(ops)

        def arrived(batch: list[tuple[object, int, _Group, int, str]]) -> None:
            for fn, _, g, c, buf in batch:
                if fn is dist.irecv and buf == "acc":  # (g_0 + ... + g_{me-1}) + g_me: replica order
                    off, n = g.chunks[c]
                    g.acc[off:off + n].add_(g.own[off:off + n])

        first = steps.pop(0, [])
        first_works = issue(first)

        def finish() -> list[Optional[torch.Tensor]]:
            wait_all(first_works, rg.blocks_host, what)
            arrived(first)
            for t in sorted(steps):
                wait_all(issue(steps[t]), rg.blocks_host, what)
                arrived(steps[t])
            out: list[Optional[torch.Tensor]] = [None] * len(grads)
            for g in groups:
                if g.stepper != me:
                    continue
                if chain_end(g.stepper, R) != me:
                    total = g.extra  # the final sum, from the chain's end
                else:
                    total = g.acc if g.acc is not None else g.own
                    if g.extra is not None:  # the last replica's raw part, added last
                        total.add_(g.extra)
                for i, t in zip(g.idx, self._views(total, [grads[i] for i in g.idx])):
                    out[i] = t
            return out

        return PendingOp(finish=finish, what=what)

    # ------------------------------------------------------------------ the weights back
    def start_broadcast(self, tensors: Sequence[torch.Tensor], steppers: Sequence[int]) -> PendingOp:
        """Overwrite ``tensors[i]`` on every replica with its stepper's copy (in place, complete
        once waited for; until then the receivers' tensors must not be read)."""
        rg, me = self.rg, self.rg.rank
        if rg.size == 1:
            return PendingOp()
        works: list = []
        unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        sent = recv = 0
        for s, idx in self._groups(tensors, steppers):
            ts = [tensors[i] for i in idx]
            if self.pack:
                buf = pack_segment(ts) if s == me else torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype,
                                                                    device=ts[0].device)
                bufs = [buf]
                if s != me:
                    unpack.append((buf, ts))
            else:
                bufs = ts  # in place: the stepper's tensors out, the others' overwritten
            for b in bufs:
                works.append(dist.broadcast(b, src=rg.g(s), group=rg.group, async_op=True))
                if s == me:
                    sent += nbytes(b)
                else:
                    recv += nbytes(b)
        self.stats.add("replica_broadcast", sent, recv, calls=len(works))

        def finish() -> None:
            for buf, ts in unpack:
                for t, v in zip(ts, self._views(buf, ts)):
                    t.copy_(v)

        return PendingOp(works, finish, blocking=rg.blocks_host, what="the replica broadcast of updated weights")
