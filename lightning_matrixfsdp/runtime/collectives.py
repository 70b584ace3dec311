"""All runtime communication: owner collectives, gradient reduction, and the small all-reduces.

Materialize (owners -> everyone) and reduce-to-owner (everyone -> owner) have three
implementations behind one interface; :class:`GradientReducer` adds what a gradient
needs after it reached its owner (the data-parallel mean, the HSDP replica sum) and
the "which parameters got a gradient" agreement; :func:`all_reduce_norm` is the
global-norm clip's scalar.  Everything counts its bytes in :class:`CommStats`, and
:func:`comm_device` is the one place that says where communication tensors live.

Byte accounting is *logical payload per rank*: what a rank contributes or obtains,
not the relay traffic of a tree or ring algorithm, except for the padded
collectives, which count the ring's (W-1) segments each way like FSDP.

Every operation is split into ``start`` (issue the communication, return a
:class:`PendingOp`) and ``PendingOp.wait`` (finish and copy out), so the unit
lifecycle can overlap communication with compute on accelerators.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.placement import MatrixShard
from lightning_matrixfsdp.runtime.waits import wait_works

#: Phases every snapshot shows.  ``optimizer_step`` is counted by nothing: the owner step
#: communicates nothing, and the phase is kept at zero so that users see it (the README's
#: loop prints it, the strategy logs ``matrix_fsdp/optimizer_step_MB``).
PHASES = ("materialize", "reduce", "replicate", "optimizer_step", "clip")
#: ``replica_split`` counts ``replica_reduce`` and ``replica_broadcast`` (``replica_comm.py``);
#: they appear in a snapshot once something was counted in them.


class CommStats:
    """Per-phase byte and call counters of one sharded model on this rank."""

    def __init__(self) -> None:
        self._d: dict[str, dict[str, int]] = {}
        self.reset()

    def reset(self) -> None:
        self._d = {p: {"sent": 0, "recv": 0, "calls": 0} for p in PHASES}

    def add(self, phase: str, sent: int = 0, recv: int = 0, calls: int = 1) -> None:
        d = self._d.setdefault(phase, {"sent": 0, "recv": 0, "calls": 0})
        d["sent"] += int(sent)
        d["recv"] += int(recv)
        d["calls"] += int(calls)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {p: dict(v) for p, v in self._d.items()}


@dataclass
class PendingOp:
    """Communication in flight; ``wait()`` finishes it and returns the result.

    ``blocking``: the works block the host while waited for (gloo), so the wait goes
    through :func:`waits.wait_works`, which SIGINT and SIGTERM can end; ``what`` names
    the operation in that case's error.
    """

    works: list = field(default_factory=list)
    finish: Optional[Callable[[], object]] = None
    blocking: bool = False
    what: str = "a collective"

    def wait(self) -> object:
        if self.blocking:
            wait_works(self.works, self.what)
        else:
            for w in self.works:
                if w is not None:
                    w.wait()
        self.works = []
        fin, self.finish = self.finish, None
        return fin() if fin is not None else None


class ShardGroup:
    """The shard span as seen by one rank: local rank, size, and the global ranks."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        if group is None or not dist.is_initialized():
            self.group, self.rank, self.size, self.global_ranks = None, 0, 1, [0]
            return
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.size)]

    @property
    def blocks_host(self) -> bool:
        """Waiting for this group's communication blocks the host (gloo, not NCCL)."""
        return self.size > 1 and comm_device(self.group).type == "cpu"

    def g(self, r: int) -> int:
        return self.global_ranks[r]


def comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a collective on ``group`` wants its tensors: the current GPU under NCCL, else
    the CPU. The one place that decides it, for the runtime, clipping and checkpoints."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


def pack_segment(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous segment (a fresh tensor: it is summed into or sent while the sources change)."""
    return torch.cat([t.reshape(-1) for t in tensors])


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


class GradientReducer:
    """Gradients of a unit, from every rank's local copy to the data-parallel mean on its owner.

    The shard group's owner collective sums them onto the owners; the owner then divides
    by the data-parallel size and, under HSDP, sums across the replicas of its shard. Under
    ``replica_split`` the owners' sums go to each role's stepping replica instead, which
    adds them and divides; the other replicas end without the gradient.
    """

    def __init__(self, collective: OwnerCollective, replicate_group: Optional[dist.ProcessGroup],
                 split: Optional[Any] = None, steppers: Optional[dict[str, int]] = None) -> None:
        self.collective = collective
        self.sg = collective.sg
        self.stats = collective.stats
        self.replicate_group = replicate_group
        self.replicate_size = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.dp_size = self.sg.size * self.replicate_size
        #: ``replica_split``: a ``replica_comm.ReplicaExchange`` (typed Any: that module imports this
        #: one) and the stepping replica of every parameter; None and {} otherwise
        self.split = split if steppers else None
        self.steppers = dict(steppers or {})

    def globally_used(self, used: list[bool], what: str = "the used-gradient flags") -> tuple[list[bool], list[bool]]:
        """Which parameters got a gradient on at least one rank (DDP leaves the rest None), and
        which got one on some ranks but not on others (the same lists on every rank)."""
        if self.dp_size == 1:
            return used, [False] * len(used)
        # one MAX all-reduce of "used here" and "unused here": both set means the ranks differ
        flags = [int(u) for u in used] + [int(not u) for u in used]
        t = torch.tensor(flags, dtype=torch.int32, device=comm_device(self.sg.group))
        for group, size in ((self.sg.group, self.sg.size), (self.replicate_group, self.replicate_size)):
            if group is not None and size > 1:
                work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
                _wait(work, comm_device(group), what)
        n = len(used)
        both = t.tolist()
        return [bool(x) for x in both[:n]], [bool(a and b) for a, b in zip(both[:n], both[n:])]

    def start(self, shards: Sequence[MatrixShard], grads: Sequence[torch.Tensor],
              keep: Sequence[bool], what: str = "a gradient reduction") -> PendingOp:
        """Issue the reduction to owners; ``wait()`` returns, per gradient, the mean on its
        owner where ``keep`` is set and None elsewhere.  ``keep`` must agree across ranks
        (it decides the replica all-reduces)."""
        pending = self.collective.start_reduce(shards, grads)
        pending.what = what
        across = self._to_steppers if self.split is not None else self._replicate_sums
        if self.sg.size == 1:
            # No shard-group reduction to wait for (W = 1): the replica reduction is issued now,
            # so it overlaps the backward of the units before this one, as DDP's buckets do.
            return PendingOp(finish=across(shards, pending.wait(), keep))
        return PendingOp(finish=lambda: across(shards, pending.wait(), keep)())

    def _to_steppers(self, shards: Sequence[MatrixShard], sums: Sequence[Optional[torch.Tensor]],
                     keep: Sequence[bool]) -> Callable[[], list[Optional[torch.Tensor]]]:
        """``replica_split``: start sending the shard group's sums on the owners to each role's
        stepping replica; the returned finish waits, and there the stepper's sum over the replicas
        (added in replica order), divided as DDP divides its sum, stays alone (None elsewhere)."""
        idx = [i for i, (g, k) in enumerate(zip(sums, keep)) if g is not None and k]
        pending = (self.split.start_reduce([sums[i] for i in idx], [self.steppers[shards[i].fqn] for i in idx])
                   if idx else None)

        def finish() -> list[Optional[torch.Tensor]]:
            out: list[Optional[torch.Tensor]] = [None] * len(sums)
            for i, g in zip(idx, pending.wait() if pending is not None else []):
                if g is not None:
                    out[i] = g.div_(self.dp_size)
            return out

        return finish

    def _replicate_sums(self, shards: Sequence[MatrixShard], sums: Sequence[Optional[torch.Tensor]],
                        keep: Sequence[bool]) -> Callable[[], list[Optional[torch.Tensor]]]:
        """HSDP: divide each owner's sum and start its all-reduce across the replicas; the
        returned finish waits for all of them. One all-reduce per gradient, all in flight at
        once: the same per-tensor collective (so the same float32 result) as one at a time,
        without a round trip per tensor."""
        out: list[Optional[torch.Tensor]] = []
        works: list[tuple[Any, torch.Tensor]] = []
        for g, k in zip(sums, keep):
            if g is None or not k:
                out.append(None)
                continue
            g.div_(self.dp_size)
            if self.replicate_group is not None and self.replicate_size > 1:
                works.append((dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.replicate_group,
                                              async_op=True), g))
            out.append(g)

        def finish() -> list[Optional[torch.Tensor]]:
            for work, g in works:
                _wait(work, g.device, "the replica sum of a gradient")
                b = nbytes(g)
                self.stats.add("replicate", b, b)
            return out

        return finish


def all_reduce_norm(local: torch.Tensor, maximum: bool, group: Optional[dist.ProcessGroup] = None,
                    stats: Optional[CommStats] = None) -> torch.Tensor:
    """Combine the owners' partial norms of a global-norm clip over ``group`` (a few
    scalars): element-wise sum (``maximum=False``) or maximum.  Returns a 1-D tensor on
    :func:`comm_device`."""
    total = local.to(comm_device(group)).reshape(-1).clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        work = dist.all_reduce(total, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM, group=group,
                               async_op=True)
        _wait(work, total.device, "the global-norm all-reduce of a gradient clip")
        if stats is not None:
            stats.add("clip", nbytes(total), nbytes(total))
    return total


def gather_ints(values: Sequence[int], group: Optional[dist.ProcessGroup] = None,
                what: str = "a small all-gather") -> list[list[int]]:
    """Every rank's ``values`` (the same length everywhere), in rank order of ``group``: the
    evaluation join's "has a batch" agreement and its announcements."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=comm_device(group))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [mine.tolist()]
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    _wait(work, mine.device, what)
    return [r.tolist() for r in rows]


def gather_objects(obj: object, group: Optional[dist.ProcessGroup] = None) -> list:
    """Every rank's picklable ``obj``, in rank order of ``group`` (setup-time agreement and
    error reports; never on a training step's path)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _wait(work: object, device: torch.device, what: str) -> None:
    """Wait for a work item; on the CPU (gloo) where SIGINT and SIGTERM can end the wait."""
    if device.type == "cpu":
        wait_works([work], what)
    else:
        work.wait()  # type: ignore[attr-defined]


COLLECTIVES: dict[str, type[OwnerCollective]] = {
    c.name: c for c in (P2PCollective, BroadcastCollective, PaddedAllGatherCollective)
}
DEFAULT_COLLECTIVE = "p2p"


COLLECTIVE_NAMES = (*COLLECTIVES, "p2p_packed", "p2p_direct")


def make_collective(name: str, sg: ShardGroup, stats: CommStats) -> OwnerCollective:
    """``p2p`` packs segments on gloo and sends tensors directly on NCCL;
    ``p2p_packed`` / ``p2p_direct`` force one of the two."""
    if name in ("p2p_packed", "p2p_direct"):
        return P2PCollective(sg, stats, pack=name == "p2p_packed")
    try:
        cls = COLLECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown collective {name!r}; choose one of {', '.join(COLLECTIVE_NAMES)}") from None
    return cls(sg, stats)
