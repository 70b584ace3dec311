"""Every rank on global rank 0's model, as under DDP: parameters when the model is sharded, buffers
then and before forwards.

**Parameters** (:func:`agree_params`). DDP broadcasts rank 0's parameters when it wraps the model,
so ranks that built it with different weights (no global seed, weights loaded on rank 0 only)
still train one model. Under owner sharding only each role's owner keeps its value, so only the
owners need rank 0's. Each rank takes a digest of the tensors whose value matters from it (the
source: every role it does not own; any other rank: the roles it owns), one all-gather of the
digests tells every rank which owners differ, and only those roles move, from the source straight
to their owner. Ranks that agree (the usual case: a global seed) move no parameter bytes; the cost
is one pass over the parameters on the source and over its own on every other rank, plus one
all-gather of 8 bytes per parameter. Under HSDP the shard-rank-0 ranks of all replicas first agree
with global rank 0 over their replicate group, then every shard group with its shard-rank 0. A
meta-device model is materialized by the owners themselves (there is no rank 0 value), so only
the replicas of each owner agree, with replica 0 (:func:`agree_replicas`).

**Buffers** (:class:`BufferSync`). DDP broadcasts rank 0's buffers when it wraps the model and
then at the start of each forward that follows a forward with gradients and gradient sync on
(``require_forward_param_sync``): before every training forward except the one after a no-sync
micro-batch, and before the first evaluation forward after training. ``BufferSync`` follows
that rule on the root module, with every buffer that exists packed into one broadcast, counted
under the ``buffers`` phase. Not during backward (activation-checkpoint recomputation) and not in
an evaluation step in which some ranks have no batch (``runtime/join.py``): the ranks without one
run no forward, so the broadcast waits for the next forward all ranks run.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_matrixfsdp.runtime.comm.core import CommStats, ShardGroup
from lightning_matrixfsdp.runtime.schedule import Schedule
from lightning_matrixfsdp.runtime.comm.sync import as_bytes, broadcast_packed, gather_digests, send_to_targets

#: Phase of the parameter agreement at sharding time in ``get_comm_stats``.
AGREE_PHASE = "init_sync"
#: Phase of the buffer broadcasts.
BUFFER_PHASE = "buffers"
#: 32-bit words per exact partial sum of a digest: words below 2^31 in magnitude times weights
#: below 2^16, 2^15 of them, stay below 2^62 in int64, whatever order the sum takes.
_BLOCK = 1 << 15
#: Words converted to int64 at a time (bounds the temporary memory to 64 MiB).
_STEP = 1 << 22


# ---------------------------------------------------------------------- digests
def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (zero-padded to a multiple of 4 bytes)."""
    raw = as_bytes(t)
    pad = -raw.numel() % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int32)


def digests(tensors: Sequence[Optional[torch.Tensor]]) -> list[int]:
    """A signed 64-bit digest of each tensor's dtype, shape and bytes (0 for None).

    The bytes, read as 32-bit words, are weighted by their position and summed exactly in int64,
    block by block, where the tensor lives (about one pass over its memory); the host hashes the
    block sums. A change of any single word always changes the digest."""
    partial: list[Optional[torch.Tensor]] = []
    weights: dict[torch.device, torch.Tensor] = {}
    for t in tensors:
        if t is None:
            partial.append(None)
            continue
        words = _words(t)
        if words.device not in weights:
            idx = torch.arange(_BLOCK, dtype=torch.int64, device=words.device)
            weights[words.device] = (idx * 40503 + 12345) % 65521 + 1
        w = weights[words.device]
        sums = []
        for s in range(0, words.numel(), _STEP):
            part = words[s:s + _STEP].to(torch.int64)
            whole = part.numel() // _BLOCK * _BLOCK
            if whole:
                sums.append((part[:whole].view(-1, _BLOCK) * w).sum(1))
            if whole < part.numel():
                sums.append((part[whole:] * w[:part.numel() - whole]).sum().reshape(1))
        partial.append(torch.cat(sums).cpu() if sums else torch.zeros(0, dtype=torch.int64))
    out = []
    for t, sums in zip(tensors, partial):
        if t is None or sums is None:
            out.append(0)
            continue
        h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode() + sums.numpy().tobytes(), digest_size=8)
        out.append(int.from_bytes(h.digest(), "little", signed=True))
    return out


def _agree(tensors: Sequence[Optional[torch.Tensor]], targets: Sequence[Sequence[int]],
           group: Optional[dist.ProcessGroup], stats: CommStats) -> list[int]:
    """Give every rank of ``targets[i]`` (group ranks) group rank 0's ``tensors[i]``. ``tensors[i]``
    is this rank's copy where it is rank 0 or a target (else unused). Returns the indices that moved."""
    me = dist.get_rank(group)
    mine = [t if who and (me == 0 or me in who) else None for t, who in zip(tensors, targets)]
    rows = gather_digests(digests(mine), group, stats, AGREE_PHASE)
    moves = [(i, r) for i, who in enumerate(targets) for r in who if r != 0 and rows[r][i] != rows[0][i]]
    send_to_targets(moves, tensors, 0, group, stats, AGREE_PHASE)
    return sorted({i for i, _ in moves})


def agree_params(tensors: Sequence[torch.Tensor], owners: Sequence[int], sg: ShardGroup,
                 replicate_group: Optional[dist.ProcessGroup], stats: CommStats) -> list[int]:
    """Before sharding (every rank holds every parameter in full): each owner's copy of
    ``tensors[i]`` (owner: shard-group rank ``owners[i]``, in every replica) becomes global rank
    0's, in place. Returns the indices whose owner's copy moved on some rank of this shard group."""
    moved: set[int] = set()
    if replicate_group is not None and dist.get_world_size(replicate_group) > 1 and sg.rank == 0:
        everyone = list(range(dist.get_world_size(replicate_group)))
        moved.update(_agree(tensors, [everyone] * len(tensors), replicate_group, stats))
    if sg.size > 1:
        moved.update(_agree(tensors, [[o] if o != 0 else [] for o in owners], sg.group, stats))
    return sorted(moved)


def agree_replicas(owned: Sequence[torch.Tensor], replicate_group: Optional[dist.ProcessGroup],
                   stats: CommStats) -> list[int]:
    """After a meta-device model was materialized by its owners (HSDP): the owners in every
    replica take replica 0's values of ``owned`` (the same roles on every rank of the group)."""
    if replicate_group is None or dist.get_world_size(replicate_group) == 1:
        return []
    everyone = list(range(dist.get_world_size(replicate_group)))
    return _agree(owned, [everyone] * len(owned), replicate_group, stats)


# ---------------------------------------------------------------------- buffers
def buffer_layout(root: nn.Module) -> str:
    """Count and digest of the buffers' names, shapes and dtypes: part of the schedule the ranks
    compare at sharding time, since a broadcast between different layouts would not match."""
    items = [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in root.named_buffers()]
    return f"{len(items)} buffers, layout {hashlib.sha256(';'.join(items).encode()).hexdigest()[:12]}"


class BufferSync:
    """Rank 0's buffers for every rank of the data-parallel group, at DDP's times (module docstring)."""

    def __init__(self, root: nn.Module, sg: ShardGroup, replicate_group: Optional[dist.ProcessGroup],
                 stats: CommStats, enabled: bool) -> None:
        self.root = root
        self.sg = sg
        self.replicate_group = replicate_group
        self.stats = stats
        self.enabled = enabled
        #: DDP's ``require_forward_param_sync``: the next forward broadcasts first
        self.due = True
        self._skipped = False

    def broadcast(self, what: str = "the broadcast of rank 0's buffers") -> None:
        """Every rank takes global rank 0's buffers now (collective over the data-parallel ranks).
        The buffers are read anew each time, as DDP does: a module may replace its tensors."""
        bufs = [b for _, b in self.root.named_buffers()]
        if not bufs:
            return
        rg = self.replicate_group
        if rg is not None and dist.get_world_size(rg) > 1 and self.sg.rank == 0:
            broadcast_packed(bufs, 0, rg, self.stats, BUFFER_PHASE, what)
        if self.sg.size > 1:
            broadcast_packed(bufs, 0, self.sg.group, self.stats, BUFFER_PHASE, what)

    def sync_if_due(self) -> None:
        """What the first evaluation forward after training does (the Trainer calls it when
        validation starts, where every rank is present): broadcast if due, then not due."""
        if self.enabled and self.due:
            self.broadcast()
        self.due = False

    def install(self, schedule: Schedule, grad_sync: Callable[[], bool],
                check: Optional[Callable[[], None]]) -> list[Any]:
        """Hook the root: broadcast before a forward when due, and say after it whether the next
        one is. ``grad_sync``: whether gradients are reduced (no-sync micro-batches say no);
        ``check``: the sequence check, so that a rank running a forward alone is named, not hung.
        Returns the hook handles (the state removes them while ``full_model`` holds the model)."""
        return [
            self.root.register_forward_pre_hook(lambda m, a: self._before_forward(schedule, check), prepend=True),
            self.root.register_forward_hook(lambda m, a, o: self._after_forward(schedule, grad_sync())),
        ]

    def _before_forward(self, schedule: Schedule, check: Optional[Callable[[], None]]) -> None:
        self._skipped = False
        if schedule.in_backward or not self.enabled or not self.due:
            return
        if schedule.announce is not None:  # an evaluation step some ranks sit out (runtime/join.py)
            self._skipped = True
            return
        if check is not None:
            check()
        self.broadcast()

    def _after_forward(self, schedule: Schedule, grad_sync: bool) -> None:
        if schedule.in_backward or self._skipped:
            return
        self.due = torch.is_grad_enabled() and grad_sync
