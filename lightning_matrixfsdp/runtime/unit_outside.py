"""Modules of a unit called outside the unit's forward: each such call is a call of the unit.

Lightning's GAN example calls ``self.generator(z)`` and ``self.discriminator(x)`` straight from
``training_step``, with ``manual_backward`` in between, and the networks hold layers (an input
``nn.Linear``) that belong to no block, so to the root unit. A unit's own forward hooks never
see such a call when it comes after a backward that reduced the unit (the root's forward, the
training step, is still running), or after the unit's forward returned, or when the unit's
module is never called at all. Between those, non-owners hold empty placeholders.

So every module inside a unit that holds some of its parameters (directly or below it, down to
the next nested unit) carries three hooks, and a call of it *outside the unit's forward*, that
is, while the unit is not both running forward and materialized, is run as a call of the unit
itself, through the unit's own forward hooks: it materializes the unit (a collective, as any
unit's forward: every rank makes the same calls, as under DDP), counts as one of its forward
calls (its inputs through the identity whose backward says the call's backward is done, its
outputs hooked to refill the storage in backward), and reshards by the unit's rule when it
returns (the root is kept until its backward reduces it, as after its own forward). Backward,
the reduction to owners, activation-checkpoint recomputation and the end-of-backward flush
then treat it like any other call of the unit. Calls nested in it, or made inside the unit's
own forward, do nothing more. A call outside the training loop's steps first meets the other
ranks (the lone-forward check), as a forward of the root does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_matrixfsdp.runtime.unit_autograd import tensors_in

# what one call of an inner module did: nothing (inside the unit's forward), ran as a call of
# the unit, or (the outermost inner call inside the root's forward) watches its outputs
_INSIDE, _ACTED, _WATCHED = 0, 1, 2


def outside_modules(unit_module: nn.Module, registrations: list[tuple[nn.Module, str]]) -> list[nn.Module]:
    """The modules below ``unit_module`` whose subtree registers one of ``registrations``: each
    registering module and its ancestors up to (not including) the unit's module, outermost
    first. None of them is inside a nested unit (a parameter belongs to the innermost unit)."""
    names = {id(m): n for n, m in unit_module.named_modules()}
    by_name = dict(unit_module.named_modules())
    picked: dict[str, nn.Module] = {}
    for sub, _ in registrations:
        name = names.get(id(sub))
        if name is None or sub is unit_module:
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            picked.setdefault(prefix, by_name[prefix])
    return [picked[n] for n in sorted(picked, key=lambda n: (n.count("."), n))]


class OutsideCalls:
    """Mixin of ``Unit``: the hooks on its inner modules (the module docstring). It uses the
    unit's forward hooks (``_pre_forward_hook``, ``_post_forward_hook``, ``_forward_exit_hook``),
    its ``params``, ``schedule``, ``module``, ``in_forward``, ``is_materialized`` and the
    reentrant-checkpoint count."""

    def _outside_hooks(self, prepend: bool) -> list[Any]:
        """Register the hooks on the inner modules; their handles."""
        self._outside_acting: list[int] = getattr(self, "_outside_acting", [])
        regs = [r for p in self.params for r in p.registrations]
        handles = []
        for sub in outside_modules(self.module, regs):
            handles += [
                sub.register_forward_pre_hook(self._outside_pre_hook, with_kwargs=True, prepend=prepend),
                sub.register_forward_hook(self._outside_post_hook),
                sub.register_forward_hook(self._outside_exit_hook, always_call=True),
            ]
        return handles

    def _acts_outside(self) -> bool:
        if self.schedule.in_backward:  # recomputation: refill if resharded; a reentrant pass to count
            return not self.is_materialized or self._reentrant_pending > 0
        return not (self.in_forward and self.is_materialized)

    def _outside_pre_hook(self, sub: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        outermost = not self._outside_acting
        self._outside_acting.append(_INSIDE)  # first: the exit hook pops it even if this raises
        if not self._acts_outside():
            if outermost and self is self.schedule.root and not self.schedule.in_backward:
                self._outside_acting[-1] = _WATCHED
            return None
        root = self.schedule.root
        if root is None or not root.in_forward:  # outside every forward of the model: as the root's
            if root is not self:  # (the root's own check runs in its forward hook)
                self.schedule.check_peers()  # outside the loop's steps: are the other ranks here too?
            if self.schedule.before_forward is not None:
                self.schedule.before_forward()
        self._outside_acting[-1] = _ACTED
        return self._pre_forward_hook(sub, args, kwargs)

    def _outside_post_hook(self, sub: nn.Module, args: tuple, output: Any) -> Any:
        kind = self._outside_acting[-1] if self._outside_acting else _INSIDE
        if kind == _ACTED:
            return self._post_forward_hook(sub, args, output)
        if kind == _WATCHED and torch.is_grad_enabled():
            # A backward inside the root's forward (manual_backward in a training step) starts
            # here, not at the root's outputs: refill what it resharded (a second backward
            # through the same forward, retain_graph=True) and mark the backward as begun.
            outs = [t for t in tensors_in(output) if t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(outs, self._pre_backward_hook, mode="any")
        return None

    def _outside_exit_hook(self, sub: nn.Module, args: tuple, output: Any) -> None:
        kind = self._outside_acting.pop() if self._outside_acting else _INSIDE
        if kind == _ACTED:
            self._forward_exit_hook(sub, args, output)
