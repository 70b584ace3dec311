"""Modules of a unit called outside the unit's forward: each such call is a call of the unit.

Lightning's GAN example calls ``self.generator(z)`` and ``self.discriminator(x)`` straight from
``training_step``, with ``manual_backward`` in between, and the networks hold layers (an input
``nn.Linear``) that belong to no block, so to the root unit. A unit's own forward hooks never
see such a call when it comes after a backward that reduced the unit (the root's forward, the
training step, is still running), or after the unit's forward returned, or when the unit's
module is never called at all. Between those, non-owners hold empty placeholders.

So every module inside a unit that holds some of its parameters (directly or below it, down to
the next nested unit) carries a forward pre-hook, and a call of it *outside the unit's forward*,
that is, while the unit is not both running forward and materialized, is run as a call of the
unit itself, through the unit's own forward hooks: it materializes the unit (a collective, as
any unit's forward: every rank makes the same calls, as under DDP), counts as one of its forward
calls (its inputs through the identity whose backward says the call's backward is done, its
outputs hooked to refill the storage in backward), and reshards by the unit's rule when it
returns (the root is kept until its backward reduces it, as after its own forward). Backward,
the reduction to owners, activation-checkpoint recomputation and the end-of-backward flush
then treat it like any other call of the unit. Calls nested in it, or made inside the unit's
own forward, do nothing more. A call outside every forward of the model first meets the other
ranks (the lone-forward check) and does the root's forward pre-work, as a forward of the root.

Inside the root's forward a backward can start (``manual_backward`` in a training step) before
any output of the root is hooked: the outputs of the outermost call of the root's modules are
hooked too, so that such a backward materializes again what an earlier one resharded.

The hooks that end such a call are registered for that call alone (the common call, inside the
unit's forward, runs one pre-hook and nothing else).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_matrixfsdp.runtime.unit_autograd import tensors_in

ACTED, WATCHED = "acted", "watched"


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


class _Call:
    """One call of an inner module that acted (ran as a call of the unit) or is watched."""

    def __init__(self, kind: str, sub: nn.Module) -> None:
        self.kind, self.sub = kind, sub
        self.nested = 0  # calls of the same module inside it (a module calling itself)
        self.returned = False
        self.handles: list[Any] = []


class OutsideCalls:
    """Mixin of ``Unit``: the hooks on its inner modules (the module docstring). It uses the
    unit's forward and backward hooks (``_pre_forward_hook``, ``_post_forward_hook``,
    ``_forward_exit_hook``, ``_pre_backward_hook``), its ``params``, ``schedule``, ``module``,
    ``in_forward``, ``is_materialized`` and the reentrant-checkpoint count."""

    def _outside_hooks(self, prepend: bool) -> list[Any]:
        """Register the pre-hooks on the inner modules; their handles."""
        self._outside_calls: list[_Call] = getattr(self, "_outside_calls", [])
        self._stale_hooks: list[Any] = getattr(self, "_stale_hooks", [])
        regs = [r for p in self.params for r in p.registrations]
        return [sub.register_forward_pre_hook(self._outside_pre_hook, with_kwargs=True, prepend=prepend)
                for sub in outside_modules(self.module, regs)]

    def _acts_outside(self) -> bool:
        if self.schedule.in_backward:  # recomputation: refill if resharded; a reentrant pass to count
            return not self.is_materialized or self._reentrant_pending > 0
        return not (self.in_forward and self.is_materialized)

    def _outside_pre_hook(self, sub: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        while self._stale_hooks:  # left by a call that raised (not removable while torch iterated them)
            self._stale_hooks.pop().remove()
        if self._outside_calls:  # inside a call that acted or is watched: nothing more
            if self._outside_calls[-1].sub is sub:
                self._outside_calls[-1].nested += 1
            return None
        if self._acts_outside():
            root = self.schedule.root
            if root is None or not root.in_forward:  # outside every forward of the model: as the root's
                if root is not self:  # (the root's own check runs in its forward hook)
                    self.schedule.check_peers()  # outside the loop's steps: are the other ranks here too?
                if self.schedule.before_forward is not None:
                    self.schedule.before_forward()
            self._begin_call(ACTED, sub)
            return self._pre_forward_hook(sub, args, kwargs)
        if self is self.schedule.root and not self.schedule.in_backward and torch.is_grad_enabled():
            self._begin_call(WATCHED, sub)
        return None

    def _begin_call(self, kind: str, sub: nn.Module) -> None:
        call = _Call(kind, sub)
        self._outside_calls.append(call)
        call.handles = [sub.register_forward_hook(self._outside_post_hook),
                        sub.register_forward_hook(self._outside_exit_hook, always_call=True)]

    def _outside_post_hook(self, sub: nn.Module, args: tuple, output: Any) -> Any:
        call = self._outside_calls[-1]
        if call.nested:
            return None
        call.returned = True
        if call.kind == ACTED:
            return self._post_forward_hook(sub, args, output)
        # WATCHED: a backward inside the root's forward (manual_backward in a training step)
        # starts here, not at the root's outputs: it refills what an earlier one resharded (a
        # second backward through the same forward, retain_graph=True) and is seen as begun.
        outs = [t for t in tensors_in(output) if t.requires_grad]
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, self._pre_backward_hook, mode="any")
        return None

    def _outside_exit_hook(self, sub: nn.Module, args: tuple, output: Any) -> None:
        call = self._outside_calls[-1]
        if call.nested:
            call.nested -= 1
            return
        self._outside_calls.pop()
        if call.returned:  # torch runs the hooks from a copy of its list: removable now
            for h in call.handles:
                h.remove()
        else:  # the forward raised: torch is iterating the hooks; the next call removes them
            self._stale_hooks += call.handles
        if call.kind == ACTED:
            self._forward_exit_hook(sub, args, output)
