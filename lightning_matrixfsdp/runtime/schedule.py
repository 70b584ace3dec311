"""The schedule one sharded root hands to its units: what runs next, and what is in flight.

A unit needs to know little about the rest of the model: which unit to prefetch
(the next one in last iteration's forward order, or the previous one in backward),
whether backward has begun (then a forward is activation-checkpoint recomputation),
and where to park its reduction so that one is in flight while backward goes on.
The schedule holds exactly that, as FSDP2 hands its param groups a small context
instead of the whole state; the root's end-of-backward work is given to it as a
callable, so nothing here knows units or the state.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Generic, Iterator, Optional, TypeVar

import torch

U = TypeVar("U")  # a unit; the schedule only compares and returns them


class Schedule(Generic[U]):
    """Forward order, prefetch targets, the reduction in flight and the backward flag."""

    def __init__(self, prefetch: bool, end_of_backward: Callable[[], None],
                 abandon: Optional[Callable[[], None]] = None) -> None:
        self.prefetch = prefetch
        self.root: Optional[U] = None  # the root unit: it wraps the others, so backward starts there
        self.in_backward = False
        self._end_of_backward_work = end_of_backward
        self._abandon_work = abandon
        self._forward_order: list[U] = []  # last iteration's, used for prefetching
        self._order_now: list[U] = []
        self._pending_reduces: list[Callable[[], None]] = []
        #: called with a unit's index before it materializes, while ranks without a batch
        #: follow an evaluation step (``runtime/join.py``); None otherwise
        self.announce: Optional[Callable[[int], None]] = None
        #: called before an outermost root forward that no training loop scheduled (outside
        #: :meth:`scheduled`): every rank must join it (``consensus.PeerCheck``); None: no check
        self.peer_check: Optional[Callable[[], None]] = None
        self._scheduled = 0
        #: inside ``full_model`` on another rank: the global rank that holds the whole model,
        #: and forwards here are refused (this rank holds placeholders); None otherwise
        self.full_on: Optional[int] = None
        #: the root's forward pre-work (``replica_split``: start the weight transfers nobody started),
        #: also run before a call of a unit's inner module outside every forward; None: nothing
        self.before_forward: Optional[Callable[[], None]] = None
        #: the backward now running computes only part of the gradients (a pipeline stage under a
        #: split-backward schedule: the input gradients, or the weight gradients later): the units
        #: materialize as usual but neither reduce nor end the iteration; runtime/pipeline/ finishes
        #: them after each part (split_backward.py)
        self.partial_backward = False

    # ------------------------------------------------------------------ forwards every rank runs
    @contextmanager
    def scheduled(self) -> Iterator[None]:
        """Forwards inside are a training loop's steps, which every rank runs: no peer check."""
        self._scheduled += 1
        try:
            yield
        finally:
            self._scheduled -= 1

    def check_peers(self) -> None:
        """Before an outermost root forward: outside the loop's steps, meet the other ranks first."""
        if self.peer_check is not None and not self._scheduled and not self.in_backward:
            self.peer_check()

    # ------------------------------------------------------------------ order and prefetch
    def record_forward(self, unit: U) -> None:
        """Record the order in which units run forward (next iteration's prefetch order)."""
        if not self.in_backward and torch.is_grad_enabled() and unit not in self._order_now:
            self._order_now.append(unit)

    def next_to_forward(self, unit: U) -> Optional[U]:
        order = self._forward_order
        if not self.prefetch or unit not in order:
            return None
        i = order.index(unit) + 1
        return order[i] if i < len(order) else None

    def next_to_backward(self, unit: U) -> Optional[U]:
        """Backward visits the inner units in reverse forward order (the root, which
        wraps them all, gets its gradients first)."""
        order = [u for u in self._forward_order if u is not self.root]
        if not self.prefetch or not order:
            return None
        if unit is self.root:
            return order[-1]
        if unit not in order:
            return None
        i = order.index(unit)
        return order[i - 1] if i > 0 else None

    # ------------------------------------------------------------------ reductions
    def defer_reduce(self, finish: Callable[[], None]) -> None:
        """Keep one reduction in flight: finish the previous before queuing the next."""
        self.drain_reduces()
        self._pending_reduces.append(finish)

    def drain_reduces(self) -> None:
        while self._pending_reduces:
            self._pending_reduces.pop(0)()

    def abandon_forward(self) -> None:
        """A forward raised: forget this iteration's forwards (the root's reset work, then the
        partial forward order)."""
        self._order_now = []
        if self._abandon_work is not None:
            self._abandon_work()

    # ------------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        """The first gradient reached a unit: queue the end-of-backward work once."""
        if self.in_backward:
            return
        self.in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        try:
            if not self.partial_backward:
                self._end_of_backward_work()
            if self._order_now:
                self._forward_order, self._order_now = self._order_now, []
        finally:
            self.in_backward = False
