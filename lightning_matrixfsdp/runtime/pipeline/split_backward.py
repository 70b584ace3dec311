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

A weight used twice in one stage (a module called twice, or a parameter two modules of the stage
share) breaks torch's weight part, in 2.11 and in 2.13: where one use feeds the other, the weight
part of that parameter runs back through the first use's nodes and frees what the other
parameters' weight parts still need ("backward through the graph a second time", on one rank,
mid-schedule), and torch 2.11 would also count that branch twice. So each stage counts, during its
forward, the calls of the modules that hold parameters; once a parameter is reached by a second
call, that stage runs every later micro-batch's backward whole at the input part's place (the
weight part then has nothing to do): exact, the stage loses only its own split. A weight used twice
inside one module's own forward (``x @ w @ w``) is not seen by this count.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Optional

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

    def __init__(self, stage: nn.Module, index: int = -1) -> None:
        state = state_of(stage)
        if state is None:
            raise MatrixShardError("a split-backward stage must be the root of matrix_shard")
        self.state, self.index = state, index
        #: the parameter (global name) found used twice in one forward of the stage; None: none yet
        self.reused: Optional[str] = None
        self._whole: set[int] = set()  # micro-batches whose backward ran whole at the input part's place
        self._calls: dict[int, int] = {}
        self._counting = False
        self._watch(stage)

    def _watch(self, stage: nn.Module) -> None:
        """Hooks that count, inside each forward of the stage, the calls of every module holding
        trainable parameters (a recomputation in backward, outside the stage's forward, counts nothing);
        a parameter two modules of the stage share counts for both."""
        names: dict[int, str] = {}
        for name, p in stage.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                if id(p) in names:
                    self._found(names[id(p)])  # shared inside the stage: used twice if both modules run
                names.setdefault(id(p), name)
        for mname, module in stage.named_modules():
            own = [names[id(p)] for p in module.parameters(recurse=False) if id(p) in names]
            if own:
                module.register_forward_pre_hook(self._counter(id(module), own[0]))
        stage.register_forward_pre_hook(lambda *_: self._start())
        stage.register_forward_hook(lambda *_: setattr(self, "_counting", False))

    def _start(self) -> None:
        self._calls.clear()
        self._counting = True

    def _counter(self, key: int, name: str) -> Any:
        def hook(*_: Any) -> None:
            if self._counting and self.reused is None:
                self._calls[key] = self._calls.get(key, 0) + 1
                if self._calls[key] > 1:
                    self._found(name)
        return hook

    def _found(self, name: str) -> None:
        if self.reused is None:
            self.reused = name
            warnings.warn(f"pipeline stage {self.index}: parameter {name!r} is used more than once in one forward "
                          "(a module called twice, or a weight two of its modules share); torch's split backward "
                          "cannot take such a weight's gradient apart from the input's, so this stage runs each "
                          "backward whole (exact; it loses only its own zero-bubble split)", stacklevel=2)

    def input_part(self, chunk: int, full_backward: bool) -> bool:
        """Whether micro-batch ``chunk``'s backward action on this stage runs whole: a whole action
        of the schedule, or a stage with a weight used twice (then its weight part is skipped)."""
        if full_backward:
            return True
        if self.reused is not None:
            self._whole.add(chunk)
            return True
        return False

    def weight_done(self, chunk: int) -> bool:
        """Whether micro-batch ``chunk``'s weight part already ran, inside a whole backward."""
        if chunk in self._whole:
            self._whole.discard(chunk)
            return True
        return False

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
