"""QK-Clip's communication: every rank's per-head maxima reduced to their maximum, and the one
agreement on the heads' layout before the first step.

The maxima are one flat float32 tensor indexed by *whole-model* head (a tensor-parallel rank
fills its own heads and leaves ``-inf`` elsewhere), so one all-reduce (MAX) over every rank
that holds a replica or a fragment of the model (the world, by default) gives each rank the
step's maximum of every head: over the data-parallel ranks' batches and across the
tensor-parallel ranks' heads alike. Maxima are exact under any reduction order.

Without an initialized process group, or on a group of one rank, both return at once.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.core import CommStats, comm_device, nbytes, wait_all

__all__ = ["QK_CLIP_PHASE", "agree_on_heads", "max_over_ranks"]

QK_CLIP_PHASE = "qk_clip"


def _alone(group: Optional[dist.ProcessGroup]) -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1


def max_over_ranks(maxima: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                   stats: Optional[CommStats] = None) -> torch.Tensor:
    """The element-wise maximum of ``maxima`` over ``group`` (a new tensor on ``maxima``'s device),
    counted under ``qk_clip`` in ``stats``."""
    if _alone(group):
        return maxima.clone()
    out = maxima.to(comm_device(group), copy=True)
    work = dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group, async_op=True)
    wait_all([work], out.device.type == "cpu", "QK-Clip's all-reduce of the largest attention logits")
    if stats is not None:
        stats.add(QK_CLIP_PHASE, nbytes(out), nbytes(out))
    return out.to(maxima.device)


def agree_on_heads(digest: str, describe: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Every rank of ``group`` found the same attention layers and heads (``digest``), or every
    rank raises the same error naming the ranks that differ (before any step's all-reduce could
    meet tensors of different sizes)."""
    if _alone(group):
        return
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (digest, describe), group=group)
    if len({d for d, _ in every}) > 1:
        lines = "; ".join(f"rank {r}: {text}" for r, (_, text) in enumerate(every))
        raise ValueError(f"QK-Clip: the ranks found different attention layers or heads ({lines}); "
                         "every rank must attach QK-Clip to the same model")
