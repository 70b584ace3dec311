"""How a unit meets autograd: the tensors inside a forward's arguments and outputs, and the
identity on a unit's inputs whose backward says that the unit's backward is done."""

from __future__ import annotations

from typing import Any, Callable

import torch


# A local map rather than ``torch.utils._pytree``: that module is private to PyTorch, and
# this one also walks subclasses of list, tuple and dict (custom batch containers) without
# registration.
def tree_map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor inside (lists, tuples, namedtuples, dicts) replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(tree_map_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map_tensors(fn, o) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, tree_map_tensors(fn, v)) for k, v in obj.items())
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj``, in order."""
    out: list[torch.Tensor] = []
    tree_map_tensors(lambda t: out.append(t) or t, obj)
    return out


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward calls ``done()`` (the unit's backward is done)."""

    @staticmethod
    def forward(ctx, done: Callable[[], None], *inputs: torch.Tensor):  # type: ignore[override]
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.done()
        return (None, *grads)
