"""``model.state_dict()`` of a sharded model: whole tensors, or an error that says what to use.

Between steps a rank holds only what it owns: the whole tensor of its roles, an empty
placeholder ``(0, *shape[1:])`` of every other (and, with tensor parallelism, its TP
fragment of a split matrix). A plain ``state_dict()`` of that looks whole but is not:
``if trainer.is_global_zero: torch.save(model.state_dict(), path)`` would write a file
missing every weight rank 0 does not own. Whole tensors need the owners, and
``state_dict()`` is often called on one rank alone, where a collective would hang; so a
sharded root's ``state_dict`` pre-hook refuses the call wherever some tensor is not whole
on this rank, on every rank alike (the verdict reads only the plan: the shard-group size
and the TP split), and names what gives whole weights instead.

It passes, unchanged:

* where every rank holds every tensor whole (one rank per shard group, no TP split);
* inside ``full_model`` on the rank that holds the whole model (the hook is off there);
* inside ``local_state_dict``: this rank's own tensors and placeholders, on purpose (the
  checkpoint code's key index reads them so; a sharded copy's ``state_dict`` never meets
  the hook, it has no runtime state).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

from lightning_matrixfsdp.runtime.tags import state_of

__all__ = ["PartialStateDictError", "local_state_dict", "local_views", "refuse_partial_state_dict"]

_LOCAL = threading.local()  # per thread: a background checkpoint thread does not open the main one's door


class PartialStateDictError(RuntimeError):
    """``state_dict()`` of a sharded model where this rank holds only part of it."""


@contextmanager
def local_views() -> Iterator[None]:
    """Inside, ``state_dict()`` of a sharded model gives this rank's tensors and placeholders."""
    depth = getattr(_LOCAL, "depth", 0)
    _LOCAL.depth = depth + 1
    try:
        yield
    finally:
        _LOCAL.depth = depth


def local_state_dict(module: nn.Module, keep_vars: bool = False) -> dict[str, Any]:
    """``module.state_dict()`` as this rank holds it: the whole tensor of what it owns, an empty
    placeholder ``(0, *shape[1:])`` elsewhere (with tensor parallelism, this TP rank's fragment).
    Local (no communication). For whole weights use ``full_model`` or a checkpoint."""
    with local_views():
        return module.state_dict(keep_vars=keep_vars)


def _split_count(st: Any) -> int:
    plan = getattr(st, "tp_plan", None)
    return sum(1 for lay in plan.layouts.values() if lay.split) if plan is not None else 0


def refuse_partial_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """The ``state_dict`` pre-hook of a sharded root (a plain function: a copy that inherits it
    has no state and passes)."""
    st = state_of(module)
    if st is None or getattr(_LOCAL, "depth", 0) or not st.params:
        return
    split = _split_count(st)
    if st.sg.size == 1 and not split:  # every tensor whole on every rank: the dict is whole
        return
    missing = [(sp.shard.fqn, tuple(sp.resident.shape)) for sp in st.params if not sp.owned]
    here = (f"this rank (shard rank {st.sg.rank} of {st.sg.size}) holds {len(st.params) - len(missing)} of "
            f"{len(st.params)} parameters whole")
    if missing:
        name, shape = missing[0]
        here += f"; the others are empty placeholders, e.g. {prefix}{name} of shape {shape}"
    if split:
        here += f"; {split} tensor-parallel matrices are this rank's fragments"
    where = ""
    if getattr(st.schedule, "full_on", None) is not None:
        where = f" (full_model holds the whole model on rank {st.schedule.full_on}, not here)"
    raise PartialStateDictError(
        f"state_dict() of a matrix_fsdp-sharded model{where} would be partial: {here}, so a file saved from it "
        "would miss weights. Instead, on every rank: `with lightning_matrixfsdp.full_model(model): if "
        "trainer.is_global_zero: torch.save(model.state_dict(), path)` (whole weights on rank 0); or "
        "`trainer.save_checkpoint(path)` with MatrixFSDPStrategy(save_distributed_checkpoint=False) (one file) "
        "or the default directory format, `lightning_matrixfsdp.save_sharded(model, path)` outside the Trainer, "
        "then `python -m lightning_matrixfsdp.consolidate` for one file. For this rank's own tensors and "
        "placeholders on purpose: lightning_matrixfsdp.local_state_dict(model).")
