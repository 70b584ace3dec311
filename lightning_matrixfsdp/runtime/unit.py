"""The per-unit lifecycle: materialize, reshard, refill for backward, reduce to owners.

One iteration:

1. ``pre_forward``: materialize every parameter into its unsharded buffer and
   register the unsharded parameters on the module.
2. ``post_forward``: reshard (shrink the pinned storage to zero bytes, register
   the resident parameters again) and hook the outputs for backward.
3. ``pre_backward`` (first gradient reaching an output): refill the same storage.
4. ``post_backward``: once the gradients of the unit's inputs and of all its
   trainable parameters have arrived, reduce them to their owners, add them to the
   resident ``.grad`` and release the storage.
5. the root's end-of-backward callback reduces, in unit order on every rank, any
   unit whose gradients did not all arrive (unused parameters).

How far backward has come for a unit is its :class:`TrainingState` (FSDP2's names),
which the backward hooks branch on; forward nesting is a depth counter, and whether
the whole model is in backward (a forward then is activation-checkpoint
recomputation) is the schedule's flag. Which gradients a unit reduces, and the start of
the reduction, are ``unit_grads.py``'s; the autograd plumbing (tensors in nested
arguments, the identity that reports the end of a unit's backward) is ``unit_autograd.py``'s.
"""

from __future__ import annotations

import weakref
from enum import Enum, auto
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_matrixfsdp.runtime.comm.collectives import OwnerCollective
from lightning_matrixfsdp.runtime.consensus import MATERIALIZE
from lightning_matrixfsdp.runtime.comm.grads import GradientReducer
from lightning_matrixfsdp.runtime.param import ShardedParam
from lightning_matrixfsdp.runtime.pickling import RefusePickle
from lightning_matrixfsdp.runtime.placement import UnitLayout
from lightning_matrixfsdp.runtime.replicas.sync import ReplicaSync
from lightning_matrixfsdp.runtime.schedule import Schedule
from lightning_matrixfsdp.runtime.unit_autograd import PostBackward, tensors_in, tree_map_tensors
from lightning_matrixfsdp.runtime.unit_grads import start_reduction
from lightning_matrixfsdp.runtime.unit_outside import OutsideCalls


class TrainingState(Enum):
    """How far backward has come for a unit in the current iteration."""

    IDLE = auto()  # forward, or between iterations: backward has not reached the unit
    PRE_BACKWARD = auto()  # backward reached its outputs: materialized, the next one prefetched
    POST_BACKWARD = auto()  # reduced: nothing reduces it again before the next iteration


class Unit(OutsideCalls, RefusePickle):
    """A wrapped module whose parameters are materialized and reduced together."""

    def __init__(
        self,
        module: nn.Module,
        layout: UnitLayout,
        params: list[ShardedParam],
        collective: OwnerCollective,
        reducer: GradientReducer,
        schedule: "Schedule[Unit]",
        reshard_after_forward: bool,
        zero_missing_grads: bool = False,
        index: int = 0,
        check: Optional[Callable[[int, int], None]] = None,
        replicas: Optional[ReplicaSync] = None,
    ) -> None:
        self.module = module
        self.replicas = replicas  # replica_split: the weight transfers between replicas
        self.index = index  # in the plan, the same on every rank
        # the sequence check (consensus.SequenceCheck): (operation, unit index) before communicating
        self._check = check
        self.layout = layout
        self.fqn = layout.fqn
        self.params = params
        self.collective = collective
        self.reducer = reducer
        self.schedule = schedule
        self.reshard_after_forward = reshard_after_forward
        self.zero_missing_grads = zero_missing_grads
        self.requires_gradient_sync = True
        self._depth = 0
        self._returned = False  # the post-forward hook ran for the call now returning
        self._pending_unshard: Optional[Any] = None
        self._pending_params: list[ShardedParam] = []
        self._handles: list[Any] = []
        for i, p in enumerate(params):
            if p.differentiable:  # an integer or bool parameter never gets a gradient
                self._handles.append(p.unsharded.register_post_accumulate_grad_hook(self._grad_ready_hook(i)))
                p.unsharded.requires_grad_(p.requires_grad)
        self._module_handles: list[Any] = []
        self.install_hooks(first=True)
        self._reset_iteration()

    def install_hooks(self, first: bool = False) -> None:
        """Register the unit's module hooks (``full_model`` removes them while the model is a
        plain module on one rank and puts them back here, the pre-forward hooks ahead of any
        registered meanwhile, so that materialization still comes first)."""
        if self._module_handles:
            return
        module = self.module
        self._module_handles = [
            module.register_forward_pre_hook(self._pre_forward_hook, with_kwargs=True, prepend=not first),
            module.register_forward_hook(self._post_forward_hook),
            # after the one above on every return, and alone when the forward raised
            module.register_forward_hook(self._forward_exit_hook, always_call=True),
        ]
        # its inner modules called outside its forward run as calls of the unit (unit_outside.py)
        self._module_handles += self._outside_hooks(prepend=not first)

    def remove_hooks(self) -> None:
        """Remove the unit's module hooks (local; ``install_hooks`` puts them back)."""
        for h in self._module_handles:
            h.remove()
        self._module_handles = []

    def _pickle_name(self) -> str:
        return f"the hooks of unit {self.fqn or '<root>'!r}"

    # ------------------------------------------------------------------ bookkeeping
    def _reset_iteration(self) -> None:
        self._depth = 0  # no forward is in flight between backward passes
        self._forward_calls = 0
        self._pending_input_grads = 0
        self._calls_without_grad_inputs = 0
        self._reentrant_pending = 0  # reentrant-checkpoint first passes whose recomputation is to come
        self._ready: set[int] = set()
        self.training_state = TrainingState.IDLE
        # A later backward through calls of an ended iteration (two losses of one forward, each
        # given to backward): an older generation; what it brings is reduced by ``flush``.
        self._generation = getattr(self, "_generation", 0) + 1
        self._late = False

    @property
    def trainable(self) -> list[int]:
        return [i for i, p in enumerate(self.params) if p.requires_grad]

    @property
    def in_forward(self) -> bool:
        """A forward of this unit is running (not counting recomputation in backward)."""
        return self._depth > 0

    @property
    def is_materialized(self) -> bool:
        return any(p.materialized for p in self.params)

    def missing_gradients(self) -> list[str]:
        """Trainable parameters still without a gradient in a unit whose other gradients
        arrived (backward reached it) and that has not reduced."""
        if not self._ready or self.training_state is TrainingState.POST_BACKWARD:
            return []
        return [self.params[i].shard.fqn for i in self.trainable if i not in self._ready]

    # ------------------------------------------------------------------ materialize / reshard
    def start_unshard(self) -> None:
        """Allocate the pinned buffers and issue materialization (no wait): also the prefetch."""
        if self._pending_unshard is not None:
            return
        todo = [p for p in self.params if not p.materialized]
        if not todo:
            return
        if self.replicas is not None:  # an owner's resident weights may still be arriving from the stepper
            self.replicas.wait(self.index)
        if self.schedule.announce is not None:
            self.schedule.announce(self.index)
        if self._check is not None:
            self._check(MATERIALIZE, self.index)
        for p in todo:
            p.alloc()
        # Aliases of their resident (a shard group of one rank) are whole already: nothing to move.
        for p in todo:
            if p.aliases:
                p.materialized = True
        todo = [p for p in todo if not p.aliases]
        if not todo:
            return
        # one item per piece: the whole parameter, or each expert block of a split stack
        shards, sources, outs = zip(*[t for p in todo for t in p.transfers()])
        with torch.no_grad():
            self._pending_unshard = self.collective.start_materialize(list(shards), list(sources), list(outs))
        self._pending_unshard.what = f"the materialization of unit {self.fqn or '<root>'!r}"
        self._pending_params = todo

    def wait_unshard(self) -> None:
        if self._pending_unshard is None:
            return
        pending, self._pending_unshard = self._pending_unshard, None
        with torch.no_grad():
            pending.wait()
        for p in self._pending_params:
            p.materialized = True
        self._pending_params = []

    def unshard(self) -> None:
        self.start_unshard()
        self.wait_unshard()

    def reshard(self) -> None:
        self.wait_unshard()  # a prefetch that was never used still owns the buffers
        for p in self.params:
            p.to_resident()
            p.free()

    def _register_unsharded(self) -> None:
        for p in self.params:
            p.to_unsharded()

    # ------------------------------------------------------------------ forward
    def _refuse_if_full_elsewhere(self) -> None:
        if self.schedule.full_on is not None:
            raise RuntimeError(
                f"a forward of the sharded model ran on rank {self.collective.sg.g(self.collective.sg.rank)} inside "
                f"lightning_matrixfsdp.full_model(..., rank={self.schedule.full_on}), where only rank "
                f"{self.schedule.full_on} holds the whole model (the others keep their placeholders). Run it on "
                f"that rank only (`if trainer.global_rank == {self.schedule.full_on}:`), or pass rank=None to "
                "give every rank the whole model")

    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        self._refuse_if_full_elsewhere()
        self.schedule.record_forward(self)
        if self.schedule.in_backward:  # activation-checkpoint recomputation inside backward
            # (not counted in _depth: early-stopping recomputation never runs post-forward)
            self.unshard()
            self._register_unsharded()
            if self._reentrant_pending and torch.is_grad_enabled() and self.trainable:
                # Reentrant checkpointing: this recomputation builds the graph that a backward
                # nested in the outer one runs, so it is the call whose gradients this unit
                # waits for and reduces (non-reentrant recomputation only refills saved tensors).
                self._reentrant_pending -= 1
                return self._track_call(args, kwargs)
            return None
        if self._depth == 0 and self is self.schedule.root:
            self.schedule.check_peers()  # outside a training loop's steps: are the other ranks here too?
        self._depth += 1
        self.unshard()
        self._register_unsharded()
        if torch.is_grad_enabled():
            nxt = self.schedule.next_to_forward(self)
            if nxt is not None:
                nxt.start_unshard()
        if (not torch.is_grad_enabled() and self.trainable
                and any(t.requires_grad for t in tensors_in((args, kwargs)))):
            # A forward without grad on inputs that need one: the first pass of reentrant
            # checkpointing (torch.utils.checkpoint(..., use_reentrant=True)), whose graph is
            # built when backward recomputes it.
            self._reentrant_pending += 1
        if not torch.is_grad_enabled() or not self.trainable:
            return None
        return self._track_call(args, kwargs)

    def _track_call(self, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """Count a forward whose backward this unit waits for; route the inputs that need a
        gradient through ``PostBackward``, which says when that backward is done."""
        self._forward_calls += 1
        flat = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not flat:
            self._calls_without_grad_inputs += 1
            return None
        self._pending_input_grads += 1
        gen = self._generation
        outs = iter(PostBackward.apply(lambda: self._on_input_grads(gen), *flat))
        ids = {id(t) for t in flat}
        mapping = {}

        def swap(t: torch.Tensor) -> torch.Tensor:
            if id(t) in ids and id(t) not in mapping:
                mapping[id(t)] = next(outs)
            return mapping.get(id(t), t)

        args, kwargs = tree_map_tensors(swap, (args, kwargs))
        return args, kwargs

    def _post_forward_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self._returned = True
        if self.schedule.in_backward:
            return None
        self._depth = max(0, self._depth - 1)
        outer = self._depth == 0  # a nested call of the same unit must not reshard its caller
        if not torch.is_grad_enabled():
            if outer:
                self.reshard()
            return None
        if self.reshard_after_forward and outer:
            self.reshard()
        outs = [t for t in tensors_in(output) if t.requires_grad]
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, self._pre_backward_hook, mode="any")
        return None

    def _forward_exit_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        """After every forward of the unit, also one that raised (``always_call``). A forward
        that raised ends the iteration: once the outermost unit call has raised, every unit
        goes back to its resident parameters with nothing pending, as between iterations, so
        that the model can be used again (a second ``fit``, a new optimizer over
        ``parameters()``) as a DDP model can."""
        if self._returned:
            self._returned = False
            return
        if self.schedule.in_backward:
            return  # a recomputation in backward: the backward raises on
        self._depth = max(0, self._depth - 1)
        root = self.schedule.root
        if self._depth == 0 and (root is None or root is self or root._depth == 0):
            self.schedule.abandon_forward()

    # ------------------------------------------------------------------ backward
    def _pre_backward_hook(self, *_: Any) -> None:
        self.schedule.begin_backward()
        if self._forward_calls == 0:  # only calls of an ended iteration: a later backward through them
            self._late = True
        if self.training_state is TrainingState.PRE_BACKWARD:
            return  # another output (or call) of this unit: still materialized, next one prefetched
        if self.training_state is TrainingState.IDLE:
            self.training_state = TrainingState.PRE_BACKWARD
        # POST_BACKWARD (an output that does not depend on the inputs got its gradient after
        # the reduction): materialize for that backward, and stay reduced.
        self.unshard()
        self._register_unsharded()
        nxt = self.schedule.next_to_backward(self)
        if nxt is not None:
            nxt.start_unshard()

    def _grad_ready_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        # The hook lives in the tensor's C++ hook list, which Python's garbage
        # collector cannot see through: a strong reference to the unit would keep
        # the whole model alive after the user drops it.
        unit_ref = weakref.ref(self)

        def hook(_: torch.Tensor) -> None:
            unit = unit_ref()
            if unit is not None:
                if (unit.training_state is TrainingState.POST_BACKWARD and unit.zero_missing_grads
                        and unit.schedule.in_backward):
                    raise RuntimeError(
                        f"a gradient of {unit.params[index].shard.fqn!r} arrived after its unit reduced "
                        "(is the parameter read directly by code outside its unit, e.g. another module's forward "
                        "using this weight, rather than through a call of its own module?); zero_missing_grads reduces "
                        "a unit as soon as the gradients of its inputs are done and cannot take later ones")
                # A backward inside the unit's forward (manual_backward in a training step, the
                # root's forward) reached no hooked output: the end-of-backward flush is queued here.
                unit.schedule.begin_backward()
                unit._ready.add(index)
                if unit._forward_calls == 0:
                    unit._late = True
                unit._maybe_post_backward()

        return hook

    def _on_input_grads(self, generation: int) -> None:
        if generation != self._generation:  # a call of an ended iteration: reduced by the flush
            self._late = True
            return
        self._pending_input_grads -= 1
        self._maybe_post_backward()

    def _maybe_post_backward(self) -> None:
        if (self.training_state is TrainingState.POST_BACKWARD or self._pending_input_grads > 0
                or self._forward_calls == 0 or self.schedule.partial_backward):
            return  # (a part of a split backward: the pipeline reduces after the weight part)
        if self.zero_missing_grads:
            # Reduce when this unit's backward is done, whatever parameters got gradients
            # here (other ranks may have used others); without a backward trigger (no input
            # needs a gradient) the end-of-backward flush does it, in unit order everywhere.
            if self._calls_without_grad_inputs == 0:
                self.post_backward()
            return
        if any(i not in self._ready for i in self.trainable):
            return
        if self._calls_without_grad_inputs and any(not p.requires_grad for p in self.params):
            return  # frozen weights may still be needed; the end-of-backward flush reduces us
        self.post_backward()

    # ------------------------------------------------------------------ end of backward (called by the root)
    def flush(self) -> None:
        """Reduce now if this unit ran forward but its backward did not reduce it (unused
        parameters, inputs without gradients), or if this backward went through calls of an
        iteration an earlier backward ended (two losses of one forward, each given to backward:
        each backward's gradients are reduced, as Lightning's DDP and FSDP2 do); the root calls it
        on every unit in order."""
        if (self._forward_calls > 0 or self._late) and self.training_state is not TrainingState.POST_BACKWARD:
            self.post_backward(flush=True)

    def end_iteration(self) -> None:
        """Release what is still materialized or in flight and start the next iteration afresh."""
        if self.is_materialized or self._pending_unshard is not None:
            self.reshard()
        self._reset_iteration()

    def post_backward(self, flush: bool = False) -> None:
        """Reduce this unit's gradients to their owners, then release the buffers."""
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        if self.requires_gradient_sync:
            self._reduce(flush)
        self.reshard()

    def reduce_unsynced(self, indices: list[int]) -> None:
        """Reduce what backwards with the reduction off left on the unsharded parameters
        ``indices`` and this synced backward did not reduce (frozen in it, e.g. by
        ``toggle_optimizer``, or not reached): DDP's first synced backward after ``no_sync``
        reduces every accumulated gradient. The root agreed on ``indices`` (zeros stand in)."""
        self._reduce(False, indices, agreed=True)

    def _reduce(self, flush: bool, indices: Optional[list[int]] = None, agreed: bool = False) -> None:
        idx = self.trainable if indices is None else indices
        if not idx:
            return
        params = [self.params[i] for i in idx]
        pending, used = start_reduction(params, self.reducer, self.index, self.fqn or "<root>", flush,
                                        self.zero_missing_grads or agreed, self._check)

        @torch.no_grad()
        def finish() -> None:
            for p, g in zip(params, pending.wait()):
                if g is not None:
                    p.accumulate_grad(g)
            if self.replicas is not None:  # the steppers may now update these: send them after the step
                self.replicas.mark_reduced(self.index, [p.shard.fqn for p, k in zip(params, used) if k])

        # In flight while backward goes on; finished before the next unit's reduction
        # starts, or at the end of backward.
        self.schedule.defer_reduce(finish)
