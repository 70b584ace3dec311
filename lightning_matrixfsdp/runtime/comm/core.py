"""The communication core: pending operations, the shard group, byte accounting, the device.

Every communication of the package is split into ``start`` (issue it, return a
:class:`PendingOp`) and ``PendingOp.wait`` (finish it and copy out), so the unit
lifecycle can overlap communication with compute on accelerators. :func:`wait_all`
is the one place that waits for work handles: on gloo a wait blocks the host, so it
goes through :func:`waits.wait_works`, which SIGINT and SIGTERM can end; on NCCL a
wait orders streams and returns at once.

Byte accounting is *logical payload per rank*, counted in :class:`CommStats` by the
module that issues the communication: what a rank contributes or obtains, not the
relay traffic of a tree or ring algorithm, except for the padded collectives, which
count the ring's (W-1) segments each way like FSDP.

:func:`comm_device` is the one place that says where communication tensors live.

The modules built on this one: ``comm/collectives.py`` (the owner collectives: materialize
and reduce-to-owner), ``comm/grads.py`` (a gradient's way to the data-parallel mean),
``replicas/comm.py`` (``replica_split``), ``comm/sync.py`` (agreement with rank 0),
``comm/small.py`` (the small agreements: consensus, join, clip, checkpoints) and
``comm/p2p.py`` (whole tensors to chosen ranks: ``full_model``, the full state dict).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_matrixfsdp.runtime.comm.waits import wait_works

#: Phases every snapshot shows.  ``optimizer_step`` is counted by nothing: the owner step
#: communicates nothing, and the phase is kept at zero so that users see it (the README's
#: loop prints it, the strategy logs ``matrix_fsdp/optimizer_step_MB``).
PHASES = ("materialize", "reduce", "replicate", "optimizer_step", "clip")
#: ``replica_split`` counts ``replica_reduce`` and ``replica_broadcast`` (``replicas/comm.py``);
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


def wait_all(works: Sequence[Any], blocking: bool, what: str) -> None:
    """Wait for every work handle of ``works`` (None entries are skipped). ``blocking``: the
    works block the host while waited for (gloo), so the wait is one that SIGINT and SIGTERM
    can end; ``what`` names the operation in that case's error."""
    if blocking:
        wait_works(works, what)
        return
    for w in works:
        if w is not None:
            w.wait()


@dataclass
class PendingOp:
    """Communication in flight; ``wait()`` finishes it and returns the result.

    ``blocking`` and ``what``: see :func:`wait_all`.
    """

    works: list = field(default_factory=list)
    finish: Optional[Callable[[], object]] = None
    blocking: bool = False
    what: str = "a collective"

    def wait(self) -> object:
        wait_all(self.works, self.blocking, self.what)
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


def pack_segment(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous segment (a fresh tensor: it is summed into or sent while the sources change)."""
    return torch.cat([t.reshape(-1) for t in tensors])
