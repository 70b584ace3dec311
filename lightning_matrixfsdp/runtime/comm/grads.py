"""A gradient's way from every rank's local copy to the data-parallel mean on its owner.

:class:`GradientReducer` runs the shard group's owner collective (``comm/collectives.py``)
and adds what a gradient needs after it reached its owner: the division by the
data-parallel size, the HSDP sum across replicas (counted under ``replicate``), or,
under ``replica_split``, the chain to each role's stepping replica
(``replicas/comm.py``); and the "which parameters got a gradient" agreement of the
end-of-backward flush.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.collectives import OwnerCollective
from lightning_matrixfsdp.runtime.comm.core import PendingOp, comm_device, nbytes, wait_all
from lightning_matrixfsdp.runtime.placement import MatrixShard


class GradientReducer:
    """Gradients of a unit, from every rank's local copy to the data-parallel mean on its owner.

    The shard group's owner collective sums them onto the owners; the owner then divides
    by the data-parallel size and, under HSDP, sums across the replicas of its shard. Under
    ``replica_split`` the owners' sums go to each role's stepping replica instead, which
    adds them and divides; the other replicas end without the gradient.
    """

    def __init__(self, collective: OwnerCollective, replicate_group: Optional[dist.ProcessGroup],
                 replicate_size: int = 1, split: Optional[Any] = None,
                 steppers: Optional[dict[str, int]] = None) -> None:
        self.collective = collective
        self.sg = collective.sg
        self.stats = collective.stats
        self.replicate_group = replicate_group
        self.replicate_size = replicate_size
        self.dp_size = self.sg.size * self.replicate_size
        #: ``replica_split``: a ``replica_comm.ReplicaExchange`` (typed Any: that module imports this
        #: one) and the stepping replica of every parameter (the plan's); None and {} otherwise
        self.split = split
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
                wait_all([work], comm_device(group).type == "cpu", what)
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
                    out[i] = g.div_(self.dp_size) if self.dp_size > 1 else g
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
            if self.dp_size > 1:  # dividing by 1 is the identity: skip the pass over the gradient
                g.div_(self.dp_size)
            if self.replicate_group is not None and self.replicate_size > 1:
                works.append((dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.replicate_group,
                                              async_op=True), g))
            out.append(g)

        def finish() -> list[Optional[torch.Tensor]]:
            for work, g in works:
                wait_all([work], g.device.type == "cpu", "the replica sum of a gradient")
                b = nbytes(g)
                self.stats.add("replicate", b, b)
            return out

        return finish
