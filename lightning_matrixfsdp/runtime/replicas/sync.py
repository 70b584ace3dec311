"""``replica_split``'s weight lifecycle: when the stepper's updated weights go to the other replicas.

Each owned parameter of a split model is in one :class:`ReplicaState`:

- ``SYNCED``: every replica holds the same weights.
- ``REDUCED``: its gradient reached the stepping replica since the last transfer was
  started, so the stepper's optimizer may have updated it (or will).
- ``SENDING``: the transfer is in flight; the unit's next materialization waits for it.

A transfer starts (``REDUCED`` -> ``SENDING``) in :meth:`ReplicaSync.start`, called

- by the adapters right after ``optimizer.step()`` returned, for that optimizer's
  parameters (the step itself issues no collective), and
- lazily by the root's next forward, for every ``REDUCED`` parameter (a bare
  ``matrix_shard`` model stepped by any optimizer). Under gradient accumulation with
  a reduction per micro-batch this also sends unchanged weights between micro-batches:
  correct, but redundant traffic (``accumulation_no_sync`` / ``no_sync`` avoids it).

:meth:`ReplicaSync.wait` (a unit, before it materializes), :meth:`ReplicaSync.wait_all`
(``module.state_dict()``, which one rank may call alone, so it starts nothing) and
:meth:`ReplicaSync.settle` (checkpoints, evaluation, the end of ``fit``: every rank) finish it. ``settle(clear=False)``
sends what is ``REDUCED`` but leaves it ``REDUCED``: between a reduction and its
optimizer step (a save in the middle of an accumulation window) the weights are equal
now, and the step that follows still has to be sent.

Every replica of a shard rank makes the same calls in the same order with the same
states (SPMD), so the transfers match without any agreement.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Iterable, Optional

import torch

from lightning_matrixfsdp.runtime.comm.core import PendingOp
from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.replicas.comm import ReplicaExchange

__all__ = ["ReplicaState", "ReplicaSync"]


class ReplicaState(Enum):
    SYNCED = auto()
    REDUCED = auto()
    SENDING = auto()


class ReplicaSync:
    """The replica transfers of one sharded root, per unit (see the module docstring)."""

    def __init__(self, units: list[list[ShardedParam]], steppers: dict[str, int], exchange: ReplicaExchange,
                 first: Optional[int] = None) -> None:
        # only what this rank owns moves between replicas (the same roles in every replica)
        self.params = [[p for p in ps if p.owned] for ps in units]
        # Transfers are issued in the order the next forward needs them: the backend runs one
        # replicate group's transfers one after another, and the root unit (``first``), which
        # wraps the others, materializes before any of them.
        self.order = ([first] if first is not None else []) + [u for u in range(len(units)) if u != first]
        self.steppers = [[steppers[p.shard.fqn] for p in ps] for ps in self.params]
        self.exchange = exchange
        self.states = [[ReplicaState.SYNCED] * len(ps) for ps in self.params]
        self._pending: list[list[PendingOp]] = [[] for _ in units]

    # ------------------------------------------------------------------ transitions
    def mark_reduced(self, unit: int, fqns: Iterable[str]) -> None:
        """The gradients of ``fqns`` (parameters of unit ``unit``) reached their steppers."""
        names = set(fqns)
        for i, p in enumerate(self.params[unit]):
            if p.shard.fqn in names:
                self.states[unit][i] = ReplicaState.REDUCED

    def start(self, only: Optional[set[int]] = None, clear: bool = True) -> None:
        """Send every ``REDUCED`` parameter (those whose resident tensor's ``id`` is in ``only``,
        if given) from its stepper; ``clear``: they become ``SENDING``, else stay ``REDUCED``."""
        for u in self.order:
            ps = self.params[u]
            todo = [i for i, (p, st) in enumerate(zip(ps, self.states[u]))
                    if st is ReplicaState.REDUCED and (only is None or id(p.resident) in only)]
            if not todo:
                continue
            with torch.no_grad():
                op = self.exchange.start_broadcast([ps[i].resident.data for i in todo],
                                                   [self.steppers[u][i] for i in todo])
            self._pending[u].append(op)
            if clear:
                for i in todo:
                    self.states[u][i] = ReplicaState.SENDING

    def wait(self, unit: int) -> None:
        """Finish unit ``unit``'s transfers in flight (before it materializes)."""
        pending, self._pending[unit] = self._pending[unit], []
        for op in pending:
            op.wait()
        self.states[unit] = [ReplicaState.SYNCED if s is ReplicaState.SENDING else s for s in self.states[unit]]

    def wait_all(self) -> None:
        """Finish every transfer in flight (local: their peers issued theirs when they were started)."""
        for u in range(len(self.params)):
            self.wait(u)

    def settle(self, clear: bool = False) -> None:
        """Make every replica's weights equal now: send what is ``REDUCED`` and wait for everything."""
        self.start(clear=clear)
        self.wait_all()

    @property
    def in_flight(self) -> bool:
        return any(self._pending)
