"""The small collectives: agreements and checks of a few numbers or objects, the clip's scalars.

None of these is on a unit's data path. The training-step ones (:func:`all_reduce_norm`
for the global-norm clip, :func:`gather_ints` for the sequence check and the evaluation
join, :func:`sum_counts` for the experts' token counts at a log step) move a few scalars; the rest (:func:`any_rank`, :func:`gather_objects`, :func:`broadcast_object`,
:func:`barrier`, :func:`monitored_barrier`, :func:`gloo_subgroups`) run at setup, around
checkpoints, or on an error path. Only the clip is counted in :class:`~comm.CommStats`
(under ``clip``): the others are not model traffic.

Without an initialized process group, or on a group of one rank, each returns at once
with this rank's own values.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, comm_device, nbytes, wait_all


def _alone(group: Optional[dist.ProcessGroup]) -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1


def all_reduce_norm(local: torch.Tensor, maximum: bool, group: Optional[dist.ProcessGroup] = None,
                    stats: Optional[CommStats] = None) -> torch.Tensor:
    """Combine the owners' partial norms of a global-norm clip over ``group`` (a few
    scalars): element-wise sum (``maximum=False``) or maximum.  Returns a 1-D tensor on
    :func:`comm_device`."""
    total = local.to(comm_device(group)).reshape(-1).clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        work = dist.all_reduce(total, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM, group=group,
                               async_op=True)
        wait_all([work], total.device.type == "cpu", "the global-norm all-reduce of a gradient clip")
        if stats is not None:
            stats.add("clip", nbytes(total), nbytes(total))
    return total


def gather_ints(values: Sequence[int], group: Optional[dist.ProcessGroup] = None,
                what: str = "a small all-gather") -> list[list[int]]:
    """Every rank's ``values`` (the same length everywhere), in rank order of ``group``: the
    evaluation join's "has a batch" agreement and its announcements."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=comm_device(group))
    if _alone(group):
        return [mine.tolist()]
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    wait_all([work], mine.device.type == "cpu", what)
    return [r.tolist() for r in rows]


def sum_counts(counts: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> list[int]:
    """``counts`` (int64) summed over ``group`` (the world by default), as a list: the experts' token
    counts at a log step (``queries.get_expert_stats``)."""
    total = counts.to(comm_device(group), torch.int64).reshape(-1).clone()
    if not _alone(group):
        work = dist.all_reduce(total, group=group, async_op=True)
        wait_all([work], total.device.type == "cpu", "the all-reduce of the experts' token counts")
    return total.tolist()


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank of the world (the same answer on every rank; the
    local flag without an initialized process group). The adapters' optimizer check agrees with it."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        t = t.to(comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(int(t.item()))


def gather_objects(obj: object, group: Optional[dist.ProcessGroup] = None) -> list:
    """Every rank's picklable ``obj``, in rank order of ``group`` (setup-time agreement,
    checkpoints and error reports; never on a training step's path)."""
    if _alone(group):
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    """Global rank ``src``'s picklable ``obj`` on every rank of the default group."""
    if _alone(None):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """A barrier of the default group that is a plain all-reduce (works on every backend, on
    the :func:`comm_device`)."""
    if not _alone(None):
        dist.all_reduce(torch.zeros(1, device=comm_device()))


def monitored_barrier(group: Optional[dist.ProcessGroup], timeout_s: float) -> None:
    """gloo's barrier that gives up after ``timeout_s`` seconds, waiting for every rank
    (``RuntimeError`` naming the ranks that did not arrive)."""
    dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)


def gloo_subgroups(spans: Sequence[Sequence[int]]) -> Optional[dist.ProcessGroup]:
    """A gloo group per span of global ranks (the spans partition the world); returns this
    rank's. Collective over the whole world."""
    group, _ = dist.new_subgroups_by_enumeration([list(s) for s in spans], backend="gloo")
    return group
