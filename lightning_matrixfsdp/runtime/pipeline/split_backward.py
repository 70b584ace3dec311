"""Split backward under owner sharding: torch's zero-bubble schedules and DualPipeV.

These schedules run each micro-batch's backward on a stage in two parts: the *input part*
(``torch.autograd.grad`` to the stage's inputs, keeping the graph, while torch records where the
parameters' gradients branch off it) and, later, the *weight part* (the parameters' gradients from
what the input part recorded), which sets ``.grad`` itself. Neither part accumulates a gradient
through autograd, so a unit's own post-backward, which waits for its parameters' gradients, never
comes; and torch finds the parameters as the stage module's ``parameters()``, which must then be
the graph's leaves: our unsharded parameters, not the resident ones.

So on every stage but the first (whose input part torch skips: its weight part is one whole
backward, which the units handle as under any schedule) each part runs with the schedule's
``partial_backward`` flag on (the units materialize as usual, reduce nothing, and the end of
that backward does nothing) and the unsharded parameters registered on the modules:

- input part: the units materialize as backward reaches them; afterwards every unit reshards and
  starts afresh (there is no gradient yet to reduce);
- weight part: every unit materializes first (the nodes that compute weight gradients may read
  the weights); afterwards every unit reduces what torch left on its unsharded parameters to the
  owners (added to their ``.grad``, as after a whole backward) and reshards;
- a whole backward (DualPipeV's ``B`` actions): as under any schedule.

What this costs against 1F1B: one more materialization per micro-batch and stage (the weight
part's), and each reduction starts after the weight part, not unit by unit during it. What stays
exact: each micro-batch's gradient on a stage is the one a whole backward gives (the same nodes run
on the same tensors), reduced once, and added on the owner in the order the weight parts run
(micro-batch order on each stage, in torch's schedules).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

from lightning_matrixfsdp.runtime.errors import MatrixShardError
from lightning_matrixfsdp.runtime.tags import state_of

__all__ = ["SplitBackward", "check_split_combination"]

PARTS = ("input", "weight", "full")


def check_split_combination(schedule: str, expert_parallel_size: int) -> None:
    """Refuse what a split backward does not support, before anything is sharded: expert
    parallelism (its local experts take their gradients from autograd hooks at the end of each
    whole backward, which a weight part is not)."""
    if expert_parallel_size != 1:
        raise MatrixShardError(
            f"pipeline schedule {schedule!r} splits each backward into input and weight gradients, which expert "
            f"parallelism (expert_parallel_size={expert_parallel_size}) does not support: its local experts "
            "take their gradients at the end of each whole backward. Use 1F1B or Interleaved1F1B with expert "
            "parallelism, or expert_parallel_size=1")


class SplitBackward:
    """How one owner-sharded stage goes through torch's split backward (see the module docstring).
    comm.py's stage runs each backward part of a micro-batch inside :meth:`part`."""

    def __init__(self, stage: nn.Module) -> None:
        state = state_of(stage)
        if state is None:
            raise MatrixShardError("a split-backward stage must be the root of matrix_shard")
        self.state = state

    @contextmanager
    def part(self, kind: str) -> Iterator[None]:
        """Around torch's ``kind`` part (``"input"``, ``"weight"`` or ``"full"``) of one micro-batch's
        backward on this stage."""
        if kind not in PARTS:
            raise ValueError(f"unknown backward part {kind!r}")
        if kind == "full":
            yield
            return
        units = self.state.units
        for unit in units:
            if kind == "weight":
                unit.unshard()
            for p in unit.params:
                p.to_unsharded()  # torch reads the stage's parameters: the graph's leaves
        schedule = self.state.schedule
        schedule.partial_backward = True
        try:
            yield
        finally:
            schedule.partial_backward = False
        if kind == "weight":
            self._reduce()
        for unit in units:
            unit.end_iteration()  # resharded; the next part materializes again

    def _reduce(self) -> None:
        """Every unit's gradients of this weight part to their owners, as a whole backward's end
        reduces them: without agreeing first where each trainable parameter has a gradient, else
        agreeing over the stage which ones got one anywhere (``unit_grads.start_reduction``)."""
        for unit in self.state.units:
            missing = any(unit.params[i].unsharded.grad is None for i in unit.trainable)
            unit.post_backward(flush=missing)
        self.state.schedule.drain_reduces()
